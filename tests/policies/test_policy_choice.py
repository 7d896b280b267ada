"""The built-in policies' victim choice, rule by rule, on small hand-made examples.

Each policy (and the covering helpers it ends with: ``cover``,
``_take_covering``, ``_cheapest_cover``, and ``Priorities`` over them) is
driven directly with fake entries whose charge, cost, rank and idleness the
test sets exactly, then asked ``victims(shortfall)``. One rule per test:
which entries count (idle ones charged in a space that is short, once
each), in what order they are taken (recency, load order, rank, priority),
when the cover is complete (the last byte counts, an overshoot ends it),
what a space with no need changes (nothing), and how ``Priorities`` hands
the rest of a shortfall from one priority to the next. They are the fast
tests the mutation run (``nox -s mutants``) relies on to kill the mutants of
the victim choice, so each is an exact example, not a search.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence

import pytest

from cachebroker import FIFO, GDSF, LRU, CostAware, Policy, PolicyBase, PolicyEntry
from cachebroker._policies._cover import cover
from cachebroker._policies._priorities import Priorities
from cachebroker._policies._ranked import _cheapest_cover, _take_covering


class Item:
    """An entry as a policy sees it, made by hand (``priority`` for ``Priorities``)."""

    def __init__(
        self,
        key: str,
        charge: Mapping[str, int],
        *,
        cost: float = 1.0,
        requests: int = 1,
        tick: int = 1,
        priority: int = 0,
    ) -> None:
        self.key = key
        self.cache = "c"
        self.charge = dict(charge)
        self.cost = cost
        self.requests = requests
        self.last_request = tick
        self.priority = priority
        self.idle_seq = 0

    @property
    def idle(self) -> bool:
        return self.idle_seq != 0

    def __repr__(self) -> str:
        return f"Item({self.key!r}, {self.charge})"


#: The idle_seq an entry gets each time it becomes idle (it only grows).
_seq = itertools.count(1)


def settle(policy: Policy, items: Sequence[Item], *, leased: Sequence[Item] = ()) -> None:
    """Request, load and (unless ``leased``) idle each item in order, as the core would."""
    for item in items:
        policy.touch(item)
        policy.admit(item)
        if item not in leased:
            item.idle_seq = next(_seq)
            policy.idle(item)


def keys(victims: Sequence[PolicyEntry]) -> list[str]:
    return [str(v.key) for v in victims]


RECENCY: list[Callable[[], Policy]] = [LRU, FIFO]
ALL: list[Callable[[], Policy]] = [LRU, FIFO, GDSF, CostAware]


def in_order(make: Callable[[], Policy], specs: Sequence[tuple[str, Mapping[str, int]]]) -> Policy:
    """``make()`` with an entry per spec, loaded and idle in that order (all of the
    same cost and tick: GDSF and CostAware rank them by size alone)."""
    policy = make()
    settle(policy, [Item(key, charge) for key, charge in specs])
    return policy


# -- cover: which entries count, and when the cover is complete ---------------


@pytest.mark.parametrize("make", ALL)
def test_an_exact_cover_takes_no_more(make: Callable[[], Policy]) -> None:
    policy = in_order(make, [("a", {"m": 5}), ("b", {"m": 5}), ("c", {"m": 5})])
    assert len(policy.victims({"m": 10})) == 2


@pytest.mark.parametrize("make", RECENCY)
def test_an_overshoot_ends_the_cover(make: Callable[[], Policy]) -> None:
    policy = in_order(make, [("a", {"m": 7}), ("b", {"m": 7}), ("c", {"m": 7})])
    assert keys(policy.victims({"m": 10})) == ["a", "b"]


@pytest.mark.parametrize("make", RECENCY)
def test_the_last_byte_of_a_shortfall_counts(make: Callable[[], Policy]) -> None:
    policy = in_order(make, [("a", {"m": 9}), ("b", {"m": 1}), ("c", {"m": 5})])
    assert keys(policy.victims({"m": 10})) == ["a", "b"]
    assert keys(policy.victims({"m": 1})) == ["a"]


@pytest.mark.parametrize("make", ALL)
def test_spaces_with_no_need_are_not_short(make: Callable[[], Policy]) -> None:
    """Zero and negative needs change nothing: their entries are not taken."""
    policy = in_order(make, [("zero", {"z": 5}), ("minus", {"n": 5}), ("m", {"m": 5})])
    assert keys(policy.victims({"z": 0, "n": -3, "m": 5})) == ["m"]
    assert policy.victims({"z": 0, "n": -3}) == []


@pytest.mark.parametrize("make", ALL)
def test_an_empty_shortfall_chooses_nothing(make: Callable[[], Policy]) -> None:
    policy = in_order(make, [("a", {"m": 5})])
    assert policy.victims({}) == []


@pytest.mark.parametrize("make", ALL)
def test_leased_entries_are_never_victims(make: Callable[[], Policy]) -> None:
    policy = make()
    items = [Item("leased", {"m": 5}), Item("a", {"m": 5}), Item("b", {"m": 5})]
    settle(policy, items, leased=items[:1])
    assert sorted(keys(policy.victims({"m": 10}))) == ["a", "b"]
    assert policy.victims({"m": 15}) in ([], items[1:])  # too few, never the leased one


@pytest.mark.parametrize("make", RECENCY)
def test_too_few_idle_entries_give_what_there_is(make: Callable[[], Policy]) -> None:
    policy = in_order(make, [("a", {"m": 5}), ("b", {"m": 5})])
    assert keys(policy.victims({"m": 15})) == ["a", "b"]


@pytest.mark.parametrize("make", RECENCY)
def test_an_entry_short_in_two_spaces_is_taken_once(make: Callable[[], Policy]) -> None:
    both = [("x", {"a": 5, "b": 5}), ("y", {"a": 5, "b": 5}), ("z", {"a": 5, "b": 5})]
    policy = in_order(make, both)
    assert keys(policy.victims({"a": 10, "b": 10})) == ["x", "y"]


@pytest.mark.parametrize("make", RECENCY)
def test_two_short_spaces_merge_their_orders(make: Callable[[], Policy]) -> None:
    """Each short space's order is drawn on, oldest first across both; entries of a
    space already covered are passed over."""
    policy = in_order(
        make, [("b1", {"b": 5}), ("a1", {"a": 5}), ("a2", {"a": 5}), ("b2", {"b": 5})]
    )
    assert keys(policy.victims({"a": 5, "b": 5})) == ["b1", "a1"]
    assert keys(policy.victims({"a": 5, "b": 10})) == ["b1", "a1", "b2"]
    assert keys(policy.victims({"b": 5, "a": 10})) == ["b1", "a1", "a2"]


def test_lru_goes_by_the_last_time_idle_fifo_by_load_order() -> None:
    policy = LRU()
    a, b, c = Item("a", {"m": 5}), Item("b", {"m": 5}), Item("c", {"m": 5})
    settle(policy, [a, b, c])
    a.idle_seq = 0  # a hit: leased, then idle again, now the most recent
    policy.busy(a)
    a.idle_seq = next(_seq)
    policy.idle(a)
    assert keys(policy.victims({"m": 10})) == ["b", "c"]
    fifo = FIFO()
    settle(fifo, [a, b, c])
    assert keys(fifo.victims({"m": 10})) == ["a", "b"]


def test_cover_stops_reading_candidates_once_covered() -> None:
    """Candidates may be costly to produce (a heap walk): cover reads at most one
    past the candidate that completes it."""
    items = [Item(k, {"m": 5}) for k in "abcd"]
    for item in items:
        item.idle_seq = next(_seq)
    read: list[str] = []

    def candidates() -> Iterator[PolicyEntry]:
        for item in items:
            read.append(item.key)
            yield item

    assert keys(cover(candidates(), {"m": 10})) == ["a", "b"]
    assert len(read) <= 3


def test_cover_skips_repeated_and_leased_candidates() -> None:
    a, b, c = Item("a", {"m": 5}), Item("b", {"m": 5}), Item("c", {"m": 5})
    a.idle_seq, c.idle_seq = 1, 2  # b is leased
    assert keys(cover(iter([a, a, b, c]), {"m": 10})) == ["a", "c"]


# -- the ranked policies: the lowest rank in any short space goes first --------


HEAPS = [None, 0]  # sorting on the spot, and heaps from the first entry


def ranked(make: Callable[[], GDSF | CostAware], heap_above: int | None) -> GDSF | CostAware:
    policy = make()
    if heap_above is not None:
        policy.heap_above = heap_above
    return policy


@pytest.mark.parametrize("heap_above", HEAPS)
def test_gdsf_takes_the_lowest_priority_first(heap_above: int | None) -> None:
    policy = ranked(GDSF, heap_above)
    items = [Item(k, {"m": 5}, cost=c) for k, c in (("dear", 9.0), ("cheap", 1.0), ("mid", 4.0))]
    settle(policy, items)
    assert keys(policy.victims({"m": 5})) == ["cheap"]
    assert keys(policy.victims({"m": 10})) == ["cheap", "mid"]
    assert keys(policy.victims({"m": 15})) == ["cheap", "mid", "dear"]
    assert keys(policy.victims({"m": 10})) == ["cheap", "mid"]  # asking changed nothing


@pytest.mark.parametrize("heap_above", HEAPS)
def test_gdsf_ranks_an_entry_by_its_lowest_short_space(heap_above: int | None) -> None:
    """Across two short spaces the lowest rank goes first, whichever space it is in."""
    policy = ranked(GDSF, heap_above)
    items = [
        Item("a3", {"a": 5}, cost=3.0),
        Item("b1", {"b": 5}, cost=1.0),
        Item("ab2", {"a": 5, "b": 5}, cost=2.0),
        Item("b4", {"b": 5}, cost=4.0),
    ]
    settle(policy, items)
    assert keys(policy.victims({"a": 5, "b": 5})) == ["b1", "ab2"]
    assert keys(policy.victims({"a": 5, "b": 10})) == ["b1", "ab2"]
    assert keys(policy.victims({"a": 10, "b": 10})) == ["b1", "ab2", "a3"]
    assert keys(policy.victims({"b": 5, "a": 5})) == ["b1", "ab2"]  # whichever is named first


@pytest.mark.parametrize("heap_above", HEAPS)
def test_gdsf_does_not_rank_by_a_space_that_is_not_short(heap_above: int | None) -> None:
    """wide holds 100 bytes of b (so ranks low there), but b has no need."""
    policy = ranked(GDSF, heap_above)
    settle(policy, [Item("wide", {"a": 1, "b": 100}, cost=1.0), Item("narrow", {"a": 1}, cost=0.5)])
    assert keys(policy.victims({"a": 1, "b": 0})) == ["narrow"]
    assert keys(policy.victims({"a": 1, "b": -1})) == ["narrow"]
    assert keys(policy.victims({"a": 1, "b": 1})) == ["wide"]


@pytest.mark.parametrize("heap_above", HEAPS)
def test_gdsf_reranks_a_requested_entry(heap_above: int | None) -> None:
    """A request re-ranks the entry: its old rank (a stale heap item) no longer counts."""
    policy = ranked(GDSF, heap_above)
    low, high = Item("low", {"m": 5}, cost=1.0), Item("high", {"m": 5}, cost=2.0)
    settle(policy, [low, high])
    assert keys(policy.victims({"m": 5})) == ["low"]
    low.idle_seq = 0
    policy.busy(low)
    low.requests = 5
    policy.touch(low)
    low.idle_seq = next(_seq)
    policy.idle(low)
    assert keys(policy.victims({"m": 5})) == ["high"]
    policy.remove(high)
    high.idle_seq = 0
    assert keys(policy.victims({"m": 5})) == ["low"]


@pytest.mark.parametrize("heap_above", HEAPS)
def test_gdsf_passes_leased_entries_and_finds_them_once_idle(heap_above: int | None) -> None:
    """The heap walk sets leased entries aside and puts them back."""
    policy = ranked(GDSF, heap_above)
    cheap, dear = Item("cheap", {"m": 5}, cost=1.0), Item("dear", {"m": 5}, cost=2.0)
    settle(policy, [cheap, dear], leased=[cheap])
    assert keys(policy.victims({"m": 5})) == ["dear"]
    assert keys(policy.victims({"m": 5})) == ["dear"]
    cheap.idle_seq = next(_seq)
    policy.idle(cheap)
    assert keys(policy.victims({"m": 5})) == ["cheap"]
    assert keys(policy.victims({"m": 10})) == ["cheap", "dear"]


# -- _take_covering: the first ranked, at least so many, enough to cover ------


def entries(*specs: tuple[str, Mapping[str, int]]) -> list[PolicyEntry]:
    return [Item(key, charge) for key, charge in specs]


def test_take_covering_stops_once_covered() -> None:
    read: list[str] = []
    items = entries(("a", {"m": 5}), ("b", {"m": 5}), ("c", {"m": 5}))

    def lazily() -> Iterator[PolicyEntry]:
        for entry in items:
            read.append(str(entry.key))
            yield entry

    for at_least in (0, 2):
        read.clear()
        assert keys(_take_covering(lazily(), {"m": 10}, at_least)) == ["a", "b"]
        assert read == ["a", "b"]


def test_take_covering_takes_at_least_as_many_as_asked() -> None:
    items = entries(("a", {"m": 5}), ("other", {"o": 5}), ("b", {"m": 5}), ("c", {"m": 5}))
    assert keys(_take_covering(iter(items), {"m": 5}, 3)) == ["a", "other", "b"]
    assert keys(_take_covering(iter(items), {"m": 15}, 1)) == ["a", "b", "c"]


def test_take_covering_passes_entries_of_covered_spaces_beyond_at_least() -> None:
    """Past ``at_least``, an entry adds to the pool only if a space it is in is still short."""
    items = entries(
        ("a1", {"a": 8}), ("a2", {"a": 8}), ("a3", {"a": 10}), ("b1", {"b": 10}), ("b2", {"b": 5})
    )
    assert keys(_take_covering(iter(items), {"a": 10, "b": 10}, 1)) == ["a1", "a2", "b1"]


def test_take_covering_ignores_spaces_with_no_need() -> None:
    items = entries(("a", {"m": 5}), ("b", {"m": 5}), ("z", {"z": 5}))
    assert keys(_take_covering(iter(items), {"m": 5, "z": 0}, 1)) == ["a"]
    assert keys(_take_covering(iter(items), {"m": 5, "z": -1}, 1)) == ["a"]


def test_take_covering_counts_the_last_byte() -> None:
    items = entries(("a", {"m": 9}), ("b", {"m": 1}), ("c", {"m": 5}))
    assert keys(_take_covering(iter(items), {"m": 10}, 1)) == ["a", "b"]
    items = entries(("a", {"m": 7}), ("b", {"m": 7}), ("c", {"m": 7}))
    assert keys(_take_covering(iter(items), {"m": 10}, 1)) == ["a", "b"]
    items = entries(("b", {"b": 5}), ("a", {"a": 1}))
    assert keys(_take_covering(iter(items), {"a": 1, "b": 5}, 1)) == ["b", "a"]


# -- CostAware: the cheapest cover among its candidates ------------------------


def per_byte(key: str, charge: Mapping[str, int], price: float) -> Item:
    """An entry whose reload costs ``price`` per byte of its (one) space: all are
    requested at the same tick, so they rank by price and are valued at their cost."""
    return Item(key, charge, cost=sum(charge.values()) * price, tick=1)


@pytest.mark.parametrize("heap_above", HEAPS)
def test_cost_policy_pool_grows_only_for_spaces_still_short(heap_above: int | None) -> None:
    """candidates=1: a1, a2 (to cover a), then b1 (for b); a3, ranked between, is not one
    of them, though a1, a3 and b1 would be the cheaper cover (2.7 against 2.98)."""
    policy = CostAware(half_life=4.0, candidates=1)
    if heap_above is not None:
        policy.heap_above = heap_above
    items = [
        per_byte("a1", {"a": 8}, 0.10),
        per_byte("a2", {"a": 8}, 0.11),
        per_byte("a3", {"a": 5}, 0.12),
        per_byte("b1", {"b": 10}, 0.13),
    ]
    settle(policy, items)
    assert sorted(keys(policy.victims({"a": 10, "b": 10}))) == ["a1", "a2", "b1"]


@pytest.mark.parametrize("heap_above", HEAPS)
def test_cost_policy_candidates_ignore_spaces_with_no_need(heap_above: int | None) -> None:
    """candidates=2: the cover of 10 bytes is chosen among the two lowest-ranked only,
    whatever other spaces the shortfall names with no need (small, in z too, is not
    taken for z)."""
    policy = CostAware(half_life=4.0, candidates=2)
    if heap_above is not None:
        policy.heap_above = heap_above
    items = [
        per_byte("big-1", {"m": 100}, 0.10),
        per_byte("mid", {"m": 50}, 0.12),
        per_byte("small", {"m": 10, "z": 1}, 0.20),
    ]
    settle(policy, items)
    assert keys(policy.victims({"m": 10})) == ["mid"]
    assert keys(policy.victims({"m": 10, "z": 0})) == ["mid"]
    assert keys(policy.victims({"m": 10, "z": -1})) == ["mid"]


def value_of(values: Mapping[str, float]) -> Callable[[PolicyEntry], float]:
    return lambda entry: values[str(entry.key)]


def test_cheapest_cover_prefers_the_cheaper_set_to_the_lower_ranks() -> None:
    """Greedy by value per share covered: two small cheap entries beat one dear big one."""
    pool: list[PolicyEntry] = [Item("big", {"m": 10}), Item("s1", {"m": 5}), Item("s2", {"m": 5})]
    chosen = _cheapest_cover(pool, {"m": 10}, value_of({"big": 3.0, "s1": 1.0, "s2": 1.0}))
    assert sorted(keys(chosen)) == ["s1", "s2"]
    chosen = _cheapest_cover(pool, {"m": 10}, value_of({"big": 1.5, "s1": 1.0, "s2": 1.0}))
    assert keys(chosen) == ["big"]


def test_cheapest_cover_prunes_members_it_does_not_need() -> None:
    """Greedy takes tiny (the best value per share), then big; big alone covers: tiny goes."""
    pool: list[PolicyEntry] = [Item("tiny", {"m": 1}), Item("big", {"m": 10})]
    chosen = _cheapest_cover(pool, {"m": 10}, value_of({"tiny": 0.05, "big": 1.0}))
    assert keys(chosen) == ["big"]


def dear_anchors(charge: Mapping[str, int]) -> tuple[list[PolicyEntry], dict[str, float]]:
    """Eight entries that cover alone but cost far too much: they take every anchor
    slot, so that the test sees the greedy cover itself."""
    return [Item(f"d{i}", charge) for i in range(8)], {f"d{i}": 100.0 for i in range(8)}


def test_cheapest_cover_is_greedy_by_value_per_share() -> None:
    """p (1.0 per share), q (1.083), r (1.1): p and q cover, so r is never reached."""
    pool, values = dear_anchors({"m": 10})
    pool += [Item("p", {"m": 6}), Item("q", {"m": 6}), Item("r", {"m": 4})]
    values |= {"p": 0.6, "q": 0.65, "r": 0.44}
    assert sorted(keys(_cheapest_cover(pool, {"m": 10}, value_of(values)))) == ["p", "q"]


def test_cheapest_cover_weighs_each_space_by_its_share_of_the_need() -> None:
    """a (1.0 per share) and b (1.1) come before ab (2.5 for two shares), though b's
    100 bytes outnumber a's 10: a share is a fraction of that space's need."""
    pool, values = dear_anchors({"a": 10, "b": 100})
    pool += [Item("a", {"a": 10}), Item("b", {"b": 100}), Item("ab", {"a": 10, "b": 100})]
    values |= {"a": 1.0, "b": 1.1, "ab": 2.5}
    chosen = _cheapest_cover(pool, {"a": 10, "b": 100}, value_of(values))
    assert sorted(keys(chosen)) == ["a", "b"]


def test_cheapest_cover_gives_no_share_of_a_space_an_entry_is_not_charged_in() -> None:
    """ab (0.975 per share) comes before a and b (1.0 each): ab alone (1.95) is the
    greedy cover."""
    pool, values = dear_anchors({"a": 10, "b": 10})
    pool += [Item("a", {"a": 10}), Item("b", {"b": 10}), Item("ab", {"a": 10, "b": 10})]
    values |= {"a": 1.0, "b": 1.0, "ab": 1.95}
    assert keys(_cheapest_cover(pool, {"a": 10, "b": 10}, value_of(values))) == ["ab"]


def test_cheapest_cover_prunes_the_most_valuable_member_first() -> None:
    """Greedy takes s, m, l (by value per share); without m or without s it still covers,
    not without both: m (0.44) goes, not s (0.40). The dear d's take the 8 anchor slots."""
    pool: list[PolicyEntry] = [Item("s", {"m": 4}), Item("m", {"m": 4}), Item("l", {"m": 6})]
    pool += [Item(f"d{i}", {"m": 10}) for i in range(8)]
    values = {"s": 0.4, "m": 0.44, "l": 0.9} | {f"d{i}": 100.0 for i in range(8)}
    assert sorted(keys(_cheapest_cover(pool, {"m": 10}, value_of(values)))) == ["l", "s"]


