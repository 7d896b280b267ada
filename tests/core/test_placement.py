"""Placement: ``acquire(spaces=[...])`` puts a value where there is room, or where
eviction costs least, and tells the loader where.

The books driven directly (which space is chosen, FIFO per space, refusal),
then the shell on every backend. Then the attacks: a stateful machine drives
the books with placed and single-space requests mixed, over every policy and
with tiers; then targeted scenarios on the books (per-space first come first
served, holders passing, quarantine, aliases, successors, measured sizes,
demotions) and on the shell on every backend (what the loader is told,
timeouts, cancellation, prefetch, a connected broker). Each bug they found is
fixed, its scenario kept here.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Mapping
from typing import Any, ClassVar

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
    OutOfSpace,
    RequestTooLarge,
)
from cachebroker._core import Entry, Request, State, Ticket, _transitions
from cachebroker._policies import GDSF, make_policy
from cachebroker._remote._daemon import Daemon, DaemonBroker
from tests.brokers import open_broker
from tests.harness import Harness, waits_aside
from tests.helpers import socket_path, watch

GPUS = ("gpu0", "gpu1")


def gpus(**options: Any) -> Harness:
    return Harness({"gpu0": 100, "gpu1": 100}, **options)


def place(
    h: Harness,
    key: str,
    size: int = 60,
    *,
    task: Hashable = "t",
    places: tuple[str, ...] = GPUS,
    cost: float | None = None,
    priority: int | None = None,
) -> Ticket:
    ticket = h.core.request(
        h.owner, Request(key, {places[0]: size}, cost=cost, priority=priority, places=places), task
    )
    h.drain()
    return ticket


def loaded(h: Harness, key: str, size: int = 60, *, cost: float | None = None) -> Ticket:
    ticket = place(h, key, size, cost=cost)
    h.finish(ticket.entry)
    return ticket


def test_the_first_space_with_room_is_chosen_without_evicting() -> None:
    h = gpus()
    a = loaded(h, "a")
    b = loaded(h, "b")
    assert a.entry.charge == {"gpu0": 60} and b.entry.charge == {"gpu1": 60}
    c = place(h, "c", 30)  # fits beside a
    assert c.entry.charge == {"gpu0": 30} and h.released == []


def test_the_space_whose_eviction_costs_least_reload_time_is_chosen() -> None:
    h = gpus()
    h.end(loaded(h, "a", cost=50.0))
    h.end(loaded(h, "b", cost=5.0))
    ticket = place(h, "c")
    assert [key for key, _ in h.released] == ["b"]  # gpu1's victim reloads faster
    h.ack(h.owner.entries["b"])
    assert ticket.entry.state is State.LOADING and ticket.entry.charge == {"gpu1": 60}


def test_ties_go_to_the_earlier_space() -> None:
    h = gpus()
    h.end(loaded(h, "a", cost=5.0))
    h.end(loaded(h, "b", cost=5.0))
    place(h, "c")
    assert [key for key, _ in h.released] == ["a"]


def test_releases_under_way_are_waited_for_before_anything_more_is_evicted() -> None:
    h = gpus()
    h.end(loaded(h, "a", cost=50.0))
    h.end(loaded(h, "b", cost=5.0))
    place(h, "c")  # b's release is under way on gpu1
    d = place(h, "d", 30)  # fits gpu0 beside a: no eviction, no wait
    assert d.entry.state is State.LOADING and d.entry.charge == {"gpu0": 30}
    assert [key for key, _ in h.released] == ["b"]


def test_first_come_first_served_holds_in_every_space_it_may_use() -> None:
    h = gpus()
    a = loaded(h, "a", 80)  # leased: nothing on gpu0 can be evicted
    b = loaded(h, "b", 80)  # leased on gpu1
    waiter = place(h, "c", 60, task="u")  # cannot be covered anywhere: first in both
    late = h.acquire("d", {"gpu1": 30}, task="v")
    assert waiter.entry.state is State.WAITING and late.entry.state is State.WAITING
    h.end(b)  # b idle: c is first in line for gpu1, so c gets it, not d
    h.ack(h.owner.entries["b"])
    assert waiter.entry.state is State.LOADING and waiter.entry.charge == {"gpu1": 60}
    assert late.entry.state is State.LOADING  # then d fits beside it
    h.end(a)
    h.core.check()


def test_a_space_too_small_is_left_out_and_all_too_small_is_refused() -> None:
    h = Harness({"gpu0": 50, "gpu1": 100})
    ticket = place(h, "a", 60)
    assert ticket.entry.places is None and ticket.entry.charge == {"gpu1": 60}
    with pytest.raises(RequestTooLarge):
        place(h, "b", 150)


def test_a_space_only_the_requesters_own_leases_could_free_is_left_out() -> None:
    h = gpus()
    mine = loaded(h, "a", 80)  # held by task "t"
    h.end(loaded(h, "b", 80))
    ticket = place(h, "c", 60, task="t")
    assert [key for key, _ in h.released] == ["b"]  # not a wait on its own lease
    h.ack(h.owner.entries["b"])
    assert ticket.entry.charge == {"gpu1": 60}
    h.end(mine)
    h.core.check()


def test_only_its_own_leases_anywhere_is_a_deadlock() -> None:
    h = gpus()
    loaded(h, "a", 80)
    loaded(h, "b", 80)
    with pytest.raises(DeadlockError):
        place(h, "c", 60, task="t")


def test_a_demoted_value_is_placed_again_when_it_comes_back_up() -> None:
    h = Harness(
        {"gpu0": 100, "gpu1": 100, "ram": 100},
        tiers={"gpu0": "ram", "gpu1": "ram"},
        moves=True,
    )
    h.end(loaded(h, "a", cost=50.0))  # gpu0
    busy = loaded(h, "b", cost=50.0)  # gpu1, leased
    c = place(h, "c")  # a goes down to ram
    a = h.owner.entries["a"]
    h.move(a)
    h.finish(c.entry)  # c on gpu0, leased
    h.end(busy)  # gpu1's b is idle now
    ticket = place(h, "a")  # a comes back up where eviction is possible: gpu1
    assert a.state is State.DEMOTED and a in h.core.queue
    b = h.owner.entries["b"]
    assert b.state in (State.MOVING, State.RELEASING)
    if b.state is State.MOVING:
        h.move(b)
    else:
        h.ack(b)
    assert a.state is State.MOVING and h.moving[-1] == (a, "gpu1")
    h.move(a)
    assert ticket.outcome is True and a.charge == {"gpu1": 60}
    h.core.check()


def demoted_from_gpu1(h: Harness) -> tuple[Ticket, Entry]:
    """``a`` placed while task ``t`` holds 80 of gpu0 (so loaded on gpu1), then moved
    down to ram; returns ``t``'s lease on gpu0 and ``a``'s entry."""
    mine = h.acquire("x", {"gpu0": 80}, task="t")
    h.finish(mine.entry)
    first = place(h, "a", task="t")  # gpu0 left out of this request: t's own lease
    a = first.entry
    assert a.places is None and a.need == {"gpu1": 60}
    assert a.asked_places == GPUS  # the entry keeps every place asked for
    h.finish(a)
    h.end(first)
    busy = h.acquire("c", {"gpu1": 90}, task="u")  # a moves down to ram
    h.move(a)
    h.finish(busy.entry)
    assert a.state is State.DEMOTED
    return mine, a


def tiered_gpus() -> Harness:
    return Harness(
        {"gpu0": 100, "gpu1": 100, "ram": 100},
        tiers={"gpu0": "ram", "gpu1": "ram"},
        moves=True,
    )


def test_a_promotion_chooses_again_among_every_place_its_acquire_asked_for() -> None:
    h = tiered_gpus()
    mine, a = demoted_from_gpu1(h)
    h.end(mine)
    assert h.core.invalidate(h.owner, "x")
    h.drain()
    h.ack(h.owner.entries["x"])  # gpu0 is empty; gpu1 is c's, leased
    again = h.core.request(h.owner, Request("a"), "t")
    h.drain()
    assert a.places == GPUS  # t holds no lease now: both places are open to it
    assert a.state is State.MOVING and h.moving == [(a, "gpu0")]
    h.move(a)
    assert again.outcome is True and a.charge == {"gpu0": 60}
    h.core.check()


def test_a_place_left_out_for_the_promoting_requesters_own_lease_is_out_of_that_wait_only() -> None:
    h = tiered_gpus()
    _, a = demoted_from_gpu1(h)  # t still holds x, 80 of gpu0
    again = h.core.request(h.owner, Request("a"), "t")
    h.drain()
    # In gpu0 only t's own lease could make room: this promotion waits in gpu1.
    assert a in h.core.queue and a.places is None and a.need == {"gpu1": 60}
    assert a.asked_places == GPUS
    h.leave(again)
    again = h.core.request(h.owner, Request("a"), "v")  # another task: gpu0 is open to it
    h.drain()
    assert a in h.core.queue and a.places == GPUS
    h.core.check()


# -- the shell -----------------------------------------------------------------


async def release(key: Hashable, value: Any) -> None:
    pass


def device_loader(key: str, seen: list[str]) -> Any:
    async def load(space: str) -> str:
        seen.append(space)
        await anyio.lowlevel.checkpoint()
        return f"{key}@{space}"

    return load


@pytest.mark.anyio
async def test_the_loader_is_told_where_its_value_was_placed(kind: str) -> None:
    seen: list[str] = []
    async with (
        open_broker(kind, {"cuda:0": "10GiB", "cuda:1": "10GiB"}) as broker,
        broker.cache("m", release) as cache,
    ):
        spaces = ["cuda:0", "cuda:1"]
        first = await cache.acquire("a", load=device_loader("a", seen), size="6GiB", spaces=spaces)
        second = await cache.acquire("b", load=device_loader("b", seen), size="6GiB", spaces=spaces)
        assert (first.value, second.value) == ("a@cuda:0", "b@cuda:1")
        infos = {info.key: info.charge for info in await broker.entries()}
        assert infos == {"a": {"cuda:0": 6 << 30}, "b": {"cuda:1": 6 << 30}}
        await first.release()
        await second.release()
        assert seen == ["cuda:0", "cuda:1"]


@pytest.mark.anyio
async def test_a_plain_loader_in_a_thread_and_a_plain_measure_follow_the_placement(
    kind: str,
) -> None:
    async with (
        open_broker(kind, {"cuda:0": "10GiB", "cuda:1": "10GiB"}) as broker,
        broker.cache("m", release) as cache,
    ):
        blocker = await cache.acquire("x", load=lambda space: space, size="8GiB", spaces=["cuda:0"])
        lease = await cache.acquire(
            "y",
            load=lambda space: space,
            size="6GiB",
            measure=lambda value: "5GiB",
            spaces=["cuda:0", "cuda:1"],
        )
        assert (blocker.value, lease.value) == ("cuda:0", "cuda:1")
        assert (await broker.stats()).used == {"cuda:0": 8 << 30, "cuda:1": 5 << 30}
        await lease.release()
        await blocker.release()


@pytest.mark.anyio
async def test_prefetch_places_too(kind: str) -> None:
    async with (
        open_broker(kind, {"cuda:0": "10GiB", "cuda:1": "10GiB"}) as broker,
        broker.cache("m", release) as cache,
    ):
        await cache.prefetch("a", load=lambda space: space, size="8GiB", spaces=["cuda:0"])
        await cache.prefetch(
            "b", load=lambda space: space, size="8GiB", spaces=["cuda:0", "cuda:1"]
        )
        infos = {info.key: info.charge for info in await broker.entries()}
        assert infos["b"] == {"cuda:1": 8 << 30}


@pytest.mark.parametrize(
    ("spaces", "size", "error", "message"),
    [
        ("cuda:0", "1GiB", TypeError, "list of space names"),
        ([], "1GiB", InvalidArgument, "at least one"),
        (["cuda:0", "cuda:9"], "1GiB", InvalidArgument, "not in the budget"),
        (["cuda:0", "cuda:0"], "1GiB", InvalidArgument, "twice"),
        (["cuda:0", 1], "1GiB", TypeError, "names"),
        (["cuda:0"], {"cuda:0": "1GiB"}, InvalidArgument, "size must be"),
        (["cuda:0"], None, InvalidArgument, "size must be"),
        (["cuda:0"], "lots", InvalidArgument, "lots"),
    ],
)
@pytest.mark.anyio
async def test_bad_spaces_are_refused_naming_the_entry(
    spaces: Any, size: Any, error: type[Exception], message: str, kind: str
) -> None:
    async with (
        open_broker(kind, {"cuda:0": "10GiB", "cuda:1": "10GiB"}) as broker,
        broker.cache("m", release) as cache,
    ):
        with pytest.raises(error, match=message):
            cache.acquire("k", load=lambda space: space, size=size, spaces=spaces)
        with pytest.raises(error, match=message):
            await cache.prefetch("k", load=lambda space: space, size=size, spaces=spaces)


# == attacks ===================================================================
#
# A stateful machine drives the books with placed and single-space requests
# mixed, over every policy and with tiers; then targeted scenarios on the books,
# on the shell on every backend, and on a connected broker. Each bug they found
# is fixed, its scenario kept here.


BUDGET = {"gpu0": 100, "gpu1": 100, "gpu2": 60, "ram": 120}
GPU_NAMES = ("gpu0", "gpu1", "gpu2")
PLACES = st.lists(st.sampled_from(GPU_NAMES), min_size=1, max_size=3, unique=True).map(tuple)
SINGLE = st.sampled_from([("gpu0",), ("gpu1",), ("gpu2",), ("ram",), ("gpu0", "ram")])
#: With tiers, no entry charged in a tiered space and its lower tier at once:
#: ``test_an_entry_charged_in_its_lower_tier_too_is_not_its_own_victim_there``.
TIERED_SINGLE = st.sampled_from([("gpu0",), ("gpu1",), ("gpu2",), ("ram",), ("gpu2", "ram")])
KEYS = st.sampled_from(["a", "b", "c", "d", "e", "f"])
TASKS = st.sampled_from([1, 2, 3])
COSTS = st.sampled_from([None, 0.5, 5.0, 50.0])
PRIORITIES = st.sampled_from([None, None, 0, 1])


class PlacementMachine(RuleBasedStateMachine):
    """Invariants, checked after every step:

    * the books add up (``Core.check``), so no space's ``used`` exceeds its
      capacity unless a load was measured larger than it declared;
    * a placed entry waits for one of its places, and, once granted, is
      charged in exactly one of the places it was asked for;
    * first come first served per space: a grant never passes an earlier
      waiter (of its priority or above) that waits for the same space and
      could be granted there, unless the later request's task holds a
      lease (holders pass) or no eviction could let the earlier one in
      (it waits aside: ``tests.harness.waits_aside``);
    * once every load, move and release has ended and every lease is given
      back, nothing waits and nothing is charged.
    """

    policy: ClassVar[str] = "lru"
    tiered: ClassVar[bool] = False

    def __init__(self) -> None:
        super().__init__()
        tiers = {"gpu0": "ram", "gpu1": "ram"} if self.tiered else None
        self.h = Harness(BUDGET, policy=make_policy(self.policy), tiers=tiers, moves=self.tiered)
        self.tickets: list[Ticket] = []
        #: The places each placed entry was asked for, as given.
        self.asked: dict[Entry, tuple[str, ...]] = {}
        self.quarantined: list[Entry] = []
        self.violations: list[str] = []
        self.unwatch = watch(_transitions, "grant", self.h.core, self._check_order)

    def _canon(self, name: str) -> str:
        return self.h.core.canon.get(name, name)

    def _check_order(self, later: Entry) -> None:
        """At its grant, no earlier waiter of its space (and priority or above) may
        still wait there, unless the later one's requesters hold leases."""
        core = self.h.core
        if later.holding:
            return
        for earlier in core.queue:
            if earlier is later:
                return
            if earlier.state is not State.WAITING:
                continue
            if earlier.priority < later.priority:
                continue
            if any(amount > core.spaces[name].attainable for name, amount in earlier.need.items()):
                continue  # refused in this pass, after the grants
            if waits_aside(core, earlier):
                continue  # no eviction could let it in: it holds up nobody
            shared = set(earlier.need).intersection(later.need)
            if not shared and earlier.places is not None and self._nowhere(earlier):
                # Served nowhere: first in line in every one of its places.
                shared = set(earlier.places).intersection(later.need)
            if shared:
                self.violations.append(
                    f"{later!r} granted {later.need} before {earlier!r}, which waits for "
                    f"{earlier.need} (places {earlier.places})"
                )

    def _nowhere(self, waiter: Entry) -> bool:
        """Whether nothing in flight (nor evicted in this pass) makes room for ``waiter``
        where it waits: it was covered nowhere."""
        ((name, amount),) = waiter.need.items()
        space = self.h.core.spaces[name]
        return space.capacity - space.used + space.releasing < amount

    def _request(
        self,
        key: str,
        need: dict[str, int],
        task: int,
        *,
        places: tuple[str, ...] | None,
        cost: float | None,
        priority: int | None,
    ) -> None:
        h = self.h
        current = h.owner.entries.get(key)
        if current is not None and current.state is State.RELEASING:
            current = current.successor
        try:
            ticket = h.core.request(
                h.owner, Request(key, need, cost=cost, priority=priority, places=places), task
            )
        except (OutOfSpace, DeadlockError):  # (RequestTooLarge is an OutOfSpace)
            h.drain()
            return
        h.drain()
        self.tickets.append(ticket)
        if places is not None and ticket.entry is not current:  # created by this request
            self.asked[ticket.entry] = places

    @rule(
        key=KEYS,
        places=PLACES,
        size=st.integers(0, 100),
        task=TASKS,
        cost=COSTS,
        priority=PRIORITIES,
    )
    def acquire_placed(
        self,
        key: str,
        places: tuple[str, ...],
        size: int,
        task: int,
        cost: float | None,
        priority: int | None,
    ) -> None:
        self._request(
            key,
            {places[0]: size},
            task,
            places=places if len(places) > 1 else None,
            cost=cost,
            priority=priority,
        )

    @rule(
        key=KEYS,
        data=st.data(),
        size=st.integers(0, 100),
        task=TASKS,
        cost=COSTS,
        priority=PRIORITIES,
    )
    def acquire_single(
        self,
        key: str,
        data: st.DataObject,
        size: int,
        task: int,
        cost: float | None,
        priority: int | None,
    ) -> None:
        spaces = data.draw(TIERED_SINGLE if self.tiered else SINGLE)
        self._request(
            key, dict.fromkeys(spaces, size), task, places=None, cost=cost, priority=priority
        )

    @precondition(lambda self: self.h.loading)
    @rule(data=st.data(), grow=st.integers(-20, 30))
    def finish_load(self, data: st.DataObject, grow: int) -> None:
        entry = data.draw(st.sampled_from(self.h.loading))
        measured = None
        if entry.charge and grow:
            measured = {s: max(0, n + grow) for s, n in entry.charge.items()}
        self.h.finish(entry, measured=measured)

    @precondition(lambda self: self.h.loading)
    @rule(data=st.data())
    def fail_load(self, data: st.DataObject) -> None:
        self.h.fail(data.draw(st.sampled_from(self.h.loading)), RuntimeError("boom"))

    @precondition(lambda self: self.h.moving)
    @rule(data=st.data(), fail=st.booleans())
    def end_move(self, data: st.DataObject, fail: bool) -> None:
        entry, _ = data.draw(st.sampled_from(self.h.moving))
        if fail:
            self.h.move(entry, error=RuntimeError("move failed"))
            self.quarantined.append(entry)
        else:
            self.h.move(entry)

    @precondition(lambda self: self.h.releasing)
    @rule(data=st.data())
    def acknowledge(self, data: st.DataObject) -> None:
        entry = data.draw(st.sampled_from(self.h.releasing))
        assert entry.leases == 0
        self.h.ack(entry)

    @precondition(lambda self: self.h.releasing)
    @rule(data=st.data())
    def refuse(self, data: st.DataObject) -> None:
        entry = data.draw(st.sampled_from(self.h.releasing))
        self.h.refuse(entry)
        self.quarantined.append(entry)

    @precondition(lambda self: self.quarantined)
    @rule(data=st.data(), forget=st.booleans())
    def write_off(self, data: st.DataObject, forget: bool) -> None:
        entry = data.draw(st.sampled_from(self.quarantined))
        self.quarantined.remove(entry)
        if entry.state is not State.QUARANTINED:
            return
        if forget:
            self.h.core.forget(entry)
        else:
            self.h.core.release_done(entry)
        self.h.drain()

    @precondition(lambda self: any(t.outcome is None for t in self.tickets))
    @rule(data=st.data())
    def withdraw(self, data: st.DataObject) -> None:
        ticket = data.draw(st.sampled_from([t for t in self.tickets if t.outcome is None]))
        self.h.leave(ticket)
        self.tickets.remove(ticket)

    @precondition(lambda self: self.h.cancelled)
    @rule()
    def loads_honour_cancellation(self) -> None:
        for entry in list(self.h.cancelled):
            self.h.cancelled.remove(entry)
            if entry.state is State.LOADING:
                self.h.loading.remove(entry)
                self.h.core.load_failed(entry, BrokerClosed("cancelled"), cancelled=True)
                self.h.drain()

    @precondition(lambda self: any(t.outcome is True for t in self.tickets))
    @rule(data=st.data())
    def end_lease(self, data: st.DataObject) -> None:
        ticket = data.draw(st.sampled_from([t for t in self.tickets if t.outcome is True]))
        self.tickets.remove(ticket)
        self.h.end(ticket)

    @rule(key=KEYS)
    def invalidate(self, key: str) -> None:
        self.h.core.invalidate(self.h.owner, key)
        self.h.drain()

    @precondition(lambda self: "gpu1" in self.h.core.canon.names and not self.h.core.tiers)
    @rule()
    def learn_an_alias(self) -> None:
        """gpu1 turns out to be gpu0, with placed requests waiting and loading."""
        self.h.core.merge_spaces("gpu0", "gpu1")
        self.h.drain()

    @invariant()
    def books_add_up(self) -> None:
        core = self.h.core
        core.check()
        assert not self.violations, self.violations
        for entry in self.h.releasing:
            assert entry.leases == 0
        for entry, asked in list(self.asked.items()):
            if entry.state is State.GONE:
                del self.asked[entry]
                continue
            allowed = {self._canon(name) for name in asked}
            if entry.state is State.WAITING:
                assert len(entry.need) == 1 and set(entry.need) <= allowed, (entry, asked)
            elif entry.state in (State.LOADING, State.READY):
                assert len(entry.charge) == 1 and set(entry.charge) <= allowed, (entry, asked)
        for ticket in list(self.tickets):
            if isinstance(ticket.outcome, BaseException):
                self._justified(ticket)
                self.tickets.remove(ticket)

    def _justified(self, ticket: Ticket) -> None:
        asked = self.asked.get(ticket.entry)
        if asked is None or not isinstance(ticket.outcome, (OutOfSpace, DeadlockError)):
            return
        if ticket.entry.charge:
            return  # loaded, and measured too large where it was placed
        core = self.h.core
        amount = sum(ticket.entry.need.values())
        for name in {self._canon(n) for n in asked}:
            space = core.spaces[name]
            own = sum(e.charge.get(name, 0) for e in core.busy if ticket.task in e.holders)
            assert amount > space.limit - space.quarantined - own, (ticket.outcome, name, asked)

    def teardown(self) -> None:
        try:
            h = self.h
            for _ in range(400):
                if h.cancelled:
                    self.loads_honour_cancellation()
                elif h.loading:
                    h.finish(h.loading[0])
                elif h.moving:
                    h.move(h.moving[0][0])
                elif h.releasing:
                    h.ack(h.releasing[0])
                elif self.quarantined:
                    entry = self.quarantined.pop()
                    if entry.state is State.QUARANTINED:
                        h.core.release_done(entry)
                        h.drain()
                elif any(t.outcome is True for t in self.tickets):
                    ticket = next(t for t in self.tickets if t.outcome is True)
                    self.tickets.remove(ticket)
                    h.end(ticket)
                elif self.tickets:
                    h.leave(self.tickets.pop())
                else:
                    break
                h.core.check()
                assert not self.violations, self.violations
            assert not h.core.queue, h.core.queue
            assert not any(entry.leases for entry in h.core.busy), h.core.busy
            h.core.clear()
            h.drain()
            for _ in range(100):
                if h.moving:
                    h.move(h.moving[0][0])
                elif h.releasing:
                    h.ack(h.releasing[0])
                else:
                    break
            assert all(space.used == 0 for space in h.core.spaces.values()), h.core.spaces
            assert not h.owner.live, h.owner.live
        finally:
            self.unwatch()


