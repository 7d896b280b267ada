"""Every change of an entry's state, one function per transition.

The steps of ``Core`` and the decisions of ``_scheduler``, ``_moves`` and
``_aliases`` change the books only through these functions, so that the ways
an entry's state (``State``), charge, leases, idle candidacy, queue place and
quarantine change can all be read from this file. Each keeps the invariants
of the package docstring for the entry it touches; none decides anything
(who is granted, what is evicted): the scheduler does.

The life of an entry, by function:

- asked for: ``create`` (waiting, or gated when its size is unknown:
  ``pass_gate``, ``hurry``, ``open_gate``), ``enqueue``, ``admit_weightless``,
  ``join`` (a ticket waits on it), ``count_request``, ``prepare_priority``;
- granted: ``grant`` (a load, or ``start_promotion`` of a demoted value);
- loaded or moved: ``set_charge``, ``recharge`` (measured), ``remember_load``,
  ``moved``, ``move_failed``; moved as books above decide: ``_above`` (``start_move``,
  ``retarget``, ``unmove``, ``park``);
- leased: ``wait_for_slot``, ``grant_slots``, ``lease_joiners``, ``unbind``;
- idle: ``rest`` (or straight to release), ``settle``, ``unidle``, ``leave_idle``;
- released: ``start_release``, ``doom``, ``drain_leased``, ``doom_parked``,
  ``release_demoting``, ``cancel_demotion``; back up: ``queue_promotion``,
  ``come_home``;
- failed or gone: ``fail_joiners``, ``fail_waiting``, ``drop_waiting``,
  ``dequeue``, ``withdraw``, ``refuse``, ``drop_ticket``, ``detach``, ``discharge``,
  ``gone``, ``hand_over``, ``check_empty`` (its owner is closing and has nothing left);
- quarantined: ``release_missed``, ``quarantine``, ``strand``,
  ``unquarantine``, ``unorphan``.
"""

from __future__ import annotations

import contextlib
import heapq
import math
from collections.abc import Hashable, Mapping
from typing import Any

from .._errors import BrokerClosed
from .._policies._priorities import Priorities
from . import _reach
from ._effects import (
    CancelLoad,
    OwnerEmpty,
    Quarantined,
    Settled,
    StartLoad,
    StartMove,
    StartRelease,
)
from ._model import Entry, Owner, Reason, State, Ticket, _naming, _shrink_if_empty, sync
from ._state import Books, keep
from ._tiers import (
    canonical,
    destination,
    freed,
    left_home,
    owner_space,
    parked_cost,
    part,
    reserved,
    stayed,
)

__all__ = [
    "move_failed",
    "moved",
    "admit_weightless",
    "cancel_demotion",
    "check_empty",
    "come_home",
    "count_request",
    "create",
    "dequeue",
    "detach",
    "discharge",
    "doom",
    "doom_parked",
    "drain_leased",
    "drop_waiting",
    "enqueue",
    "fail_joiners",
    "fail_waiting",
    "gone",
    "grant",
    "grant_slots",
    "hand_over",
    "hurry",
    "join",
    "lease_joiners",
    "leave_idle",
    "open_gate",
    "pass_gate",
    "prepare_priority",
    "quarantine",
    "queue_promotion",
    "recharge",
    "release_demoting",
    "release_missed",
    "remember_load",
    "rest",
    "set_charge",
    "settle",
    "start_promotion",
    "start_release",
    "strand",
    "unbind",
    "unidle",
    "unorphan",
    "unquarantine",
    "wait_for_slot",
    "withdraw",
]


def prepare_priority(books: Books, priority: int) -> None:
    """Have a policy serve ``priority``: at the second priority seen, one per priority.

    Called before an entry takes ``priority``, so that a policy that
    cannot be copied for it raises before anything changed.
    """
    priorities = books.priorities
    if priorities is not None:
        priorities.ensure(priority)
        return
    if books.priority is None:
        books.priority = priority
    if priority == books.priority:
        return
    priorities = Priorities(books.make_policy, books.policy, books.priority)
    priorities.ensure(priority)
    # Every entry the policy knows has the one priority seen so far.
    for other in books.entries():
        if other.state in (State.READY, State.RELEASING, State.MOVING, State.DEMOTED):
            priorities.adopt(other, books.priority, idle=bool(other.idle_seq))
    books.priorities = books.policy = priorities
    books.on_touch, books.on_busy = priorities.touch, priorities.busy
    books.on_admit, books.on_remove = priorities.admit, priorities.remove
    books.on_evicted = priorities.evicted