def test_cheapest_cover_credits_the_room_it_frees_beyond_the_shortfall() -> None:
    """small covers the 10 bytes exactly for 6.0; big covers them for 8.0 and frees 90
    bytes more, credited at half the least value per byte (big's 0.08): 8.0 - 3.6 =
    4.4, so big goes. Dearer per byte, the same room is worth less than small."""
    pool: list[PolicyEntry] = [Item("big", {"m": 100}), Item("small", {"m": 10})]
    assert keys(_cheapest_cover(pool, {"m": 10}, value_of({"big": 8.0, "small": 6.0}))) == ["big"]
    # big at 0.11 per byte: 11.0 - 0.5 x 0.11 x 90 = 6.05, more than small's 6.0.
    chosen = _cheapest_cover(pool, {"m": 10}, value_of({"big": 11.0, "small": 6.0}))
    assert keys(chosen) == ["small"]


def test_cheapest_cover_credits_room_per_short_space() -> None:
    """Two short spaces: ab frees 40 bytes of a beyond the need, credited at half of
    0.01 per byte (ab's 1.0 over its 100 bytes of a): 1.0 - 0.2 = 0.8 < a + b's 0.9."""
    pool: list[PolicyEntry] = [
        Item("a", {"a": 60}),
        Item("b", {"b": 10}),
        Item("ab", {"a": 100, "b": 10}),
    ]
    values = {"a": 0.6, "b": 0.3, "ab": 1.0}
    assert keys(_cheapest_cover(pool, {"a": 60, "b": 10}, value_of(values))) == ["ab"]


