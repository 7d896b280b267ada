"""The broker's promises at the edges real applications reach, on every backend.

Each test is a situation an application met: measured sizes under
concurrency, a task that holds one model and asks for another, a loader that
calls back into the cache, a stream of short leases, a lease outliving its
cache or dropped by a dying task, another thread's event loop.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Hashable, MutableMapping
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import pytest

from cachebroker import (
    AcquireTimeout,
    Broker,
    BrokerError,
    Cache,
    DeadlockError,
    InvalidArgument,
    Lease,
    LeasesOutstanding,
    RequestTooLarge,
    WrongEventLoop,
)
from cachebroker.probes import Probe
from tests.brokers import daemon_of, open_broker
from tests.helpers import Recorder, loader, wait_until

pytestmark = pytest.mark.anyio


class Memory:
    """A plugin whose values are real allocations; it tracks what is alive."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self.freed: list[Hashable] = []

    def load(self, size: int) -> Any:
        async def load() -> bytearray:
            self.live += size
            self.peak = max(self.peak, self.live)
            await anyio.lowlevel.checkpoint()
            await anyio.lowlevel.checkpoint()
            return bytearray(size)

        return load

    async def release(self, key: Hashable, value: bytearray) -> None:
        self.live -= len(value)
        self.freed.append(key)


async def once(lease: Lease[Any]) -> None:
    """Acquire ``lease`` and release it at once."""
    async with lease:
        pass


# ------------------------------------------------------------ measured sizes


async def test_measured_sizes_under_concurrency_stay_within_budget_plus_one_model(
    kind: str,
) -> None:
    sizes = {f"m{i}": 64 + 32 * i for i in range(5)}  # 64 .. 192
    plugin = Memory()
    budget = 300
    async with open_broker(kind, budget=budget) as broker, broker.cache("p", plugin) as cache:

        async def use(key: str) -> None:
            async with cache.acquire(key, load=plugin.load(sizes[key]), size=len):
                await anyio.lowlevel.checkpoint()

        async with anyio.create_task_group() as tg:
            for i in range(50):
                tg.start_soon(use, f"m{i % 5}")
        stats = await broker.stats()
        assert stats.used["default"] <= budget
    assert plugin.peak <= budget + max(sizes.values()), plugin.peak


async def test_measure_corrects_a_declared_size_and_is_remembered(kind: str) -> None:
    plugin = Memory()
    async with open_broker(kind, budget=1000) as broker, broker.cache("p", plugin) as cache:
        async with cache.acquire("a", load=plugin.load(300), size=100, measure=len):
            assert (await broker.stats()).used == {"default": 300}
        assert broker.export_sizes() == {"p": {"a": {"default": 300}}}
        await cache.invalidate("a")
        # Remembered across the eviction: reserved before the next load runs.
        async with anyio.create_task_group() as tg:
            gate = anyio.Event()

            async def slow() -> bytearray:
                await gate.wait()
                return bytearray(300)

            tg.start_soon(once, cache.acquire("a", load=slow, measure=len))
            await wait_until(lambda: broker.stats_nowait().loading == 1)
            assert broker.stats_nowait().used == {"default": 300}
            gate.set()
    assert broker.export_sizes() == {"p": {"a": {"default": 300}}}  # after the block, too


async def test_a_measured_size_refused_as_too_large_does_not_become_the_caches_estimate(
    kind: str,
) -> None:
    """A measure in the wrong unit, once: the key is refused, the other unknown loads
    of the cache still share the budget (they do not each reserve all of it)."""
    plugin = Memory()
    async with open_broker(kind, budget=1000) as broker, broker.cache("p", plugin) as cache:
        with pytest.raises(RequestTooLarge, match=r"p:'oops' needs 7\.8 KiB"):
            async with cache.acquire("oops", load=plugin.load(8), measure=lambda v: 8000):
                pass
        for key in ("m1", "m2", "m3"):
            async with cache.acquire(key, load=plugin.load(100), measure=len):
                pass
        assert sorted(str(e.key) for e in await broker.entries()) == ["m1", "m2", "m3"]
        with pytest.raises(RequestTooLarge, match=r"p:'oops' needs 7\.8 KiB"):
            await cache.acquire("oops", load=plugin.load(8), measure=lambda v: 8000)
    assert broker.export_sizes()["p"]["oops"] == {"default": 8000}


