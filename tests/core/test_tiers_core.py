"""Memory tiers in the books: a stateful machine driving ``Core`` with ``tiers=``.

Two layouts: two GPUs over one RAM (``gpu0, gpu1 -> ram``) and a chain
(``gpu -> ram -> disk``). Two caches: ``p``, whose releaser can move values, and
``q``, whose releaser cannot. Random requests (each key sized in one space, with
random priorities), lease ends, withdrawn tickets, loads finishing (measured
larger or smaller) or failing, releases acknowledged or refused, moves finishing,
failing or finishing measured at another size, invalidations, clears, idle
sweeps, priority changes, capacity changes of the lower tiers, closing and
reopening a cache, and writing quarantined entries off; under every built-in
policy.

After every step: ``Core.check()``; no space charged above its capacity unless a
measurement or a capacity change put it there; every withdrawn or pending ticket
where it belongs; the moves the harness performs are exactly the moves in flight;
at most one live value per key (single flight across tiers); an entry is charged
in two spaces only while it moves (or once quarantined by a failed move); a
demoted entry lies below the space it was loaded in, and its value went where
its charge says. A request for an entry whose demotion still waits for room gets
it back at once; a request for a moving or demoted entry starts no load. And
after every run: once every lease, ticket, load, release and move has ended, the
books hold exactly the idle and quarantined entries; once the caches close and
the quarantined entries are written off, every space is back to zero.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import pytest
from hypothesis import note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cachebroker import BrokerClosed, DeadlockError, OutOfSpace
from cachebroker._core import (
    Effect,
    Entry,
    Owner,
    Request,
    StartLoad,
    StartMove,
    State,
    Ticket,
)
from cachebroker._policies import make_policy
from tests.harness import Harness

POLICIES = ["lru", "fifo", "gdsf", "cost"]

#: Budgets and tiers: two upper spaces over one lower, and a chain of three.
LAYOUTS: dict[str, tuple[dict[str, int], dict[str, str]]] = {
    "fan": ({"gpu0": 100, "gpu1": 100, "ram": 150}, {"gpu0": "ram", "gpu1": "ram"}),
    "chain": ({"gpu": 100, "ram": 120, "disk": 150}, {"gpu": "ram", "ram": "disk"}),
}

KEYS = st.sampled_from("abcdefg")
PRIORITIES = st.sampled_from([None, None, None, 0, 1])


def below(tiers: dict[str, str], space: str) -> list[str]:
    """The spaces under ``space``, nearest first."""
    chain = []
    lower = tiers.get(space)
    while lower is not None:
        chain.append(lower)
        lower = tiers.get(lower)
    return chain


class Tiered(Harness):
    """The harness, checking each move and load as the core asks for it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.problems: list[str] = []

    def perform(self, effect: Effect) -> None:
        match effect:
            case StartLoad(entry):
                for other in entry.owner.live:
                    if (
                        other is not entry
                        and other.key == entry.key
                        and other.doomed is None
                        and other.state in (State.READY, State.MOVING, State.DEMOTED)
                    ):
                        self.problems.append(f"load of {entry!r} while {other!r} holds its value")
            case StartMove(entry, to):
                tiers = self.core.tiers
                if entry.promoting:
                    if entry.home is None or to not in entry.home:
                        self.problems.append(f"{entry!r} promoted to {to!r}, home {entry.home}")
                else:
                    sources = [name for name in entry.charge if name in tiers]
                    if [tiers[name] for name in sources] != [to]:
                        self.problems.append(f"{entry!r} ({entry.charge}) demoted to {to!r}")
                if entry.leases:
                    self.problems.append(f"{entry!r} moved while leased")
        super().perform(effect)