def test_cheapest_cover_tries_the_largest_entries_as_anchors() -> None:
    """Greedy by value per share takes a and b (2.0, less 2 bytes of surplus at half
    a's 1/6 per byte: 1.83); the cover anchored at large, which covers alone, costs
    less (1.8). The 8 dear 1-byte entries are never anchors: they cover the
    smallest shares."""
    pool: list[PolicyEntry] = [Item(f"f{i}", {"m": 1}) for i in range(8)]
    pool += [Item("a", {"m": 6}), Item("b", {"m": 6}), Item("large", {"m": 10})]
    values = {"a": 1.0, "b": 1.0, "large": 1.8} | {f"f{i}": 10.0 for i in range(8)}
    assert keys(_cheapest_cover(pool, {"m": 10}, value_of(values))) == ["large"]


def test_cheapest_cover_tries_eight_anchors() -> None:
    """As above, with dear entries as large as large ahead of it: large is tried
    as the eighth anchor, not as the ninth."""
    for dear, chosen in ((7, ["large"]), (8, ["a", "b"])):
        pool, values = dear_anchors({"m": 10})
        pool = [*pool[:dear], Item("a", {"m": 6}), Item("b", {"m": 6}), Item("large", {"m": 10})]
        values |= {"a": 1.0, "b": 1.0, "large": 1.8}
        assert sorted(keys(_cheapest_cover(pool, {"m": 10}, value_of(values)))) == chosen