class LRUPlacement(PlacementMachine):
    policy = "lru"


class FIFOPlacement(PlacementMachine):
    policy = "fifo"


class GDSFPlacement(PlacementMachine):
    policy = "gdsf"


class CostPlacement(PlacementMachine):
    policy = "cost"


class TieredPlacement(PlacementMachine):
    policy = "lru"
    tiered = True


class TieredCostPlacement(PlacementMachine):
    policy = "cost"
    tiered = True


def _machine(machine: type[PlacementMachine]) -> Any:
    case = machine.TestCase
    # The profile's examples (nightly explores more), each a run of up to 50 steps.
    case.settings = settings(max_examples=settings().max_examples, stateful_step_count=50)
    return case


TestPlacementLRU = _machine(LRUPlacement)
TestPlacementFIFO = _machine(FIFOPlacement)
TestPlacementGDSF = _machine(GDSFPlacement)
TestPlacementCost = _machine(CostPlacement)
TestPlacementTiered = _machine(TieredPlacement)
TestPlacementTieredCost = _machine(TieredCostPlacement)


# -- the books, scenario by scenario -------------------------------------------


def held(h: Harness, key: str, need: Mapping[str, int], task: Hashable) -> Ticket:
    """``key`` loaded and leased by ``task``."""
    ticket = h.acquire(key, need, task=task)
    h.finish(ticket.entry)
    assert ticket.outcome is True
    return ticket


