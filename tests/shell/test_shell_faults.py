"""Faults of the plugin's code and of the devices, on every backend.

Worker threads that outlive their cache, ``CancelledError`` raised by a
library rather than by the broker, process-level exceptions (``KeyboardInterrupt``,
``SystemExit``, ...) and probes whose read fails once: the broker keeps its
books exact and the application running, or lets the process-level event
through with the books exact.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Hashable, Iterator, MutableMapping
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from cachebroker import Broker, BrokerClosed, BrokerError, Cache, LoadFailed
from cachebroker._core import Request, State
from cachebroker.probes import Probe
from tests.brokers import open_broker
from tests.harness import Harness
from tests.helpers import Recorder, loader, plugin_name, wait_until

Events = list[MutableMapping[str, Any]]


def logged(events: Events, name: str) -> list[MutableMapping[str, Any]]:
    # (the process's own: a daemon in this loop logs its books too, under "p@pid")
    return [e for e in events if e["event"] == name and "@" not in str(e.get("cache", ""))]


class Sibling:
    """An unrelated task of the application: it must run to its end."""

    def __init__(self) -> None:
        self.go = anyio.Event()
        self.finished = False

    async def __call__(self) -> None:
        await self.go.wait()
        self.finished = True


# ------------------------------------------------ threads that outlive their cache


class BlockedLoader:
    """A plain loader that blocks its worker thread until ``finish()``.

    It gives up after ``GUARD`` seconds, so that a broker that waits for it
    (the defect under test) cannot hang the test run.
    """

    GUARD = 10.0

    def __init__(self, value: Any = "made in a thread") -> None:
        self.value = value
        self.error: BaseException | None = None
        self.started = threading.Event()
        self.gate = threading.Event()
        self.returned = threading.Event()

    def __call__(self) -> Any:
        self.started.set()
        try:
            self.gate.wait(self.GUARD)
            if self.error is not None:
                raise self.error
            return self.value
        finally:
            self.returned.set()

    def finish(self) -> None:
        self.gate.set()


@pytest.fixture
def blocked() -> Iterator[BlockedLoader]:
    """A blocked thread loader, let go (and its thread ended) at teardown."""
    load = BlockedLoader()
    try:
        yield load
    finally:
        load.finish()
        assert load.returned.wait(BlockedLoader.GUARD + 5)


class ValueRecorder(Recorder):
    """A Recorder that also keeps the values it was asked to free."""

    def __init__(self) -> None:
        super().__init__()
        self.values: list[Any] = []

    async def release(self, key: Hashable, value: Any) -> None:
        self.values.append(value)
        await super().release(key, value)


async def leave_a_threaded_load_running(cache: Cache, load: BlockedLoader, size: int) -> None:
    """Request ``"k"`` from ``load`` and withdraw once its thread runs."""

    async def request() -> None:
        await cache.acquire("k", load=load, size=size)

    async with anyio.create_task_group() as tg:
        tg.start_soon(request)
        await wait_until(load.started.is_set)
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_threaded_load_running_when_its_cache_closes_is_released_when_it_returns(
    kind: str, blocked: BlockedLoader, events: Events
) -> None:
    plugin = ValueRecorder()
    async with open_broker(kind, budget=100, release_timeout=0.2) as broker:
        with anyio.fail_after(5):
            token = plugin_name.set("whisper")
            async with broker.cache("p", plugin) as cache:
                plugin_name.reset(token)  # the block keeps the context it was opened in
                await leave_a_threaded_load_running(cache, blocked, 60)
        assert not blocked.returned.is_set()  # the exit did not wait for the thread
        stats = await broker.stats()
        assert (stats.entries, stats.releasing, stats.used) == (1, 1, {"default": 60})
        assert [(e.cache, e.key, e.state) for e in broker._core.entries()] == [
            ("p", "k", State.RELEASING)
        ]
        broker._core.check()
        blocked.finish()
        await wait_until(lambda: broker.stats_nowait().used == {"default": 0})
        assert plugin.values == ["made in a thread"]  # released through the plugin
        assert plugin.contexts == ["whisper"]  # in the plugin's own context
        assert broker.stats_nowait().entries == 0
        broker._core.check()
    freed = logged(events, "cachebroker.release.freed")
    assert [(e["key"], e["late"]) for e in freed] == [("k", False)]


@pytest.mark.anyio
async def test_broker_exit_is_bounded_by_a_threaded_load_that_never_returns(
    kind: str, blocked: BlockedLoader, events: Events
) -> None:
    plugin = Recorder()
    with anyio.fail_after(5):
        async with open_broker(kind, budget=100, release_timeout=0.2) as broker:
            async with broker.cache("p", plugin) as cache:
                await leave_a_threaded_load_running(cache, blocked, 60)
    assert not blocked.returned.is_set()  # neither exit waited for the thread
    stats = broker.stats_nowait()
    assert stats.quarantined_keys == (("p", "k"),)  # nobody is left to release it
    assert (stats.used, stats.releasing) == ({"default": 60}, 0)
    assert plugin.released == []
    broker._core.check()
    failed = logged(events, "cachebroker.release.failed")
    assert [e["key"] for e in failed] == ["k"]
    assert "closed before the threaded load" in failed[0]["error"]


@pytest.mark.anyio
async def test_threaded_load_failing_after_its_cache_closed_gives_its_bytes_back(
    kind: str, blocked: BlockedLoader, events: Events
) -> None:
    plugin = Recorder()
    blocked.error = RuntimeError("CUDA error: out of memory")
    async with open_broker(kind, budget=100, release_timeout=0.2) as broker:
        with anyio.fail_after(5):
            async with broker.cache("p", plugin) as cache:
                await leave_a_threaded_load_running(cache, blocked, 60)
        assert not blocked.returned.is_set()
        assert broker.stats_nowait().used == {"default": 60}
        blocked.finish()
        await wait_until(lambda: broker.stats_nowait().used == {"default": 0})
        stats = await broker.stats()
        assert (stats.entries, stats.quarantined) == (0, 0)
        assert plugin.released == []  # nothing was made: nothing to free
    failed = logged(events, "cachebroker.load.failed")
    assert "out of memory" in failed[-1]["error"]


@pytest.mark.anyio
async def test_abandoning_a_threaded_load_is_no_out_of_memory_error(
    kind: str, blocked: BlockedLoader
) -> None:
    async with open_broker(kind, budget=100, release_timeout=0.2, oom_errors=Exception) as broker:
        with anyio.fail_after(5):
            async with broker.cache("p", Recorder()) as cache:
                await leave_a_threaded_load_running(cache, blocked, 60)
        stats = await broker.stats()
        assert (stats.releasing, stats.used, stats.load_failures) == (1, {"default": 60}, 0)
        broker._core.check()
        blocked.finish()
        await wait_until(lambda: broker.stats_nowait().used == {"default": 0})


@pytest.mark.anyio
async def test_threaded_load_whose_requesters_left_keeps_its_value(kind: str) -> None:
    """Unchanged by abandoning threads on close: only the cache closing gives a thread up."""
    load = BlockedLoader("kept")
    async with open_broker(kind, budget=100) as broker, broker.cache("p", Recorder()) as cache:
        with pytest.raises(TimeoutError):
            await cache.acquire("k", load=load, size=60, timeout=0.05)
        load.finish()
        await wait_until(lambda: broker.stats_nowait().ready == 1)
        async with cache.acquire("k", load=loader("reloaded"), size=60) as lease:
            assert lease.value == "kept"


def test_abandoned_load_stays_charged_and_listed_until_its_release() -> None:
    """Core: an abandoned load holds its bytes as ``releasing`` but not its owner's close."""
    h = Harness({"m": 100})
    other = h.core.open_owner("q")
    orphan = h.acquire("a", 60).entry
    h.core.close_owner(h.owner, BrokerClosed("closed"))
    h.drain()
    assert h.cancelled == [orphan]
    h.core.load_abandoned(orphan)
    h.drain()
    assert orphan.state is State.RELEASING
    assert orphan not in h.owner.live and "a" not in h.owner.entries
    assert list(h.core.entries()) == [orphan]
    assert (h.used(), h.core.spaces["m"].releasing) == (60, 60)
    h.core.check()
    waiter = h.core.request(other, Request("b", {"m": 80}), "t")
    h.drain()
    assert waiter.entry.state is State.WAITING  # its bytes are not free yet
    h.core.release_done(orphan)
    h.drain()
    assert waiter.entry.state is State.LOADING
    assert orphan not in h.core.orphans
    h.core.check()