def test_cheapest_cover_tries_the_anchors_after_the_densest() -> None:
    """top, the densest and largest, starts the greedy cover (top and z, 1.25 less 2
    bytes of surplus at half top's 0.1 per byte: 1.15); z as anchor finds it again;
    w, the third anchor, finds a cheaper one (w and top, 1.17 less 0.05: 1.12)."""
    pool: list[PolicyEntry] = [Item("top", {"m": 6}), Item("z", {"m": 6}), Item("w", {"m": 5})]
    chosen = _cheapest_cover(pool, {"m": 10}, value_of({"top": 0.6, "z": 0.65, "w": 0.57}))
    assert sorted(keys(chosen)) == ["top", "w"]


def test_cheapest_cover_in_two_spaces_counts_no_bytes_where_none_are_charged() -> None:
    pool: list[PolicyEntry] = [
        Item("a", {"a": 2}),
        Item("b", {"b": 1}),
        Item("ab", {"a": 2, "b": 1}),
    ]
    chosen = _cheapest_cover(pool, {"a": 2, "b": 1}, value_of({"a": 1.0, "b": 1.0, "ab": 2.5}))
    assert sorted(keys(chosen)) == ["a", "b"]
    chosen = _cheapest_cover(pool, {"a": 2, "b": 1}, value_of({"a": 1.0, "b": 1.0, "ab": 1.5}))
    assert keys(chosen) == ["ab"]


