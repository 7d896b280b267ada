"""Eviction priorities: lower priorities go first, whatever the policy; never above the requester.

The books are driven directly for the rules (every built-in policy, and a
user's), then the shell on every backend for the public arguments. Then
attacks: priorities through the shell and through a connected broker with a
real daemon, the books' priorities changed in every state, and a stateful
machine mixing every step with random priorities and lease slots
(``concurrency=``) under every built-in policy, checking ``Core.check()``, the
priorities' own bookkeeping and the eviction order after every step. Among the
bugs they found, fixed: a shared broker evicted a connected process's entry by
the priority it was loaded with (a later acquire's priority is reported to it
now).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cachebroker import (
    AcquireTimeout,
    Broker,
    BrokerClosed,
    DeadlockError,
    InvalidArgument,
    OutOfSpace,
    PolicyBase,
    PolicyEntry,
)
from cachebroker._core import Entry, Reason, Request, State, Ticket, _transitions
from cachebroker._policies import make_policy
from tests.brokers import open_broker
from tests.harness import Harness
from tests.helpers import steps_until, watch
from tests.remote.support import Plugin, serving, value
from tests.shell.support import Loads, release

POLICIES = ["lru", "fifo", "gdsf", "cost"]


def ask(h: Harness, key: str, size: int, priority: int | None, task: object = "t") -> Ticket:
    ticket = h.core.request(h.owner, Request(key, {"m": size}, priority=priority), task)
    h.drain()
    return ticket


def load_idle(h: Harness, key: str, size: int, priority: int) -> None:
    ticket = ask(h, key, size, priority)
    assert ticket.outcome is True
    h.end(ticket)


@pytest.mark.parametrize("policy", POLICIES)
def test_the_lower_priority_goes_first_whatever_the_ranking(policy: str) -> None:
    h = Harness({"m": 30}, policy=make_policy(policy), instant=True)
    load_idle(h, "old-but-dear", 10, priority=5)  # least recent, loaded first
    load_idle(h, "middle", 10, priority=0)
    load_idle(h, "recent", 10, priority=0)
    for _ in range(3):  # popular, too
        h.end(ask(h, "old-but-dear", 10, 5))
    load_idle(h, "new", 10, priority=5)
    evicted = [key for key, reason in h.released if reason is Reason.CAPACITY]
    assert len(evicted) == 1 and evicted[0] in ("middle", "recent")
    h.core.check()


@pytest.mark.parametrize("policy", POLICIES)
def test_a_request_never_evicts_above_its_own_priority(policy: str) -> None:
    h = Harness({"m": 20}, policy=make_policy(policy), instant=True)
    load_idle(h, "high", 10, priority=2)
    load_idle(h, "low", 10, priority=0)
    # Priority 1 may evict "low" but not "high".
    h.end(ask(h, "mid", 10, priority=1))
    assert [key for key, _ in h.released] == ["low"]
    # A priority-0 request finds only higher priorities idle: it waits.
    waiting = ask(h, "lower", 20, priority=0)
    assert waiting.outcome is None and [key for key, _ in h.released] == ["low"]
    h.core.check()
    # The priority-2 request may evict both.
    h.leave(waiting)
    h.end(ask(h, "top", 20, priority=2))
    assert sorted(str(key) for key, _ in h.released) == ["high", "low", "mid"]
    h.core.check()


def test_pinned_entries_stay_whatever_their_priority() -> None:
    h = Harness({"m": 20}, instant=True)
    pinned = ask(h, "pinned", 10, priority=-5)
    h.core.configure(pinned.entry, pin=True)
    h.end(pinned)
    load_idle(h, "other", 10, priority=3)
    h.end(ask(h, "new", 10, priority=3))
    assert [key for key, _ in h.released] == ["other"]


def test_a_changed_priority_moves_the_entry() -> None:
    h = Harness({"m": 20}, instant=True)
    load_idle(h, "a", 10, priority=0)
    load_idle(h, "b", 10, priority=1)
    h.end(ask(h, "a", 10, priority=4))  # the latest request's priority wins
    h.end(ask(h, "c", 10, priority=4))
    assert [key for key, _ in h.released] == ["b"]
    h.core.check()


@st.composite
def steps(draw: st.DrawFn) -> list[tuple[str, int, int]]:
    return draw(
        st.lists(
            st.tuples(st.sampled_from("abcdefg"), st.integers(1, 12), st.integers(0, 2)),
            min_size=1,
            max_size=40,
        )
    )


@settings(deadline=None, max_examples=60)
@given(policy=st.sampled_from(POLICIES), requests=steps())
def test_no_victim_while_an_idle_entry_of_lower_priority_stays(
    policy: str, requests: list[tuple[str, int, int]]
) -> None:
    """Every built-in policy: evictions take lower priorities first, none above the requester."""
    h = Harness({"m": 30}, policy=make_policy(policy), instant=True)
    sizes: dict[str, int] = {}
    for key, size, priority in requests:
        size = sizes.setdefault(key, size)
        idle_before = {
            e.key: e.priority
            for e in h.owner.live
            if e.state is State.READY and not e.leases and not e.pinned
        }
        before = len(h.released)
        ticket = ask(h, key, size, priority)
        victims = [k for k, reason in h.released[before:] if reason is Reason.CAPACITY]
        note(f"{key} size {size} priority {priority}: victims {victims}")
        for victim in victims:
            assert idle_before[victim] <= priority
            for other, other_priority in idle_before.items():
                if other not in victims:
                    assert other_priority >= idle_before[victim], (victim, other)
        h.core.check()
        if ticket.outcome is True:
            h.end(ticket)
        elif ticket.outcome is None:
            h.leave(ticket)
        h.core.check()


class Biggest(PolicyBase):
    """A user's policy: the biggest idle entries first."""

    def __init__(self) -> None:
        self.idle_entries: dict[PolicyEntry, None] = {}

    def idle(self, entry: PolicyEntry) -> None:
        self.idle_entries[entry] = None

    def busy(self, entry: PolicyEntry) -> None:
        self.idle_entries.pop(entry, None)

    def remove(self, entry: PolicyEntry) -> None:
        self.idle_entries.pop(entry, None)

    def victims(self, shortfall: Mapping[str, int]) -> list[PolicyEntry]:
        chosen: list[PolicyEntry] = []
        need = sum(shortfall.values())
        for entry in sorted(self.idle_entries, key=lambda e: -sum(e.charge.values())):
            if need <= 0:
                break
            chosen.append(entry)
            need -= sum(entry.charge.values())
        return chosen if need <= 0 else []


