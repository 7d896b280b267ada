"""The simulator: traces, replay figures, the offline optimum and the command line."""

from __future__ import annotations

import io
import itertools
import json
import re
import sys
from pathlib import Path

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachebroker import InvalidArgument
from cachebroker.__main__ import main
from cachebroker.simulator import (
    BUDGETS,
    POLICIES,
    Request,
    TraceError,
    _cli,
    builtin_workload,
    figure,
    offline_bound,
    parse_trace,
    plot,
    read_trace,
    replay,
    resolve_budgets,
    simulate,
)
from cachebroker.simulator._cli import _print_table

GiB = 2**30


def req(time: float, key: str, size: int = 10, load: float = 1.0, hold: float = 0.0) -> Request:
    return Request(time=time, key=key, size={"default": size}, load_seconds=load, hold_seconds=hold)


def spaced(keys: str, *, size: int = 10, load: float = 1.0, gap: float = 10.0) -> list[Request]:
    """One request per letter, ``gap`` seconds apart (every load ends before the next)."""
    return [req(i * gap, key, size, load) for i, key in enumerate(keys)]


# ------------------------------------------------------------------ traces


def test_trace_with_every_column() -> None:
    text = (
        "time,key,size,load_seconds,hold_seconds,space,cache\n"
        "0,llama,4GiB,8,1.5,cuda:0,chat\n"
        "\n"
        "2.5,whisper,1500000000,2,,,\n"
    )
    first, second = parse_trace(text)
    assert first == Request(
        time=0.0,
        key="llama",
        size={"cuda:0": 4 * GiB},
        load_seconds=8.0,
        hold_seconds=1.5,
        cache="chat",
        line=2,
    )
    assert second.size == {"default": 1_500_000_000}
    assert (second.hold_seconds, second.cache, second.line) == (0.0, "default", 4)


def test_columns_may_come_in_any_order() -> None:
    (request,) = parse_trace("key,load_seconds,size,time\nm,3,10,1\n")
    assert (request.key, request.load_seconds, request.size, request.time) == (
        "m",
        3.0,
        {"default": 10},
        1.0,
    )


@pytest.mark.parametrize(
    ("row", "line", "column", "message"),
    [
        ("x,k,10,1", 3, "time", "expected a number of seconds, got 'x'"),
        ("nan,k,10,1", 3, "time", "expected a number of seconds"),
        ("0.5,k,10,1", 3, "time", "earlier than the previous row's 1"),
        ("2,,10,1", 3, "key", "must not be empty"),
        ("2,k,lots,1", 3, "size", "size 'lots' is not a byte quantity"),
        ("2,k,,1", 3, "size", "must not be empty"),
        ("2,k,-5,1", 3, "size", "size must not be negative, got '-5'"),
        ("2,k,10,-1", 3, "load_seconds", "non-negative number of seconds, got '-1'"),
        ("2,k,10,inf", 3, "load_seconds", "non-negative number of seconds"),
        ("2,k,10", 3, None, "expected 4 fields (time, key, size, load_seconds), got 3"),
        ("2,a,20,1", 3, "size", "default:a was {'default': 10} on line 2"),
    ],
)
def test_bad_rows_name_their_line_and_column(
    row: str, line: int, column: str | None, message: str
) -> None:
    text = f"time,key,size,load_seconds\n1,a,10,1\n{row}\n"
    with pytest.raises(TraceError, match="trace, line") as info:
        parse_trace(text)
    assert info.value.line == line
    assert info.value.column == column
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_a_key_may_not_change_space() -> None:
    text = "time,key,size,load_seconds,space\n0,a,10,1,ram\n1,a,10,1,gpu\n"
    with pytest.raises(TraceError, match="column 'space'"):
        parse_trace(text)


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ("time,key,size", "lacks the column(s) load_seconds"),
        ("time,key,size,load_seconds,model", "unknown column 'model'"),
        ("time,key,key,size,load_seconds", "column 'key' appears twice"),
    ],
)
def test_bad_headers_are_rejected(header: str, message: str) -> None:
    with pytest.raises(TraceError, match="line 1") as info:
        parse_trace(header + "\n")
    assert message in str(info.value)


def test_empty_trace_is_an_error() -> None:
    with pytest.raises(TraceError, match="the trace is empty"):
        parse_trace("")