def wait_for_slot(
    books: Books, entry: Entry, task: object, loading: tuple[Entry, ...] = (), *, bound: bool = True
) -> Ticket:
    """Queue ``task`` for a lease slot of a ready entry whose slots are taken.

    Refused when only the asking task can free the slots: leases bound
    to itself, or, from inside a loader, to the tasks waiting for that
    load (which wait on it). See ``_reach.slot_self_wait``.
    """
    own = {id(task)} | {id(t.task) for outer in loading for t in outer.joiners}
    error = _reach.slot_self_wait(entry, own, loading=bool(loading))
    if error is not None:
        raise error
    count_request(books, entry)
    ticket = Ticket(entry, task)
    ticket.bound = bound
    entry.joiners.append(ticket)
    return ticket


def grant_slots(books: Books, entry: Entry) -> None:
    """Lease a ready entry to the requests waiting for its slots, first come first."""
    joiners = entry.joiners
    granted = 0
    while joiners and (entry.slots is None or entry.leases < entry.slots):
        ticket = joiners.pop(0)
        ticket.outcome = True
        entry.holders.append(ticket.task)
        if ticket.bound:
            entry.bound.append(ticket.task)
        entry.leases += 1
        granted += 1
    # A waiter whose own leases now hold every slot would wait for ever.
    for ticket in list(joiners):
        error = _reach.slot_self_wait(entry, {id(ticket.task)})
        if error is not None:
            joiners.remove(ticket)
            ticket.outcome = error
            granted += 1
    if granted:
        books.effects.append(Settled(entry))


def count_request(books: Books, entry: Entry) -> None:
    if books.prefetching:
        return  # a prefetch is no request (see ``prefetch``)
    books.tick += 1
    entry.requests += 1
    entry.last_request = books.tick
    if books.on_touch is not None:
        books.on_touch(entry)


def withdraw(books: Books, ticket: Ticket) -> bool:
    """Take a pending ``ticket`` off its entry; return whether the queue changed (the
    caller schedules).

    The last requester leaving a queued entry removes it; leaving a loading
    entry cancels its load.
    """
    entry = drop_ticket(books, ticket, BrokerClosed("request withdrawn"))
    if entry.joiners:
        return False
    if entry.state is State.WAITING:
        drop_waiting(books, entry)
        check_empty(books, entry.owner)
        return True
    if entry.state is State.DEMOTED:  # nobody waits for its promotion any more
        dequeue(books, entry)
        rest(books, entry, entry.idle_since)
        return True
    if entry.state is State.LOADING:
        # A cancelled load gives up its key: a request arriving before the
        # load task notices must start afresh, not inherit the cancellation.
        detach(books, entry)
        books.effects.append(CancelLoad(entry))
    return False


def join(
    books: Books,
    entry: Entry,
    task: object,
    loading: tuple[Entry, ...],
    held: tuple[Entry, ...] | None,
    *,
    bound: bool,
    mine: list[Entry],
) -> Ticket:
    """A request of ``task`` waits for ``entry``'s load or move: its ticket joins the entry.

    The ticket *holds* (it may pass blocked waiters, ``Queue.holding``)
    when its task leases, or its loaders reserve, room where ``entry`` needs it
    (``mine``, ``loading``).
    """
    ticket = Ticket(entry, task, loading, held)
    ticket.bound = bound
    entry.joiners.append(ticket)
    if loading:
        for outer in loading:
            outer.nested = [t for t in outer.nested if t.outcome is None]
            outer.nested.append(ticket)
    if (entry.state is State.WAITING or entry in books.queue) and (
        mine or any(not outer.need.keys().isdisjoint(entry.need) for outer in loading)
    ):
        ticket.holds = True
        entry.holding += 1
        if entry.holding == 1:
            books.queue.held(entry)
    return ticket


