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

``--evidence`` runs the soak that the fault-handling promises are measured by:
every fault the broker handles, quarantines accumulating and ``forget()``
never called, under one global ``fail_after`` (a hang fails it). Loaders
also raise a ``CancelledError`` the broker did not cause, acquire their own
key (directly, through a helper, from their worker thread) or run in worker
threads; releasers also raise a foreign ``CancelledError`` or never return;
a probed space's reads fail; lease holders ask for a second key; leases are
dropped without being ended; short-lived caches close while their worker
thread still runs, and a few threads never return before the broker closes.
It prints how many requests were served and how many failed with which
error (each must be the documented one), and the quarantined bytes at the
end. ``--check`` runs ``Core.check()`` after every step of the books (the
test build; much slower).

    python benchmarks/soak.py --evidence [--check] [--ops 100000] [--backend B] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import itertools
import json
import logging
import random
import statistics
import sys
import threading
import time
import tracemalloc
import warnings
from collections.abc import Callable
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import structlog
from _backends import BACKENDS

import cachebroker
from cachebroker._core import Core, check_after_every_step
from cachebroker.probes import Probe

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


# ---------------------------------------------------------------------- evidence


#: How long a loader's own request for its key may wait (it is refused at once).
INNER_TIMEOUT = 0.25
#: How long a lease holder waits for its second lease: two holders may wait
#: on each other's lease, the application's own deadlock.
SECOND_TIMEOUT = 1.0
#: A blocked worker thread gives up after this long, should the soak fail.
GUARD = 60.0


class Device:
    """A probed device whose reads fail now and then; loaded values take its memory."""

    def __init__(self, total: int, rng: random.Random, failure_rate: float) -> None:
        self.total = total
        self.allocated = 0
        self.rng = rng
        self.failure_rate = failure_rate
        self.failed_reads = 0
        self.lock = threading.Lock()  # plain loaders allocate from worker threads

    def read(self) -> tuple[int, int]:
        if self.rng.random() < self.failure_rate:
            self.failed_reads += 1
            raise OSError("NVML_ERROR_UNKNOWN: an unexpected error")
        return self.total, max(0, self.total - self.allocated)

    def allocate(self, amount: int) -> None:
        with self.lock:
            self.allocated += amount


class Model:
    """A loaded value: on the probed device it takes the device's memory until freed."""

    __slots__ = ("device", "size", "space")

    def __init__(self, size: int, space: str, device: Device) -> None:
        self.size = size
        self.space = space
        self.device = device
        if space == "dev":
            device.allocate(size)

    def free(self) -> None:
        if self.space == "dev":
            self.device.allocate(-self.size)
            self.space = "freed"


def undocumented(error: Exception, *, timeout: bool, second: bool, side: bool) -> str | None:
    """Why ``error`` is not what the broker documents for such a request, or ``None``."""
    if isinstance(error, cachebroker.RequestTooLarge):
        return "no size here exceeds a whole budget"
    if isinstance(error, cachebroker.OutOfSpace):
        cause: BaseException | None = error
        while cause is not None:  # a loader's own request may have met it first
            if isinstance(cause, cachebroker.OutOfSpace) and "forget" in str(cause):
                return None
            cause = cause.__cause__
        return "OutOfSpace that does not say only forget() can help"
    if isinstance(error, cachebroker.DeadlockError):
        if "from inside the loader" in str(error):
            return None
        if second and "leased by the requesting task itself" in str(error):
            return None
        return "DeadlockError for a request that waits on nobody"
    if isinstance(error, cachebroker.AcquireTimeout):
        if timeout or second or f"within {INNER_TIMEOUT:g}s" in str(error):
            return None
        return "AcquireTimeout without a timeout"
    if isinstance(error, cachebroker.LoadFailed):
        if isinstance(error.__cause__, asyncio.CancelledError):
            return None
        return f"LoadFailed caused by {error.__cause__!r}"
    if isinstance(error, cachebroker.BrokerClosed):
        return None if side else "BrokerClosed while the cache is open"
    if isinstance(error, cachebroker.BrokerError):
        return f"undocumented {type(error).__name__}"
    if isinstance(error, RuntimeError) and "corrupt" in str(error):
        return None  # the loader's own error, shared by its requesters
    return f"not the broker's to raise: {error!r}"