def test_cheapest_cover_in_two_spaces_is_complete_once_both_are_covered() -> None:
    """Both spaces overshoot (by 1 byte each): covered all the same."""
    pool: list[PolicyEntry] = [Item("a", {"a": 3}), Item("b", {"b": 2})]
    chosen = _cheapest_cover(pool, {"a": 2, "b": 1}, value_of({"a": 1.0, "b": 1.0}))
    assert sorted(keys(chosen)) == ["a", "b"]


def test_cheapest_cover_gives_a_space_with_negative_need_no_weight() -> None:
    """z is not short: a and b (1.2) are the cheapest cover of m by value per share,
    not the tiny entries, however little each costs."""
    pool: list[PolicyEntry] = [Item(f"tiny{i}", {"m": 1}) for i in range(10)]
    pool += [Item("a", {"m": 5}), Item("b", {"m": 5})]
    values = {"a": 0.6, "b": 0.6} | {f"tiny{i}": 0.2 for i in range(10)}
    for shortfall in ({"m": 10}, {"m": 10, "z": -1}):
        assert sorted(keys(_cheapest_cover(pool, shortfall, value_of(values)))) == ["a", "b"]


def test_cheapest_cover_keeps_the_greedy_cover_on_a_tie() -> None:
    """Anchored at whole, the cover costs as much as the greedy one (1.0): the greedy stands."""
    pool: list[PolicyEntry] = [Item("h1", {"m": 5}), Item("h2", {"m": 5}), Item("whole", {"m": 10})]
    chosen = _cheapest_cover(pool, {"m": 10}, value_of({"h1": 0.5, "h2": 0.5, "whole": 1.0}))
    assert keys(chosen) == ["h1", "h2"]


