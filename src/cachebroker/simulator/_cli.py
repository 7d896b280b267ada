"""``cachebroker simulate``: the command line of ``cachebroker.simulator``."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, NoReturn

from .._errors import InvalidArgument
from .._sizes import parse_budget, parse_bytes
from .._units import format_bytes
from . import (
    BUDGETS,
    POLICIES,
    TIMINGS,
    Comparison,
    Request,
    builtin_workload,
    plot,
    read_trace,
    resolve_budgets,
    simulate,
)

__all__ = ["add_parser", "run"]

DESCRIPTION = """\
Replay a workload through the broker's own core under each eviction policy and
budget, on a virtual clock, and compare the total reload time with the offline
optimum. Without --trace it runs the built-in workload: 2,000 requests of the
Azure LLM inference trace 2023 (arrival gaps stretched 60x) over 12 real
checkpoints from 0.09 to 42.5 GB."""

TRACE_HELP = """\
CSV file with a header and one request per row. Columns: time (seconds,
non-decreasing), key, size (bytes or '4GiB'), load_seconds (what a miss costs);
optional hold_seconds (how long the lease is held, default 0), space (default
'default'), cache (the owner, default 'default'), promote_seconds (with --tier:
what a miss costs when the value waits in the lower tier, default a tenth of
load_seconds) and demote_seconds (the move down, default promote_seconds)."""

TIER_HELP = """compare each budget with a lower memory tier too: 'ram=64GiB' adds a space
'ram' of 64 GiB below every space the trace uses, where idle values are moved
instead of dropped and promoted back for their next request (at the trace's
promote_seconds); 'ram=64GiB,128GiB' compares two sizes of it; repeat for
more. Each budget is shown without the tier and with each."""


def add_parser(commands: Any, name: str, help: str) -> None:
    """Add the ``simulate`` command to ``commands`` (argparse sub-parsers)."""
    parser = commands.add_parser(name, help=help, description=DESCRIPTION)
    parser.add_argument("--trace", metavar="FILE", help=TRACE_HELP)
    parser.add_argument(
        "--budget",
        action="append",
        metavar="BUDGETS",
        help="budgets to compare: '16GiB,24GiB,32GiB' (each in the trace's one space) or "
        "'ram=16GiB,cuda:0=24GiB' (one budget of several spaces); repeat for more. "
        f"Default for the built-in workload: {','.join(f'{b // 2**30}GiB' for b in BUDGETS)}",
    )
    parser.add_argument("--tier", action="append", metavar="SPACE=SIZES", help=TIER_HELP)
    parser.add_argument(
        "--policy",
        default=",".join(POLICIES),
        metavar="NAMES",
        help=f"policies to compare, comma-separated (default: {','.join(POLICIES)})",
    )
    parser.add_argument(
        "--idle-ttl",
        type=float,
        metavar="SECONDS",
        help="release entries idle this long (in the trace's seconds)",
    )
    parser.add_argument(
        "--timing",
        choices=TIMINGS,
        default="sequential",
        help="sequential: loads take no time and leases end at once, the offline "
        "optimum's model (the default: the optimum is then a lower bound of every "
        "policy); replay: the virtual clock, with the trace's load times and holds",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument(
        "--quiet",
        "-q",
        action="store_true",
        help="print no progress on standard error (a bar on a terminal, else a line per step)",
    )
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        help="draw reload seconds, hit ratio and the wait for space against budget",
    )
    parser.add_argument(
        "--no-bound", action="store_true", help="skip the offline optimum (it needs scipy)"
    )
    parser.add_argument(
        "--no-online",
        action="store_true",
        help="skip the online optimum (the best policy knowing each key's popularity)",
    )
    parser.add_argument(
        "--max-keys",
        type=int,
        default=14,
        metavar="N",
        help="the most keys sharing spaces that the online optimum is solved over exactly "
        "(2^N states; default 14, at most 20); beyond, it is approximated, keeping N keys",
    )
    parser.add_argument(
        "--bound-time-limit",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="time the optimum may take per budget before a proven bound is shown "
        "instead (default: 30)",
    )
    parser.add_argument(
        "--seed", type=int, default=1, help="seed of the built-in workload's model choice"
    )


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run ``cachebroker simulate`` with parsed ``args``; return the exit status."""
    try:
        requests, source, budgets = _workload(args)
        policies = [name.strip() for name in args.policy.split(",") if name.strip()]
        budgets = resolve_budgets(budgets, requests)
        tiers = _tiers(args.tier or [], budgets)
        if args.idle_ttl is not None and not (args.idle_ttl > 0 and math.isfinite(args.idle_ttl)):
            raise InvalidArgument(f"--idle-ttl must be a positive number, got {args.idle_ttl}")
        if not args.bound_time_limit > 0:
            raise InvalidArgument("--bound-time-limit must be a positive number of seconds")
        if args.plot is not None and any(len(budget) != 1 for budget in budgets):
            raise InvalidArgument("--plot needs budgets of a single space")
        bound = not args.no_bound
        if bound and not _has("scipy"):
            print(
                "note: the offline optimum needs scipy (pip install scipy, cachebroker's "
                "'sim' extra); showing the policies alone",
                file=sys.stderr,
            )
            bound = False
        online = not args.no_online
        if online and not _has("numpy"):
            print(
                "note: the online optimum needs numpy (cachebroker's 'sim' extra); skipped",
                file=sys.stderr,
            )
            online = False
        if args.plot is not None and not _has("matplotlib"):
            raise InvalidArgument(
                "--plot needs matplotlib: pip install matplotlib (cachebroker's 'sim' extra)"
            )
        used = sorted({space for request in requests for space in request.size})
        steps = len(budgets) * ((1 + len(tiers)) * (len(policies) + bound) + online)
        with _progress(steps, quiet=args.quiet) as step:
            # Per budget: without a tier, then with each tier asked for.
            variants: list[list[Comparison]] = []
            for space, amount in [(None, 0), *tiers]:
                variants.append(
                    simulate(
                        requests,
                        budgets
                        if space is None
                        else [{**budget, space: amount} for budget in budgets],
                        policies,
                        idle_ttl=args.idle_ttl,
                        timing=args.timing,
                        bound=bound,
                        bound_time_limit=args.bound_time_limit,
                        online=online and space is None,
                        max_keys=args.max_keys,
                        progress=step,
                        tiers=None if space is None else dict.fromkeys(used, space),
                    )
                )
            comparisons = [c for per_budget in zip(*variants, strict=True) for c in per_budget]
        if args.plot is not None:
            plot(comparisons, args.plot, title=_plot_title(args, len(requests)))
    except OSError as exc:
        _fail(parser, f"{exc.filename}: {exc.strerror}" if exc.filename else str(exc))
    except (InvalidArgument, TypeError, ValueError) as exc:
        _fail(parser, str(exc))
    if args.json:
        json.dump(rows(comparisons), sys.stdout, indent=2)
        print()
    else:
        _print_table(comparisons, source, len(requests), sys.stdout)
        if args.plot is not None:
            print(f"plot written to {args.plot}")
    return 0


