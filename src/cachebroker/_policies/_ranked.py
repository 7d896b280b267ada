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
from collections import Counter
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from contextlib import closing
from typing import Any, ClassVar

from ._cover import cover
from ._protocol import PolicyBase, PolicyEntry

#: A heap item: (rank, version, entry); stale once the entry's version moved on.
_HeapItem = tuple[float, int, PolicyEntry]


class _Ranked(PolicyBase):
    """Resident entries in one lazy min-heap per space, keyed by a per-space rank.

    ``_rank(entry, size, ranking)`` is the priority of ``entry`` when it must
    free ``size`` bytes of a space (lower goes first); ties go to the entry
    ranked earlier. A policy may keep ``_rankings`` rankings side by side (a
    heap per space for each) and search by ``_ranking``, so that switching
    between them costs nothing. A heap item is stale once the entry was
    re-ranked or removed; stale items are skipped and compacted.

    While ``heap_above`` entries or fewer are resident (the usual model
    server), no heap is kept: a request costs no push, and a victim search
    ranks the idle entries on the spot, in the same order the heaps would
    give. Heaps are built when the entries outgrow that, and dropped when
    they fall to half of it.
    """

    #: Resident entries up to which no heap is kept.
    heap_above = 32

    def __init__(self) -> None:
        self._heaps: dict[tuple[str, int], list[_HeapItem]] = {}
        self._version: dict[PolicyEntry, int] = {}
        self._seq = itertools.count(1)
        self._heaped = False
        self._rankings = 1  # rankings kept side by side
        self._ranking = 0  # the one victims are searched by

    def _rank(self, entry: PolicyEntry, size: int, ranking: int) -> float:
        raise NotImplementedError

    def _push(self, entry: PolicyEntry) -> None:
        version = next(self._seq)
        self._version[entry] = version
        if not self._heaped:
            if len(self._version) > self.heap_above:
                self._build_heaps()
            return
        for ranking in range(self._rankings):
            for space, size in entry.charge.items():
                heap = self._heaps.setdefault((space, ranking), [])
                heapq.heappush(heap, (self._rank(entry, size, ranking), version, entry))
                if len(heap) > 2 * len(self._version) + 64:
                    heap[:] = [item for item in heap if self._version.get(item[2]) == item[1]]
                    heapq.heapify(heap)

    def _build_heaps(self) -> None:
        heaps: dict[tuple[str, int], list[_HeapItem]] = {}
        for entry, version in self._version.items():
            for ranking in range(self._rankings):
                for space, size in entry.charge.items():
                    item = (self._rank(entry, size, ranking), version, entry)
                    heaps.setdefault((space, ranking), []).append(item)
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

    def _lowest(self, shortfall: Mapping[str, int]) -> Generator[PolicyEntry, None, None]:
        """Idle entries of the short spaces, lowest rank first (each once).

        Leased entries met on the way are put back when the iteration ends.
        """
        short = [space for space in shortfall if shortfall[space] > 0]
        ranking = self._ranking
        if not self._heaped:
            ranked = sorted(
                (self._rank(entry, entry.charge[space], ranking), version, entry)
                for entry, version in self._version.items()
                if entry.idle
                for space in short
                if space in entry.charge
            )
            seen_once: set[PolicyEntry] = set()
            for _, _, entry in ranked:
                if entry not in seen_once:
                    seen_once.add(entry)
                    yield entry
            return
        heaps = [self._heaps.get((space, ranking), []) for space in short]
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
                    yield entry
        finally:
            for heap, item in set_aside:
                heapq.heappush(heap, item)


class GDSF(_Ranked):
    """GreedyDual-Size-Frequency, as in FaasCache (ASPLOS'21): the textbook baseline.

    priority = clock + frequency x reload cost / size, where frequency counts
    the requests since the entry was loaded, reload cost is ``entry.cost`` and
    size is the entry's size in the space that is short. The lowest priority
    goes first, and the clock rises to the priority of each victim as it is
    evicted (``evicted``; ``victims`` only chooses, so a choice the core
    weighs but does not act on ages nobody), so entries not requested for a
    long time age out. With equal costs and sizes it orders like LFU with aging.
    """

    def __init__(self) -> None:
        super().__init__()
        self.clock = 0.0
        self._base: dict[PolicyEntry, float] = {}

    def _rank(self, entry: PolicyEntry, size: int, ranking: int = 0) -> float:
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
        """The lowest-priority idle entries until covered (the clock stays: ``evicted``)."""
        with closing(self._lowest(shortfall)) as lowest:
            return cover(lowest, shortfall)

    def evicted(self, victims: Sequence[PolicyEntry], shortfall: Mapping[str, int]) -> None:
        """The clock rises to the highest priority among the evicted ``victims``.

        Each victim's priority is the one ``victims(shortfall)`` ranked it by:
        its lowest over the short spaces it is charged in.
        """
        short = [space for space, need in shortfall.items() if need > 0]
        for entry in victims:
            if entry not in self._base:
                continue  # (not one of its entries: nothing ranked it)
            ranks = [self._rank(entry, entry.charge[s]) for s in short if s in entry.charge]
            if ranks:
                self.clock = max(self.clock, min(ranks))