class TiersMachine(RuleBasedStateMachine):
    h: Tiered | None = None

    @initialize(
        layout=st.sampled_from(sorted(LAYOUTS)),
        policy=st.sampled_from(POLICIES),
        ttl=st.sampled_from([None, 5.0]),
        instant_moves=st.booleans(),
    )
    def setup(self, layout: str, policy: str, ttl: float | None, instant_moves: bool) -> None:
        budget, tiers = LAYOUTS[layout]
        h = self.h = Tiered(
            dict(budget), policy=make_policy(policy), idle_ttl=ttl, tiers=tiers, moves=True
        )
        self.budget = budget
        self.tiers = tiers
        self.spaces = sorted(budget)
        self.lower = sorted(set(tiers.values()))
        self.upper = sorted(tiers)  # (drawn more often: that is where moves start)
        self.instant_moves = instant_moves
        self.owners: dict[str, Owner] = {"p": h.owner, "q": h.core.open_owner("q")}
        self.sizes: dict[tuple[str, Hashable], dict[str, int]] = {}
        self.held: list[Ticket] = []
        self.pending: list[Ticket] = []
        self.tasks = 0
        #: A measurement or a capacity change may drive a space over its capacity.
        self.grew = False
        #: Creation order of entries: draws must not depend on set order (ids).
        self.born: dict[Entry, int] = {}
        #: Steps taken: the rules that end much (clear, close, ...) run only every so often.
        self.steps = 0

    # -- helpers --------------------------------------------------------------------

    @property
    def harness(self) -> Tiered:
        assert self.h is not None
        return self.h

    def _sorted(self, entries: list[Entry]) -> list[Entry]:
        return sorted(entries, key=lambda e: self.born.get(e, -1))

    def _collect(self) -> None:
        h = self.harness
        if self.instant_moves:
            while h.moving:
                entry = self._sorted([moving for moving, _ in h.moving])[0]
                h.move(entry)
        for ticket in list(self.pending):
            if ticket.outcome is True:
                self.pending.remove(ticket)
                self.held.append(ticket)
            elif ticket.outcome is not None:
                self.pending.remove(ticket)

    # -- requests, leases, tickets ---------------------------------------------------

    def _request(
        self,
        which: str,
        key: str,
        task: int,
        priority: int | None,
        data: st.DataObject,
        slots: int | None = None,
    ) -> Ticket | None:
        h = self.harness
        owner = self.owners[which]
        need = self.sizes.get((which, key))
        if need is None:
            space = data.draw(st.sampled_from(self.upper + self.spaces), label="space")
            amount = data.draw(st.sampled_from([40, 30, 20, 50, 60, 10, 0]), label="size")
            # (0: a size measured after the load; a key never measured reserves a guess)
            need = self.sizes[which, key] = {space: amount}
        self.tasks += 1
        who = task if task else self.tasks + 100
        before = owner.entries.get(key)
        was_demoting = before is not None and before in h.core.demoting
        was_parked = (
            before is not None
            and before.state in (State.MOVING, State.DEMOTED)
            and before.doomed is None
        )
        loads = len(h.loading)
        try:
            declared = None if 0 in need.values() else dict(need)
            ticket = h.core.request(
                owner, Request(key, declared, priority=priority, slots=slots), who
            )
        except (DeadlockError, OutOfSpace, BrokerClosed) as exc:
            note(f"request {which}:{key} {need} task={who} raised {exc!r}")
            h.drain()
            self._collect()
            return None
        self.born.setdefault(ticket.entry, len(self.born))
        h.drain()
        note(
            f"request {which}:{key} {need} task={who} p={priority} s={slots} -> {ticket.outcome!r}"
        )
        if was_demoting and before is not None and before.home is None:
            # Its demotion still waited for room: it is taken back at once.
            assert ticket.entry is before and ticket.outcome is True, (before, ticket.outcome)
        if was_parked:
            assert ticket.entry is before, (before, ticket.entry)
            started = [e for e in h.loading[loads:] if e.owner is owner and e.key == key]
            assert not started, f"{before!r} is moving or demoted, yet {key!r} loads again"
        if ticket.outcome is True:
            self.held.append(ticket)
        elif ticket.outcome is None:
            self.pending.append(ticket)
        self._collect()
        return ticket

    @rule(
        which=st.sampled_from("ppq"),
        key=KEYS,
        task=st.integers(0, 3),
        priority=PRIORITIES,
        data=st.data(),
    )
    def request(
        self, which: str, key: str, task: int, priority: int | None, data: st.DataObject
    ) -> None:
        self._request(which, key, task, priority, data)

    @rule(
        which=st.sampled_from("pq"),
        key=KEYS,
        task=st.integers(0, 3),
        slots=st.integers(1, 2),
        data=st.data(),
    )
    def request_limited(
        self, which: str, key: str, task: int, slots: int, data: st.DataObject
    ) -> None:
        self._request(which, key, task, None, data, slots)

    @rule(which=st.sampled_from("ppq"), key=KEYS, task=st.integers(0, 3), data=st.data())
    def request_again(self, which: str, key: str, task: int, data: st.DataObject) -> None:
        self._request(which, key, task, None, data)

    @rule(which=st.sampled_from("ppq"), key=KEYS, data=st.data())
    def use(self, which: str, key: str, data: st.DataObject, moves: bool = True) -> None:
        """A request served to the end: the loads, moves and releases it waits for
        finish (first started first; the moves only if ``moves``), and its lease ends."""
        mine = self._request(which, key, 0, None, data)
        h = self.harness
        if mine is not None:
            for _ in range(50):
                if mine.outcome is not None:
                    break
                if mine.entry in h.loading:
                    note(f"finish {mine.entry!r}")
                    h.finish(mine.entry)
                elif h.moving and moves:
                    entry = self._sorted([moving for moving, _ in h.moving])[0]
                    note(f"move of {entry!r} done")
                    h.move(entry)
                elif h.releasing:
                    entry = self._sorted(h.releasing)[0]
                    note(f"release of {entry!r} done")
                    h.ack(entry)
                else:
                    break
            self._collect()
        if mine is not None and mine in self.held:
            note(f"end {mine.entry!r} task={mine.task}")
            self.held.remove(mine)
            h.end(mine)
        self._collect()

    @rule(which=st.sampled_from("ppq"), key=KEYS, data=st.data())
    def use_again(self, which: str, key: str, data: st.DataObject) -> None:
        self.use(which, key, data)

    @rule(which=st.sampled_from("pp"), key=KEYS, data=st.data())
    def use_leaving_moves(self, which: str, key: str, data: st.DataObject) -> None:
        self.use(which, key, data, moves=False)

    @precondition(lambda self: self.h is not None and self.held)
    @rule(data=st.data())
    def end(self, data: st.DataObject) -> None:
        ticket = self.held.pop(data.draw(st.integers(0, len(self.held) - 1), label="lease"))
        note(f"end {ticket.entry!r} task={ticket.task}")
        self.harness.end(ticket)
        self._collect()

    @precondition(lambda self: self.h is not None and self.held)
    @rule(data=st.data())
    def end_again(self, data: st.DataObject) -> None:
        self.end(data)

    @precondition(lambda self: self.h is not None and self.pending)
    @rule(data=st.data())
    def leave(self, data: st.DataObject) -> None:
        ticket = self.pending.pop(data.draw(st.integers(0, len(self.pending) - 1), label="ticket"))
        entry = ticket.entry
        state = entry.state
        note(f"leave {entry!r} task={ticket.task}")
        loads = len(self.harness.loading)
        self.harness.leave(ticket)
        if state is State.DEMOTED and not entry.joiners:
            # Nobody waits for its promotion any more: it stays demoted (idle, unless
            # evicted from the lower tier at once), and nothing loads or moves it up.
            assert entry not in self.harness.core.queue, entry
            assert entry.state is not State.MOVING or not entry.promoting, entry
            started = [e for e in self.harness.loading[loads:] if e.key == entry.key]
            assert not started or entry.owner is not started[0].owner, (entry, started)
        self._collect()

    # -- loads, releases, moves ------------------------------------------------------

    @precondition(lambda self: self.h is not None and self.h.loading)
    @rule(data=st.data())
    def load_failed(self, data: st.DataObject) -> None:
        self.finish(data, False, 0)

    @precondition(lambda self: self.h is not None and self.h.loading)
    @rule(data=st.data(), ok=st.just(True), grow=st.sampled_from([0, 0, -5, 10]))
    def finish(self, data: st.DataObject, ok: bool, grow: int) -> None:
        h = self.harness
        entry = data.draw(st.sampled_from(self._sorted(h.loading)))
        note(f"finish {entry!r} ok={ok} grow={grow}")
        if ok:
            measured = None
            if grow:
                measured = {k: max(1, v + grow) for k, v in entry.charge.items()}
                self.grew = self.grew or grow > 0
            if (entry.owner.name, entry.key) in self.sizes and entry.unknown:
                ((space, _),) = self.sizes[entry.owner.name, entry.key].items()
                measured = {space: 35}  # measured: its guess may have been smaller
                self.grew = True
            h.finish(entry, measured=measured)
        else:
            h.fail(entry, RuntimeError("load failed"))
        self._collect()

    @precondition(lambda self: self.h is not None and self.h.cancelled)
    @rule()
    def cancelled_load_ends(self) -> None:
        h = self.harness
        entry = self._sorted(h.cancelled)[0]
        h.cancelled.remove(entry)
        if entry in h.loading:
            note(f"cancelled load of {entry!r} ends")
            h.loading.remove(entry)
            h.core.load_failed(entry, RuntimeError("cancelled"), cancelled=True)
            h.drain()
        self._collect()

    @precondition(lambda self: self.h is not None and self.h.releasing)
    @rule(data=st.data())
    def release_failed(self, data: st.DataObject) -> None:
        self.released(data, False)

    @precondition(lambda self: self.h is not None and self.h.releasing)
    @rule(data=st.data(), ok=st.just(True))
    def released(self, data: st.DataObject, ok: bool) -> None:
        h = self.harness
        entry = data.draw(st.sampled_from(self._sorted(h.releasing)))
        note(f"release of {entry!r} ok={ok}")
        if ok:
            h.ack(entry)
        else:
            h.refuse(entry)
        self._collect()

    def _move(self, data: st.DataObject, how: str, grow: int = 0) -> None:
        h = self.harness
        entry, to = data.draw(st.sampled_from(sorted(h.moving, key=lambda m: self.born[m[0]])))
        note(f"move of {entry!r} to {to} {how} grow={grow}")
        if how == "failed":
            h.move(entry, error=RuntimeError("move failed"))
        elif how == "measured":
            assert entry.target is not None
            measured = {to: max(1, entry.target[to] + grow)}
            self.grew = self.grew or grow > 0
            h.move(entry, measured=measured)
        else:
            h.move(entry)
        self._collect()

    @precondition(lambda self: self.h is not None and self.h.moving)
    @rule(data=st.data())
    def moved(self, data: st.DataObject) -> None:
        self._move(data, "done")

    @precondition(lambda self: self.h is not None and self.h.moving)
    @rule(data=st.data())
    def moved_again(self, data: st.DataObject) -> None:
        self._move(data, "done")

    @precondition(lambda self: self.h is not None and self.h.moving)
    @rule(data=st.data())
    def move_failed(self, data: st.DataObject) -> None:
        self._move(data, "failed")

    @precondition(lambda self: self.h is not None and self.h.moving)
    @rule(data=st.data(), grow=st.integers(-10, 10))
    def moved_measured(self, data: st.DataObject, grow: int) -> None:
        self._move(data, "measured", grow)

    # -- invalidate, clear, sweep, priorities, capacity, forget ----------------------

    @precondition(lambda self: self.h is not None and self.steps % 2 == 1)
    @rule(which=st.sampled_from("ppq"), key=KEYS)
    def invalidate(self, which: str, key: str) -> None:
        h = self.harness
        entry = self.owners[which].entries.get(key)
        note(f"invalidate {which}:{key} ({entry!r})")
        h.core.invalidate(self.owners[which], key)
        h.drain()
        if entry is not None and entry.state is not State.GONE:
            # Its key holds no value any more (a new acquire loads afresh).
            assert self.owners[which].entries.get(key) is not entry or entry.state in (
                State.RELEASING,
                State.WAITING,
            ), entry
        self._collect()

    @precondition(lambda self: self.h is not None and self.steps % 10 == 9)
    @rule()
    def clear(self) -> None:
        note("clear")
        self.harness.core.clear()
        self.harness.drain()
        self._collect()

    @precondition(lambda self: self.h is not None and self.steps % 3 == 2)
    @rule(dt=st.floats(0, 10))
    def sweep(self, dt: float) -> None:
        h = self.harness
        h.now += dt
        note(f"sweep at {h.now}")
        h.core.sweep(h.now)
        h.drain()
        self._collect()

    @precondition(lambda self: self.h is not None and self.steps % 3 == 1)
    @rule(which=st.sampled_from("pq"), key=KEYS, priority=st.integers(0, 1))
    def limit(self, which: str, key: str, priority: int) -> None:
        h = self.harness
        entry = self.owners[which].entries.get(key)
        if entry is None:
            return
        note(f"priority of {entry!r} -> {priority}")
        h.core.limit(entry, priority=priority)
        h.drain()
        self._collect()

    @precondition(lambda self: self.h is not None and self.steps % 8 == 7)
    @rule(data=st.data())
    def capacity(self, data: st.DataObject) -> None:
        h = self.harness
        name = data.draw(st.sampled_from(self.lower + self.spaces))
        capacity = data.draw(st.integers(60, self.budget[name]))
        note(f"capacity of {name} -> {capacity}")
        self.grew = self.grew or capacity < h.core.spaces[name].used
        h.core.set_capacity(name, capacity)
        h.drain()
        self._collect()

    @rule(which=st.sampled_from("pq"), key=KEYS, pin=st.booleans())
    def pin(self, which: str, key: str, pin: bool) -> None:
        h = self.harness
        owner = self.owners[which]
        entry = owner.entries.get(key)
        if entry is None:
            return
        if pin:
            if entry.state is State.READY and entry.leases:  # (as acquire(pin=True) does)
                note(f"pin {entry!r}")
                h.core.configure(entry, pin=True)
        else:
            note(f"unpin {entry!r}")
            h.core.unpin(owner, key, h.now)
            h.drain()
        self._collect()

    @precondition(lambda self: self.h is not None and self.h.core.quarantined)
    @rule(data=st.data())
    def forget(self, data: st.DataObject) -> None:
        h = self.harness
        entry = data.draw(st.sampled_from(self._sorted(list(h.core.quarantined))))
        note(f"forget {entry!r}")
        h.core.forget(entry)
        h.drain()
        self._collect()

    @precondition(lambda self: self.h is not None and self.steps % 12 == 11)
    @rule(which=st.sampled_from("pq"))
    def close(self, which: str) -> None:
        h = self.harness
        owner = self.owners[which]
        if owner.closing:
            if owner.live:
                note(f"abandon {which}")
                h.core.abandon(owner)
                h.drain()
            if not owner.live:
                note(f"reopen {which}")
                h.core.forget_owner(owner)
                self.owners[which] = h.core.open_owner(which, moves=which == "p")
                self.sizes = {k: v for k, v in self.sizes.items() if k[0] != which}
        else:
            note(f"close {which}")
            h.core.close_owner(owner, BrokerClosed(f"{which} closed"))
            h.drain()
        self._collect()

    @precondition(lambda self: self.h is not None and self.steps % 16 == 15)
    @rule()
    def quiesce(self) -> None:
        """End everything in flight; the books then hold only idle and quarantined entries."""
        note("quiesce")
        self._quiesce()
        core = self.harness.core
        assert not core.queue and not core.demoting
        for entry in core.entries():
            if entry.state is State.QUARANTINED:
                continue
            assert entry.state in (State.READY, State.DEMOTED), entry
            assert entry.idle_seq or entry.pinned or entry in core.settling, entry
        for name in core.canon.names:
            space = core.spaces[name]
            held = sum(e.charge.get(name, 0) for e in core.entries())
            assert space.used == held, (name, space.used, held)
            assert space.releasing == 0, (name, space.releasing)
            settling = sum(e.charge.get(name, 0) for e in core.settling)
            # (A pinned entry whose release failed is quarantined: counted there.)
            pinned = sum(
                e.charge.get(name, 0)
                for e in core.entries()
                if e.pinned and e.state is not State.QUARANTINED
            )
            assert space.idle_bytes + settling + pinned == space.used - space.quarantined, name

    def _quiesce(self) -> None:
        h = self.harness
        for _ in range(1_000):
            self._collect()
            if self.held:
                h.end(self.held.pop(0))
            elif self.pending:
                h.leave(self.pending.pop(0))
            elif h.cancelled:
                entry = self._sorted(h.cancelled)[0]
                h.cancelled.remove(entry)
                if entry in h.loading:
                    h.loading.remove(entry)
                    h.core.load_failed(entry, RuntimeError("cancelled"), cancelled=True)
                    h.drain()
            elif h.loading:
                h.finish(self._sorted(h.loading)[0])
            elif h.releasing:
                h.ack(self._sorted(h.releasing)[0])
            elif h.moving:
                h.move(self._sorted([entry for entry, _ in h.moving])[0])
            else:
                return
        raise AssertionError("the books never came to rest")

    # -- invariants -----------------------------------------------------------------

    @invariant()
    def books_add_up(self) -> None:
        if self.h is None:
            return
        h = self.h
        core = h.core
        self.steps += 1
        assert not h.problems, h.problems
        core.check()
        for name in core.canon.names:
            space = core.spaces[name]
            if not self.grew:
                assert space.used <= space.capacity, (name, space.used, space.capacity)
                assert name not in core.overdrawn, name
        for ticket in self.pending:
            assert ticket.outcome is None and ticket in ticket.entry.joiners, ticket.entry
        for ticket in self.held:
            # (A lease on an abandoned entry outlives its quarantine: ``forget``.)
            assert ticket.entry.state in (State.READY, State.QUARANTINED, State.GONE), ticket
            assert ticket.task in ticket.entry.holders, ticket.entry
        in_flight = {
            e for e in core.entries() if e.state is State.MOVING and e not in core.demoting
        }
        assert {e for e, _ in h.moving} == in_flight, (h.moving, in_flight)
        assert len(h.moving) == len(in_flight), h.moving
        values: dict[tuple[str, Hashable], Entry] = {}
        for entry in core.entries():
            if entry.state in (State.READY, State.MOVING, State.DEMOTED) and entry.doomed is None:
                other = values.setdefault((entry.owner.name, entry.key), entry)
                assert other is entry, (other, entry)
            if entry.state in (State.READY, State.DEMOTED, State.RELEASING):
                # In two spaces only while moving (a load of unknown size may reserve
                # its cache's largest size in every space until it is measured).
                assert len(entry.charge) <= 1 or entry.unknown, entry
            if entry.state is State.DEMOTED:
                assert entry.owner.moves and entry.home is not None, entry
                # It lies below where it was loaded: each space of its charge is one
                # of its home's (an entry of unknown size may have reserved several)
                # or below one of them.
                assert entry.charge != entry.home, entry
                assert all(
                    where in entry.home or any(where in below(self.tiers, h) for h in entry.home)
                    for where in entry.charge
                ), (entry, entry.home, entry.charge)
            if entry.state in (State.READY, State.DEMOTED) and "@" in str(entry.value):
                where = str(entry.value).rsplit("@", 1)[1]
                assert where in entry.charge, (entry, entry.value, entry.charge)
            if entry.state is State.READY:  # where it was loaded: never leased lower
                assert entry.home is None, entry

    def teardown(self) -> None:
        if self.h is None:
            return
        h = self.h
        core = h.core
        self._quiesce()
        for which, owner in self.owners.items():
            if not owner.closing:
                core.close_owner(owner, BrokerClosed(f"{which} closed"))
                h.drain()
        self._quiesce()
        for entry in list(core.quarantined):
            core.forget(entry)
            h.drain()
        self._quiesce()
        core.check()
        assert not list(core.entries()), list(core.entries())
        for name in core.canon.names:
            space = core.spaces[name]
            books = (space.used, space.releasing, space.idle_bytes, space.quarantined)
            assert books == (0, 0, 0, 0), (name, books)
        assert all(owner in h.emptied for owner in self.owners.values())


