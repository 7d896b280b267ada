"""The wire between ``cachebroker serve`` and the processes that connect to it.

A frame is a 4-byte big-endian length and that many bytes of UTF-8 JSON: one
object with an ``"op"``. The message set is small and documented in
``docs/processes.md``; ``VERSION`` is checked in the first exchange
(``hello`` / ``welcome``), so a client and a daemon of different protocol
versions refuse each other with a clear error instead of misreading.

JSON from the standard library: a typical message encodes and decodes in
5 to 20 µs, a fraction of a round trip over the socket (about 70 µs), and
the protocol needs no dependency (msgpack and msgspec, measured beside it
by ``benchmarks/framing.py``, would save about 10 µs a message). What a
hostile peer could make of it is bounded before the JSON decoder sees a
frame: its length (``MAX_FRAME``, and ``MAX_HELLO`` for the first frame of
a connection), its nesting (``MAX_DEPTH``, found by ``check_depth`` in a
linear pass at C speed, so a depth bomb is a ``ProtocolError``, never a
``RecursionError``), and its numbers (``NaN`` and ``Infinity`` are
refused). See docs/processes.md, "What a peer may send".
"""

from __future__ import annotations

import json
import os
import reprlib
import socket
import struct
from collections.abc import Callable, Collection, Hashable, Mapping
from typing import Any

import anyio.abc
from anyio.abc import ByteSendStream
from anyio.streams.buffered import BufferedByteReceiveStream

from .. import _errors
from .._core import Reason, Request
from .._errors import BrokerError
from .._shell._seam import Freed
from ._sockets import Frames, FrameTooLarge

__all__ = [
    "MAX_DEPTH",
    "MAX_FRAME",
    "MAX_HELLO",
    "VERSION",
    "ProtocolError",
    "check_depth",
    "decode",
    "decode_aliases",
    "decode_error",
    "decode_freed",
    "decode_request",
    "default_address",
    "encode",
    "encode_aliases",
    "encode_error",
    "encode_freed",
    "encode_request",
    "greet",
    "peer",
    "reason",
    "receive",
    "resolve_address",
    "send",
    "shown",
]

#: The protocol version: a daemon and a client must agree on it.
VERSION = 4

#: The largest frame either side accepts (a ``ps`` reply of thousands of entries fits).
MAX_FRAME = 16 << 20

#: The largest first frame (``hello``) a daemon accepts: what a connection that has not
#: said who it is may make the daemon buffer.
MAX_HELLO = 4096

#: The deepest nesting of arrays and objects in a message (the protocol's deepest is 4).
MAX_DEPTH = 16

_HEADER = struct.Struct(">I")

#: Every byte but quotes and brackets, deleted to leave a frame's structure (``check_depth``).
_NOT_STRUCTURE = bytes(sorted(set(range(256)) - set(b'"[]{}')))

#: Each opening bracket as ``(`` and each closing one as ``)``.
_PARENS = bytes.maketrans(b"[]{}", b"()()")

#: How values are shown in an error message: short, whatever a peer sent.
_shown = reprlib.Repr()
_shown.maxlevel = 3
_shown.maxstring = _shown.maxother = 80
_shown.maxlong = 40


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


async def receive(
    reader: Frames | BufferedByteReceiveStream, limit: int = MAX_FRAME
) -> dict[str, Any]:
    """The next message, of at most ``limit`` bytes; ``ProtocolError`` for anything else.

    Raises ``anyio.IncompleteRead`` or ``anyio.EndOfStream`` when the peer
    closed the connection.
    """
    if isinstance(reader, Frames):
        try:
            body = await reader.receive(limit)
        except FrameTooLarge as exc:
            raise ProtocolError(
                f"a frame of {exc.length} bytes is over the limit of {limit}"
            ) from None
        return decode(body)
    (length,) = _HEADER.unpack(await reader.receive_exactly(_HEADER.size))
    if length > limit:
        raise ProtocolError(f"a frame of {length} bytes is over the limit of {limit}")
    return decode(await reader.receive_exactly(length))


