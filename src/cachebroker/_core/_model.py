"""The data of the books: spaces, owners, entries, tickets, and what sizes them.

Plain slotted records with no behaviour beyond a few derived views; what
changes them is ``Core`` (``_books``) and the scheduler (``_scheduler``).
"""

from __future__ import annotations

import copy
import enum
from collections.abc import Callable, Hashable
from typing import Any

__all__ = [
    "FAIR_REQUESTS",
    "REMEMBERED_SIZES",
    "UNBOUNDED",
    "Entry",
    "Owner",
    "Reason",
    "Request",
    "Space",
    "State",
    "Ticket",
    "sync",
]


#: The capacity of a space when retention is off: more bytes than any machine has.
UNBOUNDED = 1 << 80

#: How many requests (hits included) may be served after a request queued for
#: space before the leased entries it needs stop taking new leases
#: (``_scheduler.drain``).
FAIR_REQUESTS = 256

#: How many measured sizes the books remember (the oldest are forgotten first).
REMEMBERED_SIZES = 100_000


class State(enum.Enum):
    """Life cycle of an entry. ``waiting`` is the part of loading spent queued for space."""

    WAITING = "waiting"
    LOADING = "loading"
    READY = "ready"
    #: Between spaces (``Core.tiers``): a demotion decided (waiting for room in
    #: the lower tier, or under way) or a promotion under way.
    MOVING = "moving"
    #: Loaded, parked in a lower tier: an eviction candidate there; a request
    #: queues its promotion back (``Entry.home``).
    DEMOTED = "demoted"
    RELEASING = "releasing"
    QUARANTINED = "quarantined"
    GONE = "gone"


class Reason(enum.Enum):
    """Why the broker asked an owner to release an entry."""

    CAPACITY = "capacity"
    IDLE = "idle"
    INVALIDATE = "invalidate"
    CLEAR = "clear"
    CLOSE = "close"
    UNRETAINED = "unretained"
    REJECTED = "rejected"
    RETRY = "retry"
    ABANDONED = "abandoned"


class Space:
    """One memory budget and its books."""

    __slots__ = (
        "budget",
        "capacity",
        "idle_bytes",
        "limit",
        "name",
        "overdue",
        "pinned",
        "quarantined",
        "ranked",
        "releasing",
        "used",
    )

    def __init__(self, name: str, budget: int, *, bounded: bool) -> None:
        self.name = name
        self.budget = budget
        # Unbounded (retention off) spaces admit everything; their books still add up.
        self.capacity = budget if bounded else UNBOUNDED
        #: The most this space can ever hold: sizes above it fail fast.
        self.limit = self.capacity
        self.used = 0
        self.releasing = 0
        self.idle_bytes = 0
        #: The part of ``used`` held by quarantined entries.
        self.quarantined = 0
        #: The part of ``quarantined`` whose release still runs past its
        #: timeout: a late return frees it (``_overdue.Overdue``).
        self.overdue = 0
        #: What no eviction returns, by the entries holding it (``_model.sync``):
        #: the bytes of ready pinned entries, and of the other ready entries
        #: per priority (a request evicts none above its own). Doomed entries
        #: (released when their last lease ends) are in neither.
        self.pinned = 0
        self.ranked: dict[int, int] = {}

    def absorb(self, other: Space) -> None:
        """Take ``other``'s books: the two are one memory now (``_aliases.merge_spaces``).

        The budget is the larger; the byte counts add up, except ``pinned`` and
        ``ranked``, which move with each entry's charge (``sync``).
        """
        assert not other.pinned and not other.ranked, (other.pinned, other.ranked)
        self.budget = max(self.budget, other.budget)
        self.capacity = max(self.capacity, other.capacity)
        self.limit = max(self.limit, other.limit)
        self.used += other.used
        self.releasing += other.releasing
        self.idle_bytes += other.idle_bytes
        self.quarantined += other.quarantined
        self.overdue += other.overdue

    def fits(self, amount: int) -> bool:
        return self.used + amount <= self.capacity

    @property
    def stranded(self) -> int:
        """Quarantined bytes that only ``forget()`` returns (their release raised or
        was given up): a request above ``limit - stranded`` fails fast."""
        return self.quarantined - self.overdue

    @property
    def attainable(self) -> int:
        """The most a request may need here without waiting on ``forget()``."""
        return self.limit - self.quarantined + self.overdue


