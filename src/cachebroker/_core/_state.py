"""``Books``: what the books of one broker hold.

The state of the books: the spaces and owners, the waiting queue and the
gate for loads of unknown size (``_waiting``: owners with their own
``check``), idle candidates and their expiry, tiers, aliases, quarantine
(``Overdue``), the per-key memories and the counters. Every change of
an entry's state is a function of ``_transitions``; the modules that decide
(``_scheduler``, ``_moves``, ``_aliases``, ``_reach``, ``_refusals``) read
these books and change them through ``_transitions``; ``Core`` (``_books``)
adds the steps the shell takes. The invariants are in the package docstring,
checked by ``_invariants.check``.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import TypeVar

from .._errors import InvalidArgument
from .._policies import Policy, PolicyBase, PolicyEntry
from .._policies._priorities import Priorities
from ._effects import Effect
from ._model import FAIR_REQUESTS, REMEMBERED_SIZES, Entry, Owner, Reason, Space
from ._overdue import Overdue
from ._seam import Seam
from ._spaces import Canon, Tiers
from ._waiting import Gate, Queue

__all__ = ["Books", "keep"]


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


K = TypeVar("K")


V = TypeVar("V")


def keep(table: dict[K, V], key: K, value: V) -> None:
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


class Books:
    """The state of one broker's books (see the module docstring)."""

    # Slots: the books have too many attributes for CPython to share their
    # instance dicts' keys, and the hit path reads several. ``__dict__`` stays
    # for the test build, which wraps steps per instance (``_invariants``).
    __slots__ = (
        "__dict__",
        "busy",
        "canon",
        "closed",
        "counts_loads",
        "demoting",
        "demotions",
        "effects",
        "evictions",
        "expiry",
        "fair_requests",
        "gate",
        "idle_count",
        "idle_ttl",
        "largest",
        "load_failures",
        "load_history",
        "load_seconds",
        "loads",
        "lost_room",
        "misses",
        "moves_failed",
        "on_admit",
        "on_busy",
        "on_evicted",
        "on_remove",
        "on_touch",
        "oom_retries",
        "orphans",
        "overdrawn",
        "overdue",
        "owners",
        "policy",
        "prefetching",
        "promote_history",
        "promotions",
        "quarantined",
        "queue",
        "releases_failed",
        "retain",
        "seam",
        "seq",
        "settling",
        "sizes",
        "spaces",
        "tick",
        "tiers",
        "unknown",
        "unsized",
    )

    # long: one line per field of the books, each with what it holds: the one list
    # of their state (the owners with invariants of their own are in ``_waiting``,
    # ``_spaces`` and ``_overdue``).
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
        #: Learned (or given) aliases: a space name -> the name it is merged into,
        #: the canonical names and the evidence toward merges (``_spaces``).
        self.canon = Canon(self.spaces)
        #: Each space's lower tier: where its idle entries may be moved
        #: instead of released (``_moves``), when their owner can move them;
        #: and the tiers as given (``_spaces``).
        self.tiers = Tiers(tiers or {})
        #: Demotions decided and waiting for their room in the lower tier, in order.
        self.demoting: dict[Entry, None] = {}
        self.demotions = 0
        self.promotions = 0
        self.moves_failed = 0
        self.policy = policy
        #: Priorities: entries of one priority go to ``policy``; once several
        #: coexist, ``Priorities`` gives each its own policy, made by ``_make_policy``.
        self.make_policy = _factory(policy)
        self.priorities: Priorities | None = None
        self.priority: int | None = None  # the one priority seen, until Priorities
        # Hooks a policy leaves as no-ops are not called at all (LRU's hit path).
        self.on_touch = _hook(policy, "touch")
        self.on_busy = _hook(policy, "busy")
        self.on_admit = _hook(policy, "admit")
        self.on_remove = _hook(policy, "remove")
        self.on_evicted = _evicted_hook(policy)
        #: The request clock: one tick per acquire (hit, join or miss).
        self.tick = 0
        self.idle_ttl = idle_ttl
        self.owners: dict[str, Owner] = {}
        #: Entries waiting for space, in arrival order (``_waiting``).
        self.queue = Queue()
        #: Entries with a lease, and settling ones (below): deadlock detection
        #: looks here for the leases of a task.
        self.busy: dict[Entry, None] = {}
        #: Entries whose last lease ended since the books were last settled, in
        #: that order (a subset of ``busy``): they become idle (policy, idle
        #: bytes, expiry) in ``_transitions.settle``, so a hit and the release that follows
        #: it cost one dict step each.
        self.settling: dict[Entry, bool] = {}
        self.quarantined: dict[Entry, BaseException] = {}
        #: Set when room was lost for good (quarantined, or an overdue release
        #: stranded): the next ``schedule`` refuses the lease holders whose
        #: requests only their own leases or ``forget()`` can serve now.
        self.lost_room = False
        #: The quarantined entries whose release still runs past its timeout.
        self.overdue = Overdue()
        #: Loads abandoned by their closing cache while still running (a worker
        #: thread cannot be stopped): ``releasing`` until the load returns and
        #: what it made is released (``load_abandoned``).
        self.orphans: dict[Entry, None] = {}
        self.effects: list[Effect] = []
        self.overdrawn: set[str] = set()
        self.expiry: list[tuple[float, int, Entry]] = []
        self.idle_count = 0
        #: Idle entries of unknown size, oldest first (free-and-retry's last resort).
        self.unsized: dict[Entry, None] = {}
        self.oom_retries = 0
        self.seq = itertools.count(1)
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
        self.largest: dict[str, dict[str, int]] = {}
        #: For each (cache, key) loaded: how many loads finished, and the last
        #: one's seconds; remembered across evictions, like ``sizes``.
        self.load_history: dict[tuple[str, Hashable], tuple[int, float]] = {}
        #: For each (cache, key) moved back up a tier: the seconds the latest
        #: promotion took, remembered across evictions like ``load_history``.
        self.promote_history: dict[tuple[str, Hashable], float] = {}
        #: Set during a ``prefetch`` step: the request it makes is not counted.
        self.prefetching = False
        #: Loads of unknown size waiting for their turn, and the one whose turn it is.
        self.gate = Gate()
        #: Requests served after a waiter blocked by leased entries before they
        #: are drained for it (``_scheduler.drain``).
        self.fair_requests = FAIR_REQUESTS
        #: The other process's side of these books, if any (``_seam``): told of
        #: the changes it must know, and asked what only it knows.
        self.seam: Seam | None = None
        #: Whether finished loads are counted per key (``load_history``).
        self.counts_loads = True

    def policy_victims(self, shortfall: Mapping[str, int], up_to: int | None) -> list[PolicyEntry]:
        """The policy's victims for ``shortfall``, none of a priority above ``up_to``."""
        priorities = self.priorities
        if priorities is None:  # (every entry of one priority)
            return self.policy.victims(shortfall)
        return priorities.victims(shortfall, up_to)

    def policy_evicted(self, victims: Sequence[Entry], shortfall: Mapping[str, int]) -> None:
        """Tell the policy that ``victims``, its choice for ``shortfall``, are evicted.

        Only for a choice acted on: ``policy_victims`` is also asked to weigh
        options (placement, tiers), which must leave the policy as it was.
        """
        if self.on_evicted is not None and victims:
            self.on_evicted(victims, shortfall)

    @property
    def hits(self) -> int:
        """Requests served without a load of their own: hits, and joins of a load in flight."""
        return self.tick - self.misses

    def entries(self) -> Iterable[Entry]:
        """Every entry known to the books, abandoned loads and quarantined ones included."""
        for owner in self.owners.values():
            yield from owner.live
        yield from self.orphans
        yield from self.quarantined