def decode(body: bytes) -> dict[str, Any]:
    """The message a frame's ``body`` holds; ``ProtocolError`` for anything that is not one."""
    check_depth(body)
    try:
        message = _DECODER.decode(body.decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"a frame is not JSON: {exc}") from None
    if not isinstance(message, dict) or not isinstance(message.get("op"), str):
        raise ProtocolError(f"a message must be an object with an 'op', got {body[:80]!r}")
    return message


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number of this protocol")


#: One decoder for every frame (``json.loads`` with an argument would build one a call).
_DECODER = json.JSONDecoder(parse_constant=_no_constant)


def check_depth(body: bytes) -> None:
    """``ProtocolError`` unless ``body``'s arrays and objects nest at most ``MAX_DEPTH`` deep.

    Linear, and at C speed: a frame with few brackets is let through at
    once; in another, the escapes are cut out, then all but quotes and
    brackets, then what lies between quotes (the strings), and the brackets
    that remain are paired off, innermost first, ``MAX_DEPTH`` times.
    Brackets left over are nested deeper, or do not pair, which no JSON
    does: either way the frame is refused before the decoder recurses into
    it. (Where the frame stops being JSON the cut may be wrong, but the
    decoder never reads past that point either.)
    """
    if body.count(b"[") + body.count(b"{") <= MAX_DEPTH:
        return
    if b"\\" in body:
        body = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    structure = body.translate(_PARENS, _NOT_STRUCTURE)
    # Two quotes with no bracket between them hold none inside a string, or none
    # between two strings: they go, and the quotes after them keep their parity.
    structure = structure.replace(b'""', b"")
    if b'"' in structure:
        structure = b"".join(structure.split(b'"')[::2])
    for _ in range(MAX_DEPTH):
        inner = structure.replace(b"()", b"")
        if len(inner) == len(structure):
            break
        structure = inner
    if structure:
        raise ProtocolError(
            f"a frame nests arrays and objects deeper than {MAX_DEPTH}, or does not close them"
        )


async def greet(
    stream: anyio.abc.SocketStream, session: str | None = None, *, observer: bool = False
) -> tuple[Frames, dict[str, Any]]:
    """Say ``hello``; the reader, and the daemon's answer (``welcome`` or ``error``).

    ``session`` names the connected broker across its reconnections. An
    ``observer`` only reads (``cachebroker ps``): the daemon logs its comings
    and goings at debug level.
    """
    hello: dict[str, Any] = {"op": "hello", "version": VERSION, "pid": os.getpid()}
    if session is not None:
        hello["session"] = session
    if observer:
        hello["observer"] = True
    await send(stream, hello)
    reader = Frames(stream)
    return reader, await receive(reader)