TestTiersMachine = TiersMachine.TestCase
TestTiersMachine.settings = settings(max_examples=200, stateful_step_count=80, deadline=None)


# -- targeted steps of the books --------------------------------------------------------


def tiered(budget: dict[str, int] | None = None, **kwargs: Any) -> Harness:
    return Harness(
        budget or {"gpu": 100, "ram": 100}, tiers=kwargs.pop("tiers", {"gpu": "ram"}), **kwargs
    )


def loaded(h: Harness, key: str, size: dict[str, int], task: object = "t") -> Entry:
    """Load ``key`` (ending the moves and releases that make its room) and end its lease."""
    ticket = h.acquire(key, size, task=task)
    while ticket.outcome is None:
        if ticket.entry in h.loading:
            h.finish(ticket.entry)
        elif h.moving:
            h.move(h.moving[0][0])
        else:
            h.ack(h.releasing[0])
    assert ticket.outcome is True, ticket.outcome
    h.end(ticket)
    return ticket.entry


def test_a_demotion_frees_the_upper_space_and_charges_the_lower_one_while_it_runs() -> None:
    h = tiered(moves=True)
    a = loaded(h, "a", {"gpu": 60})
    b = h.acquire("b", {"gpu": 60})
    assert a.state is State.MOVING and h.moving == [(a, "ram")]
    # Charged in both while it moves: neither space is promised more than it has.
    assert (h.used("gpu"), h.used("ram")) == (60, 60)
    assert h.core.spaces["gpu"].releasing == 60 and b.outcome is None
    h.move(a)
    assert a.state is State.DEMOTED and a.charge == {"ram": 60} and a.home == {"gpu": 60}
    assert b.entry.state is State.LOADING and (h.used("gpu"), h.used("ram")) == (60, 60)
    h.core.check()