class CostAware(_Ranked):
    """The cost-aware policy: evict the set of idle entries that is cheapest to reload.

    Each key's request rate is estimated with exponential decay on the
    request clock (one tick per acquire to the whole broker), and remembered
    across evictions. How long that memory should be depends on the workload:
    long wins when popularity is stationary, short when the working set
    moves. So the policy keeps the estimate at each half-life of
    ``HALF_LIVES`` (4 to 1,024 requests) side by side and ranks with the one
    that has predicted the requests best so far: its score is the
    log-likelihood of each request under the distribution it predicted just
    before (a proper scoring rule, mixed with 1% of uniform so that no
    estimate is ever certain), with a memory of its own as long as the
    longest half-life. ``half_life=`` fixes one instead. ``half_life`` (the
    attribute) is the one in use.

    An entry's expected reload cost is ``rate x cost``; its rank per space is
    that value per byte (kept in the log domain, where the common decay
    cancels, so ranks only change when the entry is requested).

    To cover a shortfall, the ``candidates`` lowest-ranked idle entries are
    gathered (more if they cannot cover it), and the victim *set* is chosen
    among them to cover the shortfall at the least total expected reload cost:
    the better of a greedy cover by expected reload cost per share of the
    shortfall covered (not by rank), pruned of entries it does not need, and
    the best cover that pairs one large entry (one of the 8 covering the
    largest share) with a greedy cover of the rest; a set is charged its
    values less ``SURPLUS_CREDIT`` (half) of the least value per byte among
    the candidates for each byte it frees beyond the shortfall, room that
    defers the next eviction. With mixed sizes, which set to evict matters
    more than the order.

    The hit path only logs the request: the estimates and scores are brought
    up to date once per ``batch`` requests and before each victim search, at
    a cost per distinct key of the batch (see docs/policies.md).
    """

    #: The half-lives (in requests) estimated side by side when none is fixed.
    HALF_LIVES: ClassVar[tuple[float, ...]] = (4.0, 16.0, 64.0, 256.0, 1024.0)
    #: Requests logged between two updates of the estimates.
    batch: ClassVar[int] = 128
    #: The weight of the uniform distribution mixed into each prediction.
    _MIX: ClassVar[float] = 0.01
    #: How much better (in log-likelihood) another half-life must have
    #: predicted before the ranking switches to it.
    _SWITCH_MARGIN: ClassVar[float] = 1.0

    def __init__(self, *, half_life: float | None = None, candidates: int = 24) -> None:
        super().__init__()
        if half_life is not None and not half_life > 0:
            raise ValueError(f"half_life must be a positive number of requests, got {half_life!r}")
        if candidates < 1:
            raise ValueError(f"candidates must be at least 1, got {candidates!r}")
        self.candidates = candidates
        self._halves = self.HALF_LIVES if half_life is None else (float(half_life),)
        self._bases = tuple(2.0 ** (-1.0 / h) for h in self._halves)
        self._tuning = half_life is None
        # Per half-life: its index in a rate record, base, half-life and the
        # decayed mass of one request per tick since forever.
        self._estimates = tuple(
            (i, base, half, base / (1.0 - base) if base < 1.0 else math.inf)
            for i, (base, half) in enumerate(zip(self._bases, self._halves, strict=True), 1)
        )
        # Score memory: as long as the longest half-life.
        self._score_decay = 2.0 ** (-1.0 / max(self._halves))
        # (cache, key) -> [tick of the latest request, rate at each half-life then]
        self._rates: dict[tuple[str, object], list[float]] = {}
        self._log: list[PolicyEntry] = []
        self._now = 0
        self._scores = [0.0] * len(self._halves)
        self._rankings = len(self._halves)  # a ranking (and heaps) per half-life
        self._ranking = len(self._halves) // 2
        self._forget_above = 4096

    @property
    def half_life(self) -> float:
        """The half-life (in requests) of the rate estimate ranking entries now."""
        return self._halves[self._ranking]

    def touch(self, entry: PolicyEntry) -> None:
        log = self._log
        log.append(entry)
        if len(log) >= self.batch:
            self._update()

    def _update(self) -> None:
        """Fold the logged requests into the estimates, scoring each half-life first."""
        log = self._log
        if not log:
            return
        self._log = []
        logged = len(log)
        # Requests per entry; the common batch has few distinct entries, which
        # list.count tallies faster than a Counter.
        distinct = dict.fromkeys(log)
        if len(distinct) == 1:
            counts: Mapping[PolicyEntry, int] = {log[0]: logged}
        elif len(distinct) <= 8:
            counts = {entry: log.count(entry) for entry in distinct}
        else:
            counts = Counter(log)
        start = log[-1].last_request - logged + 1  # the tick of the batch's first request
        rates = self._rates
        tuning = self._tuning
        mix = self._MIX / max(len(rates), 1)
        keep = 1.0 - self._MIX
        scored = [0.0] * len(self._bases)
        estimates = self._estimates
        moved: list[PolicyEntry] = []
        for entry, count in counts.items():
            key = (entry.cache, entry.key)
            latest = entry.last_request
            # A key requested again within the batch: its requests are taken
            # as spread evenly from its first (by position) to its latest.
            earliest: float = latest
            if count > 1:
                earliest = min(start + log.index(entry), latest)
            known = rates.get(key)
            if known is None:  # no request before the first one here
                known = rates[key] = [float(earliest)] + [0.0] * len(self._bases)
                predicted = False
            else:
                predicted = tuning
            tick = known[0]
            earliest = max(earliest, tick)  # never before its previous request
            known[0] = float(max(latest, tick))
            gap = max(latest - earliest, 0.0) / (count - 1) if count > 1 else 0.0
            for i, base, half, mass in estimates:
                rate = known[i] * base ** (earliest - tick)  # just before the first
                step = base**gap if gap else 1.0  # decay from one of its requests to the next
                if step < 1.0:
                    spread = step ** (count - 1)
                    known[i] = rate * spread + (1.0 - spread * step) / (1.0 - step)
                else:
                    known[i] = rate + count
                if predicted and earliest > 1:
                    # The score: each request's probability under the rate
                    # just before it over the decayed mass of all requests
                    # (one per tick). The first request of the batch exactly;
                    # the repeats as many times the middle one.
                    if earliest < 40 * half:  # the mass has not reached its limit yet
                        mass *= 1.0 - base ** (earliest - 1)
                    gained = math.log(keep * rate / mass + mix)
                    if count > 1:
                        middle = count / 2
                        if step < 1.0:
                            decayed = step**middle
                            before = rate * decayed + step * (1.0 - decayed) / (1.0 - step)
                        else:
                            before = rate + middle
                        gained += (count - 1) * math.log(keep * before / mass + mix)
                    scored[i - 1] += gained
            if entry in self._version:
                moved.append(entry)
            if latest > self._now:
                self._now = latest
        if tuning:
            self._retune(scored, logged)
        for entry in moved:  # re-ranked: ties now go to the entry ranked earlier
            self._push(entry)
        if len(rates) > self._forget_above and len(rates) > 8 * len(self._version):
            self._forget_cold()

    def _retune(self, scored: list[float], logged: int) -> None:
        """Add a batch's log-likelihoods to the scores; rank by the best half-life."""
        decay = self._score_decay**logged
        scores = self._scores
        best = self._ranking
        for i, gained in enumerate(scored):
            scores[i] = scores[i] * decay + gained
            if scores[i] > scores[best]:
                best = i
        if scores[best] > scores[self._ranking] + self._SWITCH_MARGIN:
            self._ranking = best  # its heaps are kept up to date already

    def _forget_cold(self) -> None:
        """Drop the rates of keys not resident: those decayed below 1/1000 of a
        request at the longest half-life, and beyond the most recent
        ``max(4096, 8 x resident)`` (so that very long memories stay bounded too)."""
        rates = self._rates
        resident = {(entry.cache, entry.key) for entry in self._version}
        horizon = self._now - 10 * max(self._halves)
        cold = {k: v for k, v in rates.items() if v[0] >= horizon and k not in resident}
        limit = max(4096, 8 * len(resident))
        if len(cold) > limit:
            cold = dict(heapq.nlargest(limit, cold.items(), key=lambda item: item[1][0]))
        cold.update((k, rates[k]) for k in resident if k in rates)
        self._rates = cold
        self._forget_above = max(4096, 2 * len(cold))

    def _log_rate(self, entry: PolicyEntry, ranking: int) -> float:
        """log2 of the decayed rate, shifted by ``+ tick / half_life`` (time-invariant)."""
        known = self._rates.get((entry.cache, entry.key))
        if known is None:  # requested in this batch only: one request then
            return entry.last_request / self._halves[ranking]
        return math.log2(known[ranking + 1]) + known[0] / self._halves[ranking]

    def _rank(self, entry: PolicyEntry, size: int, ranking: int) -> float:
        return self._log_rate(entry, ranking) + math.log2(max(entry.cost, 1e-6) / max(size, 1))

    def _log_value(self, entry: PolicyEntry) -> float:
        """log2 of ``_value`` (which underflows for entries long unrequested)."""
        known = self._rates.get((entry.cache, entry.key))
        ranking = self._ranking
        half = self._halves[ranking]
        if known is None:
            log_rate = (entry.last_request - self._now) / half
        else:
            log_rate = math.log2(known[ranking + 1]) + (known[0] - self._now) / half
        return log_rate + math.log2(max(entry.cost, 1e-6))

    def _value(self, entry: PolicyEntry) -> float:
        """Expected reload cost of evicting ``entry`` now (decayed rate x cost)."""
        known = self._rates.get((entry.cache, entry.key))
        ranking = self._ranking
        rate: float
        if known is None:
            rate = self._bases[ranking] ** (self._now - entry.last_request)
        else:
            rate = known[ranking + 1] * self._bases[ranking] ** (self._now - known[0])
        return rate * max(entry.cost, 1e-6)

    def victims(self, shortfall: Mapping[str, int]) -> list[PolicyEntry]:
        """The cheapest cover of ``shortfall`` among the lowest-ranked idle entries.

        The estimates first catch up with the requests logged since the last
        update (``touch``): what was requested, whatever is asked, so a search
        repeated with no request between changes nothing.
        """
        self._update()
        if len(self._version) <= self.candidates:
            # Every resident entry fits in the pool: skip the walk of the heaps.
            pool = [entry for entry in self._version if entry.idle]
        else:
            with closing(self._lowest(shortfall)) as lowest:
                pool = _take_covering(lowest, shortfall, self.candidates)
        if not pool:
            return []
        # Values relative to the least, from their logs: the choice depends on
        # their ratios only, and absolute values of entries long unrequested
        # underflow to 0.0, where they would all tie.
        logs = {entry: self._log_value(entry) for entry in pool}
        least = min(logs.values())
        return _cheapest_cover(pool, shortfall, lambda e: 2.0 ** min(logs[e] - least, 1000.0))


