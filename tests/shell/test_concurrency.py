"""Per-entry lease slots (``concurrency=``): the seed crate's per-model mutex, and more.

The async shell on every backend, then the books driven directly with a
stateful property test of the FIFO order of slot grants. Then attacks on the
slots: cancellation, timeouts, threads, loaders and releasers that acquire,
hand-offs, closing, invalidation, the hit path, and a connected broker with a
real daemon. Among the bugs they found, fixed: a lease handed to another task
counted as its acquirer's for deadlock detection (only leases bound to a task
by ``async with`` do now).
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cachebroker import (
    AcquireTimeout,
    Broker,
    BrokerClosed,
    Cache,
    DeadlockError,
    InvalidArgument,
)
from cachebroker._core import Request, State, Ticket
from tests.brokers import open_broker
from tests.harness import Harness
from tests.helpers import steps_until
from tests.remote.support import Plugin, serving
from tests.shell.support import Loads, release

# -- the shell, on every backend ----------------------------------------------


@pytest.mark.anyio
async def test_one_slot_makes_a_second_acquirer_wait_for_the_lease_not_a_load(kind: str) -> None:
    load = Loads()
    async with open_broker(kind, 100) as broker, broker.cache("m", release) as cache:
        first = await cache.acquire("k", load=load, size=10, concurrency=1)
        got: list[str] = []

        async def second() -> None:
            async with cache.acquire("k", load=load, size=10) as lease:
                got.append(lease.value)

        async with anyio.create_task_group() as tg:
            tg.start_soon(second)
            await wait_until(lambda: broker.stats_nowait().waiting_for_lease == 1)
            stats = broker.stats_nowait()
            assert got == [] and stats.waiting == 0 and stats.leased == 1
            await first.release()
        assert got == ["value-1"] and load.count == 1
        assert broker.stats_nowait().waiting_for_lease == 0


@pytest.mark.anyio
async def test_waiters_for_a_slot_are_served_first_come_first_served(kind: str) -> None:
    async with (
        open_broker(kind, 100) as broker,
        broker.cache("m", release, concurrency=1) as cache,
    ):
        order: list[int] = []
        holder = await cache.acquire("k", load=Loads(), size=10)

        async def waiter(i: int) -> None:
            async with cache.acquire("k", load=Loads(), size=10):
                order.append(i)
                await anyio.lowlevel.checkpoint()

        async with anyio.create_task_group() as tg:
            for i in range(5):
                tg.start_soon(waiter, i)
                await wait_until(lambda i=i: broker.stats_nowait().waiting_for_lease == i + 1)
            await holder.release()
        assert order == [0, 1, 2, 3, 4]


@pytest.mark.anyio
async def test_joiners_of_a_load_beyond_the_slots_wait_for_a_lease(kind: str) -> None:
    gate = anyio.Event()

    async def slow() -> str:
        await gate.wait()
        return "v"

    async with (
        open_broker(kind, 100) as broker,
        broker.cache("m", release, concurrency=2) as cache,
    ):
        held: list[Any] = []
        done = anyio.Event()

        async def joiner() -> None:
            lease = await cache.acquire("k", load=slow, size=10)
            held.append(lease)
            if len(held) == 2:
                done.set()

        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(joiner)
            await wait_until(lambda: broker.stats_nowait().loading == 1)
            gate.set()
            await done.wait()
            await wait_until(lambda: broker.stats_nowait().waiting_for_lease == 1)
            assert len(held) == 2
            await held[0].release()
        assert len(held) == 3
        for lease in held[1:]:
            await lease.release()


@pytest.mark.anyio
async def test_a_task_waiting_for_its_own_slot_is_a_deadlock_error(kind: str) -> None:
    async with open_broker(kind, 100) as broker, broker.cache("m", release) as cache:
        async with cache.acquire("k", load=Loads(), size=10, concurrency=1):
            with pytest.raises(DeadlockError, match=r"m:'k'.*concurrency=1") as caught:
                await cache.acquire("k", load=Loads(), size=10)
            assert caught.value.leases == (("m", "k"),)
        # Nothing was left waiting: the key is usable again.
        async with cache.acquire("k", load=Loads(), size=10):
            pass


@pytest.mark.anyio
async def test_waiting_for_a_slot_times_out_and_says_for_what(kind: str) -> None:
    async with open_broker(kind, 100) as broker, broker.cache("m", release, concurrency=1) as cache:
        async with cache.acquire("k", load=Loads(), size=10):
            results: list[BaseException] = []

            async def other() -> None:
                try:
                    await cache.acquire("k", load=Loads(), size=10, timeout=0.05)
                except AcquireTimeout as exc:
                    results.append(exc)

            async with anyio.create_task_group() as tg:
                tg.start_soon(other)
            (error,) = results
            assert isinstance(error, AcquireTimeout)
            assert error.waiting_for == "lease" and error.entry == "m:'k'"
            assert "concurrency=1" in str(error)
            assert broker.stats_nowait().waiting_for_lease == 0


async def cancellable(scope: anyio.CancelScope, func: Any, *args: Any) -> None:
    with scope:
        await func(*args)


@pytest.mark.anyio
async def test_cancelling_one_waiter_serves_the_next(kind: str) -> None:
    async with open_broker(kind, 100) as broker, broker.cache("m", release, concurrency=1) as cache:
        holder = await cache.acquire("k", load=Loads(), size=10)
        served: list[str] = []
        scope = anyio.CancelScope()

        async def waiter(name: str) -> None:
            async with cache.acquire("k", load=Loads(), size=10):
                served.append(name)

        async with anyio.create_task_group() as tg:
            tg.start_soon(cancellable, scope, waiter, "cancelled")
            await wait_until(lambda: broker.stats_nowait().waiting_for_lease == 1)
            tg.start_soon(waiter, "next")
            await wait_until(lambda: broker.stats_nowait().waiting_for_lease == 2)
            scope.cancel()
            await wait_until(lambda: broker.stats_nowait().waiting_for_lease == 1)
            await holder.release()
        assert served == ["next"]


@pytest.mark.anyio
async def test_raising_the_limit_lets_waiters_in_at_once(kind: str) -> None:
    async with open_broker(kind, 100) as broker, broker.cache("m", release, concurrency=1) as cache:
        holder = await cache.acquire("k", load=Loads(), size=10)
        got = anyio.Event()

        async def waiter() -> None:
            async with cache.acquire("k", load=Loads(), size=10):
                got.set()
                await anyio.sleep_forever()

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await wait_until(lambda: broker.stats_nowait().waiting_for_lease == 1)
            third = await cache.acquire("k", load=Loads(), size=10, concurrency=3)
            await got.wait()
            assert broker.stats_nowait().waiting_for_lease == 0
            await third.release()
            tg.cancel_scope.cancel()
        await holder.release()


@pytest.mark.anyio
async def test_closing_the_cache_fails_a_waiter_for_a_slot(kind: str) -> None:
    errors: list[BaseException] = []
    async with open_broker(kind, 100) as broker, anyio.create_task_group() as tg:
        async with broker.cache("m", release, concurrency=1) as cache:
            holder = await cache.acquire("k", load=Loads(), size=10)

            async def waiter() -> None:
                try:
                    await cache.acquire("k", load=Loads(), size=10)
                except BrokerClosed as exc:
                    errors.append(exc)

            async def release_once_failed() -> None:
                await wait_until(lambda: bool(errors))
                await holder.release()

            tg.start_soon(waiter)
            await wait_until(lambda: broker.stats_nowait().waiting_for_lease == 1)
            tg.start_soon(release_once_failed)
        # Leaving the block failed the waiter; the exit then waited for the lease.
    assert len(errors) == 1 and "m:'k'" in str(errors[0])


@pytest.mark.anyio
async def test_an_invalidated_entry_serves_its_waiters_then_goes(kind: str) -> None:
    async with open_broker(kind, 100) as broker, broker.cache("m", release, concurrency=1) as cache:
        load = Loads()
        holder = await cache.acquire("k", load=load, size=10)
        got: list[str] = []

        async def waiter() -> None:
            async with cache.acquire("k", load=load, size=10) as lease:
                got.append(lease.value)

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await wait_until(lambda: broker.stats_nowait().waiting_for_lease == 1)
            assert await cache.invalidate("k")
            await holder.release()
        assert got == ["value-1"]  # the value it waited for, before it went
        async with cache.acquire("k", load=load, size=10) as lease:
            assert lease.value == "value-2"


@pytest.mark.anyio
async def test_unlimited_by_default_and_bad_limits_are_refused(kind: str) -> None:
    async with open_broker(kind, 100) as broker, broker.cache("m", release) as cache:
        leases = [await cache.acquire("k", load=Loads(), size=10) for _ in range(20)]
        assert broker.stats_nowait().waiting_for_lease == 0
        for lease in leases:
            await lease.release()
        for bad in (0, -1):
            with pytest.raises(InvalidArgument, match="concurrency must be at least 1"):
                cache.acquire("k", load=Loads(), concurrency=bad)
        for wrong in (1.5, "1", True):
            with pytest.raises(TypeError, match="concurrency"):
                cache.acquire("k", load=Loads(), concurrency=wrong)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match="concurrency"):
            broker.cache("n", release, concurrency=0)
        with pytest.raises(TypeError, match="priority"):
            broker.cache("n", release, priority=1.0)  # type: ignore[arg-type]


async def wait_until(condition: Any, *, steps: int = 10_000) -> None:
    """Let other tasks run until ``condition()`` holds (no sleeping)."""
    for _ in range(steps):
        if condition():
            return
        await anyio.lowlevel.checkpoint()
    raise AssertionError("condition never held")


# -- the books: FIFO slot grants under random steps ----------------------------


class SlotMachine(RuleBasedStateMachine):
    """Requests for one key with a few slots; leases end and waiters leave at random.

    Invariants: the books add up (``Core.check``), leases never exceed the
    slots, the entry loads once, and slots go to waiters in arrival order.
    """

    def __init__(self) -> None:
        super().__init__()
        self.h = Harness({"m": 100}, instant=True)
        self.slots = 2
        self.held: list[Ticket] = []
        self.waiting: list[Ticket] = []
        self.granted_order: list[int] = []
        self.asked_order: list[int] = []
        self.tasks = 0

    def _collect(self) -> None:
        for ticket in list(self.waiting):
            if ticket.outcome is True:
                self.waiting.remove(ticket)
                self.held.append(ticket)
                self.granted_order.append(ticket.task)  # type: ignore[arg-type]

    @rule()
    def acquire(self) -> None:
        self.tasks += 1
        task = self.tasks
        ticket = self.h.core.request(self.h.owner, Request("k", {"m": 10}, slots=self.slots), task)
        self.h.drain()
        self.asked_order.append(task)
        if ticket.outcome is True:
            self.held.append(ticket)
            self.granted_order.append(task)
        else:
            self.waiting.append(ticket)
        self._collect()

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def end(self, data: st.DataObject) -> None:
        ticket = data.draw(st.sampled_from(self.held))
        self.held.remove(ticket)
        self.h.end(ticket)
        self._collect()

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def leave(self, data: st.DataObject) -> None:
        ticket = data.draw(st.sampled_from(self.waiting))
        self.waiting.remove(ticket)
        self.asked_order.remove(ticket.task)  # type: ignore[arg-type]
        self.h.leave(ticket)
        self._collect()

    @rule(slots=st.integers(1, 3))
    def change_limit(self, slots: int) -> None:
        self.slots = slots
        entry = self.h.owner.entries.get("k")
        if entry is not None:
            self.h.core.limit(entry, slots=slots)
            self.h.drain()
        self._collect()

    @invariant()
    def books_add_up_and_order_holds(self) -> None:
        self.h.core.check()
        entry = self.h.owner.entries.get("k")
        if entry is not None:
            assert len(self.waiting) == len(entry.joiners)
            if self.waiting:
                assert entry.leases >= (entry.slots or 0)
        # Granted in the order asked (those who left excluded).
        assert self.granted_order == [t for t in self.asked_order if t in self.granted_order]
        assert len(self.h.released) == 0  # never evicted: it fits, and it is leased or idle


TestSlotMachine = SlotMachine.TestCase
TestSlotMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


@pytest.mark.anyio
async def test_a_prefetch_joined_to_a_load_does_not_wait_for_a_lease_slot(kind: str) -> None:
    gate = anyio.Event()

    async def slow() -> str:
        await gate.wait()
        return "v"

    async with open_broker(kind, 100) as broker, broker.cache("m", release, concurrency=1) as cache:
        holder: list[Any] = []
        prefetched = anyio.Event()

        async def acquirer() -> None:
            holder.append(await cache.acquire("k", load=slow, size=10))

        async def prefetcher() -> None:
            await cache.prefetch("k", load=slow, size=10, priority=2)
            prefetched.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(acquirer)
            await wait_until(lambda: broker.stats_nowait().loading == 1)
            tg.start_soon(prefetcher)
            await wait_until(lambda: bool(cache._owner.entries["k"].joiners[1:]))
            gate.set()
            # The acquirer takes the one slot; the prefetch returns without one.
            await prefetched.wait()
            assert len(holder) == 1 and broker.stats_nowait().waiting_for_lease == 0
            (info,) = await broker.entries()
            assert info.leases == 1 and info.priority == 2
        await holder[0].release()


@pytest.mark.anyio
async def test_a_request_waiting_for_a_slot_sleeps_instead_of_spinning(kind: str) -> None:
    """The entry's wake-up event was set when its load ended: a later waiter
    must park on a fresh one, not loop around the set one (which never lets
    every task block)."""
    async with open_broker(kind, 100) as broker, broker.cache("m", release) as cache:
        first = await cache.acquire("k", load=Loads(), size=10, concurrency=1)

        async def second() -> None:
            async with cache.acquire("k", load=Loads(), size=10):
                pass

        async with anyio.create_task_group() as tg:
            tg.start_soon(second)
            with anyio.fail_after(5):
                await anyio.wait_all_tasks_blocked()
            assert broker.stats_nowait().waiting_for_lease == 1
            await first.release()


# -- helpers of the attacks ---------------------------------------------------------


async def settle(steps: int = 200) -> None:
    """Let every runnable task run for a while (no sleeping)."""
    for _ in range(steps):
        await anyio.lowlevel.checkpoint()


def leases_on(cache: Any, key: Hashable) -> int:
    entry = cache._owner.entries.get(key)
    return 0 if entry is None else int(entry.leases)


# -- cancellation, timeouts, threads ----------------------------------------------


@pytest.mark.anyio
async def test_cancelled_at_an_immediate_slot_grant_leaks_no_lease(
    anyio_backend: tuple[str, dict[str, Any]], request: pytest.FixtureRequest
) -> None:
    """A limited entry is served by the slow path (``Runner.request``), which grants the
    lease in ``core.request`` and then awaits a checkpoint: a cancellation delivered
    there propagates without ending the lease, which nobody holds any more."""
    async with (
        Broker(budget=100) as broker,
        broker.cache("m", release, concurrency=1) as cache,
    ):
        async with cache.acquire("k", load=Loads(), size=10):
            pass
        with anyio.CancelScope() as scope:
            scope.cancel()  # (a request handler cancelled just as it acquires)
            await cache.acquire("k", load=Loads(), size=10)
        leaked = leases_on(cache, "k")
        stats = broker.stats_nowait()
        # Clean up whatever leaked so that the cache can close at once.
        entry = cache._owner.entries["k"]
        core = broker._runner.core
        while entry.leases:
            core.lease_end(entry, entry.holders[-1], 0.0)
        broker._runner.apply()
    assert leaked == 0 and stats.leased == 0


@pytest.mark.anyio
async def test_cancelled_just_as_a_waited_slot_is_granted_passes_it_on() -> None:
    """The "granted just as we were cancelled" path of ``Runner._wait``."""
    async with Broker(budget=100) as broker, broker.cache("m", release, concurrency=1) as cache:
        holder = await cache.acquire("k", load=Loads(), size=10)
        served: list[str] = []
        cancelled: list[str] = []
        scope = anyio.CancelScope()

        async def waiter(name: str, scope: anyio.CancelScope | None = None) -> None:
            with scope or anyio.CancelScope():
                async with cache.acquire("k", load=Loads(), size=10) as lease:
                    served.append(lease.value)
                    await anyio.lowlevel.checkpoint()
            if scope is not None and scope.cancelled_caught:
                cancelled.append(name)

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter, "first", scope)
            assert await steps_until(lambda: broker.stats_nowait().waiting_for_lease == 1)
            tg.start_soon(waiter, "second")
            assert await steps_until(lambda: broker.stats_nowait().waiting_for_lease == 2)
            # Cancel the first waiter, then grant it the slot in the same step.
            scope.cancel()
            await holder.release()
        assert cancelled == ["first"] and served == ["value-1"]
        stats = broker.stats_nowait()
        assert stats.leased == 0 and stats.waiting_for_lease == 0 and leases_on(cache, "k") == 0
        broker._runner.core.check()


@pytest.mark.anyio
async def test_timeouts_racing_slot_grants_leave_the_books_consistent() -> None:
    async with Broker(budget=100) as broker, broker.cache("m", release, concurrency=2) as cache:
        outcomes: dict[str, int] = {"served": 0, "timed_out": 0}
        waited_for: set[str | None] = set()

        async def client(i: int) -> None:
            for _ in range(20):
                try:
                    async with cache.acquire(
                        "k", load=Loads(), size=10, timeout=0.0005 * (i % 4 + 1)
                    ):
                        outcomes["served"] += 1
                        await anyio.lowlevel.checkpoint()
                except AcquireTimeout as exc:
                    waited_for.add(exc.waiting_for)
                    outcomes["timed_out"] += 1

        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(client, i)
        assert outcomes["served"] + outcomes["timed_out"] == 160
        assert waited_for <= {"lease", "load"}
        stats = broker.stats_nowait()
        assert stats.leased == 0 and stats.waiting_for_lease == 0 and stats.loads == 1
        broker._runner.core.check()


@pytest.mark.anyio
async def test_a_lease_released_from_a_thread_grants_the_next_waiter(kind: str) -> None:
    async with open_broker(kind, 100) as broker, broker.cache("m", release, concurrency=1) as cache:
        holder = await cache.acquire("k", load=Loads(), size=10)
        got = anyio.Event()

        async def waiter() -> None:
            async with cache.acquire("k", load=Loads(), size=10):
                got.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            assert await steps_until(lambda: broker.stats_nowait().waiting_for_lease == 1)
            await anyio.to_thread.run_sync(holder.release)  # ends it on the loop, soon
            with anyio.fail_after(5):  # (a hang guard, not a timing)
                await got.wait()
        stats = broker.stats_nowait()
        assert stats.leased == 0 and stats.waiting_for_lease == 0 and stats.loads == 1


# -- loads, invalidation, clearing, idle TTL, pins, closing -------------------------


@pytest.mark.anyio
async def test_joiners_beyond_the_slots_all_get_the_load_error_and_nothing_is_left() -> None:
    gate = anyio.Event()

    async def broken() -> str:
        await gate.wait()
        raise ValueError("no weights")

    async with Broker(budget=100) as broker, broker.cache("m", release, concurrency=1) as cache:
        errors: list[BaseException] = []

        async def joiner() -> None:
            try:
                await cache.acquire("k", load=broken, size=10)
            except ValueError as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(joiner)
            assert await steps_until(lambda: broker.stats_nowait().loading == 1)
            gate.set()
        assert len(errors) == 4
        stats = broker.stats_nowait()
        assert stats.leased == 0 and stats.waiting_for_lease == 0 and stats.used == {"default": 0}
        load = Loads()
        async with cache.acquire("k", load=load, size=10) as lease:
            assert lease.value == "value-1"
        broker._runner.core.check()


@pytest.mark.anyio
async def test_an_idle_ttl_zero_entry_serves_its_slot_waiters_before_it_goes(kind: str) -> None:
    load = Loads()
    async with (
        open_broker(kind, 100) as broker,
        broker.cache("m", release, concurrency=1, idle_ttl=0) as cache,
    ):
        holder = await cache.acquire("k", load=load, size=10)
        got: list[str] = []

        async def waiter() -> None:
            async with cache.acquire("k", load=load, size=10) as lease:
                got.append(lease.value)

        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(waiter)
            assert await steps_until(lambda: broker.stats_nowait().waiting_for_lease == 3)
            await holder.release()
        assert got == ["value-1"] * 3 and load.count == 1
        assert await steps_until(lambda: broker.stats_nowait().entries == 0)
        assert broker.stats_nowait().releases["idle"] == 1


@pytest.mark.anyio
async def test_clear_evict_idle_and_pin_leave_slot_waiters_served() -> None:
    load = Loads()
    async with (
        Broker(budget=100, idle_ttl=1000) as broker,
        broker.cache("m", release, concurrency=1) as cache,
    ):
        holder = await cache.acquire("k", load=load, size=10, pin=True)
        got: list[str] = []

        async def waiter() -> None:
            async with cache.acquire("k", load=load, size=10) as lease:
                got.append(lease.value)
                await anyio.lowlevel.checkpoint()

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            tg.start_soon(waiter)
            assert await steps_until(lambda: broker.stats_nowait().waiting_for_lease == 2)
            assert (await broker.evict_idle()).entries == 0  # leased: nothing to evict
            assert (await broker.clear()).entries == 0  # leased: goes with its last lease
            assert broker.stats_nowait().waiting_for_lease == 2
            # A new acquire no longer finds the cleared entry: it loads afresh.
            async with cache.acquire("k", load=load, size=10) as fresh:
                assert fresh.value == "value-2"
            await holder.release()
        assert got == ["value-1", "value-1"]
        assert await steps_until(lambda: broker.stats_nowait().releases["clear"] == 1)
        stats = broker.stats_nowait()
        assert stats.leased == 0 and stats.waiting_for_lease == 0
        broker._runner.core.check()


@pytest.mark.anyio
async def test_closing_the_cache_fails_every_slot_waiter_and_joiner(kind: str) -> None:
    gate = anyio.Event()

    async def slow() -> str:
        await gate.wait()
        return "v"

    errors: list[BaseException] = []
    async with open_broker(kind, 100) as broker, anyio.create_task_group() as tg:
        async with broker.cache("m", release, concurrency=1) as cache:
            holder = await cache.acquire("ready", load=Loads(), size=10)

            async def ask(key: str, load: Any) -> None:
                try:
                    await cache.acquire(key, load=load, size=10)
                except BrokerClosed as exc:
                    errors.append(exc)

            for _ in range(2):
                tg.start_soon(ask, "ready", Loads())
                tg.start_soon(ask, "loading", slow)
            assert await steps_until(
                lambda: (
                    broker.stats_nowait().waiting_for_lease == 2
                    and broker.stats_nowait().loading == 1
                )
            )

            async def release_when_failed() -> None:
                await steps_until(lambda: len(errors) == 4)
                await holder.release()
                gate.set()

            tg.start_soon(release_when_failed)
    assert len(errors) == 4
    assert broker.stats_nowait().waiting_for_lease == 0


# -- deadlocks: loaders, releasers, hand-offs, lowered limits ----------------------


@pytest.mark.anyio
async def test_a_loader_acquiring_its_own_limited_key_is_a_deadlock_error(kind: str) -> None:
    async with open_broker(kind, 100) as broker, broker.cache("m", release, concurrency=1) as cache:

        async def recursive() -> str:
            async with cache.acquire("k", load=recursive, size=10):
                return "never"

        with pytest.raises(DeadlockError):
            await cache.acquire("k", load=recursive, size=10)
        assert broker.stats_nowait().entries == 0


@pytest.mark.anyio
async def test_a_loader_waiting_for_a_slot_its_requester_holds_is_a_deadlock_error(
    kind: str,
) -> None:
    async with open_broker(kind, 100) as broker, broker.cache("m", release, concurrency=1) as cache:
        outcome: list[object] = []

        async def load_b() -> str:
            async with cache.acquire("a", load=Loads(), size=10):  # held by main, below
                return "b"

        async def main() -> None:
            async with cache.acquire("a", load=Loads(), size=10):
                try:
                    async with cache.acquire("b", load=load_b, size=10):
                        outcome.append("got b")
                except DeadlockError as exc:
                    outcome.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(main)
            await steps_until(lambda: outcome, steps=2_000)
            seen = list(outcome)
            tg.cancel_scope.cancel()  # (stuck: let it go)
        assert seen and isinstance(seen[0], DeadlockError)


@pytest.mark.anyio
async def test_a_releaser_waiting_for_a_slot_held_by_the_evicting_request_is_refused(
    kind: str,
) -> None:
    outcome: list[object] = []
    caches: list[Any] = []

    async def releaser(key: Hashable, value: Any) -> None:
        if key == "x":
            try:
                async with caches[0].acquire("y", load=Loads(), size=10):
                    outcome.append("got y")
            except DeadlockError as exc:
                outcome.append(exc)

    async with (
        open_broker(kind, 100) as broker,
        broker.cache("m", releaser, concurrency=1) as cache,
    ):
        caches.append(cache)
        await (await cache.acquire("x", load=Loads(), size=90)).release()

        async def main() -> None:
            async with cache.acquire("y", load=Loads(), size=10):
                # Needs x's bytes: evicts x, whose releaser wants y's only slot.
                async with cache.acquire("z", load=Loads(), size=50):
                    outcome.append("got z")

        async with anyio.create_task_group() as tg:
            tg.start_soon(main)
            await steps_until(lambda: outcome, steps=2_000)
            seen = list(outcome)
            tg.cancel_scope.cancel()
        assert seen and isinstance(seen[0], DeadlockError)


@pytest.mark.anyio
async def test_a_lease_handed_to_another_task_makes_the_next_acquire_wait_not_fail(
    kind: str,
) -> None:
    async with open_broker(kind, 100) as broker, broker.cache("m", release, concurrency=1) as cache:
        send, receive = anyio.create_memory_object_stream[Any](1)
        used: list[str] = []
        errors: list[BaseException] = []

        async def worker() -> None:
            async with receive:
                async for lease in receive:
                    used.append(lease.value)
                    await lease.release()

        async with anyio.create_task_group() as tg:
            tg.start_soon(worker)
            async with send:
                try:
                    for _ in range(3):
                        lease = await cache.acquire("k", load=Loads(), size=10)
                        await send.send(lease)  # the worker releases it
                except DeadlockError as exc:
                    errors.append(exc)
        assert errors == [] and used == ["value-1"] * 3
        assert broker.stats_nowait().leased == 0


def test_a_waiter_left_waiting_on_its_own_leases_after_a_lowered_limit_is_refused() -> None:
    h = Harness({"m": 100}, instant=True)
    mine = h.core.request(h.owner, Request("k", {"m": 10}, slots=2), "T")
    other = h.core.request(h.owner, Request("k", {"m": 10}), "U")
    h.drain()
    assert mine.outcome is True and other.outcome is True
    again = h.core.request(h.owner, Request("k", {"m": 10}, slots=1), "T")  # waits: U holds one
    h.drain()
    assert again.outcome is None
    h.end(other)  # now only T's own lease holds the only slot
    h.core.check()
    assert isinstance(again.outcome, DeadlockError)


def test_a_slot_held_by_a_lease_that_may_travel_is_waited_for_not_refused() -> None:
    """The books: an unbound lease (awaited, not entered) may be ended by another task."""
    h = Harness({"m": 100}, instant=True)
    loose = h.core.request(h.owner, Request("k", {"m": 10}, slots=1), "T", bound=False)
    h.drain()
    assert loose.outcome is True and loose.entry.bound == []
    again = h.core.request(h.owner, Request("k", {"m": 10}), "T")  # bound: it waits for its turn
    h.drain()
    h.core.check()
    assert again.outcome is None and again in loose.entry.joiners
    h.end(loose)  # ended (by whichever task it was handed to): the waiter takes the slot
    h.core.check()
    assert again.outcome is True and loose.entry.bound == ["T"]
    # Now the slot is bound to T: asking again from T could only wait on itself.
    with pytest.raises(DeadlockError, match=r"p:'k'.*concurrency=1"):
        h.core.request(h.owner, Request("k", {"m": 10}), "T")


def test_a_lease_granted_later_keeps_whether_it_was_bound() -> None:
    """The books: a slot waiter's ``bound`` goes with the lease it is granted."""
    h = Harness({"m": 100}, instant=True)
    first = h.core.request(h.owner, Request("k", {"m": 10}, slots=1), "U")
    h.drain()
    waiter = h.core.request(h.owner, Request("k", {"m": 10}), "T", bound=False)
    h.drain()
    h.end(first)
    h.core.check()
    assert waiter.outcome is True and waiter.entry.bound == []
    # T's only lease may travel: T's next request waits instead of failing.
    nxt = h.core.request(h.owner, Request("k", {"m": 10}), "T")
    h.drain()
    assert nxt.outcome is None
    h.end(waiter)
    assert nxt.outcome is True


