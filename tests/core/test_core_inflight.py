"""Property-based tests of the core with loads and releases in flight.

Loads and releases complete (or fail) in any order the test chooses, requesters
withdraw at any time, and releases may be refused and acknowledged late. No
reference model here: the invariants alone must hold after every step.
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cachebroker import BrokerClosed, DeadlockError, OutOfSpace
from cachebroker._core import Entry, State, Ticket
from tests.harness import Harness
from tests.strategies import KEYS, SPACES, TASKS, charges


class InFlightMachine(RuleBasedStateMachine):
    """Invariants, checked after every step:

    * the books add up (``Core.check``): per space, ``used`` is the sum of the
      charges of entries holding memory and never exceeds the budget unless a
      load was measured larger than declared;
    * no entry is asked to release while leased;
    * every ticket ends with exactly one outcome, and once everything has
      finished, nothing is left: no waiter, no reservation, no lease.
    """

    def __init__(self) -> None:
        super().__init__()
        self.h = Harness(SPACES, idle_ttl=30.0)
        self.tickets: list[Ticket] = []
        self.leases: list[Ticket] = []
        self.quarantined: list[Entry] = []

    @rule(key=KEYS, size=charges(), task=TASKS)
    def acquire(self, key: str, size: dict[str, int], task: int) -> None:
        try:
            ticket = self.h.acquire(key, {s: n for s, n in size.items() if n}, task=task)
        except (OutOfSpace, DeadlockError):  # (RequestTooLarge is an OutOfSpace)
            return
        self.tickets.append(ticket)

    @precondition(lambda self: self.h.loading)
    @rule(data=st.data(), grow=st.integers(-10, 10))
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
    @rule(data=st.data())
    def acknowledge_late(self, data: st.DataObject) -> None:
        entry = data.draw(st.sampled_from(self.quarantined))
        self.quarantined.remove(entry)
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

    @precondition(lambda self: any(t.outcome is True for t in self.tickets))
    @rule(
        data=st.data(),
        ttl=st.sampled_from([None, 0.0, 5.0, float("inf")]),
        pin=st.sampled_from([None, True]),
    )
    def configure(self, data: st.DataObject, ttl: float | None, pin: bool | None) -> None:
        ticket = data.draw(st.sampled_from([t for t in self.tickets if t.outcome is True]))
        self.h.core.configure(ticket.entry, idle_ttl=ttl, pin=pin)

    @precondition(lambda self: len(self.h.core.canon.names) == 2)
    @rule()
    def merge_spaces(self) -> None:
        """The two spaces turn out to be one memory, with work in flight."""
        self.h.core.merge_spaces("ram", "gpu")
        self.h.drain()

    @rule(key=KEYS)
    def unpin(self, key: str) -> None:
        self.h.core.unpin(self.h.owner, key, self.h.now)
        self.h.drain()

    @rule(key=KEYS)
    def invalidate(self, key: str) -> None:
        self.h.core.invalidate(self.h.owner, key)
        self.h.drain()

    @rule(dt=st.floats(0, 40))
    def sweep(self, dt: float) -> None:
        self.h.now += dt
        self.h.core.sweep(self.h.now)
        self.h.drain()

    @invariant()
    def books_add_up(self) -> None:
        self.h.core.check()
        for entry in self.h.releasing:
            assert entry.leases == 0
        for ticket in list(self.tickets):
            if isinstance(ticket.outcome, BaseException):
                self.tickets.remove(ticket)

    def teardown(self) -> None:
        """Finish everything; then the books must be empty of waiters and leases."""
        h = self.h
        for _ in range(200):
            if h.cancelled:
                self.loads_honour_cancellation()
            elif h.loading:
                h.finish(h.loading[0])
            elif h.releasing:
                h.ack(h.releasing[0])
            elif self.quarantined:
                h.core.release_done(self.quarantined.pop())
                h.drain()
            elif any(t.outcome is True for t in self.tickets):
                self.end_lease_first()
            elif self.tickets:
                h.leave(self.tickets.pop())
            else:
                break
            h.core.check()
        assert not h.core.queue, h.core.queue
        assert not any(entry.leases for entry in h.core.busy), h.core.busy
        h.core.clear()
        h.drain()
        while h.releasing:
            h.ack(h.releasing[0])
        assert all(space.used == 0 for space in h.core.spaces.values())
        assert not h.owner.live

    def end_lease_first(self) -> None:
        ticket = next(t for t in self.tickets if t.outcome is True)
        self.tickets.remove(ticket)
        self.h.end(ticket)


TestCoreWithWorkInFlight = InFlightMachine.TestCase
