"""The simulator with memory tiers: replay, the offline optimum, traces and the command line."""

from __future__ import annotations

import contextlib
import itertools
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachebroker import InvalidArgument
from cachebroker.__main__ import main
from cachebroker._core import Core, State, check_after_every_step
from cachebroker.simulator import (
    CATALOGUE,
    POLICIES,
    PROMOTE_FRACTION,
    TIMINGS,
    Request,
    TraceError,
    _replay,
    builtin_workload,
    figure,
    offline_bound,
    parse_trace,
    replay,
    simulate,
)
from cachebroker.simulator._replay import Timing

GiB = 2**30
TIERS = {"gpu": "ram"}


def req(
    time: float,
    key: str,
    size: int = 10,
    load: float = 10.0,
    promote: float = 1.0,
    *,
    demote: float = 0.0,
    hold: float = 0.0,
    space: str = "gpu",
) -> Request:
    return Request(
        time=time,
        key=key,
        size={space: size},
        load_seconds=load,
        promote_seconds=promote,
        demote_seconds=demote,
        hold_seconds=hold,
    )


class Books:
    """Every Core the replay makes, checked after each step (``check_after_every_step``)."""

    def __init__(self) -> None:
        self.cores: list[Core] = []
        self.failures: list[str] = []

    def settled(self) -> None:
        """No check failed, and each replay ended with nothing in flight."""
        assert self.failures == []
        for core in self.cores:
            assert not core.queue and not core.demoting
            assert all(entry in core.settling for entry in core.busy)  # idle once read
            for entry in core.entries():
                assert entry.state in (State.READY, State.DEMOTED), entry
                assert not entry.leases and not entry.joiners, entry


@contextlib.contextmanager
def checked_books() -> Iterator[Books]:
    """Make the replay's books check themselves after every step, and collect them."""
    found = Books()

    def checked(*args: Any, **kwargs: Any) -> Core:
        core = Core(*args, **kwargs)
        check_after_every_step(core, found.failures)  # (used <= capacity in each space)
        found.cores.append(core)
        return core

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_replay, "Core", checked)
        yield found


@pytest.fixture
def books() -> Iterator[Books]:
    with checked_books() as found:
        yield found


# ------------------------------------------------------------------ the record


def test_promote_and_demote_seconds_default_to_a_tenth_of_the_load() -> None:
    plain = Request(time=0, key="a", size={"gpu": 1}, load_seconds=8.0)
    assert PROMOTE_FRACTION == 0.1
    assert plain.promote_seconds == pytest.approx(0.8)
    assert plain.demote_seconds == plain.promote_seconds
    given_one = Request(time=0, key="a", size={"gpu": 1}, load_seconds=8.0, promote_seconds=2.0)
    assert (given_one.promote_seconds, given_one.demote_seconds) == (2.0, 2.0)


def test_the_builtin_workload_promotes_at_host_to_device_speed() -> None:
    seconds = {request.key: request.promote_seconds for request in builtin_workload()}
    sizes = {name: size for name, size, _ in CATALOGUE}
    for name, promote in seconds.items():
        assert promote == pytest.approx(0.1 + sizes[name] / 12e9, abs=1e-3)
    assert seconds["llama-3-70b-instruct-q4_k_m"] == pytest.approx(3.643)
    assert all(0.1 <= promote <= 6 for promote in seconds.values())


# ------------------------------------------------------------------ the replay


def test_a_demoted_value_is_promoted_for_its_next_request(books: Books) -> None:
    # Room for one value on top and two below: B pushes A down, A's return
    # promotes it (pushing B down) for 1 s instead of a 10 s load.
    trace = [req(0, "A"), req(100, "B", load=20), req(200, "A")]
    budget = {"gpu": 10, "ram": 20}
    result = replay(trace, budget, "lru", tiers=TIERS)
    assert (result.demotions, result.promotions, result.evictions) == (2, 1, 0)
    assert (result.misses, result.hits) == (3, 0)
    assert result.promote_seconds == 1.0
    assert result.reload_seconds == 31.0 and result.cold_seconds == 30.0
    assert result.bytes_loaded == 20  # a promotion is not a load
    assert result.tiers == TIERS
    without = replay(trace, {"gpu": 10}, "lru")
    assert without.reload_seconds == 40.0 and without.demotions == without.promotions == 0
    books.settled()


