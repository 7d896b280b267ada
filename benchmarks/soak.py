"""Soak: many tasks hammering one broker while loaders and releasers misbehave.

1,000 tasks share 200 keys (Zipf popularity) under a tight budget and perform
at least 100,000 operations: acquires (held briefly, some with a timeout that
cancels the wait), invalidations and idle sweeps. Loaders fail or are slow,
releasers raise, hang past the release timeout or acknowledge late; an
"operator" writes off quarantined entries now and then.

It runs the soak twice. The first pass, untraced, gives operations/s, the
p50/p99 time an acquire waited for its lease and the count of every fault met.
The second runs the same soak under tracemalloc and compares the broker's own
memory (allocations made in the cachebroker package) after a warm-up by all
the tasks and after the soak, with every task finished and the broker
cleared: it must be back at its start level. (The warm-up runs at full
concurrency because CPython's dicts and sets keep the capacity they reached:
that is sizing, not a leak.)

    python benchmarks/soak.py [--ops 100000] [--tasks 1000] [--keys 200] [--backend B] [--json]
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import logging
import random
import statistics
import sys
import time
import tracemalloc
from typing import Any

import anyio
import structlog
from _backends import BACKENDS

import cachebroker

MiB = 2**20


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.faults: collections.Counter[str] = collections.Counter()
        self.waits: list[float] = []
        self.ops = 0
        weights = [1 / (rank + 1) ** 0.9 for rank in range(args.keys)]
        self.keys = [f"model-{i}" for i in range(args.keys)]
        self.weights = weights
        self.sizes = {key: self.rng.randint(1, 12) * MiB for key in self.keys}

    async def release(self, key: str, value: Any) -> None:
        roll = self.rng.random()
        if roll < 0.004:
            self.faults["release raised"] += 1
            raise OSError("device busy")
        if roll < 0.006:
            self.faults["release hung past timeout, acknowledged late"] += 1
            await anyio.sleep(self.args.release_timeout * 2)
        elif roll < 0.05:
            await anyio.sleep(0.001)

    def loader(self, key: str) -> Any:
        async def load() -> str:
            roll = self.rng.random()
            if roll < 0.01:
                self.faults["load failed"] += 1
                raise RuntimeError(f"corrupt checkpoint {key}")
            if roll < 0.05:
                await anyio.sleep(0.002)
            else:
                await anyio.lowlevel.checkpoint()
            return key

        return load

    async def worker(self, cache: cachebroker.Cache, broker: cachebroker.Broker, n: int) -> None:
        rng = self.rng
        for _ in range(n):
            roll = rng.random()
            key = rng.choices(self.keys, self.weights)[0]
            self.ops += 1
            if roll < 0.01:
                await cache.invalidate(key)
                continue
            if roll < 0.012:
                report = await broker.evict_idle()
                self.faults["idle entries swept"] += report.entries
                continue
            timeout = 0.002 if roll < 0.05 else None
            started = time.perf_counter()
            try:
                async with cache.acquire(
                    key, load=self.loader(key), size=self.sizes[key], timeout=timeout
                ):
                    self.waits.append(time.perf_counter() - started)
                    await anyio.lowlevel.checkpoint()
            except cachebroker.AcquireTimeout:
                self.faults["acquire timed out (wait cancelled)"] += 1
            except RuntimeError as exc:
                if "corrupt" not in str(exc):
                    raise
                self.faults["load failure seen by a waiter"] += 1

    async def operator(self, broker: cachebroker.Broker, done: anyio.Event) -> None:
        while not done.is_set():
            with anyio.move_on_after(0.05):
                await done.wait()
            for cache_name, key in (await broker.stats()).quarantined_keys:
                self.faults["quarantined entries written off"] += await broker.forget(
                    cache_name, key
                )

    async def run(self, trace: bool) -> dict[str, Any]:
        args = self.args
        broker = cachebroker.Broker(
            budget=args.budget, release_timeout=args.release_timeout, idle_ttl=1.0
        )
        async with broker, broker.cache("soak", self.release) as cache:
            # Warm up at full concurrency so that lazily created state exists
            # and containers reach their working size before the first measurement.
            async with anyio.create_task_group() as tg:
                for _ in range(args.tasks):
                    tg.start_soon(self.worker, cache, broker, 3)
            await anyio.sleep(args.release_timeout * 3)
            await broker.clear()
            await self.forget_all(broker)
            before = self.memory() if trace else 0
            self.ops = 0
            self.waits.clear()
            self.faults.clear()
            per_task = -(-args.ops // args.tasks)
            done = anyio.Event()
            started = time.perf_counter()
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.operator, broker, done)
                async with anyio.create_task_group() as workers:
                    for _ in range(args.tasks):
                        workers.start_soon(self.worker, cache, broker, per_task)
                elapsed = time.perf_counter() - started
                done.set()
            stats = await broker.stats()
            totals = {"hits": stats.hits, "misses": stats.misses, "evictions": stats.evictions}
            await anyio.sleep(args.release_timeout * 3)  # late acknowledgements land
            await broker.clear()
            await self.forget_all(broker)
            final = await broker.stats()
            broker._core.check()
            assert final.waiting == 0 and final.leased == 0 and final.entries == 0, final
            del stats, final  # the snapshots themselves must not count as the broker's
            after = self.memory() if trace else 0
        waits = sorted(self.waits)
        return {
            "backend": args.backend,
            "operations": self.ops,
            "tasks": args.tasks,
            "keys": args.keys,
            "seconds": elapsed,
            "ops_per_second": self.ops / elapsed,
            "wait_p50_us": statistics.median(waits) * 1e6,
            "wait_p99_us": waits[int(len(waits) * 0.99)] * 1e6,
            **totals,
            "faults": dict(sorted(self.faults.items())),
            "broker_memory_before": before,
            "broker_memory_after": after,
        }

    async def forget_all(self, broker: cachebroker.Broker) -> None:
        for cache_name, key in (await broker.stats()).quarantined_keys:
            await broker.forget(cache_name, key)

    @staticmethod
    def memory() -> int:
        gc.collect()
        snapshot = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(True, "*/cachebroker/*")]
        )
        return sum(stat.size for stat in snapshot.statistics("filename"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=100_000)
    parser.add_argument("--tasks", type=int, default=1_000)
    parser.add_argument("--keys", type=int, default=200)
    parser.add_argument("--budget", default="256MiB")
    parser.add_argument("--release-timeout", type=float, default=0.05)
    parser.add_argument("--backend", choices=sorted(BACKENDS), default="asyncio")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    backend, options = BACKENDS[args.backend]
    result = anyio.run(Soak(args).run, False, backend=backend, backend_options=options)
    tracemalloc.start()
    traced = anyio.run(Soak(args).run, True, backend=backend, backend_options=options)
    tracemalloc.stop()
    result["broker_memory_before"] = traced["broker_memory_before"]
    result["broker_memory_after"] = traced["broker_memory_after"]
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
        return 0
    print(
        f"soak on {result['backend']}: {result['operations']:,} operations from "
        f"{result['tasks']:,} tasks over {result['keys']} keys"
    )
    print(f"  {result['ops_per_second']:,.0f} operations/s over {result['seconds']:.1f} s")
    print(
        f"  wait for a lease: p50 {result['wait_p50_us']:,.0f} us, "
        f"p99 {result['wait_p99_us']:,.0f} us"
    )
    print(
        f"  hits {result['hits']:,}, misses {result['misses']:,}, evictions {result['evictions']:,}"
    )
    print("  faults met:")
    for name, count in result["faults"].items():
        print(f"    {count:>7,}  {name}")
    before, after = result["broker_memory_before"], result["broker_memory_after"]
    verdict = "back at its start level" if after <= before else f"{after - before:+,} bytes"
    print(
        f"  broker memory (second pass, traced): {before:,} bytes after warm-up, "
        f"{after:,} bytes after the soak ({verdict})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
