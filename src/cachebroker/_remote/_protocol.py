"""The wire between ``cachebroker serve`` and the processes that connect to it.

A frame is a 4-byte big-endian length and that many bytes of UTF-8 JSON: one
object with an ``"op"``. The message set is small and documented in
``docs/processes.md``; ``VERSION`` is checked in the first exchange
(``hello`` / ``welcome``), so a client and a daemon of different protocol
versions refuse each other with a clear error instead of misreading.

JSON from the standard library: a typical message encodes and decodes in
about 5 µs, under a tenth of a round trip over the socket (about 70 µs), and
the protocol needs no dependency.
"""

from __future__ import annotations

import json
import os
import socket
import struct
from collections.abc import Mapping
from typing import Any

import anyio.abc
from anyio.abc import ByteSendStream
from anyio.streams.buffered import BufferedByteReceiveStream

from .. import _errors
from .._errors import BrokerError

__all__ = [
    "MAX_FRAME",
    "VERSION",
    "ProtocolError",
    "decode_error",
    "default_address",
    "encode",
    "encode_error",
    "greet",
    "peer",
    "receive",
    "resolve_address",
    "send",
]

#: The protocol version: a daemon and a client must agree on it.
VERSION = 2

#: The largest frame either side accepts (a ``ps`` reply of thousands of entries fits).
MAX_FRAME = 16 << 20

_HEADER = struct.Struct(">I")


class ProtocolError(Exception):
    """A peer sent something that is not a message of this protocol."""


def default_address() -> str:
    """``$XDG_RUNTIME_DIR/cachebroker.sock``, else ``/tmp/cachebroker-$UID.sock``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "cachebroker.sock")
    return f"/tmp/cachebroker-{os.getuid()}.sock"


def resolve_address(address: str | os.PathLike[str] | None) -> str:
    """The socket path to use: ``address``, else ``CACHEBROKER_ADDRESS``, else the default."""
    if address is None:
        return os.environ.get("CACHEBROKER_ADDRESS") or default_address()
    if not isinstance(address, (str, os.PathLike)):
        raise TypeError(f"address must be a socket path, got {address!r}")
    path = os.fspath(address)
    if not path:
        raise _errors.InvalidArgument("address must be a socket path, got an empty string")
    return path


def peer(stream: anyio.abc.SocketStream) -> tuple[int | None, int | None]:
    """The peer's uid and pid (``SO_PEERCRED``), or ``None``s where the platform has none."""
    peercred = getattr(socket, "SO_PEERCRED", None)
    if peercred is None:
        return None, None
    raw = stream.extra(anyio.abc.SocketAttribute.raw_socket)
    pid, uid, _gid = struct.unpack("3i", raw.getsockopt(socket.SOL_SOCKET, peercred, 12))
    return uid, pid


def encode(message: Mapping[str, Any]) -> bytes:
    """One frame: the length, then the message as compact JSON."""
    body = json.dumps(message, separators=(",", ":"), allow_nan=False).encode()
    return _HEADER.pack(len(body)) + body


async def send(stream: ByteSendStream, *messages: Mapping[str, Any]) -> None:
    """Send ``messages``, in one write."""
    await stream.send(b"".join(encode(message) for message in messages))


async def receive(reader: BufferedByteReceiveStream) -> dict[str, Any]:
    """The next message; ``ProtocolError`` for anything that is not one.

    Raises ``anyio.IncompleteRead`` or ``anyio.EndOfStream`` when the peer
    closed the connection.
    """
    (length,) = _HEADER.unpack(await reader.receive_exactly(_HEADER.size))
    if length > MAX_FRAME:
        raise ProtocolError(f"a frame of {length} bytes is over the limit of {MAX_FRAME}")
    body = await reader.receive_exactly(length)
    try:
        message = json.loads(body)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"a frame is not JSON: {exc}") from None
    if not isinstance(message, dict) or not isinstance(message.get("op"), str):
        raise ProtocolError(f"a message must be an object with an 'op', got {body[:80]!r}")
    return message


