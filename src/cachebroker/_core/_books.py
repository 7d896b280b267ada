"""``Core``: the books of one broker, and the steps the shell takes on them.

Every method is one synchronous step (listed in ``STEPS``) or a view. A step
changes the books' state (``_state.Books``) only through ``_transitions``,
lets the scheduler grant and evict (``_scheduler.schedule``), and leaves the
work that must happen next in ``Books.effects``.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable, Mapping
from typing import Any

from .._errors import BrokerClosed, InvalidArgument, ReleaseFailed
from . import (
    _above,
    _aliases,
    _departures,
    _invariants,
    _reach,
    _refusals,
    _requests,
    _tiers,
    _transitions,
)
from ._effects import CancelLoad, Quarantined
from ._model import Entry, Owner, Reason, Request, State, Ticket, _naming, _shrink_if_empty, sync
from ._scheduler import schedule
from ._state import Books
from ._tiers import canonical

__all__ = ["Core"]

#: For the hit path: reading a member through its Enum class costs a lookup
#: through the metaclass (about 70 ns on Python 3.11).
_READY = State.READY


class Core(Books):
    """The books of one broker, and the steps the shell takes on them (module docstring)."""

    __slots__ = ()

    # ------------------------------------------------------------------ owners

    def open_owner(
        self,
        name: str,
        *,
        slots: int | None = None,
        priority: int = 0,
        ttl: float | None = None,
        moves: bool = False,
    ) -> Owner:
        """Open a cache; ``slots``, ``priority`` and ``ttl`` are its entries' defaults.

        ``moves``: its owner can move values between spaces (``tiers``).
        """
        if self.closed:
            raise BrokerClosed("the broker is closed")
        if name in self.owners:
            raise InvalidArgument(f"a cache named {name!r} is already open on this broker")
        owner = self.owners[name] = Owner(name)
        owner.slots, owner.priority, owner.ttl = slots, priority, ttl
        owner.moves = moves
        return owner

    def close_owner(self, owner: Owner, error: BaseException) -> None:
        """Start closing ``owner``: fail its waiters, cancel its loads, release its entries.

        Leased entries are released when their last lease ends. ``OwnerEmpty``
        is queued once nothing of the owner remains.
        """
        owner.closing = True
        live = list(owner.live)
        for entry in live:
            if entry.state in (State.WAITING, State.LOADING):
                _transitions.fail_joiners(self, entry, _naming(error, entry))
                if entry.state is State.WAITING:
                    _transitions.drop_waiting(self, entry)
                else:
                    entry.doomed = Reason.CLOSE
                    self.effects.append(CancelLoad(entry))
            elif entry.state is State.READY:
                if entry.joiners:  # waiting for a lease slot
                    _transitions.fail_joiners(self, entry, _naming(error, entry))
                _transitions.doom(self, entry, Reason.CLOSE)
            elif entry.state in (State.MOVING, State.DEMOTED):
                if entry.joiners:  # waiting for a move, or a promotion's room
                    _transitions.fail_joiners(self, entry, _naming(error, entry))
                    if entry in self.queue:
                        _transitions.dequeue(self, entry)
                _transitions.doom_parked(self, entry, Reason.CLOSE)
        if self.seam is not None:
            for entry in live:
                if entry.state is State.LOADING:
                    self.seam.withdrawn(entry)
        _transitions.check_empty(self, owner)
        schedule(self)

    def forget_owner(self, owner: Owner) -> None:
        """Drop ``owner`` from the registry once its block has ended."""
        if self.owners.get(owner.name) is owner:
            del self.owners[owner.name]

    # ----------------------------------------------------------------- acquire

    def configure(
        self, entry: Entry, *, idle_ttl: float | None = None, pin: bool | None = None
    ) -> None:
        """Apply an acquire's per-entry settings: the latest request's win."""
        if idle_ttl is not None:
            entry.ttl = idle_ttl
        if pin is not None:
            entry.pinned = pin
            if self.seam is not None:
                self.seam.changed(entry)

    def limit(self, entry: Entry, *, slots: int | None = None, priority: int | None = None) -> None:
        """Set ``entry``'s lease slots and eviction priority (``None``: unchanged).

        More slots grant waiting requests at once; fewer end no lease (the
        entry takes no new one until its leases fall below the limit).
        """
        if priority is not None and priority != entry.priority:
            _transitions.prepare_priority(self, priority)
            entry.priority = priority
            sync(entry)
            if self.priorities is not None:
                self.priorities.move(
                    entry,
                    admitted=entry.state
                    in (State.READY, State.RELEASING, State.MOVING, State.DEMOTED),
                    idle=bool(entry.idle_seq),
                )
            if self.seam is not None:
                self.seam.changed(entry)  # (the other side evicts by it too)
        if slots is not None and slots != entry.slots:
            entry.slots = slots
            if entry.joiners and entry.state is State.READY:
                _transitions.grant_slots(self, entry)  # (or refuses a waiter now waiting on itself)

    def reprioritize(self, entry: Entry, priority: int) -> None:
        """Give ``entry`` ``priority`` outside a request (books whose owner's acquires
        run in another process, which reports the latest one's priority).

        A lowered priority may let a waiter that waits aside (blocked only by
        higher-priority bytes) evict the entry now: the queue is served again.
        """
        lowered = priority < entry.priority
        self.limit(entry, priority=priority)
        if lowered and self.queue:
            schedule(self)

    def unpin(self, owner: Owner, key: Hashable, now: float) -> bool:
        """Make ``key`` an ordinary entry again; returns whether it was pinned."""
        entry = owner.entries.get(key)
        if entry is None or not entry.pinned:
            return False
        entry.pinned = False
        if entry.state is State.READY and not entry.leases:
            _transitions.rest(self, entry, now)
            schedule(self)
        if self.seam is not None:
            self.seam.changed(entry)
        return True

    def hit(self, entry: Entry, task: object, *, bound: bool = False) -> None:
        """Lease a ready entry to ``task``; ``bound``: as for ``request`` (the hit path
        of the shell leaves it out: such a lease never makes a slot wait hopeless)."""
        if entry.leases == 0:
            if entry.idle_seq:  # (a pinned entry never was a candidate)
                _transitions.unidle(self, entry)
                self.busy[entry] = None
            elif not self.settling.pop(entry, False):  # (a settling one is still busy)
                self.busy[entry] = None
        entry.leases += 1
        entry.holders.append(task)
        if bound:
            entry.bound.append(task)
        # _count_request, inlined: this is the hit path.
        tick = self.tick = self.tick + 1
        entry.requests += 1
        entry.last_request = tick
        if self.on_touch is not None:
            self.on_touch(entry)
        seam = self.seam
        if seam is not None and seam.leased(entry):
            # Its leases kept overlapping: new requests load afresh (behind
            # the other side's waiter), and it goes when its last lease ends.
            _transitions.doom(self, entry, Reason.CAPACITY)

    def request(
        self,
        owner: Owner,
        request: Request,
        task: object,
        *,
        loading: tuple[Entry, ...] = (),
        urgent: bool = False,
        held: tuple[Entry, ...] | None = None,
        bound: bool = True,
    ) -> Ticket:
        """Ask for ``request.key`` on behalf of ``task``; returns a ticket to wait on.

        A ready entry is leased at once (``ticket.outcome is True``) while it
        has a free lease slot and nobody waits for one; else the ticket waits
        for a slot, in arrival order, without asking for space. Otherwise the
        ticket joins the entry's load, creating the entry (and queueing it for
        space) when there is none to join. The request's ``slots`` and
        ``priority`` override the entry's (the latest request's win; a new entry takes its owner's
        when they are ``None``).

        ``request.need`` is the declared size; ``None`` means "measured after the
        load": the key's remembered size is reserved, and a key never measured
        is a load of unknown size. Those run one at a time (the gate), each
        reserving the largest size its cache has measured in each space, so
        unknown loads never overshoot the budget together: at most one load's
        error is on the books at a time, and its measurement corrects them.
        Only a request from inside a loader, or from a task holding a lease,
        does not wait for its turn (it reserves nothing): the load whose turn
        it is may be waiting for that loader's reservation or that lease.
        ``loading`` names the entries whose loader makes this request;
        ``urgent`` says the same of a request relayed from another process
        (whose loaders and leases these books do not see), and ``held`` names
        the entries its task leases there, for deadlock detection.

        ``request.places``: the spaces a new entry may be loaded in, ``need`` being
        its size in the first (one space); the scheduler chooses among those
        that can ever hold it and would not wait on ``task``'s own leases.

        ``bound``: whether only ``task`` itself can end the lease granted
        (the shell: a lease entered with ``async with``, whose block ends it
        in that task). An unbound lease may be handed to another task and
        ended there, so it never makes a wait for a lease slot hopeless.

        Raises:
            RequestTooLarge: ``need`` exceeds a space's whole budget.
            OutOfSpace: ``need`` fits the budget only once quarantined
                entries are written off (``forget``).
            DeadlockError: only evicting ``task``'s own leases (or writing
                off quarantined entries) could make room, the request waits
                for a load that waits for it, or for a lease slot that only
                ``task`` itself could free (leases bound to it).
            BrokerClosed: the owner is closing.
        """
        if owner.closing:
            raise BrokerClosed(
                f"cache {owner.name!r} is closed: cannot acquire {owner.name}:{request.key!r}"
            )
        entry = owner.entries.get(request.key)
        if entry is not None and entry.state is State.RELEASING:
            entry = entry.successor
        if entry is not None and (request.slots is not None or request.priority is not None):
            self.limit(entry, slots=request.slots, priority=request.priority)
        kept = entry is not None and entry in self.demoting
        if kept:  # its demotion still waits for room: it stays where it is
            _transitions.cancel_demotion(self, entry)  # type: ignore[arg-type]
        if entry is not None and entry.state is State.READY:
            if entry.slots is not None and (entry.joiners or entry.leases >= entry.slots):
                ticket = _transitions.wait_for_slot(self, entry, task, loading, bound=bound)
            else:
                self.hit(entry, task, bound=bound)
                ticket = Ticket(entry, task)
                ticket.outcome = True
            if kept:  # the waiters it was demoted for look elsewhere
                schedule(self)
            return ticket
        if entry is None:
            entry, mine = _requests.miss(self, owner, request, task, loading, urgent, held)
        else:
            mine = _requests.join(self, entry, kept, task, loading, held)
        ticket = _transitions.join(self, entry, task, loading, held, bound=bound, mine=mine)
        schedule(self)
        return ticket

    def adopt(
        self,
        owner: Owner,
        key: Hashable,
        charge: dict[str, int],
        task: object,
        *,
        priority: int | None = None,
    ) -> Ticket:
        """Take on a request that other books granted, whose load has begun or ended.

        For books whose owners live in other processes: a process that
        registers again with a restarted shared broker holds ``charge``
        already, so its entry is granted at once, whatever the queue and the
        budget say (the memory is taken: refusing it would not give it back),
        and a space it drives over its capacity evicts for it as after a load
        measured larger than declared. The entry is loading, ``task`` joined
        to it: the load reports how the entry stands there.
        """
        asked = tuple(charge)
        if self.canon:
            charge = canonical(self.canon, charge)
        entry = _transitions.create(self, owner, key, charge, priority=priority, asked=asked)
        self.misses -= 1  # (no request of these books: nothing was missed here)
        ticket = Ticket(entry, task)
        entry.joiners.append(ticket)
        _transitions.grant(self, entry)
        for name in charge:
            if self.spaces[name].used > self.spaces[name].capacity:
                self.overdrawn.add(name)
        schedule(self)
        return ticket

    def leave(self, ticket: Ticket, refused: BaseException | None = None) -> None:
        """Withdraw a pending ticket (its task was cancelled or timed out).

        The last requester leaving a queued entry removes it; leaving a loading
        entry cancels its load. A ticket already granted is left as it is: its
        lease must be ended with ``lease_end``.

        ``refused``: the ticket's task gets this error instead, while another
        requester of the entry waits on (books above refused the request for
        the first requester's leases: ``DeadlockError``).
        """
        entry = ticket.entry
        if refused is not None:
            if ticket.outcome is None and len(entry.joiners) > 1:
                _transitions.refuse(self, ticket, refused)
            return
        if ticket.outcome is None and _transitions.withdraw(self, ticket):
            schedule(self)
        going = entry.state is State.LOADING or (entry.state is State.MOVING and entry.promoting)
        if self.seam is not None and going and not entry.joiners:
            self.seam.withdrawn(entry)

    def prefetch(
        self,
        owner: Owner,
        request: Request,
        task: object,
        now: float,
        *,
        loading: tuple[Entry, ...] = (),
        urgent: bool = False,
        held: tuple[Entry, ...] | None = None,
    ) -> Ticket | None:
        """Have ``request.key`` loaded on behalf of ``task``, without counting a request.

        A ready entry is left loaded: ``None``; the request's ``idle_ttl`` and ``pin``, if
        given, apply to it at once (an idle one rests again from ``now``).
        Otherwise exactly as ``request`` (the same ticket, the same errors,
        the same single flight): the ticket is granted a lease when the load
        ends, which the caller ends at once, applying ``idle_ttl`` and ``pin``
        first (``configure``).

        Nothing is counted: not the request clock, the entry's requests, a
        miss, nor the policy's ``touch``. A prefetch predicts demand; it is
        none, so hit ratios and the policies' request rates stay the
        requests'. The load itself counts as any load.
        """
        priority, idle_ttl, pin = request.priority, request.idle_ttl, request.pin
        if not owner.closing:  # (a closing owner: ``request`` raises)
            entry = owner.entries.get(request.key)
            if entry is not None and entry.state is State.RELEASING:
                entry = entry.successor
            if entry is not None and entry in self.demoting:
                return None  # loaded; the policy's move down a tier stands
            if entry is not None and entry.state is State.READY:
                if priority is not None:
                    self.limit(entry, priority=priority)
                if idle_ttl is not None or pin:
                    self.retune(entry, idle_ttl, pin, now)
                elif priority is not None and self.queue:
                    schedule(self)  # a waiter aside may evict it now
                return None
        misses = self.misses
        self.prefetching = True
        try:
            return self.request(owner, request, task, loading=loading, urgent=urgent, held=held)
        finally:
            self.prefetching = False
            self.misses = misses  # (``_transitions.create`` counts a miss)

    def retune(self, entry: Entry, idle_ttl: float | None, pin: bool, now: float) -> None:
        """Apply a prefetch's ``idle_ttl`` and ``pin`` to a ready entry, without a lease
        (or the pin its process reports, for the daemon's books)."""
        if idle_ttl is not None:
            entry.ttl = idle_ttl
        if entry.leases:  # they apply when its last lease ends
            entry.pinned = entry.pinned or pin
            if self.seam is not None:
                self.seam.changed(entry)
            return
        # Idle (or about to be): out of the idle books, and back in from now,
        # so that a new idle TTL counts from the prefetch.
        if entry.idle_seq:
            _transitions.unidle(self, entry)
        elif self.settling.pop(entry, False):
            del self.busy[entry]
        entry.pinned = entry.pinned or pin
        _transitions.rest(self, entry, now)
        schedule(self)
        if self.seam is not None:
            self.seam.changed(entry)

    # ------------------------------------------------------------------ sizes

    def remember(self, cache: str, key: Hashable, charge: Mapping[str, int]) -> None:
        """Remember the measured size of ``key`` in ``cache`` (space names as given)."""
        _transitions.remember_size(self, cache, key, charge)

    # ------------------------------------------------------------------- loads

    def load_done(
        self,
        entry: Entry,
        value: Any,
        measured: dict[str, int] | None,
        seconds: float,
        now: float,
        *,
        error: BaseException | None = None,
    ) -> None:
        """Record a finished load; grant a lease to every joined ticket.

        With ``error`` (the measured size could not be taken), or when the
        measured size exceeds a space's whole budget, the joiners get the error
        instead and the loaded value is released through its owner at once.
        Ignored for an entry no longer loading (``drop_owner`` took it already).
        """
        if entry.state is not State.LOADING:
            return
        entry.value = value
        entry.state = State.READY
        entry.reload = entry.cost = seconds if entry.declared_cost is None else entry.declared_cost
        entry.nested = []
        self.loads += 1
        self.load_seconds += seconds
        _transitions.remember_load(self, entry, seconds)
        recharged = False
        if measured is not None:
            self.remember(entry.owner.name, entry.key, measured)
            if not measured.keys() <= set(entry.asked):  # (a size unknown until measured)
                entry.asked = (*entry.asked, *(n for n in measured if n not in entry.asked))
            if measured != entry.charge:
                _transitions.recharge(self, entry, measured)
                recharged = True
        if _transitions.open_gate(self, entry):
            recharged = True  # A load of unknown size was let through: schedule it.
        if self.on_admit is not None:
            self.on_admit(entry)  # with its measured charge: policies index entries by space
        rejected = error if error is not None else _refusals.oversize(self, entry)
        owner = entry.owner
        if entry.doomed is None and owner.entries.get(entry.key) is not entry:
            # Its requesters all left, yet it finished (a thread cannot be
            # stopped): keep it if its key is free, else it is superfluous.
            if entry.key in owner.entries:
                entry.doomed = Reason.ABANDONED
            else:
                owner.entries[entry.key] = entry
        sync(entry)
        if self.seam is not None:
            self.seam.loaded(entry)
        if rejected is not None:
            _transitions.fail_joiners(self, entry, rejected)
        _transitions.lease_joiners(self, entry)
        if rejected is not None:
            _transitions.start_release(self, entry, Reason.REJECTED)
        elif entry.leases:
            self.busy[entry] = None
            if not recharged:
                return  # Nothing the queue waits on changed: scheduling would do nothing.
        else:
            _transitions.rest(self, entry, now)
        schedule(self)

    # ------------------------------------------------------------------- moves

    def move_done(
        self,
        entry: Entry,
        value: Any,
        measured: dict[str, int] | None,
        seconds: float,
        now: float,
    ) -> bool:
        """The owner moved ``entry``'s value to ``entry.target`` (``_moves``).

        The bytes it left come back; it is charged where it went (as
        ``measured``, if given). Promoted, it is ready and its requesters
        get leases; demoted, it is an eviction candidate in the lower tier,
        or, when requests joined the move, queued at once to come back up.
        A demotion that lands in every space of its home (its tier is one
        memory with the space above it now, or ``measured`` says so) is no
        demotion: the entry is ready there. One measured still in a space it
        was to free made no room: it is released (once the leases of its
        joined requesters end), or the scheduler would move it down again and
        again while its waiter waits; that is what the return value says.
        Ignored for an entry no longer moving (``drop_owner`` took it already).
        """
        if entry.state is not State.MOVING or entry in self.demoting:
            return False
        stayed = _transitions.moved(self, entry, value, measured, seconds, now)
        if self.seam is not None:
            self.seam.moved(entry)
        schedule(self)
        return stayed

    def move_failed(self, entry: Entry, error: BaseException, *, ran: bool = True) -> None:
        """The move raised or timed out: quarantined, charged where it was and where it went.

        Nobody knows which of the two holds the value now, so both charges
        stay until ``forget``; its requesters get ``error``. ``ran=False``: it
        never began (books above refused it): the entry stays where it was.
        """
        if entry.state is not State.MOVING or entry in self.demoting:
            return
        if ran:
            _transitions.move_failed(self, entry, error)
        else:
            _above.unmove(self, entry, None, error)
        schedule(self)

    def load_abandoned(self, entry: Entry) -> None:
        """The closing cache stops waiting for a load that cannot be stopped (a worker thread).

        The load may still make its value, so its bytes stay charged: the entry
        is ``releasing`` from now on, its release being the load's end (the
        value released through the owner, or nothing to free if the load
        fails). It leaves its key and its owner's live entries, so the owner's
        close is not held, and is listed in ``orphans`` until ``release_done``
        or ``release_failed``. Requesters still joined get ``BrokerClosed``.
        """
        if entry.state is not State.LOADING:
            return
        owner = entry.owner
        if entry.joiners:
            closed = f"cache {owner.name!r} was closed while acquiring {owner.name}:{entry.key!r}"
            _transitions.fail_joiners(self, entry, BrokerClosed(closed))
        _transitions.detach(self, entry)
        entry.state = State.RELEASING
        for name, amount in entry.charge.items():
            self.spaces[name].releasing += amount
        self.evictions[Reason.CLOSE] += 1
        owner.live.discard(entry)
        _shrink_if_empty(owner.live)
        self.orphans[entry] = None
        entry.nested = []
        _transitions.open_gate(self, entry)
        _transitions.check_empty(self, owner)
        if self.seam is not None:
            self.seam.changed(entry)
        schedule(self)

    def load_failed(self, entry: Entry, error: BaseException, *, cancelled: bool = False) -> None:
        """Record a failed or cancelled load: return its reservation, fail its joiners.

        Ignored for an entry no longer loading (``drop_owner`` took it already).
        """
        if entry.state is not State.LOADING:
            return
        if not cancelled:
            self.load_failures += 1
        entry.nested = []
        _transitions.fail_joiners(self, entry, error)
        _transitions.discharge(self, entry)
        _transitions.detach(self, entry)
        _transitions.gone(self, entry)
        _transitions.open_gate(self, entry)
        schedule(self)

    def set_capacity(self, name: str, capacity: int, limit: int | None = None) -> None:
        """A probed space's capacity changed (the device's free memory moved).

        Shrinking below what is charged evicts idle entries at once; growing
        may grant waiting requests.
        """
        name = self.canon.get(name, name)
        space = self.spaces[name]
        space.budget = space.capacity = max(0, capacity)
        if limit is not None:
            space.limit = max(0, limit)
        if space.used > space.capacity:
            self.overdrawn.add(name)
        schedule(self)

    # ------------------------------------------------------------------ leases

    def lease_end(self, entry: Entry, task: object, now: float) -> None:
        """End one lease of ``task`` on ``entry``; a request waiting for a slot takes it."""
        entry.leases -= 1
        holders = entry.holders
        try:
            holders.remove(task)
        except ValueError:  # The lease was handed to another task: forget one of the holders.
            task = holders.pop()
        if entry.bound:
            _transitions.unbind(entry, task)
        if entry.joiners and entry.state is _READY:
            _transitions.grant_slots(self, entry)
        if entry.leases == 0:
            if entry.state is not _READY:
                # Its cache closed while it was leased: quarantined (or written
                # off since). Nobody can release it; let the value go.
                entry.value = None
            elif (
                self.queue
                or self.overdrawn
                or entry.doomed
                or entry.pinned
                or entry.ttl == 0
                or not self.retain
            ):
                del self.busy[entry]
                _transitions.rest(self, entry, now)
                schedule(self)
            else:  # Nobody waits: let it become idle when the books are next read.
                entry.idle_since = now
                self.settling[entry] = True
            if self.seam is not None:
                self.seam.ended(entry)
        elif self.tick >= self.queue.fair_at:  # Still leased, but a waiter has waited long enough.
            schedule(self)

    # ---------------------------------------------------------------- releases

    def free_for_retry(self, entry: Entry) -> list[Entry]:
        """A load ran out of memory: start releasing the next victim; return it.

        The next idle victim in policy order in the load's spaces; failing
        that, in any other space; failing that, the oldest idle entry of
        unknown size. Returns ``[]`` when nothing is left to free.
        """
        _transitions.settle(self)
        own = list(entry.charge)
        others = [name for name in self.canon.names if name not in own]
        victims: list[Entry] = []
        for spaces in (own, others):
            # All the spaces at once, then (for a policy that covers a
            # shortfall only as a whole) one at a time: any of them is worth freeing.
            for asked in (spaces, *([space] for space in spaces)) if spaces else ():
                if victims:
                    break
                chosen = self.policy.victims(dict.fromkeys(asked, 1))
                victims = [v for v in chosen if isinstance(v, Entry) and v.idle]
                self.policy_evicted(victims, dict.fromkeys(asked, 1))
        if not victims and self.unsized:
            victims = [next(iter(self.unsized))]
        for victim in victims:
            _transitions.start_release(self, victim, Reason.RETRY)
        if victims:
            self.oom_retries += 1
        return victims

    def release_done(self, entry: Entry) -> None:
        """The owner acknowledged the release ("freed"): the bytes come back.

        Also accepted for a quarantined entry whose late acknowledgement arrived.
        """
        if entry.state is State.RELEASING:
            for name, amount in entry.charge.items():
                self.spaces[name].releasing -= amount
            _transitions.discharge(self, entry)
            _transitions.unorphan(self, entry)
        elif entry.state is State.QUARANTINED:
            _transitions.unquarantine(self, entry)
        else:
            return
        _transitions.hand_over(self, entry)
        _transitions.gone(self, entry)
        schedule(self)

    def release_failed(self, entry: Entry, error: BaseException) -> None:
        """The release raised or timed out: the bytes stay charged, the entry is quarantined.

        For an entry quarantined already by its release's timeout
        (``release_overdue``), the release that ran on raised after all: its
        bytes are stranded now, until ``forget``.
        """
        if entry.state is not State.RELEASING:
            if self.overdue.end(entry):
                entry.error = self.quarantined[entry] = error
                self.effects.append(Quarantined(entry))  # (for good, now: it says why)
                _transitions.strand(self)
                if self.seam is not None:
                    self.seam.changed(entry)
                schedule(self)  # (refuses the waiters only forget() can serve now)
            return
        _transitions.release_missed(self, entry, error)
        schedule(self)

    def release_overdue(self, entry: Entry, error: BaseException) -> None:
        """The release did not return within its timeout, and still runs: quarantined.

        As ``release_failed`` (the entry leaves its key, its bytes stay
        charged, it is counted as a failed release and ``forget`` writes it
        off), except that its bytes may come back: requests may wait for them
        (``_overdue.Overdue``), within their own timeout. The release's end is
        reported as usual: ``release_done`` frees the bytes, ``release_failed``
        strands them.
        """
        if entry.state is not State.RELEASING:
            return
        _transitions.release_missed(self, entry, error, overdue=True)
        schedule(self)

    def abandon(self, owner: Owner) -> list[Entry]:
        """The owner's block ended with entries still leased: quarantine them; return them.

        Nobody is left to release them, so their bytes stay charged until
        ``forget``; their holders keep the values until their leases end.
        """
        abandoned = [entry for entry in owner.live if entry.leases]
        for entry in abandoned:
            del self.busy[entry]
            _transitions.detach(self, entry)
            _transitions.gone(self, entry)
            _transitions.quarantine(
                self,
                entry,
                ReleaseFailed(
                    f"cache {owner.name!r} was closed while {owner.name}:{entry.key!r} was "
                    "still leased: nobody is left to release it"
                ),
            )
        if abandoned:
            schedule(self)
        return abandoned

    def forget(self, entry: Entry) -> None:
        """Write off a quarantined entry: the operator says its memory is free."""
        if entry.state is State.QUARANTINED:
            _transitions.unquarantine(self, entry)
            entry.state = State.GONE
            schedule(self)
        if self.seam is not None:
            self.seam.changed(entry)

    # ------------------------------------------------------ invalidate / sweep

    def invalidate(self, owner: Owner, key: Hashable) -> bool:
        """Drop ``key``'s value: released now if idle, else when its last lease ends.

        Returns whether there was a loaded (or loading) value to drop.
        """
        entry = owner.entries.get(key)
        if entry is None or entry.state not in (
            State.READY,
            State.LOADING,
            State.MOVING,
            State.DEMOTED,
        ):
            return False
        if entry.state is State.LOADING:
            _transitions.detach(self, entry)
            entry.doomed = Reason.INVALIDATE
        elif entry.state is State.READY:
            _transitions.doom(self, entry, Reason.INVALIDATE)
        else:
            _transitions.doom_parked(self, entry, Reason.INVALIDATE)
        schedule(self)
        return True

    def sweep(self, now: float) -> list[Entry]:
        """Release every entry idle for at least the idle TTL; return them."""
        _transitions.settle(self)
        expired: list[Entry] = []
        heap = self.expiry
        while heap and heap[0][0] <= now:
            _, seq, entry = heapq.heappop(heap)
            if entry.idle_seq == seq and entry.state in (State.READY, State.DEMOTED):
                _transitions.start_release(self, entry, Reason.IDLE)
                expired.append(entry)
        if expired:
            schedule(self)
        return expired

    def next_expiry(self) -> float | None:
        """When the next idle entry expires, or ``None`` when none can."""
        _transitions.settle(self)
        heap = self.expiry
        while heap and (
            heap[0][2].idle_seq != heap[0][1]
            or heap[0][2].state not in (State.READY, State.DEMOTED)
        ):
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def clear(self) -> int:
        """Release every ready entry (leased ones when their last lease ends)."""
        count = 0
        for owner in list(self.owners.values()):
            for entry in list(owner.entries.values()):
                if entry.state is State.READY:
                    _transitions.doom(self, entry, Reason.CLEAR)
                    count += 1
                elif entry.state in (State.MOVING, State.DEMOTED) and entry.doomed is None:
                    _transitions.doom_parked(self, entry, Reason.CLEAR)
                    count += 1
        schedule(self)
        return count

    # ------------------------------------------------- owners in other processes

    def give_up(
        self, entry: Entry, reason: Reason = Reason.CAPACITY, to: dict[str, int] | None = None
    ) -> bool:
        """Books above these ones (a shared broker) picked ``entry`` as a victim (``reason``).

        An idle entry's release starts now. Returns ``False`` when the entry
        is leased or pinned, so the release is refused; ``True`` when its
        release started or is already under way (or over).

        ``to``: move it instead, to be charged so (a tier down, its room made
        above); only an idle entry moves, else ``False`` (refused).
        """
        return _above.give_up(self, entry, reason, to)

    def release_refused(self, entry: Entry, holder: object) -> None:
        """The owner refused the release: it had leased ``entry`` again meanwhile.

        For books whose owners live in other processes, where a lease taken
        there reaches these books only after the release was asked for. The
        entry is ready again, leased by ``holder`` (``None``: idle); the requests
        its bytes were meant for look for other room. A move asked of the owner
        is called off the same way: the entry stays where it was.
        """
        _above.release_refused(self, entry, holder)

    def park(self, entry: Entry, home: dict[str, int]) -> None:
        """Books above these ones took on ``entry`` (``adopt``) as its owner holds it:
        demoted, its home ``home``; an acquire brings it back up there. Ignored
        unless it is ready and idle."""
        _above.park(self, entry, home)

    def let_go(self, entry: Entry, reason: Reason) -> None:
        """The owner releases ``entry`` on its own (from another process).

        Now, or when its last lease (or its move between tiers) ends.
        """
        _above.let_go(self, entry, reason)

    def drop_owner(self, owner: Owner) -> None:
        """``owner``'s process is gone, and its memory with it: its entries leave the books at once.

        Waiting and loading requests for its keys fail with ``BrokerClosed``;
        its ready, releasing and quarantined entries' bytes come back now. The
        shell's tasks still running for them find them gone (``load_done``,
        ``load_failed``, ``release_done`` and ``release_failed`` ignore them).
        """
        _departures.drop_owner(self, owner)
        schedule(self)

    # ----------------------------------------------------------------- aliases

    def note_alias_evidence(
        self, freed: Iterable[str], loaded: Iterable[str], threshold: int
    ) -> _aliases.Learned:
        """A load in ``loaded`` spaces fit only after freeing in ``freed`` spaces (``_aliases``)."""
        return _aliases.note_alias_evidence(self, freed, loaded, threshold, self.merge_spaces)

    def merged_circle(self, keep: str, other: str) -> tuple[str, ...] | None:
        """The tiers' circle with ``keep`` and ``other`` one memory, if any (refused)."""
        return _aliases.merged_circle(self, keep, other)

    def merge_spaces(self, keep: str, other: str) -> None:
        """Treat spaces ``keep`` and ``other`` as one memory from now on (``_aliases``);
        ``InvalidArgument`` if that would make the tiers a circle."""
        _aliases.merge_spaces(self, keep, other)

    def place(self, entry: Entry, space: str) -> None:
        """Books above these ones (a shared broker) chose ``space`` among ``entry``'s
        places for its load (or its promotion): its reservation moves there first."""
        _above.place(self, entry, space)

    def owner_space(self, entry: Entry, space: str) -> str:
        """``space`` by the name ``entry``'s owner gave it (``_tiers.owner_space``)."""
        return _tiers.owner_space(self, entry, space)

    def aliases(self) -> list[tuple[str, ...]]:
        """The groups of space names known to be one memory (each group sorted)."""
        return _aliases.aliases(self.canon)

    # ------------------------------------------------------------------- views

    def waiters(self, entry: Entry) -> int:
        """How many requests wait on ``entry``: those joined to its load (or its
        queueing), or, once it is ready, those waiting for a lease slot."""
        return len(entry.joiners)

    def why_no_room(self, entry: Entry) -> str:
        """Why the request of a waiting ``entry`` has no room yet, in words (``_reach``)."""
        return _reach.why_no_room(self, entry)

    def check(self) -> None:
        """Assert the invariants of the package docstring (for tests and debugging)."""
        _invariants.check(self)