def idle(h: Harness, key: str, need: Mapping[str, int], *, cost: float | None = None) -> None:
    """``key`` loaded and idle."""
    ticket = h.core.request(h.owner, Request(key, dict(need), cost=cost), "loader")
    h.drain()
    h.finish(ticket.entry)
    h.end(ticket)


def test_a_placed_request_passes_like_a_holder_in_the_space_of_its_tasks_lease() -> None:
    h = gpus()
    held(h, "mine", {"gpu1": 20}, "T")
    held(h, "theirs", {"gpu0": 80}, "V")
    w = h.acquire("w", {"gpu1": 90}, task="W")  # waits for T's lease
    v = h.acquire("v", {"gpu1": 10}, task="V")  # behind w in gpu1
    t = place(h, "x", 60, task="T")
    assert w.entry.state is State.WAITING and v.entry.state is State.WAITING
    # spaces=["gpu1"] alone is granted at once here: the task holds a lease in gpu1.
    assert t.entry.state is State.LOADING and t.entry.charge == {"gpu1": 60}


def test_the_same_request_for_the_one_space_of_its_lease_passes() -> None:
    h = gpus()
    held(h, "mine", {"gpu1": 20}, "T")
    held(h, "theirs", {"gpu0": 80}, "V")
    h.acquire("w", {"gpu1": 90}, task="W")
    h.acquire("v", {"gpu1": 10}, task="V")
    t = place(h, "x", 60, task="T", places=("gpu1",))
    assert t.entry.state is State.LOADING and t.entry.charge == {"gpu1": 60}
    h.core.check()


