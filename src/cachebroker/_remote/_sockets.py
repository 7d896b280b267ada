"""Unix-socket streams that a cancelled receive leaves nothing behind in.

On asyncio, anyio's Unix-socket streams wait for a socket with
``loop.add_reader(sock, future.set_result, None)`` and remove that reader
from the future's done-callback, one loop turn later. A receive cancelled in
the turn its socket becomes readable (a broker closing while the daemon
answers, a daemon stopping while a process registers) leaves the reader to
run on the cancelled future: asyncio reports ``InvalidStateError`` "in
callback", in the application's log, and anyio's pytest plugin fails the
test that ran it. So on asyncio (uvloop included) the broker's connections
go through a transport, as anyio's own TCP streams do: data the loop reads
is queued by a protocol, and a receive waits on an event, which a
cancellation leaves as it was. On trio anyio's streams are used as they
are.
"""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from typing import cast

import anyio
import anyio.abc

from .._shell._backend import running_backend

__all__ = ["connect", "listen"]


async def connect(path: str) -> anyio.abc.SocketStream:
    """A stream connected to the Unix socket at ``path``."""
    if running_backend() != "asyncio":
        return await anyio.connect_unix(path)
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.create_unix_connection(_Protocol, path)
    return _TransportStream(transport, protocol)


async def listen(path: str) -> anyio.abc.SocketListener:
    """A listener at ``path``, readable and writable by its owner only."""
    listener = await anyio.create_unix_listener(path, mode=0o600)
    return listener if running_backend() != "asyncio" else _Listener(listener)


class _Listener(anyio.abc.SocketListener):
    """anyio's Unix-socket listener, with an ``accept()`` that leaves nothing behind.

    anyio's ``accept()`` on asyncio has the same race as its receive: a
    connection arriving in the turn the accept is cancelled wakes the
    cancelled future. Here the wake looks first, and the connection, once
    accepted, goes through a transport.
    """

    def __init__(self, listener: anyio.abc.SocketListener) -> None:
        self._listener = listener

    @property
    def _raw_socket(self) -> socket.socket:
        return self._listener.extra(anyio.abc.SocketAttribute.raw_socket)

    async def accept(self) -> anyio.abc.SocketStream:
        raw = self._raw_socket
        loop = asyncio.get_running_loop()
        await anyio.lowlevel.checkpoint()
        while True:
            try:
                sock, _address = raw.accept()
            except BlockingIOError:
                waiter = loop.create_future()
                loop.add_reader(raw, _wake, waiter)
                try:
                    await waiter
                finally:
                    loop.remove_reader(raw)
            else:
                break
        try:
            sock.setblocking(False)
            with anyio.CancelScope(shield=True):  # (accepted, it is not dropped: one turn)
                transport, protocol = await loop.connect_accepted_socket(_Protocol, sock)
        except BaseException:
            sock.close()
            raise
        return _TransportStream(transport, protocol)

    async def aclose(self) -> None:
        await self._listener.aclose()


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():  # (cancelled in this very turn of the loop)
        waiter.set_result(None)


class _Protocol(asyncio.Protocol):
    """What the loop reads, queued until a receive takes it; when writing may go on."""

    def __init__(self) -> None:
        self.chunks: deque[bytes] = deque()
        self.readable = asyncio.Event()  # set: a chunk, the end, or a failure to report
        self.writable = asyncio.Event()
        self.writable.set()
        self.ended = False
        self.error: Exception | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)
        transport.pause_reading()  # (reading resumes while a receive waits)
        transport.set_write_buffer_limits(0)  # (a send returns once its bytes are out)

    def data_received(self, data: bytes) -> None:
        self.chunks.append(bytes(data))
        self.readable.set()

    def eof_received(self) -> bool:
        self.ended = True
        self.readable.set()
        return True  # (the transport stays open for sending)

    def connection_lost(self, exc: Exception | None) -> None:
        self.ended = True
        self.error = exc
        self.readable.set()
        self.writable.set()

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()


class _TransportStream(anyio.abc.SocketStream):
    """An ``anyio.abc.SocketStream`` over an asyncio transport and its ``_Protocol``."""

    def __init__(self, transport: asyncio.Transport, protocol: _Protocol) -> None:
        self._transport = transport
        self._protocol = protocol
        self._closed = False
        self._receiving = False
        self._sending = False

    @property
    def _raw_socket(self) -> socket.socket:
        return cast(socket.socket, self._transport.get_extra_info("socket"))

    async def receive(self, max_bytes: int = 65536) -> bytes:
        if max_bytes < 1:
            raise ValueError("max_bytes must be a positive integer")
        if self._receiving:
            raise anyio.BusyResourceError("reading from")
        self._receiving = True
        try:
            protocol = self._protocol
            if protocol.chunks or protocol.ended or self._closed:
                await anyio.lowlevel.checkpoint()
            else:
                self._transport.resume_reading()
                try:
                    await protocol.readable.wait()
                finally:
                    if not self._transport.is_closing():
                        self._transport.pause_reading()
            if self._closed:
                raise anyio.ClosedResourceError
            if not protocol.chunks:
                if protocol.error is not None:
                    raise anyio.BrokenResourceError from protocol.error
                raise anyio.EndOfStream
            chunk = protocol.chunks.popleft()
            if len(chunk) > max_bytes:
                chunk, rest = chunk[:max_bytes], chunk[max_bytes:]
                protocol.chunks.appendleft(rest)
            if not protocol.chunks and not protocol.ended:
                protocol.readable.clear()
            return chunk
        finally:
            self._receiving = False

    async def send(self, item: bytes) -> None:
        if self._sending:
            raise anyio.BusyResourceError("writing to")
        self._sending = True
        try:
            await anyio.lowlevel.checkpoint_if_cancelled()
            protocol = self._protocol
            if not protocol.writable.is_set():
                await protocol.writable.wait()
            self._check_open()
            self._transport.write(item)
            if protocol.writable.is_set():
                await anyio.lowlevel.cancel_shielded_checkpoint()
            else:
                await protocol.writable.wait()  # (until the loop has written it out)
                self._check_open()
        finally:
            self._sending = False

    def _check_open(self) -> None:
        if self._closed:
            raise anyio.ClosedResourceError
        if self._transport.is_closing():
            if self._protocol.error is not None:
                raise anyio.BrokenResourceError from self._protocol.error
            raise anyio.BrokenResourceError

    async def send_eof(self) -> None:
        if self._transport.can_write_eof() and not self._transport.is_closing():
            self._transport.write_eof()
        await anyio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._transport.abort()  # (wakes a waiting receive or send: connection_lost)
        await anyio.lowlevel.checkpoint()