def _workload(args: argparse.Namespace) -> tuple[list[Request], str, list[Any]]:
    """The requests to replay, their name for the table, and the budgets asked for."""
    if args.trace is None:
        budgets = _budgets(args.budget) if args.budget else list(BUDGETS)
        return builtin_workload(args.seed), f"built-in workload (seed {args.seed})", budgets
    requests = read_trace(args.trace)
    if not requests:
        raise InvalidArgument(f"{args.trace}: the trace has a header but no request")
    if not args.budget:
        raise InvalidArgument("--trace needs --budget: the budgets to compare")
    return requests, args.trace, _budgets(args.budget)


def _plot_title(args: argparse.Namespace, requests: int) -> str:
    if args.trace is None:
        return f"built-in: Azure LLM 2023 code trace, {requests:,} requests (seed {args.seed})"
    return f"{Path(args.trace).name}: {requests:,} requests"


def _fail(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    """Exit with status 2 and ``message`` alone on standard error.

    The arguments parsed, so the usage block would only bury the message
    (a trace error names its line and column); a hint to ``--help`` replaces it.
    """
    parser.exit(2, f"{parser.prog}: error: {message}\n(see {parser.prog} --help)\n")


def _tiers(values: list[str], budgets: list[dict[str, int]]) -> list[tuple[str, int]]:
    """``--tier`` values as (lower space, bytes), checked against the budgets' spaces."""
    tiers: list[tuple[str, int]] = []
    for value in values:
        space, sep, amounts = value.partition("=")
        space = space.strip()
        parts = [part.strip() for part in amounts.split(",") if part.strip()]
        if not sep or not space or not parts or any("=" in part for part in parts):
            raise InvalidArgument(
                f"--tier {value!r} is not SPACE=SIZE[,SIZE...]: a lower tier's space and "
                "its budget(s), as in 'ram=64GiB' or 'ram=64GiB,128GiB'"
            )
        if any(space in budget for budget in budgets):
            raise InvalidArgument(
                f"--tier {value!r}: the budget already has a space {space!r}; the lower tier "
                "is a space of its own, below every space the trace uses "
                "(simulate(..., tiers=...) in Python sets any tiers)"
            )
        tiers.extend((space, parse_bytes(part, what=f"--tier {space}")) for part in parts)
    return tiers


def _budgets(values: list[str]) -> list[Any]:
    budgets: list[Any] = []
    for value in values:
        parts = [part.strip() for part in value.split(",") if part.strip()]
        if not parts:
            raise InvalidArgument(f"--budget {value!r} names no budget")
        if any("=" in part for part in parts):
            # One budget of several spaces, in the grammar of Broker(budget=...).
            budgets.append(parse_budget(value, what="--budget"))
        else:
            budgets.extend(parse_bytes(part, what="--budget") for part in parts)
    return budgets


def rows(comparisons: list[Comparison]) -> list[dict[str, Any]]:
    """One JSON-ready object per (policy, budget), with the same keys in the same order.

    Seconds are rounded to the millisecond and ratios to 4 decimals: sums of
    load times carry float noise (``10083.599999999984``) that means nothing.
    """
    out = []
    for comparison in comparisons:
        bound = comparison.bound
        optimum = None if bound is None else _seconds(bound.reload_seconds)
        top = comparison.top_budget
        budget: int | dict[str, int] = next(iter(top.values())) if len(top) == 1 else top
        for result in comparison.results:
            out.append(
                {
                    "policy": result.policy,
                    "budget": budget,
                    "budget_label": comparison.label,
                    "requests": result.requests,
                    "hits": result.hits,
                    "hit_ratio": _ratio(result.hit_ratio),
                    "misses": result.misses,
                    "reload_seconds": _seconds(result.reload_seconds),
                    "all_loads_seconds": _seconds(result.all_loads_seconds),
                    "bytes_loaded": result.bytes_loaded,
                    "evictions": result.evictions,
                    "waited_requests": result.waited,
                    "mean_wait_seconds": _seconds(result.mean_wait),
                    "p99_wait_seconds": _seconds(result.p99_wait),
                    "bound_reload_seconds": optimum,
                    "bound_upper_reload_seconds": (
                        None
                        if bound is None or bound.upper_seconds is None
                        else _seconds(bound.upper_seconds)
                    ),
                    "bound_method": None if bound is None else bound.method,
                    "online_reload_seconds": (
                        None
                        if comparison.online is None
                        else _seconds(comparison.online.reload_seconds)
                    ),
                    "online_expected_seconds": (
                        None
                        if comparison.online is None
                        else _seconds(comparison.online.expected_seconds)
                    ),
                    "online_exact": (
                        None if comparison.online is None else comparison.online.exact
                    ),
                    "online_slack_seconds": (
                        None
                        if comparison.online is None
                        else _seconds(comparison.online.slack_seconds)
                    ),
                    "online_note": comparison.online_note,
                    "timing": comparison.timing,
                    "tiers": dict(comparison.tiers),
                    "tier_budget": comparison.tier_budget or None,
                    "demotions": result.demotions,
                    "promotions": result.promotions,
                    "promote_seconds": _seconds(result.promote_seconds),
                }
            )
    return out


def _seconds(value: float) -> float:
    return round(value, 3) + 0.0  # + 0.0 turns a solver's -0.0 into 0.0


def _ratio(value: float) -> float:
    return round(value, 4) + 0.0


def _percent(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def _gap(value: float, bound: float | None) -> str:
    if bound is None:
        return ""
    if bound <= 0:
        return "+0%" if value <= 0 else "-"
    return f"{100 * (value / bound - 1):+.0f}%"


HEADERS = (
    "budget",
    "policy",
    "hits",
    "hit ratio",
    "misses",
    "reload s",
    "of all loads",
    "loaded",
    "evictions",
    "demotions",
    "promotions",
    "promote s",
    "wait mean",
    "wait p99",
    "vs optimum",
)


def table_rows(comparisons: list[Comparison]) -> list[tuple[str, ...]]:
    """The table's cells, one tuple per row (the optimum's row after each budget's policies)."""
    cells: list[tuple[str, ...]] = []
    for comparison in comparisons:
        bound = comparison.bound
        for result in comparison.results:
            cells.append(
                (
                    comparison.label,
                    result.policy,
                    f"{result.hits:,}",
                    f"{result.hit_ratio:.3f}",
                    f"{result.misses:,}",
                    f"{result.reload_seconds:,.0f}",
                    _percent(result.reload_seconds, result.all_loads_seconds),
                    format_bytes(result.bytes_loaded),
                    f"{result.evictions:,}",
                    f"{result.demotions:,}",
                    f"{result.promotions:,}",
                    f"{result.promote_seconds:,.0f}",
                    f"{result.mean_wait:.2f}s",
                    f"{result.p99_wait:.2f}s",
                    _gap(result.reload_seconds, None if bound is None else bound.reload_seconds),
                )
            )
        all_loads = comparison.results[0].all_loads_seconds
        if comparison.online is not None:
            seconds = comparison.online.reload_seconds
            cells.append(
                (
                    comparison.label,
                    "online optimum" if comparison.online.exact else "online (approx.)",
                    "",
                    "",
                    "",
                    f"{seconds:,.0f}",
                    _percent(seconds, all_loads),
                    *[""] * 7,
                    _gap(seconds, None if bound is None else bound.reload_seconds),
                )
            )
        if bound is not None:
            name = {"exact": "optimum", "milp-bound": "bound (milp)", "lp": "bound (lp)"}
            cells.append(
                (
                    comparison.label,
                    name[bound.method],
                    "",
                    "",
                    "",
                    f"{bound.reload_seconds:,.0f}",
                    _percent(bound.reload_seconds, all_loads),
                    *[""] * 8,
                )
            )
    return cells


def _print_table(comparisons: list[Comparison], source: str, requests: int, out: IO[str]) -> None:
    timing = comparisons[0].timing if comparisons else "sequential"
    title = f"{source}: {requests:,} requests, {timing} timing"
    cells = table_rows(comparisons)
    dropped = set()
    if timing == "sequential":
        dropped |= {"wait mean", "wait p99"}  # no request waits: loads take no time
    if not any(comparison.tiers for comparison in comparisons):
        dropped |= {"demotions", "promotions", "promote s"}
    if timing == "replay" or all(comparison.bound is None for comparison in comparisons):
        # The optimum is the sequential model's: under the virtual clock a
        # policy may come in under it (requests that wait for space).
        dropped.add("vs optimum")
    keep = [index for index, header in enumerate(HEADERS) if header not in dropped]
    headers = tuple(HEADERS[index] for index in keep)
    cells = [tuple(row[index] for index in keep) for row in cells]
    if out.isatty() and _has("rich"):
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title, title_justify="left")
        for index, header in enumerate(headers):
            table.add_column(header, justify="left" if index < 2 else "right")
        for index, row in enumerate(cells):
            last_of_budget = index + 1 == len(cells) or cells[index + 1][0] != row[0]
            table.add_row(*row, end_section=last_of_budget)
        Console(file=out).print(table)
    else:
        print(title, file=out)
        widths = [max(len(h), *(len(row[i]) for row in cells)) for i, h in enumerate(headers)]

        def line(row: tuple[str, ...]) -> str:
            return "  ".join(
                cell.ljust(width) if index < 2 else cell.rjust(width)
                for index, (cell, width) in enumerate(zip(row, widths, strict=True))
            ).rstrip()

        print(line(headers), file=out)
        for row in cells:
            print(line(row), file=out)
    _print_notes(comparisons, out)


def _print_notes(comparisons: list[Comparison], out: IO[str]) -> None:
    if any(c.online is not None for c in comparisons):
        print(
            "online optimum: the best policy knowing each key's share of the requests but not "
            "their order, run on the trace (a policy that follows a changing popularity may "
            "beat it); optimum: the best schedule knowing the order",
            file=out,
        )
    for note in dict.fromkeys(c.online_note for c in comparisons if c.online_note):
        approximated = any(c.online is not None and c.online_note == note for c in comparisons)
        print(
            f"{'online (approx.)' if approximated else 'online optimum skipped'}: {note}", file=out
        )
    if any(c.tiers for c in comparisons):
        print(
            "with a tier ('+ ram ...'): idle values are moved down instead of dropped; "
            "reload s counts the cold loads and the promotions back up (promote s); a "
            "demotion is no eviction. The optimum there covers the tier (moves take no "
            "time in its model, as loads); the online optimum does not, and is left out",
            file=out,
        )
    methods = {c.bound.method for c in comparisons if c.bound is not None}

    def brackets(method: str) -> str:
        tops = [
            f"{c.label} {c.bound.upper_seconds:,.0f} s ({100 * (c.bound.gap or 0):.1f}% above)"
            for c in comparisons
            if c.bound is not None
            and c.bound.method == method
            and c.bound.upper_seconds is not None
        ]
        return ": " + ", ".join(tops) if tops else " (none found in time)"

    if "milp-bound" in methods:
        print(
            "bound (milp): the solver hit --bound-time-limit; the figure is its proven lower "
            "bound, and the optimum lies between it and the best schedule found"
            + brackets("milp-bound"),
            file=out,
        )
    if "lp" in methods:
        print(
            "bound (lp): the LP relaxation, a lower bound, looser (the trace is too long for "
            "the MILP, or it proved nothing within --bound-time-limit); the optimum lies "
            "between it and a greedy schedule" + brackets("lp"),
            file=out,
        )
    under = [
        f"{result.policy} at {comparison.label}"
        for comparison in comparisons
        if comparison.bound is not None
        for result in comparison.results
        if result.reload_seconds < comparison.bound.reload_seconds - 1e-6
    ]
    if under:
        print(
            "note: the optimum assumes no request waits for space; requests that waited let "
            f"{', '.join(under)} come in under it (see docs/simulator.md)",
            file=out,
        )
    if any(c.timing == "replay" and c.bound is not None for c in comparisons):
        print(
            "note: replay timing: the optimum is the sequential model's (loads take no "
            "time), not a bound of these figures; --timing sequential compares with it",
            file=out,
        )


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


@contextlib.contextmanager
def _progress(steps: int, *, quiet: bool = False) -> Iterator[Any]:
    """Progress on standard error: a rich bar on a terminal, else a line as each step starts.

    (The whole built-in run takes half a minute; piped or logged, a silent
    run looks hung.) Standard output carries the results alone.
    """
    if quiet:
        yield None
        return
    if not (sys.stderr.isatty() and _has("rich")):
        done = [0]

        def line(description: str) -> None:
            done[0] += 1
            print(f"simulate: step {done[0]}/{steps}: {description}", file=sys.stderr, flush=True)

        yield line
        return
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task("simulating", total=steps)
        started = [False]

        def step(description: str) -> None:
            if started[0]:
                bar.advance(task)
            started[0] = True
            bar.update(task, description=description)

        yield step