def drop_ticket(books: Books, ticket: Ticket, outcome: BaseException) -> Entry:
    """Take pending ``ticket`` off its entry with ``outcome``; return the entry."""
    entry = ticket.entry
    ticket.outcome = outcome
    entry.joiners.remove(ticket)
    if ticket.holds:
        entry.holding -= 1
        if not entry.holding:
            books.queue.released(entry)
    return entry


def refuse(books: Books, ticket: Ticket, error: BaseException) -> None:
    """Refuse a queued entry's pending ``ticket`` with ``error`` (its task would wait on
    itself): its requester wakes to raise it, and the last one leaving fails the
    entry's wait (``fail_waiting``)."""
    entry = drop_ticket(books, ticket, error)
    if entry.joiners:
        books.effects.append(Settled(entry))  # wakes its requester
    else:
        fail_waiting(books, entry, error)


def create(
    books: Books,
    owner: Owner,
    key: Hashable,
    need: dict[str, int],
    *,
    unknown: bool = False,
    urgent: bool = False,
    slots: int | None = None,
    priority: int | None = None,
    places: tuple[str, ...] | None = None,
    asked: tuple[str, ...] = (),
    asked_places: tuple[str, ...] | None = None,
) -> Entry:
    if priority is None:
        priority = owner.priority
    prepare_priority(books, priority)
    entry = Entry(owner, key, need)
    entry.priority = priority
    entry.places = places
    entry.asked = asked
    entry.asked_places = asked_places
    if books.promote_history:
        entry.promote_cost = books.promote_history.get((owner.name, key))
    if slots is not None:
        entry.slots = slots
    current = owner.entries.get(key)
    if current is not None and current.state is State.RELEASING:
        entry.after = current
        current.successor = entry
    else:
        owner.entries[key] = entry
    owner.live.add(entry)
    books.misses += 1
    if not unknown:
        enqueue(books, entry)
        return entry
    entry.unknown = True
    if urgent:
        enqueue(books, entry)
    elif books.gate.turn is None:
        books.gate.turn = entry
        pass_gate(books, entry)
    else:
        books.gate.wait(entry)
    return entry


def enqueue(books: Books, entry: Entry) -> None:
    books.queue.add(entry, books.tick)
    admit_weightless(books, entry)


def admit_weightless(books: Books, entry: Entry) -> None:
    """Grant an entry that weighs nothing as soon as no predecessor holds it back.

    It competes for no space, so it needs no place in the queue's order
    (and the scheduler may stop walking the queue before reaching it).
    """
    if not entry.need and entry.after is None and entry.state is State.WAITING and not entry.gated:
        grant(books, entry)


def hurry(books: Books, entry: Entry) -> None:
    """Take a load of unknown size out of the gate's line: load it now, reserving nothing.

    For a request from inside a loader or from a task holding a lease: the
    load whose turn it is may be waiting for that loader's reservation or
    that lease, so waiting for the gate could be a deadlock. Its
    measurement corrects the books (and evicts) as soon as it is loaded.
    """
    books.gate.leave(entry)
    enqueue(books, entry)


def pass_gate(books: Books, entry: Entry) -> None:
    """Queue a load of unknown size, reserving the largest size its cache has measured."""
    entry.gated = False
    estimate = _estimate(books, entry.owner.name)
    # An estimate is never a reason to refuse: keep it within reach.
    entry.need = {
        name: min(amount, books.spaces[name].attainable)
        for name, amount in estimate.items()
        if min(amount, books.spaces[name].attainable) > 0
    }
    enqueue(books, entry)


def _estimate(books: Books, cache: str) -> dict[str, int]:
    """The largest size ``cache`` has measured in each space, within the space's limit.

    A size beyond a limit (a measure in the wrong unit, once) was refused and
    stays its key's own: reserved, even capped at the limit, it would evict
    the whole space for every other load of unknown size. There the largest of
    the cache's remembered sizes within the limit counts instead, by the
    limits of now (probes and merged spaces change them).
    """
    largest = books.largest.get(cache)
    if not largest:
        return {}
    estimate = canonical(books.canon, largest) if books.canon else dict(largest)
    over = {name: 0 for name, amount in estimate.items() if amount > books.spaces[name].limit}
    if over:
        for (owner, _), charge in books.sizes.items():
            if owner != cache:
                continue
            for name, amount in canonical(books.canon, charge).items():
                if name in over and over[name] < amount <= books.spaces[name].limit:
                    over[name] = amount
        estimate.update(over)
    return estimate


