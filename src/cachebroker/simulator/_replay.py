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

With ``tiers`` (``{"gpu": "ram"}``), owners can move values: the core demotes
an idle value to the lower tier instead of dropping it when the lower tier's
policy ranks it worth its room there, and a request for a demoted value
promotes it back. A promotion is a reload from the lower tier: it takes the
``promote_seconds`` of the request that asked for it (virtual time under
``"replay"``, none under ``"sequential"``) and those seconds count in the
reload seconds. A demotion takes the ``demote_seconds`` of the request that
last loaded or promoted the value (under ``"replay"``; it holds its bytes in
both tiers meanwhile) and counts as no reload.
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
from .._core import Request as Asked
from .._errors import InvalidArgument
from .._policies import Policy, make_policy
from ._request import Request, check_fits, check_tiers, where

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
        hits: Requests served without a load or promotion of their own (hits,
            and joins of a load or promotion already in flight).
        misses: Requests that started a load, or a promotion of a value
            waiting in a lower tier.
        reload_seconds: The load time of every miss, summed; with tiers, the
            load seconds of the cold loads plus the ``promote_seconds`` of the
            promotions (a promotion is a reload from the lower tier).
        all_loads_seconds: What loading on every request would have cost.
        bytes_loaded: Bytes of every load, summed over spaces (promotions are
            not loads).
        evictions: Entries released to make room or because they idled too
            long, from any tier (a demotion is not an eviction).
        wait_seconds: Per request, how long it waited for space before its load
            or promotion could start (0 for hits and for joins of a load or
            move in flight), in arrival order.
        tiers: The lower tier of each tiered space (empty without tiers).
        demotions: Values moved down a tier instead of being dropped.
        promotions: Values moved back up for a request.
        promote_seconds: The part of ``reload_seconds`` paid for promotions.
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
    tiers: Mapping[str, str] = attrs.field(factory=dict)
    demotions: int = 0
    promotions: int = 0
    promote_seconds: float = 0.0

    @property
    def cold_seconds(self) -> float:
        """The load seconds of the cold loads: ``reload_seconds`` less the promotions'."""
        return self.reload_seconds - self.promote_seconds

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
    tiers: Mapping[str, str] | None = None,
) -> ReplayResult:
    """Replay ``requests`` (sorted by time) and return the totals.

    ``timing``: ``"replay"`` (loads take their ``load_seconds``, leases their
    ``hold_seconds``) or ``"sequential"`` (both take no time; see the module
    docstring). ``tiers``: each tiered space's lower tier, ``{"gpu": "ram"}``,
    both spaces of ``budget`` (one level: a lower tier has none below it).

    Raises:
        InvalidArgument: a request is larger than its space's whole budget, or
            names a space the budget does not have; an unknown ``timing``;
            ``tiers`` names a space the budget does not have, or a request
            has a negative ``promote_seconds`` or ``demote_seconds``.
        RuntimeError: the books ended with requests still waiting for space
            that nothing would free (rather than report figures without them).
    """
    if timing not in TIMINGS:
        raise InvalidArgument(f"timing must be one of {', '.join(TIMINGS)}, got {timing!r}")
    check_fits(requests, budget)
    lower = check_tiers(tiers, budget, requests)
    core = Core(budget, make_policy(policy), idle_ttl=idle_ttl, tiers=lower)
    run = _Replay(core, requests, timed=timing == "replay", sweeping=idle_ttl is not None)
    for number, request in enumerate(requests):
        if request.time < run.now:
            raise InvalidArgument(
                f"{where(request)}requests must be in time order, but {request.time:g} "
                f"comes after {run.now:g}"
            )
        run.ask(number, request, moves=bool(lower))
    run.complete_until(math.inf)
    if core.queue:  # (nothing is in flight: they would wait forever)
        stuck = ", ".join(f"{entry.cache}:{entry.key}" for entry in core.queue)
        raise RuntimeError(
            f"the replay ended with requests never served: {stuck} still wait for space "
            "that nothing in flight will free"
        )
    return ReplayResult(
        policy=policy if isinstance(policy, str) else type(policy).__name__,
        budget=dict(budget),
        requests=len(requests),
        hits=core.hits,
        misses=core.misses,
        reload_seconds=core.load_seconds + run.promoted,
        all_loads_seconds=run.all_loads,
        bytes_loaded=run.loaded,
        evictions=core.evictions[Reason.CAPACITY] + core.evictions[Reason.IDLE],
        wait_seconds=tuple(run.waits),
        tiers=lower,
        demotions=core.demotions,
        promotions=core.promotions,
        promote_seconds=run.promoted,
    )


