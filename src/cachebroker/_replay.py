"""Replay a request trace through the real core and policy on a virtual clock.

No sleeping and no reimplemented eviction: each request is an acquire on the
same ``Core`` the live broker uses. Loads take their ``load_seconds`` of
virtual time, leases are held for ``hold_seconds`` (pinning their entries as
in the live broker), and owners acknowledge releases at once.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from ._core import Core, Effect, Entry, Owner, Reason, Ticket
from ._policy import Policy, make_policy

__all__ = ["ReplayResult", "Request", "replay"]


@attrs.frozen(kw_only=True)
class Request:
    """One request of a trace."""

    time: float
    key: str
    size: Mapping[str, int]
    load_seconds: float
    hold_seconds: float = 0.0
    cache: str = "default"


@attrs.frozen(kw_only=True)
class ReplayResult:
    """What replaying a trace under one policy and budget cost."""

    policy: str
    requests: int
    hits: int
    misses: int
    reload_seconds: float
    bytes_loaded: int
    evictions: int
    wait_seconds: tuple[float, ...]

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.requests if self.requests else 0.0


def replay(
    requests: Iterable[Request],
    budget: Mapping[str, int],
    policy: str | Policy,
    *,
    idle_ttl: float | None = None,
) -> ReplayResult:
    """Replay ``requests`` (in time order) and return the totals."""
    name = policy if isinstance(policy, str) else type(policy).__name__
    core = Core(budget, make_policy(policy), idle_ttl=idle_ttl)
    owners: dict[str, Owner] = {}
    events: list[tuple[float, int, str, Any]] = []
    order = itertools.count()
    arrived: dict[Entry, float] = {}
    holds: dict[Ticket, float] = {}
    waits: list[float] = []
    loaded = 0
    misses = 0
    now = 0.0

    def schedule(when: float, kind: str, subject: Any) -> None:
        heapq.heappush(events, (when, next(order), kind, subject))

    def perform() -> None:
        nonlocal loaded
        while core.effects:
            effects, core.effects = core.effects, []
            for kind, subject in effects:
                if kind is Effect.START_LOAD:
                    waits.append(now - arrived.pop(subject, now))
                    loaded += sum(subject.charge.values())
                    schedule(now + subject.shell.load_seconds, "loaded", subject)
                elif kind is Effect.START_RELEASE:
                    core.release_done(subject[0])
                elif kind is Effect.SETTLED:
                    for ticket in subject.shell.tickets:
                        if ticket.outcome is True:
                            schedule(now + holds[ticket], "end", ticket)
                    subject.shell.tickets = []

    for number, request in enumerate(requests):
        schedule(request.time, "arrive", (number, request))
    while events:
        now, _, kind, subject = heapq.heappop(events)
        if idle_ttl is not None:
            core.sweep(now)
        if kind == "arrive":
            number, request = subject
            owner = owners.get(request.cache) or owners.setdefault(
                request.cache, core.open_owner(request.cache)
            )
            ticket = core.request(
                owner, request.key, dict(request.size), number, cost=request.load_seconds
            )
            holds[ticket] = request.hold_seconds
            entry = ticket.entry
            if ticket.outcome is True:
                schedule(now + request.hold_seconds, "end", ticket)
            else:
                if entry.shell is None:
                    entry.shell = _Pending(request.load_seconds)
                    arrived[entry] = now
                    misses += 1
                entry.shell.tickets.append(ticket)
        elif kind == "loaded":
            core.load_done(subject, None, None, subject.shell.load_seconds, now)
        else:
            del holds[subject]
            core.lease_end(subject.entry, subject.task, now)
        perform()
    return ReplayResult(
        policy=name,
        requests=core.hits + core.misses,
        hits=core.hits,
        misses=misses,
        reload_seconds=core.load_seconds,
        bytes_loaded=loaded,
        evictions=core.evictions[Reason.CAPACITY] + core.evictions[Reason.IDLE],
        wait_seconds=tuple(waits),
    )


class _Pending:
    """The replay's slot on an entry: its load time and the tickets waiting on it."""

    __slots__ = ("load_seconds", "tickets")

    def __init__(self, load_seconds: float) -> None:
        self.load_seconds = load_seconds
        self.tickets: list[Ticket] = []