async def greet(
    stream: anyio.abc.SocketStream, session: str | None = None
) -> tuple[BufferedByteReceiveStream, dict[str, Any]]:
    """Say ``hello``; the reader, and the daemon's answer (``welcome`` or ``error``).

    ``session`` names the connected broker across its reconnections.
    """
    hello: dict[str, Any] = {"op": "hello", "version": VERSION, "pid": os.getpid()}
    if session is not None:
        hello["session"] = session
    await send(stream, hello)
    reader = BufferedByteReceiveStream(stream)
    return reader, await receive(reader)


def field(message: Mapping[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    """``message[name]``, checked to be of ``kind``; ``ProtocolError`` otherwise."""
    value = message.get(name)
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _kinds(kind)):
        raise ProtocolError(f"{message.get('op')!r} message: {name!r} is {value!r}")
    return value


def _kinds(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def charge(message: Mapping[str, Any], name: str) -> dict[str, int] | None:
    """A ``{space: bytes}`` field (or ``None`` when it is null)."""
    value = message.get(name)
    if value is None:
        return None
    if not isinstance(value, dict) or not all(
        isinstance(space, str) and type(amount) is int and amount >= 0
        for space, amount in value.items()
    ):
        raise ProtocolError(f"{message.get('op')!r} message: {name!r} is {value!r}")
    return value


#: The errors a daemon may refuse a request with (by class name).
_REFUSALS: dict[str, type[BrokerError]] = {
    cls.__name__: cls
    for cls in (
        _errors.AcquireTimeout,
        _errors.BrokerClosed,
        _errors.DeadlockError,
        _errors.InvalidArgument,
        _errors.OutOfSpace,
        _errors.RequestTooLarge,
        _errors.LoadFailed,
    )
}


def encode_error(error: BaseException, names: Mapping[str, str]) -> dict[str, Any]:
    """``error`` for the wire, each daemon-side owner name in ``names`` written as its cache's.

    A ``DeadlockError`` carries the numbers of the requester's entries it
    names (``leases``), for the process to name them as it knows them.
    """

    def mine(text: str) -> str:
        for owner in sorted(names, key=len, reverse=True):  # (w@1.2 before w@1)
            text = text.replace(owner, names[owner])
        return text

    message = mine(str(error))
    if isinstance(error, _errors.OutOfSpace) and "broker.forget(" in message:
        # Another process's quarantined entry: only that process can write it off.
        message += (
            " (a quarantined entry named cache@pid belongs to process pid: it is "
            "written off by forget() there, or when that process ends)"
        )
    fields: dict[str, Any] = {"type": type(error).__name__, "message": message}
    if isinstance(error, _errors.RequestTooLarge):
        fields.update(space=error.space, size=error.size, budget=error.budget)
        fields["entry"] = None if error.entry is None else mine(error.entry)
    if isinstance(error, _errors.DeadlockError):
        ids = (getattr(key, "id", None) for _owner, key in error.leases)
        fields["leases"] = [id for id in ids if isinstance(id, int)]
    return fields


def decode_error(fields: Any, address: str) -> BrokerError:
    """The exception a daemon's refusal stands for (a ``BrokerError`` in any case)."""
    if not isinstance(fields, dict):
        return _errors.BrokerClosed(f"the broker at {address} refused the request: {fields!r}")
    kind = _REFUSALS.get(str(fields.get("type")))
    message = str(fields.get("message", ""))
    if kind is _errors.RequestTooLarge:
        try:
            return _errors.RequestTooLarge(
                str(fields["space"]),
                int(fields["size"]),
                int(fields["budget"]),
                entry=fields.get("entry"),
            )
        except (KeyError, TypeError, ValueError):
            kind = _errors.OutOfSpace
    if kind is _errors.DeadlockError:
        return _errors.DeadlockError(message, [])
    if kind is None:
        return _errors.BrokerError(f"the broker at {address} refused the request: {message}")
    simple: type[BrokerError] = kind
    return simple(message)
