"""Eviction policies: pure, synchronous rankers of idle entries.

A policy never decides *whether* to evict. The core tells it what happens to
entries (requested, loaded, idle, leased again, gone) and asks it for a set
of victims that covers a shortfall in some spaces. It must only return
entries that are idle (``entry.idle``), and may return too few: the core then
evicts nothing and waits.

What a policy may read on an entry: ``key``, ``cache`` (its cache's name),
``charge`` (space -> bytes), ``cost`` (reload seconds: declared with
``acquire(cost=...)``, else the measured load time; known from ``admit`` on),
``requests`` (acquires since the entry was created), ``last_request`` (the
core's request clock at the latest one), ``idle`` and ``idle_seq`` (increases
each time the entry becomes idle).
"""

from __future__ import annotations

import heapq
import itertools
import math
import operator
from collections import OrderedDict
from collections.abc import Callable, Generator, Iterator, Mapping
from contextlib import closing
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from .._errors import InvalidArgument

if TYPE_CHECKING:
    from .._core import Entry

__all__ = ["FIFO", "GDSF", "LRU", "CostAware", "Policy", "PolicyBase", "make_policy"]


@runtime_checkable
class Policy(Protocol):
    """What the core tells a policy, and what it asks of it.

    Every method is called synchronously from the core and must not block or
    raise. Subclass ``PolicyBase`` to get no-op defaults for the hooks you do
    not need (the core then skips calling them).
    """

    def touch(self, entry: Entry) -> None:
        """A request for ``entry``: a hit, a join of its load, or the miss that created it."""

    def admit(self, entry: Entry) -> None:
        """``entry`` was loaded: it is resident from now on and ``entry.cost`` is known."""

    def idle(self, entry: Entry) -> None:
        """``entry`` became an eviction candidate (resident, no lease)."""

    def busy(self, entry: Entry) -> None:
        """``entry`` stopped being a candidate: leased again, or being released."""

    def remove(self, entry: Entry) -> None:
        """``entry`` left the books (possibly without ever being admitted)."""

    def victims(self, shortfall: Mapping[str, int]) -> list[Entry]:
        """Return idle entries whose release covers ``shortfall`` (space -> bytes)."""
        ...


class PolicyBase:
    """No-op hooks to build a policy on; only ``victims`` must be written."""

    def touch(self, entry: Entry) -> None:
        """A request for ``entry`` (no-op)."""

    def admit(self, entry: Entry) -> None:
        """``entry`` was loaded (no-op)."""

    def idle(self, entry: Entry) -> None:
        """``entry`` became a candidate (no-op)."""

    def busy(self, entry: Entry) -> None:
        """``entry`` stopped being a candidate (no-op)."""

    def remove(self, entry: Entry) -> None:
        """``entry`` left the books (no-op)."""

    def victims(self, shortfall: Mapping[str, int]) -> list[Entry]:
        """Return idle entries whose release covers ``shortfall`` (space -> bytes).

        Subclasses must write it; may return too few (the core then waits).
        """
        raise NotImplementedError(f"{type(self).__name__} must define victims()")


def _cover(candidates: Iterator[Entry], shortfall: Mapping[str, int]) -> list[Entry]:
    """Take candidates in the order given until every short space is covered.

    Skips candidates that are not idle and those that weigh nothing in any
    space that is still short.
    """
    remaining = {space: need for space, need in shortfall.items() if need > 0}
    chosen: list[Entry] = []
    seen: set[Entry] = set()
    for entry in candidates:
        if not remaining:
            break
        if entry in seen or not entry.idle or remaining.keys().isdisjoint(entry.charge):
            continue
        seen.add(entry)
        chosen.append(entry)
        for space, amount in entry.charge.items():
            if space in remaining:
                remaining[space] -= amount
                if remaining[space] <= 0:
                    del remaining[space]
    return chosen


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
        self._order: dict[str, OrderedDict[Entry, None]] = {}

    def idle(self, entry: Entry) -> None:
        for space in entry.charge:
            order = self._order.get(space)
            if order is None:
                order = self._order[space] = OrderedDict()
            try:
                order.move_to_end(entry)
            except KeyError:
                order[entry] = None

    def remove(self, entry: Entry) -> None:
        for space in entry.charge:
            order = self._order.get(space)
            if order is not None:
                order.pop(entry, None)
                if not order:
                    order.clear()  # give the emptied table back

    def victims(self, shortfall: Mapping[str, int]) -> list[Entry]:
        """The least recently used idle entries of the short spaces, until covered."""
        queues = [iter(self._order.get(space, ())) for space in shortfall]
        if len(queues) == 1:
            return _cover(queues[0], shortfall)
        # Leased entries (idle_seq 0) come out first from each order and are skipped.
        return _cover(heapq.merge(*queues, key=lambda entry: entry.idle_seq), shortfall)