def open_gate(books: Books, entry: Entry) -> bool:
    """``entry``'s load of unknown size is over: let the next one through, if any."""
    following = books.gate.next(entry)
    if following is None:
        return False
    pass_gate(books, following)
    return True


def remember_size(books: Books, cache: str, key: Hashable, charge: Mapping[str, int]) -> None:
    """Remember the measured size of ``key`` in ``cache`` (``Books.remember``), and the
    largest its cache has measured in each space (``_estimate``)."""
    keep(books.sizes, (cache, key), dict(charge))
    largest = books.largest.setdefault(cache, {})
    for name, amount in charge.items():
        if amount > largest.get(name, 0):
            largest[name] = amount


def remember_load(books: Books, entry: Entry, seconds: float) -> None:
    """Count a finished load of ``entry``'s key, remembered across evictions."""
    if not books.counts_loads:
        return
    loads, _ = books.load_history.get((entry.cache, entry.key), (0, 0.0))
    keep(books.load_history, (entry.cache, entry.key), (loads + 1, seconds))


def lease_joiners(books: Books, entry: Entry) -> None:
    """A ready entry's requesters get leases, up to its slots; the rest wait for one."""
    granted = entry.joiners if entry.slots is None else entry.joiners[: entry.slots]
    for ticket in granted:
        ticket.outcome = True
        entry.holders.append(ticket.task)
        if ticket.bound:
            entry.bound.append(ticket.task)
    entry.leases = len(granted)
    entry.joiners = entry.joiners[len(granted) :]
    books.effects.append(Settled(entry))


def set_charge(books: Books, entry: Entry, charge: dict[str, int]) -> None:
    entry.charge = charge
    entry.weights = tuple((books.spaces[name], amount) for name, amount in charge.items())
    if entry.kept is not None or entry.state is State.READY:
        sync(entry)


def recharge(books: Books, entry: Entry, measured: dict[str, int]) -> None:
    if books.canon:
        measured = canonical(books.canon, measured)
    for name, amount in entry.charge.items():
        books.spaces[name].used -= amount
    set_charge(books, entry, measured)
    for name, amount in measured.items():
        space = books.spaces[name]
        space.used += amount
        if space.used > space.capacity:
            books.overdrawn.add(name)


def unbind(entry: Entry, task: object) -> None:
    """Keep ``entry.bound`` within its holders once a lease of ``task`` ended.

    When ``task`` held both a bound and an unbound lease, the books cannot
    tell which one ended: the bound one is forgotten, so that the other
    can only be taken for one that may travel (a wait on it is never
    called hopeless), never the other way round.
    """
    with contextlib.suppress(ValueError):
        entry.bound.remove(task)


def settle(books: Books) -> None:
    """Make the entries whose last lease ended idle, in the order their leases ended."""
    settling = books.settling
    if settling:
        books.settling = {}
        busy = books.busy
        for entry in settling:
            del busy[entry]
            rest(books, entry, entry.idle_since)


def rest(books: Books, entry: Entry, now: float) -> None:
    """An entry with no lease: keep it as an eviction candidate, or release it."""
    if entry.doomed is not None:
        start_release(books, entry, entry.doomed)
        return
    if entry.owner.closing or not books.retain:
        start_release(books, entry, Reason.CLOSE if books.retain else Reason.UNRETAINED)
        return
    entry.idle_since = now
    if entry.pinned:
        return  # Resident regardless of policy and idle time.
    ttl = books.idle_ttl if entry.ttl is None else entry.ttl
    if ttl == 0:
        start_release(books, entry, Reason.IDLE)
        return
    entry.idle_seq = next(books.seq)
    weights = entry.weights
    if weights:
        for space, amount in weights:
            space.idle_bytes += amount
    else:
        books.unsized[entry] = None
    books.policy.idle(entry)
    books.idle_count += 1
    if ttl is not None and ttl != math.inf:
        heap = books.expiry
        heapq.heappush(heap, (now + ttl, entry.idle_seq, entry))
        if len(heap) > 2 * books.idle_count + 64:
            # Leased-again and released entries leave stale items behind
            # (lazy deletion); drop them before they outnumber the live ones.
            heap[:] = [item for item in heap if item[2].idle_seq == item[1]]
            heapq.heapify(heap)


