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
``Core._demoting`` (ahead of every waiter of its lower tier) only for
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
from typing import TYPE_CHECKING, Any

from ._effects import StartMove, StartRelease
from ._model import Entry, Reason, State
from ._reach import sync

if TYPE_CHECKING:
    from ._books import Core

__all__ = [
    "beyond",
    "cancel_demotion",
    "circle",
    "come_home",
    "evict_one",
    "freed",
    "give_up",
    "grant_demotions",
    "left_home",
    "owner_space",
    "parked_cost",
    "part",
    "queue_promotion",
    "reserved",
    "start_promotion",
    "stayed",
    "unparked",
]


def circle(tiers: Mapping[str, str]) -> tuple[str, ...] | None:
    """A circle that ``tiers`` go round in (``("a", "b", "a")``), or ``None``: a chain.

    A tier map must be a chain: a value evicted down a circle would come back
    to where it was, and an eviction that makes room below would recurse for
    ever. ``Broker(tiers=...)`` refuses one given directly, and a merge of two
    spaces (``_aliases``) refuses to make one.
    """
    for start in tiers:
        seen = [start]
        below = tiers.get(start)
        while below is not None:
            if below in seen:
                return (*seen[seen.index(below) :], below)
            seen.append(below)
            below = tiers.get(below)
    return None


def reserved(entry: Entry) -> dict[str, int]:
    """The bytes a move of ``entry`` takes in each space beyond its charge."""
    target = entry.target or {}
    charge = entry.charge
    return {n: a - charge.get(n, 0) for n, a in target.items() if a > charge.get(n, 0)}


def freed(entry: Entry) -> dict[str, int]:
    """The bytes a move of ``entry`` gives back in each space of its charge."""
    target = entry.target or {}
    return {n: a - target.get(n, 0) for n, a in entry.charge.items() if a > target.get(n, 0)}


def destination(entry: Entry) -> str:
    """The space a move of ``entry`` goes to: where it takes the most bytes."""
    gains = reserved(entry)
    if not gains:  # (a move within one space: measured sizes made them equal)
        return next(iter(entry.target or entry.charge))
    return max(gains, key=gains.__getitem__)


def owner_space(books: Core, entry: Entry, space: str) -> str:
    """``space`` (a books' name) by the name ``entry``'s owner knows it by.

    A merge keeps one name for two spaces in the books, but each owner named
    its space itself: a value goes back up to the name its request gave
    (``Entry.asked``), and down to the name the tiers as given put below
    that. The books' name is left for a space the owner never named.
    """
    canon = books.canon
    if not canon:  # (nothing merged: every name is the one given)
        return space
    for name in entry.asked:
        if canon.get(name, name) == space:
            return name
    given = books.tier_names
    for name in entry.asked:
        below = given.get(name)
        for _ in given:  # (a chain: it ends within this many steps)
            if below is None:
                break
            if canon.get(below, below) == space:
                return below
            below = given.get(below)
    return space


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


def parked_cost(entry: Entry) -> float:
    """What dropping ``entry`` from a lower tier costs: a cold load instead of a promotion."""
    return max(entry.reload - (entry.promote_cost or 0.0), 0.0)


def evict_one(books: Core, victim: Entry, reason: Reason, short: Iterable[str]) -> None:
    """Free ``victim``'s bytes in the ``short`` spaces: demote it a tier when that frees
    them and is worth it, else release it."""
    plan = _plan(books, victim, short) if books.tiers and reason is Reason.CAPACITY else None
    if plan is None:
        books._start_release(victim, reason)
        return
    target, room, displaced = plan
    books.policy_evicted(displaced, room)
    for other in displaced:
        if other.idle_seq:  # (not taken by an earlier step of this cascade)
            evict_one(books, other, reason, room)
    books._leave_idle(victim)
    victim.state = State.MOVING
    sync(victim)
    victim.target = target
    victim.promoting = False
    for name, amount in freed(victim).items():
        books.spaces[name].releasing += amount
    books._demoting[victim] = None