def test_cost_policy_weighs_the_reload_costs_themselves() -> None:
    """big (1.9) is cheaper to reload than s1 and s2 together (2.0)."""
    policy = CostAware(half_life=4.0)
    items = [
        Item("big", {"m": 10}, cost=1.9),
        Item("s1", {"m": 5}, cost=1.0),
        Item("s2", {"m": 5}, cost=1.0),
    ]
    settle(policy, items)
    assert keys(policy.victims({"m": 10})) == ["big"]


@pytest.mark.parametrize("heap_above", HEAPS)
def test_cost_policy_candidates_are_idle_entries_only(heap_above: int | None) -> None:
    """candidates=1, so the pool comes from the walk of the ranks: the leased entry,
    ranked first, is passed (once in each heap it is in)."""
    policy = CostAware(half_life=4.0, candidates=1)
    if heap_above is not None:
        policy.heap_above = heap_above
    leased = per_byte("leased", {"a": 10, "b": 10}, 0.01)
    items = [leased, per_byte("a", {"a": 10}, 0.1), per_byte("b", {"b": 10}, 0.2)]
    settle(policy, items, leased=[leased])
    assert keys(policy.victims({"a": 10})) == ["a"]
    assert sorted(keys(policy.victims({"a": 10, "b": 10}))) == ["a", "b"]