def unidle(books: Books, entry: Entry) -> None:
    weights = entry.weights
    if weights:
        for space, amount in weights:
            space.idle_bytes -= amount
    else:
        books.unsized.pop(entry, None)
    if books.on_busy is not None:
        books.on_busy(entry)
    entry.idle_seq = 0
    books.idle_count -= 1
    if not books.idle_count and books.expiry:
        books.expiry.clear()  # every item is stale: let their entries go


def leave_idle(books: Books, entry: Entry) -> None:
    """Stop ``entry`` being an eviction candidate (or about to become one)."""
    if entry.idle_seq:
        unidle(books, entry)
    elif books.settling.pop(entry, False):
        del books.busy[entry]


def start_release(books: Books, entry: Entry, reason: Reason) -> None:
    leave_idle(books, entry)
    entry.state = State.RELEASING
    sync(entry)
    for name, amount in entry.charge.items():
        books.spaces[name].releasing += amount
    books.evictions[reason] += 1
    books.effects.append(StartRelease(entry, reason))
    if books.seam is not None:
        books.seam.releasing(entry, reason)


def release_missed(
    books: Books, entry: Entry, error: BaseException, *, overdue: bool = False
) -> None:
    """A releasing entry's release raised or passed its timeout: it is quarantined."""
    for name, amount in entry.charge.items():
        books.spaces[name].releasing -= amount
    unorphan(books, entry)
    books.releases_failed += 1
    hand_over(books, entry)
    gone(books, entry)
    if overdue:
        books.overdue.add(entry)  # (first: its bytes are no stranded room)
    quarantine(books, entry, error)


def strand(books: Books) -> None:
    """An overdue release ended without freeing its bytes: the room is lost for good, so
    the next ``schedule`` refuses who waited for it (``lost_room``)."""
    books.lost_room = True


def quarantine(books: Books, entry: Entry, error: BaseException) -> None:
    """Keep a gone entry's bytes charged: nobody knows whether its memory came back."""
    entry.error = error
    entry.state = State.QUARANTINED
    books.quarantined[entry] = error
    for space, amount in entry.weights:
        space.quarantined += amount
    books.effects.append(Quarantined(entry))
    books.lost_room = True  # (less room for good: a holder may now wait on itself)
    if books.seam is not None:
        books.seam.quarantined(entry)


def unquarantine(books: Books, entry: Entry) -> None:
    books.overdue.end(entry)
    del books.quarantined[entry]
    _shrink_if_empty(books.quarantined)
    for space, amount in entry.weights:
        space.quarantined -= amount
    discharge(books, entry)


def unorphan(books: Books, entry: Entry) -> None:
    if entry in books.orphans:
        del books.orphans[entry]
        _shrink_if_empty(books.orphans)


def hand_over(books: Books, entry: Entry) -> None:
    """A finished release lets the key's successor (if any) take the slot."""
    owner = entry.owner
    if owner.entries.get(entry.key) is entry:
        successor = entry.successor
        if successor is None:
            del owner.entries[entry.key]
            _shrink_if_empty(owner.entries)
        else:
            owner.entries[entry.key] = successor
            successor.after = None
            admit_weightless(books, successor)
    entry.successor = None


def doom_parked(books: Books, entry: Entry, reason: Reason) -> None:
    """Release a moving or demoted entry for ``reason``: now, or once its move ends.

    An idle demoted one (or one whose demotion still waits for room) goes
    now; one moving, or waited for, gives its key up and goes when its
    move (and the leases its requesters get) end.
    """
    if entry in books.demoting:
        release_demoting(books, entry, reason)
    elif entry.state is State.DEMOTED and entry not in books.queue:
        start_release(books, entry, reason)
    else:
        detach(books, entry)
        entry.doomed = reason