class Evidence:
    """``--evidence``: every fault at once, quarantines accumulating, no ``forget()``."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = rng = random.Random(args.seed)
        self.keys = [f"model-{i}" for i in range(args.keys)]
        self.weights = [1 / (rank + 1) ** 0.9 for rank in range(args.keys)]
        self.sizes = {key: rng.randint(1, 12) * MiB for key in self.keys}
        # Every fourth model lives on the probed device; every fifth is sized
        # by measurement (unknown until its first load, remembered after).
        self.space = {key: "dev" if i % 4 == 3 else "default" for i, key in enumerate(self.keys)}
        self.measured = {key for i, key in enumerate(self.keys) if i % 5 == 1}
        self.device = Device(args.device_mib * MiB, rng, failure_rate=0.05)
        self.ops = 0
        self.requests = 0
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.faults: collections.Counter[str] = collections.Counter()
        self.drops = 0
        self.gates: list[threading.Event] = []
        self.never: list[threading.Event] = []
        self.side_caches = itertools.count()
        self.check_failures: list[str] = []
        self.checks = [0]
        self.timers: Any = None

    # ------------------------------------------------------------ the plugin

    async def release(self, key: str, value: Any) -> None:
        roll = self.rng.random()
        if roll < 0.004:
            self.faults["release raised"] += 1
            raise OSError("device busy")
        if roll < 0.005:
            self.faults["release raised a foreign CancelledError"] += 1
            await anyio.lowlevel.checkpoint()
            raise asyncio.CancelledError()  # a library's own, not the broker's
        if roll < 0.006:
            self.faults["release never returned"] += 1
            await anyio.sleep_forever()
        if roll < 0.008:
            self.faults["release acknowledged past the timeout"] += 1
            await anyio.sleep(self.args.release_timeout * 2)
        elif roll < 0.05:
            await anyio.sleep(0.001)
        if isinstance(value, Model):
            value.free()

    def size(self, key: str) -> dict[str, Any]:
        if key in self.measured:
            return {"size": self.measure}
        return {"size": {self.space[key]: self.sizes[key]}}

    @staticmethod
    def measure(value: Model) -> dict[str, int]:
        return {value.space: value.size}

    def loader(self, cache: cachebroker.Cache, key: str, depth: int = 0) -> Callable[[], Any]:
        """A loader for ``key``, chosen now: what it does matters only if it runs."""
        roll = self.rng.random()
        space, size, device = self.space[key], self.sizes[key], self.device

        async def own_key() -> None:
            async with cache.acquire(
                key,
                load=self.loader(cache, key, depth + 1),
                timeout=INNER_TIMEOUT,
                **self.size(key),
            ):
                pass

        if depth < 2 and roll < 0.006:
            variant = ("directly", "through a helper", "from its worker thread")[int(roll / 0.002)]

            async def load_own() -> Model:
                self.faults[f"loader acquired its own key {variant}"] += 1
                await own_key()
                return Model(size, space, device)

            def load_own_in_thread() -> Model:
                self.faults[f"loader acquired its own key {variant}"] += 1
                anyio.from_thread.run(own_key)
                return Model(size, space, device)

            if variant == "directly":

                async def load_direct() -> Model:
                    self.faults[f"loader acquired its own key {variant}"] += 1
                    async with cache.acquire(
                        key, load=load_direct, timeout=INNER_TIMEOUT, **self.size(key)
                    ):
                        return Model(size, space, device)

                return load_direct
            return load_own_in_thread if variant == "from its worker thread" else load_own
        if roll < 0.016:

            async def load_failing() -> Model:
                self.faults["load failed"] += 1
                await anyio.lowlevel.checkpoint()
                raise RuntimeError(f"corrupt checkpoint {key}")

            return load_failing
        if roll < 0.021:

            async def load_cancelled() -> Model:
                self.faults["load raised a foreign CancelledError"] += 1
                await anyio.lowlevel.checkpoint()
                raise asyncio.CancelledError()  # a library's own, not the broker's

            return load_cancelled
        if roll < 0.08:

            def load_in_thread() -> Model:
                self.faults["load ran in a worker thread"] += 1
                if roll < 0.04:
                    time.sleep(0.001)
                return Model(size, space, device)

            return load_in_thread

        async def load() -> Model:
            if roll < 0.12:
                await anyio.sleep(0.002)
            else:
                await anyio.lowlevel.checkpoint()
            return Model(size, space, device)

        return load

    # --------------------------------------------------------------- requests

    def failed(
        self, error: Exception, *, timeout: bool = False, second: bool = False, side: bool = False
    ) -> None:
        reason = undocumented(error, timeout=timeout, second=second, side=side)
        if reason is not None:
            raise AssertionError(f"{reason}: {error!r}") from error
        self.outcomes[type(error).__name__ + (" (a holder's second lease)" if second else "")] += 1

    async def request(
        self, cache: cachebroker.Cache, key: str, timeout: float | None, second: bool
    ) -> None:
        self.requests += 1
        try:
            lease = cache.acquire(
                key, load=self.loader(cache, key), timeout=timeout, **self.size(key)
            )
            async with lease:
                self.outcomes["served"] += 1
                await anyio.lowlevel.checkpoint()
                if second:
                    await self.second_lease(cache)
        except Exception as exc:
            self.failed(exc, timeout=timeout is not None)

    async def second_lease(self, cache: cachebroker.Cache) -> None:
        """A lease holder asks for another model: it must not wait on its own lease."""
        key = self.rng.choices(self.keys, self.weights)[0]
        self.requests += 1
        self.faults["lease holder asked for a second lease"] += 1
        try:
            lease = cache.acquire(
                key, load=self.loader(cache, key), timeout=SECOND_TIMEOUT, **self.size(key)
            )
            async with lease:
                self.outcomes["served"] += 1
                await anyio.lowlevel.checkpoint()
        except Exception as exc:
            self.failed(exc, second=True)

    async def drop_lease(self, cache: cachebroker.Cache, key: str) -> None:
        """Acquire and let the lease be garbage-collected: the broker warns and ends it."""
        self.requests += 1
        try:
            lease = await cache.acquire(
                key, load=self.loader(cache, key), timeout=0.05, **self.size(key)
            )
        except Exception as exc:
            self.failed(exc, timeout=True)
            return
        self.outcomes["served"] += 1
        self.drops += 1
        del lease  # never released: garbage at once

    async def side_cache(self, broker: cachebroker.Broker) -> None:
        """A short-lived cache closes while its plain loader's worker thread is blocked."""
        name = f"side-{next(self.side_caches)}"
        gate = threading.Event()
        running = anyio.Event()  # its thread runs, or the request is over
        never = len(self.never) < 3 and self.rng.random() < 0.2
        (self.never if never else self.gates).append(gate)
        self.faults["cache closed while its loader's thread ran"] += 1
        if never:
            self.faults["thread never returned before the broker closed"] += 1
        leaves = self.rng.random() < 0.5
        scope = anyio.CancelScope()

        def load() -> Model:
            anyio.from_thread.run_sync(running.set)
            gate.wait(GUARD)
            return Model(MiB, "default", self.device)

        async def request(cache: cachebroker.Cache) -> None:
            self.requests += 1
            try:
                with scope:
                    async with cache.acquire("k", load=load, size=MiB):
                        self.outcomes["served"] += 1
                if scope.cancelled_caught:
                    self.outcomes["withdrawn"] += 1
            except Exception as exc:
                self.failed(exc, side=True)
            finally:
                running.set()

        async with anyio.create_task_group() as tg:
            async with broker.cache(name, self.release) as cache:
                tg.start_soon(request, cache)
                with anyio.move_on_after(0.5):  # unless it waits for space that long
                    await running.wait()
                if leaves:
                    scope.cancel()
            # Closed without waiting for the thread; it returns a little later.
            if not never:
                self.timers.start_soon(self.open_later, gate, self.rng.random() * 0.02)

    @staticmethod
    async def open_later(gate: threading.Event, delay: float) -> None:
        await anyio.sleep(delay)
        gate.set()

    async def worker(self, broker: cachebroker.Broker, cache: cachebroker.Cache, n: int) -> None:
        rng = self.rng
        for _ in range(n):
            roll = rng.random()
            key = rng.choices(self.keys, self.weights)[0]
            self.ops += 1
            if roll < 0.01:
                await cache.invalidate(key)
            elif roll < 0.012:
                await broker.evict_idle()
            elif roll < 0.0123:
                await self.side_cache(broker)
            elif roll < 0.0153:
                await self.drop_lease(cache, key)
            else:
                timeout = 0.002 if roll < 0.05 else None
                await self.request(cache, key, timeout, second=rng.random() < 0.02)

    # -------------------------------------------------------------------- run

    async def run(self) -> dict[str, Any]:
        args = self.args
        broker = cachebroker.Broker(
            budget={"default": args.budget, "dev": Probe(self.device.read, name="flaky device")},
            release_timeout=args.release_timeout,
            idle_ttl=1.0,
            memory_wait=0.05,
            probe_interval=0.05,
        )
        core = broker._core
        if args.check:
            check_after_every_step(core, self.check_failures, self.checks)
        per_task = -(-args.ops // args.tasks)
        started = time.perf_counter()
        with anyio.fail_after(args.hang_limit):  # a hang anywhere fails the soak
            async with broker, anyio.create_task_group() as timers:
                self.timers = timers
                async with broker.cache("soak", self.release) as cache:
                    async with anyio.create_task_group() as workers:
                        for _ in range(args.tasks):
                            workers.start_soon(self.worker, broker, cache, per_task)
                    elapsed = time.perf_counter() - started
                    for gate in self.gates:
                        gate.set()
                    await anyio.sleep(args.release_timeout * 3)  # late acknowledgements land
                    stats = await broker.stats()
                    assert (stats.waiting, stats.leased, stats.loading) == (0, 0, 0), stats
                    quarantined = self.quarantined(core)
            closed = time.perf_counter() - started
        # Threads that never returned before the broker closed: quarantined.
        for gate in self.never:
            gate.set()
        core.check()
        left = self.quarantined(core)
        assert all(core.spaces[name].used == amount for name, amount in left.items()), (
            "after the broker closed, only quarantined bytes may be charged"
        )
        return {
            "backend": args.backend,
            "check": args.check,
            "operations": self.ops,
            "tasks": args.tasks,
            "keys": args.keys,
            "seconds": elapsed,
            "seconds_to_close": closed,
            "ops_per_second": self.ops / elapsed,
            "requests": self.requests,
            "served": self.outcomes["served"],
            "withdrawn": self.outcomes["withdrawn"],
            "failed": {
                k: n for k, n in sorted(self.outcomes.items()) if k not in ("served", "withdrawn")
            },
            "faults": dict(sorted(self.faults.items())),
            "probe_reads_failed": self.device.failed_reads,
            "leases_dropped": self.drops,
            "hits": stats.hits,
            "misses": stats.misses,
            "quarantined_entries": stats.quarantined,
            "quarantined_bytes": quarantined,
            "quarantined_bytes_after_close": left,
            "budget": dict(stats.budget),
            "core_checks": self.checks[0],
            "check_failures": self.check_failures[:5],
        }

    @staticmethod
    def quarantined(core: Core) -> dict[str, int]:
        held = dict.fromkeys(core.spaces, 0)
        for entry in core.quarantined:
            for name, amount in entry.charge.items():
                held[name] += amount
        return held


def run_evidence(args: argparse.Namespace, backend: str, options: dict[str, Any]) -> int:
    soak = Evidence(args)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        result = anyio.run(soak.run, backend=backend, backend_options=options)
        gc.collect()
    named = [
        w
        for w in caught
        if issubclass(w.category, ResourceWarning)
        and "garbage-collected while held" in str(w.message)
    ]
    result["dropped_lease_warnings"] = len(named)
    assert len(named) == result["leases_dropped"], (len(named), result["leases_dropped"])
    assert all("soak:'model-" in str(w.message) for w in named)
    failed = sum(result["failed"].values())
    answered = result["served"] + result["withdrawn"] + failed
    assert answered == result["requests"], "a request neither served nor failed"
    assert not result["check_failures"], result["check_failures"]
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
        return 0
    print(
        f"soak --evidence on {result['backend']}: {result['operations']:,} operations from "
        f"{result['tasks']:,} tasks over {result['keys']} keys; forget() never called"
    )
    print(
        f"  {result['ops_per_second']:,.0f} operations/s over {result['seconds']:.1f} s "
        f"(closed after {result['seconds_to_close']:.1f} s, within the "
        f"{args.hang_limit:g} s fail_after: nothing hung)"
    )
    print(
        f"  requests {result['requests']:,}: served {result['served']:,}, withdrawn by their "
        f"task {result['withdrawn']:,}, failed {failed:,} with the documented error:"
    )
    for name, count in result["failed"].items():
        print(f"    {count:>7,}  {name}")
    print("  faults injected:")
    for name, count in result["faults"].items():
        print(f"    {count:>7,}  {name}")
    print(f"    {result['probe_reads_failed']:>7,}  probe read failed")
    print(
        f"    {result['leases_dropped']:>7,}  lease dropped while held "
        f"({result['dropped_lease_warnings']:,} ResourceWarnings naming soak:key)"
    )
    print(f"  hits {result['hits']:,}, misses {result['misses']:,}")
    shown = ", ".join(
        f"{name} {amount / MiB:,.0f} of {result['budget'][name] / MiB:,.0f} MiB"
        for name, amount in result["quarantined_bytes"].items()
    )
    print(f"  quarantined at the end: {result['quarantined_entries']:,} entries, {shown}")
    after = ", ".join(
        f"{name} {amount / MiB:,.0f} MiB"
        for name, amount in result["quarantined_bytes_after_close"].items()
    )
    print(f"  charged after the broker closed (all quarantined): {after}")
    if args.check:
        checks = result["core_checks"]
        print(f"  Core.check() after every step of the books: {checks:,} checks, all exact")
    return 0


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
    parser.add_argument(
        "--evidence",
        action="store_true",
        help="every fault at once, quarantines accumulating, forget() never called",
    )
    parser.add_argument(
        "--check", action="store_true", help="with --evidence: Core.check() after every step"
    )
    parser.add_argument("--device-mib", type=int, default=128, help="the probed device's size")
    parser.add_argument(
        "--hang-limit", type=float, default=1800.0, help="seconds before a hang fails the soak"
    )
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    backend, options = BACKENDS[args.backend]
    if args.evidence:
        args.budget = cachebroker.parse_bytes(args.budget, what="budget")
        return run_evidence(args, backend, options)
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
