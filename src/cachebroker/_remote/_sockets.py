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
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import anyio
import anyio.abc
import anyio.lowlevel
from anyio.streams.buffered import BufferedByteReceiveStream

from .._shell._backend import running_backend

__all__ = ["READ_AHEAD", "FrameTooLarge", "Frames", "Outlet", "connect", "listen"]

#: How many bytes the loop reads from a connection ahead of its receives (asyncio).
READ_AHEAD = 256 << 10

#: A frame's length, before its body.
_LENGTH = struct.Struct(">I")


class FrameTooLarge(Exception):
    """A frame longer than the receiver's limit (``length``: what it said)."""

    def __init__(self, length: int) -> None:
        super().__init__(length)
        self.length = length


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
    """What the loop reads, kept until a receive takes it; when writing may go on.

    The loop reads ahead of the receives up to ``READ_AHEAD`` bytes, then
    pauses until a receive wants more: a peer that sends faster than its
    messages are handled waits in its socket, not in this process's memory.
    """

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.readable = asyncio.Event()  # set: bytes, the end, or a failure to report
        self.writable = asyncio.Event()
        self.writable.set()
        self.ended = False
        self.error: Exception | None = None
        self.transport: asyncio.Transport | None = None
        self.paused = False
        #: Called once the transport's buffer is empty again, and once the connection is lost.
        self.on_written: Callable[[], None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.transport.set_write_buffer_limits(0)  # (written out, or the writer waits)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self.readable.set()
        if len(self.buffer) >= READ_AHEAD and not self.paused:
            assert self.transport is not None
            self.transport.pause_reading()
            self.paused = True

    def want(self) -> None:
        """A receive waits for more than the buffer holds: read on."""
        self.readable.clear()
        if self.paused and self.transport is not None and not self.transport.is_closing():
            self.paused = False
            self.transport.resume_reading()

    def eof_received(self) -> bool:
        self.ended = True
        self.readable.set()
        return True  # (the transport stays open for sending)

    def connection_lost(self, exc: Exception | None) -> None:
        self.ended = True
        self.error = exc
        self.readable.set()
        self.writable.set()
        if self.on_written is not None:
            self.on_written()

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()
        if self.on_written is not None:
            self.on_written()


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
        protocol = self._protocol
        await self._fill(1, checkpoint=True)
        buffer = protocol.buffer
        chunk = bytes(buffer[:max_bytes])
        del buffer[:max_bytes]
        return chunk

    async def receive_frame(self, limit: int) -> bytes:
        """The next frame's body (after its 4-byte big-endian length), taken from the
        transport's buffer; ``FrameTooLarge`` for one longer than ``limit`` bytes.

        A frame that has arrived already is returned after one checkpoint, as
        any receive, so that what the frame before it woke runs first; the loop
        reads at most ``READ_AHEAD`` bytes ahead of the frames taken.
        """
        buffer = self._protocol.buffer
        if len(buffer) < _LENGTH.size:
            await self._fill(_LENGTH.size)
        (length,) = _LENGTH.unpack_from(buffer)
        if length > limit:
            raise FrameTooLarge(length)
        end = _LENGTH.size + length
        if len(buffer) < end:
            await self._fill(end)
        else:
            await anyio.lowlevel.checkpoint()
        body = bytes(buffer[_LENGTH.size : end])
        del buffer[:end]
        return body

    async def _fill(self, size: int, *, checkpoint: bool = False) -> None:
        """Wait until the buffer holds ``size`` bytes; ``EndOfStream`` (or
        ``IncompleteRead`` for a part of a frame) if the peer ended first."""
        if self._receiving:
            raise anyio.BusyResourceError("reading from")
        self._receiving = True
        try:
            protocol = self._protocol
            buffer = protocol.buffer
            if checkpoint and len(buffer) >= size:
                await anyio.lowlevel.checkpoint()
            while len(buffer) < size and not protocol.ended and not self._closed:
                protocol.want()
                await protocol.readable.wait()
            if self._closed:
                raise anyio.ClosedResourceError
            if len(buffer) < size:
                if protocol.error is not None:
                    raise anyio.BrokenResourceError from protocol.error
                if buffer:
                    raise anyio.IncompleteRead
                raise anyio.EndOfStream
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


class Frames:
    """The frames (a 4-byte big-endian length, then that many bytes) a stream receives.

    From one of this module's streams (asyncio) each frame is cut from the
    transport's buffer (``_TransportStream.receive_frame``); from any other
    stream (trio's), through anyio's buffered stream.
    """

    __slots__ = ("_buffered", "_stream")

    def __init__(self, stream: anyio.abc.ByteReceiveStream) -> None:
        self._stream = stream if isinstance(stream, _TransportStream) else None
        self._buffered = None if self._stream is not None else BufferedByteReceiveStream(stream)

    async def receive(self, limit: int) -> bytes:
        """The next frame's body; ``FrameTooLarge`` if it is longer than ``limit`` bytes."""
        if self._stream is not None:
            return await self._stream.receive_frame(limit)
        assert self._buffered is not None
        (length,) = _LENGTH.unpack(await self._buffered.receive_exactly(_LENGTH.size))
        if length > limit:
            raise FrameTooLarge(length)
        return await self._buffered.receive_exactly(length)


class Outlet:
    """Sends what its owner has for the peer: one write per batch.

    ``soon()`` asks for a write of what ``batch()`` returns (each message
    encoded by ``encode``, all in one write), so that what one step decides
    leaves together. Into one of this module's streams (asyncio) the write
    goes straight into the transport, where nothing waits: at the end of the
    step that asked (``at_step_end``: ``Runner.at_step_end``), or else from
    the writer task (``run``) in the loop's next turn; ``unsent`` then counts
    the messages written and not yet out of this process (the peer does not
    read). Into any other stream (trio's) the writer sends each batch. Only
    a live writer's outlet writes: once the writer is cancelled (the
    connection ends, its broker stops) nothing more leaves. ``written()``
    waits for a write to end.
    """

    __slots__ = (
        "_asked",
        "_at_step_end",
        "_batch",
        "_encode",
        "_failure",
        "_idle",
        "_stream",
        "_transport",
        "_wake",
        "_watched",
        "_writer",
        "_written",
        "open",
        "unsent",
    )

    def __init__(
        self,
        stream: anyio.abc.ByteSendStream,
        batch: Callable[[], Sequence[Mapping[str, Any]]],
        encode: Callable[[Mapping[str, Any]], bytes],
        at_step_end: Callable[[Callable[[], None]], bool] | None = None,
    ) -> None:
        self._stream = stream
        self._batch = batch
        self._encode = encode
        self._transport = stream if isinstance(stream, _TransportStream) else None
        self._at_step_end = at_step_end if self._transport is not None else None
        #: The writer's task, while it runs (asyncio).
        self._writer: asyncio.Task[Any] | None = None
        #: Whether the writer waits to be woken (not mid-turn, where a cancellation waits).
        self._idle = False
        self._asked = False
        #: What failed a write in ``flush``: the writer raises it.
        self._failure: Exception | None = None
        self._wake = anyio.Event()
        self._written = anyio.Event()
        self._watched = False
        #: Messages handed to the stream and not written out of this process yet.
        self.unsent = 0
        #: False once nothing more can be written (the connection is over).
        self.open = True
        if self._transport is not None:
            self._transport._protocol.on_written = self._out

    def soon(self) -> None:
        """Have what ``batch()`` returns written at the end of this step, or soon after."""
        if self._asked or not self.open:
            return
        self._asked = True
        if self._at_step_end is None or not self._at_step_end(self.flush):
            self._wake.set()

    def flush(self) -> None:
        """Write what ``soon()`` asked for into the transport now, or have the writer
        do it (or end on what ended the connection): never awaits, never raises."""
        writer = self._writer
        stream = self._transport
        if not self._asked:
            return
        if (
            writer is None
            or not self._idle
            or writer.cancelling()
            or self._failure is not None
            or stream is None
            or stream._closed
            or stream._transport.is_closing()
        ):
            self._wake.set()
            return
        try:
            self._write(stream)
        except Exception as exc:
            self._failure = exc
            self._wake.set()

    def _write(self, stream: _TransportStream) -> None:
        """Write the next batch into ``stream``'s transport (nothing waits there)."""
        self._asked = False
        messages = self._batch()
        if messages:
            stream._check_open()
            stream._transport.write(b"".join(map(self._encode, messages)))
            if not stream._protocol.writable.is_set():
                self.unsent += len(messages)  # (out once the transport's buffer is)
        self._notify()

    async def written(self) -> None:
        """Wait for the next write to end (or for the connection's end)."""
        self._watched = True
        await self._written.wait()

    async def drain(self) -> None:
        """Wait until everything asked for is written out, or nothing more can be."""
        while self.open and (self._asked or self.unsent):
            await self.written()

    async def run(self) -> None:
        """The writer, until the connection ends (or this task is cancelled): raises
        what failed a write (``anyio.BrokenResourceError`` and the like)."""
        stream = self._transport
        if stream is not None:
            self._writer = asyncio.current_task()
        try:
            while True:
                self._idle = True
                try:
                    await self._wake.wait()
                finally:
                    self._idle = False
                self._wake = anyio.Event()
                if stream is not None:
                    if self._failure is not None:
                        raise self._failure
                    self._write(stream)
                    # One turn of the loop before the writer waits again, as a send
                    # takes: the loop reads what was written to a peer in this same
                    # loop (a daemon in it) before every task here waits.
                    await anyio.lowlevel.cancel_shielded_checkpoint()
                    continue
                self._asked = False
                messages = self._batch()
                if messages:
                    data = b"".join(map(self._encode, messages))
                    self.unsent = len(messages)
                    try:
                        await self._stream.send(data)
                    finally:
                        self.unsent = 0
                self._notify()  # (nothing to write: a ``drain`` is over)
        finally:
            self._writer = None
            self.open = False
            self._notify()

    def _out(self) -> None:
        """The transport wrote out its buffer, or the connection is over."""
        self.unsent = 0
        self._notify()

    def _notify(self) -> None:
        if self._watched:
            self._watched = False
            self._written.set()
            self._written = anyio.Event()
