"""Tiers against real memory: two pools of buffers stand in for a GPU's memory and the host's.

A ``Pool`` hands out ``bytearray`` buffers and refuses (``OverAllocated``)
to go beyond its capacity, or beyond what the broker charges its space at
that moment: the broker charges a load, a move's destination and a value
being released before the plugin touches the memory, and discharges them
only once the plugin has freed it, so what a pool holds never exceeds the
broker's books for its space. The plugin's values are buffers in the "gpu"
pool; its ``move`` allocates in the destination pool, copies and frees the
source (so a moving value is in both pools, as the broker assumes); its
``release`` frees. Every value carries its key's pattern, checked at every
lease: a round trip down a tier and back must not lose a byte.

Budgets equal the pools' capacities. Loads declare a reload cost (``COST``)
far above what a move takes, so that whether a value is demoted or released
depends on room and policy, not on how fast the machine ran a move. Every
broker checks its books' invariants after each step of its core. On every
backend; no sleeps: tasks wait on events, or let the others run (``settle``).
Then the attacks: a chain of tiers, a device that frees late, random churn
with failing moves, and the corners they turned up.
"""

from __future__ import annotations

import functools
import random
from collections import Counter
from collections.abc import AsyncIterator, Callable, Hashable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachebroker import (
    AcquireTimeout,
    Broker,
    Cache,
    EntryInfo,
    EvictionReport,
    OutOfSpace,
    ReleaseFailed,
)
from cachebroker._core import check_after_every_step
from cachebroker.probes import Probe
from tests.brokers import open_broker

pytestmark = pytest.mark.anyio

KiB = 1024
#: Seconds a load stands for (``acquire(cost=)``): a promotion is always quicker.
COST = 1.0


class OverAllocated(Exception):
    """A pool was asked for more than it holds, or than the broker charges its space."""


class Buffer:
    """A value's memory: ``data`` in ``pool``, for ``key``."""

    __slots__ = ("data", "key", "pool")

    def __init__(self, pool: Pool, key: Hashable, size: int) -> None:
        self.pool = pool
        self.key = key
        self.data = bytearray(size)


class Pool:
    """A memory of ``capacity`` bytes: it allocates buffers and counts what they hold."""

    def __init__(self, name: str, capacity: int) -> None:
        self.name = name
        self.capacity = capacity
        self.used = 0
        self.peak = 0
        self.live: set[Buffer] = set()
        #: What the broker charges this space now, read at every allocation.
        self.booked: Callable[[], int] | None = None
        #: Every refusal and double free, also raised where it happened.
        self.errors: list[str] = []

    def alloc(self, key: Hashable, size: int) -> Buffer:
        booked = None if self.booked is None else self.booked()
        if self.used + size > self.capacity:
            self._error(f"{self.name}: {key!r} asks {size} B, {self.used} of {self.capacity} used")
        if booked is not None and self.used + size > booked:
            self._error(
                f"{self.name}: {key!r} asks {size} B beyond the broker's books "
                f"({self.used} used, {booked} charged)"
            )
        buffer = Buffer(self, key, size)
        self.live.add(buffer)
        self.used += size
        self.peak = max(self.peak, self.used)
        return buffer

    def free(self, buffer: Buffer) -> None:
        if buffer not in self.live:
            self._error(f"{self.name}: {buffer.key!r} freed twice, or in the wrong pool")
        self.live.remove(buffer)
        self.used -= len(buffer.data)

    def holding(self) -> dict[Hashable, int]:
        """Bytes per key (each key holds one buffer here once the broker is quiet)."""
        held: Counter[Hashable] = Counter()
        for buffer in self.live:
            held[buffer.key] += len(buffer.data)
        return dict(held)

    def _error(self, message: str) -> None:
        self.errors.append(message)
        raise OverAllocated(message)


class MoveError(Exception):
    """The plugin's move failed half-way: the value is in both pools."""


