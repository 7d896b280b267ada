"""``victims()`` is a question, ``evicted()`` the answer acted on.

The core asks a policy for victims to weigh options it may not take: the
places of a placed request (``_scheduler._place`` prices each), or whether a
value is worth its room a tier down (``_moves``). So asking must leave the
policy as it was, and what moves with an eviction (GDSF's clock) moves when
the core tells the policy it evicts (the optional ``evicted`` hook). The
books are driven directly (sans-I/O).
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, cast

import pytest

from cachebroker._core import Entry, Request, Ticket, _transitions
from cachebroker._core._scheduler import _place
from cachebroker._policies import GDSF, LRU, CostAware, PolicyEntry, make_policy
from cachebroker._policies._priorities import Priorities
from tests.harness import Harness

GPUS = ("gpu0", "gpu1")
POLICIES = ["lru", "fifo", "gdsf", "cost"]


def gpus(**options: Any) -> Harness:
    return Harness({"gpu0": 100, "gpu1": 100}, **options)


def idle(
    h: Harness,
    key: str,
    need: Mapping[str, int],
    *,
    cost: float | None = None,
    priority: int | None = None,
) -> Entry:
    """``key`` loaded and idle."""
    ticket = h.core.request(
        h.owner, Request(key, dict(need), cost=cost, priority=priority), "loader"
    )
    h.drain()
    h.finish(ticket.entry)
    h.end(ticket)
    return ticket.entry


def place(h: Harness, key: str, size: int, *, places: tuple[str, ...] = GPUS) -> Ticket:
    ticket = h.core.request(h.owner, Request(key, {places[0]: size}, places=places), "t")
    h.drain()
    return ticket


def state(policy: object) -> dict[str, Any]:
    """What the policy holds, as values that compare by content (entries by identity)."""
    names = {name for cls in type(policy).__mro__ for name in getattr(cls, "__slots__", ())}
    names.update(getattr(policy, "__dict__", {}))
    return {name: _frozen(getattr(policy, name)) for name in sorted(names) if name != "__dict__"}


def _frozen(value: Any) -> Any:
    if isinstance(value, dict):
        return ("dict", tuple((_frozen(k), _frozen(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return (type(value).__name__, tuple(_frozen(item) for item in value))
    if isinstance(value, set | frozenset):
        return frozenset(_frozen(item) for item in value)
    if isinstance(value, itertools.count):
        return repr(value)  # (the next number it gives)
    return value


@pytest.mark.parametrize("name", POLICIES)
def test_pricing_the_places_twice_gives_the_same_answer_and_changes_no_policy_state(
    name: str,
) -> None:
    policy = make_policy(name)
    h = gpus(policy=policy)
    idle(h, "a", {"gpu0": 80}, cost=50.0)
    idle(h, "b", {"gpu1": 80}, cost=5.0)
    _transitions.settle(h.core)  # (as every step does first: b's lease ended, it is idle now)
    if isinstance(policy, CostAware):
        # It folds the requests it logged into its estimates before any search,
        # whatever is asked: caught up first, a search changes nothing more.
        policy.victims({})
    waiter = Entry(h.owner, "c", {"gpu0": 60})  # a placed waiter, as the scheduler sees it
    waiter.places = GPUS
    before = state(policy)
    answers = []
    for _ in range(2):
        _place(h.core, waiter, {}, set(), {})  # both places must evict: both are priced
        answers.append(waiter.need)
        assert state(policy) == before
    assert answers == [{"gpu1": 60}, {"gpu1": 60}]  # b reloads faster than a
    assert h.released == []  # (weighing evicts nothing)
    h.core.check()


def test_the_gdsf_clock_moves_exactly_when_an_entry_is_evicted() -> None:
    policy = GDSF()
    h = gpus(policy=policy)
    a = idle(h, "a", {"gpu0": 80}, cost=50.0)  # priority 0 + 1 x 50 / 80
    b = idle(h, "b", {"gpu1": 80}, cost=5.0)  # priority 0 + 1 x 5 / 80
    _transitions.settle(h.core)  # (as every step does first: b's lease ended, it is idle now)
    assert policy.victims({"gpu0": 60}) == [a] and policy.victims({"gpu1": 60}) == [b]
    assert policy.clock == 0.0  # asked, not evicted
    place(h, "c", 60)  # priced in both places, evicts b
    assert [key for key, _ in h.released] == ["b"]
    assert policy.clock == 5.0 / 80
    h.ack(b)  # b leaves the books: the clock stays where its eviction put it
    assert policy.clock == 5.0 / 80
    assert h.core.invalidate(h.owner, "a")  # released, but no victim: no aging
    h.drain()
    assert policy.clock == 5.0 / 80


def test_the_gdsf_clock_rises_to_the_lowest_priority_of_a_victim_over_the_short_spaces() -> None:
    policy = GDSF()
    h = gpus(policy=policy)
    wide = idle(h, "w", {"gpu0": 80, "gpu1": 20}, cost=8.0)  # 8/80 in gpu0, 8/20 in gpu1
    policy.evicted([wide], {"gpu0": 10, "gpu1": 10})
    assert policy.clock == 8.0 / 80
    policy.evicted([wide], {"gpu1": 10})
    assert policy.clock == 8.0 / 20


def test_a_value_released_instead_of_demoted_ages_gdsf_by_its_own_priority_only() -> None:
    policy = GDSF()
    h = Harness({"gpu0": 100, "ram": 90}, tiers={"gpu0": "ram"}, moves=True, policy=policy)
    lease = h.core.request(h.owner, Request("a", {"gpu0": 20}, cost=4.0), "u")
    h.drain()
    h.finish(lease.entry)  # a: priority 0 + 1 x 4 / 20 = 0.2, leased for now
    idle(h, "z", {"gpu0": 80}, cost=40.0)  # priority 0 + 1 x 40 / 80 = 0.5
    h.acquire("y", {"gpu0": 70}, task="v")  # evicts z: it moves down to ram
    assert policy.clock == 0.5
    ((z, _),) = h.moving
    h.move(z)  # in ram, z ranks 0.5 + 1 x 40 / 80 = 1.0
    h.finish(h.owner.entries["y"])
    h.end(lease)
    # a is evicted for x. A tier down it would rank 0.5 + 1 x 4 / 20 = 0.7,
    # below z: the policy would rather drop a than z there, so a is released,
    # and that weighing ages nobody.
    h.acquire("x", {"gpu0": 30}, task="w")
    assert [key for key, _ in h.released] == ["a"]
    assert policy.clock == 0.5  # a's own priority (0.2) is below it: unchanged
    h.core.check()


class Recording(LRU):
    """LRU that records what it is told of evictions."""

    def __init__(self) -> None:
        super().__init__()
        self.told: list[tuple[list[Hashable], dict[str, int]]] = []

    def evicted(self, victims: Sequence[PolicyEntry], shortfall: Mapping[str, int]) -> None:
        self.told.append(([v.key for v in victims], dict(shortfall)))


def test_a_policy_is_told_of_the_victims_the_core_evicts_and_not_of_those_it_weighed() -> None:
    policy = Recording()
    h = gpus(policy=policy)
    idle(h, "a", {"gpu0": 80}, cost=50.0)
    idle(h, "b", {"gpu1": 80}, cost=5.0)
    place(h, "c", 60)  # weighs a (gpu0) and b (gpu1); evicts b
    assert policy.told == [(["b"], {"gpu1": 40})]


class Plain:
    """A policy written against the protocol alone, without ``evicted``."""

    def __init__(self) -> None:
        self.candidates: dict[PolicyEntry, None] = {}

    def touch(self, entry: PolicyEntry) -> None:
        pass

    def admit(self, entry: PolicyEntry) -> None:
        pass

    def idle(self, entry: PolicyEntry) -> None:
        self.candidates[entry] = None

    def busy(self, entry: PolicyEntry) -> None:
        self.candidates.pop(entry, None)

    def remove(self, entry: PolicyEntry) -> None:
        self.candidates.pop(entry, None)

    def victims(self, shortfall: Mapping[str, int]) -> list[PolicyEntry]:
        return [e for e in self.candidates if not shortfall.keys().isdisjoint(e.charge)][:1]


def test_a_policy_without_the_evicted_hook_still_evicts() -> None:
    policy = Plain()
    h = gpus(policy=make_policy(policy))
    idle(h, "a", {"gpu0": 80})
    place(h, "c", 60, places=("gpu0",))
    assert [key for key, _ in h.released] == ["a"]
    h.core.check()


def test_each_priority_s_policy_is_told_of_its_own_victims_only() -> None:
    h = gpus(policy=GDSF())
    low = idle(h, "low", {"gpu0": 50}, cost=10.0, priority=0)  # 10 / 50
    idle(h, "high", {"gpu0": 40}, cost=4.0, priority=1)  # 4 / 40
    priorities = h.core.policy
    assert isinstance(priorities, Priorities)
    place(h, "c", 60, places=("gpu0",))  # 10 free: low goes first, and covers
    assert [key for key, _ in h.released] == ["low"]
    clocks = {p: cast(GDSF, policy).clock for p, policy in priorities.policies.items()}
    assert clocks == {0: 10.0 / 50, 1: 0.0}
    h.ack(low)
    h.core.check()
