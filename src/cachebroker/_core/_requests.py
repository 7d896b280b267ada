"""A request for a key that is not ready: a miss creates its entry, a join waits on it.

The two halves of ``Core.request`` past a hit: ``miss`` checks a request for
a key with no entry (``_refusals``) and creates the entry; ``join`` checks
one for an entry loading, moving or demoted and counts it (a demoted entry
is brought back up). Both return the entries the requesting task leases
where the request needs room, which ``_transitions.join`` weighs.
"""

from __future__ import annotations

from . import _reach, _refusals, _transitions
from ._model import Entry, Owner, Request, State
from ._scheduler import schedule
from ._state import Books
from ._tiers import canonical

__all__ = ["join", "miss"]


def miss(
    books: Books,
    owner: Owner,
    request: Request,
    task: object,
    loading: tuple[Entry, ...],
    urgent: bool,
    held: tuple[Entry, ...] | None,
) -> tuple[Entry, list[Entry]]:
    """``Core.request`` for a key with no entry: check, then create it; return it and the
    entries ``task`` leases where it needs room (``_reach.leased_by``)."""
    key, need, places = request.key, request.need, request.places
    unknown = need is None
    if need is None:
        remembered = books.sizes.get((owner.name, key))
        unknown = remembered is None
        need = {} if remembered is None else dict(remembered)
    asked = (*places, *need) if places is not None else tuple(need)
    if books.canon:
        need = canonical(books.canon, need)
    asked_places = None
    if places is not None:
        asked_places = tuple(dict.fromkeys(books.canon.get(n, n) for n in places))
        places, need = _refusals.placeable(books, owner, key, asked_places, need, task, held)
    _refusals.check_fit(books, owner, key, need)
    # (A placed request holds leases where any of its places lies.)
    spread = need if places is None else dict.fromkeys(places, sum(need.values()))
    mine = _reach.leased_by(books, task, spread, queued=bool(books.queue), held=held)
    _refusals.check_deadlock(books, owner, key, need, mine, loading)
    _refusals.check_waits_on_holders(
        books,
        owner,
        key,
        need,
        places,
        owner.priority if request.priority is None else request.priority,
        task,
        held,
    )
    urgent = unknown and (urgent or bool(loading) or _refusals.holds_any(books, task))
    entry = _transitions.create(
        books,
        owner,
        key,
        need,
        unknown=unknown,
        urgent=urgent,
        slots=request.slots,
        priority=request.priority,
        places=places,
        asked=asked,
        asked_places=asked_places,
    )
    entry.declared_cost = request.cost
    _transitions.count_request(books, entry)
    return entry, mine


def join(
    books: Books,
    entry: Entry,
    kept: bool,
    task: object,
    loading: tuple[Entry, ...],
    held: tuple[Entry, ...] | None,
) -> list[Entry]:
    """``Core.request`` joining ``entry``'s load or move (or bringing it back up, when
    demoted): check, then count it; return what ``task`` leases where it needs room."""
    try:
        promote, need, placed, mine = _refusals.check_join(
            books, entry.owner, entry.key, entry, task, loading, held
        )
    except Exception:
        if kept:  # (refused: the demotion called off for it is decided anew)
            _transitions.rest(books, entry, entry.idle_since)
            schedule(books)
        raise
    # A request that brings a value back up waits for it as for a load:
    # a miss (the first to join a move down counts it; later ones join).
    if (
        promote or (entry.state is State.MOVING and not entry.promoting and not entry.joiners)
    ) and not books.prefetching:
        books.misses += 1
    if promote:
        entry.places = placed
        _transitions.queue_promotion(books, entry, need)
    _transitions.count_request(books, entry)
    return mine
