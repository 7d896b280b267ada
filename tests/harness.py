"""A synchronous driver for the sans-I/O core, shared by the core's tests.

It performs the core's effects by hand: loads and releases are recorded and
completed when a test says so (or at once with ``instant=True``); the other
kinds (cancelled loads, woken requesters, quarantined entries, emptied
owners) are recorded for the test to check.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any, assert_never

from cachebroker._core import (
    CancelLoad,
    Core,
    Effect,
    Entry,
    Owner,
    OwnerEmpty,
    Quarantined,
    Reason,
    Request,
    Settled,
    StartLoad,
    StartMove,
    StartRelease,
    State,
    Ticket,
)
from cachebroker._policies import LRU, Policy


def never_evictable(core: Core, waiter: Entry, name: str) -> int:
    """The bytes of space ``name`` that no eviction for ``waiter`` could return, recounted
    from the entries (the rule of ``_core._reach``, stated independently of its totals):
    ready pinned entries and ready ones of a higher priority (neither doomed), quarantined
    ones whose release is not running any more, and its requesters' own leases."""
    holders = [t.task for t in waiter.joiners if t.holds]
    held = 0
    for entry in core.entries():
        amount = entry.charge.get(name, 0)
        if entry.state is State.QUARANTINED:
            if entry not in core.overdue.entries:
                held += amount
        elif entry.state is State.READY and (
            (entry.doomed is None and (entry.pinned or entry.priority > waiter.priority))
            or any(task in entry.holders for task in holders)
        ):
            held += amount
    return held


def waits_aside(core: Core, waiter: Entry) -> bool:
    """Whether no eviction could ever let ``waiter`` in as the books stand (recounted):
    in a space (in every one of its places), it needs more than the rest."""
    spaces = core.spaces
    if waiter.places is None:
        return any(
            amount > spaces[name].limit - never_evictable(core, waiter, name)
            for name, amount in waiter.need.items()
        )
    amount = sum(waiter.need.values())
    return all(
        amount > spaces[name].limit - never_evictable(core, waiter, name) for name in waiter.places
    )


class Harness:
    def __init__(
        self,
        budget: Mapping[str, int],
        *,
        idle_ttl: float | None = None,
        policy: Policy | None = None,
        instant: bool = False,
        tiers: Mapping[str, str] | None = None,
        moves: bool = False,
    ) -> None:
        self.core = Core(budget, policy or LRU(), idle_ttl=idle_ttl, tiers=tiers)
        self.owner = self.core.open_owner("p", moves=moves)
        self.instant = instant
        self.now = 0.0
        self.loading: list[Entry] = []
        self.releasing: list[Entry] = []
        #: Moves started and not finished, with the space each goes to.
        self.moving: list[tuple[Entry, str]] = []
        self.moved: list[tuple[Hashable, str]] = []
        self.released: list[tuple[Hashable, Reason]] = []
        self.cancelled: list[Entry] = []
        self.settled: list[Entry] = []
        self.quarantined: list[Entry] = []
        self.emptied: list[Owner] = []

    #: Rounds of effects that one step may cause: a step of the books that keeps
    #: causing effects (a livelock) fails the test here instead of hanging it.
    MAX_ROUNDS = 10_000

    def drain(self) -> None:
        core = self.core
        for _ in range(self.MAX_ROUNDS):
            if not core.effects:
                return
            effects, core.effects = core.effects, []
            for effect in effects:
                self.perform(effect)
        raise AssertionError(f"the books still cause effects after {self.MAX_ROUNDS} rounds")

    def perform(self, effect: Effect) -> None:
        """Do what the shell would, or record the effect for the test to act on."""
        match effect:
            case StartLoad(entry):
                self.loading.append(entry)
                if self.instant:
                    self.finish(entry)
            case StartRelease(entry, reason):
                self.released.append((entry.key, reason))
                self.releasing.append(entry)
                if self.instant:
                    self.ack(entry)
            case StartMove(entry, to):
                self.moving.append((entry, to))
                self.moved.append((entry.key, to))
                if self.instant:
                    self.move(entry)
            case CancelLoad(entry):
                # The test ends the load (``load_failed(..., cancelled=True)``), as
                # the cancelled load task would.
                self.cancelled.append(entry)
            case Settled(entry):
                self.settled.append(entry)
            case Quarantined(entry):
                # The shell only reports it (a RELEASE_FAILED event); the bytes
                # stay charged until ``core.forget``.
                self.quarantined.append(entry)
            case OwnerEmpty(owner):
                # The shell lets the owner's ``cache()`` block end; the harness's
                # owner lives as long as the harness.
                self.emptied.append(owner)
            case _:
                assert_never(effect)

    def acquire(self, key: Hashable, size: int | Mapping[str, int] = 0, task: Any = "t") -> Ticket:
        need = dict(size) if isinstance(size, Mapping) else ({"m": size} if size else {})
        ticket = self.core.request(self.owner, Request(key, need), task)
        self.drain()
        return ticket

    def finish(
        self, entry: Entry, value: Any = None, measured: dict[str, int] | None = None
    ) -> None:
        self.loading.remove(entry)
        self.core.load_done(
            entry, value if value is not None else f"v-{entry.key}", measured, 1.0, self.now
        )
        self.drain()

    def fail(self, entry: Entry, error: BaseException) -> None:
        self.loading.remove(entry)
        self.core.load_failed(entry, error)
        self.drain()

    def move(
        self,
        entry: Entry,
        measured: dict[str, int] | None = None,
        seconds: float = 0.25,
        error: BaseException | None = None,
    ) -> None:
        """End ``entry``'s move: done (the value tagged with where it went), or failed."""
        (to,) = [to for moving, to in self.moving if moving is entry]
        self.moving.remove((entry, to))
        if error is not None:
            self.core.move_failed(entry, error)
        else:
            value = f"{entry.value}@{to}"
            self.core.move_done(entry, value, measured, seconds, self.now)
        self.drain()

    def ack(self, entry: Entry) -> None:
        self.releasing.remove(entry)
        self.core.release_done(entry)
        self.drain()

    def refuse(self, entry: Entry, error: BaseException | None = None) -> None:
        self.releasing.remove(entry)
        self.core.release_failed(entry, error or RuntimeError("refused"))
        self.drain()

    def end(self, ticket: Ticket) -> None:
        self.core.lease_end(ticket.entry, ticket.task, self.now)
        self.drain()

    def leave(self, ticket: Ticket) -> None:
        self.core.leave(ticket)
        self.drain()

    def used(self, space: str = "m") -> int:
        return self.core.spaces[space].used

    def cached_keys(self) -> set[Hashable]:
        return set(self.owner.entries)