def test_read_trace_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("time,key,size,load_seconds\n0,a,big,1\n")
    with pytest.raises(TraceError, match=r"t\.csv, line 2, column 'size'"):
        read_trace(path)


# ------------------------------------------------------------------ replay


def test_replay_counts_hits_and_misses() -> None:
    trace = spaced("ABAB")
    fits_both = replay(trace, {"default": 20}, "lru")
    assert (fits_both.hits, fits_both.misses, fits_both.reload_seconds) == (2, 2, 2.0)
    assert fits_both.evictions == 0
    fits_one = replay(trace, {"default": 10}, "lru")
    assert (fits_one.hits, fits_one.misses, fits_one.evictions) == (0, 4, 3)
    assert fits_one.bytes_loaded == 40
    assert fits_one.all_loads_seconds == 4.0
    assert fits_one.hit_ratio == 0.0


def test_lru_and_fifo_differ_where_they_should() -> None:
    # A is reused just before C needs room: LRU keeps it, FIFO evicts it.
    trace = spaced("ABACA")
    assert replay(trace, {"default": 20}, "lru").misses == 3
    assert replay(trace, {"default": 20}, "fifo").misses == 4


def test_requests_during_a_load_join_it() -> None:
    trace = [req(0, "A", load=5), req(1, "A", load=5), req(2, "A", load=5)]
    result = replay(trace, {"default": 10}, "lru")
    assert (result.misses, result.hits, result.reload_seconds) == (1, 2, 5.0)
    assert result.wait_seconds == (0.0, 0.0, 0.0)


def test_held_leases_pin_entries_and_make_others_wait() -> None:
    # A is held 10 s after its 1 s load; B needs A's room and waits until 11.
    trace = [req(0, "A", load=1, hold=10), req(2, "B", load=1)]
    result = replay(trace, {"default": 10}, "lru")
    assert result.wait_seconds == (0.0, 9.0)
    assert result.waited == 1
    assert result.mean_wait == 4.5
    assert result.p99_wait == 9.0
    assert result.evictions == 1


def test_idle_ttl_releases_idle_entries() -> None:
    trace = spaced("AA", gap=100)
    assert replay(trace, {"default": 10}, "lru").misses == 1
    assert replay(trace, {"default": 10}, "lru", idle_ttl=50).misses == 2


def test_replay_rejects_what_cannot_fit() -> None:
    with pytest.raises(ValueError, match="needs 50 bytes of 'default', more than its whole budget"):
        replay([req(0, "A", size=50)], {"default": 10}, "lru")
    with pytest.raises(ValueError, match="requests must be in time order"):
        replay([req(5, "A"), req(1, "B")], {"default": 10}, "lru")


# ------------------------------------------------------------------ optimum


def test_optimum_of_a_cycle_is_beladys() -> None:
    # A B C repeated 10 times with room for two: the optimum misses 16 times
    # (3 cold misses, then one in every two requests); LRU misses every time.
    trace = spaced("ABC" * 10)
    bound = offline_bound(trace, {"default": 20})
    assert bound.method == "exact"
    assert bound.reload_seconds == pytest.approx(16.0)
    assert replay(trace, {"default": 20}, "lru").reload_seconds == 30.0


def test_optimum_weighs_cost_and_size() -> None:
    # Room for 30 bytes: "big" (20 bytes, 100 s to load) alternates with two
    # small ones (10 bytes, 1 s). Keeping big resident leaves room for one
    # small one at a time, so each small one's second request reloads it:
    # 102 s of cold loads + 2 x 1 s. Evicting big instead would cost 100 s.
    keys = ["big", "s1", "s2", "big", "s1", "s2", "big"]
    trace = [
        req(i * 200.0, key, size=20 if key == "big" else 10, load=100 if key == "big" else 1)
        for i, key in enumerate(keys)
    ]
    bound = offline_bound(trace, {"default": 30})
    assert bound.method == "exact"
    assert bound.reload_seconds == pytest.approx(104.0)
    assert replay(trace, {"default": 30}, "lru").reload_seconds >= bound.reload_seconds


def test_lp_relaxation_is_a_lower_bound_of_the_optimum() -> None:
    trace = spaced("ABCDABCEABCDE" * 3)
    exact = offline_bound(trace, {"default": 30})
    relaxed = offline_bound(trace, {"default": 30}, exact_limit=0)
    assert relaxed.method == "lp"
    assert relaxed.reload_seconds <= exact.reload_seconds + 1e-6
    assert exact.variables == len(trace) - 5


