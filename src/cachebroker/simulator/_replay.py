"""Replay a request trace through the real core and policy on a virtual clock.

No sleeping and no reimplemented eviction: each request is an acquire on the
same ``Core`` the live broker uses, by its own task. Loads take their
``load_seconds`` of virtual time with their space reserved, leases are held
for ``hold_seconds`` (pinning their entries as in the live broker), and
owners acknowledge releases at once.

At one instant, completions come first: loads that finish and leases that
end at time t are applied before the requests arriving at t. A request with
``hold_seconds=0`` ends its lease right after it is granted.

``timing="sequential"`` is the classic model instead, the one the offline
optimum solves: a load takes no time and a lease ends at once, so each
request is served before the next arrives and none waits for space. The
reload seconds still count each miss's ``load_seconds``.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any, Final, Literal, assert_never

import attrs

from .._core import (
    CancelLoad,
    Core,
    Entry,
    Owner,
    OwnerEmpty,
    Quarantined,
    Reason,
    Settled,
    StartLoad,
    StartMove,
    StartRelease,
    State,
    Ticket,
)
from .._errors import InvalidArgument
from .._policies import Policy, make_policy
from ._request import Request, check_fits, where

__all__ = ["TIMINGS", "ReplayResult", "Request", "Timing", "replay"]

Timing = Literal["sequential", "replay"]
#: The timing models: ``"sequential"`` (loads take no time, leases end at
#: once: the offline optimum's model) and ``"replay"`` (the virtual clock,
#: with load times and holds).
TIMINGS: Final[tuple[Timing, ...]] = ("sequential", "replay")


@attrs.frozen(kw_only=True)
class ReplayResult:
    """What replaying a trace under one policy and budget cost.

    Attributes:
        policy: The policy's name.
        budget: Bytes per space.
        requests: Requests replayed.
        hits: Requests served without a load of their own (hits, and joins of a
            load already in flight).
        misses: Requests that started a load.
        reload_seconds: The load time of every miss, summed.
        all_loads_seconds: What loading on every request would have cost.
        bytes_loaded: Bytes of every load, summed over spaces.
        evictions: Entries released to make room or because they idled too long.
        wait_seconds: Per request, how long it waited for space before its load
            could start (0 for hits and for joins of a load in flight), in
            arrival order.
    """

    policy: str
    budget: Mapping[str, int]
    requests: int
    hits: int
    misses: int
    reload_seconds: float
    all_loads_seconds: float
    bytes_loaded: int
    evictions: int
    wait_seconds: tuple[float, ...]

    @property
    def hit_ratio(self) -> float:
        """``hits / requests`` (0 for an empty trace)."""
        return self.hits / self.requests if self.requests else 0.0

    @property
    def waited(self) -> int:
        """Requests that waited for space (the offline optimum assumes none does)."""
        return sum(1 for seconds in self.wait_seconds if seconds > 0)

    @property
    def mean_wait(self) -> float:
        """Mean time a request waited for space, in seconds."""
        return math.fsum(self.wait_seconds) / len(self.wait_seconds) if self.wait_seconds else 0.0

    @property
    def p99_wait(self) -> float:
        """The 99th percentile of the time a request waited for space (nearest rank)."""
        if not self.wait_seconds:
            return 0.0
        ordered = sorted(self.wait_seconds)
        return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def replay(
    requests: Sequence[Request],
    budget: Mapping[str, int],
    policy: str | Policy,
    *,
    idle_ttl: float | None = None,
    timing: Timing = "replay",
) -> ReplayResult:
    """Replay ``requests`` (sorted by time) and return the totals.

    ``timing``: ``"replay"`` (loads take their ``load_seconds``, leases their
    ``hold_seconds``) or ``"sequential"`` (both take no time; see the module
    docstring).

    Raises:
        InvalidArgument: a request is larger than its space's whole budget, or
            names a space the budget does not have; an unknown ``timing``.
    """
    if timing not in TIMINGS:
        raise InvalidArgument(f"timing must be one of {', '.join(TIMINGS)}, got {timing!r}")
    timed = timing == "replay"
    check_fits(requests, budget)
    name = policy if isinstance(policy, str) else type(policy).__name__
    core = Core(budget, make_policy(policy), idle_ttl=idle_ttl)
    owners: dict[str, Owner] = {}
    # Completions: (time, order, subject); an Entry is a load that finishes,
    # an (entry, task) pair a lease that ends.
    pending: list[tuple[float, int, Any]] = []
    order = itertools.count()
    push = heapq.heappush
    pop = heapq.heappop
    holds: dict[Ticket, float] = {}
    waits = [0.0] * len(requests)
    arrival: dict[Ticket, tuple[int, float]] = {}
    loaded = 0
    all_loads = 0.0
    now = 0.0
    sweeping = idle_ttl is not None
    ready = State.READY

    def perform() -> None:
        nonlocal loaded
        while core.effects:
            effects, core.effects = core.effects, []
            for effect in effects:
                match effect:
                    case StartLoad(entry):
                        shell = entry.shell
                        for ticket in shell.tickets:
                            number, since = arrival.pop(ticket)
                            waits[number] = now - since
                        shell.started = True
                        loaded += sum(entry.charge.values())
                        took = shell.load_seconds if timed else 0.0
                        push(pending, (now + took, next(order), entry))
                    case StartRelease(entry, _):
                        core.release_done(entry)
                    case Settled(entry):
                        for ticket in entry.shell.tickets:
                            arrival.pop(ticket, None)
                            if ticket.outcome is True:
                                end(entry, ticket.task, holds.pop(ticket))
                        entry.shell.tickets = []
                    case CancelLoad() | Quarantined() | OwnerEmpty() | StartMove():
                        # Never made here: requests are never withdrawn, owners never
                        # close nor move values, and releases are acknowledged at once.
                        pass
                    case _:
                        assert_never(effect)

    def end(entry: Entry, task: int, hold: float) -> None:
        if hold and timed:
            push(pending, (now + hold, next(order), (entry, task)))
        else:
            core.lease_end(entry, task, now)

    def complete_until(limit: float) -> None:
        nonlocal now
        while pending and pending[0][0] <= limit:
            now, _, subject = pop(pending)
            if sweeping:
                core.sweep(now)
            if type(subject) is tuple:
                core.lease_end(subject[0], subject[1], now)
            else:
                core.load_done(subject, None, None, subject.shell.load_seconds, now)
            if core.effects:
                perform()

    for number, request in enumerate(requests):
        if request.time < now:
            raise InvalidArgument(
                f"{where(request)}requests must be in time order, but {request.time:g} "
                f"comes after {now:g}"
            )
        if pending and pending[0][0] <= request.time:
            complete_until(request.time)
        now = request.time
        if sweeping:
            core.sweep(now)
            if core.effects:
                perform()
        owner = owners.get(request.cache)
        if owner is None:
            owner = owners[request.cache] = core.open_owner(request.cache)
        all_loads += request.load_seconds
        entry = owner.entries.get(request.key)
        if entry is not None and entry.state is ready:  # a hit, as the broker serves it
            core.hit(entry, number)
            end(entry, number, request.hold_seconds)
        else:
            ticket = core.request(
                owner, request.key, dict(request.size), number, cost=request.load_seconds
            )
            entry = ticket.entry
            if ticket.outcome is True:
                end(entry, number, request.hold_seconds)
            else:
                holds[ticket] = request.hold_seconds
                shell = entry.shell
                if shell is None:
                    shell = entry.shell = _Pending(request.load_seconds)
                shell.tickets.append(ticket)
                if not shell.started:
                    arrival[ticket] = (number, now)
        if core.effects:
            perform()
    complete_until(math.inf)
    return ReplayResult(
        policy=name,
        budget=dict(budget),
        requests=len(requests),
        hits=core.hits,
        misses=core.misses,
        reload_seconds=core.load_seconds,
        all_loads_seconds=all_loads,
        bytes_loaded=loaded,
        evictions=core.evictions[Reason.CAPACITY] + core.evictions[Reason.IDLE],
        wait_seconds=tuple(waits),
    )


class _Pending:
    """The replay's slot on an entry: its load time and the tickets waiting on it."""

    __slots__ = ("load_seconds", "started", "tickets")

    def __init__(self, load_seconds: float) -> None:
        self.load_seconds = load_seconds
        self.started = False
        self.tickets: list[Ticket] = []