def drain_leased(books: Books, entry: Entry) -> None:
    """Leased ``entry``'s bytes are due to a waiter that waited long (``_scheduler.drain``).

    Drained here, unless the other side of the books sees its leases and
    was told instead (``Seam.wanted``).
    """
    if books.seam is None or not books.seam.wanted(entry):
        doom(books, entry, Reason.CAPACITY)


def doom(books: Books, entry: Entry, reason: Reason) -> None:
    """Release ``entry`` now, or, while leased, when its last lease ends.

    An idle entry keeps its key's slot while releasing, so a new acquire
    waits for the release before loading afresh. A leased one gives the
    slot up at once: new acquires must not wait on other tasks' leases.
    """
    if entry.leases:
        detach(books, entry)
        entry.doomed = reason
        sync(entry)
    else:
        start_release(books, entry, reason)


def grant(books: Books, entry: Entry) -> None:
    """Reserve a queued entry's bytes and start its load."""
    books.queue.take(entry)
    if entry.state is State.DEMOTED:
        start_promotion(books, entry)
        return
    entry.state = State.LOADING
    set_charge(books, entry, entry.need)
    for name, amount in entry.need.items():
        books.spaces[name].used += amount
    books.effects.append(StartLoad(entry))


def fail_joiners(books: Books, entry: Entry, error: BaseException) -> None:
    for ticket in entry.joiners:
        ticket.outcome = error
    entry.joiners = []
    books.effects.append(Settled(entry))


def fail_waiting(books: Books, entry: Entry, error: BaseException) -> None:
    """Fail every requester of a waiting entry with ``error`` and drop the entry.

    A demoted entry waiting for its promotion's room stays demoted.
    """
    fail_joiners(books, entry, error)
    if entry.state is State.DEMOTED:
        dequeue(books, entry)
        rest(books, entry, entry.idle_since)
        return
    drop_waiting(books, entry)
    check_empty(books, entry.owner)


def dequeue(books: Books, entry: Entry) -> None:
    """Take a demoted entry's promotion out of the queue (its requesters are gone)."""
    books.queue.take(entry)
    entry.holding = 0


def drop_waiting(books: Books, entry: Entry) -> None:
    if entry.gated:
        books.gate.leave(entry)
    else:
        books.queue.take(entry)
    open_gate(books, entry)
    if entry.after is not None:
        entry.after.successor = None
        entry.after = None
    else:
        detach(books, entry)
    gone(books, entry)


def detach(books: Books, entry: Entry) -> None:
    owner = entry.owner
    if owner.entries.get(entry.key) is entry:
        del owner.entries[entry.key]
        _shrink_if_empty(owner.entries)


def discharge(books: Books, entry: Entry) -> None:
    for name, amount in entry.charge.items():
        books.spaces[name].used -= amount


def gone(books: Books, entry: Entry) -> None:
    if books.on_remove is not None and entry.state is not State.WAITING:
        books.on_remove(entry)
    entry.state = State.GONE
    if entry.kept is not None:
        sync(entry)
    owner = entry.owner
    owner.live.discard(entry)
    _shrink_if_empty(owner.live)
    check_empty(books, owner)
    if books.seam is not None:
        books.seam.gone(entry)


def check_empty(books: Books, owner: Owner) -> None:
    if owner.closing and not owner.live:
        books.effects.append(OwnerEmpty(owner))


def release_demoting(books: Books, entry: Entry, reason: Reason = Reason.CAPACITY) -> None:
    """Release, for ``reason``, an entry whose demotion waits for room (that is not coming)."""
    del books.demoting[entry]
    going = freed(entry)
    for name, amount in entry.charge.items():  # all of it is releasing now
        books.spaces[name].releasing += amount - going.get(name, 0)
    entry.target = None
    entry.state = State.RELEASING
    books.evictions[reason] += 1
    books.effects.append(StartRelease(entry, reason))


def cancel_demotion(books: Books, entry: Entry) -> None:
    """A request for an entry whose demotion still waits for room: it stays where it is
    (ready, or, parked a tier down already, demoted: the request then promotes it)."""
    del books.demoting[entry]
    for name, amount in freed(entry).items():
        books.spaces[name].releasing -= amount
    entry.target = None
    entry.state = State.READY if entry.home is None else State.DEMOTED
    sync(entry)


