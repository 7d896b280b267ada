"""Tiers: move an idle value down a tier instead of releasing it, and back up on demand.

``Core.tiers`` maps a space to the space below it (``{"cuda:0": "ram"}``).
When the scheduler evicts an idle entry whose owner can move values
(``Owner.moves``) and whose charge lies in one tiered space, ``evict_one``
asks the lower tier's policy whether the value is worth its room there: the
value enters that policy's ranking as a candidate (``_Parked``: charged in
the lower tier, its cost the reload seconds a promotion would save) and the
policy picks the victims that would cover the room the lower tier lacks.
When the candidate is among them, or a promotion costs as much as a cold
load, the value is released as before; otherwise those victims go and the
value is demoted. So the lower tier evicts by the same policy, and a
demoted entry can itself be dropped (or demoted further) later.

A move is charged in both spaces until it ends, so neither is over-committed:
the bytes it frees (``freed``) are ``releasing`` from the decision on (they
are what the waiters it was evicted for count on), and the bytes it takes
(``reserved``) are added to ``used`` when it is granted. A demotion waits in
``Core.demoting`` (ahead of every waiter of its lower tier) only for
releases already in flight there; if those fail, it gives up and the value
is released instead, so a waiter never waits on a demotion that cannot
happen. A request for a demoted entry queues its promotion like a load (the
same queue, placement, eviction and fairness); a request during a move joins
it; a request while a demotion still waits for room takes the entry back at
once. A move that fails quarantines the entry with both charges: nobody
knows which form of the value still holds memory.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from typing import Any

from . import _transitions
from ._effects import StartMove
from ._model import Entry, Reason, State, sync
from ._state import Books
from ._tiers import destination, freed, owner_space, parked_cost, reserved

__all__ = ["evict_one", "grant_demotions"]


class _Parked:
    """An idle entry as it would be in the lower tier: the candidate the policy ranks there."""

    __slots__ = (
        "cache",
        "charge",
        "cost",
        "idle_seq",
        "key",
        "last_request",
        "priority",
        "requests",
    )

    def __init__(self, entry: Entry, charge: dict[str, int], seq: int) -> None:
        self.key: Hashable = entry.key
        self.cache = entry.cache
        self.charge: Mapping[str, int] = charge
        self.cost = parked_cost(entry)
        self.requests = entry.requests
        self.last_request = entry.last_request
        self.priority = entry.priority
        self.idle_seq = seq

    @property
    def idle(self) -> bool:
        return True


def evict_one(books: Books, victim: Entry, reason: Reason, short: Iterable[str]) -> None:
    """Free ``victim``'s bytes in the ``short`` spaces: demote it a tier when that frees
    them and is worth it, else release it."""
    plan = _plan(books, victim, short) if books.tiers and reason is Reason.CAPACITY else None
    if plan is None:
        _transitions.start_release(books, victim, reason)
        return
    target, room, displaced = plan
    books.policy_evicted(displaced, room)
    for other in displaced:
        if other.idle_seq:  # (not taken by an earlier step of this cascade)
            evict_one(books, other, reason, room)
    _transitions.leave_idle(books, victim)
    victim.state = State.MOVING
    sync(victim)
    victim.target = target
    victim.promoting = False
    for name, amount in freed(victim).items():
        books.spaces[name].releasing += amount
    books.demoting[victim] = None


def _plan(
    books: Books, entry: Entry, short: Iterable[str]
) -> tuple[dict[str, int], dict[str, int], list[Entry]] | None:
    """Where ``entry`` would go a tier down (its charge there), the room it lacks in
    the lower tier (``{lower: bytes}``, empty when there is room) and the victims
    that must go there for it; ``None``: release it.

    A demotion frees only the tiered part of the charge: an entry evicted for
    room in any other of its spaces (``short``) is released.
    """
    owner = entry.owner
    if not owner.moves or owner.closing or entry.doomed is not None or books.closed:
        return None
    source = lower = None
    for name in entry.charge:
        below = books.tiers.get(name)
        if below is not None:
            if source is not None:
                return None  # charged in two tiered spaces: not one move
            source, lower = name, books.canon.get(below, below)
    if source is None or lower is None or lower == source:
        return None
    if any(name != source and name in entry.charge for name in short):
        return None  # its bytes there are wanted: only a release frees them
    if entry.promote_cost is not None and entry.promote_cost >= entry.reload:
        return None  # a promotion would cost what a cold load costs: nothing to save
    amount = entry.charge[source]
    target = {name: n for name, n in entry.charge.items() if name != source}
    target[lower] = target.get(lower, 0) + amount
    space = books.spaces[lower]
    if target[lower] > space.attainable:
        return None
    if any(lower in waiter.need for waiter in books.queue):
        return None  # the lower tier's own waiters come first
    pending = sum(reserved(e).get(lower, 0) for e in books.demoting)
    missing = amount - (space.capacity - space.used + space.releasing - pending)
    if missing <= 0:
        return target, {}, []
    if space.idle_bytes < missing:
        return None
    displaced = _displaced(books, entry, {lower: target[lower]}, lower, missing)
    return None if displaced is None else (target, {lower: missing}, displaced)


def _displaced(
    books: Books, entry: Entry, charge: dict[str, int], lower: str, short: int
) -> list[Entry] | None:
    """The lower tier's victims for ``entry``'s room there, by its policy; ``None`` when
    the policy would rather drop ``entry`` itself (or cannot make the room)."""
    # (The books' hooks are typed for their entries; a policy takes any PolicyEntry.)
    parked: Any = _Parked(entry, charge, next(books.seq))
    policy = books.policy
    if books.on_admit is not None:
        books.on_admit(parked)
    policy.idle(parked)
    try:
        chosen = books.policy_victims({lower: short}, entry.priority)
    finally:
        if books.on_busy is not None:
            books.on_busy(parked)
        if books.on_remove is not None:
            books.on_remove(parked)
    if any(victim is parked or victim is entry for victim in chosen):
        return None  # (charged in the lower tier too: the policy would drop it there)
    victims = [v for v in chosen if isinstance(v, Entry) and v.idle_seq and not v.leases]
    if sum(v.charge.get(lower, 0) for v in victims) < short:
        return None
    return victims


def grant_demotions(books: Books) -> None:
    """Start the demotions whose room in the lower tier is free now, first decided first.

    One whose room is no longer coming (a release it waited for failed)
    gives up: its entry is released instead.
    """
    spaces = books.spaces
    ahead: dict[str, int] = {}  # reserved by earlier demotions still waiting
    for entry in list(books.demoting):
        taking = reserved(entry)
        if not any(name in ahead for name in taking) and all(
            spaces[name].used + amount <= spaces[name].capacity for name, amount in taking.items()
        ):
            del books.demoting[entry]
            for name, amount in taking.items():
                spaces[name].used += amount
            books.effects.append(StartMove(entry, owner_space(books, entry, destination(entry))))
            continue
        coming = all(
            amount
            <= spaces[name].capacity
            - spaces[name].used
            + spaces[name].releasing
            - ahead.get(name, 0)
            for name, amount in taking.items()
        )
        if coming:
            for name, amount in taking.items():
                ahead[name] = ahead.get(name, 0) + amount
        else:
            _transitions.release_demoting(books, entry)


# A demoted entry's home and where it is parked are kept apart: a charge in its
# home's spaces means the value is there (no move back), and a promotion placed
# where it is parked would ask for its bytes again beside themselves.
