"""Who gets space next: per-space FIFO grants, eviction, fairness and refusal.

``schedule`` runs at the end of every step that may let a waiter in; the
rest are its parts: ``evict`` (start releasing victims), ``drain`` (stop new
leases on entries a long-waiting request needs), ``repay`` (evict for a load
measured larger than it declared), ``refuse`` and ``refuse_self_waits``
(fail waiters that can never be granted).

These are functions of the books' state (``schedule(books)`` on a
``_state.Books``), not methods of ``Core``: each call names the module that
decides, and this module does not import ``_books`` (which imports it).
What they change on the books goes through ``_transitions`` (``grant``,
``start_release``, ``doom``, ``fail_waiting``, ...).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from . import _reach, _refusals, _transitions
from ._model import Entry, Reason, State
from ._moves import evict_one, grant_demotions
from ._reach import out_of_reach
from ._state import Books
from ._tiers import beyond, reserved

__all__ = ["drain", "evict", "refuse", "refuse_self_waits", "repay", "schedule"]


# long: one pass decides every grant, eviction, block and refusal (as httpcore's
# pool assigns in one step); its per-space walk runs for each waiter on every
# pass, so its parts are inlined rather than calls (the contention benchmark).
def schedule(books: Books) -> None:
    """Grant queued requests that fit and evict for those that can be covered.

    Walks the queue in arrival order. Per space, ``avail`` is the free bytes
    plus those whose release is in flight, minus what earlier waiters have
    already been promised. A waiter that fits ``avail`` is promised it (and
    granted at once if it also fits the free bytes and nobody earlier in
    its spaces still waits); one that does not is covered by asking the
    policy for victims, but only when idle entries can cover the whole
    shortfall: releasing values that would not let anyone in is waste.
    A waiter that cannot be covered blocks its spaces for those behind it,
    except for requests whose task holds a lease there (or whose loader
    holds a reservation there): the blocked waiter may be waiting for
    exactly that lease, so making them wait in turn would be a deadlock.
    A waiter that no eviction could let in (``_reach.out_of_reach``: what
    it needs exceeds, in a space, all but the bytes it may never evict:
    pinned entries, higher priorities, stranded quarantine, its own leases)
    waits *aside*: it keeps its place, so it is first in line again once
    those bytes go, but it blocks nobody, drains nothing and evicts nothing
    (first come, first served protects a request that waiting could serve).
    A waiter that can never be granted without ``forget()`` is refused.
    (A lease holder's request that quarantine leaves to its own leases or
    ``forget()`` alone is refused when the quarantine grows: ``refuse_self_waits``.)
    """
    if books.lost_room:
        books.lost_room = False
        if books.queue.holding:
            refuse_self_waits(books)
    _transitions.settle(books)
    if books.overdrawn:
        repay(books)
    if books.demoting:
        grant_demotions(books)
    books.queue.fair_at = math.inf
    if not books.queue:
        return
    spaces = books.spaces
    every_space = len(books.canon.names)
    promised: dict[str, int] = {}  # to earlier waiters: granted in this pass, or covered
    unfinished: set[str] = set()  # spaces where an earlier waiter is not granted yet
    for demoted in books.demoting:  # (decided before anyone queued for their room)
        for name, amount in reserved(demoted).items():
            promised[name] = promised.get(name, 0) + amount
            unfinished.add(name)
    # Spaces where an earlier waiter cannot be covered, and the highest priority
    # of those: a later waiter of a higher priority may evict what they may not.
    blocked: dict[str, int] = {}
    grants: list[Entry] = []
    refused: list[Entry] = []
    uniform = books.priorities is None  # every entry of one priority
    for entry in books.queue:  # Grants are applied after the walk: no copy of the queue.
        if len(blocked) == every_space and not books.queue.holding and uniform:
            break  # Nobody further back may be granted or evicted for.
        priority = entry.priority
        if entry.places is not None:
            _place(books, entry, promised, unfinished, blocked)
        # One pass over its spaces (usually a single one) gathers what the
        # decision needs and promises it their bytes, taken back below if it
        # is refused, held back or not covered after all.
        need = entry.need
        attainable = True  # without waiting on forget()
        if entry.charge:  # a promotion: it asks for none of the bytes it holds already
            need = beyond(need, entry.charge)
            attainable = all(n <= spaces[name].attainable for name, n in entry.need.items())
        behind = False  # one of its spaces is blocked by an earlier waiter
        shortfall: dict[str, int] | None = None  # short of ``avail``, per space
        coverable = True  # idle entries could cover every shortfall
        grantable = entry.after is None  # fits the free bytes; nobody earlier unfinished
        for name, amount in need.items():
            space = spaces[name]
            if amount > space.attainable:
                attainable = False
            if name in blocked and priority <= blocked[name]:
                behind = True
            taken = promised.get(name, 0)
            short = amount - (space.capacity - space.used + space.releasing - taken)
            if short > 0:
                if shortfall is None:
                    shortfall = {name: short}
                else:
                    shortfall[name] = short
                if space.idle_bytes < short:
                    coverable = False
            if name in unfinished:
                grantable = False
            else:
                # All that this pass promised here was granted (and is not in
                # ``used`` yet): it must fit beside that.
                if space.used + taken + amount > space.capacity:
                    grantable = False
            promised[name] = taken + amount
        if not attainable:
            refused.append(entry)
        elif behind and not entry.holding:  # held back, unless it waits aside
            if shortfall is None or not out_of_reach(books, entry):
                _block(blocked, need, priority)
        # (Whether idle entries could cover it, first: the usual answer under contention.)
        elif shortfall is not None and not (
            coverable and evict(books, shortfall, up_to=entry.priority)
        ):
            # (Unless no eviction could let it in: then it waits aside, in its
            # place in line, blocking nobody and draining nothing: ``_reach``.)
            if not out_of_reach(books, entry):
                heads = (
                    {
                        name: short
                        for name, short in shortfall.items()
                        if name not in blocked or priority > blocked[name]
                    }
                    if behind
                    else shortfall
                )
                _block(blocked, need, priority)
                if entry.places is not None:  # the first in line in each of its places
                    _block(blocked, dict.fromkeys(entry.places, 0), priority)
                if heads:
                    drain(books, entry, heads)
        elif grantable:  # promised, and granted at once
            grants.append(entry)
            continue
        else:  # promised, to be granted in a later pass
            unfinished.update(need)
            continue
        for name, amount in need.items():  # Refused, held back, aside or not covered: not promised.
            promised[name] -= amount
    for entry in grants:
        _transitions.grant(books, entry)
    if books.demoting:  # decided in this pass: their room may be free already
        grant_demotions(books)
    if refused:
        for entry in refused:
            refuse(books, entry)
        schedule(books)  # What they were not promised may go to those behind them.


def _place(
    books: Books,
    entry: Entry,
    promised: Mapping[str, int],
    unfinished: set[str],
    blocked: Mapping[str, int],
) -> None:
    """Choose the space of a waiter with places (``acquire(spaces=...)``): set ``entry.need``.

    The first place it fits now without evicting (and where nobody earlier
    waits), else the first whose in-flight releases will make room, else the
    one whose eviction is cheapest (the reload seconds of the victims the
    policy would pick there, a query that evicts nothing and changes no
    policy state: only ``evict`` tells the policy of an eviction; ties to
    the earlier place). Places where an
    earlier waiter of its priority is blocked, or that quarantine made too
    small, come last; the waiter then waits (or is refused) in the first.
    """
    amount = sum(entry.need.values())
    spaces = books.spaces
    attainable = [name for name in entry.places or () if amount <= spaces[name].attainable]
    # (Requests of lease holders pass blocked spaces: see ``schedule``.)
    open_places = [
        name
        for name in attainable
        if entry.holding or not (name in blocked and entry.priority <= blocked[name])
    ]
    room: str | None = None
    for name in open_places:
        space = spaces[name]
        taken = promised.get(name, 0)
        if name not in unfinished and space.used + taken + amount <= space.capacity:
            entry.need = {name: amount}
            return
        if room is None and amount <= space.capacity - space.used + space.releasing - taken:
            room = name
    if room is not None:
        entry.need = {room: amount}
        return
    cheapest: float | None = None
    for name in open_places:
        space = spaces[name]
        short = amount - (space.capacity - space.used + space.releasing - promised.get(name, 0))
        if space.idle_bytes < short:
            continue
        victims = books.policy_victims({name: short}, entry.priority)
        if sum(v.charge.get(name, 0) for v in victims) < short:
            continue
        price = sum(v.cost for v in victims)
        if cheapest is None or price < cheapest:
            cheapest = price
            entry.need = {name: amount}
    if cheapest is None:  # it waits (or is refused) in the first place that can hold it
        first = (open_places or attainable or list(entry.places or ()))[0]
        entry.need = {first: amount}


def _block(blocked: dict[str, int], need: Mapping[str, int], priority: int) -> None:
    """Mark ``need``'s spaces blocked for waiters up to ``priority``."""
    for name in need:
        if blocked.get(name, priority) <= priority:
            blocked[name] = priority