class FIFO(PolicyBase):
    """First loaded, first evicted, among idle entries; leases and hits do not matter.

    Each space keeps its resident entries in load order; a victim search skips
    the leased ones.
    """

    __slots__ = ("_order", "_resident", "_seq")

    def __init__(self) -> None:
        self._resident: dict[str, OrderedDict[Entry, None]] = {}
        self._order: dict[Entry, int] = {}
        self._seq = itertools.count()

    def admit(self, entry: Entry) -> None:
        self._order[entry] = next(self._seq)
        for space in entry.charge:
            self._resident.setdefault(space, OrderedDict())[entry] = None

    def remove(self, entry: Entry) -> None:
        if self._order.pop(entry, None) is not None:
            for space in entry.charge:
                self._resident[space].pop(entry, None)

    def victims(self, shortfall: Mapping[str, int]) -> list[Entry]:
        """The first loaded idle entries of the short spaces, until covered."""
        queues = [iter(self._resident.get(space, ())) for space in shortfall]
        if len(queues) == 1:
            return _cover(queues[0], shortfall)
        order = self._order
        return _cover(heapq.merge(*queues, key=lambda entry: order[entry]), shortfall)


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
        self._heaps: dict[str, list[tuple[float, int, Entry]]] = {}
        self._version: dict[Entry, int] = {}
        self._seq = itertools.count(1)
        self._heaped = False

    def _rank(self, entry: Entry, size: int) -> float:
        raise NotImplementedError

    def _push(self, entry: Entry) -> None:
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
        heaps: dict[str, list[tuple[float, int, Entry]]] = {}
        for entry, version in self._version.items():
            for space, size in entry.charge.items():
                heaps.setdefault(space, []).append((self._rank(entry, size), version, entry))
        for heap in heaps.values():
            heapq.heapify(heap)
        self._heaps = heaps
        self._heaped = True

    def admit(self, entry: Entry) -> None:
        self._push(entry)

    def remove(self, entry: Entry) -> None:
        self._version.pop(entry, None)
        if self._heaped and len(self._version) <= self.heap_above // 2:
            self._heaps = {}
            self._heaped = False

    def _lowest(self, shortfall: Mapping[str, int]) -> Generator[tuple[float, Entry], None, None]:
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
            seen_once: set[Entry] = set()
            for rank, _, entry in ranked:
                if entry not in seen_once:
                    seen_once.add(entry)
                    yield rank, entry
            return
        heaps = [self._heaps.get(space, []) for space in short]
        set_aside: list[tuple[list[tuple[float, int, Entry]], tuple[float, int, Entry]]] = []
        seen: set[Entry] = set()
        version = self._version
        try:
            while True:
                best: list[tuple[float, int, Entry]] | None = None
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
        self._base: dict[Entry, float] = {}

    def _rank(self, entry: Entry, size: int) -> float:
        return self._base[entry] + entry.requests * max(entry.cost, 1e-9) / max(size, 1)

    def admit(self, entry: Entry) -> None:
        self._base[entry] = self.clock
        self._push(entry)

    def touch(self, entry: Entry) -> None:
        if entry in self._base:
            self._base[entry] = self.clock
            self._push(entry)

    def remove(self, entry: Entry) -> None:
        self._base.pop(entry, None)
        super().remove(entry)

    def victims(self, shortfall: Mapping[str, int]) -> list[Entry]:
        """The lowest-priority idle entries until covered; the clock rises to the highest."""
        with closing(self._lowest(shortfall)) as lowest:
            ranked = {entry: rank for rank, entry in _take_covering(lowest, shortfall)}
        chosen = _cover(iter(ranked), shortfall)
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
    the better of a greedy cover by rank, pruned of entries it does not need,
    and the best cover that pairs one large entry with a greedy cover of the
    rest. With mixed sizes, which set to evict matters more than the order.
    """

    def __init__(self, *, half_life: float = 4.0, candidates: int = 24) -> None:
        super().__init__()
        if half_life <= 0 or candidates < 1:
            raise ValueError("half_life must be positive and candidates at least 1")
        self.half_life = half_life
        self.candidates = candidates
        self._rates: dict[tuple[str, object], tuple[float, int]] = {}
        self._now = 0

    def _log_rate(self, entry: Entry) -> float:
        """log2 of the decayed rate, shifted by ``+ tick / half_life`` (time-invariant)."""
        rate, tick = self._rates.get((entry.cache, entry.key), (1.0, entry.last_request))
        return math.log2(rate) + tick / self.half_life

    def _rank(self, entry: Entry, size: int) -> float:
        return self._log_rate(entry) + math.log2(max(entry.cost, 1e-6) / max(size, 1))

    def _value(self, entry: Entry) -> float:
        """Expected reload cost of evicting ``entry`` now (decayed rate x cost)."""
        rate, tick = self._rates.get((entry.cache, entry.key), (1.0, entry.last_request))
        decay: float = 2.0 ** ((tick - self._now) / self.half_life)
        return rate * decay * max(entry.cost, 1e-6)

    def touch(self, entry: Entry) -> None:
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

    def victims(self, shortfall: Mapping[str, int]) -> list[Entry]:
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
    ranked: Iterator[tuple[float, Entry]], shortfall: Mapping[str, int], at_least: int = 0
) -> list[tuple[float, Entry]]:
    """The lowest-ranked entries: at least ``at_least`` of them, and enough to cover."""
    remaining = {space: need for space, need in shortfall.items() if need > 0}
    taken: list[tuple[float, Entry]] = []
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
    pool: list[Entry], shortfall: Mapping[str, int], value: Callable[[Entry], float]
) -> list[Entry]:
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
    amounts: dict[Entry, Any]
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

    def greedy(start: list[Entry]) -> list[Entry] | None:
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


_BUILTIN: dict[str, Callable[[], Policy]] = {
    "lru": LRU,
    "fifo": FIFO,
    "gdsf": GDSF,
    "cost": CostAware,
}


def make_policy(policy: str | Policy) -> Policy:
    """Return a policy instance for a built-in name or a user's instance."""
    if isinstance(policy, str):
        factory = _BUILTIN.get(policy.strip().lower())
        if factory is None:
            raise InvalidArgument(
                f"unknown policy {policy!r}; built-in policies are {sorted(_BUILTIN)}"
            )
        return factory()
    if isinstance(policy, Policy):
        return policy
    raise TypeError(
        "policy must be a built-in name such as 'lru' or an object with touch(), admit(), "
        f"idle(), busy(), remove() and victims() (see PolicyBase), got {type(policy).__name__}"
    )
