"""Fairness in the sans-I/O core: who waits aside, and what stays first come, first served.

A request that no eviction could let in (the bytes it lacks are pinned, of a
higher priority, quarantined for good, or its own leases) waits aside: it
holds up nobody behind it, yet keeps its place in line. A request whose
room may still come (a release running past its timeout) waits for it.
"""

from __future__ import annotations

from collections.abc import Hashable

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from cachebroker import DeadlockError, OutOfSpace, ReleaseFailed
from cachebroker._core import Entry, Reason, Request, State, Ticket, _transitions
from cachebroker._errors import BrokerClosed
from tests.harness import Harness, waits_aside
from tests.helpers import watch

MiB = 1 << 20


def ask(
    h: Harness,
    key: str,
    size: int,
    *,
    priority: int = 0,
    task: object = "t",
    pin: bool = False,
) -> Ticket:
    ticket = h.core.request(h.owner, Request(key, {"m": size}, priority=priority), task)
    if pin:
        h.core.configure(ticket.entry, pin=True)
    h.drain()
    return ticket


def load_idle(h: Harness, key: str, size: int, *, priority: int = 0, pin: bool = False) -> None:
    """Load ``key`` and end its lease: an idle (or pinned) entry."""
    ticket = ask(h, key, size, priority=priority, pin=pin)
    h.finish(ticket.entry)
    h.end(ticket)


def loading(h: Harness) -> set[Hashable]:
    return {entry.key for entry in h.loading}


# ------------------------------------------------------- the three setups of the issue


def test_a_request_below_a_higher_priority_holds_up_nobody() -> None:
    """10 MiB; an idle priority-10 entry holds 6: a priority-0 request for 6 can never
    evict it, so a later 1 MiB request, which fits the 4 MiB free, is served at once."""
    h = Harness({"m": 10 * MiB})
    load_idle(h, "dear", 6 * MiB, priority=10)
    big = ask(h, "big", 6 * MiB)
    small = ask(h, "small", 1 * MiB)
    assert loading(h) == {"small"}
    assert big.outcome is None and big.entry in h.core.queue  # still waiting, in line
    assert h.released == []  # nothing evicted for a request no eviction could serve
    h.finish(small.entry)
    assert small.outcome is True


def test_a_request_blocked_by_a_pin_holds_up_nobody() -> None:
    h = Harness({"m": 10 * MiB})
    load_idle(h, "pinned", 6 * MiB, pin=True)
    big = ask(h, "big", 6 * MiB)
    ask(h, "small", 1 * MiB)
    assert loading(h) == {"small"}
    assert big.outcome is None
    assert "pinned" in h.core.why_no_room(big.entry)
    assert "p:'pinned'" in h.core.why_no_room(big.entry)


def test_pins_and_priorities_together_hold_up_nobody() -> None:
    """3 MiB pinned and 3 MiB of priority 10: 4 MiB free, and a priority-0 request for
    5 could reach only 4: it waits aside; 1 MiB requests pass it."""
    h = Harness({"m": 10 * MiB})
    load_idle(h, "pinned", 3 * MiB, pin=True)
    load_idle(h, "dear", 3 * MiB, priority=10)
    big = ask(h, "big", 5 * MiB)
    ask(h, "s1", 1 * MiB)
    ask(h, "s2", 1 * MiB)
    assert loading(h) == {"s1", "s2"}
    why = h.core.why_no_room(big.entry)
    assert "pinned entries" in why and "p:'pinned'" in why
    assert "higher priority than its 0" in why and "p:'dear'" in why


def test_an_aside_waiter_is_first_in_line_again_once_the_pin_is_lifted() -> None:
    """Unpinning makes the waiter servable: it evicts what it needs, and a later small
    request waits behind it again (first come, first served for who can be served)."""
    h = Harness({"m": 10 * MiB})
    load_idle(h, "pinned", 6 * MiB, pin=True)
    big = ask(h, "big", 6 * MiB)
    small = ask(h, "small", 1 * MiB)
    h.finish(small.entry)
    h.end(small)  # idle now: 3 MiB free
    assert h.core.unpin(h.owner, "pinned", h.now)
    h.drain()
    assert ("pinned", Reason.CAPACITY) in h.released  # evicted for the big request
    later = ask(h, "later", 3 * MiB)  # fits the free 3 MiB, but the big one is first
    assert later.outcome is None and loading(h) == set()
    for entry in list(h.releasing):
        h.ack(entry)
    assert big.entry.state is State.LOADING