def test_under_the_clock_a_promotion_takes_its_seconds() -> None:
    # A's promotion at t=200 takes 5 s; B (arriving at 202, below) waits for
    # the top until A is back and its lease is over.
    trace = [
        req(0, "A"),
        req(100, "B"),
        req(200, "A", promote=5),
        req(202, "B", promote=1),
    ]
    budget = {"gpu": 10, "ram": 20}
    timed = replay(trace, budget, "lru", tiers=TIERS, timing="replay")
    assert timed.wait_seconds == (0.0, 0.0, 0.0, 3.0)
    assert timed.promote_seconds == 6.0 and timed.promotions == 2
    sequential = replay(trace, budget, "lru", tiers=TIERS, timing="sequential")
    assert sequential.wait_seconds == (0.0,) * 4
    assert sequential.reload_seconds == timed.reload_seconds == 26.0


def test_under_the_clock_a_demotion_holds_both_tiers_until_it_ends() -> None:
    # B's load needs A's room on top; A is moved down for 4 s first.
    trace = [req(0, "A", demote=4), req(100, "B")]
    budget = {"gpu": 10, "ram": 10}
    timed = replay(trace, budget, "lru", tiers=TIERS, timing="replay")
    assert timed.wait_seconds == (0.0, 4.0)
    assert timed.reload_seconds == 20.0  # a demotion is no reload
    quick = replay([req(0, "A"), req(100, "B")], budget, "lru", tiers=TIERS, timing="replay")
    assert quick.wait_seconds == (0.0, 0.0)


def test_requests_join_a_promotion_under_way() -> None:
    trace = [req(0, "A"), req(100, "B"), req(200, "A", promote=5), req(203, "A")]
    result = replay(trace, {"gpu": 10, "ram": 10}, "lru", tiers=TIERS, timing="replay")
    assert (result.promotions, result.hits, result.misses) == (1, 1, 3)
    assert result.wait_seconds == (0.0, 0.0, 0.0, 0.0)


def test_a_promotion_that_costs_a_load_teaches_the_core_to_drop_instead() -> None:
    # The core learns a value's promotion cost from the promotion it reports
    # (move_done's seconds); once a promotion costs as much as a load, the
    # value is dropped instead of demoted: A at t=3, B at t=4.
    trace = [req(t * 100, key, promote=20) for t, key in enumerate("ABABA")]
    result = replay(trace, {"gpu": 10, "ram": 20}, "lru", tiers=TIERS)
    assert (result.demotions, result.promotions, result.evictions) == (2, 2, 2)
    assert result.reload_seconds == 10 + 10 + 20 + 20 + 10


def test_a_value_larger_than_the_lower_tier_is_dropped() -> None:
    trace = [req(0, "A", size=10), req(100, "B", size=10), req(200, "A", size=10)]
    result = replay(trace, {"gpu": 10, "ram": 5}, "lru", tiers=TIERS)
    assert (result.demotions, result.promotions) == (0, 0)
    assert result.reload_seconds == 30.0


def test_an_idle_ttl_drops_demoted_values_too(books: Books) -> None:
    trace = [req(0, "A"), req(10, "B"), req(1000, "A")]
    result = replay(trace, {"gpu": 10, "ram": 10}, "lru", tiers=TIERS, idle_ttl=100)
    assert result.demotions == 1 and result.promotions == 0
    assert result.reload_seconds == 30.0
    books.settled()