@settings(deadline=None)
@given(
    keys=st.lists(st.integers(0, 7), min_size=1, max_size=60),
    sizes=st.lists(st.integers(1, 40), min_size=8, max_size=8),
    loads=st.lists(st.floats(0.1, 20), min_size=8, max_size=8),
    budget=st.integers(40, 120),
)
def test_optimum_is_never_above_any_policy(
    keys: list[int], sizes: list[int], loads: list[float], budget: int
) -> None:
    # Requests spaced wider than any load, so none waits for space: the
    # optimum is then a true lower bound of every schedule.
    trace = [
        req(i * 30.0, f"k{key}", size=sizes[key], load=loads[key]) for i, key in enumerate(keys)
    ]
    bound = offline_bound(trace, {"default": budget})
    assert bound.method == "exact"
    for policy in POLICIES:
        assert (
            bound.reload_seconds <= replay(trace, {"default": budget}, policy).reload_seconds + 1e-6
        )


@pytest.mark.parametrize("time_limit", [0.02, 0.1])
@pytest.mark.parametrize(("seed", "budget"), [(1, BUDGETS[0]), (2, BUDGETS[1])])
def test_a_time_limited_optimum_brackets_the_exact_one(
    seed: int, budget: int, time_limit: float
) -> None:
    # Cut short, the MILP reports its proven bound and the best solution it
    # found (or, having proved nothing, the LP): the optimum is inside.
    trace = builtin_workload(seed, requests=3000)
    exact = offline_bound(trace, {"default": budget}, time_limit=120)
    assert exact.method == "exact" and exact.upper_seconds == exact.reload_seconds
    assert exact.gap == 0.0
    cut = offline_bound(trace, {"default": budget}, time_limit=time_limit)
    assert cut.reload_seconds <= exact.reload_seconds + 1e-6
    if cut.upper_seconds is not None:
        assert cut.upper_seconds >= exact.reload_seconds - 1e-6
        assert cut.gap is not None and 0.0 <= cut.gap < 1.0
    else:
        assert cut.method in ("lp", "milp-bound") and cut.gap is None


@settings(deadline=None)
@given(
    keys=st.lists(st.integers(0, 7), min_size=1, max_size=80),
    sizes=st.lists(st.integers(1, 40), min_size=8, max_size=8),
    loads=st.lists(st.floats(0.1, 20), min_size=8, max_size=8),
    budget=st.integers(40, 120),
    two_spaces=st.booleans(),
)
def test_the_lp_is_bracketed_by_a_greedy_schedule_around_the_optimum(
    keys: list[int], sizes: list[int], loads: list[float], budget: int, two_spaces: bool
) -> None:
    def size(key: int) -> dict[str, int]:
        if two_spaces and key % 2:
            return {"ram": sizes[key], "gpu": sizes[(key + 3) % 8]}
        return {"ram": sizes[key]}

    trace = [
        Request(time=float(i), key=f"k{key}", size=size(key), load_seconds=loads[key])
        for i, key in enumerate(keys)
    ]
    room = {"ram": budget, "gpu": budget}
    exact = offline_bound(trace, room)
    relaxed = offline_bound(trace, room, exact_limit=0)
    assert relaxed.method in ("lp", "exact") and relaxed.upper_seconds is not None
    assert relaxed.reload_seconds <= exact.reload_seconds + 1e-6
    assert exact.reload_seconds <= relaxed.upper_seconds + 1e-6
    assert relaxed.gap is not None and 0.0 <= relaxed.gap <= 1.0


def test_the_greedy_schedule_is_the_optimum_where_everything_fits() -> None:
    trace = spaced("ABCDABCE" * 3)
    relaxed = offline_bound(trace, {"default": 10_000}, exact_limit=0)
    assert relaxed.upper_seconds == pytest.approx(relaxed.reload_seconds)


def test_optimum_with_several_spaces() -> None:
    trace = [
        Request(time=0, key="a", size={"ram": 10}, load_seconds=1),
        Request(time=10, key="b", size={"gpu": 10}, load_seconds=1),
        Request(time=20, key="a", size={"ram": 10}, load_seconds=1),
        Request(time=30, key="b", size={"gpu": 10}, load_seconds=1),
    ]
    # Each space holds its one key: only the cold loads.
    assert offline_bound(trace, {"ram": 10, "gpu": 10}).reload_seconds == 2.0


