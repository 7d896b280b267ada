"""Books above these ones decide: the steps of a process's books under a shared broker.

``give_up`` (the shared broker picked an entry as a victim, or to move a
tier down), ``place`` (it chose where a load or promotion goes),
``release_refused`` (the owner, in another process, had leased it again,
or could not move it), ``let_go`` (the owner releases it on its own) and
``park`` (an entry taken on as its owner holds it, demoted): ``Core``'s
steps for books shared with another process, whose docstrings say what
each does. Then the state changes only they make (``_transitions`` has the
rest): ``start_move``, ``retarget``, ``unmove`` and the transition ``park``.
"""

from __future__ import annotations

from .._errors import BrokerClosed
from . import _transitions
from ._effects import StartMove
from ._model import Entry, Reason, State, _naming, sync
from ._scheduler import schedule
from ._state import Books
from ._tiers import canonical, destination, freed, owner_space, parked_cost, part, reserved

__all__ = [
    "give_up",
    "let_go",
    "park",
    "place",
    "release_refused",
    "retarget",
    "start_move",
    "unmove",
]


def give_up(books: Books, entry: Entry, reason: Reason, to: dict[str, int] | None) -> bool:
    """The steps of ``Core.give_up`` (its docstring says what they are)."""
    _transitions.settle(books)
    if to is not None:
        idle = entry.state in (State.READY, State.DEMOTED) and entry not in books.queue
        if not idle or entry.leases or entry.pinned or entry.doomed is not None:
            return False
        start_move(books, entry, to)
        return True
    if entry.state is State.DEMOTED and entry not in books.queue:
        _transitions.start_release(books, entry, reason)
        schedule(books)
        return True
    if entry.state is State.READY:
        if entry.leases or entry.pinned:
            seam = books.seam
            if seam is not None and seam.lets_go(entry) and not entry.pinned:
                # Offered idle, leased again before the release asked for
                # then arrived: it goes when its last lease ends.
                let_go(books, entry, reason)
            return False
        _transitions.start_release(books, entry, reason)
        schedule(books)
    return entry.state is not State.LOADING


def release_refused(books: Books, entry: Entry, holder: object) -> None:
    """The steps of ``Core.release_refused`` (its docstring says what they are)."""
    if entry.state is State.MOVING and entry not in books.demoting:
        # A move asked of the owner, refused (``None``: the owner lets it go
        # on its own, or no longer has it as it was): called off.
        unmove(books, entry, holder, BrokerClosed("the move was refused"))
        schedule(books)
        return
    if entry.state is not State.RELEASING:
        if books.overdue.end(entry):  # refused after its timeout: it stays quarantined
            _transitions.strand(books)
            schedule(books)
        return
    for name, amount in entry.charge.items():
        books.spaces[name].releasing -= amount
    if entry.home is not None or holder is None:
        # Demoted (its owner brings it back up), or refused by an owner that
        # keeps it idle: an eviction candidate again.
        entry.state = State.READY if entry.home is None else State.DEMOTED
        _transitions.rest(books, entry, entry.idle_since)
    else:
        entry.state = State.READY
        entry.leases += 1
        entry.holders.append(holder)
        books.busy[entry] = None
    sync(entry)
    schedule(books)


def let_go(books: Books, entry: Entry, reason: Reason) -> None:
    """The steps of ``Core.let_go`` (its docstring says what they are)."""
    if entry.state is State.READY and entry.doomed is None:
        _transitions.doom(books, entry, reason)
        schedule(books)
    elif entry.state in (State.DEMOTED, State.MOVING) and entry.doomed is None:
        _transitions.doom_parked(books, entry, reason)  # (moving: once its move ends)
        schedule(books)


def place(books: Books, entry: Entry, space: str) -> None:
    """The steps of ``Core.place`` (its docstring says what they are)."""
    name = books.canon.get(space, space)
    if entry.state is State.MOVING and entry.promoting and entry.target is not None:
        # A promotion not begun: the books above brought it back elsewhere.
        if name not in entry.target:
            retarget(books, entry, {name: sum(entry.target.values())})
        return
    if entry.state is not State.LOADING or entry.places is None or name in entry.charge:
        return
    _transitions.recharge(books, entry, {name: sum(entry.charge.values())})
    entry.need = dict(entry.charge)


def park(books: Books, entry: Entry, home: dict[str, int]) -> None:
    """The steps of ``Core.park`` (its docstring says what they are)."""
    if entry.state is State.READY and not entry.leases and not entry.pinned:
        if books.canon:
            home = canonical(books.canon, home)
        _park(books, entry, home)
        schedule(books)


# -- the state changes of moves the books above decide


def start_move(books: Books, entry: Entry, target: dict[str, int]) -> None:
    """Move an idle ``entry`` to be charged as ``target``, as books above decided.

    For the books of a process under a shared broker, whose spaces never run
    short: the shared books chose the move (a demotion) and reserved its
    room, so it starts now, charged in both spaces until it ends.
    """
    _transitions.leave_idle(books, entry)
    entry.state = State.MOVING
    entry.promoting = False
    entry.target = dict(target)
    for name, amount in reserved(entry).items():
        books.spaces[name].used += amount
    for name, amount in freed(entry).items():
        books.spaces[name].releasing += amount
    sync(entry)
    books.effects.append(StartMove(entry, owner_space(books, entry, destination(entry))))


def retarget(books: Books, entry: Entry, target: dict[str, int]) -> None:
    """A move not begun goes to ``target`` instead (books above placed it elsewhere)."""
    for name, amount in reserved(entry).items():
        books.spaces[name].used -= amount
    for name, amount in freed(entry).items():
        books.spaces[name].releasing -= amount
    entry.target = dict(target)
    for name, amount in reserved(entry).items():
        books.spaces[name].used += amount
    for name, amount in freed(entry).items():
        books.spaces[name].releasing += amount


def unmove(books: Books, entry: Entry, holder: object, error: BaseException) -> None:
    """A move that never ran is called off: ``entry`` stays where its value is.

    Its room is given back; it is ready (or, parked a tier down already,
    demoted) again: leased by ``holder`` when the owner leased it meanwhile
    (not ``None``), else idle. Requesters that joined the move get ``error``.
    """
    for name, amount in reserved(entry).items():
        books.spaces[name].used -= amount
    for name, amount in freed(entry).items():
        books.spaces[name].releasing -= amount
    entry.target = None
    entry.promoting = False
    entry.state = State.READY if entry.home is None else State.DEMOTED
    if entry.joiners:
        _transitions.fail_joiners(books, entry, _naming(error, entry))
    if holder is not None and entry.state is State.READY:
        entry.leases += 1
        entry.holders.append(holder)
        books.busy[entry] = None
    else:
        _transitions.rest(books, entry, entry.idle_since)
    sync(entry)


def _park(books: Books, entry: Entry, home: dict[str, int]) -> None:
    """An idle ready entry is demoted already, its home ``home`` (as its owner says)."""
    _transitions.leave_idle(books, entry)
    if books.on_remove is not None:
        books.on_remove(entry)
    entry.home = dict(home)
    part(entry)
    entry.cost = parked_cost(entry)
    entry.state = State.DEMOTED
    if books.on_admit is not None:
        books.on_admit(entry)
    _transitions.rest(books, entry, entry.idle_since)
    sync(entry)
