"""The ranked policies, GDSF and CostAware, and the machinery they share.

``_Ranked`` keeps resident entries ordered by a per-space rank (lazy heaps
above ``heap_above`` entries, sorting on the spot below); GDSF covers a
shortfall in rank order, CostAware chooses the cheapest covering *set* among
the lowest-ranked candidates (``_take_covering``, then ``_cheapest_cover``).
"""

from __future__ import annotations

import heapq
import itertools
import math
import operator
from collections.abc import Callable, Generator, Iterator, Mapping
from contextlib import closing
from typing import Any

from ._cover import cover
from ._protocol import PolicyBase, PolicyEntry

#: A heap item: (rank, version, entry); stale once the entry's version moved on.
_HeapItem = tuple[float, int, PolicyEntry]


class _Ranked(PolicyBase):
    """Resident entries in one lazy min-heap per space, keyed by a per-space rank.

    ``_rank(entry, size)`` is the priority of ``entry`` when it must free
    ``size`` bytes of a space (lower goes first); ties go to the entry ranked
    earlier. A heap item is stale once the entry was re-ranked or removed;
    stale items are skipped and compacted.

    While ``heap_above`` entries or fewer are resident (the usual model
    server), no heap is kept: a request costs no push, and a victim search
    ranks the idle entries on the spot, in the same order the heaps would
    give. Heaps are built when the entries outgrow that, and dropped when
    they fall to half of it.
    """

    #: Resident entries up to which no heap is kept.
    heap_above = 32

    def __init__(self) -> None:
        self._heaps: dict[str, list[_HeapItem]] = {}
        self._version: dict[PolicyEntry, int] = {}
        self._seq = itertools.count(1)
        self._heaped = False

    def _rank(self, entry: PolicyEntry, size: int) -> float:
        raise NotImplementedError

    def _push(self, entry: PolicyEntry) -> None:
        version = next(self._seq)
        self._version[entry] = version
        if not self._heaped:
            if len(self._version) > self.heap_above:
                self._build_heaps()
            return
        for space, size in entry.charge.items():
            heap = self._heaps.setdefault(space, [])
            heapq.heappush(heap, (self._rank(entry, size), version, entry))
            if len(heap) > 2 * len(self._version) + 64:
                heap[:] = [item for item in heap if self._version.get(item[2]) == item[1]]
                heapq.heapify(heap)

    def _build_heaps(self) -> None:
        heaps: dict[str, list[_HeapItem]] = {}
        for entry, version in self._version.items():
            for space, size in entry.charge.items():
                heaps.setdefault(space, []).append((self._rank(entry, size), version, entry))
        for heap in heaps.values():
            heapq.heapify(heap)
        self._heaps = heaps
        self._heaped = True

    def admit(self, entry: PolicyEntry) -> None:
        self._push(entry)

    def remove(self, entry: PolicyEntry) -> None:
        self._version.pop(entry, None)
        if self._heaped and len(self._version) <= self.heap_above // 2:
            self._heaps = {}
            self._heaped = False

    def _lowest(
        self, shortfall: Mapping[str, int]
    ) -> Generator[tuple[float, PolicyEntry], None, None]:
        """Idle entries of the short spaces, lowest rank first (each once).

        Leased entries met on the way are put back when the iteration ends.
        """
        short = [space for space in shortfall if shortfall[space] > 0]
        if not self._heaped:
            ranked = sorted(
                (self._rank(entry, entry.charge[space]), version, entry)
                for entry, version in self._version.items()
                if entry.idle
                for space in short
                if space in entry.charge
            )
            seen_once: set[PolicyEntry] = set()
            for rank, _, entry in ranked:
                if entry not in seen_once:
                    seen_once.add(entry)
                    yield rank, entry
            return
        heaps = [self._heaps.get(space, []) for space in short]
        set_aside: list[tuple[list[_HeapItem], _HeapItem]] = []
        seen: set[PolicyEntry] = set()
        version = self._version
        try:
            while True:
                best: list[_HeapItem] | None = None
                for heap in heaps:
                    while heap and version.get(heap[0][2]) != heap[0][1]:
                        heapq.heappop(heap)
                    if heap and (best is None or heap[0] < best[0]):
                        best = heap
                if best is None:
                    return
                item = heapq.heappop(best)
                set_aside.append((best, item))
                entry = item[2]
                if entry.idle and entry not in seen:
                    seen.add(entry)
                    yield item[0], entry
        finally:
            for heap, item in set_aside:
                heapq.heappush(heap, item)