def _plan(
    books: Core, entry: Entry, short: Iterable[str]
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
    pending = sum(reserved(e).get(lower, 0) for e in books._demoting)
    missing = amount - (space.capacity - space.used + space.releasing - pending)
    if missing <= 0:
        return target, {}, []
    if space.idle_bytes < missing:
        return None
    displaced = _displaced(books, entry, {lower: target[lower]}, lower, missing)
    return None if displaced is None else (target, {lower: missing}, displaced)


def _displaced(
    books: Core, entry: Entry, charge: dict[str, int], lower: str, short: int
) -> list[Entry] | None:
    """The lower tier's victims for ``entry``'s room there, by its policy; ``None`` when
    the policy would rather drop ``entry`` itself (or cannot make the room)."""
    # (The books' hooks are typed for their entries; a policy takes any PolicyEntry.)
    parked: Any = _Parked(entry, charge, next(books._seq))
    policy = books.policy
    if books._admit is not None:
        books._admit(parked)
    policy.idle(parked)
    try:
        chosen = books.policy_victims({lower: short}, entry.priority)
    finally:
        if books._busy is not None:
            books._busy(parked)
        if books._remove is not None:
            books._remove(parked)
    if any(victim is parked or victim is entry for victim in chosen):
        return None  # (charged in the lower tier too: the policy would drop it there)
    victims = [v for v in chosen if isinstance(v, Entry) and v.idle_seq and not v.leases]
    if sum(v.charge.get(lower, 0) for v in victims) < short:
        return None
    return victims


def grant_demotions(books: Core) -> None:
    """Start the demotions whose room in the lower tier is free now, first decided first.

    One whose room is no longer coming (a release it waited for failed)
    gives up: its entry is released instead.
    """
    spaces = books.spaces
    ahead: dict[str, int] = {}  # reserved by earlier demotions still waiting
    for entry in list(books._demoting):
        taking = reserved(entry)
        if not any(name in ahead for name in taking) and all(
            spaces[name].used + amount <= spaces[name].capacity for name, amount in taking.items()
        ):
            del books._demoting[entry]
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
            give_up(books, entry)


def give_up(books: Core, entry: Entry, reason: Reason = Reason.CAPACITY) -> None:
    """Release, for ``reason``, an entry whose demotion waits for room (that is not coming)."""
    del books._demoting[entry]
    going = freed(entry)
    for name, amount in entry.charge.items():  # all of it is releasing now
        books.spaces[name].releasing += amount - going.get(name, 0)
    entry.target = None
    entry.state = State.RELEASING
    books.evictions[reason] += 1
    books.effects.append(StartRelease(entry, reason))


def cancel_demotion(books: Core, entry: Entry) -> None:
    """A request for an entry whose demotion still waits for room: it stays where it is
    (ready, or, parked a tier down already, demoted: the request then promotes it)."""
    del books._demoting[entry]
    for name, amount in freed(entry).items():
        books.spaces[name].releasing -= amount
    entry.target = None
    entry.state = State.READY if entry.home is None else State.DEMOTED
    sync(entry)


def queue_promotion(books: Core, entry: Entry, need: dict[str, int] | None) -> None:
    """A request for a demoted entry: queue its move back up, for ``need`` (its home's
    size, in one of its places)."""
    books._leave_idle(entry)
    assert need is not None
    entry.need = dict(need)
    entry.holding = 0  # (its requesters of an earlier promotion are all served)
    books._enqueue(entry)


def start_promotion(books: Core, entry: Entry) -> None:
    """A queued promotion was granted ``entry.need``: reserve it and start the move."""
    entry.state = State.MOVING
    entry.promoting = True
    entry.target = dict(entry.need)
    for name, amount in reserved(entry).items():
        books.spaces[name].used += amount
    for name, amount in freed(entry).items():
        books.spaces[name].releasing += amount
    books.effects.append(StartMove(entry, owner_space(books, entry, destination(entry))))


# A demoted entry's home and where it is parked are kept apart: a charge in its
# home's spaces means the value is there (no move back), and a promotion placed
# where it is parked would ask for its bytes again beside themselves.


def left_home(home: Mapping[str, int], charge: Mapping[str, int]) -> bool:
    """Whether a value charged ``charge`` is out of ``home``: one of the spaces it was
    loaded in holds none of it. Otherwise it is home (a tier merged into one memory
    with the space above it, or a move measured where it started): no promotion."""
    return any(name not in charge for name in home)


def stayed(going: Mapping[str, int], target: Mapping[str, int], charge: Mapping[str, int]) -> bool:
    """Whether a demotion that was to free ``going`` is still charged there (``charge``,
    as measured, holds more than ``target`` in one of them): it made no room."""
    return any(charge.get(name, 0) > target.get(name, 0) for name in going)


def unparked(entry: Entry, places: tuple[str, ...]) -> tuple[str, ...]:
    """``places`` but the spaces a demoted ``entry`` is parked in: a promotion there would
    be no move, and would ask for its bytes again beside themselves."""
    return tuple(name for name in places if name not in entry.charge)


def part(entry: Entry) -> None:
    """Keep a demoted entry's places (``acquire(spaces=...)``) off the spaces it is parked
    in (none left: ``None``, its home's)."""
    if entry.places is not None:
        entry.places = unparked(entry, entry.places) or None


def come_home(books: Core, entry: Entry) -> None:
    """A demoted entry is charged in every space of its home: ready there, no move back.

    A promotion queued for it is taken out of the queue and its requesters
    get leases (up to its slots).
    """
    entry.home = None
    entry.cost = entry.reload
    if entry in books.queue:
        books._dequeue(entry)
    entry.state = State.READY
    if entry.joiners:
        books._lease_joiners(entry)
        if entry.leases:
            books.busy[entry] = None
    sync(entry)


def beyond(need: dict[str, int], charge: Mapping[str, int]) -> dict[str, int]:
    """What a grant of ``need`` takes beside ``charge``, what its entry holds already: a
    promotion keeps the part of its charge that stays where it is (its other spaces)."""
    if not charge:  # (a load: charged nothing until granted)
        return need
    return {name: n - charge.get(name, 0) for name, n in need.items() if n > charge.get(name, 0)}