def test_cost_policy_compares_entries_long_unrequested() -> None:
    """Their values (rate x cost) underflow to 0.0; their ratios still decide: s1 and s2
    (2.0 together) go, not big (3.0), all requested once, 100,000 requests ago."""
    policy = CostAware(half_life=4.0)
    items = [
        Item("big", {"m": 10}, cost=3.0, tick=1),
        Item("s1", {"m": 5}, cost=1.0, tick=1),
        Item("s2", {"m": 5}, cost=1.0, tick=1),
        Item("now", {"m": 5}, cost=1.0, tick=100_000),
    ]
    settle(policy, items, leased=items[3:])
    assert sorted(keys(policy.victims({"m": 10}))) == ["s1", "s2"]


@pytest.mark.parametrize("candidates", [2, 3])
def test_cost_policy_with_every_resident_a_candidate_breaks_ties_by_load_order(
    candidates: int,
) -> None:
    """Two residents, candidates=2 or 3: all are in the pool, in load order (no walk
    of the ranks, which would put y, of the lower rank per byte, first). Each covers
    the need, and they cost the same: x 1.0, y 1.5 less 16 bytes of surplus at half
    its 1/16 per byte. The one loaded first goes."""
    policy = CostAware(half_life=4.0, candidates=candidates)
    settle(policy, [Item("x", {"m": 8}, cost=1.0), Item("y", {"m": 24}, cost=1.5)])
    assert keys(policy.victims({"m": 8})) == ["x"]


def long_unrequested(ticks: int) -> CostAware:
    """old, requested ``ticks`` ticks (two per half-life) before c and b, is too small to
    cover anything; c's reload costs 1.9 times b's."""
    policy = CostAware(half_life=2.0)
    settle(
        policy,
        [
            Item("old", {"m": 1}, cost=1.0, tick=1),
            Item("c", {"m": 10}, cost=1.9, tick=1 + ticks),
            Item("b", {"m": 10}, cost=1.0, tick=1 + ticks),
        ],
    )
    return policy


def test_cost_policy_compares_values_up_to_2_to_the_1000_times_the_least() -> None:
    """b is valued 2^999.5 times old, c 2^1000 (capped from 2^1000.4): b is cheaper."""
    assert keys(long_unrequested(1999).victims({"m": 10})) == ["b"]


def test_cost_policy_caps_values_at_2_to_the_1000_times_the_least() -> None:
    """b and c are valued 2^1000 and 2^1000.9 times old: both capped at 2^1000 (a
    float's range), they tie, and c, first in the pool, goes."""
    assert keys(long_unrequested(2000).victims({"m": 10})) == ["c"]


def test_cheapest_cover_of_nothing_or_from_too_little_is_empty() -> None:
    pool: list[PolicyEntry] = [Item("a", {"m": 5})]
    assert _cheapest_cover(pool, {"m": 0, "z": -1}, value_of({"a": 1.0})) == []
    assert _cheapest_cover([], {"m": 5}, value_of({})) == []
    assert _cheapest_cover(pool, {"m": 6}, value_of({"a": 1.0})) == []
    assert keys(_cheapest_cover(pool, {"m": 5, "z": 0}, value_of({"a": 1.0}))) == ["a"]


# -- Priorities: lowest priority first, the rest to the next one ---------------


