"""Attacks on tiers, against the memory pools of ``test_tiers_memory``.

Three that try hardest to break the broker: a chain of tiers where a value
parked in the middle tier is asked for while its next demotion waits for
room; a probed device whose allocator gives memory back late; and two tiers
under random acquires, cancellations, invalidations, ``clear()`` and moves
that fail half-way. Then the smaller corners they turned up, each named by
what the broker must do.
"""

from __future__ import annotations

import functools
import random
from collections.abc import AsyncIterator, Hashable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachebroker import (
    AcquireTimeout,
    Broker,
    Cache,
    EvictionReport,
    OutOfSpace,
    ReleaseFailed,
)
from cachebroker._core import check_after_every_step
from cachebroker.probes import Probe
from tests.shell.test_tiers_memory import (
    COST,
    Buffer,
    KiB,
    MoveError,
    Pool,
    Tiered,
    charged,
    exact,
    hold_idle,
    patterns,
    settle,
    states,
    tiered_broker,
    until,
)

pytestmark = pytest.mark.anyio


@asynccontextmanager
async def pooled(
    capacities: Mapping[str, int],
    tiers: Mapping[str, str],
    sizes: Mapping[str, int],
    plugin_type: type[Tiered] = Tiered,
    **options: Any,
) -> AsyncIterator[tuple[Broker, Cache, Tiered]]:
    """``tiered_broker`` for any spaces and tiers: budgets = the pools' capacities."""
    pools = {name: Pool(name, capacity) for name, capacity in capacities.items()}
    plugin = plugin_type(pools, patterns(sizes))
    failures: list[str] = []
    async with Broker(dict(capacities), tiers=tiers, **options) as broker:
        check_after_every_step(broker._core, failures)
        for pool in pools.values():
            pool.booked = functools.partial(charged, broker, pool.name)
        async with broker.cache("m", plugin) as cache:
            yield broker, cache, plugin
        for pool in pools.values():
            pool.booked = None
    assert failures == []
    assert [p.errors for p in pools.values()] == [[] for _ in pools]
    assert plugin.errors == []
    assert all(pool.used == 0 for pool in pools.values()), "leaked"


class SlowRelease(Tiered):
    """Releases of the keys in ``held`` wait for ``gate``."""

    def __init__(self, pools: Mapping[str, Pool], patterns: Mapping[str, bytes]) -> None:
        super().__init__(pools, patterns)
        self.held: set[Hashable] = set()
        self.gate = anyio.Event()

    async def release(self, key: Hashable, buffer: Buffer) -> None:
        if key in self.held:
            await self.gate.wait()
        await super().release(key, buffer)


# -- 1. a chain of tiers: asked for while its next demotion waits for room --------------


async def test_a_value_in_a_middle_tier_is_promoted_even_while_its_next_demotion_waits() -> None:
    sizes = dict.fromkeys("abcd", 60 * KiB)
    async with pooled(
        {"gpu": 100 * KiB, "ram": 100 * KiB, "disk": 100 * KiB},
        {"gpu": "ram", "ram": "disk"},
        sizes,
        SlowRelease,
    ) as (broker, cache, plugin):
        assert isinstance(plugin, SlowRelease)
        for key in "cab":  # c down to ram, then disk; a down to ram
            await hold_idle(cache, plugin, key)
        assert states(broker) == {
            "a": ("demoted", {"ram": 60 * KiB}),
            "b": ("ready", {"gpu": 60 * KiB}),
            "c": ("demoted", {"disk": 60 * KiB}),
        }
        plugin.held.add("c")
        async with anyio.create_task_group() as tg:
            # d's room: b down to ram, whose room is a's, who must go down to disk,
            # whose room is c's: c's release is slow, so a and b wait for room.
            tg.start_soon(hold_idle, cache, plugin, "d")
            await until(lambda: states(broker).get("c", ("",))[0] == "releasing")
            assert states(broker)["a"] == ("moving", {"ram": 60 * KiB})
            got: list[str] = []

            async def want_a() -> None:
                async with cache.acquire("a", load=functools.partial(plugin.load, "a")) as lease:
                    got.append(lease.value.pool.name)

            with anyio.fail_after(5):
                tg.start_soon(want_a)
                await settle()
                plugin.gate.set()  # c goes: everything can move on
        assert got == ["gpu"]  # (got: ["ram"])


# -- 2. a probed device whose allocator gives memory back late ---------------------------


