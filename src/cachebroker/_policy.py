"""Eviction policies: pure, synchronous rankers of idle entries.

A policy never decides *whether* to evict; the core tells it which entries
are idle (evictable) and asks it for a set of victims that covers a shortfall
in some spaces. It must only return entries it was told are idle.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ._core import Entry

__all__ = ["LRU", "Policy", "make_policy"]


@runtime_checkable
class Policy(Protocol):
    """What the core tells a policy, and what it asks of it.

    Every method is called synchronously from the core and must not block.
    ``entry.charge`` maps space names to bytes; ``entry.idle_seq`` increases
    each time an entry becomes idle.
    """

    def idle(self, entry: Entry) -> None:
        """``entry`` became an eviction candidate (resident, no lease)."""

    def busy(self, entry: Entry) -> None:
        """``entry`` stopped being a candidate: leased again, or being released."""

    def victims(self, shortfall: Mapping[str, int]) -> list[Entry]:
        """Return idle entries whose release covers ``shortfall`` (space -> bytes).

        Only entries charged in a short space may be returned. Returning too
        little is allowed: the core then evicts nothing and waits.
        """
        ...


class LRU:
    """Least recently used first, among idle entries charged in the short spaces.

    Each space keeps its idle entries in the order they became idle; a
    shortfall in several spaces merges those orders by ``idle_seq``. Cost:
    O(1) per lease and release, O(k log s) to pick k victims over s spaces.
    """

    __slots__ = ("_idle",)

    def __init__(self) -> None:
        self._idle: dict[str, OrderedDict[Entry, None]] = {}

    def idle(self, entry: Entry) -> None:
        for space in entry.charge:
            queue = self._idle.get(space)
            if queue is None:
                queue = self._idle[space] = OrderedDict()
            queue[entry] = None

    def busy(self, entry: Entry) -> None:
        for space in entry.charge:
            self._idle[space].pop(entry, None)

    def victims(self, shortfall: Mapping[str, int]) -> list[Entry]:
        remaining = {space: need for space, need in shortfall.items() if need > 0}
        chosen: list[Entry] = []
        seen: set[Entry] = set()
        for entry in self._oldest_first(list(remaining)):
            if not remaining:
                break
            if entry in seen or remaining.keys().isdisjoint(entry.charge):
                continue
            seen.add(entry)
            chosen.append(entry)
            for space, amount in entry.charge.items():
                if space in remaining:
                    remaining[space] -= amount
                    if remaining[space] <= 0:
                        del remaining[space]
        return chosen

    def _oldest_first(self, spaces: list[str]) -> Iterator[Entry]:
        queues = [iter(self._idle.get(space, ())) for space in spaces]
        if len(queues) == 1:
            return queues[0]
        return heapq.merge(*queues, key=lambda entry: entry.idle_seq)


_BUILTIN = {"lru": LRU}


def make_policy(policy: str | Policy) -> Policy:
    """Return a policy instance for a built-in name or a user's instance."""
    if isinstance(policy, str):
        factory = _BUILTIN.get(policy.strip().lower())
        if factory is None:
            raise ValueError(f"unknown policy {policy!r}; built-in policies are {sorted(_BUILTIN)}")
        return factory()
    if isinstance(policy, Policy):
        return policy
    raise TypeError(
        f"policy must be a built-in name such as 'lru' or an object with idle(), busy() "
        f"and victims(), got {type(policy).__name__}"
    )