def queue_promotion(books: Books, entry: Entry, need: dict[str, int] | None) -> None:
    """A request for a demoted entry: queue its move back up, for ``need`` (its home's
    size, in one of its places)."""
    leave_idle(books, entry)
    assert need is not None
    entry.need = dict(need)
    entry.holding = 0  # (its requesters of an earlier promotion are all served)
    enqueue(books, entry)


def start_promotion(books: Books, entry: Entry) -> None:
    """A queued promotion was granted ``entry.need``: reserve it and start the move."""
    entry.state = State.MOVING
    entry.promoting = True
    entry.target = dict(entry.need)
    for name, amount in reserved(entry).items():
        books.spaces[name].used += amount
    for name, amount in freed(entry).items():
        books.spaces[name].releasing += amount
    books.effects.append(StartMove(entry, owner_space(books, entry, destination(entry))))


def come_home(books: Books, entry: Entry) -> None:
    """A demoted entry is charged in every space of its home: ready there, no move back.

    A promotion queued for it is taken out of the queue and its requesters
    get leases (up to its slots).
    """
    entry.home = None
    entry.cost = entry.reload
    if entry in books.queue:
        dequeue(books, entry)
    entry.state = State.READY
    if entry.joiners:
        lease_joiners(books, entry)
        if entry.leases:
            books.busy[entry] = None
    sync(entry)


def moved(
    books: Books,
    entry: Entry,
    value: Any,
    measured: dict[str, int] | None,
    seconds: float,
    now: float,
) -> bool:
    """The state changes of ``Core.move_done`` (its docstring says what they are)."""
    going = freed(entry)
    planned = entry.target or {}
    no_room = False
    for name, amount in going.items():
        space = books.spaces[name]
        space.used -= amount
        space.releasing -= amount
    if books.on_remove is not None:
        books.on_remove(entry)  # (indexed by the charge it leaves)
    before = entry.charge
    assert entry.target is not None
    set_charge(books, entry, entry.target)
    entry.target = None
    entry.value = value
    if measured is not None:
        if books.canon:
            measured = canonical(books.canon, measured)
        if measured != entry.charge:
            recharge(books, entry, measured)
    if entry.promoting:
        entry.promoting = False
        entry.home = None
        entry.promote_cost = seconds
        keep(books.promote_history, (entry.cache, entry.key), seconds)
        entry.cost = entry.reload
        entry.state = State.READY
        books.promotions += 1
    else:
        home = before if entry.home is None else entry.home
        if left_home(home, entry.charge):
            entry.home = home
            part(entry)
            entry.cost = parked_cost(entry)
            entry.state = State.DEMOTED
            books.demotions += 1
        else:  # (home: a move within one memory, or measured where it was)
            entry.home = None
            entry.cost = entry.reload
            entry.state = State.READY
        if no_room := stayed(going, planned, entry.charge):
            entry.doomed = entry.doomed or Reason.CAPACITY
            if entry.joiners:  # (they get it; new requests load afresh)
                detach(books, entry)
        # (idle since its last lease ended, not since it moved)
        now = entry.idle_since
    if books.on_admit is not None:
        books.on_admit(entry)
    if entry.state is State.READY:
        lease_joiners(books, entry)
        if entry.leases:
            books.busy[entry] = None
        else:
            rest(books, entry, now)
    elif entry.joiners:
        queue_promotion(books, entry, entry.home)
    else:
        rest(books, entry, now)
    sync(entry)
    return no_room


def move_failed(books: Books, entry: Entry, error: BaseException) -> None:
    """The state changes of ``Core.move_failed`` (its docstring says what they are)."""
    for name, amount in freed(entry).items():
        books.spaces[name].releasing -= amount
    target = entry.target or {}
    both = {
        name: max(entry.charge.get(name, 0), target.get(name, 0))
        for name in (*entry.charge, *target)
    }
    if entry.joiners:
        fail_joiners(books, entry, _naming(error, entry))
    books.moves_failed += 1
    hand_over(books, entry)
    gone(books, entry)  # (leaves the policy by the charge it was indexed by)
    entry.target = None
    entry.promoting = False
    set_charge(books, entry, both)
    quarantine(books, entry, error)
