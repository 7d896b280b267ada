"""A client process for ``tests/remote/test_processes.py``: ``Broker.connect`` from a real process.

Run as ``python process_client.py BACKEND ADDRESS SIGNALS CONFIG`` (``BACKEND``
asyncio, uvloop or trio; ``SIGNALS`` a directory where the test creates the
files a ``wait`` step waits for; ``CONFIG`` JSON). It reports what it does on
stdout, one JSON object a line, each with an ``"event"``. ``CONFIG["mode"]``:

* ``steps``: run ``CONFIG["steps"]`` in order (``STEPS``): connect, acquire
  (held, or in the background), release, invalidate, read a lease's value,
  wait for a signal, close; loaders and releasers may block forever, or until
  a signal, so that the test can kill the process (or its daemon) in the
  middle of one; a loader may run out of memory until a file exists, which
  another process's releaser creates (``oom-until:``, ``frees:``); a releaser
  may move values between tiers (``releaser: "moves"``);
* ``random``: a seeded run of acquires, holds, releases, timeouts,
  cancellations and failing loads across a few tasks, logging every load's
  start and every release's end with a monotonic timestamp (``random_run``);
* ``memory``: load real buffers of ``CONFIG["size"]`` bytes, one key after
  another, and drop them on release (``memory_run``).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Hashable
from typing import Any

import anyio
import anyio.abc

from cachebroker import AcquireTimeout, Broker, Cache, Lease

Config = dict[str, Any]


def say(event: str, **fields: Any) -> None:
    """One line of the report."""
    print(json.dumps({"event": event, "pid": os.getpid(), **fields}), flush=True)


async def wait_signal(signals: str, name: str) -> None:
    """Wait until the test creates the file ``name`` in ``signals``."""
    path = os.path.join(signals, name)
    while not os.path.exists(path):  # noqa: ASYNC240 - a stat, not a read
        await anyio.sleep(0.005)


def error_fields(exc: BaseException) -> dict[str, str]:
    return {"type": type(exc).__name__, "message": str(exc)}


# ------------------------------------------------------------------ steps


class Steps:
    """The state of a ``steps`` run: the broker and cache, the leases held by key."""

    def __init__(self, address: str, signals: str, config: Config) -> None:
        self.address = address
        self.signals = signals
        self.releaser = str(config.get("releaser", "quick"))
        self.stack: contextlib.AsyncExitStack | None = None
        self.broker: Broker | None = None
        self.cache: Cache | None = None
        self.leases: dict[str, Lease[Any]] = {}
        self.tg: anyio.abc.TaskGroup | None = None

    async def release(self, key: Hashable, value: Any) -> None:
        say("releasing", key=repr(key))
        if self.releaser == "forever":
            await anyio.sleep_forever()
        if self.releaser.startswith("signal:"):  # until the test says so
            await wait_signal(self.signals, self.releaser.partition(":")[2])
        if self.releaser.startswith("frees:"):  # a device's memory another process sees
            await (anyio.Path(self.signals) / self.releaser.partition(":")[2]).touch()
        say("released", key=repr(key))

    def loader(self, label: str, how: str) -> Callable[[], Awaitable[str]]:
        async def load() -> str:
            say("loading", label=label)
            if how == "forever":
                await anyio.sleep_forever()
            if how.startswith("signal:"):  # until the test says so
                await wait_signal(self.signals, how.partition(":")[2])
            # The device is full until that file exists:
            room = anyio.Path(self.signals) / how.partition(":")[2]
            if how.startswith("oom-until:") and not await room.exists():
                say("out of memory", label=label)
                raise MemoryError(f"no room on the device for {label}")
            return f"{label}@{os.getpid()}"

        return load

    async def connect(self, step: Config) -> None:
        stack = contextlib.AsyncExitStack()
        try:
            self.broker = await stack.enter_async_context(
                Broker.connect(
                    self.address,
                    reconnect=step.get("reconnect", True),
                    reconnect_delay=step.get("reconnect_delay", 0.05),
                    reconnect_max_delay=max(1.0, step.get("reconnect_delay", 0.05)),
                )
            )
            releaser: Any = _Moving(self) if self.releaser == "moves" else self.release
            self.cache = await stack.enter_async_context(
                self.broker.cache(step.get("cache", "c"), releaser)
            )
        except Exception as exc:
            await stack.aclose()
            say("error", op="connect", **error_fields(exc))
            return
        self.stack = stack
        say("connected")

    async def close(self, step: Config) -> None:
        assert self.stack is not None
        for lease in self.leases.values():
            await lease.release()
        self.leases.clear()
        try:
            await self.stack.aclose()
        except Exception as exc:
            say("error", op="close", **error_fields(exc))
        else:
            say("closed")
        self.stack = self.broker = self.cache = None

    async def acquire(self, step: Config) -> None:
        if step.get("background"):
            assert self.tg is not None
            self.tg.start_soon(self._acquire, step)
        else:
            await self._acquire(step)

    async def _acquire(self, step: Config) -> None:
        assert self.cache is not None
        raw = step["key"]
        key: Hashable = tuple(raw) if isinstance(raw, list) else raw  # (JSON has no tuples)
        label = str(step.get("label", raw))
        say("acquiring", key=raw, label=label)
        try:
            lease = await self.cache.acquire(
                key,
                load=self.loader(label, step.get("load", "quick")),
                size=step.get("size", 1),
                timeout=step.get("timeout"),
                pin=bool(step.get("pin", False)),
            )
        except Exception as exc:
            say("error", op="acquire", key=raw, label=label, **error_fields(exc))
            return
        value = lease.value
        if step.get("hold", True):
            self.leases[label] = lease
        else:
            await lease.release()
        say("acquired", key=raw, label=label, value=value)

    async def release_lease(self, step: Config) -> None:
        await self.leases.pop(step["label"]).release()
        say("let go", label=step["label"])

    async def value(self, step: Config) -> None:
        try:
            say("value", label=step["label"], value=self.leases[step["label"]].value)
        except Exception as exc:
            say("error", op="value", label=step["label"], **error_fields(exc))

    async def invalidate(self, step: Config) -> None:
        assert self.tg is not None and self.cache is not None
        cache = self.cache
        self.tg.start_soon(cache.invalidate, step["key"])
        say("invalidating", key=step["key"])

    async def wait(self, step: Config) -> None:
        await wait_signal(self.signals, step["signal"])

    async def stats(self, step: Config) -> None:
        assert self.broker is not None
        stats = await self.broker.stats()
        say(
            "stats",
            used=dict(stats.used),
            broker_used=stats.broker_used,
            oom_retries=stats.oom_retries,
            releases=dict(stats.releases),
        )

    async def entries(self, step: Config) -> None:
        assert self.broker is not None
        say(
            "entries",
            entries={
                repr(e.key): {"state": e.state, "charge": dict(e.charge), "home": e.home}
                for e in await self.broker.entries()
            },
        )


class _Moving:
    """The releaser of ``releaser: "moves"``: it moves values between tiers (``Releaser.move``),
    saying so; the moved value is ``value>to``."""

    def __init__(self, steps: Steps) -> None:
        self.steps = steps

    async def release(self, key: Hashable, value: Any) -> None:
        await self.steps.release(key, value)

    async def move(self, key: Hashable, value: Any, to: str) -> Any:
        say("moved", key=repr(key), to=to)
        return f"{value}>{to}"


STEPS: dict[str, Callable[[Steps, Config], Awaitable[None]]] = {
    "connect": Steps.connect,
    "close": Steps.close,
    "acquire": Steps.acquire,
    "release": Steps.release_lease,
    "value": Steps.value,
    "wait": Steps.wait,
    "stats": Steps.stats,
    "invalidate": Steps.invalidate,
    "entries": Steps.entries,
}


async def steps_run(address: str, signals: str, config: Config) -> None:
    run = Steps(address, signals, config)
    async with anyio.create_task_group() as tg:
        run.tg = tg
        for step in config["steps"]:
            await STEPS[step["do"]](run, step)
        if run.stack is not None:
            await run.close({})


# ------------------------------------------------------------------ random


def sizes(key: int) -> dict[str, int]:
    """Each key's charge: 10 to 30 bytes of ``a``, and for every fourth key 20 of ``b``."""
    charge = {"a": 10 * (1 + key % 3)}
    if key % 4 == 0:
        charge["b"] = 20
    return charge


