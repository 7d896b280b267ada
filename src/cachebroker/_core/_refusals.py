"""Refusal and deadlock detection on asking: the checks a request meets before it waits.

A request that could never be granted (``check_fit``, ``shortage``), that
would wait on its own task's leases (``check_deadlock``,
``waits_on_itself``), in a cycle of lease holders (``check_waits_on_holders``,
``_cycles``) or on a load that waits for it (``check_cycle``,
``check_join``), or whose places cannot hold it (``placeable``) is refused
at once with an error that says why. These are read-only queries of the
books, but for ``check_join``, which hurries a gated load (``_transitions``).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

from .._errors import DeadlockError, OutOfSpace, RequestTooLarge
from .._units import format_bytes
from . import _cycles, _reach, _transitions
from ._model import Entry, Owner, State
from ._state import Books
from ._tiers import beyond, unparked

__all__ = [
    "check_cycle",
    "check_deadlock",
    "check_fit",
    "check_join",
    "check_waits_on_holders",
    "holds_any",
    "oversize",
    "placeable",
    "shortage",
    "waits_on_itself",
]


def check_fit(books: Books, owner: Owner, key: Hashable, need: Mapping[str, int]) -> None:
    for name, amount in need.items():
        error = shortage(books, owner, key, name, amount)
        if error is not None:
            raise error


def shortage(
    books: Books, owner: Owner, key: Hashable, name: str, amount: int, priority: int | None = None
) -> OutOfSpace | None:
    """The error for ``amount`` bytes in space ``name`` if they can never be granted
    (``priority``: the request's, for the reasons it gives; its cache's by default)."""
    space = books.spaces[name]
    if amount > space.limit:
        return RequestTooLarge(name, amount, space.limit, entry=f"{owner.name}:{key!r}")
    if amount > space.attainable:
        stranded = [e for e in books.quarantined if name in e.charge and e not in books.overdue]
        shown = [f"{e.owner.name}:{e.key!r}" for e in stranded][:5]
        others = _reach.obstacles(
            books, name, owner.priority if priority is None else priority, omit=("stranded",)
        )
        return OutOfSpace(
            f"{owner.name}:{key!r} needs {format_bytes(amount)} in space {name!r}, but "
            f"{format_bytes(space.stranded)} of its {format_bytes(space.limit)} are "
            f"held by quarantined entries ({', '.join(shown)}): their releases failed, "
            "so only broker.forget(cache, key) can return that memory"
            + (f" (besides, {'; '.join(others)})" if others else "")
        )
    return None


def placeable(
    books: Books,
    owner: Owner,
    key: Hashable,
    places: tuple[str, ...],
    need: dict[str, int],
    task: object,
    held: tuple[Entry, ...] | None,
) -> tuple[tuple[str, ...] | None, dict[str, int]]:
    """The places where a request of ``task`` for an entry of size ``need`` (in one
    space) may wait, and its first need: for a new entry, or a demoted one's promotion.

    Places that can never hold it, or only by evicting ``task``'s own
    leases, are left out; with none left, the first one's error is raised.
    ``None``: a single place is left (an ordinary wait). What is left out
    is left out of this request's wait only: the entry keeps every place
    asked for (``Entry.asked``), and its next promotion chooses again.
    """
    amount = sum(need.values())
    names = list(dict.fromkeys(books.canon.get(name, name) for name in places))
    kept: list[str] = []
    first: BaseException | None = None
    for name in names:
        alternative = {name: amount}
        try:
            check_fit(books, owner, key, alternative)
            mine = _reach.leased_by(books, task, alternative, queued=bool(books.queue), held=held)
            check_deadlock(books, owner, key, alternative, mine)
        except (OutOfSpace, DeadlockError) as exc:
            first = first or exc
            continue
        kept.append(name)
    if not kept:
        assert first is not None
        raise first
    return (tuple(kept) if len(kept) > 1 else None), {kept[0]: amount}


def holds_any(books: Books, task: object) -> bool:
    """Whether ``task`` holds a lease (on anything)."""
    return any(task in entry.holders for entry in books.busy)


def check_waits_on_holders(
    books: Books,
    owner: Owner,
    key: Hashable,
    need: Mapping[str, int],
    places: tuple[str, ...] | None,
    priority: int,
    task: object,
    held: tuple[Entry, ...] | None,
) -> None:
    """Refuse a request that would wait in a cycle of lease holders (``_cycles``)."""
    if not (books.busy or held) or not books.queue:
        return  # (a cycle needs another waiting lease holder)
    spaces = books.spaces
    if places is None:
        if all(spaces[s].fits(n) for s, n in need.items()):
            return
    elif any(spaces[p].fits(sum(need.values())) for p in places):
        return
    _cycles.check_cycle_of_holders(books, owner, key, need, places, priority, task, held)


def check_deadlock(
    books: Books,
    owner: Owner,
    key: Hashable,
    need: Mapping[str, int],
    mine: list[Entry],
    loading: tuple[Entry, ...] = (),
) -> None:
    """Refuse a request that only its task's leases (``mine``), or the reservations of
    the loads it is made from (``loading``: they wait for it), could make room for."""
    if not (mine or loading) or all(books.spaces[s].fits(n) for s, n in need.items()):
        return
    error = waits_on_itself(books, owner, key, need, mine, now=True)
    if error is None and loading:
        error = _waits_on_its_load(books, owner, key, need, mine, loading)
    if error is not None:
        raise error


def _waits_on_its_load(
    books: Books,
    owner: Owner,
    key: Hashable,
    need: Mapping[str, int],
    mine: list[Entry],
    loading: tuple[Entry, ...],
) -> DeadlockError | None:
    """The error for a loader's request that only the reservations of the loads it is
    made from (and its task's leases, ``mine``) could make room for: those loads wait
    for this request."""
    for name, amount in need.items():
        loads = [e for e in loading if name in e.charge]
        if not loads:
            continue
        held = loads + [e for e in mine if name in e.charge]
        space = books.spaces[name]
        if amount > space.capacity - space.stranded - sum(e.charge[name] for e in held):
            shown = [(e.owner.name, e.key) for e in held]
            return DeadlockError(
                f"acquiring {owner.name}:{key!r} from inside the loader of "
                f"{', '.join(f'{e.owner.name}:{e.key!r}' for e in loads)} needs "
                f"{format_bytes(amount)} in space {name!r}, which only "
                f"{', '.join(f'{c}:{k!r}' for c, k in shown)} could make room for: that "
                "load's own reservation (and the task's leases), and the load waits for "
                "this request; give the outer load room for both, or load the inner "
                "value first",
                shown,
            )
    return None


def waits_on_itself(
    books: Books,
    owner: Owner,
    key: Hashable,
    need: Mapping[str, int],
    mine: list[Entry],
    *,
    now: bool,
) -> DeadlockError | None:
    """The error for a request that only ``mine`` (its task's leases) or ``forget()`` can serve.

    Quarantined bytes come back only through ``forget()``, so they are no
    room either. ``now``: against the spaces' current capacity (on
    asking); else against the most they can ever hold, so that a probed
    space shrunk for a while by other processes refuses nobody waiting.
    """
    for name, amount in need.items():
        pinned = [e for e in mine if name in e.charge]
        if not pinned:
            continue
        space = books.spaces[name]
        room = (space.capacity if now else space.limit) - space.stranded
        if amount > room - sum(e.charge[name] for e in pinned):
            shown = [(e.owner.name, e.key) for e in pinned]
            written_off = (
                f" (or by writing off the {format_bytes(space.stranded)} of quarantined "
                "entries with broker.forget())"
                if space.stranded
                else ""
            )
            # (The other bytes, for the whole picture: the verdict is the leases'.)
            others = _reach.obstacles(books, name, owner.priority, pinned, omit=("stranded", "own"))
            return DeadlockError(
                f"acquiring {owner.name}:{key!r} needs {format_bytes(amount)} in space "
                f"{name!r}, which can only be freed by evicting entries leased by "
                f"the requesting task itself: {', '.join(f'{c}:{k!r}' for c, k in shown)}"
                f"{written_off}; release them first"
                + (f" (besides, {'; '.join(others)})" if others else ""),
                shown,
            )
    return None


def check_cycle(
    books: Books, owner: Owner, key: Hashable, entry: Entry, loading: tuple[Entry, ...]
) -> None:
    """Refuse to join a load that (through loaders' own requests) waits for the requester."""
    if not loading:
        return
    stack, seen = [entry], set()
    while stack:
        current = stack.pop()
        if current in loading:
            shown = [(e.owner.name, e.key) for e in loading]
            raise DeadlockError(
                f"acquiring {owner.name}:{key!r} from inside the loader of "
                f"{', '.join(f'{c}:{k!r}' for c, k in shown)} would wait for that very "
                "load; a loader must not acquire its own key (directly or through "
                "the loads it waits for)",
                shown,
            )
        if current in seen:
            continue
        seen.add(current)
        stack.extend(t.entry for t in current.nested if t.outcome is None)


def check_join(
    books: Books,
    owner: Owner,
    key: Hashable,
    entry: Entry,
    task: object,
    loading: tuple[Entry, ...],
    held: tuple[Entry, ...] | None,
) -> tuple[bool, dict[str, int], tuple[str, ...] | None, list[Entry]]:
    """A request for an existing, unready ``entry``: whether it promotes the entry (a
    demoted one, for its first requester), what it needs, the places it may wait in
    and the entries its task leases in those spaces; raises what refuses it (see
    ``request``)."""
    check_cycle(books, owner, key, entry, loading)
    if entry.gated and (loading or holds_any(books, task)):
        _transitions.hurry(books, entry)
    # A demoted entry is promoted back to where it was loaded, for its
    # first requester; later ones join (as do requesters of a move).
    # Placed, it may come back to any of the places its acquire asked
    # for that this request could wait in, but where it is parked.
    promote = entry.state is State.DEMOTED and entry not in books.queue
    need = entry.home if promote and entry.home is not None else entry.need
    placed = entry.places
    places = () if entry.asked_places is None else unparked(entry, entry.asked_places)
    if promote and places and len(need) == 1:
        placed, need = placeable(books, owner, key, places, need, task, held)
    if promote:
        check_fit(books, owner, key, need)
    waiting = promote or entry.state is State.WAITING or entry in books.queue
    taking = beyond(need, entry.charge)  # (a promotion keeps what stays put)
    # (A placed promotion, like a placed load, holds leases in any of its places.)
    spread = taking if not promote or placed is None else dict.fromkeys(placed, sum(need.values()))
    mine = (
        _reach.leased_by(books, task, spread, queued=len(books.queue) > (not promote), held=held)
        if waiting
        else []
    )
    check_deadlock(books, owner, key, taking, mine, loading if waiting else ())
    if waiting:
        check_waits_on_holders(books, owner, key, taking, placed, entry.priority, task, held)
    return promote, need, placed, mine


def oversize(books: Books, entry: Entry) -> OutOfSpace | None:
    for name, amount in entry.charge.items():
        error = shortage(books, entry.owner, entry.key, name, amount)
        if error is not None:
            return error
    return None