def refuse(books: Books, entry: Entry) -> None:
    """Fail a waiter that only ``forget()`` could ever grant (see ``_refusals.shortage``)."""
    error = None
    for name, amount in entry.need.items():
        error = error or _refusals.shortage(
            books, entry.owner, entry.key, name, amount, entry.priority
        )
    assert error is not None, entry
    _transitions.fail_waiting(books, entry, error)


def refuse_self_waits(books: Books) -> None:
    """Refuse the lease holders among the waiters that now wait on themselves.

    A release that failed since they asked may have left only their own
    leases (and ``forget()``) to make room. Only their requests are
    refused: other requesters of the same entry wait on (for those leases).
    """
    for entry in [e for e in books.queue if e.holding]:
        amount = sum(entry.need.values())
        needs = [entry.need] if entry.places is None else [{p: amount} for p in entry.places]
        for ticket in [t for t in entry.joiners if t.holds]:
            error = None
            for need in needs:  # (a placed waiter: only if every place waits on itself)
                mine = _reach.leased_by(books, ticket.task, need, queued=True, held=ticket.held)
                error = mine and _refusals.waits_on_itself(
                    books, entry.owner, entry.key, need, mine, now=False
                )
                if not error:
                    break
            if error:
                _transitions.refuse(books, ticket, error)


