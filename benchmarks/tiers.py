"""Memory tiers: reload seconds with and without host RAM below the GPU.

The built-in workload of ``cachebroker simulate`` (2,000 requests of the
Azure LLM inference trace over 12 real checkpoints, 0.09-42.5 GB, loading
in 0.4-90 s) at GPU budgets of 48 and 64 GiB, without a tier and with a RAM
tier of 64 and 128 GiB below it: an idle model is moved to RAM instead of
dropped when the policy ranks it worth its room there, and moved back for
its next request in 0.11-3.6 s (its bytes at 12 GB/s, plus 0.1 s). Policies
lru and cost, in the sequential model (loads and moves take no time, the
offline optimum's model).

For each: total reload seconds (cold loads plus promotions), its ratio to
the same policy without a tier, promotions, demotions and evictions (values
dropped, from either tier), and the offline optimum with the same tier: the
least any policy could pay knowing the future (``bound [lo, hi]`` when the
solver reached its time limit: the optimum lies in that bracket).

    python benchmarks/tiers.py [--time-limit 20] [--no-bound] [--json]

With ``--families``, the same question over the development traces of
``benchmarks/policies.py`` (``benchmarks/_families.py``: base, moving and
large catalogues, three budgets each): for each family and budget, the mean
reload seconds of lru and cost without a tier and with a RAM tier the size
of the GPU budget and twice it, and what the tier saves (no optimum: the
tiered MILP takes minutes a case there).

    python benchmarks/tiers.py --families
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from _families import traces

from cachebroker.simulator import builtin_workload, offline_bound, replay

GiB = 2**30

GPU = (48, 64)
RAM = (None, 64, 128)
POLICIES = ("lru", "cost")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--time-limit", type=float, default=20.0, help="seconds per optimum (default 20)"
    )
    parser.add_argument("--no-bound", action="store_true", help="skip the optimum")
    parser.add_argument("--json", action="store_true", help="print machine-readable figures")
    parser.add_argument(
        "--families", action="store_true", help="the development traces' families instead"
    )
    args = parser.parse_args()
    if args.families:
        return _families(args.json)
    started = time.perf_counter()
    trace = builtin_workload()
    rows: list[dict[str, Any]] = []
    for gpu in GPU:
        alone: dict[str, float] = {}
        for ram in RAM:
            budget = {"default": gpu * GiB}
            tiers = None
            if ram is not None:
                budget["ram"] = ram * GiB
                tiers = {"default": "ram"}
            bound = None
            if not args.no_bound:
                bound = offline_bound(trace, budget, tiers=tiers, time_limit=args.time_limit)
            for policy in POLICIES:
                result = replay(trace, budget, policy, timing="sequential", tiers=tiers)
                alone.setdefault(policy, result.reload_seconds)
                rows.append(
                    {
                        "gpu_gib": gpu,
                        "ram_gib": ram,
                        "policy": policy,
                        "reload_seconds": result.reload_seconds,
                        "promote_seconds": result.promote_seconds,
                        "ratio_to_no_tier": result.reload_seconds / alone[policy],
                        "hit_ratio": result.hit_ratio,
                        "promotions": result.promotions,
                        "demotions": result.demotions,
                        "evictions": result.evictions,
                        "optimum_seconds": None if bound is None else bound.reload_seconds,
                        "optimum_upper_seconds": None if bound is None else bound.upper_seconds,
                        "optimum_method": None if bound is None else bound.method,
                        "optimum_solve_seconds": None if bound is None else bound.solve_seconds,
                    }
                )
    if args.json:  # (seconds to the millisecond, ratios to 4 decimals)
        digits = {"ratio_to_no_tier": 4, "hit_ratio": 4}
        json.dump(
            [
                {
                    name: round(value, digits.get(name, 3)) if isinstance(value, float) else value
                    for name, value in row.items()
                }
                for row in rows
            ],
            sys.stdout,
            indent=2,
        )
        print()
        return 0
    _print(rows)
    print(f"\n({time.perf_counter() - started:.0f} s in all)")
    return 0


def _print(rows: list[dict[str, Any]]) -> None:
    print(
        "built-in workload, 2,000 requests, sequential model: total reload seconds "
        "(cold loads + promotions)"
    )
    headers = (
        "gpu",
        "ram tier",
        "policy",
        "reload s",
        "vs no tier",
        "promote s",
        "promotions",
        "demotions",
        "evictions",
        "over optimum",
    )
    table: list[tuple[str, ...]] = []
    untiered = 0.0
    for row in rows:
        tier = "-" if row["ram_gib"] is None else f"{row['ram_gib']} GiB"
        over = ""
        if row["optimum_seconds"]:
            over = f"{100 * (row['reload_seconds'] / row['optimum_seconds'] - 1):+.0f}%"
        table.append(
            (
                f"{row['gpu_gib']} GiB",
                tier,
                row["policy"],
                f"{row['reload_seconds']:,.0f}",
                f"{row['ratio_to_no_tier']:.3f}",
                f"{row['promote_seconds']:,.0f}",
                f"{row['promotions']:,}",
                f"{row['demotions']:,}",
                f"{row['evictions']:,}",
                over,
            )
        )
        if row["policy"] == POLICIES[-1] and row["optimum_method"] is not None:
            if row["ram_gib"] is None:
                untiered = row["optimum_seconds"]
            table.append(_optimum(row, tier, untiered))
    widths = [max(len(h), *(len(r[i]) for r in table)) for i, h in enumerate(headers)]

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(
            cell.ljust(width) if index < 3 else cell.rjust(width)
            for index, (cell, width) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    print(line(headers))
    for cells in table:
        print(line(cells))
    if any(r["optimum_method"] == "milp-bound" for r in rows):
        print(
            "bound [lo, hi]: the solver reached --time-limit; the optimum lies in the bracket, "
            "and 'over optimum' is over its lower end"
        )


def _optimum(row: dict[str, Any], tier: str, untiered: float) -> tuple[str, ...]:
    low, high = row["optimum_seconds"], row["optimum_upper_seconds"]
    name = {"exact": "optimum", "milp-bound": "bound", "lp": "bound (lp)"}[row["optimum_method"]]
    figure = f"{low:,.0f}"
    if row["optimum_method"] != "exact" and high is not None:
        figure = f"[{low:,.0f}, {high:,.0f}]"
    ratio = f"{low / untiered:.3f}" if untiered else ""
    solved = f"(solved in {row['optimum_solve_seconds']:.0f} s)"
    return (f"{row['gpu_gib']} GiB", tier, name, figure, ratio, "", "", "", "", solved)


def _families(as_json: bool) -> int:
    """Reload seconds with a RAM tier of 1x and 2x the GPU budget, per family and budget."""
    rows: list[dict[str, Any]] = []
    for case in traces():
        for index, gpu in enumerate(case.budgets):
            for policy in POLICIES:
                alone = replay(case.requests, {"default": gpu}, policy, timing="sequential")
                row: dict[str, Any] = {
                    "family": case.family,
                    "trace": case.name,
                    "budget": index,
                    "gpu_gb": round(gpu / 10**9, 1),
                    "policy": policy,
                    "no_tier_seconds": round(alone.reload_seconds, 1),
                }
                for times in (1, 2):
                    tiered = replay(
                        case.requests,
                        {"default": gpu, "ram": times * gpu},
                        policy,
                        timing="sequential",
                        tiers={"default": "ram"},
                    )
                    row[f"ram_{times}x_seconds"] = round(tiered.reload_seconds, 1)
                rows.append(row)
    if as_json:
        json.dump(rows, sys.stdout, indent=2)
        print()
        return 0
    print(
        "mean total reload seconds per family and budget (sequential model), without a "
        "tier and with a RAM tier of 1x and 2x the GPU budget; in parentheses, the share saved"
    )
    labels = {0: "tightest", 1: "middle", 2: "loosest"}
    print(f"{'family':<8} {'budget':<9} {'policy':<6} {'no tier':>9} {'RAM 1x':>16} {'RAM 2x':>16}")
    for family in dict.fromkeys(r["family"] for r in rows):
        for index, label in labels.items():
            for policy in POLICIES:
                mine = [
                    r
                    for r in rows
                    if r["family"] == family and r["budget"] == index and r["policy"] == policy
                ]
                alone = sum(r["no_tier_seconds"] for r in mine) / len(mine)
                cells = []
                for times in (1, 2):
                    tiered = sum(r[f"ram_{times}x_seconds"] for r in mine) / len(mine)
                    cells.append(f"{tiered:,.0f} ({1 - tiered / alone:.0%})")
                print(
                    f"{family:<8} {label:<9} {policy:<6} {alone:>9,.0f} "
                    f"{cells[0]:>16} {cells[1]:>16}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