def test_a_users_policy_is_copied_per_priority() -> None:
    policy = Biggest()
    h = Harness({"m": 30}, policy=policy, instant=True)
    load_idle(h, "big-high", 15, priority=1)
    load_idle(h, "small-low", 5, priority=0)
    load_idle(h, "mid-low", 10, priority=0)
    h.end(ask(h, "new", 10, priority=1))
    # The biggest first, but among priority 0 only.
    assert [key for key, _ in h.released] == ["mid-low"]
    # The user's own instance still ranks the priority it was given first.
    assert {e.key for e in policy.idle_entries} == {"big-high"}


class Locked(Biggest):
    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()  # cannot be deep-copied


def test_a_policy_that_cannot_be_copied_is_a_clear_error_at_the_second_priority() -> None:
    h = Harness({"m": 30}, policy=Locked(), instant=True)
    load_idle(h, "a", 10, priority=0)
    with pytest.raises(InvalidArgument, match="Locked cannot be copied"):
        ask(h, "b", 10, priority=1)


# -- the shell -------------------------------------------------------------------


async def load_v() -> str:
    return "v"


@pytest.mark.anyio
async def test_cache_defaults_and_acquire_overrides(kind: str) -> None:
    async with (
        open_broker(kind, budget=30) as broker,
        broker.cache("chat", release, priority=5) as chat,
        broker.cache("embed", release) as embed,
    ):
        await (await chat.acquire("llm", load=load_v, size=10)).release()
        await (await embed.acquire("e1", load=load_v, size=10)).release()
        await (await embed.acquire("e2", load=load_v, size=10, priority=9)).release()
        # Room for one more: e1 (priority 0) goes, not the chat model loaded before it.
        await (await chat.acquire("llm2", load=load_v, size=10)).release()
        assert set(chat._owner.entries) == {"llm", "llm2"}
        assert set(embed._owner.entries) == {"e2"}


