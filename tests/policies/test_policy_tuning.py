"""CostAware's self-tuning memory: which half-life it ranks with, and the estimates behind it.

The policy is fed requests directly (hand-made entries with a request clock,
as the core would touch them); the quality tests replay traces through the
core with the simulator, in the sequential model.
"""

from __future__ import annotations

import functools
import math
import random
import statistics
from collections.abc import Callable, Iterable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachebroker import CostAware
from cachebroker.simulator import CATALOGUE, Request, replay

GiB = 2**30


class Item:
    """An entry as a policy sees it; ``request`` advances the shared clock."""

    def __init__(self, key: str, clock: list[int], *, size: int = 1, cost: float = 1.0) -> None:
        self.key = key
        self.cache = "c"
        self.charge = {"m": size}
        self.cost = cost
        self.requests = 0
        self.last_request = 0
        self.idle_seq = 1
        self._clock = clock

    @property
    def idle(self) -> bool:
        return True

    def request(self, policy: CostAware) -> None:
        self._clock[0] += 1
        self.requests += 1
        self.last_request = self._clock[0]
        policy.touch(self)


def feed(policy: CostAware, keys: Iterable[str], items: dict[str, Item] | None = None) -> None:
    """Request each key in turn (one tick each), then bring the estimates up to date."""
    clock = [0]
    if items is None:
        items = {}
    else:
        clock = next(iter(items.values()))._clock if items else clock
    for key in keys:
        item = items.get(key)
        if item is None:
            item = items[key] = Item(key, clock)
        item.request(policy)
    policy.victims({})  # a victim search folds the log, whatever it is asked