class Lagging(Pool):
    """A device whose frees show only once ``catch_up()`` runs (an asynchronous allocator).

    Until then the freed bytes still count against its capacity, as the
    device would refuse them; ``read()`` is its probe.
    """

    def __init__(self, name: str, capacity: int) -> None:
        super().__init__(name, capacity)
        self.pending = 0
        self.lagging = True

    def free(self, buffer: Buffer) -> None:
        super().free(buffer)
        if self.lagging:
            self.pending += len(buffer.data)

    def catch_up(self) -> None:
        self.pending = 0

    def alloc(self, key: Hashable, size: int) -> Buffer:
        if self.used + self.pending + size > self.capacity:
            self._error(f"{self.name}: {key!r} asks {size} B, {self.pending} B not back yet")
        return super().alloc(key, size)

    def read(self) -> tuple[int, int]:
        return self.capacity, self.capacity - self.used - self.pending


async def device_case(*, demote: bool) -> list[str]:
    """Load "a", then "b" for "a"'s room, freed by a release or a demotion; the device
    shows "a"'s bytes back only once the broker waits for "b"'s room and nothing else
    runs. Returns what the pools refused."""
    sizes = {"a": 60 * KiB, "b": 60 * KiB}
    gpu = Lagging("gpu", 100 * KiB)
    pools = {"gpu": gpu, "ram": Pool("ram", 200 * KiB)}
    plugin = Tiered(pools, patterns(sizes))
    budget: dict[str, Any] = {"gpu": Probe(gpu.read), "ram": 200 * KiB}
    tiers = {"gpu": "ram"} if demote else None
    async with Broker(budget, tiers=tiers, memory_wait=5) as broker:
        async with broker.cache("m", plugin) as cache:
            await hold_idle(cache, plugin, "a")
            async with anyio.create_task_group() as tg:

                async def want_b() -> None:
                    try:
                        await hold_idle(cache, plugin, "b")
                    except Exception as exc:  # the pool refused "b"'s load
                        refused.append(repr(exc))

                refused: list[str] = []
                tg.start_soon(want_b)
                await until(lambda: gpu.pending > 0)  # "a" left the device (not shown yet)
                await settle()
                gpu.catch_up()
            gpu.lagging = False  # (the cache's close need not wait)
            gpu.catch_up()
    assert refused == [] or gpu.errors
    return gpu.errors


async def test_a_release_on_a_probed_space_waits_for_the_memory_to_show() -> None:
    assert await device_case(demote=False) == []


async def test_a_demotion_on_a_probed_space_waits_for_the_memory_to_show() -> None:
    assert await device_case(demote=True) == []


# -- 3. two tiers under everything at once ------------------------------------------------