def test_an_owner_without_move_has_its_entries_released_not_demoted() -> None:
    h = tiered(moves=False)
    a = loaded(h, "a", {"gpu": 60})
    h.acquire("b", {"gpu": 60})
    assert a.state is State.RELEASING and not h.moving and h.used("ram") == 0


def test_a_request_during_a_demotion_waiting_for_room_takes_the_entry_back() -> None:
    h = tiered({"gpu": 100, "ram": 100}, moves=True)
    r = loaded(h, "r", {"ram": 80})  # the lower tier is nearly full, of one idle entry
    a = loaded(h, "a", {"gpu": 60})
    b = h.acquire("b", {"gpu": 60}, task="B")
    # The policy makes room in ram for a: r is released, a waits for that room.
    assert r.state is State.RELEASING and a in h.core.demoting and not h.moving
    again = h.acquire("a", {"gpu": 60}, task="A")
    assert again.outcome is True and again.entry is a and a.state is State.READY
    assert a not in h.core.demoting and not h.moving
    assert h.core.spaces["gpu"].releasing == 0 and b.outcome is None
    h.core.check()
    h.ack(r)
    assert not h.moving  # a is leased: nothing moves it
    h.end(again)  # now it can make room for b
    assert a.state is State.MOVING and h.moving == [(a, "ram")]
    h.move(a)
    assert b.entry.state is State.LOADING
    h.core.check()