@pytest.mark.parametrize(
    ("budget", "settings", "reserved"),
    [
        # A probed space's limit is known once its probe is read, after sizes= are.
        ({"gpu": Probe(lambda: (1000, 1000))}, {}, {"gpu": 400}),
        # Spaces given as one memory are merged after sizes= are: 500 fits the two.
        ({"gpu": 1000, "b": 300}, {"aliases": [["gpu", "b"]]}, {"gpu": 500}),
        # A size beyond the limit is its key's own; the largest within it counts.
        ({"gpu": 1000}, {}, {"gpu": 400}),
    ],
    ids=["probed", "aliased", "oversize"],
)
async def test_a_load_of_unknown_size_reserves_the_largest_size_within_todays_limits(
    budget: dict[str, Any], settings: dict[str, Any], reserved: dict[str, int]
) -> None:
    sizes = {"p": {"big": {"gpu": 400}, "other": {"b": 500}, "oops": {"gpu": 5000}}}
    if "b" not in budget:
        del sizes["p"]["other"]
    async with Broker(budget, sizes=sizes, **settings) as broker:
        async with broker.cache("p", Recorder()) as cache:
            gate = anyio.Event()

            async def slow() -> bytes:
                await gate.wait()
                return b"x"

            async with anyio.create_task_group() as tg:
                tg.start_soon(once, cache.acquire("new", load=slow, measure=lambda v: {"gpu": 1}))
                await wait_until(lambda: broker.stats_nowait().loading == 1)
                (entry,) = await broker.entries()
                assert entry.charge == reserved
                gate.set()


async def test_sizes_exported_by_one_broker_are_reserved_by_the_next(kind: str) -> None:
    """Connected, the process reserves the remembered size at the daemon too."""
    async with open_broker(kind, 1000, sizes={"p": {"a": "200B"}}) as broker:
        daemon = daemon_of(broker)
        async with broker.cache("p", Recorder()) as cache:
            gate = anyio.Event()

            async def slow() -> bytes:
                await gate.wait()
                return b"x" * 200

            async with anyio.create_task_group() as tg:
                tg.start_soon(once, cache.acquire("a", load=slow, size=len))
                await wait_until(lambda: broker.stats_nowait().loading == 1)
                assert broker.stats_nowait().used == {"default": 200}
                if daemon is not None:
                    await wait_until(lambda: daemon.totals()["used"] == {"default": 200})
                gate.set()


@pytest.mark.parametrize(
    ("sizes", "error"),
    [
        ({"p": {"a": "lots"}}, InvalidArgument),
        ({"p": {"a": {"gpu": 10}}}, InvalidArgument),
        ({"p": ["a"]}, TypeError),
        (["p"], TypeError),
    ],
)
def test_bad_sizes_are_refused_with_their_place(sizes: Any, error: type[Exception]) -> None:
    with pytest.raises(error):
        Broker(budget=100, sizes=sizes)


@pytest.mark.parametrize(
    ("sizes", "error"),
    [
        ({"p": {"a": "lots"}}, InvalidArgument),
        ({"p": {"a": {"gpu": 10}}}, InvalidArgument),
        ({"p": ["a"]}, TypeError),
    ],
)
async def test_bad_sizes_of_a_connected_broker_are_refused_when_it_is_entered(
    sizes: Any, error: type[Exception]
) -> None:
    """Checked against the daemon's spaces, which the broker learns on connecting."""
    async with open_broker("connected", 100) as other:
        daemon = daemon_of(other)
        assert daemon is not None
        with pytest.raises(error, match="sizes"):
            async with Broker.connect(daemon.address, sizes=sizes):
                pass
        await wait_until(lambda: len(daemon.connections) == 1)  # (only ``other``'s)