def _quarantine(h: Harness, ticket: Ticket) -> None:
    """Invalidate the leased entry of ``ticket``, end the lease, and refuse its release."""
    h.core.invalidate(h.owner, ticket.entry.key)
    h.drain()
    h.end(ticket)
    h.refuse(ticket.entry)
    assert ticket.entry.state is State.QUARANTINED


def test_a_place_quarantine_made_too_small_is_dropped_not_the_request() -> None:
    h = gpus()
    doomed = held(h, "q", {"gpu0": 50}, "Q")
    held(h, "f", {"gpu0": 50}, "F")
    held(h, "b", {"gpu1": 80}, "B")
    h.acquire("w", {"gpu1": 90}, task="W")  # first in line in gpu1
    ticket = place(h, "x", 60, task="T")
    assert ticket.entry.state is State.WAITING
    _quarantine(h, doomed)  # gpu0 can never hold 60 again without forget()
    assert h.core.spaces["gpu1"].attainable == 100
    assert ticket.outcome is None and ticket.entry.state is State.WAITING
    assert ticket.entry.need == {"gpu1": 60}


def test_a_holder_is_not_refused_for_one_place_while_another_can_serve_it() -> None:
    h = gpus()
    held(h, "y", {"gpu0": 40}, "T")
    held(h, "z", {"gpu0": 40}, "U")
    doomed = held(h, "q", {"gpu0": 20}, "U")
    held(h, "w", {"gpu1": 80}, "U")
    ticket = place(h, "p", 50, task="T")
    assert ticket.entry.state is State.WAITING and ticket.holds
    _quarantine(h, doomed)  # gpu0: 100 - 20 quarantined - T's own 40 < 50
    assert ticket.outcome is None and ticket.entry.state is State.WAITING


