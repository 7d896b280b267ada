"""CostAware's choice of a victim *set*, checked against the rule it states.

The policy is driven directly with hand-made entries (anything that satisfies
``PolicyEntry``), so each test controls ranks and values exactly; one example
goes through the core as well. The reference below restates the rule of
``CostAware`` (see its docstring) with plain lists: from a pool of
candidates, the cheaper of a greedy cover by value per share of the
shortfall, pruned of members it does not need, and the same greedy cover
started from each of the 8 entries covering the largest share; "cheaper"
counting each byte freed beyond the shortfall at half the least value per
byte in the pool.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

from cachebroker import CostAware, PolicyEntry
from cachebroker._core import Reason, Request
from tests.harness import Harness

HALF_LIFE = 4.0


class Item:
    """An entry as a policy sees it, made by hand."""

    def __init__(self, key: str, charge: Mapping[str, int], cost: float, tick: int) -> None:
        self.key = key
        self.cache = "c"
        self.charge = dict(charge)
        self.cost = cost
        self.requests = 1
        self.last_request = tick
        self.idle_seq = 0

    @property
    def idle(self) -> bool:
        return self.idle_seq != 0

    def __repr__(self) -> str:
        return f"Item({self.key!r}, {self.charge}, cost={self.cost}, tick={self.last_request})"


def load(policy: CostAware, items: Sequence[Item], *, leased: Sequence[Item] = ()) -> None:
    """Request, load and (unless ``leased``) idle each item in order, as the core would."""
    for seq, item in enumerate(items, 1):
        policy.touch(item)
        policy.admit(item)
        if item not in leased:
            item.idle_seq = seq
            policy.idle(item)


def as_items(victims: Sequence[PolicyEntry]) -> list[Item]:
    """The victims, which must be entries the policy was given."""
    items = [v for v in victims if isinstance(v, Item)]
    assert len(items) == len(victims)
    return items


def value(item: Item, now: int) -> float:
    """The expected reload cost of an item requested once, at ``item.last_request``."""
    return float(2.0 ** ((item.last_request - now) / HALF_LIFE) * max(item.cost, 1e-6))


def rank(item: Item, size: int) -> float:
    """CostAware's rank of an item requested once, in a space where it holds ``size`` bytes.

    log2 of the rate (1 request: 0.0) shifted by tick / half-life, plus log2 of cost per byte.
    """
    return (0.0 + item.last_request / HALF_LIFE) + math.log2(max(item.cost, 1e-6) / max(size, 1))


def covers(chosen: Sequence[Item], need: Mapping[str, int]) -> bool:
    return all(sum(e.charge.get(s, 0) for e in chosen) >= n for s, n in need.items() if n > 0)


def cost(chosen: Sequence[Item], values: Mapping[Item, float]) -> float:
    return sum(values[e] for e in chosen)


def charge(
    chosen: Sequence[Item],
    values: Mapping[Item, float],
    need: Mapping[str, int],
    pool: Sequence[Item],
) -> float:
    """What the rule minimises: the values, less half the least value per byte in
    ``pool`` (per short space) for each byte freed beyond the shortfall."""
    total = cost(chosen, values)
    for space, n in need.items():
        densities = [values[e] / e.charge[space] for e in pool if e.charge.get(space)]
        surplus = sum(e.charge.get(space, 0) for e in chosen) - n
        total -= 0.5 * min(densities, default=0.0) * surplus
    return total


def reference_cover(
    pool: Sequence[Item], shortfall: Mapping[str, int], values: Mapping[Item, float]
) -> list[Item]:
    """The rule of ``CostAware`` for choosing a covering set among ``pool``."""
    need = {s: n for s, n in shortfall.items() if n > 0}
    if not pool or not need:
        return []

    def share(e: Item) -> float:  # of the shortfall that ``e`` covers
        return sum(min(e.charge.get(s, 0), n) / n for s, n in need.items())

    by_density = sorted((e for e in pool if share(e) > 0), key=lambda e: values[e] / share(e))

    def greedy(start: list[Item]) -> list[Item] | None:
        chosen = list(start)
        for e in by_density:
            if covers(chosen, need):
                break
            if e not in chosen:
                chosen.append(e)
        if not covers(chosen, need):
            return None
        for e in sorted(chosen, key=lambda e: -values[e]):
            rest = [x for x in chosen if x is not e]
            if covers(rest, need):
                chosen = rest
        return chosen

    best = greedy([])
    if best is None:
        return []
    for anchor in sorted(pool, key=share, reverse=True)[:8]:
        if anchor is by_density[0] or not share(anchor):
            continue
        option = greedy([anchor])
        if option is not None and charge(option, values, need, pool) < charge(
            best, values, need, pool
        ):
            best = option
    return best


def check_against_brute_force(
    victims: Sequence[Item],
    idle: Sequence[Item],
    shortfall: Mapping[str, int],
    values: Mapping[Item, float],
) -> None:
    """What any choice by the rule satisfies, checked over every subset of ``idle``."""
    assert len(set(victims)) == len(victims)
    assert all(v in idle for v in victims)
    if not covers(idle, shortfall):
        assert victims == []
        return
    assert covers(victims, shortfall)
    # Irredundant: no proper subset covers (a covering set stays covering when grown).
    for v in victims:
        assert not covers([x for x in victims if x is not v], shortfall), f"{v} not needed"
    # Never dearer than a single entry that covers alone (each one is an anchor).
    need = {s: n for s, n in shortfall.items() if n > 0}
    singles = [charge([e], values, need, idle) for e in idle if covers([e], need)]
    if len(idle) <= 8 and singles:
        assert charge(victims, values, need, idle) <= min(singles) * (1 + 1e-12) + 1e-12
    # And never cheaper than the best cover of all (sanity of the brute force).
    best = min(
        cost(subset, values)
        for size in range(1, len(idle) + 1)
        for subset in itertools.combinations(idle, size)
        if covers(subset, shortfall)
    )
    assert cost(victims, values) >= best * (1 - 1e-12)  # sums in another order


# -- several short spaces -----------------------------------------------------


def test_cost_policy_covers_a_shortfall_in_two_spaces_through_the_core() -> None:
    """Two entries each charged in one space are cheaper than one charged in both."""
    h = Harness({"gpu": 100, "ram": 100}, policy=CostAware(), instant=True)
    for key, need, reload in (
        ("gpu-only", {"gpu": 50}, 1.0),
        ("ram-only", {"ram": 50}, 1.0),
        ("both", {"gpu": 50, "ram": 50}, 5.0),
    ):
        ticket = h.core.request(h.owner, Request(key, need, cost=reload), 1)
        h.drain()
        h.end(ticket)
    ticket = h.core.request(h.owner, Request("new", {"gpu": 50, "ram": 50}, cost=1.0), 1)
    h.drain()
    assert ticket.outcome is True
    assert sorted(str(k) for k, _ in h.released) == ["gpu-only", "ram-only"]
    assert {reason for _, reason in h.released} == {Reason.CAPACITY}


@st.composite
def two_space_instances(draw: st.DrawFn) -> tuple[list[Item], list[Item], dict[str, int]]:
    """Up to 7 entries charged in gpu, ram (and disk, never short); some leased."""
    items: list[Item] = []
    tick = 0
    for index in range(draw(st.integers(1, 7))):
        tick += draw(st.integers(1, 3))
        charge = draw(
            st.fixed_dictionaries(
                {},
                optional={
                    "gpu": st.integers(1, 12),
                    "ram": st.integers(1, 12),
                    "disk": st.integers(1, 12),
                },
            )
        )
        reload = draw(st.sampled_from([0.5, 1.0, 2.0, 3.0, 8.0]))
        items.append(Item(f"k{index}", charge, reload, tick))
    leased = [item for item in items if draw(st.integers(0, 4)) == 0]
    shortfall = {"gpu": draw(st.integers(1, 20)), "ram": draw(st.integers(1, 20))}
    return items, leased, shortfall


@settings(deadline=None)
@given(two_space_instances())
def test_cost_policy_chooses_by_its_rule_when_two_spaces_are_short(
    instance: tuple[list[Item], list[Item], dict[str, int]],
) -> None:
    items, leased, shortfall = instance
    policy = CostAware(half_life=HALF_LIFE)
    load(policy, items, leased=leased)
    now = items[-1].last_request
    values = {item: value(item, now) for item in items}
    # At most 7 entries, fewer than the 24 candidates: every idle entry is one.
    idle = [item for item in items if item not in leased]

    victims = as_items(policy.victims(shortfall))
    note(f"victims {victims}")
    assert victims == reference_cover(idle, shortfall, values)
    check_against_brute_force(victims, idle, shortfall, values)


# -- more idle entries than candidates ----------------------------------------


def per_byte(key: str, size: int, price: float) -> Item:
    """An entry of ``size`` bytes in space m whose reload costs ``price`` per byte.

    All are requested at the same tick, so they rank by ``price`` and their
    values are their costs.
    """
    return Item(key, {"m": size}, size * price, tick=1)


@pytest.mark.parametrize("heap_above", [None, 0])
@pytest.mark.parametrize("admitted", ["by rank", "reversed"])
@pytest.mark.parametrize("beyond", [1, 2, 4])
def test_cost_policy_chooses_among_its_candidates_only(
    heap_above: int | None, admitted: str, beyond: int
) -> None:
    """candidates=3: the cover of 10 bytes is chosen among the 3 lowest-ranked entries.

    Cheaper covers ranked after them are not considered, however many there
    are (``beyond``), and what ranks is cost per byte, not admission order.
    """
    specs = [
        ("big-1", 100, 0.10),  # ranked 1st, value 10
        ("big-2", 100, 0.11),  # 2nd, value 11
        ("mid", 50, 0.12),  # 3rd, value 6 (less 2 of credit): the cheapest among the first three
        ("small-1", 10, 0.20),  # 4th, value 2: cheaper, but beyond the cut
        ("small-2", 10, 0.21),
        ("small-3", 10, 0.22),
        ("small-4", 10, 0.23),
    ][: 3 + beyond]
    items = [per_byte(*spec) for spec in specs]
    if admitted == "reversed":
        items.reverse()
    policy = CostAware(half_life=HALF_LIFE, candidates=3)
    if heap_above is not None:
        policy.heap_above = heap_above
    load(policy, items)
    assert [v.key for v in policy.victims({"m": 10})] == ["mid"]


@pytest.mark.parametrize("heap_above", [None, 0])
def test_cost_policy_takes_more_candidates_until_they_cover(heap_above: int | None) -> None:
    """candidates=2: the two lowest-ranked cover 20 of 25 bytes, so the third joins them.

    The cover is then chosen among those three (all are needed), not among
    more: "whole", ranked 4th, would cover alone for less (3.125 < 3.3).
    """
    items = [
        per_byte("a", 10, 0.10),  # ranked 1st, value 1.0
        per_byte("b", 10, 0.11),  # 2nd, value 1.1
        per_byte("c", 10, 0.12),  # 3rd, value 1.2
        per_byte("whole", 25, 0.125),  # 4th, value 3.125
        per_byte("later", 30, 0.5),  # 5th
    ]
    policy = CostAware(half_life=HALF_LIFE, candidates=2)
    if heap_above is not None:
        policy.heap_above = heap_above
    load(policy, items)
    assert [v.key for v in policy.victims({"m": 25})] == ["a", "b", "c"]


def reference_pool(
    items: Sequence[Item], leased: Sequence[Item], shortfall: Mapping[str, int], candidates: int
) -> list[Item]:
    """The entries CostAware chooses among: the ``candidates`` lowest-ranked idle
    entries of the short spaces, then the next ones by rank that help, until covered."""
    idle = [item for item in items if item not in leased]
    if len(items) <= candidates:
        return idle  # every resident entry is a candidate
    need = {s: n for s, n in shortfall.items() if n > 0}
    # An entry ranks by its lowest rank in the short spaces it is charged in;
    # ties go to the entry loaded first.
    ranked = sorted(
        (min(rank(e, e.charge[s]) for s in need if s in e.charge), index, e)
        for index, e in enumerate(idle)
        if any(s in e.charge for s in need)
    )
    pool: list[Item] = []
    for _, _, e in ranked:
        if len(pool) >= candidates:
            if covers(pool, need):
                break
            still_short = [s for s, n in need.items() if sum(x.charge.get(s, 0) for x in pool) < n]
            if not any(s in e.charge for s in still_short):
                continue
        pool.append(e)
    return pool


@st.composite
def crowded_instances(
    draw: st.DrawFn,
) -> tuple[list[Item], list[Item], dict[str, int], int]:
    """More entries than candidates (1-3), in one or two short spaces; some leased."""
    candidates = draw(st.integers(1, 3))
    spaces = draw(st.sampled_from([("m",), ("gpu", "ram")]))
    items: list[Item] = []
    tick = 0
    for index in range(candidates + draw(st.integers(1, 4))):
        tick += draw(st.integers(0, 2))
        charged = draw(st.lists(st.sampled_from(spaces), min_size=1, unique=True))
        # Sizes far apart, so that a small entry ranked beyond the cut (dear
        # per byte) can be a cheaper cover than the big ones before it.
        charge = {space: draw(st.sampled_from([4, 10, 25, 60])) for space in charged}
        reload = draw(st.sampled_from([0.5, 1.0, 2.0, 4.0, 8.0]))
        items.append(Item(f"k{index}", charge, reload, tick))
    leased = [item for item in items if draw(st.integers(0, 4)) == 0]
    shortfall = {space: draw(st.integers(1, 12)) for space in spaces}
    return items, leased, shortfall, candidates


@settings(deadline=None)
@given(crowded_instances(), st.sampled_from([None, 0]))
def test_cost_policy_with_more_entries_than_candidates_follows_its_rule(
    instance: tuple[list[Item], list[Item], dict[str, int], int], heap_above: int | None
) -> None:
    items, leased, shortfall, candidates = instance
    policy = CostAware(half_life=HALF_LIFE, candidates=candidates)
    if heap_above is not None:
        policy.heap_above = heap_above
    load(policy, items, leased=leased)
    now = items[-1].last_request
    values = {item: value(item, now) for item in items}
    pool = reference_pool(items, leased, shortfall, candidates)
    note(f"pool {pool}")

    victims = as_items(policy.victims(shortfall))
    note(f"victims {victims}")
    assert victims == reference_cover(pool, shortfall, values)
    idle = [item for item in items if item not in leased]
    if covers(idle, shortfall):
        assert covers(victims, shortfall)  # the pool grows until it can cover