def test_a_request_during_a_demotion_in_flight_waits_then_promotes() -> None:
    h = tiered({"gpu": 100, "ram": 150}, moves=True)
    a = loaded(h, "a", {"gpu": 60})
    b = h.acquire("b", {"gpu": 60}, task="B")
    again = h.acquire("a", {"gpu": 60}, task="A")
    assert again.outcome is None and a.joiners == [again] and not h.loading
    h.move(a)  # demoted, then queued at once to come back up (behind b)
    assert a.state is State.DEMOTED and a in h.core.queue and again.outcome is None
    h.finish(b.entry)
    h.end(b)  # b goes down (room for a in gpu), a comes up
    assert b.entry.state is State.MOVING
    h.move(b.entry)
    assert a.state is State.MOVING and a.promoting and h.moving == [(a, "gpu")]
    h.move(a, seconds=0.1)
    assert again.outcome is True and a.state is State.READY and a.charge == {"gpu": 60}
    assert a.value == "v-a@ram@gpu" and a.promote_cost == 0.1 and a.home is None
    assert h.core.loads == 2 and h.core.promotions == 1
    h.core.check()


def test_a_request_during_a_promotion_joins_it() -> None:
    h = tiered({"gpu": 100, "ram": 150}, moves=True)
    a = loaded(h, "a", {"gpu": 60})
    loaded(h, "b", {"gpu": 60})  # a goes down
    first = h.acquire("a", {"gpu": 60}, task="A")
    (b,) = [e for e, _ in h.moving]
    h.move(b)
    assert a.state is State.MOVING and a.promoting
    second = h.acquire("a", {"gpu": 60}, task="A2")
    assert second.outcome is None and not h.loading
    h.move(a)
    assert first.outcome is True and second.outcome is True and a.leases == 2
    h.core.check()


