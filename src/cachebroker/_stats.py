"""Read-only snapshots the broker hands out: ``Stats``, ``EntryInfo`` and ``EvictionReport``."""

from __future__ import annotations

from collections.abc import Hashable, Mapping

import attrs

__all__ = ["EntryInfo", "EvictionReport", "Stats"]


@attrs.frozen(kw_only=True)
class Stats:
    """A consistent snapshot of the broker's books, taken in one step.

    Attributes:
        entries: Entries holding memory: loading, ready, moving, demoted,
            releasing or quarantined.
        used: Bytes charged per space (every entry holding memory counts).
        budget: Budget per space; 0 everywhere means retention is off.
        hits: Acquires served without a load of their own: by a ready entry, or
            by joining a load already in flight.
        misses: Acquires that created a new entry (and so a load), or that
            moved a demoted entry back up a tier (``promotions``).
            (``Cache.prefetch`` is no acquire: it counts as neither.)
        loads: Loads that finished successfully (prefetches' too).
        load_failures: Loads that raised.
        load_seconds: Total time spent in successful loads.
        evictions: Entries released to make room (by accounting or after an
            out-of-memory error) or because they sat idle.
        oom_retries: Loads retried after an out-of-memory error freed a victim.
        aliases: Groups of space names the broker treats as one memory
            (given, or learned from retries); pass to ``Broker(aliases=...)``.
        releases: Releases started, by reason (capacity, idle, invalidate, clear,
            close, unretained, rejected, retry, abandoned).
        releases_failed: Releases that raised or timed out (now quarantined).
        releases_timed_out: Those of ``releases_failed`` that were not
            acknowledged within ``release_timeout``.
        releases_blocking: Releases that blocked the event loop for longer
            than ``Broker(blocking_warning=...)`` in one step.
        waiting: Requests queued for space.
        waiting_for_lease: Requests waiting for a lease slot of a loaded entry
            whose ``concurrency`` is taken (not for space).
        loading: Entries whose load is running.
        ready: Entries loaded and usable (idle or leased).
        leased: Entries with at least one lease.
        releasing: Entries whose release is in flight.
        quarantined: Entries whose release (or move) failed; their bytes stay charged.
        quarantined_keys: ``(cache, key)`` of each quarantined entry, for
            ``Broker.forget`` once an operator has dealt with it.
        broker_used: For a broker connected to a shared one
            (``Broker.connect``): bytes charged per space across every
            process, as the shared broker reported them (``stats()`` asks it;
            ``stats_nowait()`` gives the last answer). ``used`` and the
            counters above are this process's own. ``None`` in-process.
        moving: Entries moving between tiers (``Broker(tiers=...)``), or
            whose move down waits for room in the lower tier.
        demoted: Entries parked in a lower tier, loaded (``used`` counts them
            there; ``entries()`` says which).
        demotions: Moves down a tier that finished (each one a release
            avoided).
        promotions: Moves back up that finished (each one a load avoided;
            its requester counted a miss).
        moves_failed: Moves that raised or timed out (those entries are
            quarantined with both charges).
    """

    entries: int
    used: Mapping[str, int]
    budget: Mapping[str, int]
    hits: int
    misses: int
    loads: int
    load_failures: int
    load_seconds: float
    evictions: int
    oom_retries: int
    aliases: tuple[tuple[str, ...], ...] = ()
    releases: Mapping[str, int]
    releases_failed: int
    releases_timed_out: int = 0
    releases_blocking: int = 0
    waiting: int
    waiting_for_lease: int = 0
    loading: int
    ready: int
    leased: int
    releasing: int
    quarantined: int
    quarantined_keys: tuple[tuple[str, Hashable], ...] = ()
    broker_used: Mapping[str, int] | None = None
    moving: int = 0
    demoted: int = 0
    demotions: int = 0
    promotions: int = 0
    moves_failed: int = 0

    @property
    def hit_ratio(self) -> float:
        """Hits over all acquires (0.0 before the first acquire)."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


@attrs.frozen(kw_only=True)
class EntryInfo:
    """One entry of the books, as ``Broker.entries()`` found it (one snapshot for all).

    Attributes:
        cache: The name of the cache that owns it.
        key: Its key, the object given to ``acquire``.
        state: ``"waiting"`` (queued for space), ``"loading"``, ``"ready"``,
            ``"moving"`` (between tiers: moving down, waiting for room to,
            or moving back up), ``"demoted"`` (loaded, parked in a lower
            tier; an acquire moves it back), ``"releasing"`` or
            ``"quarantined"`` (its release or move failed; its bytes stay
            charged until ``Broker.forget``).
        charge: Bytes charged against the budget, per space: where it lives
            (the declared size until measured; nothing while waiting; while
            moving, the charge it leaves, the one it goes to being
            ``moving_to``).
        leases: Leases held on it.
        waiting: Requests waiting on it: acquires and prefetches joined to its
            load (or to its wait for space).
        pinned: Kept resident regardless of policy and idle time.
        priority: Its eviction priority (lower is evicted first).
        idle_seconds: Seconds since its last lease ended, for a ready entry
            with no lease, where an idle TTL applies to it (the broker's
            ``idle_ttl`` or the entry's own ``acquire(idle_ttl=...)``,
            ``math.inf`` included); ``None`` otherwise: the hit path reads no
            clock when no idle TTL needs it.
        loads: Loads of this key in this cache that finished, counted across
            evictions (remembered per key like measured sizes).
        load_seconds: How long the latest of those loads took; ``None``
            before the first one finished.
        home: For an entry moved down a tier (demoted, or moving): the charge
            it had where it was loaded, where an acquire moves it back;
            ``None`` for one where it was loaded.
        moving_to: While moving: the charge it will have once moved (both are
            on the books until then); ``None`` otherwise.
        promote_seconds: How long its latest move back up took (its reload
            cost from the lower tier); ``None`` before one.
    """

    cache: str
    key: Hashable
    state: str
    charge: Mapping[str, int]
    leases: int
    waiting: int
    pinned: bool
    priority: int
    idle_seconds: float | None
    loads: int
    load_seconds: float | None
    home: Mapping[str, int] | None = None
    moving_to: Mapping[str, int] | None = None
    promote_seconds: float | None = None


@attrs.frozen(kw_only=True)
class EvictionReport:
    """What an explicit sweep (``evict_idle``, ``clear``) released.

    Attributes:
        entries: Entries whose owners acknowledged the release.
        bytes: Bytes freed by those releases, summed over spaces.
        failed: Releases that raised or timed out (the entries are quarantined).
    """

    entries: int
    bytes: int
    failed: int = 0