def test_a_prefetch_that_lowers_a_priority_puts_an_aside_waiter_back_in_line() -> None:
    h = Harness({"m": 10 * MiB})
    load_idle(h, "dear", 6 * MiB, priority=10)
    big = ask(h, "big", 6 * MiB)
    assert h.core.prefetch(h.owner, Request("dear", {"m": 6 * MiB}, priority=0), "t", h.now) is None
    h.drain()
    assert ("dear", Reason.CAPACITY) in h.released
    h.ack(h.releasing[0])
    assert big.entry.state is State.LOADING


def test_an_aside_waiter_is_served_once_the_higher_priority_entry_goes() -> None:
    h = Harness({"m": 10 * MiB})
    load_idle(h, "dear", 6 * MiB, priority=10)
    big = ask(h, "big", 6 * MiB)
    assert h.core.invalidate(h.owner, "dear")
    h.drain()
    h.ack(h.releasing[0])
    assert big.entry.state is State.LOADING


def test_a_changed_priority_puts_an_aside_waiter_back_in_line() -> None:
    h = Harness({"m": 10 * MiB})
    load_idle(h, "dear", 6 * MiB, priority=10)
    big = ask(h, "big", 6 * MiB)
    h.end(ask(h, "dear", 6 * MiB, priority=0, task="other"))  # a hit lowers it
    assert ("dear", Reason.CAPACITY) in h.released
    h.ack(h.releasing[0])
    assert big.entry.state is State.LOADING


def test_a_request_the_leases_it_may_evict_could_serve_still_blocks() -> None:
    """The reason for first come, first served holds: a request that leases ending
    would serve holds up the smaller ones behind it."""
    h = Harness({"m": 10 * MiB})
    held = ask(h, "held", 6 * MiB, task="other")
    h.finish(held.entry)
    big = ask(h, "big", 7 * MiB)
    small = ask(h, "small", 1 * MiB)
    assert big.outcome is None and small.outcome is None and loading(h) == set()
    why = h.core.why_no_room(small.entry)
    assert "leased by other tasks" in why and "1 earlier request(s)" in why
    h.end(held)
    h.ack(h.releasing[0])
    assert loading(h) == {"big", "small"}


def test_a_request_a_running_release_could_serve_still_blocks() -> None:
    h = Harness({"m": 10 * MiB})
    load_idle(h, "old", 8 * MiB)
    big = ask(h, "big", 9 * MiB)  # evicts "old": 9 of 10 once it is released
    small = ask(h, "small", 1 * MiB)
    assert big.outcome is None and small.outcome is None and loading(h) == set()
    h.ack(h.releasing[0])
    assert loading(h) == {"big", "small"}


def test_own_leases_and_pins_make_a_holder_wait_aside() -> None:
    """A task leasing 3 MiB asks for 6 with 4 pinned: only a lifted pin could serve
    it (not a deadlock: pins can be lifted), so it waits aside and others pass."""
    h = Harness({"m": 10 * MiB})
    mine = ask(h, "mine", 3 * MiB, task="holder")
    h.finish(mine.entry)
    load_idle(h, "pinned", 4 * MiB, pin=True)
    big = ask(h, "big", 6 * MiB, task="holder")
    assert big.outcome is None
    ask(h, "other", 2 * MiB, task="another")
    assert loading(h) == {"other"}
    why = h.core.why_no_room(big.entry)
    assert "leased by the requesting task itself" in why and "p:'mine'" in why