@pytest.mark.parametrize("policy", ["lru", "cost"])
def test_a_tier_saves_reload_time_on_a_workload_with_reuse(policy: str) -> None:
    trace = builtin_workload(requests=600)
    alone = replay(trace, {"default": 48 * GiB}, policy, timing="sequential")
    tiered = replay(
        trace,
        {"default": 48 * GiB, "ram": 64 * GiB},
        policy,
        timing="sequential",
        tiers={"default": "ram"},
    )
    assert tiered.promotions > 0 and tiered.demotions >= tiered.promotions
    assert tiered.reload_seconds < alone.reload_seconds
    assert tiered.reload_seconds == pytest.approx(tiered.cold_seconds + tiered.promote_seconds)


def schedule(draw: Any, keys: int, length: int) -> list[Request]:
    """Requests of ``keys`` keys of random sizes, some in the lower tier's space itself."""
    spaces = draw(st.lists(st.sampled_from(["gpu", "gpu", "ram"]), min_size=keys, max_size=keys))
    sizes = draw(st.lists(st.integers(3, 10), min_size=keys, max_size=keys))
    loads = draw(st.lists(st.floats(0.5, 10), min_size=keys, max_size=keys))
    promotes = draw(st.lists(st.sampled_from([0.0, 0.3, 2.0, 12.0]), min_size=keys, max_size=keys))
    picks = draw(st.lists(st.integers(0, keys - 1), min_size=length // 2, max_size=length))
    holds = draw(st.lists(st.sampled_from([0.0, 0.0, 3.0, 30.0]), min_size=len(picks)))
    gaps = draw(st.lists(st.sampled_from([0.0, 0.5, 2.0, 20.0]), min_size=len(picks)))
    trace, now = [], 0.0
    for key, hold, gap in zip(picks, holds, gaps, strict=False):
        now += gap
        trace.append(
            Request(
                time=now,
                key=f"k{key}",
                size={spaces[key]: sizes[key]},
                load_seconds=loads[key],
                promote_seconds=promotes[key],
                demote_seconds=promotes[key] / 2,
                hold_seconds=hold,
            )
        )
    return trace


@st.composite
def traces(draw: Any, keys: int = 5, length: int = 40) -> list[Request]:
    return schedule(draw, draw(st.integers(2, keys)), length)


@settings(deadline=None, max_examples=150)
@given(
    trace=traces(),
    top=st.integers(10, 20),
    below=st.integers(10, 20),
    timing=st.sampled_from(TIMINGS),
    policy=st.sampled_from(POLICIES),
)
def test_a_replay_with_tiers_keeps_both_budgets_and_serves_every_request(
    trace: list[Request], top: int, below: int, timing: Timing, policy: str
) -> None:
    with checked_books() as found:
        result = replay(trace, {"gpu": top, "ram": below}, policy, tiers=TIERS, timing=timing)
    found.settled()
    assert result.hits + result.misses == len(trace)
    (core,) = found.cores
    assert result.misses == core.loads + result.promotions  # each miss loads or promotes
    assert result.promote_seconds <= result.reload_seconds + 1e-9
    if timing == "sequential":
        assert result.waited == 0


# ------------------------------------------------------------------ the optimum


def brute_force(trace: Sequence[Request], budget: Mapping[str, int]) -> float:
    """The least reload time, by dynamic programming over every placement of every key.

    After each request a key is on top (in its own space), below (a key of
    the tiered space only) or gone; between requests a key may go down or be
    dropped, never up: only its request brings it back, at its load or
    promotion cost. Capacities hold after each request, where a key promoted
    by it still holds its room below.
    """
    keys = sorted({request.key for request in trace})
    size = {request.key: dict(request.size) for request in trace}

    def fits(state: tuple[int, ...], rising: str | None) -> bool:
        used = dict.fromkeys(budget, 0)
        if rising is not None:  # promoted now: its room below is not free yet
            ((space, amount),) = size[rising].items()
            used[TIERS[space]] += amount
        for key, where in zip(keys, state, strict=True):
            ((space, amount),) = size[key].items()
            if where == 1:
                used[space] += amount
            elif where == 2:
                used[TIERS[space]] += amount
        return all(used[space] <= budget[space] for space in budget)

    best: dict[tuple[int, ...], float] = {(0,) * len(keys): 0.0}
    for request in trace:
        asked = keys.index(request.key)
        following: dict[tuple[int, ...], float] = {}
        for state, cost in best.items():
            cost += (request.load_seconds, 0.0, request.promote_seconds)[state[asked]]
            options = []
            for index, now in enumerate(state):
                ((space, _),) = size[keys[index]].items()
                if index == asked:
                    options.append([1])
                elif now == 1:
                    options.append([1, 0, 2] if space in TIERS else [1, 0])
                else:
                    options.append([now, 0] if now else [0])
            for placed in itertools.product(*options):
                rising = request.key if state[asked] == 2 else None
                if fits(placed, rising) and following.get(placed, math.inf) > cost:
                    following[placed] = cost
        best = following
    return min(best.values())


@settings(deadline=None, max_examples=120)
@given(trace=traces(keys=4, length=12), top=st.integers(10, 16), below=st.integers(10, 16))
def test_the_optimum_with_tiers_is_the_brute_force_one_and_below_every_policy(
    trace: list[Request], top: int, below: int
) -> None:
    budget = {"gpu": top, "ram": below}
    exact = offline_bound(trace, budget, tiers=TIERS)
    assert exact.method == "exact"
    assert exact.reload_seconds == pytest.approx(brute_force(trace, budget), abs=1e-6)
    for policy in POLICIES:
        result = replay(trace, budget, policy, tiers=TIERS, timing="sequential")
        assert exact.reload_seconds <= result.reload_seconds + 1e-6, policy
    relaxed = offline_bound(trace, budget, tiers=TIERS, exact_limit=0)
    assert relaxed.reload_seconds <= exact.reload_seconds + 1e-6
    assert relaxed.upper_seconds is not None
    assert exact.reload_seconds <= relaxed.upper_seconds + 1e-6
    alone = offline_bound(trace, budget)
    assert exact.reload_seconds <= alone.reload_seconds + 1e-6  # a tier never costs


def test_the_optimum_keeps_a_value_on_top_until_the_top_is_needed() -> None:
    # Top: 3 bytes; below: 2. D (1 byte) stays on top beside C while C's
    # promotion still holds the room below, then goes down when A (3 bytes)
    # needs the whole top: the only way to keep it. Kept below or on top
    # for its whole gap, D would be reloaded.
    trace = [
        req(0, "A", size=3),
        req(1, "C", size=2),
        req(2, "A", size=3),
        req(3, "D", size=1),
        req(4, "C", size=2),
        req(5, "A", size=3),
        req(6, "D", size=1),
    ]
    budget = {"gpu": 3, "ram": 2}
    exact = offline_bound(trace, budget, tiers=TIERS)
    # Five loads (A three times, C and D) and two promotions (C's and D's).
    assert exact.reload_seconds == pytest.approx(brute_force(trace, budget)) == 52.0
    lru = replay(trace, budget, "lru", tiers=TIERS, timing="sequential")
    assert (lru.reload_seconds, lru.promotions) == (52.0, 2)


def test_two_values_never_swap_tiers_at_one_request() -> None:
    # A's promotion needs B's room on top and B's demotion A's room below:
    # each move would wait for the other, so B is dropped.
    trace = [req(0, "A"), req(100, "B"), req(200, "A"), req(300, "B")]
    budget = {"gpu": 10, "ram": 10}
    exact = offline_bound(trace, budget, tiers=TIERS)
    assert exact.reload_seconds == pytest.approx(brute_force(trace, budget)) == 31.0
    result = replay(trace, budget, "lru", tiers=TIERS)
    # A down at B's load; B dropped at A's promotion; A down again at B's reload.
    assert (result.demotions, result.promotions, result.evictions) == (2, 1, 1)
    assert result.reload_seconds == 31.0


# ------------------------------------------------------------------ simulate and figures


def test_simulate_with_tiers_covers_the_tier_in_the_optimum_and_skips_the_online_one() -> None:
    trace = [req(t * 10.0, key) for t, key in enumerate("ABCABCABC")]
    (comparison,) = simulate(trace, [{"gpu": 20, "ram": 10}], ["lru"], tiers=TIERS)
    assert comparison.tiers == TIERS
    assert comparison.label == "20 B + ram 10 B"
    assert comparison.top_budget == {"gpu": 20} and comparison.tier_budget == {"ram": 10}
    assert comparison.online is None and comparison.online_note == "it does not model tiers"
    assert comparison.bound is not None and comparison.bound.method == "exact"
    # Three keys, room for two on top and one below; the one below never
    # swaps with one on top, so each promotion drops a value: 30 s of cold
    # loads, one reload and two promotions.
    assert comparison.bound.reload_seconds == pytest.approx(42.0)
    (result,) = comparison.results
    assert comparison.bound.reload_seconds <= result.reload_seconds


def test_the_figure_draws_each_tier_as_lines_of_its_own() -> None:
    trace = [req(t * 10.0, key) for t, key in enumerate("ABCABCABC")]
    budgets = [{"gpu": 10}, {"gpu": 20}]
    plain = simulate(trace, budgets, ["lru"], online=False)
    tiered = simulate(
        trace, [{**b, "ram": 10} for b in budgets], ["lru"], online=False, tiers=TIERS
    )
    drawn = figure([*plain, *tiered])
    reloads = drawn.axes[0]
    assert [line.get_label() for line in reloads.lines] == [
        "lru",
        "optimum",
        "lru + ram 10 B",
        "optimum + ram 10 B",
    ]
    plain_line, _, tier_line, _ = reloads.lines
    assert plain_line.get_color() == tier_line.get_color()
    assert tier_line.get_xdata() == pytest.approx([10 / GiB, 20 / GiB])


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("tiers", "message"),
    [
        ({"gpu": "disk"}, "tiers names space 'disk', which is not in the budget"),
        ({"tpu": "ram"}, "tiers names space 'tpu'"),
        ({"gpu": "gpu"}, "tiers puts space 'gpu' below itself"),
        ({"gpu": "ram", "ram": "gpu"}, "round in a circle"),
    ],
)
def test_bad_tiers_are_rejected(tiers: dict[str, str], message: str) -> None:
    trace = [req(0, "A")]
    budget = {"gpu": 10, "ram": 10}
    with pytest.raises(InvalidArgument, match=message):
        replay(trace, budget, "lru", tiers=tiers)
    with pytest.raises(InvalidArgument, match=message):
        offline_bound(trace, budget, tiers=tiers)
    with pytest.raises(InvalidArgument, match=message):
        simulate(trace, [budget], ["lru"], tiers=tiers)


def test_a_budget_without_the_lower_tier_is_rejected() -> None:
    with pytest.raises(InvalidArgument, match="tiers names space 'ram'"):
        simulate([req(0, "A")], [10], ["lru"], tiers=TIERS)


@pytest.mark.parametrize("column", ["promote_seconds", "demote_seconds"])
@pytest.mark.parametrize("value", [-1.0, math.nan, math.inf])
def test_a_bad_tier_cost_names_its_request(column: str, value: float) -> None:
    costs: dict[str, Any] = {column: value}
    bad = Request(time=1, key="b", size={"gpu": 1}, load_seconds=1, line=7, **costs)
    trace = [req(0, "A"), bad]
    with pytest.raises(InvalidArgument, match=f"line 7: default:b: {column} must be a non-neg"):
        replay(trace, {"gpu": 10, "ram": 10}, "lru", tiers=TIERS)
    with pytest.raises(InvalidArgument, match=f"line 7: default:b: {column}"):
        offline_bound(trace, {"gpu": 10, "ram": 10}, tiers=TIERS)
    replay(trace, {"gpu": 10, "ram": 10}, "lru")  # without tiers the costs are not read


# ------------------------------------------------------------------ traces


def test_tier_costs_round_trip_through_a_trace() -> None:
    requests = [
        req(0.0, "a", promote=0.25, demote=0.5),
        req(1.5, "b", load=4.0, promote=0.0, demote=3.0),
    ]
    rows = [
        f"{r.time},{r.key},{r.size['gpu']},{r.load_seconds},gpu,{r.promote_seconds},"
        f"{r.demote_seconds}"
        for r in requests
    ]
    text = "time,key,size,load_seconds,space,promote_seconds,demote_seconds\n" + "\n".join(rows)
    parsed = parse_trace(text)
    assert [(r.promote_seconds, r.demote_seconds) for r in parsed] == [(0.25, 0.5), (0.0, 3.0)]
    assert [r.line for r in parsed] == [2, 3]
    assert [attrs_of(r) for r in parsed] == [attrs_of(r) for r in requests]


def attrs_of(request: Request) -> tuple[Any, ...]:
    return (request.time, request.key, dict(request.size), request.load_seconds)


def test_empty_or_missing_tier_costs_take_the_defaults() -> None:
    first, second = parse_trace(
        "time,key,size,load_seconds,promote_seconds,demote_seconds\n0,a,1,5,,\n1,b,1,5,2,\n"
    )
    assert (first.promote_seconds, first.demote_seconds) == (0.5, 0.5)
    assert (second.promote_seconds, second.demote_seconds) == (2.0, 2.0)
    (plain,) = parse_trace("time,key,size,load_seconds\n0,a,1,8\n")
    assert plain.promote_seconds == pytest.approx(0.8)


@pytest.mark.parametrize("column", ["promote_seconds", "demote_seconds"])
def test_a_negative_tier_cost_in_a_trace_names_its_line_and_column(column: str) -> None:
    text = f"time,key,size,load_seconds,{column}\n0,a,1,5,1\n1,b,1,5,-2\n"
    with pytest.raises(TraceError, match="line 3") as info:
        parse_trace(text)
    assert info.value.line == 3 and info.value.column == column
    assert "non-negative number of seconds, got '-2'" in str(info.value)


# ------------------------------------------------------------------ command line


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    path = tmp_path / "trace.csv"
    rows = [f"{i * 10},{key},10,2,0.5" for i, key in enumerate("ABCABDABCE")]
    path.write_text("time,key,size,load_seconds,promote_seconds\n" + "\n".join(rows) + "\n")
    return path


def test_cli_tier_adds_rows_with_a_lower_tier(
    trace_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["simulate", "--trace", str(trace_file), "--budget", "20,30", "--policy", "lru"]
    assert main([*args, "--tier", "ram=20,40", "--json", "--no-online"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(row["budget_label"], row["tier_budget"]) for row in rows] == [
        ("20 B", None),
        ("20 B + ram 20 B", {"ram": 20}),
        ("20 B + ram 40 B", {"ram": 40}),
        ("30 B", None),
        ("30 B + ram 20 B", {"ram": 20}),
        ("30 B + ram 40 B", {"ram": 40}),
    ]
    assert [row["budget"] for row in rows] == [20, 20, 20, 30, 30, 30]
    plain, tiered = rows[0], rows[1]
    assert plain["tiers"] == {} and tiered["tiers"] == {"default": "ram"}
    assert plain["promotions"] == plain["demotions"] == 0
    assert tiered["promotions"] > 0 and tiered["promote_seconds"] == 0.5 * tiered["promotions"]
    assert tiered["reload_seconds"] < plain["reload_seconds"]
    assert tiered["bound_method"] == "exact"
    assert tiered["bound_reload_seconds"] <= tiered["reload_seconds"]
    assert main([*args, "--tier", "ram=20"]) == 0
    table = capsys.readouterr().out
    assert "20 B + ram 20 B" in table and "promotions" in table and "promote s" in table
    assert "with a tier ('+ ram ...')" in table
    assert main(args) == 0
    assert "promotions" not in capsys.readouterr().out


@pytest.mark.parametrize(
    ("tier", "message"),
    [
        ("ram", "is not SPACE=SIZE"),
        ("=4GiB", "is not SPACE=SIZE"),
        ("ram=", "is not SPACE=SIZE"),
        ("ram=4GiB,disk=8GiB", "is not SPACE=SIZE"),
        ("ram=lots", "--tier ram"),
        ("default=40", "the budget already has a space 'default'"),
    ],
)
def test_cli_bad_tiers_are_clear(
    trace_file: Path, capsys: pytest.CaptureFixture[str], tier: str, message: str
) -> None:
    args = ["simulate", "--trace", str(trace_file), "--budget", "20", "--tier", tier]
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


# ------------------------------------------------------------------ attacks


@settings(deadline=None)
@given(trace=traces(), top=st.integers(10, 20), timing=st.sampled_from(TIMINGS))
def test_a_lower_tier_of_no_bytes_changes_nothing(
    trace: list[Request], top: int, timing: Timing
) -> None:
    # Nothing fits below, so nothing is demoted: the replay and the optimum
    # are those without a tier, request for request. (Keys of the lower
    # tier's own space are moved up: it has no room for them.)
    trace = [
        Request(
            time=r.time,
            key=r.key,
            size={"gpu": r.size.get("gpu", r.size.get("ram", 0))},
            load_seconds=r.load_seconds,
            promote_seconds=r.promote_seconds,
            hold_seconds=r.hold_seconds,
        )
        for r in trace
    ]
    for policy in POLICIES:
        alone = replay(trace, {"gpu": top}, policy, timing=timing)
        tiered = replay(trace, {"gpu": top, "ram": 0}, policy, timing=timing, tiers=TIERS)
        assert (tiered.demotions, tiered.promotions) == (0, 0)
        assert (tiered.hits, tiered.misses, tiered.evictions) == (
            alone.hits,
            alone.misses,
            alone.evictions,
        )
        assert tiered.reload_seconds == alone.reload_seconds
        assert tiered.wait_seconds == alone.wait_seconds
    assert offline_bound(trace, {"gpu": top, "ram": 0}, tiers=TIERS).reload_seconds == (
        pytest.approx(offline_bound(trace, {"gpu": top}).reload_seconds, abs=1e-6)
    )


@st.composite
def shared_tier_traces(draw: Any) -> list[Request]:
    """Two GPUs above one RAM; some keys also hold host memory of their own (``cpu``)."""
    keys = draw(st.integers(2, 6))
    shapes = draw(
        st.lists(
            st.sampled_from(
                [{"gpu0": 6}, {"gpu1": 5}, {"gpu0": 4, "cpu": 2}, {"gpu1": 7, "cpu": 1}, {"cpu": 3}]
            ),
            min_size=keys,
            max_size=keys,
        )
    )
    promotes = draw(st.lists(st.sampled_from([0.0, 0.5, 3.0]), min_size=keys, max_size=keys))
    picks = draw(st.lists(st.integers(0, keys - 1), min_size=4, max_size=30))
    holds = draw(st.lists(st.sampled_from([0.0, 1.0, 8.0]), min_size=len(picks)))
    gaps = draw(st.lists(st.sampled_from([0.0, 0.7, 5.0]), min_size=len(picks)))
    trace, now = [], 0.0
    for key, hold, gap in zip(picks, holds, gaps, strict=False):
        now += gap
        trace.append(
            Request(
                time=now,
                key=f"k{key}",
                size=shapes[key],
                load_seconds=4.0 + key,
                promote_seconds=promotes[key],
                demote_seconds=promotes[key],
                hold_seconds=hold,
                cache="a" if key % 2 else "b",
            )
        )
    return trace


@settings(deadline=None)
@given(trace=shared_tier_traces(), below=st.integers(5, 14))
def test_two_tiers_sharing_one_lower_space_and_values_of_several_spaces(
    trace: list[Request], below: int
) -> None:
    # Two GPUs move values into one RAM; a value charged on a GPU and in
    # host memory moves its GPU part only. The books hold after every step,
    # every request is served, and the optimum is below every policy. (Host
    # memory has room for all: see the next test for why.)
    budget = {"gpu0": 10, "gpu1": 8, "cpu": 6, "ram": below}
    tiers = {"gpu0": "ram", "gpu1": "ram"}
    exact = offline_bound(trace, budget, tiers=tiers)
    assert exact.reload_seconds <= offline_bound(trace, budget).reload_seconds + 1e-6
    with checked_books() as found:
        for policy, timing in itertools.product(POLICIES, TIMINGS):
            result = replay(trace, budget, policy, tiers=tiers, timing=timing)
            assert result.hits + result.misses == len(trace)
            if timing == "sequential":
                assert exact.reload_seconds <= result.reload_seconds + 1e-6, policy
    found.settled()


def test_a_request_during_a_demotion_waits_for_it_then_for_its_promotion() -> None:
    # A's load ends at t=10, when B's load pushes it down for 4 s. A is asked
    # for at t=12, while it moves: it waits for the demotion to end, then
    # for B's lease (held from t=14 to t=24); its promotion starts at t=24.
    # The request at t=21 joins that promotion's wait.
    trace = [
        req(0, "A", demote=4),
        req(10, "B", hold=10, load=0),
        req(12, "A", promote=1),
        req(21, "A"),
    ]
    result = replay(trace, {"gpu": 10, "ram": 10}, "lru", tiers=TIERS, timing="replay")
    assert result.wait_seconds == (0.0, 4.0, 12.0, 3.0)
    assert (result.promotions, result.misses, result.hits) == (1, 3, 1)
    assert result.reload_seconds == 10 + 0 + 1


def test_a_value_demoted_for_room_it_keeps_does_not_block_the_waiter_forever() -> None:
    # K4 waits for 3 bytes of host memory while K1 (4 GPU bytes and 2 host
    # bytes) loads. K1's lease ends and it is evicted for K4, but demoting
    # it moves only its GPU part; asked for again during that move, K1 is
    # queued for its promotion behind K4, which waits for K1's host bytes.
    trace = [
        Request(time=0, key="k1", size={"gpu": 4, "cpu": 2}, load_seconds=5, promote_seconds=1),
        Request(time=0, key="k4", size={"cpu": 3}, load_seconds=8),
        Request(time=5, key="k1", size={"gpu": 4, "cpu": 2}, load_seconds=5, promote_seconds=1),
    ]
    budget = {"gpu": 10, "cpu": 4, "ram": 5}
    result = replay(trace, budget, "lru", tiers=TIERS, timing="replay")
    assert result.hits + result.misses == 3


@settings(deadline=None)
@given(trace=traces(), top=st.integers(10, 20), below=st.integers(10, 20))
def test_requests_far_apart_make_the_clock_change_nothing_but_the_waits(
    trace: list[Request], top: int, below: int
) -> None:
    # Spaced wider than any load, move and hold, each request is served and
    # every move over before the next: the clock may delay a load behind a
    # demotion, but decides nothing differently.
    spaced = [
        Request(
            time=100.0 * number,
            key=r.key,
            size=r.size,
            load_seconds=r.load_seconds,
            promote_seconds=r.promote_seconds,
            demote_seconds=r.demote_seconds,
            hold_seconds=r.hold_seconds,
        )
        for number, r in enumerate(trace)
    ]
    budget = {"gpu": top, "ram": below}
    for policy in POLICIES:
        clock = replay(spaced, budget, policy, tiers=TIERS, timing="replay")
        sequential = replay(spaced, budget, policy, tiers=TIERS, timing="sequential")
        assert (clock.hits, clock.misses, clock.evictions) == (
            sequential.hits,
            sequential.misses,
            sequential.evictions,
        )
        assert (clock.demotions, clock.promotions) == (sequential.demotions, sequential.promotions)
        assert clock.reload_seconds == pytest.approx(sequential.reload_seconds)
        assert all(wait <= 12.0 for wait in clock.wait_seconds)  # a demotion's at most


def test_a_chain_of_tiers_is_refused_by_the_simulator() -> None:
    trace = [req(0, "A")]
    budget = {"gpu": 10, "ram": 10, "disk": 10}
    with pytest.raises(InvalidArgument, match="one level of tiers"):
        replay(trace, budget, "lru", tiers={"gpu": "ram", "ram": "disk"})
