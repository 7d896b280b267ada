"""The online optimum: the optimal policy for a known popularity, checked by enumeration.

For a few keys and short traces every trace can be listed with its
probability under independent draws, so expectations are exact sums: the
expected cost the solver reports must be what its own policy pays on
average, no built-in policy may expect less, and on every single trace the
policy pays at least the offline optimum. Then the attacks, against
independent references: a plain backward induction, the offline MILP,
enumeration and sampling, and the policy's own decision rule replayed.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import random
import statistics
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from cachebroker import InvalidArgument
from cachebroker.simulator import (
    POLICIES,
    Request,
    _online,
    figure,
    offline_bound,
    online_optimum,
    replay,
    simulate,
)
from cachebroker.simulator._online import _Group, _groups, _run, _Values

pytest.importorskip("numpy")


def trace_of(picks: Sequence[int], sizes: Sequence[int], costs: Sequence[float]) -> list[Request]:
    return [
        Request(time=float(t), key=f"k{k}", size={"m": sizes[k]}, load_seconds=costs[k])
        for t, k in enumerate(picks)
    ]


def every_trace(
    sizes: Sequence[int], costs: Sequence[float], shares: Sequence[float], length: int
) -> Iterator[tuple[float, list[Request]]]:
    """Every trace of ``length`` independent draws, with its probability."""
    for picks in itertools.product(range(len(sizes)), repeat=length):
        yield math.prod(shares[k] for k in picks), trace_of(picks, sizes, costs)


def group_of(sizes: Sequence[int], costs: Sequence[float], shares: Sequence[float]) -> _Group:
    keys = [("default", f"k{k}") for k in range(len(sizes))]
    return _Group(
        keys=keys,
        index={key: i for i, key in enumerate(keys)},
        sizes={"m": list(sizes)},
        costs=list(costs),
        shares=list(shares),
    )


@st.composite
def instances(draw: st.DrawFn) -> tuple[list[int], list[float], list[float], int, int]:
    count = draw(st.integers(2, 4))
    sizes = draw(st.lists(st.integers(1, 10), min_size=count, max_size=count))
    costs = draw(st.lists(st.sampled_from([0.5, 1.0, 2.0, 5.0]), min_size=count, max_size=count))
    weights = draw(st.lists(st.integers(1, 9), min_size=count, max_size=count))
    shares = [w / sum(weights) for w in weights]
    budget = draw(st.integers(max(sizes), sum(sizes)))
    length = draw(st.integers(1, 5 if count <= 3 else 4))
    return sizes, costs, shares, budget, length


@settings(deadline=None, max_examples=30)
@given(instances())
def test_expected_cost_is_the_least_of_any_online_policy_and_its_own_average(
    instance: tuple[list[int], list[float], list[float], int, int],
) -> None:
    sizes, costs, shares, budget, length = instance
    note(f"sizes {sizes} costs {costs} shares {shares} budget {budget} length {length}")
    group = group_of(sizes, costs, shares)
    values = _Values(group, {"m": budget}, length)
    expected = values.expected
    averages = dict.fromkeys(POLICIES, 0.0)
    own = 0.0
    for chance, trace in every_trace(sizes, costs, shares, length):
        paid = _run(group, values, trace)
        own += chance * paid
        # On each trace: never below the offline optimum, which knows the order.
        assert paid >= offline_bound(trace, {"m": budget}).reload_seconds - 1e-9
        for policy in POLICIES:
            result = replay(trace, {"m": budget}, policy, timing="sequential")
            averages[policy] += chance * result.reload_seconds
    assert own == pytest.approx(expected, rel=1e-9, abs=1e-9)
    for policy, average in averages.items():
        assert expected <= average + 1e-9, policy


def test_everything_fits_costs_each_first_load_only() -> None:
    picks = [0, 1, 2, 0, 1, 2, 2, 1]
    trace = trace_of(picks, [3, 4, 5], [1.0, 2.0, 4.0])
    online = online_optimum(trace, {"m": 12})
    assert online.reload_seconds == pytest.approx(7.0)
    assert online.reload_seconds == pytest.approx(offline_bound(trace, {"m": 12}).reload_seconds)


def test_room_for_one_pays_every_change_of_key() -> None:
    """Only one key fits at a time: every request for another key than the last one loads."""
    picks = [0, 0, 1, 0, 2, 2, 1]
    trace = trace_of(picks, [5, 5, 5], [1.0, 2.0, 3.0])
    online = online_optimum(trace, {"m": 5})
    assert online.reload_seconds == pytest.approx(1 + 2 + 1 + 3 + 2)


def test_it_keeps_the_valuable_key_where_lru_would_not() -> None:
    """A key reloaded at great cost is kept over a cheap one even when it was used longer ago."""
    # Key 0 costs 50 s and is a third of the requests; keys 1 and 2 cost 1 s.
    picks = [0, 1, 2] * 30
    trace = trace_of(picks, [5, 5, 5], [50.0, 1.0, 1.0])
    online = online_optimum(trace, {"m": 10})
    lru = replay(trace, {"m": 10}, "lru", timing="sequential").reload_seconds
    assert online.reload_seconds == pytest.approx(50.0 + 1.0 + 1.0 * 59)
    assert lru > 1000


def test_keys_of_separate_spaces_are_solved_apart() -> None:
    """Ten keys in each of two spaces: two processes of 2^10 states, not one of 2^20."""
    rng = random.Random(7)
    trace = []
    for t in range(300):
        space, k = rng.choice(("ram", "gpu")), rng.randrange(10)
        trace.append(
            Request(time=float(t), key=f"{space}{k}", size={space: 1 + k}, load_seconds=1.0 + k)
        )
    budget = {"ram": 30, "gpu": 30}
    online = online_optimum(trace, budget)
    assert online.keys == 20
    assert online.largest_group == 10
    alone = sum(
        online_optimum([r for r in trace if space in r.size], budget).reload_seconds
        for space in ("ram", "gpu")
    )
    assert online.reload_seconds == pytest.approx(alone)
    offline = offline_bound(trace, budget, time_limit=10)
    assert online.reload_seconds >= offline.reload_seconds - 1e-9


def test_too_many_keys_sharing_a_space_is_refused_unless_approximated_as_simulate_does() -> None:
    trace = trace_of(list(range(16)) * 2, [1] * 16, [1.0] * 16)
    with pytest.raises(InvalidArgument, match="16 keys of this trace share spaces"):
        online_optimum(trace, {"m": 8})
    exact = online_optimum(trace, {"m": 8}, max_keys=16)  # a larger limit is the caller's choice
    assert exact.exact and exact.passed_keys == 0 and exact.slack_seconds == 0.0
    (comparison,) = simulate(trace, [8], ["lru"], bound=False)
    online = comparison.online
    assert online is not None and not online.exact
    assert online.passed_keys == 2 and online.keys == 16 and online.largest_group == 16
    # Two passing keys, each 2 of the 32 requests at 1 s: 4 s of slack.
    assert online.slack_seconds == pytest.approx(4.0)
    assert exact.expected_seconds <= online.expected_seconds + 1e-9
    assert online.expected_seconds <= exact.expected_seconds + online.slack_seconds + 1e-9
    assert comparison.online_note is not None
    assert "16 keys share spaces, more than the 14 solved exactly" in comparison.online_note
    (wider,) = simulate(trace, [8], ["lru"], bound=False, max_keys=16)
    assert wider.online is not None and wider.online.exact and wider.online_note is None
    assert wider.online.reload_seconds == pytest.approx(exact.reload_seconds)


@pytest.mark.parametrize("max_keys", [0, 21, -3, 2.5, True, "14"])
def test_a_max_keys_out_of_range_is_refused_before_any_work(max_keys: object) -> None:
    trace = trace_of([0, 1, 0], [1, 1], [1.0, 1.0])
    with pytest.raises(InvalidArgument, match="max_keys must be an integer from 1 to 20"):
        online_optimum(trace, {"m": 1}, max_keys=max_keys)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="max_keys must be an integer from 1 to 20"):
        simulate(trace, [1], ["lru"], bound=False, max_keys=max_keys)  # type: ignore[arg-type]


@settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(instances(), st.data())
def test_the_approximation_lies_within_its_slack_above_the_optimum_and_pays_its_expectation(
    instance: tuple[list[int], list[float], list[float], int, int], data: st.DataObject
) -> None:
    """Keeping fewer keys: E[exact] <= E[approximate] <= E[exact] + slack, and the
    approximating policy's average over every trace is its reported expectation."""
    sizes, costs, shares, budget, length = instance
    kept = data.draw(st.integers(1, len(sizes) - 1), label="kept")
    note(f"sizes {sizes} costs {costs} shares {shares} budget {budget} length {length}")
    exact = _Values(group_of(sizes, costs, shares), {"m": budget}, length).expected
    group = group_of(sizes, costs, shares)
    group.pass_all_but(kept)
    assert len(group.keys) == kept and len(group.passing) == len(sizes) - kept
    # The passing keys are those of the least share x cost.
    worth = sorted(p * c for p, c in zip(shares, costs, strict=True))
    assert sorted(
        p * c for p, c in zip(group.passing_shares, group.passing_costs, strict=True)
    ) == (pytest.approx(worth[: len(sizes) - kept]))
    values = _Values(group, {"m": budget}, length)
    slack = length * group.slack_seconds_per_request
    assert exact - 1e-9 <= values.expected <= exact + slack + 1e-9
    own = 0.0
    for chance, trace in every_trace(sizes, costs, shares, length):
        paid = _run(group, values, trace)
        own += chance * paid
        assert paid >= offline_bound(trace, {"m": budget}).reload_seconds - 1e-9
    assert own == pytest.approx(values.expected, rel=1e-9, abs=1e-9)