@pytest.mark.anyio
async def test_a_request_that_only_higher_priorities_could_serve_times_out_saying_so(
    kind: str,
) -> None:
    async with open_broker(kind, budget=20) as broker, broker.cache("m", release) as cache:
        await (await cache.acquire("dear", load=load_v, size=20, priority=3)).release()
        with pytest.raises(AcquireTimeout) as caught:
            await cache.acquire("cheap", load=load_v, size=10, priority=1, timeout=0.05)
        assert caught.value.waiting_for == "space"
        assert "higher priority than its 1" in str(caught.value)
        assert broker.stats_nowait().used == {"default": 20}  # never over-committed
        async with anyio.create_task_group():
            pass


# -- priorities through the shell --------------------------------------------------


@pytest.mark.anyio
async def test_a_low_priority_waiter_does_not_hold_back_a_higher_priority_request(
    kind: str,
) -> None:
    async with (
        open_broker(kind, budget=100) as broker,
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
            assert await steps_until(lambda: broker.stats_nowait().waiting == 1)
            tg.start_soon(dear)
            await steps_until(lambda: "llm2" in got, steps=2_000)
            seen = list(got)
            tg.cancel_scope.cancel()
        assert "llm2" in seen


class Uncopyable(PolicyBase):
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
    h = Harness({"m": 30}, policy=Uncopyable(), instant=True)
    h.end(ask(h, "a", 10, 0))
    with pytest.raises(InvalidArgument, match="cannot be copied"):
        h.core.request(h.owner, Request("b", {"m": 10}, priority=1), "t")
    h.drain()
    assert "b" not in h.owner.entries and not h.core.queue
    h.core.check()


@pytest.mark.anyio
async def test_an_uncopyable_policy_refused_at_a_second_priority_leaves_the_broker_usable(
    kind: str,
) -> None:
    async with (
        open_broker(kind, budget=20, policy=Uncopyable()) as broker,
        broker.cache("m", release) as cache,
    ):
        await (await cache.acquire("a", load=Loads(), size=10)).release()
        with pytest.raises(InvalidArgument, match="cannot be copied"):
            await cache.acquire("b", load=Loads(), size=10, priority=1)
        async with cache.acquire("c", load=Loads(), size=10) as lease:  # priority 0 again
            assert lease.value == "value-1"
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
                    await steps_until(lambda: dear.released or got, steps=20_000)
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
                    await steps_until(lambda: plugin.released or got, steps=20_000)
                    released = list(plugin.released)
                    tg.cancel_scope.cancel()
    assert released == []  # in one process, y waits: x is of a higher priority


# -- the books: priorities ------------------------------------------------------------


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
    priorities = h.core.priorities
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
    priorities = core.priorities
    assert priorities is not None
    for entry in core.entries():
        if entry.idle_seq:
            assert priorities._home[entry] == entry.priority
            assert entry in priorities._idle[entry.priority]


def test_merged_spaces_keep_the_priorities_order() -> None:
    h = Harness({"ram": 50, "gpu": 50}, instant=True)
    core = h.core
    for key, space, priority in (("g-high", "gpu", 5), ("r-low", "ram", 0), ("g-low", "gpu", 1)):
        ticket = core.request(h.owner, Request(key, {space: 25}, priority=priority), "t")
        h.drain()
        h.end(ticket)
    core.merge_spaces("ram", "gpu")
    h.drain()
    core.check()
    # Merged: 75 bytes in a space of 50; repaid from the lowest priority up.
    assert [k for k, r in h.released if r is Reason.CAPACITY] == ["r-low"]
    ticket = core.request(h.owner, Request("new", {"ram": 25}, priority=5), "t")
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
    unwatch: Any = None

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

        self.unwatch = watch(_transitions, "start_release", core, checked_release)

    def _watch_priorities(self) -> None:
        assert self.h is not None
        priorities = self.h.core.priorities
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
                self._owner(which), Request(key, dict(need), priority=priority, slots=slots), who
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

    @precondition(lambda self: self.h is not None and "gpu" in self.h.core.canon.names)
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
        priorities = core.priorities
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

    def teardown(self) -> None:
        if self.unwatch is not None:
            self.unwatch()


TestLimitsMachine = LimitsMachine.TestCase
TestLimitsMachine.settings = settings(max_examples=60, stateful_step_count=100, deadline=None)