@pytest.mark.parametrize("when", ["queued", "moving"])
def test_the_last_joiner_of_a_promotion_leaving_leaves_the_entry_demoted_and_idle(
    when: str,
) -> None:
    h = tiered({"gpu": 100, "ram": 150}, moves=True, idle_ttl=10.0)
    a = loaded(h, "a", {"gpu": 60})
    held = h.acquire("b", {"gpu": 60}, task="B")
    h.move(a)
    h.finish(held.entry)  # b is leased: a's promotion cannot get its room
    ticket = h.acquire("a", {"gpu": 60}, task="A")
    assert a in h.core.queue and ticket.outcome is None
    if when == "moving":
        h.end(held)
        (b,) = [e for e, _ in h.moving]
        h.move(b)
        assert a.state is State.MOVING and a.promoting
    h.leave(ticket)
    h.core.check()
    if when == "queued":
        assert a.state is State.DEMOTED and a.idle_seq and a not in h.core.queue
        assert a.charge == {"ram": 60} and h.used("gpu") == 60
    else:  # the move up goes on; the value is ready and idle once it is up
        h.move(a)
        assert a.state is State.READY and a.idle_seq and not a.leases
    h.core.check()


def test_a_failed_demotion_quarantines_with_both_charges_and_fails_its_waiters() -> None:
    h = tiered(moves=True)
    a = loaded(h, "a", {"gpu": 60})
    b = h.acquire("b", {"gpu": 60}, task="B")
    again = h.acquire("a", {"gpu": 60}, task="A")
    h.move(a, error=RuntimeError("dma fault"))
    assert a.state is State.QUARANTINED and a.charge == {"gpu": 60, "ram": 60}
    assert isinstance(again.outcome, RuntimeError) and "'a'" in str(again.outcome)
    # b can never get 60 of gpu's 100 while 60 are quarantined.
    assert isinstance(b.outcome, OutOfSpace)
    assert (h.used("gpu"), h.used("ram")) == (60, 60) and h.core.moves_failed == 1
    h.core.forget(a)
    h.drain()
    assert (h.used("gpu"), h.used("ram")) == (0, 0)
    h.core.check()