def test_a_task_ending_one_of_two_kinds_of_lease_is_never_refused_falsely() -> None:
    """The books cannot tell which of a task's two leases ended: the bound one is forgotten."""
    h = Harness({"m": 100}, instant=True)
    bound = h.core.request(h.owner, Request("k", {"m": 10}, slots=2), "T")
    loose = h.core.request(h.owner, Request("k", {"m": 10}), "T", bound=False)
    h.drain()
    entry = bound.entry
    assert entry.bound == ["T"] and entry.holders == ["T", "T"]
    h.end(bound)
    h.core.check()
    assert entry.bound == [] and entry.leases == 1
    h.core.limit(entry, slots=1)
    again = h.core.request(h.owner, Request("k", {"m": 10}), "T")  # waits for the lease left
    h.drain()
    assert again.outcome is None
    h.end(loose)
    assert again.outcome is True


# -- stats and the hit path --------------------------------------------------------


@pytest.mark.anyio
async def test_stats_waiting_for_lease_follows_the_books_through_churn() -> None:
    async with Broker(budget=100) as broker, broker.cache("m", release) as cache:
        core = broker._runner.core

        def counted() -> int:
            return sum(
                len(e.joiners) for e in core.entries() if e.state is State.READY and e.joiners
            )

        holders = [await cache.acquire(k, load=Loads(), size=10, concurrency=1) for k in "abc"]
        scopes = [anyio.CancelScope() for _ in range(9)]

        async def waiter(key: str, scope: anyio.CancelScope) -> None:
            with scope:
                async with cache.acquire(key, load=Loads(), size=10):
                    await anyio.lowlevel.checkpoint()

        async with anyio.create_task_group() as tg:
            for i, scope in enumerate(scopes):
                tg.start_soon(waiter, "abc"[i % 3], scope)
            assert await steps_until(lambda: broker.stats_nowait().waiting_for_lease == 9)
            assert counted() == 9 and broker.stats_nowait().waiting == 0
            scopes[0].cancel()
            scopes[4].cancel()
            assert await steps_until(lambda: broker.stats_nowait().waiting_for_lease == 7)
            assert await cache.invalidate("b")  # its waiters still wait for b's slot
            assert broker.stats_nowait().waiting_for_lease == counted() == 7
            for lease in holders:
                await lease.release()
        stats = broker.stats_nowait()
        assert stats.waiting_for_lease == 0 and stats.leased == 0 and counted() == 0