def test_own_leases_alone_are_still_a_deadlock() -> None:
    h = Harness({"m": 10 * MiB})
    mine = ask(h, "mine", 6 * MiB, task="holder")
    h.finish(mine.entry)
    load_idle(h, "pinned", 2 * MiB, pin=True)
    with pytest.raises(DeadlockError, match="leased by the requesting task itself") as caught:
        ask(h, "big", 6 * MiB, task="holder")
    assert "pinned entries" in str(caught.value)  # the rest of the picture


def test_the_out_of_space_error_names_the_pins_besides_the_quarantine() -> None:
    h = Harness({"m": 10 * MiB})
    load_idle(h, "pinned", 2 * MiB, pin=True)
    load_idle(h, "broken", 6 * MiB)
    h.core.invalidate(h.owner, "broken")
    h.drain()
    h.refuse(h.releasing[0])
    with pytest.raises(OutOfSpace, match=r"only broker\.forget") as caught:
        ask(h, "big", 5 * MiB)
    assert "pinned entries" in str(caught.value) and "p:'pinned'" in str(caught.value)


# ------------------------------------------------------------- releases past their timeout


def overdue(h: Harness, key: str, size: int) -> Entry:
    """Load ``key``, evict it, and let its release run past its timeout."""
    load_idle(h, key, size)
    h.core.invalidate(h.owner, key)
    h.drain()
    (entry,) = h.releasing
    h.releasing.remove(entry)
    h.core.release_overdue(entry, ReleaseFailed("not acknowledged within 0.2s"))
    h.drain()
    return entry


def test_a_request_waits_for_a_release_running_past_its_timeout() -> None:
    h = Harness({"m": 10 * MiB})
    late = overdue(h, "late", 10 * MiB)
    assert late.state is State.QUARANTINED and h.core.quarantined
    big = ask(h, "big", 10 * MiB)  # no OutOfSpace: the bytes may come back
    assert big.outcome is None
    assert "release is still running past release_timeout" in h.core.why_no_room(big.entry)
    h.core.release_done(late)  # the late return
    h.drain()
    assert big.entry.state is State.LOADING  # in the very step that freed the bytes


def test_a_release_that_raises_after_its_timeout_refuses_who_waited_for_it() -> None:
    h = Harness({"m": 10 * MiB})
    late = overdue(h, "late", 10 * MiB)
    big = ask(h, "big", 10 * MiB)
    h.core.release_failed(late, ReleaseFailed("raised late"))
    h.drain()
    assert isinstance(big.outcome, OutOfSpace)
    assert "only broker.forget" in str(big.outcome)
    assert h.core.quarantined[late].args == ("raised late",)
    with pytest.raises(OutOfSpace):
        ask(h, "again", 10 * MiB)


def test_a_request_for_stranded_bytes_fails_at_once_as_before() -> None:
    h = Harness({"m": 10 * MiB})
    load_idle(h, "broken", 10 * MiB)
    h.core.invalidate(h.owner, "broken")
    h.drain()
    h.refuse(h.releasing[0])
    with pytest.raises(OutOfSpace, match=r"only broker\.forget"):
        ask(h, "big", 10 * MiB)


def test_an_overdue_entry_written_off_then_returning_late_frees_nothing_twice() -> None:
    h = Harness({"m": 10 * MiB})
    late = overdue(h, "late", 6 * MiB)
    h.core.forget(late)
    h.drain()
    assert h.used() == 0 and not h.core.overdue.entries
    ask(h, "other", 8 * MiB)
    h.core.release_done(late)  # its late return: already written off
    h.drain()
    assert h.used() == 8 * MiB
    h.core.check()


def test_an_owner_gone_with_an_overdue_release_takes_its_bytes() -> None:
    h = Harness({"m": 10 * MiB})
    overdue(h, "late", 6 * MiB)
    h.core.drop_owner(h.owner)
    h.drain()
    assert h.used() == 0 and not h.core.overdue.entries
    h.core.check()


def test_an_overdue_release_refused_strands_its_bytes() -> None:
    """A release refused after its timeout (the daemon's owner leased it again) is not
    running any more: its bytes are stranded, as for one that raised."""
    h = Harness({"m": 10 * MiB})
    late = overdue(h, "late", 10 * MiB)
    big = ask(h, "big", 10 * MiB)
    h.core.release_refused(late, "holder")
    h.drain()
    assert isinstance(big.outcome, OutOfSpace)