def test_a_failed_promotion_quarantines_with_both_charges() -> None:
    h = tiered({"gpu": 100, "ram": 150}, moves=True)
    a = loaded(h, "a", {"gpu": 60})
    loaded(h, "b", {"gpu": 60})  # a goes down
    ticket = h.acquire("a", {"gpu": 60}, task="A")
    (b,) = [e for e, _ in h.moving]
    h.move(b)
    h.move(a, error=RuntimeError("dma fault"))
    assert isinstance(ticket.outcome, RuntimeError) and a.state is State.QUARANTINED
    assert a.charge == {"gpu": 60, "ram": 60}
    h.core.check()


def test_a_demotion_the_lower_tier_cannot_take_falls_back_to_a_release() -> None:
    h = tiered(moves=True)
    leased = h.acquire("r", {"ram": 80}, task="R")
    h.finish(leased.entry)  # ram is full of a leased entry
    a = loaded(h, "a", {"gpu": 60})
    b = h.acquire("b", {"gpu": 60}, task="B")
    assert a.state is State.RELEASING and not h.moving and not h.core.demoting
    h.ack(a)
    assert b.entry.state is State.LOADING
    h.core.check()


def test_a_demotion_waiting_for_failed_releases_gives_up_and_releases() -> None:
    h = tiered(moves=True)
    r = loaded(h, "r", {"ram": 80})
    a = loaded(h, "a", {"gpu": 60})
    b = h.acquire("b", {"gpu": 60}, task="B")
    assert r.state is State.RELEASING and a in h.core.demoting
    h.refuse(r)  # ram's room is not coming: a is released instead
    assert r.state is State.QUARANTINED and a.state is State.RELEASING
    assert not h.core.demoting and h.core.spaces["gpu"].releasing == 60
    h.ack(a)
    assert b.entry.state is State.LOADING
    h.core.check()


