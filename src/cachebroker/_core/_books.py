"""``Core``: the books of one broker, and the steps the shell takes on them.

Every public method is one synchronous step (listed in ``STEPS``) or a view;
a step updates the books, lets the scheduler grant and evict
(``_scheduler.schedule``), and leaves the work that must happen next in
``Core.effects``. The underscored methods are the primitives those steps
share with the scheduler and the alias bookkeeping (``_grant``,
``_start_release``, ``_doom``, ``_fail_waiting``, ...): each keeps the
invariants of the package docstring for the entry it touches.
"""

from __future__ import annotations

import contextlib
import copy
import heapq
import itertools
import math
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from .._errors import (
    BrokerClosed,
    DeadlockError,
    InvalidArgument,
    OutOfSpace,
    ReleaseFailed,
    RequestTooLarge,
)
from .._policies import Policy, PolicyBase, PolicyEntry
from .._policies._priorities import Priorities
from .._units import format_bytes
from . import _aliases, _invariants, _moves, _reach
from ._aliases import canonical
from ._effects import CancelLoad, Effect, OwnerEmpty, Quarantined, Settled, StartLoad, StartRelease
from ._model import (
    FAIR_REQUESTS,
    REMEMBERED_SIZES,
    Entry,
    Owner,
    Reason,
    Space,
    State,
    Ticket,
    _naming,
    _shrink_if_empty,
)
from ._scheduler import refuse_self_waits, schedule
from ._seam import Seam

__all__ = ["Core"]

#: For the hit path: reading a member through its Enum class costs a lookup
#: through the metaclass (about 70 ns on Python 3.11).
_READY = State.READY


def _factory(policy: Policy) -> Callable[[], Policy]:
    """Make more of ``policy`` for other priorities: copies of it as it is now (unused)."""
    try:
        pristine = copy.deepcopy(policy)
    except Exception as exc:
        problem = exc

        def refuse() -> Policy:
            raise InvalidArgument(
                f"entries of several priorities need a policy per priority, and the policy "
                f"{type(policy).__name__} cannot be copied ({problem}); give the broker a "
                "policy name or a policy that copy.deepcopy can copy"
            ) from problem

        return refuse
    return lambda: copy.deepcopy(pristine)


def _slot_self_wait(entry: Entry, own: set[int], *, loading: bool = False) -> DeadlockError | None:
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


K = TypeVar("K")
V = TypeVar("V")


def _keep(table: dict[K, V], key: K, value: V) -> None:
    """Remember ``value`` for ``key`` in one of the books' per-key memories (sizes, load
    and promotion times): the newest last, at most ``REMEMBERED_SIZES``, the oldest
    forgotten first."""
    table.pop(key, None)
    if len(table) >= REMEMBERED_SIZES:
        del table[next(iter(table))]
    table[key] = value


def _hook(policy: Policy, name: str) -> Callable[[Entry], None] | None:
    """``policy.name``, or ``None`` when it is PolicyBase's no-op (so it is not called)."""
    method = getattr(policy, name, None)
    if method is None or getattr(type(policy), name, None) is getattr(PolicyBase, name):
        return None
    return method  # type: ignore[no-any-return]


#: What ``Policy.evicted`` looks like (an optional hook: ``_evicted_hook``).
_Evicted = Callable[[Sequence[PolicyEntry], Mapping[str, int]], None]


def _evicted_hook(policy: Policy) -> _Evicted | None:
    """``policy.evicted``, or ``None`` when it has none or PolicyBase's no-op.

    The hook is optional (``Policy`` does not list it): a policy written
    before it, or without a use for it, is told nothing.
    """
    method = getattr(policy, "evicted", None)
    if not callable(method) or getattr(type(policy), "evicted", None) is PolicyBase.evicted:
        return None
    return method  # type: ignore[no-any-return]