# --------------------------------------------- CancelledError that is not the broker's


@pytest.mark.anyio
async def test_foreign_cancelled_error_in_loader_is_a_failed_load(kind: str) -> None:
    calls: list[int] = []

    async def load() -> str:
        calls.append(1)
        await anyio.lowlevel.checkpoint()
        if len(calls) == 1:
            raise asyncio.CancelledError()  # a library's own, not the broker's
        return "loaded"

    sibling = Sibling()
    reached_the_end = False
    async with open_broker(kind, budget=100) as broker, anyio.create_task_group() as app:
        app.start_soon(sibling)
        async with broker.cache("p", Recorder()) as cache:
            with pytest.raises(LoadFailed, match=r"loading p:'k' raised CancelledError") as info:
                await cache.acquire("k", load=load, size=10)
            assert isinstance(info.value, BrokerError)
            assert isinstance(info.value.__cause__, asyncio.CancelledError)
            stats = await broker.stats()  # a checkpoint: the cache body was not cancelled
            assert (stats.used, stats.load_failures, stats.entries) == ({"default": 0}, 1, 0)
            async with cache.acquire("k", load=load, size=10) as lease:
                assert lease.value == "loaded"
            assert len(calls) == 2  # loaded again
            broker._core.check()
            reached_the_end = True
        sibling.go.set()
    assert reached_the_end and sibling.finished


