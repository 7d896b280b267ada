"""Adversarial tests of lease slots (``concurrency=``) and eviction priorities.

Each test attacks one corner of the change: the async shell on every backend
(cancellation, timeouts, threads, loaders and releasers that acquire, hand-offs,
closing, invalidation), a connected broker with a real daemon, and the books
driven directly (a stateful machine mixing every step with random priorities
and slots under every built-in policy, checking ``Core.check()``, the priorities'
own bookkeeping and the eviction order after every step).

The bugs these attacks found are fixed, among them: a lease handed to another
task counted as its acquirer's for deadlock detection (only leases bound to a
task by ``async with`` do now), and a shared broker evicted a connected
process's entry by the priority it was loaded with (a later acquire's priority
is reported to it now).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Hashable
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from hypothesis import note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cachebroker import (
    AcquireTimeout,
    Broker,
    BrokerClosed,
    Cache,
    DeadlockError,
    InvalidArgument,
    OutOfSpace,
    PolicyBase,
    PolicyEntry,
)
from cachebroker._core import Entry, Reason, State, Ticket
from cachebroker._policies import make_policy
from tests.harness import Harness
from tests.remote.support import Plugin, serving, value
from tests.shell.test_concurrency import Loads, release

POLICIES = ["lru", "fifo", "gdsf", "cost"]


# -- helpers ---------------------------------------------------------------------


async def wait_until(condition: Callable[[], Any], *, steps: int = 5_000) -> bool:
    """Let other tasks run until ``condition()`` holds; whether it did (no sleeping)."""
    for _ in range(steps):
        if condition():
            return True
        await anyio.lowlevel.checkpoint()
    return bool(condition())


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
            assert await wait_until(lambda: broker.stats_nowait().waiting_for_lease == 1)
            tg.start_soon(waiter, "second")
            assert await wait_until(lambda: broker.stats_nowait().waiting_for_lease == 2)
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
async def test_a_lease_released_from_a_thread_grants_the_next_waiter() -> None:
    async with Broker(budget=100) as broker, broker.cache("m", release, concurrency=1) as cache:
        holder = await cache.acquire("k", load=Loads(), size=10)
        got = anyio.Event()

        async def waiter() -> None:
            async with cache.acquire("k", load=Loads(), size=10):
                got.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            assert await wait_until(lambda: broker.stats_nowait().waiting_for_lease == 1)
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
            assert await wait_until(lambda: broker.stats_nowait().loading == 1)
            gate.set()
        assert len(errors) == 4
        stats = broker.stats_nowait()
        assert stats.leased == 0 and stats.waiting_for_lease == 0 and stats.used == {"default": 0}
        load = Loads()
        async with cache.acquire("k", load=load, size=10) as lease:
            assert lease.value == "value-1"
        broker._runner.core.check()


@pytest.mark.anyio
async def test_an_idle_ttl_zero_entry_serves_its_slot_waiters_before_it_goes() -> None:
    load = Loads()
    async with (
        Broker(budget=100) as broker,
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
            assert await wait_until(lambda: broker.stats_nowait().waiting_for_lease == 3)
            await holder.release()
        assert got == ["value-1"] * 3 and load.count == 1
        assert await wait_until(lambda: broker.stats_nowait().entries == 0)
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
            assert await wait_until(lambda: broker.stats_nowait().waiting_for_lease == 2)
            assert (await broker.evict_idle()).entries == 0  # leased: nothing to evict
            assert (await broker.clear()).entries == 0  # leased: goes with its last lease
            assert broker.stats_nowait().waiting_for_lease == 2
            # A new acquire no longer finds the cleared entry: it loads afresh.
            async with cache.acquire("k", load=load, size=10) as fresh:
                assert fresh.value == "value-2"
            await holder.release()
        assert got == ["value-1", "value-1"]
        assert await wait_until(lambda: broker.stats_nowait().releases["clear"] == 1)
        stats = broker.stats_nowait()
        assert stats.leased == 0 and stats.waiting_for_lease == 0
        broker._runner.core.check()


@pytest.mark.anyio
async def test_closing_the_cache_fails_every_slot_waiter_and_joiner() -> None:
    gate = anyio.Event()

    async def slow() -> str:
        await gate.wait()
        return "v"

    errors: list[BaseException] = []
    async with Broker(budget=100) as broker, anyio.create_task_group() as tg:
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
            assert await wait_until(
                lambda: (
                    broker.stats_nowait().waiting_for_lease == 2
                    and broker.stats_nowait().loading == 1
                )
            )

            async def release_when_failed() -> None:
                await wait_until(lambda: len(errors) == 4)
                await holder.release()
                gate.set()

            tg.start_soon(release_when_failed)
    assert len(errors) == 4
    assert broker.stats_nowait().waiting_for_lease == 0


# -- deadlocks: loaders, releasers, hand-offs, lowered limits ----------------------


@pytest.mark.anyio
async def test_a_loader_acquiring_its_own_limited_key_is_a_deadlock_error() -> None:
    async with Broker(budget=100) as broker, broker.cache("m", release, concurrency=1) as cache:

        async def recursive() -> str:
            async with cache.acquire("k", load=recursive, size=10):
                return "never"

        with pytest.raises(DeadlockError):
            await cache.acquire("k", load=recursive, size=10)
        assert broker.stats_nowait().entries == 0


@pytest.mark.anyio
async def test_a_loader_waiting_for_a_slot_its_requester_holds_is_a_deadlock_error() -> None:
    async with Broker(budget=100) as broker, broker.cache("m", release, concurrency=1) as cache:
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
            await wait_until(lambda: outcome, steps=2_000)
            seen = list(outcome)
            tg.cancel_scope.cancel()  # (stuck: let it go)
        assert seen and isinstance(seen[0], DeadlockError)


@pytest.mark.anyio
async def test_a_releaser_waiting_for_a_slot_held_by_the_evicting_request_is_refused() -> None:
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
        Broker(budget=100) as broker,
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
            await wait_until(lambda: outcome, steps=2_000)
            seen = list(outcome)
            tg.cancel_scope.cancel()
        assert seen and isinstance(seen[0], DeadlockError)


@pytest.mark.anyio
async def test_a_lease_handed_to_another_task_makes_the_next_acquire_wait_not_fail() -> None:
    async with Broker(budget=100) as broker, broker.cache("m", release, concurrency=1) as cache:
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
    mine = h.core.request(h.owner, "k", {"m": 10}, "T", slots=2)
    other = h.core.request(h.owner, "k", {"m": 10}, "U")
    h.drain()
    assert mine.outcome is True and other.outcome is True
    again = h.core.request(h.owner, "k", {"m": 10}, "T", slots=1)  # waits: U holds one
    h.drain()
    assert again.outcome is None
    h.end(other)  # now only T's own lease holds the only slot
    h.core.check()
    assert isinstance(again.outcome, DeadlockError)


def test_a_slot_held_by_a_lease_that_may_travel_is_waited_for_not_refused() -> None:
    """The books: an unbound lease (awaited, not entered) may be ended by another task."""
    h = Harness({"m": 100}, instant=True)
    loose = h.core.request(h.owner, "k", {"m": 10}, "T", slots=1, bound=False)
    h.drain()
    assert loose.outcome is True and loose.entry.bound == []
    again = h.core.request(h.owner, "k", {"m": 10}, "T")  # bound: it waits for its turn
    h.drain()
    h.core.check()
    assert again.outcome is None and again in loose.entry.joiners
    h.end(loose)  # ended (by whichever task it was handed to): the waiter takes the slot
    h.core.check()
    assert again.outcome is True and loose.entry.bound == ["T"]
    # Now the slot is bound to T: asking again from T could only wait on itself.
    with pytest.raises(DeadlockError, match=r"p:'k'.*concurrency=1"):
        h.core.request(h.owner, "k", {"m": 10}, "T")


def test_a_lease_granted_later_keeps_whether_it_was_bound() -> None:
    """The books: a slot waiter's ``bound`` goes with the lease it is granted."""
    h = Harness({"m": 100}, instant=True)
    first = h.core.request(h.owner, "k", {"m": 10}, "U", slots=1)
    h.drain()
    waiter = h.core.request(h.owner, "k", {"m": 10}, "T", bound=False)
    h.drain()
    h.end(first)
    h.core.check()
    assert waiter.outcome is True and waiter.entry.bound == []
    # T's only lease may travel: T's next request waits instead of failing.
    nxt = h.core.request(h.owner, "k", {"m": 10}, "T")
    h.drain()
    assert nxt.outcome is None
    h.end(waiter)
    assert nxt.outcome is True