def test_every_place_quarantined_refuses_as_a_single_space_request_would() -> None:
    h = gpus()
    q0 = held(h, "q0", {"gpu0": 50}, "Q")
    q1 = held(h, "q1", {"gpu1": 50}, "Q")
    _quarantine(h, q0)
    _quarantine(h, q1)
    with pytest.raises(OutOfSpace, match="quarantined") as caught:
        place(h, "x", 60)
    assert not isinstance(caught.value, RequestTooLarge)
    h.core.check()


def test_with_no_place_left_the_first_places_error_is_raised() -> None:
    h = Harness({"gpu0": 50, "gpu1": 100})
    held(h, "mine", {"gpu1": 80}, "t")
    with pytest.raises(RequestTooLarge, match="gpu0"):
        place(h, "x", 60, task="t")
    with pytest.raises(DeadlockError, match="gpu1"):
        place(h, "x", 60, task="t", places=("gpu1", "gpu0"))
    assert "x" not in h.owner.entries
    h.core.check()


def test_weighing_the_places_does_not_age_gdsf() -> None:
    clocks = []
    for places in (GPUS, ("gpu1",)):
        policy = GDSF()
        h = gpus(policy=policy)
        idle(h, "a", {"gpu0": 80}, cost=50.0)
        idle(h, "b", {"gpu1": 80}, cost=5.0)
        place(h, "c", 60, places=places)
        assert [key for key, _ in h.released] == ["b"]
        clocks.append(policy.clock)
    assert clocks[0] == clocks[1]


def test_a_tie_in_reload_seconds_goes_to_the_earlier_space() -> None:
    h = gpus()
    idle(h, "a", {"gpu0": 80}, cost=5.0)
    idle(h, "b", {"gpu1": 70}, cost=5.0)
    place(h, "c", 60)
    assert [key for key, _ in h.released] == ["a"]


def test_a_placed_waiter_served_nowhere_is_first_in_line_in_each_place_per_priority() -> None:
    h = gpus()
    held(h, "x0", {"gpu0": 80}, "U")
    held(h, "x1", {"gpu1": 80}, "U")
    first = place(h, "p", 60, task="T", priority=0)
    low = h.core.request(h.owner, Request("low", {"gpu1": 10}, priority=0), "V")
    high = h.core.request(h.owner, Request("high", {"gpu1": 10}, priority=1), "W")
    h.drain()
    assert first.entry.state is State.WAITING
    assert low.entry.state is State.WAITING  # behind p in gpu1, though it fits
    assert high.entry.state is State.LOADING  # a higher priority passes
    h.leave(first)  # withdrawn: the line in gpu1 moves on
    assert low.entry.state is State.LOADING
    h.core.check()


def test_two_placed_waiters_are_served_in_order_where_room_appears() -> None:
    h = gpus()
    held(h, "x0", {"gpu0": 80}, "U")
    x1 = held(h, "x1", {"gpu1": 80}, "U")
    first = place(h, "p", 60, task="T")
    second = place(h, "q", 30, task="V")
    assert first.entry.state is State.WAITING and second.entry.state is State.WAITING
    h.end(x1)
    h.ack(h.owner.entries["x1"])
    assert first.entry.state is State.LOADING and first.entry.charge == {"gpu1": 60}
    assert second.entry.state is State.LOADING and second.entry.charge == {"gpu1": 30}
    h.core.check()


def test_a_placed_load_of_a_key_still_releasing_waits_for_that_release_then_is_placed() -> None:
    h = gpus()
    idle(h, "a", {"gpu0": 60})
    assert h.core.invalidate(h.owner, "a")
    h.drain()
    old = h.owner.entries["a"]
    assert old.state is State.RELEASING
    ticket = place(h, "a", 60)  # gpu1 has room; the key's old value is still going
    new = ticket.entry
    assert new is not old and new.after is old and new.state is State.WAITING
    assert new.need == {"gpu1": 60}
    later = h.acquire("later", {"gpu1": 50}, task="u")  # behind it in gpu1
    assert later.entry.state is State.WAITING
    h.ack(old)  # placed when granted: gpu0, the first place, has room again
    assert new.state is State.LOADING and new.charge == {"gpu0": 60}
    assert later.entry.state is State.LOADING and later.entry.charge == {"gpu1": 50}
    assert h.owner.entries["a"] is new
    h.finish(new)
    assert ticket.outcome is True and new.value == "v-a"
    h.end(ticket)
    h.core.check()