async def test_size_callable_and_measure_together_are_refused(kind: str) -> None:
    async with open_broker(kind, budget=100) as broker, broker.cache("p", Recorder()) as cache:
        with pytest.raises(TypeError, match="either size=callable or measure="):
            cache.acquire("a", load=loader(b"x"), size=len, measure=len)
        with pytest.raises(TypeError, match="measure must be a callable"):
            cache.acquire("a", load=loader(b"x"), measure=3)  # type: ignore[call-overload]


# ---------------------------------------------------- waiting on oneself


async def test_task_holding_a_lease_is_not_queued_behind_a_request_waiting_for_it(
    kind: str,
) -> None:
    """T1 holds A; T2 waits for A's space; T1 asks for B, which fits: no hang."""
    async with open_broker(kind, budget=100) as broker, broker.cache("p", Recorder()) as cache:
        a = await cache.acquire("A", load=loader("a"), size=60)
        async with anyio.create_task_group() as tg:
            tg.start_soon(once, cache.acquire("X", load=loader("x"), size=50))
            await wait_until(lambda: broker.stats_nowait().waiting == 1)
            with anyio.fail_after(5):
                async with cache.acquire("B", load=loader("b"), size=30) as b:
                    assert b.value == "b"
            await a.release()  # now X gets its space


async def test_loader_that_acquires_its_own_key_gets_a_deadlock_error(kind: str) -> None:
    async with open_broker(kind, budget=100) as broker, broker.cache("p", Recorder()) as cache:

        async def helper() -> str:
            async with cache.acquire("a", load=load_a, size=10) as inner:
                return str(inner.value)

        async def load_a() -> str:
            return await helper()

        with anyio.fail_after(5), pytest.raises(DeadlockError, match="p:'a'"):
            await cache.acquire("a", load=load_a, size=10)
        stats = await broker.stats()
        assert (stats.used, stats.loading, stats.waiting) == ({"default": 0}, 0, 0)
        async with cache.acquire("a", load=loader("fine"), size=10) as lease:
            assert lease.value == "fine"


async def test_threaded_loader_calling_back_for_its_own_key_gets_a_deadlock_error(
    kind: str,
) -> None:
    async with open_broker(kind, budget=100) as broker, broker.cache("p", Recorder()) as cache:

        async def inner() -> None:
            await cache.acquire("a", load=loader("x"), size=10)

        def load_a() -> str:
            anyio.from_thread.run(inner)
            return "never"

        with anyio.fail_after(5), pytest.raises(DeadlockError):
            await cache.acquire("a", load=load_a, size=10)
        assert (await broker.stats()).used == {"default": 0}


async def test_loader_may_acquire_other_keys_of_unknown_size(kind: str) -> None:
    async with open_broker(kind, budget=1000) as broker, broker.cache("p", Recorder()) as cache:

        async def load_outer() -> bytes:
            async with cache.acquire("inner", load=loader(b"i" * 10), size=len) as inner:
                return bytes(inner.value * 2)

        with anyio.fail_after(5):
            async with cache.acquire("outer", load=load_outer, size=len) as lease:
                assert len(lease.value) == 20
        assert (await broker.stats()).used == {"default": 30}


# ----------------------------------------------------------------- fairness


async def test_stream_of_short_leases_does_not_starve_a_large_request(kind: str) -> None:
    async with open_broker(kind, budget=100) as broker, broker.cache("p", Recorder()) as cache:
        for key in ("A", "B"):
            await (await cache.acquire(key, load=loader(key), size=50)).release()
        stop = anyio.Event()

        async def hammer(key: str) -> None:
            while not stop.is_set():
                async with cache.acquire(key, load=loader(key), size=50):
                    await anyio.lowlevel.checkpoint()

        async with anyio.create_task_group() as tg:
            for key in ("A", "B", "A", "B"):
                tg.start_soon(hammer, key)
            await anyio.lowlevel.checkpoint()
            with anyio.fail_after(10):
                async with cache.acquire("X", load=loader("x"), size=100) as big:
                    assert big.value == "x"
            stop.set()


# --------------------------------------------- leases outliving their cache


