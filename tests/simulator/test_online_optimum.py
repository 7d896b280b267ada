"""The online optimum: the optimal policy for a known popularity, checked by enumeration.

For a few keys and short traces every trace can be listed with its
probability under independent draws, so expectations are exact sums: the
expected cost the solver reports must be what its own policy pays on
average, no built-in policy may expect less, and on every single trace the
policy pays at least the offline optimum.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

from cachebroker import InvalidArgument
from cachebroker.simulator import (
    POLICIES,
    Request,
    offline_bound,
    online_optimum,
    replay,
    simulate,
)
from cachebroker.simulator._online import _Group, _run, _Values

pytest.importorskip("numpy")


def trace_of(picks: Sequence[int], sizes: Sequence[int], costs: Sequence[float]) -> list[Request]:
    return [
        Request(time=float(t), key=f"k{k}", size={"m": sizes[k]}, load_seconds=costs[k])
        for t, k in enumerate(picks)
    ]


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
    for picks in itertools.product(range(len(sizes)), repeat=length):
        chance = math.prod(shares[k] for k in picks)
        trace = trace_of(picks, sizes, costs)
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


def test_too_many_keys_sharing_a_space_is_refused_and_simulate_says_so() -> None:
    trace = trace_of(list(range(16)) * 2, [1] * 16, [1.0] * 16)
    with pytest.raises(InvalidArgument, match="16 keys of this trace share spaces"):
        online_optimum(trace, {"m": 8})
    online_optimum(trace, {"m": 8}, max_keys=16)  # a larger limit is the caller's choice
    (comparison,) = simulate(trace, [8], ["lru"], bound=False)
    assert comparison.online is None
    assert comparison.online_note is not None and "up to 14 keys" in comparison.online_note


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