class Tiered:
    """A plugin whose values are buffers: loaded in "gpu", moved between pools, freed on release."""

    def __init__(self, pools: Mapping[str, Pool], patterns: Mapping[str, bytes]) -> None:
        self.pools = pools
        self.patterns = patterns
        #: Leases held on each value, kept by the tasks that hold them.
        self.leased: Counter[Buffer] = Counter()
        self.loads: list[Hashable] = []
        self.moves: list[tuple[Hashable, str, str]] = []
        self.released: list[tuple[Hashable, str]] = []
        #: The broker broke the plugin's contract: a value moved or freed while leased...
        self.errors: list[str] = []
        #: Spaces whose next move there fails half-way (both buffers kept, in
        #: ``stranded`` under their key, for whoever writes the entry off).
        self.fail_next: set[str] = set()
        self.stranded: dict[Hashable, list[Buffer]] = {}
        #: A move to a space waits for its gate, if it has one; ``moving``: started, by key.
        self.gates: dict[str, anyio.Event] = {}
        self.moving: dict[Hashable, anyio.Event] = {}

    async def load(self, key: str) -> Buffer:
        pattern = self.patterns[key]
        buffer = self.pools["gpu"].alloc(key, len(pattern))
        try:
            await anyio.lowlevel.checkpoint()
            buffer.data[:] = pattern
            await anyio.lowlevel.checkpoint()
        except BaseException:
            buffer.pool.free(buffer)
            raise
        self.loads.append(key)
        return buffer

    async def move(self, key: Hashable, buffer: Buffer, to: str) -> Buffer:
        source = buffer.pool
        if self.leased[buffer]:
            self.errors.append(f"{key!r} moved to {to!r} while leased")
        if buffer not in source.live or source.name == to:
            self.errors.append(f"{key!r} moved from {source.name!r} to {to!r}: not there")
        target = self.pools[to].alloc(key, len(buffer.data))
        self.moving.setdefault(key, anyio.Event()).set()
        try:
            gate = self.gates.get(to)
            if gate is not None:
                await gate.wait()
            await anyio.lowlevel.checkpoint()
            target.data[:] = buffer.data
            if to in self.fail_next:
                self.fail_next.discard(to)
                self.stranded.setdefault(key, []).extend((buffer, target))
                raise MoveError(f"{key!r} to {to!r}")
            await anyio.lowlevel.checkpoint()
        except MoveError:
            raise  # half-way: both buffers stay
        except BaseException:
            target.pool.free(target)
            raise
        finally:
            self.moving.pop(key, None)
        source.free(buffer)
        self.moves.append((key, source.name, to))
        return target

    async def release(self, key: Hashable, buffer: Buffer) -> None:
        if self.leased[buffer]:
            self.errors.append(f"{key!r} released while leased")
        await anyio.lowlevel.checkpoint()
        buffer.pool.free(buffer)
        self.released.append((key, buffer.pool.name))

    def check(self, key: str, value: Buffer) -> None:
        """A leased value: in "gpu", alive, its key's pattern intact."""
        assert value.key == key, (value.key, key)
        assert value.pool.name == "gpu", f"{key!r} leased in {value.pool.name!r}"
        assert value in value.pool.live, f"{key!r} leased after it was freed"
        assert value.data == self.patterns[key], f"{key!r} lost its data"


def patterns(sizes: Mapping[str, int]) -> dict[str, bytes]:
    return {key: random.Random(repr(key)).randbytes(size) for key, size in sizes.items()}


def exact(buffer: Buffer) -> dict[str, int]:
    """``measure=``: the buffer's length, in the space of its pool."""
    return {buffer.pool.name: len(buffer.data)}


def charged(broker: Broker, space: str) -> int:
    return broker.stats_nowait().used[space]