class GDSF(_Ranked):
    """GreedyDual-Size-Frequency, as in FaasCache (ASPLOS'21): the textbook baseline.

    priority = clock + frequency x reload cost / size, where frequency counts
    the requests since the entry was loaded, reload cost is ``entry.cost`` and
    size is the entry's size in the space that is short. The lowest priority
    goes first, and the clock rises to the priority of each victim, so entries
    not requested for a long time age out. With equal costs and sizes it
    orders like LFU with aging.
    """

    def __init__(self) -> None:
        super().__init__()
        self.clock = 0.0
        self._base: dict[PolicyEntry, float] = {}

    def _rank(self, entry: PolicyEntry, size: int) -> float:
        return self._base[entry] + entry.requests * max(entry.cost, 1e-9) / max(size, 1)

    def admit(self, entry: PolicyEntry) -> None:
        self._base[entry] = self.clock
        self._push(entry)

    def touch(self, entry: PolicyEntry) -> None:
        if entry in self._base:
            self._base[entry] = self.clock
            self._push(entry)

    def remove(self, entry: PolicyEntry) -> None:
        self._base.pop(entry, None)
        super().remove(entry)

    def victims(self, shortfall: Mapping[str, int]) -> list[PolicyEntry]:
        """The lowest-priority idle entries until covered; the clock rises to the highest."""
        with closing(self._lowest(shortfall)) as lowest:
            ranked = {entry: rank for rank, entry in _take_covering(lowest, shortfall)}
        chosen = cover(iter(ranked), shortfall)
        if chosen:
            self.clock = max(self.clock, max(ranked[entry] for entry in chosen))
        return chosen


class CostAware(_Ranked):
    """The cost-aware policy: evict the set of idle entries that is cheapest to reload.

    Each key's request rate is estimated with exponential decay on the
    request clock (a half-life of ``half_life`` requests to the whole broker),
    and remembered across evictions. The short default half-life (4) makes the
    rate mostly a recency signal with a memory of bursts: measured on
    `benchmarks/policies.py`, longer ones (16-200) won more on Zipf workloads
    but lost up to 4x to LRU when the working set moved, while 4 beat LRU on
    both (see docs/policies.md). An entry's expected reload cost is ``rate x cost``; its
    rank per space is that value per byte (kept in the log domain, where the
    common decay cancels, so ranks only change when the entry is requested).

    To cover a shortfall, the ``candidates`` lowest-ranked idle entries are
    gathered (more if they cannot cover it), and the victim *set* is chosen
    among them to cover the shortfall at the least total expected reload cost:
    the better of a greedy cover by expected reload cost per share of the
    shortfall covered (not by rank), pruned of entries it does not need, and
    the best cover that pairs one large entry (one of the 8 covering the
    largest share) with a greedy cover of the rest. With mixed sizes, which
    set to evict matters more than the order.
    """

    def __init__(self, *, half_life: float = 4.0, candidates: int = 24) -> None:
        super().__init__()
        if half_life <= 0 or candidates < 1:
            raise ValueError("half_life must be positive and candidates at least 1")
        self.half_life = half_life
        self.candidates = candidates
        self._rates: dict[tuple[str, object], tuple[float, int]] = {}
        self._now = 0

    def _log_rate(self, entry: PolicyEntry) -> float:
        """log2 of the decayed rate, shifted by ``+ tick / half_life`` (time-invariant)."""
        rate, tick = self._rates.get((entry.cache, entry.key), (1.0, entry.last_request))
        return math.log2(rate) + tick / self.half_life

    def _rank(self, entry: PolicyEntry, size: int) -> float:
        return self._log_rate(entry) + math.log2(max(entry.cost, 1e-6) / max(size, 1))

    def _value(self, entry: PolicyEntry) -> float:
        """Expected reload cost of evicting ``entry`` now (decayed rate x cost)."""
        rate, tick = self._rates.get((entry.cache, entry.key), (1.0, entry.last_request))
        decay: float = 2.0 ** ((tick - self._now) / self.half_life)
        return rate * decay * max(entry.cost, 1e-6)

    def touch(self, entry: PolicyEntry) -> None:
        key = (entry.cache, entry.key)
        now = entry.last_request
        self._now = now
        rate, tick = self._rates.get(key, (0.0, now))
        self._rates[key] = (rate * 2.0 ** ((tick - now) / self.half_life) + 1.0, now)
        if len(self._rates) > 4096 and len(self._rates) > 8 * len(self._version):
            self._forget_cold()
        if entry in self._version:
            self._push(entry)

    def _forget_cold(self) -> None:
        """Drop rate memories decayed below 1/1000 of a request (bounded memory)."""
        horizon = self._now - 10 * self.half_life
        self._rates = {k: v for k, v in self._rates.items() if v[1] >= horizon}

    def victims(self, shortfall: Mapping[str, int]) -> list[PolicyEntry]:
        """The cheapest cover of ``shortfall`` among the lowest-ranked idle entries."""
        if len(self._version) <= self.candidates:
            # Every resident entry fits in the pool: skip the walk of the heaps.
            pool = [entry for entry in self._version if entry.idle]
        else:
            with closing(self._lowest(shortfall)) as lowest:
                taken = _take_covering(lowest, shortfall, self.candidates)
            pool = [entry for _, entry in taken]
        return _cheapest_cover(pool, shortfall, self._value)