def _take_covering(
    ranked: Iterator[PolicyEntry], shortfall: Mapping[str, int], at_least: int
) -> list[PolicyEntry]:
    """The first of the ``ranked`` entries: at least ``at_least`` of them, and enough
    to cover; past ``at_least``, only those charged in a space still short."""
    remaining = {space: need for space, need in shortfall.items() if need > 0}
    taken: list[PolicyEntry] = []
    for entry in ranked:
        if remaining.keys().isdisjoint(entry.charge) and len(taken) >= at_least:
            continue
        taken.append(entry)
        for space, amount in entry.charge.items():
            if space in remaining:
                remaining[space] -= amount
                if remaining[space] <= 0:
                    del remaining[space]
        if not remaining and len(taken) >= at_least:
            break
    return taken


#: The share of the least value per byte among the candidates that a byte
#: freed beyond the shortfall is credited with (see ``_cheapest_cover``).
SURPLUS_CREDIT = 0.5


# long: one search (greedy, anchors, the charge), its hot spot kept inline.
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
    by_density = sorted((e for e in pool if weights[e]), key=lambda e: values[e] / weights[e])

    # What is still missing of the shortfall, and the bytes of each entry that
    # can be chosen (by_density: those charged in a short space), in a form
    # whose arithmetic runs in C: plain ints for one short space (the usual
    # case), tuples per space otherwise. This is the policy's hot spot.
    amounts: dict[PolicyEntry, Any]
    if len(need) == 1:
        ((space, total),) = need.items()
        amounts = {e: e.charge[space] for e in by_density}
        needed: Any = total
        minus: Callable[[Any, Any], Any] = operator.sub
        plus: Callable[[Any, Any], Any] = operator.add
        short: Callable[[Any], bool] = (0).__lt__
    else:
        amounts = {e: tuple(e.charge.get(space, 0) for space in need) for e in by_density}
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
    # A cover's charge: its values less SURPLUS_CREDIT of the least value per
    # byte for each byte freed beyond the shortfall, per space (docs/policies.md).
    # (A cover exists: every short space has candidates charged in it.)
    credit = [
        SURPLUS_CREDIT * min(values[e] / e.charge[space] for e in by_density if e.charge.get(space))
        for space in need
    ]

    def charged(option: list[PolicyEntry]) -> float:
        missing = needed  # <= 0 for a cover: minus the surplus
        for entry in option:
            missing = minus(missing, amounts[entry])
        value = sum(values[e] for e in option)
        if len(need) == 1:
            return value + credit[0] * float(missing)
        return value + math.fsum(map(operator.mul, credit, missing))

    best_cost = charged(best)
    for anchor in sorted(pool, key=weights.__getitem__, reverse=True)[:8]:
        if anchor is by_density[0] or not weights[anchor]:
            continue  # greedy([anchor]) would be greedy([]) again
        option = greedy([anchor])
        if option is not None and (cost := charged(option)) < best_cost:
            best, best_cost = option, cost
    return best