async def test_lease_held_past_its_cache_stays_visible_and_forgettable(kind: str) -> None:
    plugin = Recorder()
    async with open_broker(kind, budget=100, release_timeout=0.05) as broker:
        holder: Any = None
        with pytest.raises(LeasesOutstanding):
            async with broker.cache("p", plugin) as cache:
                holder = await cache.acquire("a", load=loader("v"), size=40)
        stats = await broker.stats()
        assert stats.quarantined_keys == (("p", "a"),)
        assert stats.used == {"default": 40}
        assert holder.value == "v"  # never freed under its holder
        await holder.release()
        assert await broker.forget("p", "a") == 1
        assert (await broker.stats()).used == {"default": 0}
    assert plugin.released == []


async def test_lease_dropped_while_held_warns_and_is_ended(kind: str) -> None:
    async with open_broker(kind, budget=100) as broker, broker.cache("p", Recorder()) as cache:

        async def dies() -> None:
            await cache.acquire("a", load=loader("v"), size=60)
            raise RuntimeError("the task died holding its lease")

        with pytest.warns(ResourceWarning, match="p:'a'"):  # noqa: PT031
            with pytest.raises(RuntimeError):
                await dies()
            gc.collect()
        await wait_until(lambda: broker.stats_nowait().leased == 0)
        # Its bytes are evictable again: a request that needs them is served.
        with anyio.fail_after(5):
            async with cache.acquire("b", load=loader("w"), size=60):
                pass


# ---------------------------------------------------- another thread's loop


@pytest.mark.parametrize("entered", [False, True], ids=["awaited", "entered"])
async def test_cache_used_from_another_threads_event_loop_is_refused(
    kind: str, anyio_backend: tuple[str, dict[str, Any]], entered: bool
) -> None:
    async with open_broker(kind, budget=100) as broker, broker.cache("p", Recorder()) as cache:
        await (await cache.acquire("hit", load=loader(1), size=10)).release()
        errors: list[BaseException] = []

        def other_thread() -> None:
            async def misuse(cache: Cache) -> None:
                for key in ("hit", "miss"):
                    try:
                        if entered:
                            async with cache.acquire(key, load=loader(2), size=10):
                                pass
                        else:
                            await cache.acquire(key, load=loader(2), size=10)
                    except BrokerError as exc:
                        errors.append(exc)
                try:
                    await cache.invalidate("hit")
                except BrokerError as exc:
                    errors.append(exc)

            name, options = anyio_backend
            anyio.run(misuse, cache, backend=name, backend_options=options)

        thread = threading.Thread(target=other_thread)
        thread.start()
        await anyio.to_thread.run_sync(thread.join)
        assert [type(e) for e in errors] == [WrongEventLoop] * 3
        assert "another thread" in str(errors[0])
        stats = await broker.stats()
        assert (stats.hits, stats.misses, stats.leased) == (0, 1, 0)


async def test_lease_released_from_another_thread_is_ended_on_the_loop(kind: str) -> None:
    async with open_broker(kind, budget=100) as broker, broker.cache("p", Recorder()) as cache:
        lease = await cache.acquire("a", load=loader(1), size=60)

        def release_there() -> None:
            anyio.run(lease.release)

        await anyio.to_thread.run_sync(release_there)
        await wait_until(lambda: broker.stats_nowait().leased == 0)
        with anyio.fail_after(5):
            async with cache.acquire("b", load=loader(2), size=60):
                pass


async def test_acquire_times_out_while_its_own_request_is_the_only_waiter(kind: str) -> None:
    """A timeout leaves nothing behind, even for a request that waited at the gate."""
    async with open_broker(kind, budget=100) as broker, broker.cache("p", Recorder()) as cache:
        gate = anyio.Event()

        async def slow() -> bytes:
            await gate.wait()
            return b"x"

        async with anyio.create_task_group() as tg:
            tg.start_soon(once, cache.acquire("first", load=slow, size=len))
            await wait_until(lambda: broker.stats_nowait().loading == 1)
            with pytest.raises(AcquireTimeout):
                await cache.acquire("second", load=loader(b"y"), size=len, timeout=0.05)
            broker._core.check()
            gate.set()
        broker._core.check()
        assert (await broker.stats()).waiting == 0


