"""Policy quality per family: total reload seconds of each policy against the two optima.

Four families of 2,000-request traces (``benchmarks/_families.py``), each at
three budgets:

* ``base``: the built-in 12-model catalogue (0.09-42.5 GB), stationary Zipf
  popularity, exponents 0.6-1.2, at 48, 64 and 80 GiB;
* ``moving``: the same catalogue with a moving popularity ranking (rotated
  by 3 models every 300 requests, or two ranks swapped every 40);
* ``large``: catalogues of 20-40 models (0.1-141 GB), Zipf 0.6-1.2, four
  stationary and two moving, at 30%, 45% and 60% of their bytes;
* ``recency``: 40 phases of 50 requests, each cycling over 3 models drawn at
  random (3 seeds): recency is all there is to know.

Requests are replayed in the sequential model (loads take no time), which is
the offline optimum's, so the optimum is a true lower bound of every policy.
Every policy runs: lru, fifo, gdsf, cost (which tunes its rate memory itself)
and cost with each fixed half-life it chooses among; beside them ``known
shares`` (cost told each model's share of the trace instead of learning it),
the online optimum (the best policy knowing each model's share of the requests, not
their order: exact up to ``--max-keys`` models, beyond that its
approximation, within a stated slack) and the offline optimum (knowing the
order; where the solver stops at ``--time-limit``, its proven lower bound,
so the percentages over it are upper estimates). Percentages are over the
offline optimum; per family, the mean and worst over its cases, and what
the gap of ``cost`` is made of: foresight (online over offline optimum),
choice (known shares over the online optimum: greedy victims instead of the
whole process) and learning (``cost`` over known shares).

    python benchmarks/policies.py [--families base,moving,large,recency]
        [--time-limit 60] [--max-keys 14] [--no-bound] [--json]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import random
import statistics
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from _families import Trace, traces

from cachebroker import CostAware, PolicyEntry
from cachebroker.simulator import CATALOGUE, Request, offline_bound, online_optimum, replay

GiB = 2**30

BUDGETS = (48 * GiB, 64 * GiB, 80 * GiB)
NAMED = ("lru", "fifo", "gdsf", "cost")
FIXED = tuple(f"cost h={half:g}" for half in CostAware.HALF_LIVES)


def recency_workload(seed: int, n: int = 2000, phase: int = 50, width: int = 3) -> list[Request]:
    rng = random.Random(seed)
    picks: list[tuple[str, int, float]] = []
    while len(picks) < n:
        working_set = rng.sample(CATALOGUE, width)
        picks.extend(working_set[i % width] for i in range(phase))
    return [_request(i, model) for i, model in enumerate(picks[:n])]


def _request(number: int, model: tuple[str, int, float]) -> Request:
    name, size, seconds = model
    return Request(time=float(number), key=name, size={"default": size}, load_seconds=seconds)


class KnownShares(CostAware):
    """``cost`` told each model's share of the trace's requests instead of learning it.

    The knowledge the online optimum has, with ``cost``'s own choice of
    victims: it ranks by share x reload seconds (per byte), through the two
    places ``CostAware`` reads its estimates. Against ``cost`` it prices the
    learning; against the online optimum, the greedy choice; on large
    catalogues, where the online optimum is only approximated, it is the
    plainer reference: one online policy that knows the popularity.
    """

    def __init__(self, shares: Mapping[tuple[str, object], float]) -> None:
        super().__init__(half_life=1024.0)
        self._shares = {key: math.log2(share) for key, share in shares.items()}

    def _rank(self, entry: PolicyEntry, size: int, ranking: int) -> float:
        log_cost = math.log2(max(entry.cost, 1e-6) / max(size, 1))
        return self._shares[(entry.cache, entry.key)] + log_cost

    def _log_value(self, entry: PolicyEntry) -> float:
        return self._shares[(entry.cache, entry.key)] + math.log2(max(entry.cost, 1e-6))


def shares(requests: Sequence[Request]) -> dict[tuple[str, object], float]:
    """Each (cache, key)'s share of ``requests``."""
    counts = Counter((request.cache, request.key) for request in requests)
    return {key: count / len(requests) for key, count in counts.items()}


def _policy(name: str) -> Any:
    if name in FIXED:
        return functools.partial(CostAware, half_life=float(name.removeprefix("cost h=")))
    return lambda: name


