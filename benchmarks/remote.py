"""Several processes, one broker: what ``Broker.connect()`` costs next to an in-process ``Broker``.

1. Hit path: ``async with cache.acquire(...)`` and the awaited form
   (``lease = await ...; await lease.release()``) on a warm entry, in-process
   and connected, in interleaved rounds in this process (median over rounds of
   the mean per call). A third pair holds the lease across one checkpoint, so
   that the connected broker's writer runs and reports the lease's 0->1 and
   1->0 transitions to the daemon. The target: a connected hit within 2x of an
   in-process one. One round trip (``stats()``, which asks the daemon for its
   totals) is timed beside them.
2. Miss with one eviction: the budget fits one entry; this process and a
   second client process (the holder) take turns, each miss evicting the
   other's idle entry. Time per miss here (the holder's misses are untimed),
   next to one broker with two caches doing the same in-process; the
   messages per miss are counted by the daemon, by op, and compared with the
   protocol's critical path (acquire -> release -> report -> grant: two round
   trips, one of them between the daemon and the other process).
3. Contention: N client processes x T tasks over K keys each, the budget
   fitting a quarter of one process's keys; each task acquires a Zipf-ish key,
   holds it for one checkpoint and releases it, P times. Grants/s and p50/p99
   wait per acquire, measured in the clients and aggregated here, next to the
   same workload in one process (one broker, N caches, N x T tasks).

The daemon runs in a subprocess by default (``--daemon subprocess``: the daemon
does not share this process's event loop or GIL, as with ``cachebroker serve``;
it is this script in its daemon role, which counts the messages it sends and
receives); ``--daemon in-loop`` runs it in this process's loop instead. The helper
processes (daemon, holder, contention clients) run on ``--backend`` as this one
does, and log nothing below WARNING, as the in-process broker.

    python benchmarks/remote.py [--quick] [--daemon subprocess|in-loop] [--calls N]
        [--rounds R] [--misses N] [--processes 3] [--tasks 1000] [--per-task 20]
        [--keys 100] [--backend asyncio] [--json]
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import structlog
from _backends import BACKENDS
from anyio.streams.buffered import BufferedByteReceiveStream

import cachebroker
from cachebroker._remote import _protocol as wire

Bench = Callable[[int], Awaitable[float]]
SCRIPT = os.path.abspath(__file__)
LINE = 1 << 26  # the longest line a helper may print (a worker's waits)


async def load() -> str:
    return "model"


async def release(key: object, value: object) -> None:
    pass


# ------------------------------------------------------- counting messages


class Counts:
    """Messages this process encodes and receives (``_protocol.encode`` / ``receive``), by
    direction and op."""

    def __init__(self) -> None:
        self.messages: collections.Counter[str] = collections.Counter()

    def install(self, receiving: bool) -> None:
        encode, receive = wire.encode, wire.receive

        def counted_encode(message: Any) -> bytes:
            self.messages["sent " + message["op"]] += 1
            return encode(message)

        async def counted_receive(reader: Any, limit: int = wire.MAX_FRAME) -> dict[str, Any]:
            message = await receive(reader, limit)
            self.messages["received " + message["op"]] += 1
            return message

        wire.encode = counted_encode
        if receiving:
            wire.receive = counted_receive

    def snapshot(self) -> dict[str, Any]:
        return {"messages": dict(self.messages)}


# ------------------------------------------------------------ helper roles


async def role_daemon(args: argparse.Namespace) -> None:
    """This script as the daemon: serve ``--socket``; print counts when asked on stdin."""
    from cachebroker._remote._daemon import Daemon, DaemonBroker

    counts = Counts()
    counts.install(receiving=True)
    daemon = Daemon(DaemonBroker(budget=args.budget), args.socket)
    async with anyio.create_task_group() as tg:
        await tg.start(daemon.run)
        print("ready", flush=True)
        while await anyio.to_thread.run_sync(sys.stdin.readline):  # "counts"
            print(json.dumps(counts.snapshot()), flush=True)
        tg.cancel_scope.cancel()


async def role_holder(args: argparse.Namespace) -> None:
    """The other process of the miss benchmark: ``load I`` loads key I and leaves it idle."""
    async with (
        cachebroker.Broker.connect(args.socket) as broker,
        broker.cache("holder", release) as cache,
    ):
        print("ready", flush=True)
        while line := await anyio.to_thread.run_sync(sys.stdin.readline):
            async with cache.acquire(("h", int(line.split()[1])), load=load, size=1):
                pass
            await broker.stats()  # a round trip: the daemon has had the "idle" report
            print("ok", flush=True)


async def role_worker(args: argparse.Namespace) -> None:
    """A contention client: ``--tasks`` tasks in this process, started by ``go`` on stdin."""
    async with (
        cachebroker.Broker.connect(args.socket) as broker,
        broker.cache("w", release) as cache,
    ):
        print("ready", flush=True)
        await anyio.to_thread.run_sync(sys.stdin.readline)
        result = await contend([cache], args, seed=args.seed)
        stats = await broker.stats()
    result.update(misses=stats.misses, evictions=stats.evictions)
    print(json.dumps(result), flush=True)


async def contend(caches: list[cachebroker.Cache], args: argparse.Namespace, seed: int) -> Any:
    """``args.tasks`` tasks per cache, each acquiring a Zipf-ish key ``args.per_task`` times."""
    rng = random.Random(seed)
    keys = list(range(args.keys))
    weights = [1 / (k + 1) for k in keys]
    waits: list[float] = []

    async def slow_load() -> int:
        await anyio.lowlevel.checkpoint()
        return 1

    async def worker(cache: cachebroker.Cache) -> None:
        for _ in range(args.per_task):
            key = rng.choices(keys, weights)[0]
            begun = time.perf_counter()
            async with cache.acquire(key, load=slow_load, size=1, timeout=120):
                waits.append(time.perf_counter() - begun)
                await anyio.lowlevel.checkpoint()

    started = time.perf_counter()
    with anyio.fail_after(600):
        async with anyio.create_task_group() as tg:
            for cache in caches:
                for _ in range(args.tasks):
                    tg.start_soon(worker, cache)
    return {"start": started, "end": time.perf_counter(), "waits": waits}


# ------------------------------------------------------------ the driver


class Helper:
    """A helper process of this script, spoken to by lines on its stdin and stdout."""

    def __init__(self, process: anyio.abc.Process) -> None:
        self.process = process
        assert process.stdout is not None
        self.rx = BufferedByteReceiveStream(process.stdout)

    async def say(self, line: str) -> None:
        assert self.process.stdin is not None
        await self.process.stdin.send(line.encode() + b"\n")

    async def line(self) -> str:
        return (await self.rx.receive_until(b"\n", LINE)).decode()

    async def ask(self, line: str) -> str:
        await self.say(line)
        return await self.line()


@asynccontextmanager
async def helper(
    args: argparse.Namespace, role: str, socket: str, *extra: str
) -> AsyncIterator[Helper]:
    """This script in ``role``, on the same event loop kind as the driver."""
    command = [sys.executable, SCRIPT, "--role", role, "--socket", socket]
    command += ["--backend", args.backend, *extra]
    process = await anyio.open_process(command, stderr=None)
    try:
        proc = Helper(process)
        with anyio.fail_after(30):
            ready = await proc.line()
        if ready.strip() != "ready":
            raise RuntimeError(f"the {role} helper said {ready!r}")
        yield proc
    finally:
        with anyio.CancelScope(shield=True):
            assert process.stdin is not None
            await process.stdin.aclose()
            with anyio.move_on_after(10):
                await process.wait()
            if process.returncode is None:
                process.kill()
                await process.wait()
            await process.aclose()


class DaemonHandle:
    """The daemon, in a subprocess (counting messages) or in this loop."""

    def __init__(self, helper: Helper | None, counts: Counts | None) -> None:
        self.helper = helper
        self.counts = counts

    async def snapshot(self) -> dict[str, Any]:
        if self.helper is not None:
            return json.loads(await self.helper.ask("counts"))  # type: ignore[no-any-return]
        assert self.counts is not None
        return self.counts.snapshot()


@asynccontextmanager
async def daemon(args: argparse.Namespace, budget: int) -> AsyncIterator[tuple[str, DaemonHandle]]:
    """A fresh daemon (budget ``budget`` bytes) on a socket in a private directory."""
    directory = tempfile.mkdtemp(prefix="cachebroker-bench-")
    socket = os.path.join(directory, "broker.sock")
    try:
        if args.daemon == "subprocess":
            async with helper(args, "daemon", socket, "--budget", str(budget)) as proc:
                yield socket, DaemonHandle(proc, None)
        else:
            from cachebroker._remote._daemon import Daemon, DaemonBroker

            counts = Counts()
            counts.install(receiving=True)  # (counts this process's clients too)
            served = Daemon(DaemonBroker(budget=budget), socket)
            async with anyio.create_task_group() as tg:
                await tg.start(served.run)
                yield socket, DaemonHandle(None, counts)
                tg.cancel_scope.cancel()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


async def raw_round_trips(socket: str, n: int) -> float:
    """Median seconds of a bare ``totals`` request and its answer, without a client broker."""
    async with await anyio.connect_unix(socket) as stream:
        reader = BufferedByteReceiveStream(stream)
        await wire.send(stream, {"op": "hello", "version": wire.VERSION, "pid": os.getpid()})
        await wire.receive(reader)
        trips = []
        for _ in range(n):
            started = time.perf_counter()
            await wire.send(stream, {"op": "totals"})
            await wire.receive(reader)
            trips.append(time.perf_counter() - started)
    return statistics.median(trips)


#: What a daemon sends, and what its clients send (``totals`` and ``ps`` go both ways).
DAEMON_SENDS = {"welcome", "grant", "fail", "release", "totals", "ps", "error"}
CLIENT_SENDS = {"hello", "open", "close", "acquire", "cancel", "report", "totals", "ps"}


def per_op(before: dict[str, Any], after: dict[str, Any], n: int, skip: set[str]) -> Any:
    """Messages the daemon received and sent, by op, per operation.

    With the daemon in this loop the counters see this process's client too:
    only what a daemon sends is counted as sent, only what a client sends as received.
    """
    ops = {}
    for name, count in after["messages"].items():
        direction, op = name.split()
        if op in skip or op not in (DAEMON_SENDS if direction == "sent" else CLIENT_SENDS):
            continue
        delta = count - before["messages"].get(name, 0)
        if delta:
            ops[name] = delta / n
    return ops


# -------------------------------------------------------------- 1. hit path


async def hit_path(args: argparse.Namespace) -> dict[str, Any]:
    counts = Counts()
    async with daemon(args, 1 << 30) as (socket, _):
        if args.daemon == "subprocess":
            counts.install(receiving=False)  # what this process sends
        local = cachebroker.Broker(budget="1GiB")
        remote = cachebroker.Broker.connect(socket)
        async with (
            local,
            remote,
            local.cache("bench", release) as local_cache,
            remote.cache("bench", release) as remote_cache,
        ):
            contenders: dict[str, Bench] = {}
            for where, cache in (("in-process", local_cache), ("connected", remote_cache)):
                await (await cache.acquire("k", load=load, size=1)).release()
                contenders[f"{where} async with"] = with_bench(cache)
                contenders[f"{where} await+release"] = await_bench(cache)
                contenders[f"{where} held over a checkpoint"] = held_bench(cache)
            samples: dict[str, list[float]] = {name: [] for name in contenders}
            sent: dict[str, int] = dict.fromkeys(contenders, 0)
            for bench in contenders.values():  # warm up
                await bench(args.calls // 10 or 1)
            for _ in range(args.rounds):
                for name, bench in contenders.items():
                    before = sum(counts.messages.values())
                    samples[name].append(await bench(args.calls) / args.calls)
                    await anyio.sleep(0.001)  # let the writer send what the round marked
                    sent[name] += sum(counts.messages.values()) - before
            trips = []
            for _ in range(200):
                started = time.perf_counter()
                await remote.stats()
                trips.append(time.perf_counter() - started)
            raw = await raw_round_trips(socket, 200)
            figures = {name: statistics.median(values) for name, values in samples.items()}
    calls = args.rounds * args.calls
    result: dict[str, Any] = {
        "stats_round_trip_us": statistics.median(trips) * 1e6,
        "raw_round_trip_us": raw * 1e6,
        "rows": [],
    }
    for name, seconds in figures.items():
        where, _, form = name.partition(" ")
        base = figures[f"in-process {form}"]
        result["rows"].append(
            {
                "contender": name,
                "us_per_call": seconds * 1e6,
                "ratio_to_in_process": seconds / base,
                "messages_per_call": (sent[name] / calls if args.daemon == "subprocess" else None),
            }
        )
    return result


def with_bench(cache: cachebroker.Cache) -> Bench:
    async def bench(n: int) -> float:
        acquire = cache.acquire
        started = time.perf_counter()
        for _ in range(n):
            async with acquire("k", load=load, size=1):
                pass
        return time.perf_counter() - started

    return bench


def await_bench(cache: cachebroker.Cache) -> Bench:
    async def bench(n: int) -> float:
        acquire = cache.acquire
        started = time.perf_counter()
        for _ in range(n):
            lease = await acquire("k", load=load, size=1)
            await lease.release()
        return time.perf_counter() - started

    return bench


def held_bench(cache: cachebroker.Cache) -> Bench:
    async def bench(n: int) -> float:
        acquire = cache.acquire
        checkpoint = anyio.lowlevel.checkpoint
        started = time.perf_counter()
        for _ in range(n):
            async with acquire("k", load=load, size=1):
                await checkpoint()
            await checkpoint()
        return time.perf_counter() - started

    return bench


# ---------------------------------------------------- 2. miss with eviction


async def miss_in_process(n: int) -> float:
    async with (
        cachebroker.Broker(budget=1) as broker,
        broker.cache("a", release) as mine,
        broker.cache("b", release) as theirs,
    ):
        total = 0.0
        for i in range(n):
            async with theirs.acquire(("h", i), load=load, size=1):
                pass
            started = time.perf_counter()
            async with mine.acquire(("d", i), load=load, size=1):
                pass
            total += time.perf_counter() - started
        return total / n


async def miss_connected(args: argparse.Namespace) -> dict[str, Any]:
    n = args.misses
    async with daemon(args, 1) as (socket, handle):
        async with (
            helper(args, "holder", socket) as holder,
            cachebroker.Broker.connect(socket) as broker,
            broker.cache("driver", release) as cache,
        ):
            raw = await raw_round_trips(socket, 200)
            await holder.ask("load -1")
            before = await handle.snapshot()
            total = 0.0
            for i in range(n):
                started = time.perf_counter()
                async with cache.acquire(("d", i), load=load, size=1):
                    pass
                total += time.perf_counter() - started
                await holder.ask(f"load {i}")  # evicts ours
            after = await handle.snapshot()
    # Each turn is two misses (ours, timed, and the holder's); stats() is not part of them.
    messages = per_op(before, after, 2 * n, skip={"totals"})
    return {
        "miss_us": total / n * 1e6,
        "raw_round_trip_us": raw * 1e6,
        "messages_per_miss": messages,
        "total_messages_per_miss": sum(messages.values()),
    }


# ------------------------------------------------------------ 3. contention


async def contention(args: argparse.Namespace) -> dict[str, Any]:
    budget = max(1, args.keys // 4)
    async with daemon(args, budget) as (socket, _):
        extra = ["--keys", str(args.keys), "--tasks", str(args.tasks)]
        extra += ["--per-task", str(args.per_task)]
        results: list[Any] = []
        async with anyio.create_task_group() as tg:
            procs: list[Helper] = []
            ready = anyio.Event()

            async def client(index: int) -> None:
                async with helper(args, "worker", socket, *extra, "--seed", str(index)) as proc:
                    procs.append(proc)
                    if len(procs) == args.processes:
                        ready.set()
                    await ready.wait()
                    await proc.say("go")
                    with anyio.fail_after(900):
                        results.append(json.loads(await proc.line()))

            for index in range(args.processes):
                tg.start_soon(client, index)
    waits = sorted(w for r in results for w in r["waits"])
    elapsed = max(r["end"] for r in results) - min(r["start"] for r in results)
    connected = {
        "grants_per_second": len(waits) / elapsed,
        "per_process": [len(r["waits"]) / (r["end"] - r["start"]) for r in results],
        "wait_p50_us": statistics.median(waits) * 1e6,
        "wait_p99_us": waits[int(len(waits) * 0.99)] * 1e6,
        "acquisitions": len(waits),
        "misses": sum(r["misses"] for r in results),
        "seconds": elapsed,
    }
    async with cachebroker.Broker(budget=budget) as broker, AsyncExitStack() as stack:
        caches = [
            await stack.enter_async_context(broker.cache(f"w{index}", release))
            for index in range(args.processes)
        ]
        local = await contend(caches, args, seed=0)
        stats = await broker.stats()
    waits = sorted(local["waits"])
    in_process = {
        "grants_per_second": len(waits) / (local["end"] - local["start"]),
        "wait_p50_us": statistics.median(waits) * 1e6,
        "wait_p99_us": waits[int(len(waits) * 0.99)] * 1e6,
        "acquisitions": len(waits),
        "misses": stats.misses,
        "seconds": local["end"] - local["start"],
    }
    return {"budget_entries": budget, "connected": connected, "in_process": in_process}


# ------------------------------------------------------------------- main


async def run(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "daemon": args.daemon,
        "hit": await hit_path(args),
        "miss": {
            "in_process_us": await miss_in_process(args.misses) * 1e6,
            "connected": await miss_connected(args),
        },
        "contention": await contention(args),
    }


def report(args: argparse.Namespace, result: dict[str, Any]) -> None:
    where = {"subprocess": "in a subprocess", "in-loop": "in this process's loop"}[args.daemon]
    hit = result["hit"]
    print(
        f"remote broker on {args.backend}, daemon {where}; one round trip to the daemon: "
        f"{hit['raw_round_trip_us']:.0f} us (bare frames), "
        f"{hit['stats_round_trip_us']:.0f} us (broker.stats())"
    )
    print(
        f"hit path, median of {args.rounds} rounds x {args.calls} calls (lower is better; "
        "target: connected within 2x of in-process)"
    )
    print(f"  {'contender':<38} {'us/call':>8} {'x in-process':>13} {'msgs/call':>10}")
    for row in hit["rows"]:
        messages = row["messages_per_call"]
        shown = "-" if messages is None else f"{messages:.2f}"
        print(
            f"  {row['contender']:<38} {row['us_per_call']:>8.2f} "
            f"{row['ratio_to_in_process']:>13.2f} {shown:>10}"
        )
    miss = result["miss"]
    connected = miss["connected"]
    ratio = connected["miss_us"] / miss["in_process_us"]
    print(
        f"miss evicting another process's idle entry, {args.misses} misses "
        "(budget of one entry; two processes take turns)"
    )
    print(f"  in-process (one broker, two caches)  {miss['in_process_us']:>8.1f} us/miss")
    print(
        f"  connected                            {connected['miss_us']:>8.1f} us/miss  "
        f"{ratio:.1f}x in-process; {connected['miss_us'] / connected['raw_round_trip_us']:.1f}x "
        f"a bare round trip ({connected['raw_round_trip_us']:.0f} us)"
    )
    print(
        "  round trips on a miss's path (protocol): 2 "
        "(acquire -> [release -> report gone] -> grant), 0 in-process"
    )
    ops = ", ".join(f"{name} {count:.2f}" for name, count in connected["messages_per_miss"].items())
    print(
        f"  messages per miss, counted by the daemon: "
        f"{connected['total_messages_per_miss']:.2f} ({ops})"
    )
    c = result["contention"]
    print(
        f"contention: {args.processes} processes x {args.tasks:,} tasks x {args.per_task} "
        f"acquires over {args.keys} keys each, {c['budget_entries']} entries fit"
    )
    print(f"  {'':<28} {'grants/s':>10} {'wait p50 us':>12} {'wait p99 us':>12} {'misses':>8}")
    for name, key in (("connected (aggregated)", "connected"), ("in-process", "in_process")):
        f = c[key]
        print(
            f"  {name:<28} {f['grants_per_second']:>10,.0f} {f['wait_p50_us']:>12,.0f} "
            f"{f['wait_p99_us']:>12,.0f} {f['misses']:>8,}"
        )
    per = ", ".join(f"{g:,.0f}" for g in c["connected"]["per_process"])
    ratio = c["connected"]["grants_per_second"] / c["in_process"]["grants_per_second"]
    p99 = c["connected"]["wait_p99_us"] / c["in_process"]["wait_p99_us"]
    print(f"  connected / in-process: grants/s {ratio:.2f}x, p99 wait {p99:.1f}x")
    print(f"  per process grants/s: {per}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run (seconds)")
    parser.add_argument("--daemon", choices=["subprocess", "in-loop"], default="subprocess")
    parser.add_argument("--calls", type=int, default=None, help="hits per round (20,000)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of hits (7)")
    parser.add_argument("--misses", type=int, default=None, help="misses timed (1,000)")
    parser.add_argument("--processes", type=int, default=3, help="contention: client processes")
    parser.add_argument("--tasks", type=int, default=None, help="contention: tasks per process")
    parser.add_argument("--per-task", type=int, default=None, help="contention: acquires per task")
    parser.add_argument("--keys", type=int, default=100, help="contention: keys per process")
    parser.add_argument("--backend", choices=sorted(BACKENDS), default="asyncio")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--role", choices=["daemon", "holder", "worker"], help=argparse.SUPPRESS)
    parser.add_argument("--socket", help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    quick = {"calls": 5_000, "rounds": 3, "misses": 200, "tasks": 200, "per_task": 10}
    full = {"calls": 20_000, "rounds": 7, "misses": 1_000, "tasks": 1_000, "per_task": 20}
    for name, value in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    backend, options = BACKENDS[args.backend]
    if args.role is not None:
        roles = {"daemon": role_daemon, "holder": role_holder, "worker": role_worker}
        anyio.run(roles[args.role], args, backend=backend, backend_options=options)
        return 0
    result = anyio.run(run, args, backend=backend, backend_options=options)
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
    else:
        report(args, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