@pytest.mark.anyio
async def test_unlimited_entries_keep_the_hit_path_after_a_limit_was_set_and_lowered(
    monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    slow: list[Hashable] = []
    original = Cache._acquire_slow

    async def counting(self: Cache, lease: Any, entered: bool) -> Any:
        slow.append(lease.key)
        return await original(self, lease, entered)

    monkeypatch.setattr(Cache, "_acquire_slow", counting)
    async with (
        open_broker(kind, 100) as broker,
        broker.cache("m", release) as cache,
        contextlib.AsyncExitStack() as held,
    ):
        await (await cache.acquire("free", load=Loads(), size=10)).release()
        # Entered, as by ``async with``: only this task can end them.
        limited = [
            await held.enter_async_context(
                cache.acquire("lim", load=Loads(), size=10, concurrency=3)
            ),
            await held.enter_async_context(cache.acquire("lim", load=Loads(), size=10)),
        ]
        errors: list[BaseException] = []

        async def lower() -> None:  # another task lowers the limit: 2 leases >= 1 slot
            try:
                await cache.acquire("lim", load=Loads(), size=10, concurrency=1, timeout=0.01)
            except AcquireTimeout as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(lower)
        assert [getattr(e, "waiting_for", None) for e in errors] == ["lease"]
        assert leases_on(cache, "lim") == 2  # lowering ends no lease
        slow.clear()
        free = [await cache.acquire("free", load=Loads(), size=10) for _ in range(20)]
        assert slow == [] and leases_on(cache, "free") == 20
        # The limited one takes the slow path, and this task's blocks hold both its leases.
        with pytest.raises(DeadlockError):
            await cache.acquire("lim", load=Loads(), size=10)
        assert slow == ["lim"]
        for lease in free + limited:
            await lease.release()
        async with cache.acquire("lim", load=Loads(), size=10) as lease:
            assert lease.value == "value-1"
        assert broker.stats_nowait().loads == 2


# -- a connected broker and a real daemon -------------------------------------------


@pytest.mark.anyio
async def test_slots_through_a_connected_broker_share_one_load_and_one_daemon_entry() -> None:
    async with serving() as daemon:
        async with Broker.connect(daemon.address) as broker:
            async with broker.cache("w", Plugin(), concurrency=1) as cache:
                load = Loads()
                holder = await cache.acquire("k", load=load, size=10)
                order: list[int] = []

                async def waiter(i: int) -> None:
                    async with cache.acquire("k", load=load, size=10):
                        order.append(i)
                        await anyio.lowlevel.checkpoint()

                async with anyio.create_task_group() as tg:
                    for i in range(3):
                        tg.start_soon(waiter, i)

                        def queued(i: int = i) -> bool:
                            return broker.stats_nowait().waiting_for_lease == i + 1

                        assert await steps_until(queued)
                    await holder.release()
                assert order == [0, 1, 2] and load.count == 1
                assert await steps_until(
                    lambda: [e["state"] for e in daemon.listing()["entries"]] == ["ready"],
                    steps=20_000,
                )
                daemon.runner.core.check()
                broker._runner.core.check()