def zipf_keys(n: int, keys: int = 12, s: float = 1.0, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    weights = [1 / (rank + 1) ** s for rank in range(keys)]
    return [f"k{i}" for i in rng.choices(range(keys), weights, k=n)]


def phased_keys(n: int, *, phase: int, width: int, keys: int = 40, seed: int = 0) -> list[str]:
    """A working set of ``width`` keys, cycled in turn, redrawn every ``phase`` requests."""
    rng = random.Random(seed)
    out: list[str] = []
    while len(out) < n:
        working = rng.sample(range(keys), width)
        out.extend(f"k{working[i % width]}" for i in range(phase))
    return out[:n]


# -- which memory it settles on ----------------------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_stationary_popularity_settles_on_a_long_memory(seed: int) -> None:
    policy = CostAware()
    feed(policy, zipf_keys(20_000, seed=seed))
    assert policy.half_life >= 256


@pytest.mark.parametrize("seed", range(3))
def test_a_moving_working_set_settles_on_a_short_memory(seed: int) -> None:
    policy = CostAware()
    feed(policy, phased_keys(20_000, phase=50, width=3, seed=seed))
    assert policy.half_life <= 16


def test_it_follows_a_change_of_workload_both_ways() -> None:
    """The scores have a memory of their own: a new regime wins within a few thousand requests."""
    policy = CostAware()
    items: dict[str, Item] = {}
    feed(policy, zipf_keys(20_000, seed=1), items)
    assert policy.half_life >= 256
    feed(policy, phased_keys(8_000, phase=50, width=3, seed=1), items)
    assert policy.half_life <= 16
    feed(policy, zipf_keys(20_000, seed=2), items)
    assert policy.half_life >= 256


def test_a_fixed_half_life_is_kept() -> None:
    policy = CostAware(half_life=16)
    feed(policy, zipf_keys(5_000))
    assert policy.half_life == 16
    policy = CostAware(half_life=math.inf)  # no decay at all: plain request counts
    feed(policy, ["a", "a", "b"])
    assert policy._value(Item("a", [3])) == pytest.approx(2.0)


@pytest.mark.parametrize("half_life", [0, -1.0, math.nan])
def test_bad_half_life_is_refused(half_life: float) -> None:
    with pytest.raises(ValueError, match="half_life"):
        CostAware(half_life=half_life)


def test_bad_candidates_is_refused() -> None:
    with pytest.raises(ValueError, match="candidates"):
        CostAware(candidates=0)


# -- the estimates ------------------------------------------------------------


def exact_rate(ticks: Sequence[int], now: int, half_life: float) -> float:
    return math.fsum(2.0 ** ((t - now) / half_life) for t in ticks)


@settings(deadline=None, max_examples=50)
@given(keys=st.lists(st.sampled_from("abcde"), min_size=1, max_size=400))
def test_estimates_are_exact_when_folded_every_request(keys: list[str]) -> None:
    """With a batch of one, every half-life's rate is the decayed count of the key's requests."""
    policy = CostAware()
    policy.batch = 1  # type: ignore[misc]
    items: dict[str, Item] = {}
    clock = [0]
    for key in keys:
        items.setdefault(key, Item(key, clock)).request(policy)
    now = clock[0]
    for key in items:
        ticks = [t for t, k in enumerate(keys, 1) if k == key]
        record = policy._rates[("c", key)]
        for index, half in enumerate(policy.HALF_LIVES, 1):
            expected = exact_rate(ticks, now, half)
            got = record[index] * 2.0 ** ((record[0] - now) / half)
            assert got == pytest.approx(expected, rel=1e-9), (key, half)


@pytest.mark.parametrize(("half_life", "within"), [(64.0, 0.1), (256.0, 0.03), (1024.0, 0.01)])
def test_batched_estimates_stay_close_to_exact(half_life: float, within: float) -> None:
    """Requests folded 128 at a time are taken as spread evenly over their part of the batch.

    The error is that of the latest batch's arrangement, so it shrinks as the
    memory grows past the batch.
    """
    keys = zipf_keys(3_000, seed=5)
    policy = CostAware(half_life=half_life)
    items: dict[str, Item] = {}
    feed(policy, keys, items)
    now = len(keys)
    for key in items:
        ticks = [t for t, k in enumerate(keys, 1) if k == key]
        expected = exact_rate(ticks, now, half_life)
        assert policy._value(items[key]) == pytest.approx(expected, rel=within), key


def test_a_key_evicted_and_loaded_again_within_a_batch_counts_once_per_request() -> None:
    """Two entries of one key (the second a reload) pool their requests in one estimate."""
    policy = CostAware(half_life=math.inf)
    clock = [0]
    first, second = Item("a", clock), Item("a", clock)
    for _ in range(3):
        first.request(policy)
    for _ in range(2):
        second.request(policy)
    policy.victims({})
    assert policy._value(second) == pytest.approx(5.0)


def test_memory_of_rates_stays_bounded() -> None:
    """A stream of distinct keys does not grow the rate table without end."""
    policy = CostAware()
    feed(policy, (f"k{i}" for i in range(60_000)))
    # Rates older than 10 longest half-lives are dropped when the table outgrows
    # 8 x the residents (none here) and the previous size.
    assert len(policy._rates) <= 2 * 10 * max(policy.HALF_LIVES) + 4096


# -- quality, replayed through the core ---------------------------------------


def _requests(picks: Sequence[tuple[str, int, float]]) -> list[Request]:
    return [
        Request(time=float(i), key=name, size={"m": size}, load_seconds=seconds)
        for i, (name, size, seconds) in enumerate(picks)
    ]


def _zipf_trace(seed: int, n: int = 2000) -> list[Request]:
    rng = random.Random(seed)
    models = list(CATALOGUE)
    rng.shuffle(models)
    return _requests(rng.choices(models, [1 / (r + 1) for r in range(len(models))], k=n))


def _recency_trace(seed: int, n: int = 2000) -> list[Request]:
    rng = random.Random(seed)
    picks: list[tuple[str, int, float]] = []
    while len(picks) < n:
        working = rng.sample(CATALOGUE, 3)
        picks.extend(working[i % 3] for i in range(50))
    return _requests(picks[:n])


def _moving_trace(seed: int, n: int = 2000, period: int = 300) -> list[Request]:
    rng = random.Random(seed)
    models = list(CATALOGUE)
    rng.shuffle(models)
    weights = [1 / (r + 1) for r in range(len(models))]
    picks = []
    for i in range(n):
        if i and i % period == 0:
            models = models[3:] + models[:3]
        picks.append(rng.choices(models, weights)[0])
    return _requests(picks)


def _total(
    traces: Sequence[list[Request]], budget: int, policy: str | Callable[[], CostAware]
) -> float:
    return statistics.mean(
        replay(
            trace,
            {"m": budget},
            policy if isinstance(policy, str) else policy(),
            timing="sequential",
        ).reload_seconds
        for trace in traces
    )


@pytest.mark.parametrize("budget", [48 * GiB, 64 * GiB, 80 * GiB])
def test_tuned_cost_beats_lru_on_skewed_popularity(budget: int) -> None:
    traces = [_zipf_trace(seed) for seed in range(3)]
    assert _total(traces, budget, "cost") < 0.8 * _total(traces, budget, "lru")


@pytest.mark.parametrize("budget", [48 * GiB, 64 * GiB, 80 * GiB])
def test_tuned_cost_is_no_worse_than_lru_where_recency_is_all(budget: int) -> None:
    traces = [_recency_trace(seed) for seed in range(3)]
    assert _total(traces, budget, "cost") <= 1.02 * _total(traces, budget, "lru")


@pytest.mark.parametrize(
    ("make", "budget"), [(_zipf_trace, 64 * GiB), (_moving_trace, 64 * GiB)], ids=["zipf", "moving"]
)
def test_tuned_cost_is_near_the_best_fixed_memory(
    make: Callable[[int], list[Request]], budget: int
) -> None:
    """Within 5% of the best of the half-lives it chooses among, on each kind of workload."""
    traces = [make(seed) for seed in range(3)]
    fixed = [
        _total(traces, budget, functools.partial(CostAware, half_life=h))
        for h in CostAware.HALF_LIVES
    ]
    assert _total(traces, budget, CostAware) <= 1.05 * min(fixed)


def test_a_switch_of_memory_with_heaps_chooses_as_without() -> None:
    """Heaps are kept for every half-life, so a switch needs no rebuild and changes no choice."""
    with_heaps, without = CostAware(), CostAware()
    with_heaps.heap_above = 0
    clock = [0]
    items = [Item(f"k{i}", clock, size=1 + i % 7, cost=1.0 + i % 5) for i in range(40)]
    for policy in (with_heaps, without):
        for item in items:
            policy.admit(item)
    rng = random.Random(3)
    seen = set()
    for phase in range(6):
        stream = (
            rng.choices(items, [1 / (r + 1) for r in range(40)], k=3000)
            if phase % 2 == 0
            else [items[(phase * 7 + i % 3) % 40] for i in range(3000)]
        )
        for item in stream:
            clock[0] += 1
            item.last_request = clock[0]
            with_heaps.touch(item)
            without.touch(item)
        for need in (1, 9, 30):
            chosen = [v.key for v in with_heaps.victims({"m": need})]
            assert chosen == [v.key for v in without.victims({"m": need})]
        assert with_heaps.half_life == without.half_life
        seen.add(with_heaps.half_life)
    assert len(seen) > 1  # the memory did switch on the way