@asynccontextmanager
async def tiered_broker(
    gpu: int, ram: int, sizes: Mapping[str, int], **options: Any
) -> AsyncIterator[tuple[Broker, Cache, Tiered]]:
    """A broker over two pools (budgets = capacities), its tiered cache, and the plugin.

    Checks the books after every step, and, on the way out, that the pools
    held what the broker charged and are empty once the cache closed.
    """
    pools = {"gpu": Pool("gpu", gpu), "ram": Pool("ram", ram)}
    plugin = Tiered(pools, patterns(sizes))
    failures: list[str] = []
    async with Broker({"gpu": gpu, "ram": ram}, tiers={"gpu": "ram"}, **options) as broker:
        check_after_every_step(broker._core, failures)
        for pool in pools.values():
            pool.booked = functools.partial(charged, broker, pool.name)
        async with broker.cache("m", plugin) as cache:
            yield broker, cache, plugin
        for pool in pools.values():
            pool.booked = None
    assert failures == []
    assert [p.errors for p in pools.values()] == [[], []]
    assert plugin.errors == []
    assert {name: p.used for name, p in pools.items()} == {"gpu": 0, "ram": 0}, "leaked"


async def settle(steps: int = 200) -> None:
    """Let every runnable task run for a while (no sleeping)."""
    for _ in range(steps):
        await anyio.lowlevel.checkpoint()


async def until(condition: Callable[[], object], steps: int = 20_000) -> None:
    """Let other tasks run until ``condition()`` holds (no sleeping); fail if it never does."""
    for _ in range(steps):
        if condition():
            return
        await anyio.lowlevel.checkpoint()
    assert condition()


def states(broker: Broker) -> dict[Hashable, tuple[str, dict[str, int]]]:
    """``entries()`` now, by key: (state, charge)."""
    return {e.key: (e.state, dict(e.charge)) for e in broker._entries_now()}


async def quiet(broker: Broker) -> list[EntryInfo]:
    """Wait until no move, load or release runs and nothing waits; the entries then."""

    def calm() -> bool:
        return all(
            e.state in ("ready", "demoted", "quarantined") and not e.leases and not e.waiting
            for e in broker._entries_now()
        )

    await until(calm)
    return await broker.entries()


def assert_books_match(broker: Broker, plugin: Tiered, entries: list[EntryInfo]) -> None:
    """Quiet: the broker charges each space what its pool holds, and each entry where it is."""
    pools = plugin.pools
    stats = broker.stats_nowait()
    assert dict(stats.used) == {name: pool.used for name, pool in pools.items()}
    where = {"gpu": "ready", "ram": "demoted"}
    held = {
        buffer.key: (where[name], {name: len(buffer.data)})
        for name, pool in pools.items()
        for buffer in pool.live
    }
    assert sum(len(pool.live) for pool in pools.values()) == len(held), "a key in both pools"
    assert {e.key: (e.state, dict(e.charge)) for e in entries} == held


# -- many tasks, random keys and sizes ---------------------------------------------------


async def churn(
    cache: Cache,
    plugin: Tiered,
    rng: random.Random,
    *,
    workers: int,
    rounds: int,
    measured: bool,
    cancel_one_in: int | None = None,
) -> int:
    """``workers`` tasks acquiring random keys ``rounds`` times; return how many were cancelled."""
    keys = sorted(plugin.patterns, key=repr)
    cancelled = 0

    async def cancel_after(scope: anyio.CancelScope, steps: int) -> None:
        for _ in range(steps):
            await anyio.lowlevel.checkpoint()
        scope.cancel()

    async def use(key: str, hold: int) -> None:
        size = len(plugin.patterns[key])
        declared = size + rng.randrange(2 * KiB) if measured else size
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
                for _ in range(hold):
                    await anyio.lowlevel.checkpoint()
                plugin.check(key, lease.value)
            finally:
                plugin.leased[lease.value] -= 1

    async def worker(seed: int) -> None:
        nonlocal cancelled
        local = random.Random(seed)
        for _ in range(rounds):
            key, hold = local.choice(keys), local.randrange(4)
            async with anyio.create_task_group() as tg:
                with anyio.CancelScope() as scope:
                    if cancel_one_in is not None and local.randrange(cancel_one_in) == 0:
                        tg.start_soon(cancel_after, scope, local.randrange(12))
                    await use(key, hold)
                    tg.cancel_scope.cancel()  # (the canceller, if it has not fired)
                cancelled += scope.cancelled_caught

    async with anyio.create_task_group() as tg:
        for _ in range(workers):
            tg.start_soon(worker, rng.randrange(2**32))
    return cancelled


