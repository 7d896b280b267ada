"""Per-entry lease slots (``concurrency=``): the seed crate's per-model mutex, and more.

The async shell on every backend, then the books driven directly with a
stateful property test of the FIFO order of slot grants.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import anyio
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cachebroker import (
    AcquireTimeout,
    Broker,
    BrokerClosed,
    DeadlockError,
    InvalidArgument,
)
from cachebroker._core import Ticket
from tests.harness import Harness


async def release(key: Hashable, value: Any) -> None:
    pass


class Loads:
    """A loader that counts its calls and returns a new value each time."""

    def __init__(self) -> None:
        self.count = 0

    async def __call__(self) -> str:
        self.count += 1
        return f"value-{self.count}"


# -- the shell, on every backend ----------------------------------------------


@pytest.mark.anyio
async def test_one_slot_makes_a_second_acquirer_wait_for_the_lease_not_a_load() -> None:
    load = Loads()
    async with Broker(budget=100) as broker, broker.cache("m", release) as cache:
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
async def test_waiters_for_a_slot_are_served_first_come_first_served() -> None:
    async with (
        Broker(budget=100) as broker,
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
async def test_joiners_of_a_load_beyond_the_slots_wait_for_a_lease() -> None:
    gate = anyio.Event()

    async def slow() -> str:
        await gate.wait()
        return "v"

    async with (
        Broker(budget=100) as broker,
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
async def test_a_task_waiting_for_its_own_slot_is_a_deadlock_error() -> None:
    async with Broker(budget=100) as broker, broker.cache("m", release) as cache:
        async with cache.acquire("k", load=Loads(), size=10, concurrency=1):
            with pytest.raises(DeadlockError, match=r"m:'k'.*concurrency=1") as caught:
                await cache.acquire("k", load=Loads(), size=10)
            assert caught.value.leases == (("m", "k"),)
        # Nothing was left waiting: the key is usable again.
        async with cache.acquire("k", load=Loads(), size=10):
            pass


@pytest.mark.anyio
async def test_waiting_for_a_slot_times_out_and_says_for_what() -> None:
    async with Broker(budget=100) as broker, broker.cache("m", release, concurrency=1) as cache:
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
async def test_cancelling_one_waiter_serves_the_next() -> None:
    async with Broker(budget=100) as broker, broker.cache("m", release, concurrency=1) as cache:
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
async def test_raising_the_limit_lets_waiters_in_at_once() -> None:
    async with Broker(budget=100) as broker, broker.cache("m", release, concurrency=1) as cache:
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
async def test_closing_the_cache_fails_a_waiter_for_a_slot() -> None:
    errors: list[BaseException] = []
    async with Broker(budget=100) as broker, anyio.create_task_group() as tg:
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
async def test_an_invalidated_entry_serves_its_waiters_then_goes() -> None:
    async with Broker(budget=100) as broker, broker.cache("m", release, concurrency=1) as cache:
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
async def test_unlimited_by_default_and_bad_limits_are_refused() -> None:
    async with Broker(budget=100) as broker, broker.cache("m", release) as cache:
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
        ticket = self.h.core.request(self.h.owner, "k", {"m": 10}, task, slots=self.slots)
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
async def test_a_prefetch_joined_to_a_load_does_not_wait_for_a_lease_slot() -> None:
    gate = anyio.Event()

    async def slow() -> str:
        await gate.wait()
        return "v"

    async with Broker(budget=100) as broker, broker.cache("m", release, concurrency=1) as cache:
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
async def test_a_request_waiting_for_a_slot_sleeps_instead_of_spinning() -> None:
    """The entry's wake-up event was set when its load ended: a later waiter
    must park on a fresh one, not loop around the set one (which never lets
    every task block)."""
    async with Broker(budget=100) as broker, broker.cache("m", release) as cache:
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