class Flaky(Tiered):
    """A plugin whose moves fail half-way now and then (``MoveError``)."""

    def __init__(
        self, pools: Mapping[str, Pool], patterns: Mapping[str, bytes], rng: random.Random
    ) -> None:
        super().__init__(pools, patterns)
        self.rng = rng
        self.fail_rate = 0.0

    async def move(self, key: Hashable, buffer: Buffer, to: str) -> Buffer:
        if self.rng.random() < self.fail_rate:
            self.fail_next.add(to)
        return await super().move(key, buffer, to)


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    seed=st.integers(0, 2**32 - 1),
    measured=st.booleans(),
    policy=st.sampled_from(["lru", "fifo", "cost", "gdsf"]),
    fail_rate=st.sampled_from([0.0, 0.05, 0.2]),
)
async def test_chaos_keeps_pools_books_and_data_in_step(
    seed: int, measured: bool, policy: str, fail_rate: float
) -> None:
    """Acquires of random keys with random holds, one in five cancelled at a random
    step; invalidations and ``clear()`` among them; moves failing half-way (their
    entries written off once quiet). The pools never over-allocate, every lease
    sees its data in "gpu", and once quiet each entry is where its buffer is."""
    rng = random.Random(seed)
    gpu, ram = rng.randrange(24, 64) * KiB, rng.randrange(0, 64) * KiB
    sizes = {f"k{i}": rng.randrange(2 * KiB, gpu) for i in range(rng.randrange(3, 12))}
    pools = {"gpu": Pool("gpu", gpu), "ram": Pool("ram", ram)}
    plugin = Flaky(pools, patterns(sizes), rng)
    plugin.fail_rate = fail_rate
    failures: list[str] = []
    async with Broker({"gpu": gpu, "ram": ram}, tiers={"gpu": "ram"}, policy=policy) as broker:
        check_after_every_step(broker._core, failures)
        for pool in pools.values():
            pool.booked = functools.partial(charged, broker, pool.name)
        async with broker.cache("m", plugin) as cache:
            keys = sorted(sizes)

            async def cancel_after(scope: anyio.CancelScope, steps: int) -> None:
                for _ in range(steps):
                    await anyio.lowlevel.checkpoint()
                scope.cancel()

            async def worker(local: random.Random) -> None:
                for _ in range(12):
                    key, action = local.choice(keys), local.random()
                    if action < 0.05:
                        await cache.invalidate(key)
                        continue
                    if action < 0.07:
                        await broker.clear()
                        continue
                    size = len(plugin.patterns[key])
                    declared = min(size + local.randrange(KiB), gpu) if measured else size
                    async with anyio.create_task_group() as tg:
                        with anyio.CancelScope() as scope:
                            if local.random() < 0.2:
                                tg.start_soon(cancel_after, scope, local.randrange(10))
                            try:
                                async with cache.acquire(
                                    key,
                                    load=functools.partial(plugin.load, key),
                                    size={"gpu": declared},
                                    measure=exact if measured else None,
                                    cost=COST,
                                ) as lease:
                                    plugin.leased[lease.value] += 1
                                    try:
                                        plugin.check(key, lease.value)
                                        for _ in range(local.randrange(3)):
                                            await anyio.lowlevel.checkpoint()
                                        plugin.check(key, lease.value)
                                    finally:
                                        plugin.leased[lease.value] -= 1
                            except (ReleaseFailed, OutOfSpace):
                                pass  # a failed move (or what it left) was in the way
                            tg.cancel_scope.cancel()

            async with anyio.create_task_group() as tg:
                for _ in range(rng.randrange(2, 10)):
                    tg.start_soon(worker, random.Random(rng.randrange(2**32)))
            await until(
                lambda: all(
                    e.state in ("ready", "demoted", "quarantined") and not e.waiting
                    for e in broker._entries_now()
                )
            )
            for key in {key for _, key in broker.stats_nowait().quarantined_keys}:
                for buffer in plugin.stranded.pop(key):
                    buffer.pool.free(buffer)
                assert await broker.forget("m", key) >= 1
            assert plugin.stranded == {}
            where = {"gpu": "ready", "ram": "demoted"}
            held = {
                buffer.key: (where[name], {name: len(buffer.data)})
                for name, pool in pools.items()
                for buffer in pool.live
            }
            assert states(broker) == held
            assert dict(broker.stats_nowait().used) == {n: p.used for n, p in pools.items()}
        for pool in pools.values():
            pool.booked = None
    assert failures == []
    assert [p.errors for p in pools.values()] == [[], []]
    assert plugin.errors == []
    assert {name: p.used for name, p in pools.items()} == {"gpu": 0, "ram": 0}


# -- corners --------------------------------------------------------------------------------


async def test_invalidating_a_value_while_it_moves_releases_it_where_it_went() -> None:
    sizes = {"a": 60 * KiB, "b": 60 * KiB, "c": 60 * KiB}
    async with tiered_broker(100 * KiB, 200 * KiB, sizes) as (broker, cache, plugin):
        await hold_idle(cache, plugin, "a")
        await hold_idle(cache, plugin, "b")  # "a" down
        gate = plugin.gates["gpu"] = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(hold_idle, cache, plugin, "a")  # "b" down, "a" up
            await until(lambda: "a" in plugin.moving)
            assert await cache.invalidate("a")  # its requester still gets it, once up
            gate.set()
        del plugin.gates["gpu"]
        await until(lambda: bool(plugin.released))
        assert plugin.released == [("a", "gpu")]  # released once its lease ended
        await hold_idle(cache, plugin, "c")  # room to spare: nothing moves
        gate = plugin.gates["ram"] = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(hold_idle, cache, plugin, "a")  # "c" down, "a" loaded
            await until(lambda: "c" in plugin.moving)
            assert await cache.invalidate("c")
            gate.set()
        await until(lambda: len(plugin.released) == 2)
        assert plugin.released == [("a", "gpu"), ("c", "ram")]  # from where it went
        assert states(broker) == {
            "a": ("ready", {"gpu": 60 * KiB}),
            "b": ("demoted", {"ram": 60 * KiB}),
        }


async def test_closing_the_cache_releases_demoted_values_from_the_lower_tier() -> None:
    sizes = {"a": 60 * KiB, "b": 60 * KiB, "c": 60 * KiB}
    async with tiered_broker(100 * KiB, 200 * KiB, sizes) as (broker, cache, plugin):
        for key in "abc":
            await hold_idle(cache, plugin, key)
        assert sorted(s for s, _ in states(broker).values()) == ["demoted", "demoted", "ready"]
    assert sorted(plugin.released) == [("a", "ram"), ("b", "ram"), ("c", "gpu")]