def test_a_task_ending_one_of_two_kinds_of_lease_is_never_refused_falsely() -> None:
    """The books cannot tell which of a task's two leases ended: the bound one is forgotten."""
    h = Harness({"m": 100}, instant=True)
    bound = h.core.request(h.owner, "k", {"m": 10}, "T", slots=2)
    loose = h.core.request(h.owner, "k", {"m": 10}, "T", bound=False)
    h.drain()
    entry = bound.entry
    assert entry.bound == ["T"] and entry.holders == ["T", "T"]
    h.end(bound)
    h.core.check()
    assert entry.bound == [] and entry.leases == 1
    h.core.limit(entry, slots=1)
    again = h.core.request(h.owner, "k", {"m": 10}, "T")  # waits for the lease left
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
            assert await wait_until(lambda: broker.stats_nowait().waiting_for_lease == 9)
            assert counted() == 9 and broker.stats_nowait().waiting == 0
            scopes[0].cancel()
            scopes[4].cancel()
            assert await wait_until(lambda: broker.stats_nowait().waiting_for_lease == 7)
            assert await cache.invalidate("b")  # its waiters still wait for b's slot
            assert broker.stats_nowait().waiting_for_lease == counted() == 7
            for lease in holders:
                await lease.release()
        stats = broker.stats_nowait()
        assert stats.waiting_for_lease == 0 and stats.leased == 0 and counted() == 0