def test_a_passing_key_is_served_beside_the_best_contents_and_dropped() -> None:
    """Budget 10: a (6 bytes, 6 s) and b (4, 1 s) are kept; c (5, 1 s, rare) passes
    through. c fits beside b only, so each c costs its load and a's reload after."""
    picks = [0, 1, 0, 1, 2, 0, 1, 0, 2, 1, 0, 1]
    trace = trace_of(picks, [6, 4, 5], [6.0, 1.0, 1.0])
    online = online_optimum(trace, {"m": 10}, max_keys=2, approximate=True)
    assert online.passed_keys == 1 and not online.exact
    assert online.slack_seconds == pytest.approx(len(picks) * (2 / 12) * 1.0)
    # a and b load once; each c loads (1 s) beside b, and a loads again after it.
    assert online.reload_seconds == pytest.approx(6.0 + 1.0 + 2 * (1.0 + 6.0))


def test_simulate_sets_it_beside_the_offline_optimum() -> None:
    trace = trace_of([0, 1, 2, 0, 3, 1, 0, 2, 3, 0] * 5, [4, 3, 2, 5], [4.0, 3.0, 1.0, 6.0])
    (comparison,) = simulate(trace, [9], ["lru", "cost"])
    assert comparison.online is not None and comparison.bound is not None
    assert comparison.online.reload_seconds >= comparison.bound.reload_seconds - 1e-9
    (skipped,) = simulate(trace, [9], ["lru"], online=False)
    assert skipped.online is None and skipped.online_note is None


