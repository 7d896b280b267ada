"""Property-based tests of the core against a plain reference model of LRU.

Loads and releases complete at once, so between steps every entry is either
queued for space or resident; the reference model keeps that world in lists
and recomputes everything naively.
"""

from __future__ import annotations

from collections.abc import Hashable

import pytest
from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cachebroker import DeadlockError, RequestTooLarge
from cachebroker._core import Entry, Reason, Ticket
from cachebroker._policies import LRU
from tests.harness import Harness
from tests.strategies import KEYS, SPACES, TASKS, charges


class Resident:
    """The model's view of a loaded entry."""

    def __init__(self, key: Hashable, charge: dict[str, int]) -> None:
        self.key = key
        self.charge = charge
        self.holders: list[object] = []
        self.idle_order: int | None = None
        self.idle_since = 0.0
        self.doomed = False


class Waiter:
    def __init__(self, key: Hashable, need: dict[str, int]) -> None:
        self.key = key
        self.need = need
        self.tasks: list[object] = []
        #: Its tasks that held a lease in its spaces when they asked: it may
        #: pass a waiter that cannot be covered (which may wait for that lease).
        self.holding: list[object] = []


class Model:
    """LRU over idle entries, FIFO per space, evicting only when it covers a waiter."""

    def __init__(self, ttl: float) -> None:
        self.resident: list[Resident] = []
        self.current: dict[Hashable, Resident] = {}
        self.queue: list[Waiter] = []
        self.order = 0
        self.ttl = ttl
        self.now = 0.0
        self.evicted: list[tuple[Hashable, Reason]] = []

    def used(self, space: str) -> int:
        return sum(r.charge.get(space, 0) for r in self.resident)

    def idle(self) -> list[Resident]:
        return sorted(
            (r for r in self.resident if r.idle_order is not None), key=lambda r: r.idle_order or 0
        )

    def rest(self, r: Resident) -> None:
        if r.doomed:
            self.evict(r, Reason.INVALIDATE)
            return
        self.order += 1
        r.idle_order = self.order
        r.idle_since = self.now

    def evict(self, r: Resident, reason: Reason) -> None:
        self.resident.remove(r)
        if self.current.get(r.key) is r:
            del self.current[r.key]
        self.evicted.append((r.key, reason))

    def out_of_reach(self, waiter: Waiter) -> bool:
        """Whether, in one of its spaces, it needs more than all but the leases of its
        own lease-holding tasks there: no eviction could let it in (it waits aside)."""
        mine = [
            r
            for r in self.resident
            if set(r.holders) & set(waiter.holding) and r.charge.keys() & waiter.need.keys()
        ]
        return any(
            n > SPACES[s] - sum(r.charge.get(s, 0) for r in mine) for s, n in waiter.need.items()
        )

    def schedule(self) -> None:
        """FIFO per space: a waiter that cannot be covered blocks its spaces for those
        behind it (but for lease holders), unless it waits aside (``out_of_reach``)."""
        blocked: set[str] = set()
        for waiter in list(self.queue):
            short = {s: n - (SPACES[s] - self.used(s)) for s, n in waiter.need.items()}
            short = {s: n for s, n in short.items() if n > 0}
            if blocked & waiter.need.keys() and not waiter.holding:
                if not (short and self.out_of_reach(waiter)):
                    blocked |= waiter.need.keys()
                continue
            if short:
                idle = self.idle()
                if any(sum(r.charge.get(s, 0) for r in idle) < n for s, n in short.items()):
                    if not self.out_of_reach(waiter):
                        blocked |= waiter.need.keys()
                    continue
                for r in idle:  # oldest first, only those that help a still-short space
                    if not short:
                        break
                    if not short.keys() & r.charge.keys():
                        continue
                    self.evict(r, Reason.CAPACITY)
                    for s in list(short):
                        short[s] -= r.charge.get(s, 0)
                        if short[s] <= 0:
                            del short[s]
            self.queue.remove(waiter)
            r = Resident(waiter.key, waiter.need)
            r.holders = list(waiter.tasks)
            self.resident.append(r)
            self.current[waiter.key] = r

    def pinned_by(self, task: object, space: str) -> int:
        return sum(r.charge.get(space, 0) for r in self.resident if task in r.holders)