@pytest.mark.anyio
async def test_loader_awaiting_a_future_cancelled_elsewhere_fails_only_its_load(
    kind: str,
    anyio_backend_name: str,
) -> None:
    if anyio_backend_name != "asyncio":
        pytest.skip("an asyncio future")

    async def load() -> str:
        future = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_soon(future.cancel)  # e.g. a client's connection pool
        result: str = await future
        return result

    sibling = Sibling()
    async with open_broker(kind, budget=100) as broker, anyio.create_task_group() as app:
        app.start_soon(sibling)
        async with broker.cache("p", Recorder()) as cache:
            with pytest.raises(LoadFailed):
                await cache.acquire("k", load=load, size=10)
            await anyio.lowlevel.checkpoint()
            assert (await broker.stats()).used == {"default": 0}
        sibling.go.set()
    assert sibling.finished


@pytest.mark.anyio
async def test_foreign_cancelled_error_in_releaser_is_a_failed_release(
    kind: str, events: Events
) -> None:
    async def release(key: str, value: Any) -> None:
        await anyio.lowlevel.checkpoint()
        raise asyncio.CancelledError()  # a library's own, not the broker's

    sibling = Sibling()
    reached_the_end = False
    async with open_broker(kind, budget=100) as broker, anyio.create_task_group() as app:
        app.start_soon(sibling)
        async with broker.cache("p", release) as cache:
            async with cache.acquire("k", load=loader("v"), size=10):
                pass
            assert await cache.invalidate("k") is True
            stats = await broker.stats()
            assert stats.quarantined_keys == (("p", "k"),)
            assert (stats.used, stats.releasing) == ({"default": 10}, 0)
            async with cache.acquire("k", load=loader("again"), size=10) as lease:
                assert lease.value == "again"
            reached_the_end = True
        sibling.go.set()
    assert reached_the_end and sibling.finished
    failed = logged(events, "cachebroker.release.failed")
    assert failed[0]["key"] == "k" and "CancelledError" in failed[0]["error"]


# ------------------------------------------------------- process-level exceptions


class Meltdown(BaseException):
    """A process-level exception of the application's own."""


PROCESS_LEVEL = [KeyboardInterrupt, SystemExit, GeneratorExit, Meltdown]


def run_raising(
    anyio_backend: tuple[str, dict[str, Any]],
    main: Callable[[], Awaitable[None]],
    kind: type[BaseException],
) -> float:
    """Run ``main`` in a fresh event loop; check that ``kind`` came out; return the seconds taken.

    A fresh loop, because on asyncio ``KeyboardInterrupt`` and ``SystemExit``
    raised in any task stop the loop itself. ``kind`` comes out bare, never in
    an exception group (docs/failure-semantics.md, "Exceptions").
    """
    backend, options = anyio_backend
    started = time.monotonic()
    with pytest.raises(kind):
        anyio.run(main, backend=backend, backend_options=options)
    return time.monotonic() - started


def loop_survives(anyio_backend: tuple[str, dict[str, Any]], kind: type[BaseException]) -> bool:
    """Whether tasks still run after ``kind`` left one (asyncio stops for these two)."""
    return anyio_backend[0] == "trio" or kind not in (KeyboardInterrupt, SystemExit)