def _take_covering(
    ranked: Iterator[tuple[float, PolicyEntry]], shortfall: Mapping[str, int], at_least: int = 0
) -> list[tuple[float, PolicyEntry]]:
    """The lowest-ranked entries: at least ``at_least`` of them, and enough to cover."""
    remaining = {space: need for space, need in shortfall.items() if need > 0}
    taken: list[tuple[float, PolicyEntry]] = []
    for rank, entry in ranked:
        if remaining.keys().isdisjoint(entry.charge) and len(taken) >= at_least:
            continue
        taken.append((rank, entry))
        for space, amount in entry.charge.items():
            if space in remaining:
                remaining[space] -= amount
                if remaining[space] <= 0:
                    del remaining[space]
        if not remaining and len(taken) >= at_least:
            break
    return taken


def _cheapest_cover(
    pool: list[PolicyEntry], shortfall: Mapping[str, int], value: Callable[[PolicyEntry], float]
) -> list[PolicyEntry]:
    """A low-cost set of entries from ``pool`` covering ``shortfall`` (see CostAware)."""
    need = {space: amount for space, amount in shortfall.items() if amount > 0}
    if not pool or not need:
        return []
    values = {entry: value(entry) for entry in pool}
    # The fraction of the shortfall each entry covers.
    weights = {e: sum(min(e.charge.get(s, 0), n) / n for s, n in need.items()) for e in pool}
    by_density = sorted((e for e in pool if weights[e] > 0), key=lambda e: values[e] / weights[e])

    # What is still missing of the shortfall, and each entry's bytes, in a form
    # whose arithmetic runs in C: plain ints for one short space (the usual
    # case), tuples per space otherwise. This is the policy's hot spot.
    amounts: dict[PolicyEntry, Any]
    if len(need) == 1:
        ((space, total),) = need.items()
        amounts = {e: e.charge.get(space, 0) for e in pool}
        needed: Any = total
        minus: Callable[[Any, Any], Any] = operator.sub
        plus: Callable[[Any, Any], Any] = operator.add
        short: Callable[[Any], bool] = (0).__lt__
    else:
        amounts = {e: tuple(e.charge.get(space, 0) for space in need) for e in pool}
        needed = tuple(need.values())

        def minus(a: Any, b: Any) -> Any:
            return tuple(map(operator.sub, a, b))

        def plus(a: Any, b: Any) -> Any:
            return tuple(map(operator.add, a, b))

        def short(missing: Any) -> bool:
            return bool(max(missing) > 0)

    def greedy(start: list[PolicyEntry]) -> list[PolicyEntry] | None:
        chosen = list(start)
        missing = needed  # bytes still missing (<= 0 once covered)
        for entry in chosen:
            missing = minus(missing, amounts[entry])
        for entry in by_density:
            if not short(missing):
                break
            if entry not in chosen:
                chosen.append(entry)
                missing = minus(missing, amounts[entry])
        if short(missing):
            return None
        # Prune: drop the most valuable members the cover does not need.
        for entry in sorted(chosen, key=lambda e: -values[e]):
            without = plus(missing, amounts[entry])
            if not short(without):
                chosen.remove(entry)
                missing = without
        return chosen

    best = greedy([])
    if best is None:
        return []
    best_cost = sum(values[e] for e in best)
    for anchor in sorted(pool, key=weights.__getitem__, reverse=True)[:8]:
        if anchor is by_density[0] or not weights[anchor]:
            continue  # greedy([anchor]) would be greedy([]) again
        option = greedy([anchor])
        if option is not None and (cost := sum(values[e] for e in option)) < best_cost:
            best, best_cost = option, cost
    return best