class Boom(Exception):
    """A load that fails on purpose."""


def plan(rng: random.Random, count: int, keys: int) -> list[Config]:
    """``count`` operations, drawn from ``rng``."""
    ops = []
    for _ in range(count):
        roll = rng.random()
        ops.append(
            {
                "kind": "cancel" if roll < 0.15 else "fail" if roll < 0.2 else "hold",
                "key": rng.randrange(keys),
                "load": rng.uniform(0, 0.004),
                "hold": rng.uniform(0, 0.015),
                "timeout": rng.uniform(0.002, 0.2),
                "cancel": rng.uniform(0, 0.006),
            }
        )
    return ops


async def random_run(address: str, signals: str, config: Config) -> None:
    """Run ``config["ops"]`` random operations over ``config["workers"]`` tasks.

    Logs ``load`` when a loader starts (its bytes are granted), ``unload``
    when one ends without a value, and ``freed`` when a release is done, each
    with ``time.monotonic_ns()``: the test orders every process's lines by
    it and checks that the bytes loaded never exceed the shared budget.
    """
    rng = random.Random(config["seed"])
    workers = config["workers"]
    plans = [plan(rng, config["ops"] // workers, config["keys"]) for _ in range(workers)]
    outcomes: Counter[str] = Counter()
    pid = os.getpid()

    async def release(key: Hashable, value: Any) -> None:
        assert isinstance(key, int)
        await anyio.sleep(0.001)
        say("freed", key=key, bytes=sizes(key), t=time.monotonic_ns())

    def loader(key: int, op: Config) -> Callable[[], Awaitable[tuple[int, int]]]:
        async def load() -> tuple[int, int]:
            say("load", key=key, bytes=sizes(key), t=time.monotonic_ns())
            try:
                await anyio.sleep(op["load"])
                if op["kind"] == "fail":
                    raise Boom(f"load of {key} fails on purpose")
            except BaseException:
                say("unload", key=key, bytes=sizes(key), t=time.monotonic_ns())
                raise
            return (key, pid)

        return load

    async def one(cache: Cache, op: Config) -> str:
        key = op["key"]
        lease = cache.acquire(key, load=loader(key, op), size=sizes(key), timeout=op["timeout"])
        async with lease:
            if lease.value != (key, pid):
                return "wrong value"
            await anyio.sleep(op["hold"])
        return "held"

    async def worker(cache: Cache, ops: list[Config]) -> None:
        for op in ops:
            try:
                if op["kind"] == "cancel":
                    with anyio.move_on_after(op["cancel"]) as scope:
                        outcome = await one(cache, op)
                    if scope.cancelled_caught:
                        outcome = "cancelled"
                else:
                    outcome = await one(cache, op)
            except AcquireTimeout:
                outcome = "timeout"
            except Boom:
                outcome = "failed"
            except Exception as exc:
                outcome = f"unexpected {type(exc).__name__}: {exc}"
            outcomes[outcome] += 1

    async with Broker.connect(address) as broker:
        async with broker.cache("random", release) as cache:
            async with anyio.create_task_group() as tg:
                for ops in plans:
                    tg.start_soon(worker, cache, ops)
            say("done", outcomes=dict(outcomes))
            await wait_signal(signals, "report")
            stats = await broker.stats()
            say("holding", used=dict(stats.used), entries=stats.entries, leased=stats.leased)
            await wait_signal(signals, "close")
    say("closed")


# ------------------------------------------------------------------ memory


async def memory_run(address: str, signals: str, config: Config) -> None:
    """Load each of ``config["keys"]`` ``config["rounds"]`` times: real, resident buffers.

    The release drops the only reference to the buffer (the entry's, once
    the releaser returns) so its pages go back to the system before the
    daemon hears that the bytes are free.
    """
    size = config["size"]

    async def release(key: Hashable, value: Any) -> None:
        del value
        gc.collect()
        say("freed", key=key)

    async def load() -> bytearray:
        buffer: bytearray = bytearray(b"\x01") * size  # one allocation, every page written
        return buffer

    async with Broker.connect(address) as broker:
        async with broker.cache("weights", release) as cache:
            say("ready")
            await wait_signal(signals, "go")
            for _ in range(config["rounds"]):
                for key in config["keys"]:
                    async with cache.acquire(key, load=load, size=size, timeout=20) as lease:
                        say("loaded", key=key, first=lease.value[0])
                        await anyio.sleep(0.01)
            say("done")
    say("closed")


# ------------------------------------------------------------------ shared books


class SharedBooks:
    """Every process's real bytes in one block of shared memory: ``pid, held, peak`` a slot.

    A process adds what its loader allocates and subtracts what its releaser
    (or a failed or cancelled load) frees; at every allocation it sums the
    slots of the processes still running (a process that ended, a zombie
    included, holds nothing: the operating system has its memory back) and
    keeps the highest sum it saw as its slot's peak.
    """

    SLOT = 3

    def __init__(self, name: str, slot: int) -> None:
        from multiprocessing import resource_tracker, shared_memory

        self.memory = shared_memory.SharedMemory(name=name)
        # Attached, not owned: this process's exit must not unlink it (before 3.13,
        # attaching registers it with this process's resource tracker).
        resource_tracker.unregister(self.memory._name, "shared_memory")  # type: ignore[attr-defined]
        assert self.memory.buf is not None
        self.cells = self.memory.buf.cast("q")
        self.slot = slot
        self.cells[slot * self.SLOT] = os.getpid()
        self.slots = len(self.cells) // self.SLOT

    def allocate(self, size: int) -> None:
        cells, at = self.cells, self.slot * self.SLOT
        cells[at + 1] += size
        total = sum(
            cells[i * self.SLOT + 1]
            for i in range(self.slots)
            if i == self.slot or running(cells[i * self.SLOT])
        )
        cells[at + 2] = max(cells[at + 2], total)

    def free(self, size: int) -> None:
        self.cells[self.slot * self.SLOT + 1] -= size


def running(pid: int) -> bool:
    """Whether ``pid`` runs (Linux: not gone, not a zombie)."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            return file.read().rpartition(b")")[2].split()[:1] != [b"Z"]
    except OSError:
        return False


class Failing(Exception):
    """A load or a release that fails on purpose."""


async def shared_run(address: str, signals: str, config: Config) -> None:
    """Tasks acquiring keys of honest sizes, under cancellation, load and release failures.

    ``size=`` is the bytes the loader allocates (``SharedBooks``); the releaser
    frees them, except the few releases that fail on purpose, whose bytes stay
    allocated (and quarantined in the books) until the process ends.
    """
    books = SharedBooks(config["memory"], config["slot"])
    rng = random.Random(config["seed"])
    failures_left = config.get("release_failures", 2)

    async def release(key: Hashable, value: Any) -> None:
        nonlocal failures_left
        await anyio.sleep(rng.random() * 0.002)
        if failures_left and rng.random() < 0.05:
            failures_left -= 1
            raise Failing(f"the release of {key!r} fails on purpose")
        books.free(value)

    def loader(size: int) -> Callable[[], Awaitable[int]]:
        async def load() -> int:
            books.allocate(size)
            try:
                await anyio.sleep(rng.random() * 0.003)
                if rng.random() < config.get("load_failures", 0.05):
                    raise Failing("the load fails on purpose")
            except BaseException:
                books.free(size)
                raise
            return size

        return load

    outcomes: Counter[str] = Counter()

    async def task(cache: Cache) -> None:
        for _ in range(config["ops"]):
            key = rng.randrange(config["keys"])
            size = config["sizes"][key % len(config["sizes"])]
            lease = cache.acquire(key, load=loader(size), size=size, timeout=config["timeout"])
            try:
                if rng.random() < config.get("cancel", 0.05):
                    with anyio.move_on_after(0.003) as scope:
                        async with lease:
                            await anyio.sleep(rng.random() * 0.003)
                    outcomes["cancelled" if scope.cancelled_caught else "held"] += 1
                else:
                    async with lease:
                        await anyio.sleep(rng.random() * 0.003)
                    outcomes["held"] += 1
            except Exception as exc:
                outcomes[type(exc).__name__] += 1

    async with Broker.connect(address) as broker:
        async with broker.cache("shared", release) as cache:
            say("started")
            async with anyio.create_task_group() as tg:
                for _ in range(config["tasks"]):
                    tg.start_soon(task, cache)
            say("done", outcomes=dict(outcomes))
    say("closed")


# ------------------------------------------------------------------ main

MODES = {"steps": steps_run, "random": random_run, "memory": memory_run, "shared": shared_run}


def main() -> None:
    backend, address, signals, raw = sys.argv[1:5]
    config = json.loads(raw)
    options = {"use_uvloop": True} if backend == "uvloop" else {}
    anyio.run(
        MODES[config["mode"]],
        address,
        signals,
        config,
        backend="asyncio" if backend == "uvloop" else backend,
        backend_options=options,
    )


if __name__ == "__main__":
    main()