def drain(books: Books, waiter: Entry, shortfall: Mapping[str, int]) -> None:
    """Stop new leases on leased entries that ``waiter`` needs, once it has waited long.

    Hits bypass the queue, so entries that are leased again and again
    would never all be idle at once for a waiter at the head of a space.
    Once ``books.fair_requests`` (``FAIR_REQUESTS``) requests have been
    served since the waiter was queued, enough leased entries (least
    recently requested first, never pinned ones nor ones of a higher
    priority than the waiter's) are doomed to cover its
    shortfall (``_transitions.drain_leased``): they give their key up at once (new
    acquires of it queue behind the waiter) and are released when their
    last lease ends.
    """
    due = waiter.queued_tick + books.fair_requests
    if books.tick < due:
        books.queue.fair_at = min(books.queue.fair_at, due)  # checked when a lease ends
        return
    for name, short in shortfall.items():
        coming = books.spaces[name].idle_bytes
        if books.priorities is not None:  # only idle entries it may evict are coming
            coming = sum(
                e.charge.get(name, 0)
                for e in books.entries()
                if e.idle_seq and e.priority <= waiter.priority
            )
        candidates = []
        for entry in books.busy:
            amount = entry.charge.get(name)
            if not amount or not entry.leases:
                continue
            if entry.doomed is not None:
                coming += amount  # released when its last lease ends
            elif not entry.pinned and entry.priority <= waiter.priority:
                candidates.append(entry)
        candidates.sort(key=lambda e: e.last_request)
        for entry in candidates:
            if coming >= short:
                break
            _transitions.drain_leased(books, entry)
            coming += entry.charge[name]


def evict(
    books: Books, shortfall: dict[str, int], *, partial: bool = False, up_to: int | None = None
) -> bool:
    """Start releasing victims that cover ``shortfall``; False (releasing none) if they cannot.

    ``partial``: release what the policy offers even if it falls short (``repay``).
    ``up_to``: the requester's priority; entries of higher priority are not
    victims for it (with entries of a single priority, all are of its own).
    ``schedule`` asks only when the idle bytes could cover the whole shortfall
    (``Space.idle_bytes``): otherwise no victims can, and asking would be waste.
    """
    victims: list[Entry] = []
    freed = dict.fromkeys(shortfall, 0)
    chosen = books.policy_victims(shortfall, up_to)
    for victim in chosen:
        # A policy sees entries as PolicyEntry: only one of the books' own may come back.
        if (
            not isinstance(victim, Entry)
            or victim.leases
            or victim.state not in (State.READY, State.DEMOTED)
            or not victim.idle_seq
        ):
            raise RuntimeError(f"policy chose {victim!r}, which is not an idle entry")
        victims.append(victim)
        for name, amount in victim.charge.items():
            if name in freed:
                freed[name] += amount
    if not partial and any(freed[name] < short for name, short in shortfall.items()):
        return False
    books.policy_evicted(victims, shortfall)  # (the choice is acted on: only now)
    for victim in victims:
        if victim.idle_seq:  # (not taken by an earlier victim's demotion)
            evict_one(books, victim, Reason.CAPACITY, shortfall)
    return True


def repay(books: Books) -> None:
    """Evict for spaces driven over budget by a load measured larger than declared."""
    shortfall: dict[str, int] = {}
    for name in list(books.overdrawn):
        space = books.spaces[name]
        if space.used <= space.capacity:
            books.overdrawn.discard(name)
        elif (short := space.used - space.releasing - space.capacity) > 0:
            shortfall[name] = short
    if shortfall:
        evict(books, shortfall, partial=True)
