"""What a connected process asks its daemon and awaits the answer to (``Questions``).

Two questions, each about one of the process's requests, by its number: why
it has no room yet (``why``, for the words of an ``AcquireTimeout``), and,
for a load that ran out of memory, which victims the daemon freed for it
(``free``, answered ``freed`` once their releases ended). A question the
daemon cannot answer any more (the connection ended) is answered "unknown":
``None``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable, Mapping
from typing import Any

import anyio

from .._shell._seam import Freed
from . import _protocol as wire

__all__ = ["WHY_TIMEOUT", "Questions"]

#: Seconds a request that timed out waits for the daemon to say why.
WHY_TIMEOUT = 1.0


class _Why:
    __slots__ = ("event", "text")

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.text: str | None = None


class _Freeing:
    __slots__ = ("event", "freed")

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.freed: Freed | None = None


class Questions:
    """The questions asked of the daemon and not answered yet, by request number."""

    __slots__ = ("_frees", "_post", "_released", "_whys")

    def __init__(self, post: Callable[[dict[str, Any]], None]) -> None:
        self._post = post
        self._whys: dict[int, _Why] = {}
        self._frees: dict[int, _Freeing] = {}
        #: While loads wait for ``freed``: the names of the entries the daemon asked
        #: this process to release, by number (a ``freed`` names them, once gone).
        self._released: dict[int, tuple[str, Hashable]] = {}

    def ask_why(self, id: int) -> Callable[[], Awaitable[str | None]]:
        """Ask why request ``id`` has no room yet; what awaits the answer (``WHY_TIMEOUT``)."""
        asked = self._whys[id] = _Why()
        self._post({"op": "why", "id": id})

        async def answer() -> str | None:
            try:
                with anyio.move_on_after(WHY_TIMEOUT):
                    await asked.event.wait()
            finally:
                self._whys.pop(id, None)
            return asked.text

        return answer

    async def free(self, id: int) -> Freed | None:
        """Ask the daemon to free victims for load ``id``; what it freed, once their
        releases ended (``None``: unanswered, or that load asks already)."""
        if id in self._frees:
            return None
        freeing = self._frees[id] = _Freeing()
        self._post({"op": "free", "id": id})
        try:
            await freeing.event.wait()
        finally:
            self._frees.pop(id, None)
            if not self._frees:
                self._released.clear()
        return freeing.freed

    def releasing(self, id: int, name: tuple[str, Hashable]) -> None:
        """The daemon asked for the release of this process's entry ``id`` (``name``)."""
        if self._frees:
            self._released[id] = name

    def answer_why(self, message: Mapping[str, Any]) -> None:
        asked = self._whys.get(wire.field(message, "id", int))
        if asked is not None:
            text = message.get("text")
            asked.text = f"{text:.2000}" if isinstance(text, str) else None
            asked.event.set()

    def answer_freed(self, message: Mapping[str, Any]) -> None:
        freeing = self._frees.get(wire.field(message, "id", int))
        if freeing is not None:
            freeing.freed = wire.decode_freed(message, self._released.get)
            freeing.event.set()

    def unanswered(self) -> None:
        """The connection ended: every question waiting is answered "unknown"."""
        for asked in self._whys.values():
            asked.event.set()
        for freeing in self._frees.values():
            freeing.event.set()
