"""``cache.prefetch``: a load into the cache that holds no lease and is no request.

On every backend. Timing comes from events and ``wait_all_tasks_blocked``; the
only real clock is in the few timeouts. Every broker here checks the books'
invariants after each step of its core.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from cachebroker import (
    FIFO,
    GDSF,
    LRU,
    AcquireTimeout,
    Broker,
    BrokerClosed,
    CostAware,
    DeadlockError,
    InvalidArgument,
    InvalidKey,
    RequestTooLarge,
)
from tests.remote.support import Plugin, serving, until, used, value
from tests.shell.support import Gated, checked, counting, never

pytestmark = pytest.mark.anyio


class Recorder:
    def __init__(self) -> None:
        self.released: list[Hashable] = []

    async def release(self, key: Hashable, value: Any) -> None:
        self.released.append(key)


# ------------------------------------------------------------------ loading


async def test_prefetch_loads_the_value_without_holding_a_lease(kind: str) -> None:
    calls: list[str] = []
    async with checked(kind, budget=100) as broker, broker.cache("p", Recorder()) as cache:
        await cache.prefetch("a", load=counting("A", calls), size=10)
        (entry,) = await broker.entries()
        assert (entry.state, entry.leases, entry.loads, entry.charge) == (
            "ready",
            0,
            1,
            {"default": 10},
        )
        async with cache.acquire("a", load=never, size=10) as lease:
            assert lease.value == "A"
        assert calls == ["A"]
        stats = await broker.stats()
        # The prefetch was no request: the acquire after it is the only one, a hit.
        assert (stats.hits, stats.misses, stats.loads) == (1, 0, 1)


async def test_prefetch_of_a_loaded_key_loads_nothing_and_counts_nothing() -> None:
    async with checked(budget=100) as broker, broker.cache("p", Recorder()) as cache:
        lease = await cache.acquire("a", load=counting("A", []), size=10)
        await cache.prefetch("a", load=never, size=10)  # leased
        assert [(e.state, e.leases) for e in await broker.entries()] == [("ready", 1)]
        await lease.release()
        before = await broker.stats()
        core = broker._core
        entry = cache._entries["a"]
        tick, requests = core.tick, entry.requests
        await cache.prefetch("a", load=never, size=10)  # idle
        after = await broker.stats()
        assert (after.hits, after.misses, after.loads) == (before.hits, before.misses, 1)
        assert (core.tick, entry.requests) == (tick, requests)
        assert [(e.state, e.leases) for e in await broker.entries()] == [("ready", 0)]


async def test_an_acquire_joins_a_prefetch_in_flight(kind: str) -> None:
    load = Gated("A")
    got: list[str] = []
    async with checked(kind, budget=100) as broker, broker.cache("p", Recorder()) as cache:

        async def acquire() -> None:
            async with cache.acquire("a", load=never, size=10) as lease:
                got.append(lease.value)

        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: cache.prefetch("a", load=load, size=10))
            await load.started.wait()
            tg.start_soon(acquire)
            await anyio.wait_all_tasks_blocked()
            assert [(e.state, e.waiting) for e in await broker.entries()] == [("loading", 2)]
            load.open.set()
        assert (got, load.calls) == (["A"], 1)
        stats = await broker.stats()
        assert (stats.hits, stats.misses, stats.loads) == (1, 0, 1)  # the acquire joined


async def test_a_prefetch_joins_an_acquire_in_flight(kind: str) -> None:
    load = Gated("A")
    async with checked(kind, budget=100) as broker, broker.cache("p", Recorder()) as cache:
        held = anyio.Event()
        done = anyio.Event()

        async def acquire() -> None:
            async with cache.acquire("a", load=load, size=10):
                held.set()
                await done.wait()

        async with anyio.create_task_group() as tg:
            tg.start_soon(acquire)
            await load.started.wait()
            prefetched = anyio.Event()

            async def prefetch() -> None:
                await cache.prefetch("a", load=never, size=10)
                prefetched.set()

            tg.start_soon(prefetch)
            await anyio.wait_all_tasks_blocked()
            assert [e.waiting for e in await broker.entries()] == [2]
            load.open.set()
            await prefetched.wait()
            await held.wait()
            # The prefetch gave its lease back; the acquire holds its own.
            assert [(e.leases, e.waiting) for e in await broker.entries()] == [(1, 0)]
            done.set()
        assert load.calls == 1
        assert (await broker.stats()).misses == 1


# ------------------------------------------------------------------ errors


async def test_a_failed_prefetch_raises_the_loaders_exception(kind: str) -> None:
    async def broken() -> Any:
        await anyio.lowlevel.checkpoint()
        raise LookupError("no such weights")

    async with checked(kind, budget=100) as broker, broker.cache("p", Recorder()) as cache:
        with pytest.raises(LookupError, match="no such weights"):
            await cache.prefetch("a", load=broken, size=10)
        assert await broker.entries() == []
        stats = await broker.stats()
        assert (stats.load_failures, stats.used) == (1, {"default": 0})


async def test_a_prefetch_times_out_waiting_for_space_then_for_its_load(kind: str) -> None:
    async with checked(kind, budget=10) as broker, broker.cache("p", Recorder()) as cache:
        held, done = anyio.Event(), anyio.Event()

        async def hold() -> None:
            async with cache.acquire("a", load=counting("A", []), size=10):
                held.set()
                await done.wait()

        async with anyio.create_task_group() as tg:
            tg.start_soon(hold)
            await held.wait()
            with pytest.raises(AcquireTimeout) as timed_out:
                await cache.prefetch("b", load=never, size=10, timeout=0.02)
            assert timed_out.value.waiting_for == "space"
            assert [e.key for e in await broker.entries()] == ["a"]
            done.set()
        stuck = Gated("B")  # (room for it: ``a`` is evicted)
        with pytest.raises(AcquireTimeout) as timed_out:
            await cache.prefetch("b", load=stuck, size=10, timeout=0.02)
        assert timed_out.value.waiting_for == "load"
        await anyio.wait_all_tasks_blocked()
        assert stuck.cancelled  # it was the load's only requester
        assert await broker.entries() == []
        assert (await broker.stats()).used == {"default": 0}


async def test_a_prefetch_is_refused_as_an_acquire_would_be(kind: str) -> None:
    async with checked(kind, budget=10) as broker:
        async with broker.cache("p", Recorder()) as cache:
            with pytest.raises(TypeError, match="load must be a callable"):
                await cache.prefetch("a", load="weights", size=1)  # type: ignore[arg-type]
            with pytest.raises(RequestTooLarge):
                await cache.prefetch("a", load=never, size=11)
            with pytest.raises(InvalidKey):
                await cache.prefetch(["a"], load=never, size=1)  # type: ignore[arg-type]
            with pytest.raises(InvalidArgument):
                await cache.prefetch("a", load=never, size=1, timeout=-1)
            # Only its own lease could make room: a deadlock, not a hang.
            async with cache.acquire("a", load=counting("A", []), size=10):
                with pytest.raises(DeadlockError):
                    await cache.prefetch("b", load=never, size=10)
        with pytest.raises(BrokerClosed, match="cannot prefetch p:'a'"):
            await cache.prefetch("a", load=never, size=1)
        assert await broker.entries() == []


# ------------------------------------------------------------ cancellation


async def test_a_cancelled_prefetch_leaves_the_load_to_the_other_requesters(kind: str) -> None:
    load = Gated("A")
    got: list[str] = []
    async with checked(kind, budget=100) as broker, broker.cache("p", Recorder()) as cache:

        async def acquire() -> None:
            async with cache.acquire("a", load=load, size=10) as lease:
                got.append(lease.value)

        async with anyio.create_task_group() as tg:
            tg.start_soon(acquire)
            await load.started.wait()
            scope = anyio.CancelScope()

            async def prefetch() -> None:
                with scope:
                    await cache.prefetch("a", load=never, size=10)

            tg.start_soon(prefetch)
            await anyio.wait_all_tasks_blocked()
            assert [e.waiting for e in await broker.entries()] == [2]
            scope.cancel()
            await anyio.wait_all_tasks_blocked()
            assert [e.waiting for e in await broker.entries()] == [1]
            load.open.set()
        assert (got, load.calls, load.cancelled) == (["A"], 1, False)


async def test_a_prefetch_cancelled_alone_cancels_its_load(kind: str) -> None:
    load = Gated("A")
    async with checked(kind, budget=100) as broker, broker.cache("p", Recorder()) as cache:
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: cache.prefetch("a", load=load, size=10))
            await load.started.wait()
            tg.cancel_scope.cancel()
        await anyio.wait_all_tasks_blocked()
        assert load.cancelled
        assert await broker.entries() == []
        assert (await broker.stats()).used == {"default": 0}


async def test_a_prefetch_of_a_loaded_key_is_a_checkpoint(kind: str) -> None:
    async with checked(kind, budget=100) as broker, broker.cache("p", Recorder()) as cache:
        await cache.prefetch("a", load=counting("A", []), size=10)
        with anyio.CancelScope() as scope:
            scope.cancel()
            await cache.prefetch("a", load=never, size=10)
        assert scope.cancelled_caught
        assert [e.state for e in await broker.entries()] == ["ready"]


# ------------------------------------------------------------ for the policy


async def test_a_prefetched_entry_is_evicted_by_the_next_request(kind: str) -> None:
    recorder = Recorder()
    async with checked(kind, budget=10) as broker, broker.cache("p", recorder) as cache:
        await cache.prefetch("a", load=counting("A", []), size=10)
        async with cache.acquire("b", load=counting("B", []), size=10) as lease:
            assert lease.value == "B"
        assert recorder.released == ["a"]
        assert (await broker.stats()).releases["capacity"] == 1


async def test_a_prefetch_is_no_request_for_the_policy(kind: str) -> None:
    """GDSF ranks by requests: ``a``, prefetched twice (the second time ready) and never
    acquired, ranks below ``b``, acquired once, and goes first; counted as requests, the
    prefetches would have made ``a`` the more requested and ``b`` the victim."""
    recorder = Recorder()
    async with (
        checked(kind, budget=20, policy=GDSF()) as broker,
        broker.cache("p", recorder) as cache,
    ):
        async with cache.acquire("b", load=counting("B", []), size=10, cost=1.0):
            pass
        await cache.prefetch("a", load=counting("A", []), size=10, cost=1.0)
        await cache.prefetch("a", load=never, size=10, cost=1.0)
        async with cache.acquire("c", load=counting("C", []), size=10, cost=1.0):
            pass
        assert recorder.released == ["a"]


@pytest.mark.parametrize("policy", [LRU, FIFO, GDSF, CostAware])
async def test_prefetches_among_acquires_keep_the_books_exact_under_every_policy(
    policy: type[LRU | FIFO | GDSF | CostAware], kind: str
) -> None:
    """Prefetches of new, loaded and evicted keys among acquires, with evictions at
    every step: every policy takes entries that were never requested, and the
    books add up after each step (``checked``)."""
    recorder = Recorder()
    async with (
        checked(kind, budget=30, policy=policy()) as broker,
        broker.cache("p", recorder) as cache,
    ):
        for i in range(30):
            async with cache.acquire(f"k{i % 5}", load=counting(i, []), size=10):
                pass
            await cache.prefetch(f"p{i}", load=counting(i, []), size=10)
            await cache.prefetch(f"k{(i + 1) % 5}", load=counting(i, []), size=10)
        stats = await broker.stats()
        assert (stats.hits + stats.misses, stats.used["default"]) == (30, 30)
        assert len(recorder.released) == stats.loads - 3


async def test_prefetch_pins_a_new_entry_and_a_loaded_one(kind: str) -> None:
    async with checked(kind, budget=20) as broker, broker.cache("p", Recorder()) as cache:
        await cache.prefetch("a", load=counting("A", []), size=10, pin=True)
        async with cache.acquire("b", load=counting("B", []), size=10):
            pass
        await cache.prefetch("b", load=never, size=10, pin=True)  # idle: pinned now
        assert [(e.key, e.pinned) for e in await broker.entries()] == [("a", True), ("b", True)]
        with pytest.raises(AcquireTimeout):  # neither may be evicted
            await cache.acquire("c", load=never, size=10, timeout=0.02)
        assert await cache.unpin("b")
        async with cache.acquire("c", load=counting("C", []), size=10):
            pass
        assert [e.key for e in await broker.entries()] == ["a", "c"]


async def test_prefetch_sets_the_idle_ttl_of_a_loaded_entry_from_now() -> None:
    now = [0.0]
    recorder = Recorder()
    async with (
        checked(budget=100, clock=lambda: now[0]) as broker,
        broker.cache("p", recorder) as cache,
    ):
        async with cache.acquire("a", load=counting("A", []), size=10):
            pass  # no idle TTL: the end of the lease is not timed
        now[0] = 1000.0
        await cache.prefetch("a", load=never, size=10, idle_ttl=10)
        now[0] = 1005.0
        assert [e.idle_seconds for e in await broker.entries()] == [5.0]
        assert (await broker.evict_idle()).entries == 0
        now[0] = 1010.0
        assert (await broker.evict_idle()).entries == 1
        assert recorder.released == ["a"]


async def test_prefetch_with_idle_ttl_zero_releases_the_value_once_loaded(kind: str) -> None:
    recorder = Recorder()
    async with checked(kind, budget=100) as broker, broker.cache("p", recorder) as cache:
        await cache.prefetch("a", load=counting("A", []), size=10, idle_ttl=0)
        await anyio.wait_all_tasks_blocked()
        assert recorder.released == ["a"]
        assert await broker.entries() == []
        assert (await broker.stats()).releases["idle"] == 1


# ------------------------------------------------------------ Broker.connect


async def test_a_connected_broker_prefetches_through_the_shared_broker() -> None:
    async with serving(budget={"m": 100}) as daemon:
        async with Broker.connect(daemon.address) as one, Broker.connect(daemon.address) as two:
            first = Plugin()
            async with one.cache("w", first) as c1, two.cache("w", Plugin()) as c2:
                await c1.prefetch("a", load=value("A"), size={"m": 60})
                assert [(e.state, e.leases) for e in await one.entries()] == [("ready", 0)]
                await until(lambda: [e["state"] for e in daemon.listing()["entries"]] == ["ready"])
                assert used(daemon) == 60
                stats = await one.stats()
                assert (stats.hits, stats.misses, stats.loads) == (0, 0, 1)
                # Idle in process one: the shared broker has it released there for two.
                async with c2.acquire("b", load=value("B"), size={"m": 60}) as lease:
                    assert lease.value == "B"
                assert first.released == ["a"]
                assert await one.entries() == []
                # A prefetch that the shared broker times out.
                async with c2.acquire("b", load=value("B"), size={"m": 60}):
                    with pytest.raises(AcquireTimeout):
                        await c1.prefetch("c", load=value("C"), size={"m": 60}, timeout=0.05)
                # The timed-out prefetch leaves nothing behind. (Its withdrawal and
                # the end of the lease on "b" cross to the shared broker in either
                # order: "b" may have been released for it meanwhile.)
                await until(
                    lambda: (
                        len(daemon.listing()["entries"]) <= 1
                        and used(daemon) == 60 * len(daemon.listing()["entries"])
                    )
                )
