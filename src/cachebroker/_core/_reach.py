"""What room a waiter could ever reach, and why it has none: the bytes it may never evict.

First come, first served per space protects a big request from a stream of
small ones. A request blocked by bytes it may never evict gains nothing from
that order: holding up everyone behind it would only turn one wait into many.
So the scheduler asks, of a waiter it cannot serve, whether any eviction could
ever let it in (``out_of_reach``); one that no eviction could waits *aside*:
it keeps its place in the queue but blocks nobody (``_scheduler.schedule``).

A request of priority ``p`` may never evict, in a space:

* the bytes of ready pinned entries (``Space.pinned``);
* the bytes of ready entries of a priority above ``p`` (``Space.ranked``, per
  priority: there are few priorities, so summing those above ``p`` is cheap);
* quarantined bytes whose release raised or was given up
  (``Space.stranded``: only ``forget()`` returns them);
* the bytes its own requesters' leases hold (a task waiting for room does
  not end its leases).

Everything else may come back to it: free bytes, releases in flight, idle
and leased entries it may evict (leases end), doomed entries (released when
their last lease ends), loads in flight (their values become entries like
any other), parked and moving entries of the tiers, and the quarantined bytes
whose release still runs past its timeout (``Overdue``: a late return frees
them). Counting the uncertain as reachable keeps the order of arrival
wherever a wait could end in a grant.

``sync`` keeps ``Space.pinned`` and ``Space.ranked`` as running totals: the
books call it wherever an entry becomes or stops being ready, is doomed, or
changes its charge or priority, and ``Entry.pinned`` calls it when a pin
changes. ``check`` recounts them (and ``Overdue``'s) from the entries.
``why_no_room`` puts the same books into words for ``AcquireTimeout`` and
the errors about space; it is a function of the books alone, so that the
daemon, which runs the same books, can give a remote request the same reason.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from .._errors import DeadlockError
from .._units import format_bytes
from ._model import Entry, Space, State

if TYPE_CHECKING:
    from ._state import Books

__all__ = [
    "check",
    "leased_by",
    "slot_self_wait",
    "obstacles",
    "out_of_reach",
    "room_in",
    "why_no_room",
]

#: How many entries a reason names before it counts the rest.
SHOWN = 3


def check(books: Books) -> None:
    """Recount what ``sync`` and ``Overdue`` keep, from the entries (``Core.check``)."""
    pinned = dict.fromkeys(books.canon.names, 0)
    ranked: dict[str, dict[int, int]] = {name: {} for name in books.canon.names}
    for entry in books.entries():
        counted = entry.state is State.READY and entry.doomed is None and bool(entry.weights)
        expected = (entry.pinned, entry.priority, entry.weights) if counted else None
        assert entry.kept == expected, (entry, entry.kept, expected)
        if counted:
            for name, amount in entry.charge.items():
                if entry.pinned:
                    pinned[name] += amount
                elif amount:
                    ranked[name][entry.priority] = ranked[name].get(entry.priority, 0) + amount
    for name in books.canon.names:
        space = books.spaces[name]
        assert space.pinned == pinned[name], (name, space.pinned, pinned[name])
        assert space.ranked == ranked[name], (name, space.ranked, ranked[name])
    books.overdue.check(books.quarantined, {n: books.spaces[n] for n in books.canon.names})


def _own(books: Books, entry: Entry) -> list[Entry]:
    """The entries leased by the requesters of ``entry`` that hold a lease in its spaces."""
    spread = (
        entry.need
        if entry.places is None
        else dict.fromkeys(entry.places, sum(entry.need.values()))
    )
    mine: dict[Entry, None] = {}
    for ticket in entry.joiners:
        if ticket.holds:
            for leased in leased_by(books, ticket.task, spread, queued=True, held=ticket.held):
                mine[leased] = None
    return list(mine)


def _beyond(space: Space, priority: int) -> int:
    """The bytes of ``space`` no eviction for a request of ``priority`` returns
    (its requesters' own leases aside)."""
    held = space.pinned + space.stranded
    for level, amount in space.ranked.items():
        if level > priority:
            held += amount
    return held


def _mine_in(name: str, priority: int, mine: Iterable[Entry]) -> int:
    """The bytes in ``name`` of ``mine`` (own leases) not counted by ``_beyond`` already."""
    return sum(
        e.charge.get(name, 0)
        for e in mine
        if not (e.kept is not None and (e.pinned or e.priority > priority))
    )


def out_of_reach(books: Books, entry: Entry) -> bool:
    """Whether no eviction could let ``entry`` in: in one of its spaces (in every one
    of its places), it needs more than the bytes it could ever reach there."""
    mine = _own(books, entry) if entry.holding else ()
    spaces = books.spaces
    priority = entry.priority
    if entry.places is None:
        for name, amount in entry.need.items():
            space = spaces[name]
            reach = space.limit - _beyond(space, priority)
            if amount > reach - (_mine_in(name, priority, mine) if mine else 0):
                return True
        return False
    amount = sum(entry.need.values())
    for name in entry.places:
        space = spaces[name]
        reach = space.limit - _beyond(space, priority)
        if amount <= reach - (_mine_in(name, priority, mine) if mine else 0):
            return False
    return True


def _shown(entries: Sequence[Entry]) -> str:
    names = [f"{e.owner.name}:{e.key!r}" for e in entries[:SHOWN]]
    if len(entries) > SHOWN:
        names.append(f"and {len(entries) - SHOWN} more")
    return ", ".join(names)


def _held(entries: Sequence[Entry], name: str) -> str:
    """``N bytes (cache:key, ...)``: what ``entries`` hold in space ``name``."""
    amount = sum(e.charge.get(name, 0) for e in entries)
    return f"{format_bytes(amount)} ({_shown(entries)})"


def obstacles(
    books: Books,
    name: str,
    priority: int,
    mine: Sequence[Entry] = (),
    *,
    queued: Entry | None = None,
    omit: Container[str] = (),
) -> list[str]:
    """The reasons, in words, that space ``name`` has no more room for a request of
    ``priority`` (whose requesters lease ``mine``): each a clause naming its bytes
    and, when few, its entries. ``queued``: the request's entry, if it waits in
    the queue (the earlier requests in line are named too). ``omit``: kinds of
    reason an error names already (``"stranded"``: quarantined entries only
    ``forget()`` returns; ``"own"``: the requesting task's own leases)."""
    space = books.spaces[name]
    pinned: list[Entry] = []
    higher: list[Entry] = []
    leased: list[Entry] = []
    doomed: list[Entry] = []
    own = [e for e in mine if name in e.charge]
    for entry in books.entries():
        if name not in entry.charge or entry.state is not State.READY or entry in own:
            continue
        if entry.doomed is not None:
            if entry.leases:
                doomed.append(entry)
        elif entry.pinned:
            pinned.append(entry)
        elif entry.priority > priority:
            higher.append(entry)
        elif entry.leases:
            leased.append(entry)
    lost = [
        e
        for e in books.quarantined
        if "stranded" not in omit and name in e.charge and e not in books.overdue
    ]
    overdue = [e for e in books.overdue.entries if name in e.charge]
    reasons: list[str] = []
    if pinned:
        reasons.append(f"{_held(pinned, name)} held by pinned entries, which are never evicted")
    if higher:
        levels = sorted({e.priority for e in higher})
        reasons.append(
            f"{_held(higher, name)} held by entries of a higher priority than its {priority} "
            f"({', '.join(map(str, levels))}), which a request does not evict"
        )
    if lost:
        reasons.append(
            f"{_held(lost, name)} held by quarantined entries whose release failed: only "
            "broker.forget(cache, key) returns that memory"
        )
    if overdue:
        reasons.append(
            f"{_held(overdue, name)} held by quarantined entries whose release is still "
            "running past release_timeout: a late return frees them"
        )
    if own and "own" not in omit:
        reasons.append(f"{_held(own, name)} leased by the requesting task itself")
    if leased:
        reasons.append(
            f"{_held(leased, name)} leased by other tasks: waiting for those leases to end"
        )
    if doomed:
        reasons.append(f"{_held(doomed, name)} released when their leases end")
    if space.releasing:
        reasons.append(f"{format_bytes(space.releasing)} being released")
    if queued is not None:
        ahead = []
        for waiter in books.queue:
            if waiter is queued:
                break
            if name in waiter.need:
                ahead.append(waiter)
        if ahead:
            reasons.append(
                f"{len(ahead)} earlier request(s) for {_held_need(ahead, name)} in line first"
            )
    if space.capacity < space.limit:
        reasons.append(
            f"the device's free memory leaves it {format_bytes(space.capacity)} of its "
            f"{format_bytes(space.limit)} for now"
        )
    return reasons


def _held_need(waiters: Sequence[Entry], name: str) -> str:
    amount = sum(w.need.get(name, 0) for w in waiters)
    return f"{format_bytes(amount)} ({_shown(waiters)})"


def room_in(
    books: Books,
    name: str,
    amount: int,
    priority: int,
    mine: Sequence[Entry] = (),
    *,
    queued: Entry | None = None,
) -> str:
    """One space's answer to "why no room for ``amount`` bytes": its free bytes, and why."""
    space = books.spaces[name]
    free = max(0, space.capacity - space.used)
    head = (
        f"{format_bytes(free)} of {format_bytes(space.limit)} free in {name!r} "
        f"for {format_bytes(amount)}"
    )
    reasons = obstacles(books, name, priority, mine, queued=queued)
    return f"{head}: {'; '.join(reasons)}" if reasons else head


def why_no_room(books: Books, entry: Entry) -> str:
    """Why the request of a waiting ``entry`` has no room yet, in words, per space.

    Names the bytes held by pinned entries, by higher priorities, by
    quarantined entries (stranded, or whose release still runs), by its
    requesters' own leases and by other leases, those being released and the
    earlier requests in line. A function of the books alone.
    """
    mine = _own(books, entry) if entry.holding else []
    need: Mapping[str, int] = entry.need
    if entry.places is not None:
        amount = sum(entry.need.values())
        need = dict.fromkeys(entry.places, amount)
    queued = entry if entry in books.queue else None
    return "; and ".join(
        room_in(books, name, amount, entry.priority, mine, queued=queued)
        for name, amount in need.items()
    )


def leased_by(
    books: Books,
    task: object,
    need: Mapping[str, int],
    *,
    queued: bool,
    held: tuple[Entry, ...] | None = None,
) -> list[Entry]:
    """The entries ``task`` holds leases on in the spaces of ``need``.

    ``held``: those of a request relayed from another process (its task's
    leases there), instead of looking for ``task`` among the holders.
    Only wanted when the request may wait: it does not fit now (deadlock
    detection), or others are queued ahead of it (it may have to pass them).
    """
    if not need or not (books.busy or held):
        return []
    if not queued and all(books.spaces[s].fits(n) for s, n in need.items()):
        return []
    if held is not None:
        # (pinned: leased there, but the books above know it pinned, not leased)
        return [
            entry
            for entry in held
            if (entry.leases or entry.pinned)
            and entry.state is State.READY
            and not entry.charge.keys().isdisjoint(need)
        ]
    return [
        entry
        for entry in books.busy
        if task in entry.holders and not entry.charge.keys().isdisjoint(need)
    ]


def slot_self_wait(entry: Entry, own: set[int], *, loading: bool = False) -> DeadlockError | None:
    """The error for a wait for ``entry``'s lease slots that only ``own`` tasks (by id) can free.

    The books know which task acquired each lease, not which task will end
    it: ``lease.release()`` works from any task, so a lease taken with
    ``lease = await cache.acquire(...)`` may have been handed to a worker
    that ends it while its acquirer waits. Such a wait is hopeless only when
    every lease holding the slots is ``bound`` (``Core.request``) to one of
    ``own``, which cannot end it while it waits; one that may travel keeps
    the wait alive (bounded by the acquire's own ``timeout``).
    """
    holders = entry.holders
    if not holders or len(entry.bound) < len(holders):
        return None  # (``bound`` is a sub-multiset of ``holders``: some lease may travel)
    if any(id(holder) not in own for holder in holders):
        return None
    return DeadlockError(
        f"acquiring {entry.owner.name}:{entry.key!r} would wait for a lease slot "
        f"(concurrency={entry.slots}) that only this task's own lease on it can free"
        + (" (or the tasks waiting for the load asking)" if loading else ""),
        [(entry.owner.name, entry.key)],
    )