class Owner:
    """A cache: one releaser's namespace of keys."""

    __slots__ = ("closing", "entries", "live", "moves", "name", "priority", "slots", "ttl")

    def __init__(self, name: str) -> None:
        self.name = name
        #: The current entry of each key (what an acquire of that key finds).
        self.entries: dict[Hashable, Entry] = {}
        #: Every entry of this owner not yet gone or quarantined.
        self.live: set[Entry] = set()
        self.closing = False
        #: Defaults for this owner's new entries (``broker.cache(...)``): lease
        #: slots (``None``: unlimited), eviction priority, idle TTL (``None``:
        #: the broker's).
        self.slots: int | None = None
        self.priority = 0
        self.ttl: float | None = None
        #: Whether its releaser can move a value between spaces (``Core.tiers``).
        self.moves = False


class Request:
    """One acquire or prefetch, as ``Cache`` checked and parsed it.

    Built once, in ``Cache`` (``_acquire_slow``, ``prefetch``), or from a
    process's message on the daemon's side (``_remote.wire.decode_request``),
    and passed whole through the actor, the runner and the books; the
    connected process sends it to the daemon (``wire.encode_request``). What
    is not the request's own, but the circumstances of the call (the task,
    the loads it runs in, what it leases elsewhere), is passed beside it.

    ``need`` is the declared size per space (``None``: measured after the
    load); with ``places`` it is the size in the first of them. ``load`` and
    ``measure`` are the shell's: the books never call them. ``slots`` and
    ``priority`` are ``acquire``'s ``concurrency`` and ``priority``;
    ``idle_ttl`` and ``pin`` apply once the value is loaded.
    """

    __slots__ = (
        "cost",
        "idle_ttl",
        "key",
        "load",
        "measure",
        "need",
        "pin",
        "places",
        "priority",
        "slots",
        "timeout",
    )

    def __init__(
        self,
        key: Hashable,
        need: dict[str, int] | None = None,
        *,
        load: Callable[..., Any] | None = None,
        measure: Callable[[Any], Any] | None = None,
        cost: float | None = None,
        timeout: float | None = None,
        idle_ttl: float | None = None,
        pin: bool = False,
        slots: int | None = None,
        priority: int | None = None,
        places: tuple[str, ...] | None = None,
    ) -> None:
        self.key = key
        self.need = need
        self.load = load
        self.measure = measure
        self.cost = cost
        self.timeout = timeout
        self.idle_ttl = idle_ttl
        self.pin = pin
        self.slots = slots
        self.priority = priority
        self.places = places

    def __repr__(self) -> str:
        given = ", ".join(
            f"{name}={getattr(self, name)!r}"
            for name in ("need", "cost", "timeout", "idle_ttl", "slots", "priority", "places")
            if getattr(self, name) is not None
        )
        pinned = ", pin=True" if self.pin else ""
        return f"Request({self.key!r}{', ' if given else ''}{given}{pinned})"


class Ticket:
    """One requester's claim on an entry that is not ready yet.

    ``outcome`` is ``None`` while pending, ``True`` once a lease was granted to
    it, or the exception it must raise.
    """

    __slots__ = ("bound", "entry", "held", "holds", "loading", "outcome", "task")

    def __init__(
        self,
        entry: Entry,
        task: object,
        loading: tuple[Entry, ...] = (),
        held: tuple[Entry, ...] | None = None,
    ) -> None:
        self.entry = entry
        self.task = task
        #: For a request relayed from another process: the entries its task
        #: leases there (the books see only that the process leases them).
        self.held = held
        self.outcome: bool | BaseException | None = None
        #: The entries whose loader made this request (it runs inside their load).
        self.loading = loading
        #: Whether ``task`` held a lease in the requested spaces when it asked:
        #: a waiter blocked on that lease must not block this request in turn.
        self.holds = False
        #: Whether ``task`` itself will end the lease granted to this ticket
        #: (``Core.request``'s ``bound``): only such leases can make a wait
        #: for a lease slot hopeless.
        self.bound = True