def test_a_placed_load_measured_larger_is_repaid_in_the_space_it_was_placed() -> None:
    h = gpus()
    idle(h, "x", {"gpu0": 30})
    held(h, "y", {"gpu1": 90}, "u")
    ticket = place(h, "p", 60)
    assert ticket.entry.charge == {"gpu0": 60}
    h.finish(ticket.entry, measured={"gpu0": 85})  # 115 of 100: x is evicted for it
    assert [key for key, _ in h.released] == ["x"]
    assert ticket.entry.charge == {"gpu0": 85} and h.used("gpu0") == 115
    h.ack(h.owner.entries["x"])
    assert h.used("gpu0") == 85 and h.used("gpu1") == 90
    h.core.check()


def test_requests_with_other_spaces_join_the_placed_load() -> None:
    h = gpus()
    held(h, "x0", {"gpu0": 80}, "U")
    first = place(h, "k", 60, task="T")
    assert first.entry.charge == {"gpu1": 60}
    joined = place(h, "k", 60, task="V", places=("gpu0",))
    also = h.acquire("k", {"gpu0": 60}, task="W")
    assert joined.entry is first.entry and also.entry is first.entry
    assert h.loading == [first.entry]
    h.finish(first.entry)
    assert first.outcome is joined.outcome is also.outcome is True
    assert first.entry.charge == {"gpu1": 60}  # one value, where it was placed
    h.core.check()


def test_a_learned_alias_merges_the_places_of_a_waiter() -> None:
    h = Harness({"gpu0": 100, "gpu1": 100, "gpu2": 100})
    held(h, "x0", {"gpu0": 80}, "U")
    held(h, "x1", {"gpu1": 80}, "U")
    x2 = held(h, "x2", {"gpu2": 80}, "U")
    ticket = place(h, "p", 60, places=("gpu1", "gpu2", "gpu0"))
    assert ticket.entry.state is State.WAITING
    h.core.merge_spaces("gpu0", "gpu1")
    h.drain()
    h.core.check()
    assert ticket.entry.places == ("gpu0", "gpu2")
    assert set(ticket.entry.need) <= {"gpu0", "gpu2"}
    h.core.invalidate(h.owner, "x2")
    h.drain()
    h.end(x2)
    h.ack(x2.entry)
    assert ticket.entry.state is State.LOADING and ticket.entry.charge == {"gpu2": 60}
    h.core.check()


def test_a_demoted_value_comes_back_among_all_the_spaces_it_was_asked_for() -> None:
    h = Harness(
        {"gpu0": 100, "gpu1": 100, "ram": 100},
        tiers={"gpu0": "ram", "gpu1": "ram"},
        moves=True,
    )
    mine = held(h, "x", {"gpu0": 80}, "T")
    first = place(h, "a", 60, task="T", cost=50.0)  # gpu0 left out: T's own lease
    assert first.entry.charge == {"gpu1": 60}
    h.finish(first.entry)
    h.end(first)
    h.end(mine)
    h.core.invalidate(h.owner, "x")
    h.drain()
    h.ack(h.owner.entries["x"])
    busy = h.acquire("c", {"gpu1": 90}, task="U")  # a moves down to ram
    a = h.owner.entries["a"]
    h.move(a)
    h.finish(busy.entry)
    assert a.state is State.DEMOTED and h.used("gpu0") == 0
    again = h.core.request(h.owner, Request("a"), "T")
    h.drain()
    assert a.state is State.MOVING and h.moving == [(a, "gpu0")]
    h.move(a)
    assert again.outcome is True and a.charge == {"gpu0": 60}


def test_an_entry_charged_in_its_lower_tier_too_is_not_its_own_victim_there() -> None:
    h = Harness({"gpu0": 100, "ram": 120}, tiers={"gpu0": "ram"}, moves=True)
    b = h.acquire("b", {"gpu0": 24, "ram": 24})
    h.acquire("c", {"gpu0": 77}, task="u")
    a = h.acquire("a", {"ram": 73}, task="u")
    h.finish(b.entry)
    h.finish(a.entry)
    h.end(b)  # c evicts b from gpu0; ram has 23 free for b's 24 more
    h.core.check()


# -- the shell, on every backend -----------------------------------------------

GIB = 1 << 30
TWO_GPUS = {"cuda:0": "10GiB", "cuda:1": "10GiB"}


async def discard(key: Hashable, value: Any) -> None:
    pass


def told(seen: list[str]) -> Callable[[str], Awaitable[str]]:
    """A loader that records the space it is told and returns its name."""

    async def load(space: str) -> str:
        seen.append(space)
        await anyio.lowlevel.checkpoint()
        return space

    return load


async def until(condition: Callable[[], Awaitable[bool]]) -> None:
    """Let other tasks run until ``condition()`` holds (bounded in steps, not time)."""
    for _ in range(10_000):
        if await condition():
            return
        await anyio.lowlevel.checkpoint()
    raise AssertionError("the condition never held")


@contextlib.asynccontextmanager
async def both_gpus_held(cache: Any) -> AsyncIterator[None]:
    """8GiB leased in each GPU by another task for the duration of the block."""
    ready, done = anyio.Event(), anyio.Event()

    async def hold() -> None:
        zero = await cache.acquire("x0", load=told([]), size="8GiB", spaces=["cuda:0"])
        one = await cache.acquire("x1", load=told([]), size="8GiB", spaces=["cuda:1"])
        ready.set()
        await done.wait()
        await zero.release()
        await one.release()

    async with anyio.create_task_group() as tg:
        tg.start_soon(hold)
        await ready.wait()
        try:
            yield
        finally:
            done.set()


@pytest.mark.anyio
async def test_the_loader_is_told_one_of_the_names_it_gave_when_spaces_are_aliases() -> None:
    seen: list[str] = []
    budget = {"gpu": "10GiB", "cuda:0": "10GiB", "cuda:1": "10GiB"}
    async with (
        Broker(budget, aliases=[["gpu", "cuda:0"]]) as broker,
        broker.cache("m", discard) as cache,
    ):
        assert (await broker.stats()).aliases == (("cuda:0", "gpu"),)
        lease = await cache.acquire("a", load=told(seen), size="1GiB", spaces=["cuda:0", "cuda:1"])
        await lease.release()
        assert seen == ["cuda:0"]