@pytest.mark.anyio
async def test_unlimited_entries_keep_the_hit_path_after_a_limit_was_set_and_lowered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slow: list[Hashable] = []
    original = Cache._acquire_slow

    async def counting(self: Cache, key: Hashable, *args: Any) -> Any:
        slow.append(key)
        return await original(self, key, *args)

    monkeypatch.setattr(Cache, "_acquire_slow", counting)
    async with (
        Broker(budget=100) as broker,
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


# -- priorities through the shell --------------------------------------------------


@pytest.mark.anyio
async def test_a_low_priority_waiter_does_not_hold_back_a_higher_priority_request() -> None:
    async with (
        Broker(budget=100) as broker,
        broker.cache("chat", release, priority=10) as chat,
        broker.cache("embed", release, priority=0) as embed,
    ):
        await (await chat.acquire("llm", load=Loads(), size=100)).release()
        got: list[str] = []

        async def cheap() -> None:  # may not evict llm: it waits (as documented)
            async with embed.acquire("e", load=Loads(), size=50):
                got.append("e")

        async def dear() -> None:  # may evict llm (same priority)
            async with chat.acquire("llm2", load=Loads(), size=50):
                got.append("llm2")

        async with anyio.create_task_group() as tg:
            tg.start_soon(cheap)
            assert await wait_until(lambda: broker.stats_nowait().waiting == 1)
            tg.start_soon(dear)
            await wait_until(lambda: "llm2" in got, steps=2_000)
            seen = list(got)
            tg.cancel_scope.cancel()
        assert "llm2" in seen


class Locked(PolicyBase):
    """A user's policy holding a lock: it cannot be deep-copied."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.idle_entries: dict[PolicyEntry, None] = {}

    def idle(self, entry: PolicyEntry) -> None:
        self.idle_entries[entry] = None

    def busy(self, entry: PolicyEntry) -> None:
        self.idle_entries.pop(entry, None)

    def remove(self, entry: PolicyEntry) -> None:
        self.idle_entries.pop(entry, None)

    def victims(self, shortfall: Any) -> list[PolicyEntry]:
        chosen: list[PolicyEntry] = []
        need = dict(shortfall)
        for entry in self.idle_entries:
            if all(n <= 0 for n in need.values()):
                break
            chosen.append(entry)
            for space, amount in entry.charge.items():
                if space in need:
                    need[space] -= amount
        return chosen if all(n <= 0 for n in need.values()) else []


def test_an_uncopyable_policy_refused_at_a_second_priority_leaves_the_books_consistent() -> None:
    h = Harness({"m": 30}, policy=Locked(), instant=True)
    h.end(ask(h, "a", 10, 0))
    with pytest.raises(InvalidArgument, match="cannot be copied"):
        h.core.request(h.owner, "b", {"m": 10}, "t", priority=1)
    h.drain()
    assert "b" not in h.owner.entries and not h.core.queue
    h.core.check()


@pytest.mark.anyio
async def test_an_uncopyable_policy_refused_at_a_second_priority_leaves_the_broker_usable() -> None:
    async with Broker(budget=20, policy=Locked()) as broker, broker.cache("m", release) as cache:
        await (await cache.acquire("a", load=Loads(), size=10)).release()
        with pytest.raises(InvalidArgument, match="cannot be copied"):
            await cache.acquire("b", load=Loads(), size=10, priority=1)
        async with cache.acquire("c", load=Loads(), size=10) as lease:  # priority 0 again
            assert lease.value == "value-1"
        broker._runner.core.check()


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

                        assert await wait_until(queued)
                    await holder.release()
                assert order == [0, 1, 2] and load.count == 1
                assert await wait_until(
                    lambda: [e["state"] for e in daemon.listing()["entries"]] == ["ready"],
                    steps=20_000,
                )
                daemon.runner.core.check()
                broker._runner.core.check()


@pytest.mark.anyio
async def test_a_priority_given_at_the_first_acquire_reaches_the_shared_broker() -> None:
    async with serving() as daemon:
        async with Broker.connect(daemon.address) as broker:
            dear = Plugin()
            async with (
                broker.cache("dear", dear, priority=9) as high,
                broker.cache("cheap", Plugin(), priority=1) as low,
            ):
                await (await high.acquire("x", load=value("X"), size=60)).release()
                got: list[str] = []

                async def ask() -> None:
                    async with low.acquire("y", load=value("Y"), size=60):
                        got.append("y")

                async with anyio.create_task_group() as tg:
                    tg.start_soon(ask)
                    await wait_until(lambda: dear.released or got, steps=20_000)
                    released, served = list(dear.released), list(got)
                    tg.cancel_scope.cancel()
                assert released == [] and served == []


@pytest.mark.anyio
async def test_a_priority_raised_on_a_ready_entry_reaches_the_shared_broker() -> None:
    async with serving() as daemon:
        async with Broker.connect(daemon.address) as broker:
            plugin = Plugin()
            async with (
                broker.cache("w", plugin) as cache,
                broker.cache("v", Plugin(), priority=5) as other,
            ):
                await (await cache.acquire("x", load=value("X"), size=60)).release()
                # The latest acquire's priority wins: x is now above anything of "v".
                await (await cache.acquire("x", load=value("X"), size=60, priority=9)).release()
                assert cache._owner.entries["x"].priority == 9
                got: list[str] = []

                async def ask() -> None:
                    async with other.acquire("y", load=value("Y"), size=60):
                        got.append("y")

                async with anyio.create_task_group() as tg:
                    tg.start_soon(ask)
                    await wait_until(lambda: plugin.released or got, steps=20_000)
                    released = list(plugin.released)
                    tg.cancel_scope.cancel()
    assert released == []  # in one process, y waits: x is of a higher priority


# -- the books: priorities ------------------------------------------------------------


def ask(h: Harness, key: str, size: int, priority: int | None, task: object = "t") -> Ticket:
    ticket = h.core.request(h.owner, key, {"m": size}, task, priority=priority)
    h.drain()
    return ticket


@pytest.mark.parametrize("policy", POLICIES)
def test_a_waiter_blocked_only_by_priority_holds_back_no_higher_priority_one(policy: str) -> None:
    h = Harness({"m": 100}, policy=make_policy(policy), instant=True)
    h.end(ask(h, "dear", 100, 10))
    low = ask(h, "cheap", 50, 0, task="low")
    assert low.outcome is None  # may not evict "dear": waits, as documented
    high = ask(h, "urgent", 50, 10, task="high")
    h.core.check()
    assert high.outcome is True and ("dear", Reason.CAPACITY) in h.released


def test_a_priority_lowered_outside_a_request_lets_a_waiter_aside_evict_at_once() -> None:
    """The books of a shared broker learn a process's later priority by a report."""
    h = Harness({"m": 100}, instant=True)
    dear = ask(h, "dear", 100, 10)
    h.end(dear)
    low = ask(h, "cheap", 50, 0, task="low")
    assert low.outcome is None  # waits aside: "dear" is above it
    h.core.reprioritize(dear.entry, 10)  # unchanged: still waits
    h.drain()
    assert low.outcome is None and h.released == []
    h.core.reprioritize(dear.entry, 0)  # lowered: the queue is served again
    h.drain()
    h.core.check()
    assert ("dear", Reason.CAPACITY) in h.released and low.outcome is True


def overlap(h: Harness, held: Ticket, times: int = 10) -> None:
    """Lease "busy" again before each lease ends, so that it is never idle."""
    for i in range(times):
        nxt = ask(h, "busy", 40, 0, task=f"b{i}")
        h.end(held)
        if nxt.outcome is not True:  # drained: the key was given up, the new one waits
            h.leave(nxt)
            return
        held = nxt
    # Never drained: the last lease is still held, so "busy" was not released.


def test_drain_dooms_leased_entries_when_nothing_idle_is_in_the_way() -> None:
    """The control for the test below: the same waiter, no higher-priority idle entry."""
    h = Harness({"m": 100}, instant=True)
    h.core.fair_requests = 3
    pinned = ask(h, "dear", 60, 10)
    h.core.configure(pinned.entry, pin=True)
    h.end(pinned)
    held = ask(h, "busy", 40, 0, task="a")
    waiter = ask(h, "want", 40, 0, task="w")
    assert waiter.outcome is None
    overlap(h, held)
    assert ("busy", Reason.CAPACITY) in h.released


def test_drain_does_not_count_idle_bytes_the_waiter_may_not_evict() -> None:
    h = Harness({"m": 100}, instant=True)
    h.core.fair_requests = 3
    h.end(ask(h, "dear", 60, 10))  # idle, but above the waiter's priority
    held = ask(h, "busy", 40, 0, task="a")
    waiter = ask(h, "want", 40, 0, task="w")
    assert waiter.outcome is None
    overlap(h, held)
    assert ("busy", Reason.CAPACITY) in h.released
    assert ("dear", Reason.CAPACITY) not in h.released


@pytest.mark.parametrize("policy", POLICIES)
def test_a_priority_changed_back_to_the_first_seen_one_ranks_with_it(policy: str) -> None:
    h = Harness({"m": 30}, policy=make_policy(policy), instant=True)
    h.end(ask(h, "a", 10, 3))  # the first priority seen: the broker's own policy
    h.end(ask(h, "b", 10, 3))
    h.end(ask(h, "a", 10, 0))  # a second priority: priorities; a moves down
    h.core.check()
    h.end(ask(h, "a", 10, 3))  # and back to the first one
    h.end(ask(h, "c", 10, 1))
    h.core.check()
    priorities = h.core._priorities
    assert priorities is not None
    assert priorities._home[h.owner.entries["a"]] == 3
    # "c" (1) goes first, whatever the ranking: below both others.
    h.end(ask(h, "d", 10, 3))
    assert [k for k, r in h.released if r is Reason.CAPACITY] == ["c"]
    h.core.check()


@pytest.mark.parametrize("policy", POLICIES)
def test_priorities_changed_while_waiting_loading_leased_and_releasing(policy: str) -> None:
    h = Harness({"m": 40}, policy=make_policy(policy))
    core = h.core
    loaded = ask(h, "leased", 10, 0)
    core.load_done(loaded.entry, "v", None, 1.0, 0.0)
    h.loading.remove(loaded.entry)
    h.drain()
    loading = ask(h, "loading", 10, 0)
    idle = ask(h, "idle", 10, 0)
    core.load_done(idle.entry, "v", None, 1.0, 0.0)
    h.loading.remove(idle.entry)
    h.drain()
    h.end(idle)
    waiting = ask(h, "waiting", 20, 0)  # evicts idle: releasing, unacknowledged
    assert waiting.outcome is None and h.releasing == [idle.entry]
    for ticket, priority in ((loaded, 5), (loading, 4), (waiting, 3)):
        core.limit(ticket.entry, priority=priority)
        h.drain()
        core.check()
    core.limit(idle.entry, priority=7)  # releasing
    core.check()
    h.ack(idle.entry)
    core.check()
    core.load_done(loading.entry, "v", None, 1.0, 0.0)
    h.loading.remove(loading.entry)
    h.drain()
    h.end(loading)
    h.end(loaded)
    core.check()
    priorities = core._priorities
    assert priorities is not None
    for entry in core.entries():
        if entry.idle_seq:
            assert priorities._home[entry] == entry.priority
            assert entry in priorities._idle[entry.priority]


def test_merged_spaces_keep_the_priorities_order() -> None:
    h = Harness({"ram": 50, "gpu": 50}, instant=True)
    core = h.core
    for key, space, priority in (("g-high", "gpu", 5), ("r-low", "ram", 0), ("g-low", "gpu", 1)):
        ticket = core.request(h.owner, key, {space: 25}, "t", priority=priority)
        h.drain()
        h.end(ticket)
    core.merge_spaces("ram", "gpu")
    h.drain()
    core.check()
    # Merged: 75 bytes in a space of 50; repaid from the lowest priority up.
    assert [k for k, r in h.released if r is Reason.CAPACITY] == ["r-low"]
    ticket = core.request(h.owner, "new", {"ram": 25}, "t", priority=5)
    h.drain()
    assert ticket.outcome is True
    assert [k for k, r in h.released if r is Reason.CAPACITY] == ["r-low", "g-low"]
    core.check()


# -- the books: a stateful machine ---------------------------------------------------

KEYS = st.sampled_from(list("abcdef"))
BUDGET = {"ram": 100, "gpu": 60}
PRIORITIES = st.one_of(st.none(), st.integers(-1, 2))
SLOTS = st.one_of(st.none(), st.integers(1, 3))


class LimitsMachine(RuleBasedStateMachine):
    """Requests with random priorities and slots on two caches, lease ends, leaves,
    loads that finish (measured bigger or smaller) or fail, releases acknowledged or
    refused, invalidations, clears, sweeps, limit changes, pins, a merge of the spaces,
    capacity changes, and a cache closed, abandoned and opened again.

    After every step: ``Core.check()``; the priorities' own books (every idle entry is idle
    in the tier of its priority, and nothing else is); every pending ticket is still
    among its entry's joiners; and no idle entry was evicted for space while an idle
    entry of a lower priority charged in all its spaces stayed, nor above ``up_to``.
    """

    h: Harness | None = None

    @initialize(
        policy=st.sampled_from(POLICIES),
        qslots=st.one_of(st.none(), st.integers(1, 2)),
        qprio=st.integers(-1, 2),
        instant=st.booleans(),
    )
    def setup(self, policy: str, qslots: int | None, qprio: int, instant: bool) -> None:
        h = self.h = Harness(
            dict(BUDGET), policy=make_policy(policy), idle_ttl=5.0, instant=instant
        )
        h.core.fair_requests = 4
        self.q = h.core.open_owner("q", slots=qslots, priority=qprio)
        self.qdefaults = (qslots, qprio)
        self.held: list[Ticket] = []
        self.pending: list[Ticket] = []
        self.sizes: dict[tuple[str, str], dict[str, int]] = {}
        self.tasks = 0
        self.problems: list[str] = []
        #: Creation order of entries: draws must not depend on set order (ids).
        self.born: dict[Entry, int] = {}
        core = h.core
        start_release = core._start_release

        def checked_release(entry: Entry, reason: Reason) -> None:
            if reason is Reason.CAPACITY and entry.idle_seq:  # (a victim, not a drained one)
                for other in core.entries():
                    if (
                        other is not entry
                        and other.idle_seq
                        and other.priority < entry.priority
                        and set(entry.charge) <= set(other.charge)
                    ):
                        self.problems.append(
                            f"evicted {entry!r} ({entry.priority}) while {other!r} "
                            f"({other.priority}) stayed idle"
                        )
            start_release(entry, reason)

        core._start_release = checked_release  # type: ignore[method-assign]

    def _watch_priorities(self) -> None:
        assert self.h is not None
        priorities = self.h.core._priorities
        if priorities is None or "victims" in vars(priorities):
            return
        victims = priorities.victims

        def checked(shortfall: Any, up_to: int | None = None) -> list[Any]:
            chosen = victims(shortfall, up_to)
            for entry in chosen:
                if up_to is not None and getattr(entry, "priority", 0) > up_to:
                    self.problems.append(f"victim {entry!r} above up_to={up_to}")
            return chosen

        priorities.victims = checked  # type: ignore[method-assign]

    def _collect(self) -> None:
        self._watch_priorities()
        for ticket in list(self.pending):
            if ticket.outcome is True:
                self.pending.remove(ticket)
                self.held.append(ticket)
            elif ticket.outcome is not None:
                self.pending.remove(ticket)

    def _sorted(self, entries: list[Entry]) -> list[Entry]:
        return sorted(entries, key=lambda e: self.born.get(e, -1))

    def _owner(self, which: str) -> Any:
        assert self.h is not None
        return self.h.owner if which == "p" else self.q

    def _request(
        self,
        which: str,
        key: str,
        ram: int,
        gpu: int,
        task: int,
        priority: int | None,
        slots: int | None,
    ) -> None:
        assert self.h is not None
        h = self.h
        need = self.sizes.setdefault(
            (which, key), {k: v for k, v in {"ram": ram, "gpu": gpu}.items() if v}
        )
        self.tasks += 1
        who = task if task else self.tasks + 100
        try:
            ticket = h.core.request(
                self._owner(which), key, dict(need), who, priority=priority, slots=slots
            )
        except (DeadlockError, OutOfSpace, BrokerClosed) as exc:
            note(f"request {which}:{key} raised {exc!r}")
            h.drain()
            self._collect()
            return
        self.born.setdefault(ticket.entry, len(self.born))
        h.drain()
        note(
            f"request {which}:{key} {need} task={who} p={priority} s={slots} -> {ticket.outcome!r}"
        )
        if ticket.outcome is True:
            self.held.append(ticket)
        elif ticket.outcome is None:
            self.pending.append(ticket)
        self._collect()

    @rule(
        which=st.sampled_from("pq"),
        key=KEYS,
        ram=st.integers(0, 35),
        gpu=st.integers(0, 25),
        task=st.integers(0, 3),
        priority=PRIORITIES,
        slots=SLOTS,
    )
    def request(self, **kwargs: Any) -> None:
        self._request(**kwargs)

    @rule(
        which=st.sampled_from("pq"),
        key=KEYS,
        ram=st.integers(0, 35),
        gpu=st.integers(0, 25),
        task=st.integers(0, 3),
        priority=PRIORITIES,
        slots=SLOTS,
    )
    def request_again(self, **kwargs: Any) -> None:  # (requests weigh more than the rest)
        self._request(**kwargs)

    @rule(which=st.sampled_from("pq"), key=KEYS, task=st.integers(0, 3), slots=st.integers(1, 2))
    def request_limited(self, which: str, key: str, task: int, slots: int) -> None:
        self._request(which, key, 10, 0, task, None, slots)

    @precondition(lambda self: self.h is not None and self.held)
    @rule(data=st.data())
    def end(self, data: st.DataObject) -> None:
        assert self.h is not None
        ticket = data.draw(st.sampled_from(self.held))
        self.held.remove(ticket)
        note(f"end {ticket.entry!r} task={ticket.task}")
        self.h.end(ticket)
        self._collect()

    @precondition(lambda self: self.h is not None and self.held)
    @rule(data=st.data())
    def end_again(self, data: st.DataObject) -> None:
        self.end(data)

    @precondition(lambda self: self.h is not None and self.pending)
    @rule(data=st.data())
    def leave(self, data: st.DataObject) -> None:
        assert self.h is not None
        ticket = data.draw(st.sampled_from(self.pending))
        self.pending.remove(ticket)
        note(f"leave {ticket.entry!r} task={ticket.task}")
        self.h.leave(ticket)
        self._collect()

    @precondition(lambda self: self.h is not None and self.h.loading)
    @rule(data=st.data(), ok=st.booleans(), grow=st.integers(-5, 10))
    def finish(self, data: st.DataObject, ok: bool, grow: int) -> None:
        assert self.h is not None
        entry = data.draw(st.sampled_from(self._sorted(self.h.loading)))
        note(f"finish {entry!r} ok={ok} grow={grow}")
        if ok:
            measured = (
                {k: min(max(0, v + grow), 100) for k, v in entry.charge.items()} if grow else None
            )
            self.h.finish(entry, measured=measured)
        else:
            self.h.fail(entry, RuntimeError("boom"))
        self._collect()

    @precondition(lambda self: self.h is not None and self.h.cancelled)
    @rule()
    def cancelled_load_ends(self) -> None:
        assert self.h is not None
        entry = self._sorted(self.h.cancelled)[0]
        self.h.cancelled.remove(entry)
        if entry in self.h.loading:
            note(f"cancelled load of {entry!r} ends")
            self.h.loading.remove(entry)
            self.h.core.load_failed(entry, RuntimeError("cancelled"), cancelled=True)
            self.h.drain()
        self._collect()

    @precondition(lambda self: self.h is not None and self.h.releasing)
    @rule(data=st.data(), ok=st.booleans())
    def released(self, data: st.DataObject, ok: bool) -> None:
        assert self.h is not None
        entry = data.draw(st.sampled_from(self._sorted(self.h.releasing)))
        note(f"release of {entry!r} ok={ok}")
        if ok:
            self.h.ack(entry)
        else:
            self.h.refuse(entry)
        self._collect()

    @rule(which=st.sampled_from("pq"), key=KEYS)
    def invalidate(self, which: str, key: str) -> None:
        assert self.h is not None
        note(f"invalidate {which}:{key}")
        self.h.core.invalidate(self._owner(which), key)
        self.h.drain()
        self._collect()

    @rule()
    def clear(self) -> None:
        assert self.h is not None
        note("clear")
        self.h.core.clear()
        self.h.drain()
        self._collect()

    @rule(dt=st.floats(0, 10))
    def sweep(self, dt: float) -> None:
        assert self.h is not None
        self.h.now += dt
        note(f"sweep at {self.h.now}")
        self.h.core.sweep(self.h.now)
        self.h.drain()
        self._collect()

    @rule(which=st.sampled_from("pq"), key=KEYS, slots=SLOTS, priority=PRIORITIES)
    def limit(self, which: str, key: str, slots: int | None, priority: int | None) -> None:
        assert self.h is not None
        entry = self._owner(which).entries.get(key)
        if entry is None:
            return
        note(f"limit {entry!r} slots={slots} priority={priority}")
        self.h.core.limit(entry, slots=slots, priority=priority)
        self.h.drain()
        self._collect()

    @rule(which=st.sampled_from("pq"), key=KEYS, pin=st.booleans())
    def pin(self, which: str, key: str, pin: bool) -> None:
        assert self.h is not None
        owner = self._owner(which)
        entry = owner.entries.get(key)
        if entry is None:
            return
        if pin:
            if entry.state is State.READY and entry.leases:  # (as acquire(pin=True) does)
                note(f"pin {entry!r}")
                self.h.core.configure(entry, pin=True)
        else:
            note(f"unpin {entry!r}")
            self.h.core.unpin(owner, key, self.h.now)
            self.h.drain()
        self._collect()

    @precondition(lambda self: self.h is not None and "gpu" in self.h.core.canon_names)
    @rule()
    def merge(self) -> None:
        assert self.h is not None
        note("merge gpu into ram")
        self.h.core.merge_spaces("ram", "gpu")
        self.h.drain()
        self._collect()

    @rule(capacity=st.integers(40, 100))
    def capacity(self, capacity: int) -> None:
        assert self.h is not None
        note(f"capacity of ram {capacity}")
        self.h.core.set_capacity("ram", capacity)
        self.h.drain()
        self._collect()

    @precondition(lambda self: self.h is not None and not self.q.closing)
    @rule()
    def close_q(self) -> None:
        assert self.h is not None
        note("close q")
        self.h.core.close_owner(self.q, BrokerClosed("q closed"))
        self.h.drain()
        self._collect()

    @precondition(lambda self: self.h is not None and self.q.closing)
    @rule()
    def reopen_q(self) -> None:
        assert self.h is not None
        core = self.h.core
        if self.q.live:
            note("abandon q")
            core.abandon(self.q)
            self.h.drain()
            if self.q.live:
                return
        note("reopen q")
        core.forget_owner(self.q)
        slots, priority = self.qdefaults
        self.q = core.open_owner("q", slots=slots, priority=priority)
        self.sizes = {k: v for k, v in self.sizes.items() if k[0] != "q"}
        self._collect()

    @invariant()
    def books_add_up(self) -> None:
        if self.h is None:
            return
        assert not self.problems, self.problems
        core = self.h.core
        core.check()
        priorities = core._priorities
        if priorities is not None:
            for entry in core.entries():
                if entry.idle_seq:
                    home = priorities._home.get(entry)
                    assert home == entry.priority, (entry, home, entry.priority)
                    assert entry in priorities._idle[home], entry
            for priority, idle in priorities._idle.items():
                for member in idle:
                    assert isinstance(member, Entry), member
                    assert member.idle_seq and member.state is State.READY, (priority, member)
                    assert member.priority == priority, (priority, member)
        for ticket in self.pending:
            assert ticket in ticket.entry.joiners, (ticket.entry, ticket.entry.state)


TestLimitsMachine = LimitsMachine.TestCase
TestLimitsMachine.settings = settings(max_examples=60, stateful_step_count=100, deadline=None)
