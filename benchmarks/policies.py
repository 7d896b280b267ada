"""Policy quality: total reload seconds of each policy against the two optima.

Three workloads over a catalogue of 12 real checkpoints (0.09-42.5 GB), 2,000
requests each:

* ``zipf``: Zipf(1.0) popularity over a shuffled catalogue, stationary —
  skewed and mixed-size, where knowing cost and size pays, and a long memory
  of request rates wins;
* ``moving``: the same popularity, with the ranking rotated by 3 models every
  300 requests — a working set that moves, where a short memory wins;
* ``recency``: 40 phases of 50 requests, each cycling over 3 models drawn at
  random — recency is all there is to know.

Requests are replayed in the sequential model (loads take no time), which is
the offline optimum's, so the optimum is a true lower bound of every policy.
Each workload runs at three budgets under lru, fifo, gdsf, cost (which tunes
its rate memory itself) and cost with each fixed half-life it chooses among,
beside the online optimum (the best policy knowing each model's share of the
requests, not their order) and the offline optimum (knowing the order).
Figures are means over seeds; percentages are over the offline optimum.

    python benchmarks/policies.py [--seeds 3] [--no-bound] [--json]
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import sys
from collections.abc import Callable
from typing import Any

from cachebroker import CostAware
from cachebroker.simulator import CATALOGUE, Request, offline_bound, online_optimum, replay

GiB = 2**30

BUDGETS = (48 * GiB, 64 * GiB, 80 * GiB)
NAMED = ("lru", "fifo", "gdsf", "cost")
FIXED = tuple(f"cost h={half:g}" for half in CostAware.HALF_LIVES)


def zipf_workload(seed: int, n: int = 2000) -> list[Request]:
    rng = random.Random(seed)
    models = list(CATALOGUE)
    rng.shuffle(models)
    weights = [1 / (rank + 1) for rank in range(len(models))]
    return [_request(i, model) for i, model in enumerate(rng.choices(models, weights, k=n))]


def moving_workload(seed: int, n: int = 2000, period: int = 300, shift: int = 3) -> list[Request]:
    rng = random.Random(seed)
    models = list(CATALOGUE)
    rng.shuffle(models)
    weights = [1 / (rank + 1) for rank in range(len(models))]
    picks = []
    for i in range(n):
        if i and i % period == 0:
            models = models[shift:] + models[:shift]
        picks.append(rng.choices(models, weights)[0])
    return [_request(i, model) for i, model in enumerate(picks)]


def recency_workload(seed: int, n: int = 2000, phase: int = 50, width: int = 3) -> list[Request]:
    rng = random.Random(seed)
    picks: list[tuple[str, int, float]] = []
    while len(picks) < n:
        working_set = rng.sample(CATALOGUE, width)
        picks.extend(working_set[i % width] for i in range(phase))
    return [_request(i, model) for i, model in enumerate(picks[:n])]


WORKLOADS: dict[str, Callable[[int], list[Request]]] = {
    "zipf": zipf_workload,
    "moving": moving_workload,
    "recency": recency_workload,
}


def _request(number: int, model: tuple[str, int, float]) -> Request:
    name, size, seconds = model
    return Request(time=float(number), key=name, size={"default": size}, load_seconds=seconds)


def _policy(name: str) -> Any:
    if name in FIXED:
        return functools.partial(CostAware, half_life=float(name.removeprefix("cost h=")))
    return lambda: name


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3, help="workloads per kind (averaged)")
    parser.add_argument("--no-bound", action="store_true", help="skip both optima")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    policies = (*NAMED, *FIXED)
    rows: list[dict[str, Any]] = []
    for kind, make in WORKLOADS.items():
        traces = [make(seed) for seed in range(args.seeds)]
        for budget in BUDGETS:
            space = {"default": budget}
            totals = {
                name: statistics.mean(
                    replay(trace, space, _policy(name)(), timing="sequential").reload_seconds
                    for trace in traces
                )
                for name in policies
            }
            if not args.no_bound:
                totals["online optimum"] = statistics.mean(
                    online_optimum(trace, space).reload_seconds for trace in traces
                )
                totals["optimum"] = statistics.mean(
                    offline_bound(trace, space).reload_seconds for trace in traces
                )
            optimum = totals.get("optimum")
            for name, seconds in totals.items():
                rows.append(
                    {
                        "workload": kind,
                        "budget_gib": budget / GiB,
                        "policy": name,
                        "reload_seconds": round(seconds, 3),
                        "over_optimum": None
                        if optimum is None
                        else round(seconds / optimum - 1, 4),
                        "ratio_to_lru": round(seconds / totals["lru"], 4),
                    }
                )
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        print()
        return 0
    _print(rows, args.seeds)
    return 0


def _print(rows: list[dict[str, Any]], seeds: int) -> None:
    names = list(dict.fromkeys(row["policy"] for row in rows))
    bounded = rows[0]["over_optimum"] is not None
    print(
        f"total reload seconds, mean of {seeds} workloads of 2,000 requests each, sequential model"
    )
    print("(in parentheses: % over the offline optimum)" if bounded else "(ratio to lru)")
    width = 15
    print(f"{'workload':<9} {'budget':>7} " + " ".join(f"{n:>{width}}" for n in names))
    for kind in WORKLOADS:
        for budget in BUDGETS:
            cells = [r for r in rows if r["workload"] == kind and r["budget_gib"] == budget / GiB]
            shown = " ".join(_cell(r, bounded).rjust(width) for r in cells)
            print(f"{kind:<9} {budget / GiB:>4.0f}GiB {shown}")
    if not bounded:
        return
    print()
    print("mean % over the optimum, by workload: cost (self-tuning) against the best fixed memory")
    for kind in WORKLOADS:
        over = {
            name: statistics.mean(
                r["over_optimum"] for r in rows if r["workload"] == kind and r["policy"] == name
            )
            for name in names
        }
        best = min(FIXED, key=over.__getitem__)
        print(
            f"  {kind:<8} cost {100 * over['cost']:5.1f}%   best fixed ({best}) "
            f"{100 * over[best]:5.1f}%   lru {100 * over['lru']:5.1f}%   "
            f"online optimum {100 * over['online optimum']:5.1f}%"
        )


def _cell(row: dict[str, Any], bounded: bool) -> str:
    if bounded:
        return f"{row['reload_seconds']:.0f} ({100 * row['over_optimum']:+.0f}%)"
    return f"{row['reload_seconds']:.0f} ({row['ratio_to_lru']:.2f})"


if __name__ == "__main__":
    sys.exit(main())