class Entry:
    """One cached (or soon cached) value and its books."""

    __slots__ = (
        "after",
        "asked",
        "asked_places",
        "bound",
        "cache",
        "charge",
        "cost",
        "declared_cost",
        "doomed",
        "error",
        "gated",
        "holders",
        "holding",
        "home",
        "idle_seq",
        "idle_since",
        "joiners",
        "kept",
        "key",
        "last_request",
        "leases",
        "need",
        "nested",
        "owner",
        "pin",
        "places",
        "priority",
        "promote_cost",
        "promoting",
        "queued_tick",
        "reload",
        "requests",
        "shell",
        "slots",
        "state",
        "successor",
        "target",
        "ttl",
        "unknown",
        "value",
        "weights",
    )

    # long: one line per field of an entry, each with what it holds and when.
    def __init__(self, owner: Owner, key: Hashable, need: dict[str, int]) -> None:
        self.owner = owner
        #: The name of the cache that owns this entry.
        self.cache: str = owner.name
        self.key = key
        self.need = need
        self.charge: dict[str, int] = {}
        #: ``charge`` as (Space, bytes) pairs, for the hot paths.
        self.weights: tuple[tuple[Space, int], ...] = ()
        self.state = State.WAITING
        self.leases = 0
        #: The task of each lease (one item per lease; usually a single one).
        self.holders: list[object] = []
        #: The holders (one item per lease, a sub-multiset of ``holders``)
        #: whose lease only their own task can end: see ``Core.request``'s
        #: ``bound``. The other leases may have been handed to another task.
        self.bound: list[object] = []
        #: Tickets waiting on it: for its load while it is waiting or loading;
        #: for a lease slot (FIFO) while it is ready and ``slots`` are taken.
        self.joiners: list[Ticket] = []
        #: The most leases it may have at once (``None``: unlimited).
        self.slots: int | None = owner.slots
        #: Lower priorities are evicted first, whatever the policy's ranking
        #: (``broker.entries()`` shows it).
        self.priority = owner.priority
        self.value: Any = None
        self.error: BaseException | None = None
        self.idle_seq = 0
        self.idle_since = 0.0
        #: Reload cost in seconds: the declared one, else the measured load time.
        self.declared_cost: float | None = None
        self.reload = 0.0
        #: What losing it where it is now costs, as policies read it: ``reload``,
        #: or, parked in a lower tier, ``reload`` less its promotion's seconds.
        self.cost = 0.0
        #: The spaces its wait may be placed in (``acquire(spaces=...)``), in the
        #: order given; ``need`` is its size in one of them, chosen when it is
        #: granted. Those of ``asked_places`` left to the request that queued it (see
        #: ``_refusals.placeable``); ``None``: one was left, ``need``'s.
        self.places: tuple[str, ...] | None = None
        #: The space names its first request gave (its size's, then its places),
        #: as given: its owner is told of a space by its own name for it, which
        #: a merge of spaces does not change (``_tiers.owner_space``).
        self.asked: tuple[str, ...] = ()
        #: Every space its acquire asked for (``None``: it gave no places), kept
        #: for its life: a promotion chooses among them again, for its requester.
        self.asked_places: tuple[str, ...] | None = None
        #: Tiers (``Core.tiers``): the charge it had where it was loaded, while
        #: it is parked lower (``None``: it is where it was loaded); while
        #: ``moving``, the charge it moves to, and whether the move goes back up;
        #: the seconds its latest promotion took (``None``: never promoted).
        self.home: dict[str, int] | None = None
        self.target: dict[str, int] | None = None
        self.promoting = False
        self.promote_cost: float | None = None
        #: Requests for this entry since it was created, and the core's request
        #: clock (``Core.tick``) at the latest one: what policies rank by.
        self.requests = 0
        self.last_request = 0
        #: Per-entry idle TTL (``None``: the broker's); pinned entries are never
        #: eviction candidates and never expire while their cache is open.
        self.ttl: float | None = owner.ttl
        self.pin = False
        #: What it counts in its spaces' ``pinned`` or ``ranked`` (``_model.sync``):
        #: whether pinned, its priority and its weights then; ``None``: nothing.
        self.kept: tuple[bool, int, tuple[tuple[Space, int], ...]] | None = None
        #: Why to release it when its last lease ends (invalidated, cleared, closing).
        self.doomed: Reason | None = None
        #: A releasing entry this one must wait for, and the reverse link.
        self.after: Entry | None = None
        self.successor: Entry | None = None
        #: Slot for the async shell (events, cancel scopes); the core never reads it.
        self.shell: Any = None
        #: The request clock when it was queued for space (fairness, see
        #: ``_scheduler.drain``).
        self.queued_tick = 0
        #: Joined tickets whose task holds a lease in the requested spaces.
        self.holding = 0
        #: Its size is unknown until measured (see ``Core.request``), and it
        #: waits at the gate that lets one such load run at a time.
        self.unknown = False
        self.gated = False
        #: Tickets that this entry's loader asked for (deadlock detection).
        self.nested: list[Ticket] = []

    @property
    def idle(self) -> bool:
        """Whether the entry is an eviction candidate (loaded, no lease, not releasing)."""
        return self.idle_seq != 0

    @property
    def pinned(self) -> bool:
        """Whether it stays resident whatever the policy and idle time (``configure``)."""
        return self.pin

    @pinned.setter
    def pinned(self, value: bool) -> None:
        # A property, not a slot, so that every writer (the daemon mirrors its
        # processes' pins) keeps its spaces' ``pinned`` bytes right.
        value = bool(value)
        if value is not self.pin:
            self.pin = value
            if self.kept is not None:
                sync(self)

    def __repr__(self) -> str:
        return f"<Entry {self.owner.name}:{self.key!r} {self.state.value} leases={self.leases}>"