def test_command_line_shows_and_exports_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from cachebroker.__main__ import main

    path = tmp_path / "trace.csv"
    lines = ["time,key,size,load_seconds"]
    for t, k in enumerate([0, 1, 2, 0, 3, 1, 0, 2, 3, 0] * 3):
        lines.append(f"{t},k{k},{[4, 3, 2, 5][k]},{[4.0, 3.0, 1.0, 6.0][k]}")
    path.write_text("\n".join(lines) + "\n")
    assert main(["simulate", "--trace", str(path), "--budget", "9", "--policy", "lru"]) == 0
    out = capsys.readouterr().out
    assert "online optimum" in out
    assert main(["simulate", "--trace", str(path), "--budget", "9", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert all(row["online_reload_seconds"] is not None for row in rows)
    assert all(row["online_expected_seconds"] > 0 for row in rows)
    assert main(["simulate", "--trace", str(path), "--budget", "9", "--no-online"]) == 0
    assert "online optimum" not in capsys.readouterr().out


def test_a_single_key_and_an_empty_group() -> None:
    """One key: loaded once. A key charging nothing: never evicted, loaded once."""
    trace = trace_of([0, 0, 0], [5], [2.0])
    assert online_optimum(trace, {"m": 5}).reload_seconds == pytest.approx(2.0)
    weightless = [Request(time=float(t), key="w", size={}, load_seconds=3.0) for t in range(3)]
    assert online_optimum(weightless, {"m": 5}).reload_seconds == pytest.approx(3.0)


# == attacks ===================================================================
#
# Independent references: a plain dictionary backward induction over every set
# of keys (no grouping, no numpy, no stationary shortcut), the exact MILP of
# ``offline_bound``, exact enumeration of short traces, sampling of longer ones,
# and an exact evaluation of the policy ``_run`` follows (its decision rule
# replayed on every state). Some tests were written against bugs of the first
# version (capped value tables deciding on unconverged values, int64 overflow in
# the fit test, absolute tolerances, an overshooting stopping rule), all fixed
# since.


#: The attacks check against ``offline_bound``'s MILP, which needs scipy.
needs_scipy = pytest.mark.skipif(
    importlib.util.find_spec("scipy") is None, reason="could not import 'scipy'"
)

Key = tuple[str, str]


# ---------------------------------------------------------------- references


def reference_model(
    requests: Sequence[Request],
) -> tuple[list[Key], list[dict[str, int]], list[float], list[float]]:
    """Keys in first-seen order, each key's largest positive size per space, mean cost, share."""
    keys: list[Key] = []
    sizes: dict[Key, dict[str, int]] = {}
    seconds: dict[Key, float] = {}
    counts: dict[Key, int] = {}
    for request in requests:
        key = (request.cache, request.key)
        if key not in sizes:
            keys.append(key)
            sizes[key] = {}
            seconds[key] = 0.0
            counts[key] = 0
        counts[key] += 1
        seconds[key] += request.load_seconds
        for space, amount in request.size.items():
            if amount > 0:
                sizes[key][space] = max(sizes[key].get(space, 0), amount)
    return (
        keys,
        [sizes[key] for key in keys],
        [seconds[key] / counts[key] for key in keys],
        [counts[key] / len(requests) for key in keys],
    )


def brute_expected(
    sizes: Sequence[Mapping[str, int]],
    costs: Sequence[float],
    shares: Sequence[float],
    budget: Mapping[str, int],
    horizon: int,
) -> float:
    """Least expected reload time of ``horizon`` i.i.d. requests from the empty cache.

    Every set of keys at once (no grouping), dictionaries, full iteration.
    """
    count = len(sizes)

    def fits(state: frozenset[int]) -> bool:
        used: dict[str, int] = {}
        for k in state:
            for space, amount in sizes[k].items():
                used[space] = used.get(space, 0) + amount
        return all(amount <= budget[space] for space, amount in used.items())

    states = [
        frozenset(c) for r in range(count + 1) for c in itertools.combinations(range(count), r)
    ]
    states = [s for s in states if fits(s)]
    fitting = set(states)
    choices = {
        (s, k): [
            frozenset(t) | {k}
            for r in range(len(s) + 1)
            for t in itertools.combinations(sorted(s), r)
            if frozenset(t) | {k} in fitting
        ]
        for s in states
        for k in range(count)
        if k not in s
    }
    value = dict.fromkeys(states, 0.0)
    stay = 1.0 - sum(shares)
    for _ in range(horizon):
        new = {}
        for s in states:
            v = stay * value[s]
            for k in range(count):
                if k in s:
                    v += shares[k] * value[s]
                else:
                    v += shares[k] * (costs[k] + min(value[t] for t in choices[(s, k)]))
            new[s] = v
        value = new
    return value[frozenset()]


def components(sizes: Sequence[Mapping[str, int]]) -> list[int]:
    """Sizes of the groups of keys sharing spaces (a weightless key alone), by graph search."""
    count = len(sizes)
    seen: set[int] = set()
    out = []
    for start in range(count):
        if start in seen:
            continue
        seen.add(start)
        stack, size = [start], 0
        while stack:
            k = stack.pop()
            size += 1
            for j in range(count):
                if j not in seen and set(sizes[k]) & set(sizes[j]):
                    seen.add(j)
                    stack.append(j)
        out.append(size)
    return out


def policy_value(group: _Group, values: _Values, horizon: int, bits: int) -> float:
    """Exact expected reload time of the policy ``_run`` follows with ``values``.

    ``_run``'s rule: on a miss of k with r requests left after it, keep the
    subset of the contents (plus k) of least ``values.table(r)``, ties to the
    most keys. Only states over the first ``bits`` keys are
    visited (the others never have a request).
    """
    shares, costs = group.shares, group.costs
    stay = 1.0 - sum(shares)
    decided: dict[tuple[int, int, int], int] = {}

    def decide(state: int, k: int, t: int) -> int:
        memo = decided.get((state, k, t))
        if memo is not None:
            return memo
        table = values.table(t)
        others = [j for j in range(bits) if state >> j & 1]
        options = []
        for r in range(len(others) + 1):
            for kept in itertools.combinations(others, r):
                choice = 1 << k
                for j in kept:
                    choice |= 1 << j
                options.append((float(table[choice]), -r, choice))
        low = min(option[0] for option in options)
        tied = [o for o in options if o[0] <= low + 1e-12 * abs(low)]
        decided[(state, k, t)] = best = min(tied, key=lambda o: o[1])[2]
        return best

    first = values.table(0)
    live = [s for s in range(1 << bits) if math.isfinite(float(first[s]))]
    value = dict.fromkeys(live, 0.0)
    for remaining in range(1, horizon + 1):
        t = remaining - 1
        new = {}
        for s in live:
            v = stay * value[s]
            for k in range(bits):
                if shares[k] == 0.0:
                    continue
                if s >> k & 1:
                    v += shares[k] * value[s]
                else:
                    v += shares[k] * (costs[k] + value[decide(s, k, t)])
            new[s] = v
        value = new
    return value[0]


def single_group(sizes: Sequence[int], costs: Sequence[float], shares: Sequence[float]) -> _Group:
    keys = [("default", f"k{k}") for k in range(len(sizes))]
    return _Group(
        keys=keys,
        index={key: i for i, key in enumerate(keys)},
        sizes={"m": list(sizes)},
        costs=list(costs),
        shares=list(shares),
    )


def one_space(picks: Sequence[int], sizes: Sequence[int], costs: Sequence[float]) -> list[Request]:
    return [
        Request(time=float(t), key=f"k{k}", size={"m": sizes[k]}, load_seconds=costs[k])
        for t, k in enumerate(picks)
    ]


# ------------------------------------------------ the solver against references

SPACES = ("a", "b", "c")


@st.composite
def messy_traces(draw: st.DrawFn) -> tuple[list[Request], dict[str, int]]:
    """Up to 4 keys (the same key string in two caches), each charging up to three
    spaces with sizes and costs that vary between requests, zero sizes, ``{}``."""
    count = draw(st.integers(1, 4))
    names = draw(
        st.lists(
            st.tuples(st.sampled_from(["c1", "c2"]), st.sampled_from(["x", "y"])),
            min_size=count,
            max_size=count,
            unique=True,
        )
    )
    profiles = []
    for _ in names:
        spaces = draw(st.lists(st.sampled_from(SPACES), max_size=3, unique=True))
        profiles.append({space: draw(st.integers(0, 5)) for space in spaces})
    length = draw(st.integers(1, 9))
    requests = []
    for t in range(length):
        k = draw(st.integers(0, count - 1))
        size = {}
        for space, top in profiles[k].items():
            if draw(st.booleans()):  # a request may charge less than the largest, or nothing
                size[space] = draw(st.integers(0, top))
            else:
                size[space] = top
        cost = draw(st.sampled_from([0.0, 0.5, 1.0, 2.0, 7.0]))
        cache, key = names[k]
        requests.append(Request(time=float(t), key=key, size=size, load_seconds=cost, cache=cache))
    largest = {s: max([r.size.get(s, 0) for r in requests] + [0]) for s in SPACES}
    total = {s: sum(p.get(s, 0) for p in profiles) for s in SPACES}
    budget = {s: draw(st.integers(largest[s], max(largest[s], total[s]))) for s in SPACES}
    return requests, budget


@needs_scipy
@settings(deadline=None, max_examples=100, suppress_health_check=[HealthCheck.too_slow])
@given(messy_traces())
def test_expected_is_the_brute_force_optimum_and_realised_is_never_below_offline(
    case: tuple[list[Request], dict[str, int]],
) -> None:
    requests, budget = case
    note(f"trace {[(r.cache, r.key, dict(r.size), r.load_seconds) for r in requests]}")
    note(f"budget {budget}")
    keys, sizes, costs, shares = reference_model(requests)
    online = online_optimum(requests, budget)
    expected = brute_expected(sizes, costs, shares, budget, len(requests))
    assert online.expected_seconds == pytest.approx(expected, rel=1e-9, abs=1e-9)
    assert online.keys == len(keys)
    assert online.largest_group == max(components(sizes))
    offline = offline_bound(requests, budget)
    assert offline.method == "exact"
    assert online.reload_seconds >= offline.reload_seconds - 1e-9
    # And never more than loading on every request.
    assert online.reload_seconds <= sum(r.load_seconds for r in requests) + 1e-9


@st.composite
def longer_traces(draw: st.DrawFn) -> tuple[list[Request], dict[str, int]]:
    """Up to 6 keys over two spaces (some charging both), 40 requests, varying costs."""
    count = draw(st.integers(2, 6))
    profiles = [draw(st.sampled_from([{"a": 1}, {"b": 1}, {"a": 1, "b": 1}])) for _ in range(count)]
    profiles = [{s: draw(st.integers(1, 6)) for s in p} for p in profiles]
    weights = draw(st.lists(st.integers(1, 9), min_size=count, max_size=count))
    seed = draw(st.integers(0, 2**16))
    rng = random.Random(seed)
    requests = []
    for t, k in enumerate(rng.choices(range(count), weights=weights, k=40)):
        requests.append(
            Request(
                time=float(t),
                key=f"k{k}",
                size=profiles[k],
                load_seconds=rng.choice([0.5, 1.0, 3.0, 10.0]),
            )
        )
    budget = {
        s: draw(
            st.integers(
                max([p.get(s, 0) for p in profiles] + [1]),
                max(1, sum(p.get(s, 0) for p in profiles)),
            )
        )
        for s in ("a", "b")
    }
    return requests, budget


@needs_scipy
@settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(longer_traces())
def test_realised_is_never_below_the_exact_offline_optimum_on_longer_traces(
    case: tuple[list[Request], dict[str, int]],
) -> None:
    requests, budget = case
    online = online_optimum(requests, budget)
    offline = offline_bound(requests, budget, time_limit=20)
    assert offline.method == "exact"
    assert online.reload_seconds >= offline.reload_seconds - 1e-9
    # The policy is an online policy: it may not beat the best built-in one by
    # more than the offline optimum does; it must pay at least every first load.
    firsts: dict[tuple[str, str], float] = {}
    for request in requests:
        firsts.setdefault((request.cache, request.key), request.load_seconds)
    assert online.reload_seconds >= sum(firsts.values()) - 1e-9


@needs_scipy
def test_a_chain_of_spaces_is_one_group_and_a_bridge_couples_them() -> None:
    """a-b and b-c: three keys of which no two share every space form one group, and
    the budget of b decides what a and c may keep."""
    #   A charges a and b, B charges b and c, C charges c alone, D charges d.
    sizes = {
        "A": {"a": 2, "b": 2},
        "B": {"b": 2, "c": 2},
        "C": {"c": 3},
        "D": {"d": 1},
    }
    costs = {"A": 5.0, "B": 1.0, "C": 3.0, "D": 2.0}
    rng = random.Random(11)
    picks = rng.choices("ABCD", weights=[3, 2, 4, 1], k=40)
    trace = [
        Request(time=float(t), key=k, size=sizes[k], load_seconds=costs[k])
        for t, k in enumerate(picks)
    ]
    budget = {"a": 2, "b": 3, "c": 5, "d": 1}  # A and B never together (b); B and C: 5 of c
    online = online_optimum(trace, budget)
    assert online.largest_group == 3 and online.keys == 4
    _, ref_sizes, ref_costs, ref_shares = reference_model(trace)
    assert online.expected_seconds == pytest.approx(
        brute_expected(ref_sizes, ref_costs, ref_shares, budget, len(trace)), rel=1e-9
    )
    assert online.reload_seconds >= offline_bound(trace, budget).reload_seconds - 1e-9
    # Ungrouped (the bridge key removed), a and c are independent processes.
    apart = online_optimum([r for r in trace if r.key != "B"], budget)
    assert apart.largest_group == 1


@needs_scipy
def test_the_same_key_string_in_two_caches_is_two_keys() -> None:
    """("c1", "x") and ("c2", "x") compete for room: with one fitting, alternation always loads."""
    trace = [
        Request(time=float(t), key="x", size={"m": 5}, load_seconds=1.0, cache=f"c{t % 2 + 1}")
        for t in range(10)
    ]
    online = online_optimum(trace, {"m": 5})
    assert online.keys == 2 and online.largest_group == 2
    assert online.reload_seconds == pytest.approx(10.0)
    both = online_optimum(trace, {"m": 10})
    assert both.reload_seconds == pytest.approx(2.0)


@needs_scipy
def test_sizes_are_each_keys_largest_so_a_later_larger_request_still_fits() -> None:
    """Key x is small at first and large later: the policy must plan for the large size."""
    trace = [
        Request(time=0.0, key="x", size={"m": 1}, load_seconds=1.0),
        Request(time=1.0, key="y", size={"m": 4}, load_seconds=1.0),
        Request(time=2.0, key="x", size={"m": 4}, load_seconds=1.0),
        Request(time=3.0, key="y", size={"m": 4}, load_seconds=1.0),
        Request(time=4.0, key="x", size={"m": 1}, load_seconds=1.0),
    ]
    online = online_optimum(trace, {"m": 5})
    # x (4 at its largest) and y (4) never fit together: every request misses.
    assert online.reload_seconds == pytest.approx(5.0)
    # The offline model takes the first size; the online figure is still not below it.
    assert online.reload_seconds >= offline_bound(trace, {"m": 5}).reload_seconds - 1e-9


@needs_scipy
def test_weightless_keys_are_loaded_once_and_never_counted_against_max_keys() -> None:
    """Thirty keys of size {} or 0 beside one space: each is its own group, loaded once."""
    trace = []
    for t in range(120):
        k = t % 30
        size: dict[str, int] = {} if k % 2 else {"m": 0}
        trace.append(Request(time=float(t), key=f"w{k}", size=size, load_seconds=1.0 + k))
    online = online_optimum(trace, {"m": 1}, max_keys=1)
    assert online.keys == 30 and online.largest_group == 1
    assert online.reload_seconds == pytest.approx(sum(1.0 + k for k in range(30)))


# ------------------------------------------------------------------ edges


@needs_scipy
def test_one_request_and_empty_trace() -> None:
    one = [Request(time=0.0, key="x", size={"m": 3}, load_seconds=2.5)]
    online = online_optimum(one, {"m": 3})
    assert online.reload_seconds == pytest.approx(2.5)
    assert online.expected_seconds == pytest.approx(2.5)
    assert online.keys == 1 and online.largest_group == 1
    empty = online_optimum([], {"m": 3})
    assert (empty.reload_seconds, empty.expected_seconds, empty.keys) == (0.0, 0.0, 0)


@needs_scipy
def test_free_loads_cost_nothing_and_cheap_keys_are_the_ones_dropped() -> None:
    free = one_space([0, 1, 2, 0, 1, 2], [3, 3, 3], [0.0, 0.0, 0.0])
    online = online_optimum(free, {"m": 3})
    assert (online.reload_seconds, online.expected_seconds) == (0.0, 0.0)
    # k0 is free but still needs room when requested: each k0 evicts k1 or k2, and
    # the one evicted is the one needed last (20 s, the offline optimum here too).
    mixed = one_space([1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2], [3, 3, 3], [0.0, 4.0, 4.0])
    online = online_optimum(mixed, {"m": 6})
    assert online.reload_seconds == pytest.approx(20.0)
    assert online.reload_seconds == pytest.approx(offline_bound(mixed, {"m": 6}).reload_seconds)
    # With room for all three, each key loads once: 8 s.
    assert online_optimum(mixed, {"m": 9}).reload_seconds == pytest.approx(8.0)


@needs_scipy
def test_only_one_key_fits_through_a_second_space() -> None:
    """Plenty of room in one space, a second space holds one key at a time."""
    trace = [
        Request(time=float(t), key=k, size={"ram": 1, "gpu": 10}, load_seconds=1.0)
        for t, k in enumerate("ababbaab")
    ]
    online = online_optimum(trace, {"ram": 100, "gpu": 10})
    assert online.reload_seconds == pytest.approx(6.0)  # every change of key


@needs_scipy
@pytest.mark.parametrize("count", [14, 15])
def test_max_keys_boundary(count: int) -> None:
    trace = one_space(list(range(count)) * 2, [1] * count, [1.0] * count)
    if count <= 14:
        online = online_optimum(trace, {"m": count})
        assert online.largest_group == count
        assert online.reload_seconds == pytest.approx(count)
    else:
        with pytest.raises(InvalidArgument, match=f"{count} keys of this trace share spaces"):
            online_optimum(trace, {"m": count})


@needs_scipy
def test_fifteen_keys_in_two_disjoint_spaces_are_within_the_limit_but_a_bridge_is_not() -> None:
    trace = [
        Request(
            time=float(t), key=f"k{t % 15}", size={"a" if t % 15 < 7 else "b": 1}, load_seconds=1.0
        )
        for t in range(30)
    ]
    budget = {"a": 3, "b": 3}
    online = online_optimum(trace, budget)
    assert online.largest_group == 8 and online.keys == 15
    bridge = Request(time=30.0, key="bridge", size={"a": 1, "b": 1}, load_seconds=1.0)
    with pytest.raises(InvalidArgument, match="16 keys"):
        online_optimum([*trace, bridge], budget)
    # The same key string in 15 caches is 15 keys.
    caches = [
        Request(time=float(t), key="x", size={"m": 1}, load_seconds=1.0, cache=f"c{t % 15}")
        for t in range(30)
    ]
    with pytest.raises(InvalidArgument, match="15 keys"):
        online_optimum(caches, {"m": 3})


# --------------------------------------------------- against online policies


@needs_scipy
def test_enumerated_coupled_spaces_expected_is_own_average_and_beats_every_policy() -> None:
    """Two spaces coupled by a key, a third apart, two caches: exact sums over every trace."""
    reference = [
        Request(time=0.0, key="A", size={"a": 2}, load_seconds=4.0, cache="c1"),
        Request(time=1.0, key="B", size={"a": 2, "b": 2}, load_seconds=2.0, cache="c1"),
        Request(time=2.0, key="A", size={"b": 3}, load_seconds=3.0, cache="c2"),
        Request(time=3.0, key="D", size={"c": 1}, load_seconds=1.0, cache="c2"),
    ]
    shares_list = [0.4, 0.2, 0.3, 0.1]
    shares = {(r.cache, r.key): s for r, s in zip(reference, shares_list, strict=True)}
    budget = {"a": 3, "b": 4, "c": 1}
    length = 5
    groups = _groups(reference, shares)
    assert sorted(len(g.keys) for g in groups) == [1, 3]
    solved = [
        (g, values, values.expected) for g in groups for values in [_Values(g, budget, length)]
    ]
    expected = sum(from_empty for _, _, from_empty in solved)
    own = 0.0
    averages = dict.fromkeys(POLICIES, 0.0)
    for picks in itertools.product(range(4), repeat=length):
        chance = math.prod(shares_list[k] for k in picks)
        trace = [attr_copy(reference[k], time=float(t)) for t, k in enumerate(picks)]
        own += chance * sum(_run(g, values, trace) for g, values, _ in solved)
        for policy in POLICIES:
            averages[policy] += (
                chance * replay(trace, budget, policy, timing="sequential").reload_seconds
            )
    assert own == pytest.approx(expected, rel=1e-9)
    for policy, average in averages.items():
        assert expected <= average + 1e-9, policy


def attr_copy(request: Request, **changes: object) -> Request:
    import attrs

    return attrs.evolve(request, **changes)  # type: ignore[arg-type]


@needs_scipy
def test_sampled_iid_traces_expected_is_its_own_mean_and_no_policy_does_better() -> None:
    """Traces drawn i.i.d. from a known popularity: 4 standard errors of slack."""
    sizes, costs, shares = [4, 3, 3, 2], [9.0, 1.0, 3.0, 2.0], [0.15, 0.4, 0.3, 0.15]
    budget, length, samples = {"m": 6}, 60, 250
    group = single_group(sizes, costs, shares)
    values = _Values(group, budget, length)
    expected = values.expected
    rng = random.Random(2024)
    own: list[float] = []
    paid: dict[str, list[float]] = {policy: [] for policy in POLICIES}
    for _ in range(samples):
        trace = one_space(rng.choices(range(4), weights=shares, k=length), sizes, costs)
        own.append(_run(group, values, trace))
        for policy in POLICIES:
            paid[policy].append(replay(trace, budget, policy, timing="sequential").reload_seconds)
    error = statistics.stdev(own) / math.sqrt(samples)
    assert abs(statistics.mean(own) - expected) <= 4 * error
    for policy, costs_paid in paid.items():
        slack = 4 * statistics.stdev(costs_paid) / math.sqrt(samples)
        assert expected <= statistics.mean(costs_paid) + slack, policy


# -------------------------------------------------------- the stationary shortcut


@needs_scipy
def test_stationary_shortcut_gives_the_full_iterations_expected_value() -> None:
    sizes, costs, shares = [3, 2, 2], [5.0, 1.0, 2.0], [0.2, 0.5, 0.3]
    group = single_group(sizes, costs, shares)
    horizon = 1500
    values = _Values(group, {"m": 4}, horizon)
    expected = values.expected
    assert values.last < horizon  # the shortcut was taken
    full = brute_expected([{"m": s} for s in sizes], costs, shares, {"m": 4}, horizon)
    # The shortcut stops when the expected total is known within a relative 1e-9.
    assert expected == pytest.approx(full, rel=1e-8)


@needs_scipy
def test_a_tiny_table_cap_changes_nothing_of_the_expected_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sizes, costs, shares = [3, 2, 2, 1], [5.0, 1.0, 2.0, 7.0], [0.2, 0.45, 0.3, 0.05]
    group = single_group(sizes, costs, shares)
    expected = _Values(group, {"m": 5}, 800).expected
    monkeypatch.setattr(_online, "_TABLE_BYTES", 1)
    values = _Values(group, {"m": 5}, 800)
    assert values.stride == 400 and len(values.kept) <= 3
    assert values.expected == pytest.approx(expected, rel=1e-12)


@needs_scipy
def test_expected_never_exceeds_loading_each_key_once_when_everything_fits() -> None:
    """The budget holds both keys: any policy pays each key's load at most once.

    The exact expectation is sum(c * (1 - (1 - p) ** n)) <= 2. The solver stops
    when the span of one step is <= 1e-9 and adds ``step.max() * remaining``,
    though the rare key's step is still p * (1 - p) ** done > 0 and shrinking.
    """
    rng = random.Random(0)
    length = 20_000
    picks = ["x"] * length
    for i in rng.sample(range(length), 100):
        picks[i] = "w"
    trace = [
        Request(time=float(t), key=k, size={"m": 1}, load_seconds=1.0) for t, k in enumerate(picks)
    ]
    online = online_optimum(trace, {"m": 2})
    exact = sum(1 - (1 - c / length) ** length for c in (100, length - 100))
    assert online.reload_seconds == pytest.approx(2.0)
    # Known to a relative 1e-9 (the induction stops there), never beyond.
    assert online.expected_seconds <= 2.0 * (1 + 1e-9)
    assert online.expected_seconds == pytest.approx(exact, rel=1e-9)


@needs_scipy
def test_scaling_every_load_time_scales_both_figures() -> None:
    rng = random.Random(3)
    picks = rng.choices(range(5), weights=[5, 4, 3, 2, 1], k=300)
    sizes = [1, 2, 3, 4, 5]

    def figures(scale: float) -> tuple[float, float]:
        trace = one_space(picks, sizes, [(1.0 + k) * scale for k in range(5)])
        online = online_optimum(trace, {"m": 7})
        return online.reload_seconds / scale, online.expected_seconds / scale

    unit = figures(1.0)
    assert figures(1e3) == pytest.approx(unit, rel=1e-6)
    assert figures(1e-10) == pytest.approx(unit, rel=1e-6)


@needs_scipy
def test_the_policy_run_on_a_long_trace_expects_what_expected_seconds_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rare expensive key (k3: 100 s, one request in 10,000) is worth evicting the
    hot key k1 for over a long horizon but not over 511 requests; with tables
    capped at 512 (what 64 MiB holds for 14 keys) the policy evicts it instead."""
    assert _online._TABLE_BYTES // (8 * 2**14) == 512  # a 14-key group keeps 512 tables
    sizes, costs = [3, 4, 5, 3], [1.0, 5.0, 1.0, 100.0]
    weights = [0.0003, 1.0, 0.0001, 0.0001]
    shares = [w / sum(weights) for w in weights]
    group = single_group(sizes, costs, shares)
    budget, horizon = {"m": 11}, 6000
    # Uncapped, the policy run is exactly the optimum (checks policy_value itself).
    monkeypatch.setattr(_online, "_TABLE_BYTES", 2**40)
    values = _Values(group, budget, horizon)
    expected = values.expected
    assert values.stride == 1
    assert policy_value(group, values, horizon, 4) == pytest.approx(expected, rel=1e-9)
    # Capped at the 512 tables a 14-key group gets by default: one in 12 kept,
    # the others computed again when the run reaches them.
    monkeypatch.setattr(_online, "_TABLE_BYTES", 512 * 8 * 16)
    values = _Values(group, budget, horizon)
    assert values.stride == 12
    assert values.expected == pytest.approx(expected, rel=1e-9)
    assert policy_value(group, values, horizon, 4) == pytest.approx(expected, rel=1e-9)


@needs_scipy
def test_huge_sizes_do_not_overflow_the_fit_test() -> None:
    big = 2**62
    trace = [
        Request(time=float(t), key=k, size={"m": big}, load_seconds=1.0)
        for t, k in enumerate("abababab")
    ]
    lru = replay(trace, {"m": big}, "lru", timing="sequential").reload_seconds
    assert lru == 8.0
    assert online_optimum(trace, {"m": big}).reload_seconds == pytest.approx(8.0)


# ----------------------------------------------------------- long traces


@needs_scipy
def test_fifty_thousand_requests_of_twelve_keys_in_time_and_memory() -> None:
    import tracemalloc

    rng = random.Random(1)
    picks = rng.choices(range(12), weights=[1 / (i + 1) for i in range(12)], k=50_000)
    trace = one_space(picks, [1 + k for k in range(12)], [1.0 + k for k in range(12)])
    tracemalloc.start()
    try:
        online = online_optimum(trace, {"m": 30})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 100 * 2**20
    assert online.largest_group == 12
    assert online.reload_seconds > 0
    lru = replay(trace, {"m": 30}, "lru", timing="sequential").reload_seconds
    assert online.expected_seconds < lru


# --------------------------------------------------------- simulate, CLI, figure


@needs_scipy
def test_simulate_figure_without_online_when_skipped_and_named_when_approximate() -> None:
    trace = one_space(list(range(15)) * 2, [1] * 15, [1.0] * 15)
    comparisons = simulate(trace, [4, 8], ["lru"], bound=False, online=False)
    assert all(c.online is None and c.online_note is None for c in comparisons)
    reloads = figure(comparisons).axes[0]
    assert [line.get_label() for line in reloads.lines] == ["lru"]
    approximate = simulate(trace, [4, 8], ["lru"], bound=False)
    assert all(c.online is not None and not c.online.exact for c in approximate)
    reloads = figure(approximate).axes[0]
    assert [line.get_label() for line in reloads.lines] == ["lru", "online (approx.)"]


@needs_scipy
def test_simulate_online_is_the_same_under_both_timings_and_several_spaces() -> None:
    trace = [
        Request(
            time=2.0 * t,
            key=f"k{k}",
            size={"ram" if k < 3 else "gpu": 2 + k},
            load_seconds=1.0 + k,
            hold_seconds=1.5,
        )
        for t, k in enumerate([0, 3, 1, 4, 2, 5, 0, 3, 1, 4, 0, 5, 2, 3])
    ]
    budget = {"ram": "5B", "gpu": "9B"}
    sequential, timed = (
        simulate(trace, [budget], ["lru"], timing=timing)[0] for timing in ("sequential", "replay")
    )
    assert sequential.online is not None and timed.online is not None
    direct = online_optimum(trace, {"ram": 5, "gpu": 9})
    for comparison in (sequential, timed):
        online = comparison.online
        assert online is not None
        assert online.reload_seconds == pytest.approx(direct.reload_seconds)
        assert online.expected_seconds == pytest.approx(direct.expected_seconds)
    assert sequential.bound is not None
    assert sequential.online.reload_seconds >= sequential.bound.reload_seconds - 1e-9


def write_trace(path: Path, rows: list[str], header: str = "time,key,size,load_seconds") -> str:
    path.write_text("\n".join([header, *rows]) + "\n")
    return str(path)


@needs_scipy
def test_cli_json_with_too_many_keys_has_the_approximation_and_a_note(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from cachebroker.__main__ import main

    rows = [f"{t},k{t % 15},1,1.0" for t in range(45)]
    path = write_trace(tmp_path / "many.csv", rows)
    assert main(["simulate", "--trace", path, "--budget", "4,8", "--json", "--no-bound"]) == 0
    out = capsys.readouterr().out
    data = json.loads(out)
    assert len(data) == 2 * len(POLICIES)
    for row in data:
        assert row["online_reload_seconds"] is not None
        assert row["online_exact"] is False and row["online_slack_seconds"] > 0
        assert "15 keys share spaces, more than the 14 solved exactly" in row["online_note"]
    assert main(["simulate", "--trace", path, "--budget", "4", "--no-bound"]) == 0
    text = capsys.readouterr().out
    assert "online (approx.): 15 keys share spaces" in text
    assert any("  online (approx.)  " in line for line in text.splitlines())
    assert not any("  online optimum  " in line for line in text.splitlines())
    assert any("  lru  " in line for line in text.splitlines())
    args = ["simulate", "--trace", path, "--budget", "4", "--no-bound", "--max-keys", "15"]
    assert main([*args, "--json"]) == 0
    for row in json.loads(capsys.readouterr().out):
        assert row["online_exact"] is True and row["online_slack_seconds"] == 0
        assert row["online_note"] is None
    with pytest.raises(SystemExit):
        main([*args[:-1], "0"])
    assert "max_keys must be an integer from 1 to 20" in capsys.readouterr().err


@needs_scipy
def test_cli_no_online_json_and_replay_timing_and_several_spaces(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from cachebroker.__main__ import main

    pattern = [0, 3, 1, 4, 2, 5, 0, 3, 1, 4, 0, 5, 2, 3, 1, 1]
    rows = [
        f"{2 * t},k{k},{2 + k},{1.0 + k + (t % 3) * 0.5},1.5,{'ram' if k < 3 else 'gpu'}"
        for t, k in enumerate(pattern)
    ]
    header = "time,key,size,load_seconds,hold_seconds,space"
    path = write_trace(tmp_path / "two.csv", rows, header)
    budget = "ram=5B,gpu=9B"
    assert main(["simulate", "--trace", path, "--budget", budget, "--json", "--no-online"]) == 0
    for row in json.loads(capsys.readouterr().out):
        assert row["online_reload_seconds"] is None
        assert row["online_expected_seconds"] is None
        assert row["online_note"] is None
    from cachebroker.simulator import read_trace

    direct = online_optimum(read_trace(path), {"ram": 5, "gpu": 9})
    for timing in ("sequential", "replay"):
        args = ["simulate", "--trace", path, "--budget", budget, "--json", "--timing", timing]
        assert main(args) == 0
        data = json.loads(capsys.readouterr().out)
        for row in data:
            assert row["timing"] == timing
            assert row["online_reload_seconds"] == pytest.approx(direct.reload_seconds, abs=1e-3)
            assert row["online_expected_seconds"] == pytest.approx(
                direct.expected_seconds, abs=1e-3
            )
            assert row["online_note"] is None
            assert row["online_reload_seconds"] >= row["bound_reload_seconds"] - 1e-3
    assert main(["simulate", "--trace", path, "--budget", budget, "--timing", "replay"]) == 0
    text = capsys.readouterr().out
    online_rows = [line for line in text.splitlines() if "  online optimum  " in line]
    assert len(online_rows) == 1
    assert f"{direct.reload_seconds:,.0f}" in online_rows[0]