@pytest.mark.anyio
async def test_a_loader_that_takes_no_space_fails_the_acquire_with_its_type_error(
    kind: str,
) -> None:
    async with open_broker(kind, TWO_GPUS) as broker, broker.cache("m", discard) as cache:

        def no_space() -> str:
            return "v"

        loader: Any = no_space  # (typed to take the space: the mistake under test)
        with pytest.raises(TypeError, match="positional argument"):
            await cache.acquire("k", load=loader, size="1GiB", spaces=["cuda:0", "cuda:1"])
        stats = await broker.stats()
        assert stats.used == {"cuda:0": 0, "cuda:1": 0} and stats.load_failures == 1
        async with cache.acquire(
            "k", load=lambda space: f"v@{space}", size="1GiB", spaces=["cuda:1", "cuda:0"]
        ) as lease:
            assert lease.value == "v@cuda:1"  # the first place given, with room


@pytest.mark.anyio
async def test_a_bad_loader_with_spaces_is_told_it_must_take_the_space(kind: str) -> None:
    async with open_broker(kind, TWO_GPUS) as broker, broker.cache("m", discard) as cache:
        not_callable: Any = 42
        with pytest.raises(TypeError) as caught:
            cache.acquire("k", load=not_callable, size="1GiB", spaces=["cuda:0"])
        assert "no argument" not in str(caught.value)


@pytest.mark.anyio
async def test_spaces_as_a_tuple_or_the_default_space_and_not_as_a_generator(kind: str) -> None:
    seen: list[str] = []
    async with open_broker(kind, "10GiB") as broker, broker.cache("m", discard) as cache:
        async with cache.acquire("a", load=told(seen), size="1GiB", spaces=("default",)) as lease:
            assert lease.value == "default"
    async with open_broker(kind, TWO_GPUS) as broker, broker.cache("m", discard) as cache:
        async with cache.acquire(
            "b", load=told(seen), size="1GiB", spaces=("cuda:1", "cuda:0")
        ) as lease:
            assert lease.value == "cuda:1"
        once: Any = iter(["cuda:0"])  # (typed Sequence[str]: an iterator is the mistake)
        with pytest.raises(TypeError, match="list of space names"):
            cache.acquire("c", load=told(seen), size="1GiB", spaces=once)
        generated: Any = (name for name in ["cuda:0"])
        with pytest.raises(TypeError, match="list of space names"):
            await cache.prefetch("c", load=told(seen), size="1GiB", spaces=generated)
    assert seen == ["default", "cuda:1"]


class Bytes(int):
    """A byte count of its own type (an ``int`` subclass, as some libraries return)."""


@pytest.mark.anyio
async def test_spaces_take_the_sizes_size_takes_without_them(kind: str) -> None:
    async with open_broker(kind, TWO_GPUS) as broker, broker.cache("m", discard) as cache:
        async with cache.acquire("a", load=lambda: "A", size={"cuda:0": Bytes(10)}):
            pass
        async with cache.acquire(
            "b", load=lambda space: space, size=Bytes(10), spaces=["cuda:0", "cuda:1"]
        ) as lease:
            assert lease.value == "cuda:0"


@pytest.mark.anyio
async def test_a_placed_request_that_times_out_says_it_waited_for_space(kind: str) -> None:
    async with open_broker(kind, TWO_GPUS) as broker, broker.cache("m", discard) as cache:
        async with both_gpus_held(cache):
            with pytest.raises(AcquireTimeout) as caught:
                await cache.acquire(
                    "c", load=told([]), size="6GiB", spaces=["cuda:0", "cuda:1"], timeout=0.01
                )
            assert caught.value.waiting_for == "space" and caught.value.entry == "m:'c'"
            stats = await broker.stats()
            assert stats.waiting == 0 and stats.entries == 2


@pytest.mark.anyio
async def test_a_placed_request_that_times_out_names_every_space_it_waited_for(kind: str) -> None:
    async with open_broker(kind, TWO_GPUS) as broker, broker.cache("m", discard) as cache:
        async with both_gpus_held(cache):
            with pytest.raises(AcquireTimeout) as caught:
                await cache.acquire(
                    "c", load=told([]), size="6GiB", spaces=["cuda:0", "cuda:1"], timeout=0.01
                )
            assert "cuda:1" in str(caught.value)


@pytest.mark.anyio
async def test_a_cancelled_placed_waiter_gives_up_its_place_in_every_line(kind: str) -> None:
    seen: list[str] = []
    async with open_broker(kind, TWO_GPUS) as broker, broker.cache("m", discard) as cache:
        async with both_gpus_held(cache), anyio.create_task_group() as tg:

            async def waiting(count: int) -> bool:
                return (await broker.stats()).waiting == count

            scope = anyio.CancelScope()
            late_done = anyio.Event()

            async def first() -> None:
                with scope:
                    await cache.acquire(
                        "p", load=told(seen), size="6GiB", spaces=["cuda:0", "cuda:1"]
                    )

            async def late() -> None:
                # Fits beside x1 now, but p waits first in line in cuda:1 too.
                async with cache.acquire("q", load=told(seen), size="2GiB", spaces=["cuda:1"]):
                    late_done.set()

            tg.start_soon(first)
            await until(lambda: waiting(1))
            tg.start_soon(late)
            await until(lambda: waiting(2))
            assert not late_done.is_set()
            scope.cancel()
            await late_done.wait()
        assert seen == ["cuda:1"]  # q's load; p's never ran
        stats = await broker.stats()
        assert stats.waiting == 0 and stats.used == {"cuda:0": 8 * GIB, "cuda:1": 10 * GIB}


@pytest.mark.anyio
async def test_a_prefetch_with_spaces_is_hit_by_an_acquire_without(kind: str) -> None:
    seen: list[str] = []
    async with open_broker(kind, TWO_GPUS) as broker, broker.cache("m", discard) as cache:
        await cache.prefetch("x", load=told(seen), size="8GiB", spaces=["cuda:0"])
        await cache.prefetch("a", load=told(seen), size="6GiB", spaces=["cuda:0", "cuda:1"])
        async with cache.acquire("a", load=lambda: "unused", size={"cuda:0": "6GiB"}) as lease:
            assert lease.value == "cuda:1"
        assert seen == ["cuda:0", "cuda:1"]
        stats = await broker.stats()
        assert stats.loads == 2 and stats.hits == 1


@pytest.mark.anyio
async def test_a_plain_loader_in_a_thread_measured_larger_is_repaid_where_it_was_placed(
    kind: str,
) -> None:
    async with open_broker(kind, TWO_GPUS) as broker, broker.cache("m", discard) as cache:
        await cache.prefetch("x", load=lambda space: space, size="3GiB", spaces=["cuda:0"])
        await cache.prefetch("y", load=lambda space: space, size="9GiB", spaces=["cuda:1"])
        async with cache.acquire(
            "p",
            load=lambda space: space,
            size="6GiB",
            measure=lambda value: "9GiB",  # 12 of 10 GiB: x goes
            spaces=["cuda:0", "cuda:1"],
        ) as lease:
            assert lease.value == "cuda:0"
            infos = {info.key: info.charge for info in await broker.entries()}
            assert infos["p"] == {"cuda:0": 9 * GIB}
        await until(lambda: _used_is(broker, {"cuda:0": 9 * GIB, "cuda:1": 9 * GIB}))
        assert (await broker.stats()).evictions == 1