def count_moves(broker: Broker) -> Counter[str]:
    """Moves done, down and up, as the broker's events report them."""
    counts: Counter[str] = Counter()

    def listener(event: str, fields: Mapping[str, Any]) -> None:
        if event == "cachebroker.move.done":
            counts["up" if fields["up"] else "down"] += 1
        elif event == "cachebroker.move.failed":
            counts["failed"] += 1

    broker.add_listener(listener)
    return counts


def random_sizes(rng: random.Random, keys: int) -> dict[str, int]:
    return {f"k{i:02}": rng.randrange(4 * KiB, 20 * KiB) for i in range(keys)}


@pytest.mark.parametrize("measured", [False, True], ids=["declared", "measured"])
async def test_many_tasks_never_over_allocate_and_keep_their_data(measured: bool) -> None:
    rng = random.Random(1)
    sizes = random_sizes(rng, 16)  # ~190 KiB of values for 64 + 96 KiB
    async with tiered_broker(64 * KiB, 96 * KiB, sizes) as (broker, cache, plugin):
        moves = count_moves(broker)
        await churn(cache, plugin, rng, workers=24, rounds=12, measured=measured)
        entries = await quiet(broker)
        assert_books_match(broker, plugin, entries)
        assert any(e.state == "demoted" for e in entries)
        assert moves["down"] >= 10 and moves["up"] >= 5, moves
        assert moves["failed"] == 0
        assert [m for m in plugin.moves if m[1:] == ("gpu", "ram")]  # the plugin agrees
        assert any(name == "ram" for _, name in plugin.released)  # the lower tier evicts too
        peak = {name: pool.peak for name, pool in plugin.pools.items()}
        assert peak["gpu"] > 48 * KiB and peak["ram"] > 48 * KiB, peak  # both were full
        # A demoted key comes back up with its data.
        demoted = next(str(e.key) for e in entries if e.state == "demoted")
        async with cache.acquire(demoted, load=functools.partial(plugin.load, demoted)) as lease:
            plugin.check(demoted, lease.value)  # (no size=: it is loaded, one tier down)
        assert states(broker)[demoted][0] == "ready"
        assert_books_match(broker, plugin, await quiet(broker))


@pytest.mark.parametrize("measured", [False, True], ids=["declared", "measured"])
async def test_cancelled_acquirers_leave_books_and_pools_in_step(measured: bool) -> None:
    """One acquire in four is cancelled at a random point: waiting for room, for a load,
    for a promotion, or holding its lease, while other moves and releases run."""
    rng = random.Random(2)
    sizes = random_sizes(rng, 14)
    async with tiered_broker(56 * KiB, 72 * KiB, sizes) as (broker, cache, plugin):
        moves = count_moves(broker)
        cancelled = await churn(
            cache, plugin, rng, workers=20, rounds=15, measured=measured, cancel_one_in=4
        )
        assert cancelled >= 20
        entries = await quiet(broker)
        assert_books_match(broker, plugin, entries)
        assert moves["down"] and moves["up"], moves


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    gpu=st.integers(24, 64),
    ram=st.integers(0, 96),
    sizes=st.lists(st.integers(1, 24), min_size=2, max_size=10),
    seed=st.integers(0, 2**32 - 1),
    measured=st.booleans(),
    cancel_one_in=st.one_of(st.none(), st.integers(2, 6)),
)
async def test_any_budgets_and_sizes_keep_pools_within_their_books(
    gpu: int,
    ram: int,
    sizes: list[int],
    seed: int,
    measured: bool,
    cancel_one_in: int | None,
) -> None:
    """Budgets in KiB, a lower tier possibly smaller than any value (or empty)."""
    rng = random.Random(seed)
    sized = {f"k{i}": min(size, gpu) * KiB - rng.randrange(KiB) for i, size in enumerate(sizes)}
    async with tiered_broker(gpu * KiB, ram * KiB, sized) as (broker, cache, plugin):
        await churn(
            cache,
            plugin,
            rng,
            workers=10,
            rounds=8,
            measured=measured and gpu * KiB >= max(sized.values()) + 2 * KiB,
            cancel_one_in=cancel_one_in,
        )
        assert_books_match(broker, plugin, await quiet(broker))


