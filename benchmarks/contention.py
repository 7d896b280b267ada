"""Contention: 1,000 tasks over 100 keys under a tight budget.

Each task acquires a random key (Zipf-ish), holds it for one scheduling step
and releases it, many times. Prints acquisitions/s and the p50/p99 time an
acquire waited, next to the uncontended hit rate of a single task measured in
the same run.

    python benchmarks/contention.py [--tasks 1000] [--keys 100] [--per-task 50] [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import time
from typing import Any

import anyio
import structlog
from _backends import BACKENDS

import cachebroker


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(7)
    keys = list(range(args.keys))
    weights = [1 / (k + 1) for k in keys]
    waits: list[float] = []

    async def release(key: int, value: int) -> None:
        await anyio.lowlevel.checkpoint()

    async def load() -> int:
        await anyio.lowlevel.checkpoint()
        return 1

    budget = args.keys // 4  # a quarter of the keys fit
    async with cachebroker.Broker(budget=budget) as broker, broker.cache("c", release) as cache:
        # Uncontended: one task, one hot key.
        await (await cache.acquire(0, load=load, size=1)).release()
        n = 20_000
        started = time.perf_counter()
        for _ in range(n):
            await (await cache.acquire(0, load=load, size=1)).release()
        uncontended = n / (time.perf_counter() - started)

        async def worker() -> None:
            for _ in range(args.per_task):
                key = rng.choices(keys, weights)[0]
                begun = time.perf_counter()
                async with cache.acquire(key, load=load, size=1):
                    waits.append(time.perf_counter() - begun)
                    await anyio.lowlevel.checkpoint()

        started = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for _ in range(args.tasks):
                tg.start_soon(worker)
        elapsed = time.perf_counter() - started
        stats = await broker.stats()
    waits.sort()
    return {
        "tasks": args.tasks,
        "keys": args.keys,
        "budget_entries": budget,
        "acquisitions": len(waits),
        "acquisitions_per_second": len(waits) / elapsed,
        "uncontended_hits_per_second": uncontended,
        "wait_p50_us": statistics.median(waits) * 1e6,
        "wait_p99_us": waits[int(len(waits) * 0.99)] * 1e6,
        "hit_ratio": stats.hit_ratio,
        "evictions": stats.evictions,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=1_000)
    parser.add_argument("--keys", type=int, default=100)
    parser.add_argument("--per-task", type=int, default=50)
    parser.add_argument("--backend", choices=sorted(BACKENDS), default="asyncio")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    backend, options = BACKENDS[args.backend]
    result = anyio.run(run, args, backend=backend, backend_options=options)
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
        return 0
    print(
        f"contention on {args.backend}: {result['tasks']:,} tasks over {result['keys']} keys, "
        f"{result['budget_entries']} fit"
    )
    print(f"  {result['acquisitions_per_second']:,.0f} acquisitions/s under contention")
    print(f"  {result['uncontended_hits_per_second']:,.0f} hits/s uncontended (one task)")
    print(
        f"  wait p50 {result['wait_p50_us']:,.0f} us, p99 {result['wait_p99_us']:,.0f} us; "
        f"hit ratio {result['hit_ratio']:.0%}, evictions {result['evictions']:,}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
