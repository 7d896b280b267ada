"""Hit path: acquire + release of a cached entry, side by side with value caches.

Contenders: cachebroker (awaited, and with ``async with``), async-lru,
cachetools + asyncache and aiocache's ``SimpleMemoryCache.get`` (the peers run
on asyncio and uvloop; only cachebroker runs on trio). Every contender runs in
the same process, on the same loop, in interleaved rounds; the figure per
contender is the median over rounds of the mean cost per call. Ratios are to a
cached ``async-lru`` call measured in the same run.

By default nothing configures logging, as in an application that does not; the
figures must not change with ``--logging structlog`` (structlog filtering at
WARNING) or ``--logging stdlib`` (``logging.basicConfig(level=WARNING)``).

    python benchmarks/hit_path.py [--calls N] [--rounds R] [--logging L] [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import structlog

import cachebroker

Bench = Callable[[int], Awaitable[float]]


async def make_contenders(backend: str) -> tuple[dict[str, Bench], Any]:
    """Build each contender with its key already cached; return them and a closer."""
    contenders: dict[str, Bench] = {}
    broker = cachebroker.Broker(budget="1GiB")
    await broker.__aenter__()

    async def release(key: str, value: str) -> None:
        pass

    block = broker.cache("bench", release)
    cache = await block.__aenter__()

    async def load() -> str:
        return "model"

    await (await cache.acquire("k", load=load, size=1)).release()

    async def broker_await(n: int) -> float:
        acquire = cache.acquire
        start = time.perf_counter()
        for _ in range(n):
            lease = await acquire("k", load=load, size=1)
            await lease.release()
        return time.perf_counter() - start

    async def broker_with(n: int) -> float:
        acquire = cache.acquire
        start = time.perf_counter()
        for _ in range(n):
            async with acquire("k", load=load, size=1):
                pass
        return time.perf_counter() - start

    contenders["cachebroker await+release"] = broker_await
    contenders["cachebroker async with"] = broker_with

    # The same hit under the cost-aware policy, whose hit only logs the request.
    cost_broker = cachebroker.Broker(budget="1GiB", policy="cost")
    await cost_broker.__aenter__()
    cost_block = cost_broker.cache("bench", release)
    cost_cache = await cost_block.__aenter__()
    await (await cost_cache.acquire("k", load=load, size=1)).release()

    async def broker_cost(n: int) -> float:
        acquire = cost_cache.acquire
        start = time.perf_counter()
        for _ in range(n):
            lease = await acquire("k", load=load, size=1)
            await lease.release()
        return time.perf_counter() - start

    contenders["cachebroker await+release, cost"] = broker_cost

    if backend == "asyncio":
        from async_lru import alru_cache

        @alru_cache(maxsize=128)
        async def cached(key: str) -> str:
            return "model"

        await cached("k")

        async def alru(n: int) -> float:
            start = time.perf_counter()
            for _ in range(n):
                await cached("k")
            return time.perf_counter() - start

        contenders["async-lru cached call"] = alru

        try:
            import cachetools
            from asyncache import cached as async_cached
        except ImportError:
            pass
        else:

            @async_cached(cachetools.LRUCache(maxsize=128))
            async def lru_cached(key: str) -> str:
                return "model"

            await lru_cached("k")

            async def asyncache_call(n: int) -> float:
                start = time.perf_counter()
                for _ in range(n):
                    await lru_cached("k")
                return time.perf_counter() - start

            contenders["cachetools+asyncache cached call"] = asyncache_call

        try:
            from aiocache import SimpleMemoryCache
        except ImportError:
            pass
        else:
            memory = SimpleMemoryCache()
            await memory.set("k", "model")

            async def aiocache_get(n: int) -> float:
                get = memory.get
                start = time.perf_counter()
                for _ in range(n):
                    await get("k")
                return time.perf_counter() - start

            contenders["aiocache SimpleMemoryCache.get"] = aiocache_get

    async def close() -> None:
        await cost_block.__aexit__(None, None, None)
        await cost_broker.__aexit__(None, None, None)
        await block.__aexit__(None, None, None)
        await broker.__aexit__(None, None, None)

    return contenders, close


async def measure(backend: str, calls: int, rounds: int) -> dict[str, float]:
    contenders, close = await make_contenders(backend)
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for bench in contenders.values():  # warm up
        await bench(calls // 10 or 1)
    for _ in range(rounds):
        for name, bench in contenders.items():
            samples[name].append(await bench(calls) / calls)
    await close()
    return {name: statistics.median(values) for name, values in samples.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--logging",
        choices=["none", "structlog", "stdlib"],
        default="none",
        help="logging set up before the run, at WARNING (default: none at all)",
    )
    parser.add_argument("--json", action="store_true", help="print machine-readable figures")
    args = parser.parse_args()
    if args.logging == "structlog":
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    elif args.logging == "stdlib":
        logging.basicConfig(level=logging.WARNING)
    runs: list[tuple[str, str, dict[str, Any]]] = [("asyncio", "asyncio", {})]
    try:
        import uvloop  # noqa: F401
    except ImportError:
        pass
    else:
        runs.append(("uvloop", "asyncio", {"use_uvloop": True}))
    runs.append(("trio", "trio", {}))
    results: list[dict[str, Any]] = []
    for label, backend, options in runs:
        figures = anyio.run(measure, backend, args.calls, args.rounds, backend_options=options)
        reference = figures.get("async-lru cached call")
        for name, seconds in figures.items():
            results.append(
                {
                    "loop": label,
                    "contender": name,
                    "us_per_call": seconds * 1e6,
                    "ratio_to_async_lru": seconds / reference if reference else None,
                }
            )
    if args.json:
        json.dump(results, sys.stdout, indent=2)
        print()
        return 0
    print(
        f"hit path, median of {args.rounds} rounds x {args.calls} calls (lower is better), "
        f"logging: {args.logging}"
    )
    print(f"{'loop':<8} {'contender':<32} {'us/call':>8} {'x async-lru':>12}")
    for row in results:
        ratio = row["ratio_to_async_lru"]
        shown = f"{ratio:.2f}" if ratio is not None else "-"
        print(f"{row['loop']:<8} {row['contender']:<32} {row['us_per_call']:>8.2f} {shown:>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