async def request_shielded(cache: Cache, got: list[BaseException], **acquire: Any) -> None:
    """Acquire ``"k"`` where the cache's teardown cannot cancel it: what does it get?"""
    with anyio.fail_after(5, shield=True):
        try:
            await cache.acquire("k", **acquire)
        except BrokerError as exc:
            got.append(exc)


@pytest.mark.parametrize("kind", PROCESS_LEVEL)
@pytest.mark.parametrize("threaded", [False, True], ids=["async", "thread"])
def test_process_level_exception_from_a_loader_propagates_and_fails_the_load(
    anyio_backend: tuple[str, dict[str, Any]], kind: type[BaseException], threaded: bool
) -> None:
    broker = Broker(budget=100, release_timeout=30)
    got: list[BaseException] = []

    async def load() -> str:
        await anyio.lowlevel.checkpoint()
        raise kind()

    def load_in_thread() -> str:
        raise kind()

    async def main() -> None:
        with anyio.fail_after(5):
            async with broker, broker.cache("p", Recorder()) as cache:
                chosen = load_in_thread if threaded else load
                await request_shielded(cache, got, load=chosen, size=60)

    elapsed = run_raising(anyio_backend, main, kind)
    broker._core.check()
    stats = broker.stats_nowait()
    assert (stats.used, stats.loading, stats.load_failures) == ({"default": 0}, 0, 1)
    if loop_survives(anyio_backend, kind):
        assert isinstance(got[0], LoadFailed) and isinstance(got[0].__cause__, kind)
    assert elapsed < 15  # a generous bound against the exit waiting release_timeout (30 s)


@pytest.mark.parametrize("kind", PROCESS_LEVEL)
def test_process_level_exception_from_a_size_callable_propagates_and_fails_the_load(
    anyio_backend: tuple[str, dict[str, Any]], kind: type[BaseException]
) -> None:
    broker = Broker(budget=100, release_timeout=30)
    got: list[BaseException] = []

    def measure(value: object) -> int:
        raise kind()

    async def main() -> None:
        with anyio.fail_after(5):
            async with broker, broker.cache("p", Recorder()) as cache:
                await request_shielded(cache, got, load=loader("v"), size=measure)

    elapsed = run_raising(anyio_backend, main, kind)
    broker._core.check()
    stats = broker.stats_nowait()
    assert (stats.loading, stats.releasing) == (0, 0)
    assert stats.quarantined_keys == (("p", "k"),)  # nobody has time to release it
    if loop_survives(anyio_backend, kind):
        assert isinstance(got[0], LoadFailed) and isinstance(got[0].__cause__, kind)
    assert elapsed < 15


@pytest.mark.parametrize("kind", PROCESS_LEVEL)
def test_process_level_exception_from_a_releaser_propagates_and_quarantines_the_entry(
    anyio_backend: tuple[str, dict[str, Any]], kind: type[BaseException]
) -> None:
    broker = Broker(budget=100, release_timeout=30)

    async def release(key: str, value: Any) -> None:
        await anyio.lowlevel.checkpoint()
        raise kind()

    async def main() -> None:
        with anyio.fail_after(5):
            async with broker, broker.cache("p", release) as cache:
                async with cache.acquire("k", load=loader("v"), size=60):
                    pass  # left idle: released when the cache closes

    elapsed = run_raising(anyio_backend, main, kind)
    broker._core.check()
    stats = broker.stats_nowait()
    assert stats.quarantined_keys == (("p", "k"),)
    assert (stats.used, stats.releasing) == ({"default": 60}, 0)
    assert elapsed < 15


# ------------------------------------------------------------ probes that fail