# ------------------------------------------------------------------ simulate


def test_budgets_are_resolved_to_the_trace_space() -> None:
    trace = [Request(time=0, key="a", size={"cuda:0": 10}, load_seconds=1)]
    assert resolve_budgets(["1KiB", 64], trace) == [{"cuda:0": 1024}, {"cuda:0": 64}]
    two = [*trace, Request(time=1, key="b", size={"ram": 10}, load_seconds=1)]
    with pytest.raises(ValueError, match="give each a budget"):
        resolve_budgets(["1KiB"], two)
    with pytest.raises(ValueError, match=r"budget ram=100 B has no amount for the space\(s\) cuda"):
        resolve_budgets([{"ram": 100}], two)
    unnamed = [Request(time=0, key="a", size={"default": 10}, load_seconds=1)]
    with pytest.raises(ValueError, match=r"cuda:0=8\.0 GiB has no amount .* give one amount"):
        resolve_budgets(["cuda:0=8GiB"], unnamed)
    assert resolve_budgets([{"ram": "1KiB", "cuda:0": 5}], two) == [{"ram": 1024, "cuda:0": 5}]


def test_simulate_compares_every_policy_at_every_budget() -> None:
    steps: list[str] = []
    comparisons = simulate(spaced("ABCABD"), [20, 30], ["lru", "cost"], progress=steps.append)
    assert [c.label for c in comparisons] == ["20 B", "30 B"]
    assert [[r.policy for r in c.results] for c in comparisons] == [["lru", "cost"]] * 2
    assert all(c.bound is not None for c in comparisons)
    assert steps[:3] == ["lru at 20 B", "cost at 20 B", "optimum at 20 B"]
    with pytest.raises(ValueError, match="unknown policy 'mru'"):
        simulate(spaced("A"), [10], ["mru"])


def test_builtin_workload_is_the_documented_one() -> None:
    requests = builtin_workload()
    assert len(requests) == 2000
    assert len({r.key for r in requests}) == 12
    assert all(a.time <= b.time for a, b in itertools.pairwise(requests))
    assert max(r.size["default"] for r in requests) <= min(BUDGETS)
    assert builtin_workload(seed=2) != requests
    assert builtin_workload(requests=10)[-1] == requests[9]
    with pytest.raises(ValueError, match="requests must be between 1 and 8818"):
        builtin_workload(requests=9000)


def test_plot_is_written(tmp_path: Path) -> None:
    comparisons = simulate(spaced("ABCABD"), [20, 30, 40])
    path = tmp_path / "plot.png"
    plot(comparisons, path, title="t.csv: 6 requests")
    assert path.read_bytes().startswith(b"\x89PNG")


def test_figure_draws_reloads_hit_ratio_and_waits_under_a_title() -> None:
    # A is held 10 s after its 1 s load; B needs A's room and waits 9 s.
    trace = [req(0, "A", load=1, hold=10), req(2, "B", load=1)]
    comparisons = simulate(trace, [10, 20], ["lru", "cost"], timing="replay")
    drawn = figure(comparisons, title="t.csv: 2 requests")
    assert drawn.get_suptitle() == "t.csv: 2 requests"
    reloads, ratios, waits = drawn.axes
    assert reloads.get_title() == "Reload time" and ratios.get_title() == "Hit ratio"
    assert waits.get_title() == "Wait for space: mean (solid), p99 (dashed)"
    lru_mean, lru_p99, cost_mean, cost_p99 = waits.lines
    assert lru_mean.get_ydata() == pytest.approx([4.5, 0.0])  # at 10 bytes, then at 20
    assert lru_p99.get_ydata() == pytest.approx([9.0, 0.0])
    assert lru_mean.get_color() == lru_p99.get_color() != cost_mean.get_color()
    assert cost_p99.get_linestyle() == "--"
    assert [line.get_label() for line in reloads.lines] == [
        "lru",
        "cost",
        "optimum",
        "online optimum",
    ]
    assert figure(comparisons).get_suptitle() == "2 requests"


