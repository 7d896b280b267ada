"""Policy quality: total reload seconds of each built-in policy, replayed through the core.

Two workloads over a catalogue of 12 real checkpoints (0.09-42.5 GB):

* ``zipf``: 2,000 requests with Zipf(1.0) popularity over a shuffled catalogue
  — skewed and mixed-size, where knowing cost and size pays;
* ``recency``: 2,000 requests in 40 phases of 50; each phase cycles over 3
  models drawn at random — recency is all there is to know.

Requests arrive far enough apart that every load finishes before the next
request, so the figures measure eviction choices alone, and the offline
optimum (the simulator's exact MILP) is a true lower bound. Each workload is
replayed at three budgets under lru, fifo, gdsf and cost; ratios are to lru,
and the last column is each budget's optimum.

    python benchmarks/policies.py [--seeds 5] [--no-bound] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from typing import Any

from cachebroker.simulator import CATALOGUE, Request, offline_bound, replay

GiB = 2**30

BUDGETS = (48 * GiB, 64 * GiB, 80 * GiB)
POLICIES = ("lru", "fifo", "gdsf", "cost")
GAP = 120.0  # seconds between requests: longer than the slowest load


def zipf_workload(seed: int, n: int = 2000) -> list[Request]:
    rng = random.Random(seed)
    models = list(CATALOGUE)
    rng.shuffle(models)
    weights = [1 / (rank + 1) for rank in range(len(models))]
    picks = rng.choices(models, weights, k=n)
    return [_request(i, model) for i, model in enumerate(picks)]


def recency_workload(seed: int, n: int = 2000, phase: int = 50, width: int = 3) -> list[Request]:
    rng = random.Random(seed)
    picks: list[tuple[str, int, float]] = []
    while len(picks) < n:
        working_set = rng.sample(CATALOGUE, width)
        picks.extend(working_set[i % width] for i in range(phase))
    return [_request(i, model) for i, model in enumerate(picks[:n])]


def _request(number: int, model: tuple[str, int, float]) -> Request:
    name, size, seconds = model
    return Request(time=number * GAP, key=name, size={"default": size}, load_seconds=seconds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5, help="workloads per kind (averaged)")
    parser.add_argument("--no-bound", action="store_true", help="skip the offline optimum")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    names = [*POLICIES] if args.no_bound else [*POLICIES, "optimum"]
    rows: list[dict[str, Any]] = []
    for kind, make in (("zipf", zipf_workload), ("recency", recency_workload)):
        traces = [make(seed) for seed in range(args.seeds)]
        for budget in BUDGETS:
            totals = {
                policy: statistics.mean(
                    replay(trace, {"default": budget}, policy).reload_seconds for trace in traces
                )
                for policy in POLICIES
            }
            if not args.no_bound:
                totals["optimum"] = statistics.mean(
                    offline_bound(trace, {"default": budget}).reload_seconds for trace in traces
                )
            for policy, seconds in totals.items():
                rows.append(
                    {
                        "workload": kind,
                        "budget_gib": budget / GiB,
                        "policy": policy,
                        "reload_seconds": seconds,
                        "ratio_to_lru": seconds / totals["lru"],
                    }
                )
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        print()
        return 0
    print(f"total reload seconds, mean of {args.seeds} workloads of 2,000 requests each")
    print(f"{'workload':<9} {'budget':>8} " + " ".join(f"{p:>14}" for p in names))
    for kind in ("zipf", "recency"):
        for budget in BUDGETS:
            cells = [r for r in rows if r["workload"] == kind and r["budget_gib"] == budget / GiB]
            shown = " ".join(
                f"{r['reload_seconds']:>7.0f} ({r['ratio_to_lru']:.2f})" for r in cells
            )
            print(f"{kind:<9} {budget / GiB:>5.0f}GiB {shown}")
    print("(in parentheses: ratio to lru; lower is better)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