class FlakyDevice:
    """A device's ``(total, free)`` bytes, whose reads fail while told to."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.free = total
        self.reads = 0
        self.failing = False
        #: Ordinals (``reads`` after the read) of single reads that fail.
        self.fail_on: set[int] = set()

    def read(self) -> tuple[int, int]:
        self.reads += 1
        if self.failing or self.reads in self.fail_on:
            raise OSError("NVML_ERROR_UNKNOWN: an unexpected error")
        return self.total, self.free

    def load(self, key: str, size: int) -> Callable[[], Awaitable[str]]:
        async def load() -> str:
            await anyio.lowlevel.checkpoint()
            self.free -= size
            return key

        return load


class DeviceReleaser:
    """Frees on the device what it is asked to release."""

    def __init__(self, device: FlakyDevice, sizes: dict[str, int]) -> None:
        self.device = device
        self.sizes = sizes
        self.freed: list[str] = []

    async def release(self, key: str, value: Any) -> None:
        await anyio.lowlevel.checkpoint()
        self.device.free += self.sizes[key]
        self.freed.append(key)


@pytest.mark.anyio
async def test_probe_failing_on_the_timer_keeps_the_last_good_reading(events: Events) -> None:
    device = FlakyDevice(1000)
    broker = Broker(budget={"gpu": Probe(device.read)}, probe_interval=0.01)
    async with broker, broker.cache("p", DeviceReleaser(device, {"k": 100})) as cache:
        assert (await broker.stats()).budget == {"gpu": 1000}
        device.free = 400  # what the failing reads would have shown
        device.failing = True
        await wait_until(lambda: len(logged(events, "cachebroker.probe.failed")) >= 2)
        assert broker.stats_nowait().budget == {"gpu": 1000}  # the last good reading stands
        device.failing = False
        await wait_until(lambda: broker.stats_nowait().budget == {"gpu": 400})
        async with cache.acquire("k", load=device.load("k", 100), size={"gpu": 100}) as lease:
            assert lease.value == "k"
    failed = logged(events, "cachebroker.probe.failed")[0]
    assert (failed["log_level"], failed["space"]) == ("warning", "gpu")
    assert "NVML_ERROR_UNKNOWN" in failed["error"]


@pytest.mark.anyio
async def test_probe_failing_before_its_first_reading_counts_the_space_as_full(
    events: Events,
) -> None:
    device = FlakyDevice(1000)
    device.fail_on = {1}
    broker = Broker(budget={"gpu": Probe(device.read)}, probe_interval=3600)
    assert broker.stats_nowait().budget == {"gpu": 0}  # full: nothing fits until a good read
    assert len(logged(events, "cachebroker.probe.failed")) == 1
    async with broker, broker.cache("p", DeviceReleaser(device, {"k": 100})) as cache:
        async with cache.acquire("k", load=device.load("k", 100), size={"gpu": 100}):
            assert broker.stats_nowait().budget == {"gpu": 1000}  # read again before the miss


@pytest.mark.anyio
async def test_probe_failing_before_a_release_skips_only_the_memory_wait(
    events: Events,
) -> None:
    device = FlakyDevice(1000)
    plugin = DeviceReleaser(device, {"a": 600, "b": 600})
    broker = Broker(budget={"gpu": Probe(device.read)}, memory_wait=30, probe_interval=3600)
    async with broker, broker.cache("p", plugin) as cache:
        async with cache.acquire("a", load=device.load("a", 600), size={"gpu": 600}):
            pass
        device.fail_on = {device.reads + 1}  # the read of the free bytes before the release
        with anyio.fail_after(5):
            assert await cache.invalidate("a") is True
        stats = await broker.stats()
        assert (stats.used, stats.releasing, stats.quarantined) == ({"gpu": 0}, 0, 0)
        assert plugin.freed == ["a"]
        async with cache.acquire("b", load=device.load("b", 600), size={"gpu": 600}):
            assert broker.stats_nowait().budget == {"gpu": 1000}  # good readings again
    assert logged(events, "cachebroker.probe.failed")


@pytest.mark.anyio
async def test_probe_failing_while_waiting_for_released_memory_stops_the_wait(
    events: Events,
) -> None:
    device = FlakyDevice(1000)
    leaky = Recorder()  # frees nothing on the device: the wait would last memory_wait
    broker = Broker(budget={"gpu": Probe(device.read)}, memory_wait=30, probe_interval=3600)
    async with broker, broker.cache("p", leaky) as cache:
        async with cache.acquire("a", load=device.load("a", 600), size={"gpu": 600}):
            pass
        device.fail_on = {device.reads + 2}  # the first read while waiting for the memory
        with anyio.fail_after(5):
            assert await cache.invalidate("a") is True
        stats = await broker.stats()
        assert (stats.used, stats.releasing, stats.quarantined) == ({"gpu": 0}, 0, 0)
    assert logged(events, "cachebroker.probe.failed")
    assert not logged(events, "cachebroker.release.memory_slow")