async def test_loop_of_hits_lets_other_tasks_run_on_trio(
    kind: str,
    anyio_backend: tuple[str, dict[str, Any]],
) -> None:
    """trio: every async operation is a checkpoint; a hit is a schedule point now and then."""
    if anyio_backend[0] != "trio":
        pytest.skip("asyncio: an uncontended hit completes without suspending, by design")
    async with open_broker(kind, budget=100) as broker, broker.cache("p", Recorder()) as cache:
        await (await cache.acquire("k", load=loader(1), size=10)).release()
        ticks = 0
        done = False

        async def sibling() -> None:
            nonlocal ticks
            while not done:
                ticks += 1
                await anyio.lowlevel.checkpoint()

        async with anyio.create_task_group() as tg:
            tg.start_soon(sibling)
            await anyio.lowlevel.checkpoint()
            before = ticks
            for _ in range(20_000):
                async with cache.acquire("k", load=loader(1), size=10):
                    pass
            during = ticks - before
            done = True
        assert during >= 20_000 // 32 - 1, during


# ------------------------------------------------------- blocking releases


async def test_releaser_that_blocks_the_loop_is_reported(
    kind: str,
    events: list[MutableMapping[str, Any]],
) -> None:
    class Blocking:
        async def release(self, key: Hashable, value: Any) -> None:
            await anyio.lowlevel.checkpoint()
            time.sleep(0.06)  # noqa: ASYNC251 - a gc.collect() or device sync on the loop

    async with open_broker(kind, budget=100, blocking_warning=0.05) as broker:
        async with broker.cache("p", Blocking()) as cache:
            await (await cache.acquire("a", load=loader(1), size=10)).release()
            await cache.invalidate("a")
            assert (await broker.stats()).releases_blocking == 1
    (warning,) = [e for e in events if e["event"] == "cachebroker.release.blocking"]
    assert (warning["cache"], warning["key"], warning["log_level"]) == ("p", "a", "warning")
    assert warning["seconds"] >= 0.06


async def test_releaser_that_yields_is_not_reported(
    kind: str,
    events: list[MutableMapping[str, Any]],
) -> None:
    class Yielding:
        async def release(self, key: Hashable, value: Any) -> None:
            for _ in range(100):
                await anyio.lowlevel.checkpoint()

    async with open_broker(kind, budget=100, blocking_warning=1.0) as broker:
        async with broker.cache("p", Yielding()) as cache:
            await (await cache.acquire("a", load=loader(1), size=10)).release()
            await cache.invalidate("a")
            assert (await broker.stats()).releases_blocking == 0
    assert not [e for e in events if e["event"] == "cachebroker.release.blocking"]


# ---------------------------------------------------------- forgotten leases


async def test_lease_held_long_while_requests_wait_is_reported(
    events: list[MutableMapping[str, Any]],
) -> None:
    # (In-process: connected, the daemon reports it, naming the process: test_remote_pins.py.)
    now = [0.0]
    async with Broker(budget=100, clock=lambda: now[0], lease_warning=0.4) as broker:
        async with broker.cache("p", Recorder()) as cache:
            forgotten = await cache.acquire("a", load=loader(1), size=60)
            async with anyio.create_task_group() as tg:
                tg.start_soon(once, cache.acquire("b", load=loader(2), size=60))
                await wait_until(lambda: forgotten._entry in broker._runner.held_leases.held)
                assert not [e for e in events if e["event"] == "cachebroker.lease.held"]
                now[0] += 1.0  # the sweeper checks every lease_warning / 4 (real) seconds
                await wait_until(
                    lambda: any(e["event"] == "cachebroker.lease.held" for e in events)
                )
                await forgotten.release()
    (held,) = [e for e in events if e["event"] == "cachebroker.lease.held"]
    assert (held["cache"], held["key"], held["log_level"]) == ("p", "a", "warning")
    assert held["seconds"] >= 0.4 and held["waiting"] == 1
    assert len(held["holders"]) == 1 and isinstance(held["holders"][0], str)