def cause(error: BaseException) -> BaseException:
    """The first exception of ``error``'s chain of causes."""
    while error.__cause__ is not None:
        error = error.__cause__
    return error


# -- one move at a time ----------------------------------------------------------------


async def hold_idle(cache: Cache, plugin: Tiered, key: str) -> None:
    """Load ``key`` (or find it) and end the lease at once: it is idle then."""
    size = {"gpu": len(plugin.patterns[key])}
    load = functools.partial(plugin.load, key)
    async with cache.acquire(key, load=load, size=size, cost=COST) as lease:
        plugin.check(key, lease.value)


async def test_a_round_trip_keeps_the_data_and_charges_one_space_at_a_time() -> None:
    sizes = {"a": 60 * KiB, "b": 60 * KiB}
    async with tiered_broker(100 * KiB, 200 * KiB, sizes) as (broker, cache, plugin):
        for key in "ab":
            async with cache.acquire(
                key,
                load=functools.partial(plugin.load, key),
                size={"gpu": sizes[key]},
                measure=exact,
                cost=COST,
            ):
                pass
        assert states(broker) == {
            "a": ("demoted", {"ram": 60 * KiB}),
            "b": ("ready", {"gpu": 60 * KiB}),
        }
        await hold_idle(cache, plugin, "a")  # up again, "b" down
        assert states(broker) == {
            "a": ("ready", {"gpu": 60 * KiB}),
            "b": ("demoted", {"ram": 60 * KiB}),
        }
        assert plugin.loads == ["a", "b"]
        assert plugin.moves == [("a", "gpu", "ram"), ("b", "gpu", "ram"), ("a", "ram", "gpu")]
        assert_books_match(broker, plugin, await broker.entries())


async def test_a_move_that_fails_quarantines_with_both_charges_until_forgotten() -> None:
    sizes = {"a": 60 * KiB, "b": 60 * KiB}
    async with tiered_broker(100 * KiB, 100 * KiB, sizes) as (broker, cache, plugin):
        moves = count_moves(broker)
        await hold_idle(cache, plugin, "a")
        plugin.fail_next.add("ram")
        # "b" waits for the room "a"'s demotion frees; the move fails half-way, and
        # the quarantined copy in "gpu" leaves "b" no room until it is written off.
        with pytest.raises(OutOfSpace, match="quarantined"):
            await hold_idle(cache, plugin, "b")
        # Nobody knows which copy holds the value: both stay charged.
        assert states(broker) == {"a": ("quarantined", {"gpu": 60 * KiB, "ram": 60 * KiB})}
        stats = await broker.stats()
        assert stats.quarantined_keys == (("m", "a"),)
        assert dict(stats.used) == {"gpu": 60 * KiB, "ram": 60 * KiB}
        assert {n: p.holding() for n, p in plugin.pools.items()} == {
            "gpu": {"a": 60 * KiB},
            "ram": {"a": 60 * KiB},
        }
        assert moves["failed"] == 1 and plugin.loads == ["a"]
        # The plugin deals with both copies, then the broker writes them off.
        for buffer in plugin.stranded.pop("a"):
            buffer.pool.free(buffer)
        assert await broker.forget("m", "a") == 1
        assert broker.stats_nowait().used == {"gpu": 0, "ram": 0}
        await hold_idle(cache, plugin, "b")
        await hold_idle(cache, plugin, "a")  # loaded afresh; "b" demoted this time
        assert plugin.loads == ["a", "b", "a"]
        assert states(broker) == {
            "a": ("ready", {"gpu": 60 * KiB}),
            "b": ("demoted", {"ram": 60 * KiB}),
        }
        assert_books_match(broker, plugin, await quiet(broker))