async def test_a_task_holding_the_room_its_promotion_needs_gets_deadlock_error() -> None:
    from cachebroker import DeadlockError

    sizes = {"x": 60 * KiB, "y": 60 * KiB}
    async with tiered_broker(100 * KiB, 200 * KiB, sizes) as (broker, cache, plugin):
        await hold_idle(cache, plugin, "y")
        await hold_idle(cache, plugin, "x")  # "y" down
        async with cache.acquire("x", load=functools.partial(plugin.load, "x")):
            with pytest.raises(DeadlockError, match="leased by the requesting task itself"):
                await hold_idle(cache, plugin, "y")
        assert states(broker)["y"] == ("demoted", {"ram": 60 * KiB})


async def test_clear_waits_for_and_reports_demoted_entries() -> None:
    sizes = {"a": 60 * KiB, "b": 60 * KiB}
    async with tiered_broker(100 * KiB, 200 * KiB, sizes, release_timeout=None) as (
        broker,
        cache,
        plugin,
    ):
        await hold_idle(cache, plugin, "a")
        await hold_idle(cache, plugin, "b")  # "a" down
        report = await broker.clear()
        assert plugin.released and {key for key, _ in plugin.released} == {"a", "b"}
        assert report == EvictionReport(entries=2, bytes=120 * KiB)


async def test_stats_count_demoted_entries_among_those_holding_memory() -> None:
    sizes = {"a": 60 * KiB, "b": 60 * KiB}
    async with tiered_broker(100 * KiB, 200 * KiB, sizes) as (broker, cache, plugin):
        await hold_idle(cache, plugin, "a")
        await hold_idle(cache, plugin, "b")  # "a" down
        stats = await broker.stats()
        assert stats.used == {"gpu": 60 * KiB, "ram": 60 * KiB}
        assert stats.entries == len(await broker.entries()) == 2


async def test_a_demotion_does_not_restart_the_idle_clock() -> None:
    now = [0.0]
    sizes = {"a": 60 * KiB, "b": 60 * KiB}
    async with tiered_broker(100 * KiB, 200 * KiB, sizes, idle_ttl=10, clock=lambda: now[0]) as (
        broker,
        cache,
        plugin,
    ):
        await hold_idle(cache, plugin, "a")  # idle from 0
        now[0] = 9
        await hold_idle(cache, plugin, "b")  # "a" down at 9
        now[0] = 12  # "a" idle for 12 s, over its 10 s
        report = await broker.evict_idle()
        assert states(broker) == {"b": ("ready", {"gpu": 60 * KiB})}
        assert report.entries == 1


async def test_a_failed_promotion_chains_the_moves_exception_to_its_requesters() -> None:
    sizes = {"a": 60 * KiB, "b": 60 * KiB}
    async with tiered_broker(100 * KiB, 200 * KiB, sizes) as (broker, cache, plugin):
        await hold_idle(cache, plugin, "a")
        await hold_idle(cache, plugin, "b")  # "a" down
        plugin.fail_next.add("gpu")
        with pytest.raises(ReleaseFailed) as info:
            await hold_idle(cache, plugin, "a")
        for buffer in plugin.stranded.pop("a"):
            buffer.pool.free(buffer)
        assert await broker.forget("m", "a") == 1
        chain = []
        error: BaseException | None = info.value
        while error is not None:
            chain.append(type(error))
            error = error.__cause__
        assert MoveError in chain, chain


async def test_a_timeout_waiting_for_a_promotions_room_says_space() -> None:
    sizes = {"x": 60 * KiB, "y": 60 * KiB}
    async with tiered_broker(100 * KiB, 200 * KiB, sizes) as (_, cache, plugin):
        await hold_idle(cache, plugin, "y")
        await hold_idle(cache, plugin, "x")  # "y" down
        held, done = anyio.Event(), anyio.Event()

        async def hold_x() -> None:
            async with cache.acquire("x", load=functools.partial(plugin.load, "x")):
                held.set()
                await done.wait()

        async with anyio.create_task_group() as tg:
            tg.start_soon(hold_x)
            await held.wait()
            try:
                with pytest.raises(AcquireTimeout) as info:
                    await cache.acquire("y", load=functools.partial(plugin.load, "y"), timeout=0.01)
            finally:
                done.set()
        assert info.value.waiting_for == "space", info.value
