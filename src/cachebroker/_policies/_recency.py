"""The recency policies: LRU and FIFO keep each space's idle entries in one order."""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Mapping

from ._cover import cover
from ._protocol import PolicyBase, PolicyEntry


class LRU(PolicyBase):
    """Least recently used first, among idle entries charged in the short spaces.

    Each space keeps its resident entries in the order they last became idle.
    A leased entry keeps its place (the victim search skips it) and moves to
    the end when it becomes idle again, so a hit and its release cost one
    ``move_to_end`` per space. A shortfall in several spaces merges the
    orders by ``idle_seq``. Picking k victims is O(k log s) over s spaces,
    plus the leased entries passed on the way.
    """

    __slots__ = ("_order",)

    def __init__(self) -> None:
        self._order: dict[str, OrderedDict[PolicyEntry, None]] = {}

    def idle(self, entry: PolicyEntry) -> None:
        for space in entry.charge:
            order = self._order.get(space)
            if order is None:
                order = self._order[space] = OrderedDict()
            try:
                order.move_to_end(entry)
            except KeyError:
                order[entry] = None

    def remove(self, entry: PolicyEntry) -> None:
        for space in entry.charge:
            order = self._order.get(space)
            if order is not None:
                order.pop(entry, None)
                if not order:
                    order.clear()  # give the emptied table back

    def victims(self, shortfall: Mapping[str, int]) -> list[PolicyEntry]:
        """The least recently used idle entries of the short spaces, until covered."""
        queues = [iter(self._order.get(space, ())) for space in shortfall]
        if len(queues) == 1:
            return cover(queues[0], shortfall)
        # Leased entries (idle_seq 0) come out first from each order and are skipped.
        return cover(heapq.merge(*queues, key=lambda entry: entry.idle_seq), shortfall)


class FIFO(PolicyBase):
    """First loaded, first evicted, among idle entries; leases and hits do not matter.

    Each space keeps its resident entries in load order; a victim search skips
    the leased ones.
    """

    __slots__ = ("_order", "_resident", "_seq")

    def __init__(self) -> None:
        self._resident: dict[str, OrderedDict[PolicyEntry, None]] = {}
        self._order: dict[PolicyEntry, int] = {}
        self._seq = itertools.count()

    def admit(self, entry: PolicyEntry) -> None:
        self._order[entry] = next(self._seq)
        for space in entry.charge:
            self._resident.setdefault(space, OrderedDict())[entry] = None

    def remove(self, entry: PolicyEntry) -> None:
        if self._order.pop(entry, None) is not None:
            for space in entry.charge:
                self._resident[space].pop(entry, None)

    def victims(self, shortfall: Mapping[str, int]) -> list[PolicyEntry]:
        """The first loaded idle entries of the short spaces, until covered."""
        queues = [iter(self._resident.get(space, ())) for space in shortfall]
        if len(queues) == 1:
            return cover(queues[0], shortfall)
        order = self._order
        return cover(heapq.merge(*queues, key=lambda entry: order[entry]), shortfall)
