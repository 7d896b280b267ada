"""What a process asks the daemon besides its requests, and what it tells of its memories.

``why`` (why a request has no room yet) and ``free`` (free the next victims
for a load that ran out of memory there) are answered from the daemon's
books; ``evidence`` (a load fit only after freeing elsewhere) and
``aliases`` (spaces its books know to be one memory) merge spaces in them,
and through ``Daemon.tell_aliases`` in every process's books.
"""

from __future__ import annotations

from typing import Any, Protocol

import anyio
import anyio.abc

from .. import _log_events as ev
from .._core import Entry, State
from .._shell._seam import Relay
from . import _protocol as wire
from ._mirrors import _Key, _Mirror
from ._protocol import ProtocolError

__all__ = ["Asked", "aliases", "evidence", "free", "why"]


class _Told(Protocol):
    def tell_aliases(self, **fields: Any) -> None: ...


class Asked(Protocol):
    """What these answers need of the process's connection (``_connection.Connection``)."""

    @property
    def runner(self) -> Relay: ...
    @property
    def daemon(self) -> _Told: ...
    @property
    def pid(self) -> int: ...
    @property
    def mirrors(self) -> dict[int, _Mirror]: ...
    @property
    def tg(self) -> anyio.abc.TaskGroup | None: ...

    def post(self, message: dict[str, Any]) -> None: ...
    def names(self) -> dict[str, str]: ...
    def entry_of(self, id: int) -> Entry | None: ...


def why(connection: Asked, id: int) -> None:
    """Say why request ``id`` has no room yet, in the books' words (``Core.why_no_room``)."""
    entry = connection.entry_of(id)
    text = None
    if entry is not None and entry.state is State.WAITING and entry.need:
        text = wire.rename(connection.runner.core.why_no_room(entry), connection.names())
    connection.post({"op": "why", "id": id, "text": text})


def free(connection: Asked, id: int) -> None:
    """Load ``id`` ran out of memory there: free the next victims in the daemon's
    books (idle entries of any process, in the policy's order, ``Core.free_for_retry``),
    and answer ``freed`` once their releases ended. Nothing to free (or no such
    load here): no victims, and the process's load fails with ``OutOfSpace``."""
    entry = connection.entry_of(id)
    victims: list[Entry] = []
    if entry is not None and entry.state is State.LOADING:
        victims = connection.runner.core.free_for_retry(entry)
        connection.runner.apply()
    names = connection.names()
    named = [
        (
            names.get(v.owner.name, v.owner.name),
            repr(v.key),
            v.key.id if isinstance(v.key, _Key) and v.owner.name in names else None,
        )
        for v in victims
    ]
    answer = {
        "op": "freed",
        "id": id,
        **wire.encode_freed(named, {name for victim in victims for name in victim.charge}),
    }
    released = [v.shell.released for v in victims if v.shell.released is not None]
    assert connection.tg is not None
    connection.tg.start_soon(_freed, connection, answer, released)


async def _freed(connection: Asked, answer: dict[str, Any], released: list[anyio.Event]) -> None:
    for event in released:
        await event.wait()
    connection.post(answer)


def evidence(connection: Asked, message: dict[str, Any]) -> None:
    """Load ``id`` fit only after freeing in ``freed`` (free and retry): evidence that
    ``freed`` and ``loaded`` are one memory, noted in the daemon's books; spaces it
    merges are merged in every process's books too (``Daemon.tell_aliases``)."""
    spaces = connection.runner.core.spaces
    named: dict[str, list[str]] = {}
    for field in ("freed", "loaded"):
        value = message.get(field)
        if not isinstance(value, list) or not all(
            isinstance(name, str) and name in spaces for name in value
        ):
            raise ProtocolError(f"'evidence' message: {field!r} is {wire.shown(value)}")
        named[field] = value
    mirror = connection.mirrors.get(wire.field(message, "id", int))
    cache = mirror.space.name if mirror is not None else f"?@{connection.pid}"
    key: object = mirror.key if mirror is not None else None
    if connection.runner.learn_aliases(named["freed"], named["loaded"], cache, key):
        connection.daemon.tell_aliases(cache=cache, key=repr(key))


def aliases(connection: Asked, message: dict[str, Any]) -> None:
    """The process's books know spaces to be one memory (a daemon before this one
    learned it): so do the daemon's books, and every process's."""
    core = connection.runner.core
    merged = False
    for keep, other in wire.decode_aliases(message, core.spaces):
        if core.canon.get(keep, keep) == core.canon.get(other, other):
            continue
        found = core.merged_circle(keep, other)
        if found is not None:  # (the daemon's tiers would go round in a circle)
            connection.runner.emit(
                "warning",
                ev.ALIAS_REFUSED,
                spaces=[keep, other],
                circle=list(found),
                evidence=None,
                cache=f"?@{connection.pid}",
                key=None,
            )
            continue
        core.merge_spaces(keep, other)
        merged = True
    connection.runner.apply()
    if merged:
        connection.daemon.tell_aliases(pid=connection.pid)