def test_invalidate_during_a_demotion_in_flight_releases_it_once_moved() -> None:
    h = tiered(moves=True)
    a = loaded(h, "a", {"gpu": 60})
    h.acquire("b", {"gpu": 60}, task="B")
    assert h.core.invalidate(h.owner, "a")
    h.drain()
    assert a.state is State.MOVING and "a" not in h.owner.entries
    fresh = h.acquire("a", {"gpu": 30}, task="A")  # a new value, loaded afresh
    assert fresh.entry is not a and fresh.outcome is None
    h.move(a)
    assert a.state is State.RELEASING  # not kept in ram once moved
    h.ack(a)
    assert h.used("ram") == 0
    h.core.check()


def test_invalidate_while_demoted_releases_it_from_the_lower_tier() -> None:
    h = tiered(moves=True)
    a = loaded(h, "a", {"gpu": 60})
    loaded(h, "b", {"gpu": 60})  # a goes down
    assert a.state is State.DEMOTED
    assert h.core.invalidate(h.owner, "a")
    h.drain()
    assert a.state is State.RELEASING and h.releasing == [a]
    h.ack(a)
    assert h.used("ram") == 0 and "a" not in h.owner.entries
    h.core.check()


def test_clear_releases_demoted_and_moving_entries() -> None:
    h = tiered(moves=True)
    a = loaded(h, "a", {"gpu": 60})
    loaded(h, "b", {"gpu": 60})  # a goes down
    c = loaded(h, "c", {"gpu": 40})
    assert h.core.clear() == 3
    h.drain()
    assert a.state is State.RELEASING and c.state is State.RELEASING
    while h.releasing:
        h.ack(h.releasing[0])
    assert (h.used("gpu"), h.used("ram")) == (0, 0)
    h.core.check()


def test_an_idle_demoted_entry_expires_from_the_lower_tier() -> None:
    h = tiered(moves=True, idle_ttl=5.0)
    a = loaded(h, "a", {"gpu": 60})
    b = h.acquire("b", {"gpu": 60}, task="B")
    h.now = 1.0
    h.move(a)  # idle in ram since its lease ended at 0
    h.finish(b.entry)
    h.end(b)
    assert h.core.next_expiry() == 5.0
    h.now = 6.0
    assert h.core.sweep(h.now) == [a, b.entry]
    assert a.state is State.RELEASING and a.charge == {"ram": 60}
    h.core.check()


def test_close_owner_during_a_demotion_and_a_queued_promotion() -> None:
    h = tiered(moves=True)
    a = loaded(h, "a", {"gpu": 60})
    b = h.acquire("b", {"gpu": 60}, task="B")
    waiter = h.acquire("a", {"gpu": 60}, task="A")
    h.core.close_owner(h.owner, BrokerClosed("closed"))
    h.drain()
    assert isinstance(waiter.outcome, BrokerClosed) and isinstance(b.outcome, BrokerClosed)
    h.move(a)
    assert a.state is State.RELEASING
    h.ack(a)
    assert h.emptied == [h.owner] and (h.used("gpu"), h.used("ram")) == (0, 0)
    h.core.check()


def test_a_demotion_down_a_chain_makes_room_by_demoting_further() -> None:
    h = Harness(
        {"gpu": 100, "ram": 100, "disk": 100}, tiers={"gpu": "ram", "ram": "disk"}, moves=True
    )
    r = loaded(h, "r", {"ram": 80})
    a = loaded(h, "a", {"gpu": 60})
    h.acquire("b", {"gpu": 60}, task="B")
    # r goes from ram to disk, a from gpu to ram once r's room is free.
    assert h.moving == [(r, "disk")] and a in h.core.demoting
    assert (h.used("ram"), h.used("disk")) == (80, 80)
    h.move(r)
    assert h.moving == [(a, "ram")]
    h.move(a)
    assert a.charge == {"ram": 60} and r.charge == {"disk": 80}
    h.core.check()


def test_a_move_measured_larger_than_its_room_is_repaid_by_eviction() -> None:
    h = tiered(moves=True)
    loaded(h, "r", {"ram": 30})
    a = loaded(h, "a", {"gpu": 60})
    h.acquire("b", {"gpu": 60}, task="B")
    h.move(a, measured={"ram": 90})  # bigger in ram than declared
    assert a.charge == {"ram": 90}
    # The over-measured case: evicted at once, back within the budget once released.
    while h.releasing:
        h.ack(h.releasing[0])
    assert h.used("ram") <= 100
    h.core.check()