async def _used_is(broker: Broker, used: Mapping[str, int]) -> bool:
    return dict((await broker.stats()).used) == dict(used)


class Mover:
    """Values are strings that say where they are; moves are recorded."""

    def __init__(self) -> None:
        self.moves: list[tuple[Hashable, str]] = []

    async def release(self, key: Hashable, value: Any) -> None:
        pass

    async def move(self, key: Hashable, value: Any, to: str) -> Any:
        await anyio.lowlevel.checkpoint()
        self.moves.append((key, to))
        return f"{key}@{to}"


@pytest.mark.anyio
async def test_a_demoted_value_is_moved_up_to_the_gpu_that_has_room_now() -> None:
    plugin = Mover()
    budget = {"cuda:0": "10GiB", "cuda:1": "10GiB", "ram": "20GiB"}
    spaces = ["cuda:0", "cuda:1"]
    async with (
        Broker(budget, tiers={"cuda:0": "ram", "cuda:1": "ram"}) as broker,
        broker.cache("m", plugin) as cache,
    ):

        def load(key: str) -> Callable[[str], str]:
            return lambda space: f"{key}@{space}"

        await cache.prefetch("a", load=load("a"), size="6GiB", cost=50.0, spaces=spaces)
        await cache.prefetch("b", load=load("b"), size="6GiB", cost=5.0, spaces=spaces)
        # c goes where eviction costs least: b's GPU; b moves down to ram.
        async with cache.acquire("c", load=load("c"), size="6GiB", cost=50.0, spaces=spaces) as c:
            assert c.value == "c@cuda:1" and plugin.moves == [("b", "ram")]
            # b comes back up where room can be made now: a's GPU (c is leased).
            async with cache.acquire("b", load=load("b"), size="6GiB", spaces=spaces) as lease:
                assert lease.value == "b@cuda:0"  # (the move's value)
        assert plugin.moves == [("b", "ram"), ("a", "ram"), ("b", "cuda:0")]
        stats = await broker.stats()
        assert stats.loads == 3 and stats.promotions == 1
        infos = {info.key: (info.state, info.charge) for info in await broker.entries()}
        assert infos["a"] == ("demoted", {"ram": 6 * GIB})
        assert infos["b"] == ("ready", {"cuda:0": 6 * GIB})


# -- a broker connected to ``cachebroker serve`` ----------------------------------


@contextlib.asynccontextmanager
async def serving() -> AsyncIterator[Daemon]:
    """A daemon with two GPUs on a fresh socket, for the duration of the block."""
    with socket_path() as address:
        daemon = Daemon(DaemonBroker(budget={"cuda:0": 100, "cuda:1": 100}), address)
        with anyio.fail_after(60):  # (bounded: a test that would hang fails instead)
            async with anyio.create_task_group() as tg:
                await tg.start(daemon.run)
                try:
                    yield daemon
                finally:
                    tg.cancel_scope.cancel()


@contextlib.asynccontextmanager
async def two_processes() -> AsyncIterator[tuple[Daemon, Broker, Cache, Broker, Cache]]:
    """A daemon and two brokers connected to it, each with its cache ``m``."""
    async with (
        serving() as daemon,
        Broker.connect(daemon.address) as one,
        Broker.connect(daemon.address) as two,
        one.cache("m", discard) as first,
        two.cache("m", discard) as second,
    ):
        yield daemon, one, first, two, second


@pytest.mark.anyio
async def test_a_connected_broker_is_placed_by_the_daemon_s_books() -> None:
    """Placement across processes: ``two``'s own books see nothing on either GPU (they
    would choose ``cuda:0``); the daemon's see ``one``'s 80 on ``cuda:0`` and place
    ``two``'s 60 on ``cuda:1``, which ``two``'s loader is told, and where both books
    charge it."""
    seen: list[str] = []
    async with two_processes() as (daemon, _one, first, two, second):
        async with first.acquire("x", load=lambda: "X", size={"cuda:0": 80}):
            places = ["cuda:0", "cuda:1"]
            async with second.acquire("y", load=told(seen), size=60, spaces=places) as lease:
                assert lease.value == "cuda:1"
                assert {i.key: i.charge for i in await two.entries()} == {"y": {"cuda:1": 60}}
                charged = {e["key"]: e["charge"] for e in daemon.listing()["entries"]}
                assert charged == {"'x'": {"cuda:0": 80}, "'y'": {"cuda:1": 60}}
            await second.prefetch("z", load=told(seen), size=30, spaces=places)
        assert seen == ["cuda:1", "cuda:1"]  # (z: 80 + 30 would not fit on cuda:0)
        assert (await two.stats()).used == {"cuda:0": 0, "cuda:1": 90}
        assert (await two.stats()).broker_used == {"cuda:0": 80, "cuda:1": 90}


@pytest.mark.anyio
async def test_a_connected_placed_waiter_goes_where_room_appears_first() -> None:
    """Both GPUs full with ``one``'s leases: ``two``'s placed request waits at the
    daemon in both lines, and is placed on the GPU whose lease ends first."""
    seen: list[str] = []
    async with two_processes() as (daemon, _one, first, _two, second):
        a = await first.acquire("a", load=lambda: "A", size={"cuda:0": 90})
        b = await first.acquire("b", load=lambda: "B", size={"cuda:1": 90})
        async with anyio.create_task_group() as tg:

            async def placed() -> None:
                async with second.acquire(
                    "c", load=told(seen), size=50, spaces=["cuda:0", "cuda:1"]
                ) as lease:
                    assert lease.value == "cuda:1"

            tg.start_soon(placed)
            with anyio.fail_after(10):
                while not any(e["state"] == "waiting" for e in daemon.listing()["entries"]):
                    await anyio.sleep(0.001)
            await b.release()  # (b, idle now, is evicted for c: cuda:1 has room first)
        await a.release()
        assert seen == ["cuda:1"]


@pytest.mark.anyio
async def test_a_connected_broker_hits_with_spaces_too() -> None:
    async with (
        serving() as daemon,
        Broker.connect(daemon.address) as broker,
        broker.cache("m", discard) as cache,
    ):
        async with cache.acquire("a", load=lambda: "A", size={"cuda:1": 10}):
            pass
        async with cache.acquire("a", load=told([]), size=10, spaces=["cuda:1"]) as lease:
            assert lease.value == "A"