class _Replay:
    """One replay's shell: the books, the completions in flight, and the figures.

    It does for the books what the broker's runner does: performs their
    effects (a load, a release, a move takes its time from the trace), ends
    leases after their ``hold_seconds``, and counts what the result reports.
    """

    def __init__(
        self, core: Core, requests: Sequence[Request], *, timed: bool, sweeping: bool
    ) -> None:
        self.core = core
        self.requests = requests
        self.timed = timed
        self.sweeping = sweeping
        self.owners: dict[str, Owner] = {}
        # Completions: (time, order, subject); an Entry is a load that finishes,
        # an (entry, task) pair a lease that ends, a _Move a move that ends.
        self.pending: list[tuple[float, int, Any]] = []
        self.order = itertools.count()
        self.holds: dict[Ticket, float] = {}
        self.waits = [0.0] * len(requests)
        self.arrival: dict[Ticket, tuple[int, float]] = {}
        self.loaded = 0
        self.all_loads = 0.0
        self.promoted = 0.0
        self.now = 0.0

    def ask(self, number: int, request: Request, *, moves: bool) -> None:
        """Request ``number`` arrives: what finished before it first, then its hit or wait."""
        core = self.core
        pending = self.pending
        if pending and pending[0][0] <= request.time:
            self.complete_until(request.time)
        now = self.now = request.time
        if self.sweeping:
            core.sweep(now)
            if core.effects:
                self.perform()
        owner = self.owners.get(request.cache)
        if owner is None:
            owner = self.owners[request.cache] = core.open_owner(request.cache, moves=moves)
        self.all_loads += request.load_seconds
        entry = owner.entries.get(request.key)
        if entry is not None and entry.state is State.READY:  # a hit, as the broker serves it
            core.hit(entry, number)
            self.end(entry, number, request.hold_seconds)
        else:
            asked = Asked(request.key, dict(request.size), cost=request.load_seconds)
            ticket = core.request(owner, asked, number)
            entry = ticket.entry
            if ticket.outcome is True:
                self.end(entry, number, request.hold_seconds)
            else:
                self.holds[ticket] = request.hold_seconds
                shell = entry.shell
                if shell is None:
                    shell = entry.shell = _Pending(request)
                shell.tickets.append(ticket)
                # It waits for space unless it joined a load or promotion under way.
                state = entry.state
                if not (state is State.LOADING or (state is State.MOVING and entry.promoting)):
                    self.arrival[ticket] = (number, now)
        if core.effects:
            self.perform()

    def started(self, shell: _Pending) -> None:
        """The load or promotion the tickets of ``shell`` wait for starts now."""
        for ticket in shell.tickets:
            since = self.arrival.pop(ticket, None)
            if since is not None:
                self.waits[since[0]] = self.now - since[1]

    def perform(self) -> None:
        core = self.core
        while core.effects:
            effects, core.effects = core.effects, []
            for effect in effects:
                match effect:
                    case StartLoad(entry):
                        shell = entry.shell
                        self.started(shell)
                        self.loaded += sum(entry.charge.values())
                        took = shell.load_seconds if self.timed else 0.0
                        heapq.heappush(self.pending, (self.now + took, next(self.order), entry))
                    case StartRelease(entry, _):
                        core.release_done(entry)
                    case StartMove(entry, _):
                        self.move(entry)
                    case Settled(entry):
                        for ticket in entry.shell.tickets:
                            self.arrival.pop(ticket, None)
                            if ticket.outcome is True:
                                self.end(entry, ticket.task, self.holds.pop(ticket))
                        entry.shell.tickets = []
                    case CancelLoad() | Quarantined() | OwnerEmpty():
                        # Never made here: requests are never withdrawn, owners never
                        # close, and releases and moves always succeed.
                        pass
                    case _:
                        assert_never(effect)

    def move(self, entry: Entry) -> None:
        """Start ``entry``'s move: up for the requester that asked first, or down."""
        shell = entry.shell
        if entry.promoting:
            self.started(shell)
            # The first requester waiting asked for the promotion.
            first = self.requests[shell.tickets[0].task]
            seconds = first.promote_seconds
            shell.demote_seconds = first.demote_seconds
            self.promoted += seconds
        else:
            seconds = shell.demote_seconds
        if self.timed and seconds > 0:
            heapq.heappush(
                self.pending, (self.now + seconds, next(self.order), _Move(entry, seconds))
            )
        else:
            self.core.move_done(entry, None, None, seconds, self.now)

    def end(self, entry: Entry, task: int, hold: float) -> None:
        if hold and self.timed:
            heapq.heappush(self.pending, (self.now + hold, next(self.order), (entry, task)))
        else:
            self.core.lease_end(entry, task, self.now)

    def complete_until(self, limit: float) -> None:
        core = self.core
        pending = self.pending
        while pending and pending[0][0] <= limit:
            now, _, subject = heapq.heappop(pending)
            self.now = now
            if self.sweeping:
                core.sweep(now)
            kind = type(subject)
            if kind is tuple:
                core.lease_end(subject[0], subject[1], now)
            elif kind is _Move:
                core.move_done(subject.entry, None, None, subject.seconds, now)
            else:
                core.load_done(subject, None, None, subject.shell.load_seconds, now)
            if core.effects:
                self.perform()


class _Pending:
    """The replay's slot on an entry: its load and demotion times, and the tickets
    waiting on it (for its load, a lease or a promotion)."""

    __slots__ = ("demote_seconds", "load_seconds", "tickets")

    def __init__(self, request: Request) -> None:
        self.load_seconds = request.load_seconds
        self.demote_seconds = request.demote_seconds
        self.tickets: list[Ticket] = []


class _Move:
    """A move that ends: its entry and how long it took."""

    __slots__ = ("entry", "seconds")

    def __init__(self, entry: Entry, seconds: float) -> None:
        self.entry = entry
        self.seconds = seconds