def test_figure_leaves_out_the_waits_in_the_sequential_model() -> None:
    trace = [req(0, "A", load=1, hold=10), req(2, "B", load=1)]
    drawn = figure(simulate(trace, [10, 20], ["lru"], timing="sequential"))
    assert [axes.get_title() for axes in drawn.axes] == ["Reload time", "Hit ratio"]


# ------------------------------------------------------------------ command line


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    path = tmp_path / "trace.csv"
    rows = [f"{i * 10},{key},10,2" for i, key in enumerate("ABCABDABCE")]
    path.write_text("time,key,size,load_seconds\n" + "\n".join(rows) + "\n")
    return path


def test_cli_json_output(trace_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["simulate", "--trace", str(trace_file), "--budget", "20,30", "--json"]
    assert main(args) == 0
    results = json.loads(capsys.readouterr().out)
    assert len(results) == 2 * len(POLICIES)
    first = results[0]
    for key in ("policy", "budget", "requests", "hits", "reload_seconds", "bound_reload_seconds"):
        assert key in first
    assert (first["policy"], first["budget"], first["requests"]) == ("lru", 20, 10)
    assert first["bound_method"] == "exact"
    assert first["bound_upper_reload_seconds"] == first["bound_reload_seconds"]
    assert first["waited_requests"] == 0
    assert all(r["bound_reload_seconds"] <= r["reload_seconds"] for r in results)


def test_cli_notes_give_a_cut_short_optimums_bracket(capsys: pytest.CaptureFixture[str]) -> None:
    trace = builtin_workload(1, requests=3000)
    comparisons = simulate(trace, [BUDGETS[0]], ("lru",), bound_time_limit=0.02)
    bound = comparisons[0].bound
    assert bound is not None
    cut = attrs.evolve(bound, method="milp-bound", upper_seconds=bound.reload_seconds * 1.25)
    _cli._print_notes([attrs.evolve(comparisons[0], bound=cut)], sys.stdout)
    note = capsys.readouterr().out
    assert "the optimum lies between it and the best schedule found" in note
    assert f"{cut.upper_seconds:,.0f} s (20.0% above)" in note


def test_cli_json_rounds_seconds_and_ratios(capsys: pytest.CaptureFixture[str]) -> None:
    # The built-in workload's load times sum to floats such as 10083.599999999984.
    args = ["simulate", "--budget", "56GiB,64GiB", "--policy", "lru,cost", "--no-bound", "--json"]
    assert main(args) == 0
    text = capsys.readouterr().out
    results = json.loads(text)
    assert [list(row) for row in results] == [list(results[0])] * len(results)
    assert not re.search(r"\.\d{5,}", text), "a float with a long tail"
    for row in results:
        for key in ("reload_seconds", "all_loads_seconds", "mean_wait_seconds"):
            assert row[key] == round(row[key], 3)
        assert row["hit_ratio"] == round(row["hit_ratio"], 4)
        assert row["hit_ratio"] == pytest.approx(row["hits"] / row["requests"], abs=5e-5)


def test_cli_table_and_plot(
    trace_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png = tmp_path / "out.png"
    args = ["simulate", "--trace", str(trace_file), "--budget", "20", "--budget", "30"]
    assert main([*args, "--policy", "lru,gdsf", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "trace.csv: 10 requests" in out
    assert "optimum" in out and "gdsf" in out and "vs optimum" in out
    assert png.read_bytes().startswith(b"\x89PNG")


def test_cli_plot_is_titled_by_the_workload(
    trace_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import cachebroker.simulator._cli as cli

    titles: list[str] = []
    monkeypatch.setattr(cli, "plot", lambda comparisons, path, *, title: titles.append(title))
    png = str(tmp_path / "out.png")
    assert main(["simulate", "--trace", str(trace_file), "--budget", "20", "--plot", png]) == 0
    assert (
        main(["simulate", "--budget", "72GiB", "--policy", "lru", "--no-bound", "--plot", png]) == 0
    )
    assert titles == [
        "trace.csv: 10 requests",
        "built-in: Azure LLM 2023 code trace, 2,000 requests (seed 1)",
    ]


def test_cli_several_spaces_without_bound(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "t.csv"
    path.write_text("time,key,size,load_seconds,space\n0,a,10,1,ram\n1,b,10,1,gpu\n2,a,10,1,ram\n")
    args = ["simulate", "--trace", str(path), "--budget", "ram=10,gpu=10", "--no-bound"]
    assert main([*args, "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert results[0]["budget"] == {"ram": 10, "gpu": 10}
    assert results[0]["hits"] == 1
    assert results[0]["bound_reload_seconds"] is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--budget", "lots"], "--budget 'lots' is not a byte quantity"),
        (["--budget", "ram=1GiB,gpu"], "'ram=1GiB,gpu': expected SPACE=AMOUNT pairs"),
        (["--budget", "5"], "needs 10 bytes of 'default', more than its whole budget of 5"),
        (["--budget", "20", "--policy", "mru"], "unknown policy 'mru'"),
        (["--budget", "20", "--idle-ttl", "-1"], "--idle-ttl must be a positive number"),
        ([], "--trace needs --budget"),
    ],
)
def test_cli_errors_are_clear(
    trace_file: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", "--trace", str(trace_file), *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert "usage:" not in err and "(see cachebroker simulate --help)" in err


def test_cli_usage_errors_still_print_the_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", "--idle-ttl", "soon"])
    assert exit_info.value.code == 2
    assert "usage: cachebroker simulate" in capsys.readouterr().err


def test_cli_bad_trace_prints_the_error_alone_with_a_hint_to_help(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("time,key,size,load_seconds\n0,a,10,slow\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", "--trace", str(bad), "--budget", "1GiB"])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        f"cachebroker simulate: error: {bad}, line 2, column 'load_seconds': "
        "expected a non-negative number of seconds, got 'slow'",
        "(see cachebroker simulate --help)",
    ]


def test_cli_missing_trace_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", "--trace", str(tmp_path / "none.csv"), "--budget", "1GiB"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "none.csv: No such file or directory" in err
    assert "usage:" not in err


def test_cli_builtin_workload(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--budget", "72GiB", "--policy", "lru,cost"]) == 0
    out = capsys.readouterr().out
    assert "built-in workload (seed 1): 2,000 requests" in out
    assert "72.0 GiB" in out and "optimum" in out


def test_rich_table_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "160")

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Terminal()
    _print_table(simulate(spaced("ABAB"), [10]), "t.csv", 4, out)
    text = out.getvalue()
    assert "t.csv: 4 requests" in text and "optimum" in text and "┃" in text


def test_cli_without_the_sim_extra(
    trace_file: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import cachebroker.simulator._cli as cli

    monkeypatch.setattr(cli, "_has", lambda module: False)
    assert main(["simulate", "--trace", str(trace_file), "--budget", "20"]) == 0
    captured = capsys.readouterr()
    assert "the offline optimum needs scipy" in captured.err
    assert "optimum" not in captured.out and "lru" in captured.out
    with pytest.raises(SystemExit):
        main(["simulate", "--trace", str(trace_file), "--budget", "20", "--plot", "x.png"])
    assert "--plot needs matplotlib" in capsys.readouterr().err


def test_requests_that_wait_can_come_in_under_the_optimum_and_the_table_says_so() -> None:
    # A is held 10 s per request; C needs all 20 bytes, so it waits until A's
    # leases end at 15, and the second C joins it there: two loads. The model
    # serves requests as they arrive, so C evicts A at 2 and A evicts C at 5.
    trace = [
        req(0, "A", size=10, load=1, hold=10),
        req(2, "C", size=20, load=1),
        req(5, "A", size=10, load=1, hold=10),
        req(6, "C", size=20, load=1),
    ]
    result = replay(trace, {"default": 20}, "lru")
    assert (result.misses, result.reload_seconds, result.waited) == (2, 2.0, 2)
    assert offline_bound(trace, {"default": 20}).reload_seconds == 4.0
    out = io.StringIO()
    _print_table(simulate(trace, [20], ["lru"], timing="replay"), "t.csv", 4, out)
    assert "the optimum assumes no request waits for space" in out.getvalue()
    assert "lru at 20 B" in out.getvalue()


@settings(deadline=None)
@given(
    keys=st.lists(st.integers(0, 5), min_size=1, max_size=40),
    gaps=st.lists(st.sampled_from([0.0, 0.5, 1.0, 3.0, 10.0]), min_size=40, max_size=40),
    sizes=st.lists(st.integers(1, 40), min_size=6, max_size=6),
    loads=st.lists(st.floats(0.1, 8), min_size=6, max_size=6),
    budget=st.integers(40, 100),
)
def test_optimum_is_never_above_a_policy_under_which_no_request_waited(
    keys: list[int], gaps: list[float], sizes: list[int], loads: list[float], budget: int
) -> None:
    # Loads overlap requests here (requests for a loading key join it); only
    # waiting for space is outside the model.
    trace, now = [], 0.0
    for key, gap in zip(keys, gaps, strict=False):
        now += gap
        trace.append(req(now, f"k{key}", size=sizes[key], load=loads[key]))
    bound = offline_bound(trace, {"default": budget}).reload_seconds
    for policy in POLICIES:
        result = replay(trace, {"default": budget}, policy)
        if result.waited == 0:
            assert bound <= result.reload_seconds + 1e-6, policy


@settings(deadline=None)
@given(
    keys=st.lists(st.integers(0, 5), min_size=1, max_size=40),
    gaps=st.lists(st.sampled_from([0.0, 0.5, 1.0, 3.0, 10.0]), min_size=40, max_size=40),
    holds=st.lists(st.sampled_from([0.0, 2.0, 20.0]), min_size=40, max_size=40),
    sizes=st.lists(st.integers(1, 40), min_size=6, max_size=6),
    loads=st.lists(st.floats(0.1, 8), min_size=6, max_size=6),
    budget=st.integers(40, 100),
)
def test_under_sequential_timing_the_optimum_is_below_every_policy(
    keys: list[int],
    gaps: list[float],
    holds: list[float],
    sizes: list[int],
    loads: list[float],
    budget: int,
) -> None:
    # Whatever the arrivals, loads and holds: sequential timing is the
    # optimum's own model, so no request waits and no policy beats it.
    trace, now = [], 0.0
    for key, gap, hold in zip(keys, gaps, holds, strict=False):
        now += gap
        trace.append(req(now, f"k{key}", size=sizes[key], load=loads[key], hold=hold))
    bound = offline_bound(trace, {"default": budget}).reload_seconds
    for policy in POLICIES:
        result = replay(trace, {"default": budget}, policy, timing="sequential")
        assert result.waited == 0 and result.mean_wait == 0.0, policy
        assert bound <= result.reload_seconds + 1e-6, policy


def test_sequential_timing_serves_each_request_before_the_next() -> None:
    # Under the clock, B arrives while A's 5 s load runs and joins nothing:
    # with room for one, it waits; sequentially A is loaded (and its lease
    # over) before B arrives, so B evicts it and A's return reloads it.
    trace = [
        req(0, "A", size=10, load=5, hold=1),
        req(1, "B", size=10, load=5),
        req(2, "A", load=5),
    ]
    timed = replay(trace, {"default": 10}, "lru")
    sequential = replay(trace, {"default": 10}, "lru", timing="sequential")
    assert timed.waited >= 1
    assert (sequential.misses, sequential.reload_seconds, sequential.waited) == (3, 15.0, 0)
    with pytest.raises(InvalidArgument, match="timing must be one of sequential, replay"):
        replay(trace, {"default": 10}, "lru", timing="virtual")  # type: ignore[arg-type]


def test_cli_timing_decides_the_columns_and_says_what_the_optimum_is(
    trace_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", "--trace", str(trace_file), "--budget", "20"]) == 0
    sequential = capsys.readouterr().out
    assert "sequential timing" in sequential and "vs optimum" in sequential
    assert "wait mean" not in sequential
    assert (
        main(["simulate", "--trace", str(trace_file), "--budget", "20", "--timing", "replay"]) == 0
    )
    timed = capsys.readouterr().out
    assert "replay timing" in timed and "wait mean" in timed
    assert "vs optimum" not in timed and "not a bound of these figures" in timed
    args = ["simulate", "--trace", str(trace_file), "--budget", "20", "--json"]
    assert main([*args, "--timing", "replay"]) == 0
    assert {row["timing"] for row in json.loads(capsys.readouterr().out)} == {"replay"}


def test_read_trace_accepts_a_byte_order_mark_and_crlf(tmp_path: Path) -> None:
    path = tmp_path / "excel.csv"
    path.write_bytes(b"\xef\xbb\xbftime,key,size,load_seconds\r\n0,a,1KiB,2\r\n")
    (request,) = read_trace(path)
    assert (request.key, request.size, request.load_seconds) == ("a", {"default": 1024}, 2.0)