class NewestFirst(PolicyBase):
    """A user's policy that ranks the most recently idle first (unlike idle order)."""

    def __init__(self) -> None:
        self.idle_entries: list[PolicyEntry] = []

    def idle(self, entry: PolicyEntry) -> None:
        self.idle_entries.append(entry)

    def busy(self, entry: PolicyEntry) -> None:
        self.idle_entries.remove(entry)

    def victims(self, shortfall: Mapping[str, int]) -> list[PolicyEntry]:
        return cover(reversed(self.idle_entries), shortfall)


class Stingy(PolicyBase):
    """A user's policy that never offers a victim."""

    def victims(self, shortfall: Mapping[str, int]) -> list[PolicyEntry]:
        return []


def prioritized(
    make: Callable[[], Policy], *specs: tuple[str, Mapping[str, int], int]
) -> tuple[Priorities, dict[str, Item]]:
    """``Priorities`` over ``make``'s policies, with each entry settled (idle) in turn."""
    policies = Priorities(make, make(), 0)
    items = {key: Item(key, charge, priority=priority) for key, charge, priority in specs}
    settle(policies, list(items.values()))
    return policies, items


def test_priorities_cover_from_the_lowest_priority_up() -> None:
    policies, _ = prioritized(LRU, ("p1", {"m": 5}, 1), ("p0", {"m": 9}, 0), ("p1b", {"m": 5}, 1))
    assert keys(policies.victims({"m": 5})) == ["p0"]
    assert keys(policies.victims({"m": 10})) == ["p0", "p1"]  # the last byte counts
    assert keys(policies.victims({"m": 9})) == ["p0"]  # an exact cover
    assert keys(policies.victims({"m": 19})) == ["p0", "p1", "p1b"]
    assert policies.victims({"m": 20}) == []


def test_priorities_never_go_above_up_to() -> None:
    policies, _ = prioritized(LRU, ("p0", {"m": 5}, 0), ("p1", {"m": 5}, 1), ("p2", {"m": 5}, 2))
    assert keys(policies.victims({"m": 10}, up_to=1)) == ["p0", "p1"]
    assert keys(policies.victims({"m": 5}, up_to=0)) == ["p0"]
    assert policies.victims({"m": 15}, up_to=1) == []
    assert policies.victims({"m": 10}, up_to=0) == []
    assert keys(policies.victims({"m": 15})) == ["p0", "p1", "p2"]
    assert keys(policies.victims({"m": 15}, up_to=2)) == ["p0", "p1", "p2"]


def test_priorities_pass_a_priority_with_no_idle_entry_in_the_short_space() -> None:
    policies, items = prioritized(
        LRU, ("elsewhere", {"o": 5}, 0), ("leased", {"m": 5}, 1), ("p2", {"m": 5}, 2)
    )
    policies.busy(items["leased"])
    items["leased"].idle_seq = 0
    assert keys(policies.victims({"m": 5})) == ["p2"]


def test_priorities_ignore_spaces_with_no_need() -> None:
    policies, _ = prioritized(LRU, ("z", {"z": 5}, 0), ("m", {"m": 5}, 1))
    assert keys(policies.victims({"m": 5, "z": 0, "n": -2})) == ["m"]
    assert keys(policies.victims({"m": 1})) == ["m"]
    assert policies.victims({"z": 0}) == []


def test_within_a_priority_its_policy_ranking_holds() -> None:
    """The user's policy picks newest first, an exact cover and an overshoot alike."""
    policies, _ = prioritized(
        NewestFirst, ("x", {"m": 5}, 0), ("y", {"m": 5}, 0), ("z", {"m": 5}, 0), ("w", {"m": 5}, 1)
    )
    assert keys(policies.victims({"m": 10})) == ["z", "y"]
    assert keys(policies.victims({"m": 8})) == ["z", "y"]
    assert keys(policies.victims({"m": 5})) == ["z"]


def test_a_policy_that_falls_short_is_covered_for_in_idle_order() -> None:
    """Its idle entries could cover: they are taken in the order they became idle."""
    policies, _ = prioritized(
        Stingy, ("x", {"m": 5}, 0), ("y", {"m": 5}, 0), ("z", {"m": 5}, 0), ("w", {"m": 5}, 1)
    )
    assert keys(policies.victims({"m": 10})) == ["x", "y"]


def test_a_priority_that_cannot_cover_gives_all_its_idle_entries() -> None:
    """Priority 0 cannot cover a: every idle entry of it charged in a short space goes
    (z too, though b is covered before it), then priority 1 covers the rest."""
    policies, _ = prioritized(
        LRU, ("x", {"b": 5}, 0), ("y", {"a": 3}, 0), ("z", {"b": 2}, 0), ("w", {"a": 1}, 1)
    )
    assert keys(policies.victims({"a": 4, "b": 5})) == ["x", "y", "z", "w"]