class Core:
    """The books of one broker. See the package docstring for the invariants."""

    # Slots: the books have too many attributes for CPython to share their
    # instance dicts' keys, and the hit path reads several. ``__dict__`` stays
    # for the test build, which wraps steps per instance (``_invariants``).
    __slots__ = (
        "__dict__",
        "_admit",
        "_busy",
        "_demoting",
        "_evicted",
        "_expiry",
        "_fair_at",
        "_gate",
        "_holding_waiters",
        "_largest",
        "_overdrawn",
        "_prefetching",
        "_remove",
        "_seq",
        "_settling",
        "_touch",
        "_unknown",
        "_unsized",
        "alias_evidence",
        "busy",
        "canon",
        "canon_names",
        "closed",
        "counts_loads",
        "demotions",
        "effects",
        "evictions",
        "fair_requests",
        "idle_count",
        "idle_ttl",
        "load_failures",
        "load_history",
        "load_seconds",
        "loads",
        "misses",
        "moves_failed",
        "oom_retries",
        "orphans",
        "overdue",
        "owners",
        "policy",
        "promote_history",
        "promotions",
        "quarantined",
        "queue",
        "releases_failed",
        "retain",
        "seam",
        "sizes",
        "spaces",
        "tick",
        "tier_names",
        "tiers",
    )

    def __init__(
        self,
        budget: Mapping[str, int],
        policy: Policy,
        *,
        idle_ttl: float | None = None,
        retain: bool | None = None,
        tiers: Mapping[str, str] | None = None,
    ) -> None:
        self.retain = any(amount > 0 for amount in budget.values()) if retain is None else retain
        self.spaces = {
            name: Space(name, amount, bounded=self.retain) for name, amount in budget.items()
        }
        #: Learned (or given) aliases: a space name -> the name it is merged into.
        self.canon: dict[str, str] = {}
        self.canon_names = list(self.spaces)
        self.alias_evidence: dict[frozenset[str], int] = {}
        #: Each space's lower tier: where its idle entries may be moved
        #: instead of released (``_moves``), when their owner can move them.
        self.tiers: dict[str, str] = dict(tiers or {})
        #: The tiers as given, by the names given (merges rewrite ``tiers``):
        #: the names an owner is told its values move down to (``_moves.owner_space``).
        self.tier_names: dict[str, str] = dict(self.tiers)
        #: Demotions decided and waiting for their room in the lower tier, in order.
        self._demoting: dict[Entry, None] = {}
        self.demotions = 0
        self.promotions = 0
        self.moves_failed = 0
        self.policy = policy
        #: Priorities: entries of one priority go to ``policy``; once several
        #: coexist, ``Priorities`` gives each its own policy, made by ``_make_policy``.
        self._make_policy = _factory(policy)
        self._priorities: Priorities | None = None
        self._priority: int | None = None  # the one priority seen, until Priorities
        # Hooks a policy leaves as no-ops are not called at all (LRU's hit path).
        self._touch = _hook(policy, "touch")
        self._busy = _hook(policy, "busy")
        self._admit = _hook(policy, "admit")
        self._remove = _hook(policy, "remove")
        self._evicted = _evicted_hook(policy)
        #: The request clock: one tick per acquire (hit, join or miss).
        self.tick = 0
        self.idle_ttl = idle_ttl
        self.owners: dict[str, Owner] = {}
        self.queue: dict[Entry, None] = {}
        #: Entries with a lease, and settling ones (below): deadlock detection
        #: looks here for the leases of a task.
        self.busy: dict[Entry, None] = {}
        #: Entries whose last lease ended since the books were last settled, in
        #: that order (a subset of ``busy``): they become idle (policy, idle
        #: bytes, expiry) in ``_settle``, so a hit and the release that follows
        #: it cost one dict step each.
        self._settling: dict[Entry, bool] = {}
        self.quarantined: dict[Entry, BaseException] = {}
        #: The quarantined entries whose release still runs past its timeout.
        self.overdue = _reach.Overdue()
        #: Loads abandoned by their closing cache while still running (a worker
        #: thread cannot be stopped): ``releasing`` until the load returns and
        #: what it made is released (``load_abandoned``).
        self.orphans: dict[Entry, None] = {}
        self.effects: list[Effect] = []
        self._overdrawn: set[str] = set()
        self._expiry: list[tuple[float, int, Entry]] = []
        self.idle_count = 0
        #: Idle entries of unknown size, oldest first (free-and-retry's last resort).
        self._unsized: dict[Entry, None] = {}
        self.oom_retries = 0
        self._seq = itertools.count(1)
        self.closed = False
        # Counters for stats().
        self.misses = 0
        self.loads = 0
        self.load_failures = 0
        self.load_seconds = 0.0
        self.evictions: dict[Reason, int] = dict.fromkeys(Reason, 0)
        self.releases_failed = 0
        #: The measured size of each (cache, key), remembered across evictions:
        #: what a load sized by measurement reserves next time.
        self.sizes: dict[tuple[str, Hashable], dict[str, int]] = {}
        #: Per cache, the largest size measured in each space: what a load of
        #: unknown size reserves.
        self._largest: dict[str, dict[str, int]] = {}
        #: For each (cache, key) loaded: how many loads finished, and the last
        #: one's seconds; remembered across evictions, like ``sizes``.
        self.load_history: dict[tuple[str, Hashable], tuple[int, float]] = {}
        #: For each (cache, key) moved back up a tier: the seconds the latest
        #: promotion took, remembered across evictions like ``load_history``.
        self.promote_history: dict[tuple[str, Hashable], float] = {}
        #: Set during a ``prefetch`` step: the request it makes is not counted.
        self._prefetching = False
        #: Loads of unknown size waiting for their turn, and the one whose turn it is.
        self._gate: dict[Entry, None] = {}
        self._unknown: Entry | None = None
        #: Queued entries with ``holding`` tickets: they may pass blocked spaces.
        self._holding_waiters = 0
        #: The request clock at which a blocked waiter becomes due for
        #: ``_scheduler.drain``.
        self._fair_at = math.inf
        #: Requests served after a waiter blocked by leased entries before they
        #: are drained for it (``_scheduler.drain``).
        self.fair_requests = FAIR_REQUESTS
        #: The other process's side of these books, if any (``_seam``): told of
        #: the changes it must know, and asked what only it knows.
        self.seam: Seam | None = None
        #: Whether finished loads are counted per key (``load_history``).
        self.counts_loads = True

    @property
    def hits(self) -> int:
        """Requests served without a load of their own: hits, and joins of a load in flight."""
        return self.tick - self.misses

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
                self._fail_joiners(entry, _naming(error, entry))
                if entry.state is State.WAITING:
                    self._drop_waiting(entry)
                else:
                    entry.doomed = Reason.CLOSE
                    self.effects.append(CancelLoad(entry))
            elif entry.state is State.READY:
                if entry.joiners:  # waiting for a lease slot
                    self._fail_joiners(entry, _naming(error, entry))
                self._doom(entry, Reason.CLOSE)
            elif entry.state in (State.MOVING, State.DEMOTED):
                if entry.joiners:  # waiting for a move, or a promotion's room
                    self._fail_joiners(entry, _naming(error, entry))
                    if entry in self.queue:
                        self._dequeue(entry)
                self._doom_parked(entry, Reason.CLOSE)
        if self.seam is not None:
            for entry in live:
                if entry.state is State.LOADING:
                    self.seam.withdrawn(entry)
        self._check_empty(owner)
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
            self._prepare_priority(priority)
            entry.priority = priority
            _reach.sync(entry)
            if self._priorities is not None:
                self._priorities.move(
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
                self._grant_slots(entry)  # (or refuses a waiter now waiting on itself)

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

    def _prepare_priority(self, priority: int) -> None:
        """Have a policy serve ``priority``: at the second priority seen, one per priority.

        Called before an entry takes ``priority``, so that a policy that
        cannot be copied for it raises before anything changed.
        """
        priorities = self._priorities
        if priorities is not None:
            priorities.ensure(priority)
            return
        if self._priority is None:
            self._priority = priority
        if priority == self._priority:
            return
        priorities = Priorities(self._make_policy, self.policy, self._priority)
        priorities.ensure(priority)
        # Every entry the policy knows has the one priority seen so far.
        for other in self.entries():
            if other.state in (State.READY, State.RELEASING, State.MOVING, State.DEMOTED):
                priorities.adopt(other, self._priority, idle=bool(other.idle_seq))
        self._priorities = self.policy = priorities
        self._touch, self._busy = priorities.touch, priorities.busy
        self._admit, self._remove = priorities.admit, priorities.remove
        self._evicted = priorities.evicted

    def _wait_for_slot(
        self, entry: Entry, task: object, loading: tuple[Entry, ...] = (), *, bound: bool = True
    ) -> Ticket:
        """Queue ``task`` for a lease slot of a ready entry whose slots are taken.

        Refused when only the asking task can free the slots: leases bound
        to itself, or, from inside a loader, to the tasks waiting for that
        load (which wait on it). See ``_slot_self_wait``.
        """
        own = {id(task)} | {id(t.task) for outer in loading for t in outer.joiners}
        error = _slot_self_wait(entry, own, loading=bool(loading))
        if error is not None:
            raise error
        self._count_request(entry)
        ticket = Ticket(entry, task)
        ticket.bound = bound
        entry.joiners.append(ticket)
        return ticket

    def _grant_slots(self, entry: Entry) -> None:
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
            error = _slot_self_wait(entry, {id(ticket.task)})
            if error is not None:
                joiners.remove(ticket)
                ticket.outcome = error
                granted += 1
        if granted:
            self.effects.append(Settled(entry))

    def unpin(self, owner: Owner, key: Hashable, now: float) -> bool:
        """Make ``key`` an ordinary entry again; returns whether it was pinned."""
        entry = owner.entries.get(key)
        if entry is None or not entry.pinned:
            return False
        entry.pinned = False
        if entry.state is State.READY and not entry.leases:
            self._rest(entry, now)
            schedule(self)
        if self.seam is not None:
            self.seam.changed(entry)
        return True

    def hit(self, entry: Entry, task: object, *, bound: bool = False) -> None:
        """Lease a ready entry to ``task``; ``bound``: as for ``request`` (the hit path
        of the shell leaves it out: such a lease never makes a slot wait hopeless)."""
        if entry.leases == 0:
            if entry.idle_seq:  # (a pinned entry never was a candidate)
                self._unidle(entry)
                self.busy[entry] = None
            elif not self._settling.pop(entry, False):  # (a settling one is still busy)
                self.busy[entry] = None
        entry.leases += 1
        entry.holders.append(task)
        if bound:
            entry.bound.append(task)
        # _count_request, inlined: this is the hit path.
        tick = self.tick = self.tick + 1
        entry.requests += 1
        entry.last_request = tick
        if self._touch is not None:
            self._touch(entry)
        seam = self.seam
        if seam is not None:
            seam.leased(entry)
            if seam.drains(entry):
                # Its leases kept overlapping: new requests load afresh (behind
                # the other side's waiter), and it goes when its last lease ends.
                self._doom(entry, Reason.CAPACITY)

    def _count_request(self, entry: Entry) -> None:
        if self._prefetching:
            return  # a prefetch is no request (see ``prefetch``)
        self.tick += 1
        entry.requests += 1
        entry.last_request = self.tick
        if self._touch is not None:
            self._touch(entry)

    def request(
        self,
        owner: Owner,
        key: Hashable,
        need: dict[str, int] | None,
        task: object,
        *,
        cost: float | None = None,
        loading: tuple[Entry, ...] = (),
        urgent: bool = False,
        held: tuple[Entry, ...] | None = None,
        slots: int | None = None,
        priority: int | None = None,
        places: tuple[str, ...] | None = None,
        bound: bool = True,
    ) -> Ticket:
        """Ask for ``key`` on behalf of ``task``; returns a ticket to wait on.

        A ready entry is leased at once (``ticket.outcome is True``) while it
        has a free lease slot and nobody waits for one; else the ticket waits
        for a slot, in arrival order, without asking for space. Otherwise the
        ticket joins the entry's load, creating the entry (and queueing it for
        space) when there is none to join. ``slots`` and ``priority`` override
        the entry's (the latest request's win; a new entry takes its owner's
        when they are ``None``).

        ``need`` is the declared size; ``None`` means "measured after the
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

        ``places``: the spaces a new entry may be loaded in, ``need`` being
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
                f"cache {owner.name!r} is closed: cannot acquire {owner.name}:{key!r}"
            )
        entry = owner.entries.get(key)
        if entry is not None and entry.state is State.RELEASING:
            entry = entry.successor
        if entry is not None and (slots is not None or priority is not None):
            self.limit(entry, slots=slots, priority=priority)
        kept = entry is not None and entry in self._demoting
        if kept:  # its demotion still waits for room: it stays where it is
            _moves.cancel_demotion(self, entry)  # type: ignore[arg-type]
        if entry is not None and entry.state is State.READY:
            if entry.slots is not None and (entry.joiners or entry.leases >= entry.slots):
                ticket = self._wait_for_slot(entry, task, loading, bound=bound)
            else:
                self.hit(entry, task, bound=bound)
                ticket = Ticket(entry, task)
                ticket.outcome = True
            if kept:  # the waiters it was demoted for look elsewhere
                schedule(self)
            return ticket
        if entry is None:
            unknown = need is None
            if need is None:
                remembered = self.sizes.get((owner.name, key))
                unknown = remembered is None
                need = {} if remembered is None else dict(remembered)
            asked = (*places, *need) if places is not None else tuple(need)
            if self.canon:
                need = canonical(self.canon, need)
            asked_places = None
            if places is not None:
                asked_places = tuple(dict.fromkeys(self.canon.get(n, n) for n in places))
                places, need = self._placeable(owner, key, asked_places, need, task, held)
            self._check_fit(owner, key, need)
            # (A placed request holds leases where any of its places lies.)
            spread = need if places is None else dict.fromkeys(places, sum(need.values()))
            mine = self._leased_by(task, spread, queued=bool(self.queue), held=held)
            self._check_deadlock(owner, key, need, mine)
            urgent = unknown and (urgent or bool(loading) or self._holds_any(task))
            entry = self._create(
                owner,
                key,
                need,
                unknown=unknown,
                urgent=urgent,
                slots=slots,
                priority=priority,
                places=places,
                asked=asked,
                asked_places=asked_places,
            )
            entry.declared_cost = cost
            self._count_request(entry)
        else:
            try:
                promote, need, placed, mine = self._check_join(
                    owner, key, entry, task, loading, held
                )
            except Exception:
                if kept:  # (refused: the demotion called off for it is decided anew)
                    self._rest(entry, entry.idle_since)
                    schedule(self)
                raise
            # A request that brings a value back up waits for it as for a load:
            # a miss (the first to join a move down counts it; later ones join).
            if (
                promote
                or (entry.state is State.MOVING and not entry.promoting and not entry.joiners)
            ) and not self._prefetching:
                self.misses += 1
            if promote:
                entry.places = placed
                _moves.queue_promotion(self, entry, need)
            self._count_request(entry)
        ticket = Ticket(entry, task, loading, held)
        ticket.bound = bound
        entry.joiners.append(ticket)
        if loading:
            for outer in loading:
                outer.nested = [t for t in outer.nested if t.outcome is None]
                outer.nested.append(ticket)
        if (entry.state is State.WAITING or entry in self.queue) and (
            mine or any(not outer.need.keys().isdisjoint(entry.need) for outer in loading)
        ):
            ticket.holds = True
            entry.holding += 1
            if entry.holding == 1 and not entry.gated:
                self._holding_waiters += 1
        schedule(self)
        return ticket

    def _check_join(
        self,
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
        self._check_cycle(owner, key, entry, loading)
        if entry.gated and (loading or self._holds_any(task)):
            self._hurry(entry)
        # A demoted entry is promoted back to where it was loaded, for its
        # first requester; later ones join (as do requesters of a move).
        # Placed, it may come back to any of the places its acquire asked
        # for that this request could wait in, but where it is parked.
        promote = entry.state is State.DEMOTED and entry not in self.queue
        need = entry.home if promote and entry.home is not None else entry.need
        placed = entry.places
        places = () if entry.asked_places is None else _moves.unparked(entry, entry.asked_places)
        if promote and places and len(need) == 1:
            placed, need = self._placeable(owner, key, places, need, task, held)
        if promote:
            self._check_fit(owner, key, need)
        waiting = promote or entry.state is State.WAITING or entry in self.queue
        taking = _moves.beyond(need, entry.charge)  # (a promotion keeps what stays put)
        # (A placed promotion, like a placed load, holds leases in any of its places.)
        spread = (
            taking if not promote or placed is None else dict.fromkeys(placed, sum(need.values()))
        )
        mine = (
            self._leased_by(task, spread, queued=len(self.queue) > (not promote), held=held)
            if waiting
            else []
        )
        self._check_deadlock(owner, key, taking, mine)
        return promote, need, placed, mine

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
        entry = self._create(owner, key, charge, priority=priority, asked=asked)
        self.misses -= 1  # (no request of these books: nothing was missed here)
        ticket = Ticket(entry, task)
        entry.joiners.append(ticket)
        self._grant(entry)
        for name in charge:
            if self.spaces[name].used > self.spaces[name].capacity:
                self._overdrawn.add(name)
        schedule(self)
        return ticket

    def leave(self, ticket: Ticket) -> None:
        """Withdraw a pending ticket (its task was cancelled or timed out).

        The last requester leaving a queued entry removes it; leaving a loading
        entry cancels its load. A ticket already granted is left as it is: its
        lease must be ended with ``lease_end``.
        """
        entry = ticket.entry
        if ticket.outcome is None:
            self._withdraw(ticket)
        if self.seam is not None and entry.state is State.LOADING and not entry.joiners:
            self.seam.withdrawn(entry)

    def _withdraw(self, ticket: Ticket) -> None:
        ticket.outcome = BrokerClosed("request withdrawn")
        entry = ticket.entry
        entry.joiners.remove(ticket)
        if ticket.holds:
            entry.holding -= 1
            if not entry.holding and entry in self.queue:
                self._holding_waiters -= 1
        if entry.joiners:
            return
        if entry.state is State.WAITING:
            self._drop_waiting(entry)
            self._check_empty(entry.owner)
            schedule(self)
        elif entry.state is State.DEMOTED:  # nobody waits for its promotion any more
            self._dequeue(entry)
            self._rest(entry, entry.idle_since)
            schedule(self)
        elif entry.state is State.LOADING:
            # A cancelled load gives up its key: a request arriving before the
            # load task notices must start afresh, not inherit the cancellation.
            self._detach(entry)
            self.effects.append(CancelLoad(entry))

    def prefetch(
        self,
        owner: Owner,
        key: Hashable,
        need: dict[str, int] | None,
        task: object,
        now: float,
        *,
        cost: float | None = None,
        idle_ttl: float | None = None,
        pin: bool = False,
        loading: tuple[Entry, ...] = (),
        priority: int | None = None,
        places: tuple[str, ...] | None = None,
    ) -> Ticket | None:
        """Have ``key`` loaded on behalf of ``task``, without counting a request.

        A ready entry is left loaded: ``None``; ``idle_ttl`` and ``pin``, if
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
        if not owner.closing:  # (a closing owner: ``request`` raises)
            entry = owner.entries.get(key)
            if entry is not None and entry.state is State.RELEASING:
                entry = entry.successor
            if entry is not None and entry in self._demoting:
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
        self._prefetching = True
        try:
            return self.request(
                owner,
                key,
                need,
                task,
                cost=cost,
                loading=loading,
                priority=priority,
                places=places,
            )
        finally:
            self._prefetching = False
            self.misses = misses  # (``_create`` counts a miss)

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
            self._unidle(entry)
        elif self._settling.pop(entry, False):
            del self.busy[entry]
        entry.pinned = entry.pinned or pin
        self._rest(entry, now)
        schedule(self)
        if self.seam is not None:
            self.seam.changed(entry)

    def _create(
        self,
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
        self._prepare_priority(priority)
        entry = Entry(owner, key, need)
        entry.priority = priority
        entry.places = places
        entry.asked = asked
        entry.asked_places = asked_places
        if self.promote_history:
            entry.promote_cost = self.promote_history.get((owner.name, key))
        if slots is not None:
            entry.slots = slots
        current = owner.entries.get(key)
        if current is not None and current.state is State.RELEASING:
            entry.after = current
            current.successor = entry
        else:
            owner.entries[key] = entry
        owner.live.add(entry)
        self.misses += 1
        if not unknown:
            self._enqueue(entry)
            return entry
        entry.unknown = True
        if urgent:
            self._enqueue(entry)
        elif self._unknown is None:
            self._unknown = entry
            self._pass_gate(entry)
        else:
            entry.gated = True
            self._gate[entry] = None
        return entry

    def _enqueue(self, entry: Entry) -> None:
        entry.queued_tick = self.tick
        self.queue[entry] = None
        self._admit_weightless(entry)

    def _admit_weightless(self, entry: Entry) -> None:
        """Grant an entry that weighs nothing as soon as no predecessor holds it back.

        It competes for no space, so it needs no place in the queue's order
        (and the scheduler may stop walking the queue before reaching it).
        """
        if (
            not entry.need
            and entry.after is None
            and entry.state is State.WAITING
            and not entry.gated
        ):
            self._grant(entry)

    # ------------------------------- refusal and deadlock detection, on asking

    def _check_fit(self, owner: Owner, key: Hashable, need: Mapping[str, int]) -> None:
        for name, amount in need.items():
            error = self._shortage(owner, key, name, amount)
            if error is not None:
                raise error

    def _shortage(
        self, owner: Owner, key: Hashable, name: str, amount: int, priority: int | None = None
    ) -> OutOfSpace | None:
        """The error for ``amount`` bytes in space ``name`` if they can never be granted
        (``priority``: the request's, for the reasons it gives; its cache's by default)."""
        space = self.spaces[name]
        if amount > space.limit:
            return RequestTooLarge(name, amount, space.limit, entry=f"{owner.name}:{key!r}")
        if amount > space.attainable:
            stranded = [e for e in self.quarantined if name in e.charge and e not in self.overdue]
            shown = [f"{e.owner.name}:{e.key!r}" for e in stranded][:5]
            others = _reach.obstacles(
                self, name, owner.priority if priority is None else priority, omit=("stranded",)
            )
            return OutOfSpace(
                f"{owner.name}:{key!r} needs {format_bytes(amount)} in space {name!r}, but "
                f"{format_bytes(space.stranded)} of its {format_bytes(space.limit)} are "
                f"held by quarantined entries ({', '.join(shown)}): their releases failed, "
                "so only broker.forget(cache, key) can return that memory"
                + (f" (besides, {'; '.join(others)})" if others else "")
            )
        return None

    def _placeable(
        self,
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
        names = list(dict.fromkeys(self.canon.get(name, name) for name in places))
        kept: list[str] = []
        first: BaseException | None = None
        for name in names:
            alternative = {name: amount}
            try:
                self._check_fit(owner, key, alternative)
                mine = self._leased_by(task, alternative, queued=bool(self.queue), held=held)
                self._check_deadlock(owner, key, alternative, mine)
            except (OutOfSpace, DeadlockError) as exc:
                first = first or exc
                continue
            kept.append(name)
        if not kept:
            assert first is not None
            raise first
        return (tuple(kept) if len(kept) > 1 else None), {kept[0]: amount}

    def _holds_any(self, task: object) -> bool:
        """Whether ``task`` holds a lease (on anything)."""
        return any(task in entry.holders for entry in self.busy)

    def _leased_by(
        self,
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
        if not need or not (self.busy or held):
            return []
        if not queued and all(self.spaces[s].fits(n) for s, n in need.items()):
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
            for entry in self.busy
            if task in entry.holders and not entry.charge.keys().isdisjoint(need)
        ]

    def _check_deadlock(
        self, owner: Owner, key: Hashable, need: Mapping[str, int], mine: list[Entry]
    ) -> None:
        if not mine or all(self.spaces[s].fits(n) for s, n in need.items()):
            return
        error = self._waits_on_itself(owner, key, need, mine, now=True)
        if error is not None:
            raise error

    def _waits_on_itself(
        self,
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
            space = self.spaces[name]
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
                others = _reach.obstacles(
                    self, name, owner.priority, pinned, omit=("stranded", "own")
                )
                return DeadlockError(
                    f"acquiring {owner.name}:{key!r} needs {format_bytes(amount)} in space "
                    f"{name!r}, which can only be freed by evicting entries leased by "
                    f"the requesting task itself: {', '.join(f'{c}:{k!r}' for c, k in shown)}"
                    f"{written_off}; release them first"
                    + (f" (besides, {'; '.join(others)})" if others else ""),
                    shown,
                )
        return None

    def _check_cycle(
        self, owner: Owner, key: Hashable, entry: Entry, loading: tuple[Entry, ...]
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

    # ----------------------------------------- loads of unknown size: the gate

    def _hurry(self, entry: Entry) -> None:
        """Take a load of unknown size out of the gate's line: load it now, reserving nothing.

        For a request from inside a loader or from a task holding a lease: the
        load whose turn it is may be waiting for that loader's reservation or
        that lease, so waiting for the gate could be a deadlock. Its
        measurement corrects the books (and evicts) as soon as it is loaded.
        """
        del self._gate[entry]
        _shrink_if_empty(self._gate)
        entry.gated = False
        self._enqueue(entry)

    def _pass_gate(self, entry: Entry) -> None:
        """Queue a load of unknown size, reserving the largest size its cache has measured."""
        entry.gated = False
        largest = self._largest.get(entry.owner.name)
        if largest:
            estimate = canonical(self.canon, largest) if self.canon else largest
            # An estimate is never a reason to refuse: keep it within reach.
            entry.need = {
                name: min(amount, self.spaces[name].attainable)
                for name, amount in estimate.items()
                if min(amount, self.spaces[name].attainable) > 0
            }
        if entry.holding:
            self._holding_waiters += 1
        self._enqueue(entry)

    def _open_gate(self, entry: Entry) -> bool:
        """``entry``'s load of unknown size is over: let the next one through, if any."""
        if entry is not self._unknown:
            return False
        self._unknown = None
        if not self._gate:
            return False
        following = next(iter(self._gate))
        del self._gate[following]
        _shrink_if_empty(self._gate)
        self._unknown = following
        self._pass_gate(following)
        return True

    def _remember_load(self, entry: Entry, seconds: float) -> None:
        """Count a finished load of ``entry``'s key, remembered across evictions."""
        if not self.counts_loads:
            return
        loads, _ = self.load_history.get((entry.cache, entry.key), (0, 0.0))
        _keep(self.load_history, (entry.cache, entry.key), (loads + 1, seconds))

    def policy_victims(self, shortfall: Mapping[str, int], up_to: int | None) -> list[PolicyEntry]:
        """The policy's victims for ``shortfall``, none of a priority above ``up_to``."""
        priorities = self._priorities
        if priorities is None:  # (every entry of one priority)
            return self.policy.victims(shortfall)
        return priorities.victims(shortfall, up_to)

    def policy_evicted(self, victims: Sequence[Entry], shortfall: Mapping[str, int]) -> None:
        """Tell the policy that ``victims``, its choice for ``shortfall``, are evicted.

        Only for a choice acted on: ``policy_victims`` is also asked to weigh
        options (placement, tiers), which must leave the policy as it was.
        """
        if self._evicted is not None and victims:
            self._evicted(victims, shortfall)

    def remember(self, cache: str, key: Hashable, charge: Mapping[str, int]) -> None:
        """Remember the measured size of ``key`` in ``cache`` (space names as given)."""
        _keep(self.sizes, (cache, key), dict(charge))
        largest = self._largest.setdefault(cache, {})
        for name, amount in charge.items():
            if amount > largest.get(name, 0):
                largest[name] = amount

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
        self._remember_load(entry, seconds)
        recharged = False
        if measured is not None:
            self.remember(entry.owner.name, entry.key, measured)
            if not measured.keys() <= set(entry.asked):  # (a size unknown until measured)
                entry.asked = (*entry.asked, *(n for n in measured if n not in entry.asked))
            if measured != entry.charge:
                self._recharge(entry, measured)
                recharged = True
        if self._open_gate(entry):
            recharged = True  # A load of unknown size was let through: schedule it.
        if self._admit is not None:
            self._admit(entry)  # with its measured charge: policies index entries by space
        rejected = error if error is not None else self._oversize(entry)
        owner = entry.owner
        if entry.doomed is None and owner.entries.get(entry.key) is not entry:
            # Its requesters all left, yet it finished (a thread cannot be
            # stopped): keep it if its key is free, else it is superfluous.
            if entry.key in owner.entries:
                entry.doomed = Reason.ABANDONED
            else:
                owner.entries[entry.key] = entry
        _reach.sync(entry)
        if self.seam is not None:
            self.seam.loaded(entry)
        if rejected is not None:
            self._fail_joiners(entry, rejected)
        self._lease_joiners(entry)
        if rejected is not None:
            self._start_release(entry, Reason.REJECTED)
        elif entry.leases:
            self.busy[entry] = None
            if not recharged:
                return  # Nothing the queue waits on changed: scheduling would do nothing.
        else:
            self._rest(entry, now)
        schedule(self)

    def _lease_joiners(self, entry: Entry) -> None:
        """A ready entry's requesters get leases, up to its slots; the rest wait for one."""
        granted = entry.joiners if entry.slots is None else entry.joiners[: entry.slots]
        for ticket in granted:
            ticket.outcome = True
            entry.holders.append(ticket.task)
            if ticket.bound:
                entry.bound.append(ticket.task)
        entry.leases = len(granted)
        entry.joiners = entry.joiners[len(granted) :]
        self.effects.append(Settled(entry))

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
        if entry.state is not State.MOVING or entry in self._demoting:
            return False
        going = _moves.freed(entry)
        planned = entry.target or {}
        stayed = False
        for name, amount in going.items():
            space = self.spaces[name]
            space.used -= amount
            space.releasing -= amount
        if self._remove is not None:
            self._remove(entry)  # (indexed by the charge it leaves)
        before = entry.charge
        assert entry.target is not None
        self._set_charge(entry, entry.target)
        entry.target = None
        entry.value = value
        if measured is not None:
            if self.canon:
                measured = canonical(self.canon, measured)
            if measured != entry.charge:
                self._recharge(entry, measured)
        if entry.promoting:
            entry.promoting = False
            entry.home = None
            entry.promote_cost = seconds
            _keep(self.promote_history, (entry.cache, entry.key), seconds)
            entry.cost = entry.reload
            entry.state = State.READY
            self.promotions += 1
        else:
            home = before if entry.home is None else entry.home
            if _moves.left_home(home, entry.charge):
                entry.home = home
                _moves.part(entry)
                entry.cost = _moves.parked_cost(entry)
                entry.state = State.DEMOTED
                self.demotions += 1
            else:  # (home: a move within one memory, or measured where it was)
                entry.home = None
                entry.cost = entry.reload
                entry.state = State.READY
            if stayed := _moves.stayed(going, planned, entry.charge):
                entry.doomed = entry.doomed or Reason.CAPACITY
                if entry.joiners:  # (they get it; new requests load afresh)
                    self._detach(entry)
            # (idle since its last lease ended, not since it moved)
            now = entry.idle_since
        if self._admit is not None:
            self._admit(entry)
        if entry.state is State.READY:
            self._lease_joiners(entry)
            if entry.leases:
                self.busy[entry] = None
            else:
                self._rest(entry, now)
        elif entry.joiners:
            _moves.queue_promotion(self, entry, entry.home)
        else:
            self._rest(entry, now)
        _reach.sync(entry)
        schedule(self)
        return stayed

    def move_failed(self, entry: Entry, error: BaseException) -> None:
        """The move raised or timed out: quarantined, charged where it was and where it went.

        Nobody knows which of the two holds the value now, so both charges
        stay until ``forget``; its requesters get ``error``.
        """
        if entry.state is not State.MOVING or entry in self._demoting:
            return
        for name, amount in _moves.freed(entry).items():
            self.spaces[name].releasing -= amount
        target = entry.target or {}
        both = {
            name: max(entry.charge.get(name, 0), target.get(name, 0))
            for name in (*entry.charge, *target)
        }
        if entry.joiners:
            self._fail_joiners(entry, _naming(error, entry))
        self.moves_failed += 1
        self._hand_over(entry)
        self._gone(entry)  # (leaves the policy by the charge it was indexed by)
        entry.target = None
        entry.promoting = False
        self._set_charge(entry, both)
        self._quarantine(entry, error)
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
            self._fail_joiners(entry, BrokerClosed(closed))
        self._detach(entry)
        entry.state = State.RELEASING
        for name, amount in entry.charge.items():
            self.spaces[name].releasing += amount
        self.evictions[Reason.CLOSE] += 1
        owner.live.discard(entry)
        _shrink_if_empty(owner.live)
        self.orphans[entry] = None
        entry.nested = []
        self._open_gate(entry)
        self._check_empty(owner)
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
        self._fail_joiners(entry, error)
        self._discharge(entry)
        self._detach(entry)
        self._gone(entry)
        self._open_gate(entry)
        schedule(self)

    def _set_charge(self, entry: Entry, charge: dict[str, int]) -> None:
        entry.charge = charge
        entry.weights = tuple((self.spaces[name], amount) for name, amount in charge.items())
        if entry.kept is not None or entry.state is State.READY:
            _reach.sync(entry)

    def _recharge(self, entry: Entry, measured: dict[str, int]) -> None:
        if self.canon:
            measured = canonical(self.canon, measured)
        for name, amount in entry.charge.items():
            self.spaces[name].used -= amount
        self._set_charge(entry, measured)
        for name, amount in measured.items():
            space = self.spaces[name]
            space.used += amount
            if space.used > space.capacity:
                self._overdrawn.add(name)

    def _oversize(self, entry: Entry) -> OutOfSpace | None:
        for name, amount in entry.charge.items():
            error = self._shortage(entry.owner, entry.key, name, amount)
            if error is not None:
                return error
        return None

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
            self._overdrawn.add(name)
        schedule(self)

    # ------------------------------------------------------------------ leases

    @staticmethod
    def _unbind(entry: Entry, task: object) -> None:
        """Keep ``entry.bound`` within its holders once a lease of ``task`` ended.

        When ``task`` held both a bound and an unbound lease, the books cannot
        tell which one ended: the bound one is forgotten, so that the other
        can only be taken for one that may travel (a wait on it is never
        called hopeless), never the other way round.
        """
        with contextlib.suppress(ValueError):
            entry.bound.remove(task)

    def lease_end(self, entry: Entry, task: object, now: float) -> None:
        """End one lease of ``task`` on ``entry``; a request waiting for a slot takes it."""
        entry.leases -= 1
        holders = entry.holders
        try:
            holders.remove(task)
        except ValueError:  # The lease was handed to another task: forget one of the holders.
            task = holders.pop()
        if entry.bound:
            self._unbind(entry, task)
        if entry.joiners and entry.state is _READY:
            self._grant_slots(entry)
        if entry.leases == 0:
            if entry.state is not _READY:
                # Its cache closed while it was leased: quarantined (or written
                # off since). Nobody can release it; let the value go.
                entry.value = None
            elif (
                self.queue
                or self._overdrawn
                or entry.doomed
                or entry.pinned
                or entry.ttl == 0
                or not self.retain
            ):
                del self.busy[entry]
                self._rest(entry, now)
                schedule(self)
            else:  # Nobody waits: let it become idle when the books are next read.
                entry.idle_since = now
                self._settling[entry] = True
            if self.seam is not None:
                self.seam.ended(entry)
        elif self.tick >= self._fair_at:  # Still leased, but a waiter has waited long enough.
            schedule(self)

    def _settle(self) -> None:
        """Make the entries whose last lease ended idle, in the order their leases ended."""
        settling = self._settling
        if settling:
            self._settling = {}
            busy = self.busy
            for entry in settling:
                del busy[entry]
                self._rest(entry, entry.idle_since)

    def _rest(self, entry: Entry, now: float) -> None:
        """An entry with no lease: keep it as an eviction candidate, or release it."""
        if entry.doomed is not None:
            self._start_release(entry, entry.doomed)
            return
        if entry.owner.closing or not self.retain:
            self._start_release(entry, Reason.CLOSE if self.retain else Reason.UNRETAINED)
            return
        entry.idle_since = now
        if entry.pinned:
            return  # Resident regardless of policy and idle time.
        ttl = self.idle_ttl if entry.ttl is None else entry.ttl
        if ttl == 0:
            self._start_release(entry, Reason.IDLE)
            return
        entry.idle_seq = next(self._seq)
        weights = entry.weights
        if weights:
            for space, amount in weights:
                space.idle_bytes += amount
        else:
            self._unsized[entry] = None
        self.policy.idle(entry)
        self.idle_count += 1
        if ttl is not None and ttl != math.inf:
            heap = self._expiry
            heapq.heappush(heap, (now + ttl, entry.idle_seq, entry))
            if len(heap) > 2 * self.idle_count + 64:
                # Leased-again and released entries leave stale items behind
                # (lazy deletion); drop them before they outnumber the live ones.
                heap[:] = [item for item in heap if item[2].idle_seq == item[1]]
                heapq.heapify(heap)

    def _unidle(self, entry: Entry) -> None:
        weights = entry.weights
        if weights:
            for space, amount in weights:
                space.idle_bytes -= amount
        else:
            self._unsized.pop(entry, None)
        if self._busy is not None:
            self._busy(entry)
        entry.idle_seq = 0
        self.idle_count -= 1
        if not self.idle_count and self._expiry:
            self._expiry.clear()  # every item is stale: let their entries go

    # ---------------------------------------------------------------- releases

    def _leave_idle(self, entry: Entry) -> None:
        """Stop ``entry`` being an eviction candidate (or about to become one)."""
        if entry.idle_seq:
            self._unidle(entry)
        elif self._settling.pop(entry, False):
            del self.busy[entry]

    def _start_release(self, entry: Entry, reason: Reason) -> None:
        self._leave_idle(entry)
        entry.state = State.RELEASING
        _reach.sync(entry)
        for name, amount in entry.charge.items():
            self.spaces[name].releasing += amount
        self.evictions[reason] += 1
        self.effects.append(StartRelease(entry, reason))
        if self.seam is not None:
            self.seam.releasing(entry, reason)

    def free_for_retry(self, entry: Entry) -> list[Entry]:
        """A load ran out of memory: start releasing the next victim; return it.

        The next idle victim in policy order in the load's spaces; failing
        that, in any other space; failing that, the oldest idle entry of
        unknown size. Returns ``[]`` when nothing is left to free.
        """
        self._settle()
        own = list(entry.charge)
        others = [name for name in self.canon_names if name not in own]
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
        if not victims and self._unsized:
            victims = [next(iter(self._unsized))]
        for victim in victims:
            self._start_release(victim, Reason.RETRY)
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
            self._discharge(entry)
            self._unorphan(entry)
        elif entry.state is State.QUARANTINED:
            self._unquarantine(entry)
        else:
            return
        self._hand_over(entry)
        self._gone(entry)
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
                self._strand()
                if self.seam is not None:
                    self.seam.changed(entry)
            return
        self._release_missed(entry, error)

    def release_overdue(self, entry: Entry, error: BaseException) -> None:
        """The release did not return within its timeout, and still runs: quarantined.

        As ``release_failed`` (the entry leaves its key, its bytes stay
        charged, it is counted as a failed release and ``forget`` writes it
        off), except that its bytes may come back: requests may wait for them
        (``_reach.Overdue``), within their own timeout. The release's end is
        reported as usual: ``release_done`` frees the bytes, ``release_failed``
        strands them.
        """
        if entry.state is not State.RELEASING:
            return
        self._release_missed(entry, error, overdue=True)

    def _release_missed(self, entry: Entry, error: BaseException, *, overdue: bool = False) -> None:
        """A releasing entry's release raised or passed its timeout: it is quarantined."""
        for name, amount in entry.charge.items():
            self.spaces[name].releasing -= amount
        self._unorphan(entry)
        self.releases_failed += 1
        self._hand_over(entry)
        self._gone(entry)
        if overdue:
            self.overdue.add(entry)  # (first: its bytes are no stranded room)
        self._quarantine(entry, error)
        schedule(self)

    def _strand(self) -> None:
        """An overdue release ended without freeing its bytes: refuse who waited for them."""
        if self._holding_waiters:
            refuse_self_waits(self)
        schedule(self)  # (refuses the waiters only forget() can serve now)

    def _quarantine(self, entry: Entry, error: BaseException) -> None:
        """Keep a gone entry's bytes charged: nobody knows whether its memory came back."""
        entry.error = error
        entry.state = State.QUARANTINED
        self.quarantined[entry] = error
        for space, amount in entry.weights:
            space.quarantined += amount
        self.effects.append(Quarantined(entry))
        if self._holding_waiters:  # less room for good: a holder may now wait on itself
            refuse_self_waits(self)
        if self.seam is not None:
            self.seam.quarantined(entry)

    def _unquarantine(self, entry: Entry) -> None:
        self.overdue.end(entry)
        del self.quarantined[entry]
        _shrink_if_empty(self.quarantined)
        for space, amount in entry.weights:
            space.quarantined -= amount
        self._discharge(entry)

    def abandon(self, owner: Owner) -> list[Entry]:
        """The owner's block ended with entries still leased: quarantine them; return them.

        Nobody is left to release them, so their bytes stay charged until
        ``forget``; their holders keep the values until their leases end.
        """
        abandoned = [entry for entry in owner.live if entry.leases]
        for entry in abandoned:
            del self.busy[entry]
            self._detach(entry)
            self._gone(entry)
            self._quarantine(
                entry,
                ReleaseFailed(
                    f"cache {owner.name!r} was closed while {owner.name}:{entry.key!r} was "
                    "still leased: nobody is left to release it"
                ),
            )
        if abandoned:
            schedule(self)
        return abandoned

    def _unorphan(self, entry: Entry) -> None:
        if entry in self.orphans:
            del self.orphans[entry]
            _shrink_if_empty(self.orphans)

    def forget(self, entry: Entry) -> None:
        """Write off a quarantined entry: the operator says its memory is free."""
        if entry.state is State.QUARANTINED:
            self._unquarantine(entry)
            entry.state = State.GONE
            schedule(self)
        if self.seam is not None:
            self.seam.changed(entry)

    def _hand_over(self, entry: Entry) -> None:
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
                self._admit_weightless(successor)
        entry.successor = None

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
            self._detach(entry)
            entry.doomed = Reason.INVALIDATE
        elif entry.state is State.READY:
            self._doom(entry, Reason.INVALIDATE)
        else:
            self._doom_parked(entry, Reason.INVALIDATE)
        schedule(self)
        return True

    def sweep(self, now: float) -> list[Entry]:
        """Release every entry idle for at least the idle TTL; return them."""
        self._settle()
        expired: list[Entry] = []
        heap = self._expiry
        while heap and heap[0][0] <= now:
            _, seq, entry = heapq.heappop(heap)
            if entry.idle_seq == seq and entry.state in (State.READY, State.DEMOTED):
                self._start_release(entry, Reason.IDLE)
                expired.append(entry)
        if expired:
            schedule(self)
        return expired

    def next_expiry(self) -> float | None:
        """When the next idle entry expires, or ``None`` when none can."""
        self._settle()
        heap = self._expiry
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
                    self._doom(entry, Reason.CLEAR)
                    count += 1
                elif entry.state in (State.MOVING, State.DEMOTED) and entry.doomed is None:
                    self._doom_parked(entry, Reason.CLEAR)
                    count += 1
        schedule(self)
        return count

    def _doom_parked(self, entry: Entry, reason: Reason) -> None:
        """Release a moving or demoted entry for ``reason``: now, or once its move ends.

        An idle demoted one (or one whose demotion still waits for room) goes
        now; one moving, or waited for, gives its key up and goes when its
        move (and the leases its requesters get) end.
        """
        if entry in self._demoting:
            _moves.give_up(self, entry, reason)
        elif entry.state is State.DEMOTED and entry not in self.queue:
            self._start_release(entry, reason)
        else:
            self._detach(entry)
            entry.doomed = reason

    def _drain(self, entry: Entry) -> None:
        """Leased ``entry``'s bytes are due to a waiter that waited long (``_scheduler.drain``).

        Drained here, unless the other side of the books sees its leases and
        was told instead (``Seam.wanted``).
        """
        if self.seam is None or not self.seam.wanted(entry):
            self._doom(entry, Reason.CAPACITY)

    def _doom(self, entry: Entry, reason: Reason) -> None:
        """Release ``entry`` now, or, while leased, when its last lease ends.

        An idle entry keeps its key's slot while releasing, so a new acquire
        waits for the release before loading afresh. A leased one gives the
        slot up at once: new acquires must not wait on other tasks' leases.
        """
        if entry.leases:
            self._detach(entry)
            entry.doomed = reason
            _reach.sync(entry)
        else:
            self._start_release(entry, reason)

    # ------------------------------------------------- owners in other processes

    def give_up(self, entry: Entry) -> bool:
        """Books above these ones (a shared broker) picked ``entry`` as a victim.

        An idle entry's release starts now. Returns ``False`` when the entry
        is leased or pinned, so the release is refused; ``True`` when its
        release started or is already under way (or over).
        """
        self._settle()
        if entry.state is State.READY:
            if entry.leases or entry.pinned:
                seam = self.seam
                if seam is not None and seam.lets_go(entry) and not entry.pinned:
                    # Offered idle, leased again before the release asked for
                    # then arrived: it goes when its last lease ends.
                    self.let_go(entry, Reason.CAPACITY)
                return False
            self._start_release(entry, Reason.CAPACITY)
            schedule(self)
        return entry.state is not State.LOADING

    def release_refused(self, entry: Entry, holder: object) -> None:
        """The owner refused the release: it had leased ``entry`` again meanwhile.

        For books whose owners live in other processes, where a lease taken
        there reaches these books only after the release was asked for. The
        entry is ready again, leased by ``holder``; the requests its bytes
        were meant for look for other room.
        """
        if entry.state is not State.RELEASING:
            if self.overdue.end(entry):  # refused after its timeout: it stays quarantined
                self._strand()
            return
        for name, amount in entry.charge.items():
            self.spaces[name].releasing -= amount
        entry.state = State.READY
        entry.leases += 1
        entry.holders.append(holder)
        self.busy[entry] = None
        _reach.sync(entry)
        schedule(self)

    def let_go(self, entry: Entry, reason: Reason) -> None:
        """The owner releases ``entry`` on its own (from another process).

        Now, or when its last lease ends.
        """
        if entry.state is State.READY and entry.doomed is None:
            self._doom(entry, reason)
            schedule(self)

    def drop_owner(self, owner: Owner) -> None:
        """``owner``'s process is gone, and its memory with it: its entries leave the books at once.

        Waiting and loading requests for its keys fail with ``BrokerClosed``;
        its ready, releasing and quarantined entries' bytes come back now. The
        shell's tasks still running for them find them gone (``load_done``,
        ``load_failed``, ``release_done`` and ``release_failed`` ignore them).
        """
        owner.closing = True
        gone = BrokerClosed(f"cache {owner.name!r} is gone: the process that opened it ended")
        mine = [
            *owner.live,
            *(entry for entry in self.orphans if entry.owner is owner),
            *(entry for entry in self.quarantined if entry.owner is owner),
        ]
        for entry in mine:
            state = entry.state
            if state is State.WAITING:
                self._fail_joiners(entry, gone)
                self._drop_waiting(entry)
                continue
            if state is State.QUARANTINED:  # (gone from its key and owner already)
                self._unquarantine(entry)
                entry.state = State.GONE
                continue
            if state is State.LOADING:
                self._fail_joiners(entry, gone)
                entry.nested = []
                self._open_gate(entry)
            elif state is State.READY:
                if entry.idle_seq:
                    self._unidle(entry)
                self._settling.pop(entry, None)
                self.busy.pop(entry, None)
                entry.leases = 0
                entry.holders = []
                entry.bound = []
            elif state is State.RELEASING:
                for name, amount in entry.charge.items():
                    self.spaces[name].releasing -= amount
                self._unorphan(entry)
            elif state is State.DEMOTED:
                self._fail_joiners(entry, gone)
                if entry in self.queue:
                    self._dequeue(entry)
                self._leave_idle(entry)
            elif state is State.MOVING:
                self._fail_joiners(entry, gone)
                for name, amount in _moves.freed(entry).items():
                    self.spaces[name].releasing -= amount
                if entry in self._demoting:
                    del self._demoting[entry]
                else:
                    for name, amount in _moves.reserved(entry).items():
                        self.spaces[name].used -= amount
                entry.target = None
            entry.value = None
            self._discharge(entry)
            self._detach(entry)
            self._gone(entry)
        self._check_empty(owner)
        schedule(self)

    # ----------------------------------------------------------------- aliases

    def note_alias_evidence(
        self, freed: Iterable[str], loaded: Iterable[str], threshold: int
    ) -> _aliases.Learned:
        """A load in ``loaded`` spaces fit only after freeing in ``freed`` spaces (``_aliases``)."""
        return _aliases.note_alias_evidence(self, freed, loaded, threshold)

    def merge_spaces(self, keep: str, other: str) -> None:
        """Treat spaces ``keep`` and ``other`` as one memory from now on (``_aliases``);
        ``InvalidArgument`` if that would make the tiers a circle."""
        _aliases.merge_spaces(self, keep, other)

    def owner_space(self, entry: Entry, space: str) -> str:
        """``space`` by the name ``entry``'s owner gave it (``_moves.owner_space``)."""
        return _moves.owner_space(self, entry, space)

    def aliases(self) -> list[tuple[str, ...]]:
        """The groups of space names known to be one memory (each group sorted)."""
        return _aliases.aliases(self.canon)

    # ----------------------------------------------------- grants and removals

    def _grant(self, entry: Entry) -> None:
        """Reserve a queued entry's bytes and start its load."""
        del self.queue[entry]
        _shrink_if_empty(self.queue)
        if entry.holding:
            self._holding_waiters -= 1
        if entry.state is State.DEMOTED:
            _moves.start_promotion(self, entry)
            return
        entry.state = State.LOADING
        self._set_charge(entry, entry.need)
        for name, amount in entry.need.items():
            self.spaces[name].used += amount
        self.effects.append(StartLoad(entry))

    def _fail_joiners(self, entry: Entry, error: BaseException) -> None:
        for ticket in entry.joiners:
            ticket.outcome = error
        entry.joiners = []
        self.effects.append(Settled(entry))

    def _fail_waiting(self, entry: Entry, error: BaseException) -> None:
        """Fail every requester of a waiting entry with ``error`` and drop the entry.

        A demoted entry waiting for its promotion's room stays demoted.
        """
        self._fail_joiners(entry, error)
        if entry.state is State.DEMOTED:
            self._dequeue(entry)
            self._rest(entry, entry.idle_since)
            return
        self._drop_waiting(entry)
        self._check_empty(entry.owner)

    def _dequeue(self, entry: Entry) -> None:
        """Take a demoted entry's promotion out of the queue (its requesters are gone)."""
        del self.queue[entry]
        _shrink_if_empty(self.queue)
        if entry.holding:
            self._holding_waiters -= 1
            entry.holding = 0

    def _drop_waiting(self, entry: Entry) -> None:
        if entry.gated:
            del self._gate[entry]
            _shrink_if_empty(self._gate)
        else:
            del self.queue[entry]
            _shrink_if_empty(self.queue)
            if entry.holding:
                self._holding_waiters -= 1
        self._open_gate(entry)
        if entry.after is not None:
            entry.after.successor = None
            entry.after = None
        else:
            self._detach(entry)
        self._gone(entry)

    def _detach(self, entry: Entry) -> None:
        owner = entry.owner
        if owner.entries.get(entry.key) is entry:
            del owner.entries[entry.key]
            _shrink_if_empty(owner.entries)

    def _discharge(self, entry: Entry) -> None:
        for name, amount in entry.charge.items():
            self.spaces[name].used -= amount

    def _gone(self, entry: Entry) -> None:
        if self._remove is not None and entry.state is not State.WAITING:
            self._remove(entry)
        entry.state = State.GONE
        if entry.kept is not None:
            _reach.sync(entry)
        owner = entry.owner
        owner.live.discard(entry)
        _shrink_if_empty(owner.live)
        self._check_empty(owner)
        if self.seam is not None:
            self.seam.gone(entry)

    def _check_empty(self, owner: Owner) -> None:
        if owner.closing and not owner.live:
            self.effects.append(OwnerEmpty(owner))

    # ------------------------------------------------------------------- views

    def entries(self) -> Iterable[Entry]:
        """Every entry known to the books, abandoned loads and quarantined ones included."""
        for owner in self.owners.values():
            yield from owner.live
        yield from self.orphans
        yield from self.quarantined

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