class CoreMachine(RuleBasedStateMachine):
    """Invariants, checked after every step:

    * per space, ``used`` equals the sum of the resident entries' sizes and
      never exceeds the budget;
    * no leased entry is ever chosen as a victim;
    * victims are chosen in LRU order among idle entries of the short spaces
      (the release sequence equals the model's);
    * the set of cached keys and of queued keys equals the model's.
    """

    def __init__(self) -> None:
        super().__init__()
        self.h = Harness(SPACES, idle_ttl=50.0, policy=LRU(), instant=True)
        self.model = Model(ttl=50.0)
        self.leases: list[Ticket] = []
        self.pending: list[Ticket] = []
        self.records: dict[Entry, Resident] = {}

    # ----------------------------------------------------------------- rules

    @rule(key=KEYS, size=charges(), task=TASKS)
    def acquire(self, key: str, size: dict[str, int], task: int) -> None:
        if any(ticket.task == task for ticket in self.pending):
            return  # (a task waiting in acquire asks for nothing else meanwhile)
        m = self.model
        need = {s: n for s, n in size.items() if n}
        r = m.current.get(key)
        waiter = next((w for w in m.queue if w.key == key), None)
        expect_error: type[Exception] | None = None
        if r is not None:
            r.holders.append(task)
            r.idle_order = None
        elif waiter is not None:
            if self._deadlocks(task, waiter.need) or self._closes_cycle(task, waiter.need):
                expect_error = DeadlockError
            else:
                self._join(waiter, task)
                m.schedule()  # a joiner holding a lease may let it pass a blocked waiter
        elif any(n > SPACES[s] for s, n in need.items()):
            expect_error = RequestTooLarge
        elif self._deadlocks(task, need) or self._closes_cycle(task, need):
            expect_error = DeadlockError
        else:
            waiter = Waiter(key, need)
            self._join(waiter, task)
            m.queue.append(waiter)
            m.schedule()
        if expect_error is not None:
            with pytest.raises(expect_error):
                self.h.acquire(key, need, task=task)
            return
        ticket = self.h.acquire(key, need, task=task)
        (self.leases if ticket.outcome is True else self.pending).append(ticket)

    def _join(self, waiter: Waiter, task: object) -> None:
        waiter.tasks.append(task)
        if any(
            task in r.holders and r.charge.keys() & waiter.need.keys() for r in self.model.resident
        ):
            waiter.holding.append(task)

    def _deadlocks(self, task: object, need: dict[str, int]) -> bool:
        m = self.model
        if all(m.used(s) + n <= SPACES[s] for s, n in need.items()):
            return False
        return any(
            m.pinned_by(task, s) and n > SPACES[s] - m.pinned_by(task, s) for s, n in need.items()
        )

    def _closes_cycle(self, task: object, need: dict[str, int]) -> bool:
        """Whether ``task``, a lease holder, would wait among lease holders none of
        which can ever be served: take out, again and again, each waiting lease
        holder that fits once every byte but the leases of those left came back."""
        m = self.model
        if all(m.used(s) + n <= SPACES[s] for s, n in need.items()):
            return False

        def holds(t: object) -> bool:
            return any(t in r.holders for r in m.resident)

        if not holds(task):
            return False
        asking = (task, need)
        left = [asking] + [(t, w.need) for w in m.queue for t in w.tasks if holds(t)]
        while True:
            tasks = {t for t, _ in left}
            held = [r for r in m.resident if tasks & set(r.holders)]
            room = {s: b - sum(r.charge.get(s, 0) for r in held) for s, b in SPACES.items()}
            going = [w for w in left if all(a <= room[s] for s, a in w[1].items())]
            if not going:
                return any(w is asking for w in left)
            left = [w for w in left if not any(w is g for g in going)]

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def release_lease(self, data: st.DataObject) -> None:
        ticket = data.draw(st.sampled_from(self.leases))
        self.leases.remove(ticket)
        m = self.model
        r = self.records[ticket.entry]
        r.holders.remove(ticket.task)
        if not r.holders:
            m.rest(r)
            m.schedule()
        self.h.end(ticket)

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def withdraw(self, data: st.DataObject) -> None:
        ticket = data.draw(st.sampled_from(self.pending))
        self.pending.remove(ticket)
        m = self.model
        waiter = next(w for w in m.queue if w.key == ticket.entry.key)
        waiter.tasks.remove(ticket.task)
        if ticket.holds:
            waiter.holding.remove(ticket.task)
        if not waiter.tasks:
            m.queue.remove(waiter)
            m.schedule()
        self.h.leave(ticket)

    @rule(key=KEYS)
    def invalidate(self, key: str) -> None:
        m = self.model
        r = m.current.get(key)
        expected = r is not None
        if r is not None:
            del m.current[key]
            if r.holders:
                r.doomed = True
            else:
                m.evict(r, Reason.INVALIDATE)
            m.schedule()
        assert self.h.core.invalidate(self.h.owner, key) is expected
        self.h.drain()

    @rule(dt=st.floats(0, 40))
    def advance_and_sweep(self, dt: float) -> None:
        m = self.model
        m.now += dt
        self.h.now = m.now
        for r in m.idle():
            if r.idle_since + m.ttl <= m.now:
                m.evict(r, Reason.IDLE)
        m.schedule()
        self.h.core.sweep(m.now)
        self.h.drain()

    # ------------------------------------------------------------ invariants

    @invariant()
    def books_match_model(self) -> None:
        h, m = self.h, self.model
        self._follow_grants()
        h.core.check()
        for space, budget in SPACES.items():
            used = h.core.spaces[space].used
            assert used == m.used(space), (space, used, m.used(space))
            assert used <= budget
        assert h.cached_keys() - {
            k for k, e in h.owner.entries.items() if e.state.value == "waiting"
        } == set(m.current)
        assert [e.key for e in h.core.queue] == [w.key for w in m.queue]
        note(f"released: {h.released}")
        assert h.released == m.evicted

    @invariant()
    def leased_entries_never_chosen(self) -> None:
        for entry in self.h.releasing:
            assert entry.leases == 0

    def _follow_grants(self) -> None:
        # Pair each resident core entry with its model record, and move tickets
        # whose wait was granted during the step over to the leases.
        for key, r in self.model.current.items():
            self.records.setdefault(self.h.owner.entries[key], r)
        for ticket in [t for t in self.pending if t.outcome is not None]:
            assert ticket.outcome is True, ticket.outcome
            self.pending.remove(ticket)
            self.leases.append(ticket)


TestCoreAgainstLRUModel = CoreMachine.TestCase