# ------------------------------------------------------------------------- the property

SPACES = ("m", "n")
BUDGET = {"m": 20, "n": 10}
KEYS = st.sampled_from("abcdefg")
TASKS = st.integers(1, 3)
PRIORITIES = st.integers(0, 2)
NEEDS = st.sampled_from([("m",), ("n",), ("m", "n")])


class FairnessMachine(RuleBasedStateMachine):
    """Random requests, pins, priorities, lease ends, loads and releases (on time,
    failed, or past their timeout then returning or raising), driving ``Core`` directly.

    After every step:

    * the books add up (``Core.check``);
    * a request that can be served is never starved: a waiter whose need fits the
      free bytes is granted, unless an earlier waiter that does not wait aside
      shares one of its spaces (``tests.harness.waits_aside`` recounts, from the
      entries, whether any eviction could let a waiter in);
    * a grant passes no earlier waiter of its space (of its priority or above)
      that does not wait aside, unless the later request's task holds a lease.
    """

    def __init__(self) -> None:
        super().__init__()
        self.h = Harness(BUDGET)
        self.tickets: list[Ticket] = []
        self.overdue: list[Entry] = []
        self.violations: list[str] = []
        self.unwatch = watch(_transitions, "grant", self.h.core, self._check_order)

    def _check_order(self, later: Entry) -> None:
        core = self.h.core
        if later.holding:
            return
        for earlier in core.queue:
            if earlier is later:
                return
            if earlier.priority < later.priority or set(earlier.need).isdisjoint(later.need):
                continue
            if any(amount > core.spaces[n].attainable for n, amount in earlier.need.items()):
                continue  # refused in this pass, after the grants
            if not waits_aside(core, earlier):
                self.violations.append(
                    f"{later!r} granted {later.need} before {earlier!r}, which waits for "
                    f"{earlier.need} and could be served"
                )

    @initialize(
        residents=st.lists(
            st.tuples(KEYS, NEEDS, st.integers(1, 12), PRIORITIES, st.booleans()),
            max_size=3,
            unique_by=lambda resident: resident[0],
        )
    )
    def residents(self, residents: list[tuple[str, tuple[str, ...], int, int, bool]]) -> None:
        """Start with idle entries, some pinned or of a higher priority than most requests."""
        h = self.h
        for key, spaces, size, priority, pin in residents:
            try:
                ticket = h.core.request(
                    h.owner, Request(key, dict.fromkeys(spaces, size), priority=priority), 0
                )
            except OutOfSpace:
                continue
            h.core.configure(ticket.entry, pin=pin)
            h.drain()
            if ticket.entry in h.loading:
                h.finish(ticket.entry)
            if ticket.outcome is True:
                h.end(ticket)
            else:
                self.tickets.append(ticket)

    @rule(
        key=KEYS,
        spaces=NEEDS,
        size=st.integers(0, 12),
        task=TASKS,
        priority=PRIORITIES,
        pin=st.booleans(),
    )
    def acquire(
        self, key: str, spaces: tuple[str, ...], size: int, task: int, priority: int, pin: bool
    ) -> None:
        h = self.h
        try:
            ticket = h.core.request(
                h.owner, Request(key, dict.fromkeys(spaces, size), priority=priority), task
            )
        except (OutOfSpace, DeadlockError):
            h.drain()
            return
        if pin:
            h.core.configure(ticket.entry, pin=True)
        h.drain()
        self.tickets.append(ticket)

    @precondition(lambda self: self.h.loading)
    @rule(data=st.data())
    def finish_load(self, data: st.DataObject) -> None:
        self.h.finish(data.draw(st.sampled_from(self.h.loading)))

    @precondition(lambda self: self.h.loading)
    @rule(data=st.data())
    def fail_load(self, data: st.DataObject) -> None:
        self.h.fail(data.draw(st.sampled_from(self.h.loading)), RuntimeError("boom"))

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

    @precondition(lambda self: any(t.outcome is None for t in self.tickets))
    @rule(data=st.data())
    def withdraw(self, data: st.DataObject) -> None:
        ticket = data.draw(st.sampled_from([t for t in self.tickets if t.outcome is None]))
        self.tickets.remove(ticket)
        self.h.leave(ticket)

    @precondition(lambda self: self.h.releasing)
    @rule(data=st.data(), outcome=st.sampled_from(["freed", "raised", "overdue"]))
    def end_release(self, data: st.DataObject, outcome: str) -> None:
        h = self.h
        entry = data.draw(st.sampled_from(h.releasing))
        if outcome == "freed":
            h.ack(entry)
        elif outcome == "raised":
            h.refuse(entry)
        else:
            h.releasing.remove(entry)
            h.core.release_overdue(entry, ReleaseFailed("past its timeout"))
            h.drain()
            self.overdue.append(entry)

    @precondition(lambda self: self.overdue)
    @rule(data=st.data(), returned=st.booleans())
    def late_release_ends(self, data: st.DataObject, returned: bool) -> None:
        entry = data.draw(st.sampled_from(self.overdue))
        self.overdue.remove(entry)
        if returned:
            self.h.core.release_done(entry)
        else:
            self.h.core.release_failed(entry, ReleaseFailed("raised late"))
        self.h.drain()

    @precondition(lambda self: self.h.core.quarantined)
    @rule(data=st.data())
    def forget(self, data: st.DataObject) -> None:
        entry = data.draw(st.sampled_from(list(self.h.core.quarantined)))
        self.h.core.forget(entry)
        self.h.drain()

    @rule(key=KEYS)
    def unpin(self, key: str) -> None:
        self.h.core.unpin(self.h.owner, key, self.h.now)
        self.h.drain()

    @rule(key=KEYS, pin=st.booleans())
    def pin_ready(self, key: str, pin: bool) -> None:
        """Pin (or unpin) a loaded entry in place, as the daemon mirrors a process's pin."""
        entry = self.h.owner.entries.get(key)
        if entry is not None and entry.state is State.READY and entry.leases:
            entry.pinned = pin  # (a leased one: an idle one is an eviction candidate)
            self.h.drain()

    @rule(key=KEYS, priority=PRIORITIES)
    def reprioritize(self, key: str, priority: int) -> None:
        entry = self.h.owner.entries.get(key)
        if entry is not None:
            self.h.core.limit(entry, priority=priority)
            self.h.drain()

    @rule(key=KEYS)
    def invalidate(self, key: str) -> None:
        self.h.core.invalidate(self.h.owner, key)
        self.h.drain()

    @precondition(lambda self: "n" in self.h.core.canon.names)
    @rule()
    def learn_an_alias(self) -> None:
        """n turns out to be m: pinned, ranked and overdue bytes move with the entries."""
        self.h.core.merge_spaces("m", "n")
        self.h.drain()

    @invariant()
    def books_add_up(self) -> None:
        self.h.core.check()
        assert not self.violations, self.violations

    @invariant()
    def a_request_that_can_be_served_is_never_starved(self) -> None:
        core = self.h.core
        ahead: list[Entry] = []  # earlier waiters that do not wait aside
        for waiter in core.queue:
            if waiter.after is None and not waiter.gated:
                fits = all(
                    core.spaces[name].used + amount <= core.spaces[name].capacity
                    for name, amount in waiter.need.items()
                )
                behind = any(not set(e.need).isdisjoint(waiter.need) for e in ahead)
                assert not fits or behind, (
                    f"{waiter!r} needs {waiter.need}, which is free, and no earlier "
                    f"waiter that could be served shares its spaces; queue {list(core.queue)}"
                )
            if not waits_aside(core, waiter):
                ahead.append(waiter)

    def teardown(self) -> None:
        try:
            h = self.h
            for entry in list(self.overdue):
                h.core.release_done(entry)
            h.drain()
            h.core.check()
        finally:
            self.unwatch()


TestFairness = FairnessMachine.TestCase
TestFairness.settings = settings(max_examples=settings().max_examples, stateful_step_count=60)
