"""Eviction and scale: what a miss that must evict costs, as victims and entries grow.

1. Miss with eviction of k victims whose releases each sleep d seconds:
   total time / d, for k = 1, 8, 64 (releases run concurrently, so ~1).
2. Scale: the cost of a miss that evicts one victim, and of a hit, with 100,
   1,000, 10,000 and 100,000 resident entries, as ratios to the 100-entry
   figure (victim selection and wake-up are O(log n), so ~1).

Medians over interleaved rounds.

    python benchmarks/scaling.py [--rounds 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from typing import Any

import anyio
import structlog

import cachebroker


async def load() -> str:
    return "v"


async def fill(cache: cachebroker.Cache, keys: range) -> None:
    """Load each key (one byte each) and leave it idle."""
    for key in keys:
        await (await cache.acquire(key, load=load, size=1)).release()


async def eviction_ratio(k: int, delay: float) -> float:
    async def release(key: str, value: object) -> None:
        await anyio.sleep(delay)

    async with cachebroker.Broker(budget=k) as broker, broker.cache("b", release) as cache:
        await fill(cache, range(k))
        started = time.perf_counter()
        await (await cache.acquire("big", load=load, size=k)).release()
        return (time.perf_counter() - started) / delay


async def scale_costs(entries: int, calls: int) -> tuple[float, float]:
    """Seconds per miss-that-evicts-one and per hit, with ``entries`` resident."""

    async def release(key: object, value: object) -> None:
        pass

    async with cachebroker.Broker(budget=entries) as broker, broker.cache("b", release) as cache:
        await fill(cache, range(entries))
        started = time.perf_counter()
        await fill(cache, range(entries, entries + calls))
        miss = (time.perf_counter() - started) / calls
        hot = entries + calls - 1
        started = time.perf_counter()
        for _ in range(calls):
            await (await cache.acquire(hot, load=load, size=1)).release()
        hit = (time.perf_counter() - started) / calls
        return miss, hit


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--delay", type=float, default=0.05)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    result: dict[str, Any] = {"eviction": {}, "scale": {}}
    for k in (1, 8, 64):
        ratios = [anyio.run(eviction_ratio, k, args.delay) for _ in range(args.rounds)]
        result["eviction"][k] = statistics.median(ratios)
    sizes = (100, 1_000, 10_000, 100_000)
    samples: dict[int, list[tuple[float, float]]] = {n: [] for n in sizes}
    for _ in range(args.rounds):
        for n in sizes:
            samples[n].append(anyio.run(scale_costs, n, 2_000))
    for n in sizes:
        miss = statistics.median(m for m, _ in samples[n])
        hit = statistics.median(h for _, h in samples[n])
        result["scale"][n] = {"miss_us": miss * 1e6, "hit_us": hit * 1e6}
    base = result["scale"][100]
    for figures in result["scale"].values():
        figures["miss_ratio"] = figures["miss_us"] / base["miss_us"]
        figures["hit_ratio"] = figures["hit_us"] / base["hit_us"]
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
        return 0
    print(f"miss evicting k victims whose releases sleep d={args.delay}s (median of {args.rounds})")
    for k, ratio in result["eviction"].items():
        print(f"  k={k:<3} total / d = {ratio:.2f}")
    print("scale: miss that evicts one, and hit, by resident entries (ratio to 100)")
    print(f"  {'entries':>8} {'miss us':>9} {'ratio':>6} {'hit us':>8} {'ratio':>6}")
    for n, f in result["scale"].items():
        print(
            f"  {n:>8,} {f['miss_us']:>9.1f} {f['miss_ratio']:>6.2f} "
            f"{f['hit_us']:>8.2f} {f['hit_ratio']:>6.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