def _cases(families: list[str]) -> list[Trace]:
    made = traces([f for f in families if f != "recency"])
    if "recency" in families:
        for seed in range(3):
            made.append(Trace("recency", f"recency {seed}", recency_workload(seed), BUDGETS))
    return made


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="base,moving,large,recency")
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds per optimum")
    parser.add_argument("--max-keys", type=int, default=14, help="online optimum solved exactly")
    parser.add_argument("--no-bound", action="store_true", help="skip both optima")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    policies = (*NAMED, *FIXED)
    rows: list[dict[str, Any]] = []
    for case in _cases(families):
        for budget in case.budgets:
            space = {"default": budget}
            row: dict[str, Any] = {
                "family": case.family,
                "trace": case.name,
                "budget_gb": round(budget / 10**9, 1),
                "reload_seconds": {
                    name: replay(
                        case.requests, space, _policy(name)(), timing="sequential"
                    ).reload_seconds
                    for name in policies
                },
            }
            known = replay(
                case.requests, space, KnownShares(shares(case.requests)), timing="sequential"
            )
            row["reload_seconds"]["known shares"] = known.reload_seconds
            if not args.no_bound:
                online = online_optimum(
                    case.requests, space, max_keys=args.max_keys, approximate=True
                )
                bound = offline_bound(case.requests, space, time_limit=args.time_limit)
                row["reload_seconds"]["online optimum"] = online.reload_seconds
                row["online_exact"] = online.exact
                row["online_slack_seconds"] = round(online.slack_seconds, 1)
                row["online_expected_seconds"] = round(online.expected_seconds, 1)
                row["optimum"] = bound.reload_seconds
                row["optimum_method"] = bound.method
                row["over_optimum"] = {
                    name: round(seconds / bound.reload_seconds - 1, 4)
                    for name, seconds in row["reload_seconds"].items()
                }
            row["reload_seconds"] = {k: round(v, 1) for k, v in row["reload_seconds"].items()}
            rows.append(row)
            if not args.json:
                print(_line(row), flush=True)
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        print()
        return 0
    if not args.no_bound:
        _summary(rows, families)
    return 0


def _line(row: dict[str, Any]) -> str:
    if "over_optimum" in row:
        over = row["over_optimum"]
        cells = " ".join(f"{name}={100 * over[name]:+.1f}%" for name in over)
        mark = "" if row["optimum_method"] == "exact" else " (over a bound)"
        return f"{row['family']:<8} {row['trace']:<22} {row['budget_gb']:>6.1f} GB  {cells}{mark}"
    lru = row["reload_seconds"]["lru"]
    cells = " ".join(f"{n}={s / lru:.3f}" for n, s in row["reload_seconds"].items())
    return f"{row['family']:<8} {row['trace']:<22} {row['budget_gb']:>6.1f} GB  (x lru) {cells}"


def _summary(rows: list[dict[str, Any]], families: list[str]) -> None:
    names = list(rows[0]["over_optimum"])
    print()
    print("% over the offline optimum per family: mean / worst over its cases")
    print(f"{'policy':<16}" + "".join(f"{f:>16}" for f in families) + f"{'all':>16}")
    for name in names:
        cells = []
        for family in [*families, None]:
            over = [r["over_optimum"][name] for r in rows if family in (None, r["family"])]
            cells.append(f"{100 * statistics.mean(over):+.1f} / {100 * max(over):+.0f}")
        print(f"{name:<16}" + "".join(f"{c:>16}" for c in cells))
    print()
    print("cost against lru (reload seconds, ratio): best and worst case per family")
    for family in families:
        ratios = [
            r["reload_seconds"]["cost"] / r["reload_seconds"]["lru"]
            for r in rows
            if r["family"] == family
        ]
        print(f"  {family:<8} {min(ratios):.3f} .. {max(ratios):.3f}")
    print()
    print("the gap of cost, per family (mean points over the offline optimum):")
    print("  (one run a case, so the parts are noisy; they mean what they say where")
    print("  popularity is stationary and the online optimum exact: where it moves, known")
    print("  shares and the online optimum assume its average holds throughout)")
    for family in families:
        mine = [r for r in rows if r["family"] == family]
        cost, known, online = (
            100 * statistics.mean(r["over_optimum"][name] for r in mine)
            for name in ("cost", "known shares", "online optimum")
        )
        approximate = sum(not r["online_exact"] for r in mine)
        slack = statistics.mean(r["online_slack_seconds"] / r["optimum"] for r in mine)
        bounded = sum(r["optimum_method"] != "exact" for r in mine)
        print(
            f"  {family:<8} foresight (online optimum) {online:+.1f}, choice (known shares"
            f" - online) {known - online:+.1f}, learning (cost - known shares) {cost - known:+.1f}"
            + (
                f"; online approximate in {approximate} of {len(mine)} cases (its slack: "
                f"{100 * slack:.0f} points on average)"
                if approximate
                else ""
            )
            + (f"; optimum a bound in {bounded} of {len(mine)}" if bounded else "")
        )


if __name__ == "__main__":
    sys.exit(main())
