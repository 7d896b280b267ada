"""Simulator speed: replay rate per policy, and the time to solve the offline optimum.

Replays the built-in workload of ``cachebroker simulate`` (2,000 requests over
12 real checkpoints) at each of its budgets under each built-in policy, after
one warm-up pass; the figure is the median over rounds of requests replayed
per second, and "sweep" the rate over all five budgets one after another.
Then solves the offline optimum (the MILP) once per budget and prints the
solve time and the method reached.

    python benchmarks/replay.py [--rounds 7] [--no-bound] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from cachebroker._units import format_bytes
from cachebroker.simulator import BUDGETS, POLICIES, builtin_workload, offline_bound, replay


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--no-bound", action="store_true", help="skip the optimum's timing")
    parser.add_argument("--json", action="store_true", help="print machine-readable figures")
    args = parser.parse_args()
    requests = builtin_workload()
    budgets = [{"default": budget} for budget in BUDGETS]
    for policy in POLICIES:  # warm-up
        for budget in budgets:
            replay(requests, budget, policy)
    figures: list[dict[str, Any]] = []
    for policy in POLICIES:
        for budget in budgets:
            seconds = []
            for _ in range(args.rounds):
                started = time.perf_counter()
                replay(requests, budget, policy)
                seconds.append(time.perf_counter() - started)
            figures.append(
                {
                    "what": "replay",
                    "policy": policy,
                    "budget": budget["default"],
                    "requests_per_second": len(requests) / statistics.median(seconds),
                }
            )
    if not args.no_bound:
        for budget in budgets:
            bound = offline_bound(requests, budget)
            figures.append(
                {
                    "what": "optimum",
                    "budget": budget["default"],
                    "seconds": bound.solve_seconds,
                    "method": bound.method,
                    "reload_seconds": bound.reload_seconds,
                }
            )
    if args.json:
        json.dump(figures, sys.stdout, indent=2)
        print()
        return 0
    print(f"replay of the built-in workload ({len(requests):,} requests), requests/s, median")
    header = "".join(f"{format_bytes(b['default']):>11}" for b in budgets)
    print(f"{'policy':<7}{header}{'sweep':>11}")
    for policy in POLICIES:
        rates = [f["requests_per_second"] for f in figures if f.get("policy") == policy]
        sweep = len(rates) / sum(1 / rate for rate in rates)  # all budgets, one after another
        print(f"{policy:<7}" + "".join(f"{rate:>11,.0f}" for rate in rates) + f"{sweep:>11,.0f}")
    if not args.no_bound:
        print("offline optimum (MILP, HiGHS):")
        for f in figures:
            if f["what"] == "optimum":
                print(
                    f"  {format_bytes(f['budget']):>9}: {f['seconds']:6.2f} s, {f['method']}, "
                    f"{f['reload_seconds']:,.0f} reload seconds"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