def field(message: Mapping[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    """``message[name]``, checked to be of ``kind``; ``ProtocolError`` otherwise."""
    value = message.get(name)
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _kinds(kind)):
        raise ProtocolError(f"{message.get('op')!r} message: {name!r} is {shown(value)}")
    return value


def shown(value: object) -> str:
    """``value``'s ``repr``, cut short: what an error message says a peer sent."""
    return _shown.repr(value)


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
        raise ProtocolError(f"{message.get('op')!r} message: {name!r} is {shown(value)}")
    return value


def reason(message: Mapping[str, Any]) -> Reason:
    """A ``release`` message's ``reason`` (``capacity`` when it gives none)."""
    value = message.get("reason", Reason.CAPACITY.value)
    try:
        return Reason(value)
    except (ValueError, TypeError):
        raise ProtocolError(f"'release' message: 'reason' is {shown(value)}") from None


def encode_freed(victims: list[tuple[str, str, int | None]], spaces: set[str]) -> dict[str, Any]:
    """The fields of a ``freed`` answer: each victim as ``[cache, key, id]`` (``id``:
    the asking process's number of the entry when it was its own, else null), and
    the spaces their bytes were in."""
    return {"victims": [list(victim) for victim in victims], "spaces": sorted(spaces)}


def decode_freed(
    message: Mapping[str, Any], own: Callable[[int], tuple[str, Hashable] | None]
) -> Freed:
    """A ``freed`` answer, its fields checked (``ProtocolError`` otherwise); ``own``
    names an entry of the asking process by its number, as the process knows it."""
    victims = message.get("victims")
    if not isinstance(victims, list) or not all(
        isinstance(victim, list)
        and len(victim) == 3
        and isinstance(victim[0], str)
        and isinstance(victim[1], str)
        and (victim[2] is None or type(victim[2]) is int)
        for victim in victims
    ):
        raise ProtocolError(f"'freed' message: 'victims' is {shown(victims)}")
    spaces = message.get("spaces")
    if not isinstance(spaces, list) or not all(isinstance(name, str) for name in spaces):
        raise ProtocolError(f"'freed' message: 'spaces' is {shown(spaces)}")
    named: list[tuple[str, Hashable]] = []
    for cache, key, id in victims:
        mine = None if id is None else own(id)
        named.append(mine if mine is not None else (cache, key))
    return Freed(tuple(named), frozenset(spaces))


def encode_request(request: Request) -> dict[str, Any]:
    """The fields of an ``acquire`` message that carry ``request``: what the daemon's
    books weigh of it (its size, ``None`` when measured after the load; the reload
    cost it declared; its eviction priority)."""
    fields: dict[str, Any] = {
        "need": request.need,
        "cost": request.cost,
        "priority": request.priority,
    }
    if request.places is not None:  # (``need``: the size in the first of them)
        fields["places"] = list(request.places)
    return fields


def decode_request(
    message: Mapping[str, Any],
    key: Hashable,
    *,
    load: Callable[..., Any],
    measure: Callable[[Any], Any],
) -> Request:
    """The request an ``acquire`` message carries (``encode_request``), checked, as the
    daemon's books take it: under ``key``, loaded by ``load`` and sized by ``measure``
    (the process's report of its load)."""
    need = charge(message, "need")
    cost = message.get("cost")
    if cost is not None and (type(cost) not in (int, float) or not 0 <= cost < float("inf")):
        raise ProtocolError(f"'acquire' message: 'cost' is {shown(cost)}")
    priority = message.get("priority", 0)
    if type(priority) is not int:
        raise ProtocolError(f"'acquire' message: 'priority' is {shown(priority)}")
    places = message.get("places")
    if places is not None and (
        not isinstance(places, list)
        or not places
        or not all(isinstance(name, str) for name in places)
        or len(set(places)) != len(places)
        or need is None
        or list(need) != places[:1]
    ):
        raise ProtocolError(f"'acquire' message: 'places' is {shown(places)} (need {shown(need)})")
    return Request(
        key,
        need,
        load=load,
        measure=measure,
        cost=cost,
        priority=priority,
        places=None if places is None else tuple(places),
    )


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


def rename(text: str, names: Mapping[str, str]) -> str:
    """``text`` with each daemon-side owner name in ``names`` written as its cache's."""
    for owner in sorted(names, key=len, reverse=True):  # (w@1.2 before w@1)
        text = text.replace(owner, names[owner])
    return text


def encode_error(error: BaseException, names: Mapping[str, str]) -> dict[str, Any]:
    """``error`` for the wire, each daemon-side owner name in ``names`` written as its cache's.

    A ``DeadlockError`` carries the numbers of the requester's entries it
    names (``leases``), for the process to name them as it knows them.
    """

    def mine(text: str) -> str:
        return rename(text, names)

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


def encode_aliases(canon: Mapping[str, str]) -> list[list[str]]:
    """Spaces known to be one memory, as ``[[kept, merged, ...], ...]``: each group's
    name in the books first (``Core.canon``: each merged name and the name it went to)."""
    groups: dict[str, list[str]] = {}
    for name, kept in sorted(canon.items()):
        if name != kept:
            groups.setdefault(kept, [kept]).append(name)
    return [groups[kept] for kept in sorted(groups)]


def decode_aliases(message: Mapping[str, Any], spaces: Collection[str]) -> list[tuple[str, str]]:
    """An ``aliases`` field: the pairs to merge (kept, merged), every name one of ``spaces``."""
    groups = message.get("aliases", [])
    if not isinstance(groups, list) or not all(
        isinstance(group, list)
        and len(group) >= 2
        and all(isinstance(name, str) and name in spaces for name in group)
        for group in groups
    ):
        raise ProtocolError(f"{message.get('op')!r} message: 'aliases' is {shown(groups)}")
    return [(group[0], other) for group in groups for other in group[1:]]