def _naming(error: BaseException, entry: Entry) -> BaseException:
    """``error`` as the requesters of ``entry`` get it: its type, a message naming the entry."""
    try:
        named = copy.copy(error)
        named.args = (f"{error} while acquiring {entry.owner.name}:{entry.key!r}",)
    except Exception:  # an exception that cannot be copied is given as it is
        return error
    # (A copy keeps the instance's attributes, not the chain: the cause is the
    # plugin's own exception, which its requesters need to see.)
    named.__cause__, named.__suppress_context__ = error.__cause__, error.__suppress_context__
    return named


def _shrink_if_empty(container: dict[Any, Any] | set[Any]) -> None:
    """Give an emptied container's table back: CPython keeps a dict's or set's
    peak size until it is cleared, so a burst would hold memory for good."""
    if not container:
        container.clear()


def sync(entry: Entry) -> None:
    """Count ``entry`` in its spaces' ``pinned`` or ``ranked`` bytes as it is now.

    Idempotent: what it counted before is taken back first. Counted: a ready
    entry that is not doomed (a doomed one is released when its last lease
    ends, so its bytes are coming back).
    """
    kept = entry.kept
    if kept is not None:
        pinned, priority, weights = kept
        for space, amount in weights:
            if pinned:
                space.pinned -= amount
            elif amount:  # (no zero in ``ranked``: a priority holding nothing leaves)
                ranked = space.ranked
                left = ranked[priority] - amount
                if left:
                    ranked[priority] = left
                else:
                    del ranked[priority]
    if entry.state is State.READY and entry.doomed is None and entry.weights:
        pinned, priority, weights = entry.kept = (entry.pin, entry.priority, entry.weights)
        for space, amount in weights:
            if pinned:
                space.pinned += amount
            elif amount:
                ranked = space.ranked
                ranked[priority] = ranked.get(priority, 0) + amount
    else:
        entry.kept = None