async def test_a_promotion_that_fails_fails_its_requesters_and_quarantines() -> None:
    sizes = {"a": 60 * KiB, "b": 60 * KiB}
    async with tiered_broker(100 * KiB, 200 * KiB, sizes) as (broker, cache, plugin):
        await hold_idle(cache, plugin, "a")
        await hold_idle(cache, plugin, "b")  # "a" demoted
        plugin.fail_next.add("gpu")
        errors: list[BaseException] = []

        async def want_a() -> None:
            try:
                await hold_idle(cache, plugin, "a")
            except ReleaseFailed as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(want_a)
        assert len(errors) == 3 and all("raised MoveError" in str(e) for e in errors), errors
        entries = await quiet(broker)
        assert {e.key: (e.state, dict(e.charge)) for e in entries} == {
            "a": ("quarantined", {"gpu": 60 * KiB, "ram": 60 * KiB}),
            "b": ("demoted", {"ram": 60 * KiB}),
        }
        for buffer in plugin.stranded.pop("a"):
            buffer.pool.free(buffer)
        assert await broker.forget("m", "a") == 1
        assert_books_match(broker, plugin, await quiet(broker))


async def test_an_acquirer_cancelled_during_its_promotion_leaves_the_value_promoted() -> None:
    sizes = {"a": 60 * KiB, "b": 60 * KiB}
    async with tiered_broker(100 * KiB, 200 * KiB, sizes) as (broker, cache, plugin):
        await hold_idle(cache, plugin, "a")
        await hold_idle(cache, plugin, "b")  # "a" down
        gate = plugin.gates["gpu"] = anyio.Event()
        async with anyio.create_task_group() as tg:
            scope = anyio.CancelScope()

            async def want_a() -> None:
                with scope:
                    await hold_idle(cache, plugin, "a")

            tg.start_soon(want_a)
            await until(lambda: "a" in plugin.moving)  # "b" went down, "a" comes up
            assert states(broker)["a"] == ("moving", {"ram": 60 * KiB})
            assert plugin.pools["gpu"].holding() == {"a": 60 * KiB}
            scope.cancel()
            await settle()
            gate.set()
        assert scope.cancelled_caught
        entries = await quiet(broker)
        assert_books_match(broker, plugin, entries)
        assert states(broker) == {
            "a": ("ready", {"gpu": 60 * KiB}),
            "b": ("demoted", {"ram": 60 * KiB}),
        }
        await hold_idle(cache, plugin, "a")  # a hit, with its data
        assert plugin.loads == ["a", "b"]


async def test_an_acquirer_cancelled_while_its_room_is_being_demoted() -> None:
    sizes = {"a": 60 * KiB, "b": 60 * KiB}
    async with tiered_broker(100 * KiB, 200 * KiB, sizes) as (broker, cache, plugin):
        await hold_idle(cache, plugin, "a")
        gate = plugin.gates["ram"] = anyio.Event()
        async with anyio.create_task_group() as tg:
            scope = anyio.CancelScope()

            async def want_b() -> None:
                with scope:
                    await hold_idle(cache, plugin, "b")

            tg.start_soon(want_b)
            await until(lambda: "a" in plugin.moving)
            # During the move "a" is charged in both spaces, and in both pools.
            assert broker.stats_nowait().used == {"gpu": 60 * KiB, "ram": 60 * KiB}
            assert states(broker)["a"] == ("moving", {"gpu": 60 * KiB})
            scope.cancel()
            await settle()
            gate.set()
        assert scope.cancelled_caught
        entries = await quiet(broker)
        assert_books_match(broker, plugin, entries)
        assert states(broker) == {"a": ("demoted", {"ram": 60 * KiB})}
        assert plugin.loads == ["a"]


# == attacks ===================================================================
#
# Three that try hardest to break the broker: a chain of tiers where a value
# parked in the middle tier is asked for while its next demotion waits for
# room; a probed device whose allocator gives memory back late; and two tiers
# under random acquires, cancellations, invalidations, ``clear()`` and moves
# that fail half-way. Then the smaller corners they turned up, each named by
# what the broker must do.


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
    kind: str, seed: int, measured: bool, policy: str, fail_rate: float
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
    async with open_broker(
        kind, {"gpu": gpu, "ram": ram}, tiers={"gpu": "ram"}, policy=policy
    ) as broker:
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
            assert states(broker) == held, (states(broker), held)
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
