"""``Broker``, the facade: construction, life cycle, ``cache()``, the operations, stats.

What runs the broker is its ``Runner`` (``_runner``); the facade checks the
arguments, builds the books and the runner, and turns each operation into a
step of the books and the runner's effects.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable, Iterable, Mapping
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Any

import anyio
import anyio.lowlevel

from .. import _log_events as ev
from .._core import Core, Reason, State
from .._core._tiers import reserved
from .._errors import InvalidArgument
from .._policies import Policy, make_policy
from .._remote._protocol import resolve_address as _address
from .._sizes import parse_budget, tier_map
from .._stats import EntryInfo, EvictionReport, Stats
from . import _logging
from ._cache import Cache, _CacheBlock
from ._config import (
    BudgetValue,
    Listener,
    ReleaseFunction,
    Releaser,
    alias_groups,
    budget_value,
    env_arguments,
    eviction_priority,
    lease_slots,
    non_negative_seconds,
    oom_error_types,
    oom_retry_bound,
    positive_seconds,
    remembered_sizes,
    resolve_mover,
    resolve_releaser,
    split_probes,
)
from ._runner import Runner
from ._seam import LOCAL, Relay, Remote

__all__ = ["Broker", "check_running"]


class Broker:
    """The central broker: holds the budgets of every memory space and decides what stays loaded.

    Use it as an async context manager; open one ``cache(...)`` block per plugin
    inside it::

        async with cachebroker.Broker(budget={"ram": "16GiB", "cuda:0": "24GiB"}) as broker:
            async with broker.cache("whisper", WhisperPlugin()) as cache:
                async with cache.acquire("large-v3", load=load, size={"cuda:0": "3GiB"}) as lease:
                    ...

    Args:
        budget: Bytes as an ``int``, a string such as ``"24GiB"``, a hardware
            probe (``cachebroker.probes``), or a mapping of space name to any
            of these; or the same as text, in the grammar of
            ``CACHEBROKER_BUDGET`` and ``cachebroker serve --budget``:
            ``"ram=16GiB,cuda:0=24GiB"``, with probed spaces as
            ``"ram=system-4GiB"`` or ``"cuda:0=nvidia:0-1GiB"`` (device, then
            the headroom). A single quantity means one space named
            ``"default"``. A fractional number of bytes (``"0.5B"``) is an
            error. A budget of 0 everywhere turns retention off: every
            acquire loads (concurrent ones still share a load) and a value is
            released as soon as its last lease ends.
        policy: Eviction policy: ``"lru"`` (the default) or a ``Policy`` instance.
        idle_ttl: Seconds an entry may sit unleased before the broker releases it
            on its own timer; ``None`` disables idle eviction.
        release_timeout: Seconds a releaser has to acknowledge; past it the entry
            is quarantined (its bytes stay charged). ``None`` waits forever.
        clock: A callable returning the current time in seconds, for idle
            bookkeeping and load timings. Defaults to the event loop's clock.
        logger: Where events go (``docs/events.md``): a structlog logger, or a
            standard library ``logging.Logger`` (or ``LoggerAdapter``). By
            default, the application's structlog configuration if it has one,
            else the standard library logger ``"cachebroker"``, so that
            ``logging``'s levels and handlers apply and nothing below
            ``WARNING`` shows unless the application asks.
        oom_errors: Exception types that mean "out of memory" when a loader
            raises them (e.g. ``torch.cuda.OutOfMemoryError``), in addition to
            ``MemoryError`` and ``OutOfSpace``. The broker then frees the next
            idle victim and retries the load (free and retry).
        oom_retries: How many times one load may be retried after freeing.
        aliases: Groups of space names known to be one memory, e.g. from a
            previous broker's ``stats().aliases``. They share one capacity
            (the larger budget) and evict from each other. A group that would
            make ``tiers`` go round in a circle raises ``InvalidArgument``.
        alias_threshold: How many times a load in one space must have fit only
            after freeing in another before the broker merges the two.
        memory_wait: After a release on a probed space, how long to wait for
            the device to show at least 75% of the bytes back before granting
            them (``None`` or 0: do not wait).
        probe_interval: Seconds between re-reads of probed spaces on the
            broker's timer (they are also re-read before every miss).
        blocking_warning: Seconds a releaser may run without yielding to the
            event loop before ``cachebroker.release.blocking`` is logged (a
            releaser runs on the loop: ``gc.collect()`` or a device
            synchronisation there stalls every other task; offload them with
            ``anyio.to_thread.run_sync``). ``None`` turns the check off.
        lease_warning: Seconds a lease may be held while requests wait for
            its space before ``cachebroker.lease.held`` is logged (once per
            lease), naming cache, key and the holder tasks: a forgotten
            lease otherwise stalls every request behind it silently.
            ``None`` turns the check off.
        sizes: Measured sizes to start from, as ``export_sizes()`` returned
            them from a previous broker: ``{cache: {key: size}}``, each size
            as for ``acquire(size=...)``. A load sized by measurement reserves
            its key's remembered size.
        tiers: Each space's lower tier, ``{"cuda:0": "ram"}``: an idle entry
            the policy evicts from a space with a lower tier is moved there
            instead of released, when its cache's releaser offers
            ``move(key, value, to)`` and the lower tier's policy ranks it
            above what it would displace there; an acquire moves it back.
            ``move`` is told each space by the name the acquire (or ``tiers``)
            gave it, whatever ``aliases`` merge. See docs/memory.md ("Tiers").

    .. versionadded:: 0.1.0
    """

    #: The runner's other side (the daemon of ``cachebroker serve`` sets its
    #: own before it builds the runner).
    _remote: Remote = LOCAL

    def __init__(
        self,
        budget: BudgetValue | Mapping[str, BudgetValue],
        *,
        policy: str | Policy = "lru",
        idle_ttl: float | None = None,
        release_timeout: float | None = 30.0,
        clock: Callable[[], float] | None = None,
        logger: Any = None,
        oom_errors: type[BaseException] | tuple[type[BaseException], ...] = (),
        oom_retries: int = 8,
        aliases: Iterable[Iterable[str]] = (),
        alias_threshold: int = 3,
        sizes: Mapping[str, Mapping[Any, Any]] | None = None,
        blocking_warning: float | None = 0.1,
        lease_warning: float | None = 60.0,
        memory_wait: float | None = 5.0,
        probe_interval: float = 1.0,
        tiers: Mapping[str, str] | None = None,
    ) -> None:
        budget, probes = split_probes(budget_value(budget))
        spaces = parse_budget(budget)
        lower = tier_map(tiers, spaces)
        memory_wait = positive_seconds(memory_wait, "memory_wait") if memory_wait else None
        checked_probe_interval = positive_seconds(probe_interval, "probe_interval")
        oom_types = oom_error_types(oom_errors)
        oom_retries = oom_retry_bound(oom_retries)
        if idle_ttl == 0 and not isinstance(idle_ttl, bool):
            # (0 means "off" in CACHEBROKER_IDLE_TTL and serve --idle-ttl, and "at the
            # last lease's end" for a cache or an acquire: say which is which.)
            raise InvalidArgument(
                f"idle_ttl must be a positive number of seconds or None, got {idle_ttl!r}: "
                "None keeps idle entries until they are evicted; to release each entry when "
                "its last lease ends, give idle_ttl=0 to broker.cache(...) or acquire(...)"
            )
        idle_ttl = positive_seconds(idle_ttl, "idle_ttl", inf_is_none=True)
        release_timeout = positive_seconds(release_timeout, "release_timeout", inf_is_none=True)
        blocking_warning = positive_seconds(blocking_warning, "blocking_warning", inf_is_none=True)
        lease_warning = positive_seconds(lease_warning, "lease_warning", inf_is_none=True)
        if clock is not None and not callable(clock):
            raise TypeError(f"clock must be a callable returning seconds, got {clock!r}")
        core = self._core = Core(
            spaces,
            make_policy(policy),
            idle_ttl=idle_ttl,
            retain=True if probes else None,
            tiers=lower,
        )
        if isinstance(alias_threshold, bool) or not isinstance(alias_threshold, int):
            raise TypeError(f"alias_threshold must be an int, got {alias_threshold!r}")
        if alias_threshold < 1:
            raise InvalidArgument(f"alias_threshold must be at least 1, got {alias_threshold}")
        for cache_name, key, charge in remembered_sizes(sizes, spaces):
            core.remember(cache_name, key, charge)
        for group in alias_groups(aliases, spaces):
            for name in group[1:]:
                core.merge_spaces(group[0], name)
        self._runner = Runner(
            core,
            budget=dict(spaces),
            probes=probes,
            idle_ttl=idle_ttl,
            release_timeout=release_timeout,
            blocking_warning=blocking_warning,
            lease_warning=lease_warning,
            memory_wait=memory_wait,
            probe_interval=checked_probe_interval,
            oom_errors=oom_types,
            oom_retries=oom_retries,
            alias_threshold=alias_threshold,
            clock=clock,
            logger=_logging.check_logger(logger),
            remote=self._remote,
        )

    # ------------------------------------------------------------ life cycle

    @classmethod
    def connect(
        cls,
        address: str | os.PathLike[str] | None = None,
        *,
        logger: Any = None,
        oom_errors: type[BaseException] | tuple[type[BaseException], ...] = (),
        oom_retries: int = 8,
        sizes: Mapping[str, Mapping[Any, Any]] | None = None,
        reconnect: bool = True,
        reconnect_delay: float = 0.05,
        reconnect_max_delay: float = 1.0,
        reconnect_timeout: float | None = None,
        clock: Callable[[], float] | None = None,
        blocking_warning: float | None = 0.1,
    ) -> Broker:
        """A broker backed by the machine's shared one (``cachebroker serve``).

        Use it as ``async with Broker.connect() as broker``: entering connects
        to the socket at ``address`` (default: ``CACHEBROKER_ADDRESS``, else
        ``$XDG_RUNTIME_DIR/cachebroker.sock``, else
        ``/tmp/cachebroker-$UID.sock``). The broker has the same API and
        semantics as an in-process one; the budget, policy, idle TTL and
        release timeout are the daemon's, and every process connected to it
        shares its budget (``docs/processes.md``). Values stay in this
        process; hits on entries this process holds need no round trip.

        Entering raises ``BrokerClosed`` naming the address when no broker
        answers there. If the daemon goes away later (a restart, an
        upgrade), the broker connects again by itself, with backoff, and
        registers everything this process holds before the new daemon grants
        anything to others; meanwhile leases and hits go on working and
        requests that need the daemon wait, each within its own timeout
        (``docs/processes.md``). With ``reconnect=False``, or once
        ``reconnect_timeout`` has passed, each operation that needs the
        daemon raises ``BrokerClosed``; connect again to go on.

        Args:
            address: The daemon's socket path.
            logger: As for ``Broker``.
            oom_errors: As for ``Broker``: free and retry frees idle entries of
                any process, in the daemon's policy order, then retries.
            oom_retries: As for ``Broker``.
            sizes: As for ``Broker``: measured sizes to start from
                (``export_sizes()``), checked against the daemon's spaces when
                the broker is entered.
            reconnect: Whether to connect again when the daemon goes away.
            reconnect_delay: Seconds before the first try; each failed try
                doubles the wait ...
            reconnect_max_delay: ... up to this many seconds.
            reconnect_timeout: Seconds without a daemon after which the broker
                gives up (``None``: it never does).
            clock: As for ``Broker``: this process runs its entries' idle
                timers (with the daemon's idle TTL) and times its loads on it.
            blocking_warning: As for ``Broker``: this process's releasers run
                on its loop.

        .. versionchanged:: 0.1.0
           ``reconnect`` and its settings; ``oom_retries``, ``sizes``, ``clock``,
           ``blocking_warning``.
        """
        from .._remote._admission import connected_runner  # (only when asked for)
        from .._remote._client import Reconnect

        if not isinstance(reconnect, bool):
            raise TypeError(f"reconnect must be True or False, got {reconnect!r}")
        delay = positive_seconds(reconnect_delay, "reconnect_delay")
        max_delay = positive_seconds(reconnect_max_delay, "reconnect_max_delay")
        if delay is None or max_delay is None or max_delay < delay:
            raise InvalidArgument(
                f"reconnect_delay ({reconnect_delay!r}) and reconnect_max_delay "
                f"({reconnect_max_delay!r}) must be seconds, the first at most the second"
            )
        timeout = positive_seconds(reconnect_timeout, "reconnect_timeout", inf_is_none=True)
        if clock is not None and not callable(clock):
            raise TypeError(f"clock must be a callable returning seconds, got {clock!r}")
        blocking = positive_seconds(blocking_warning, "blocking_warning", inf_is_none=True)
        runner = connected_runner(
            _address(address),
            logger=_logging.check_logger(logger),
            oom_errors=oom_error_types(oom_errors),
            oom_retries=oom_retry_bound(oom_retries),
            sizes=sizes,
            clock=clock,
            blocking_warning=blocking,
            reconnect=Reconnect(reconnect, delay, max_delay, timeout),
        )
        broker = cls.__new__(cls)
        broker._core = runner.core
        broker._runner = runner
        return broker

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Broker:
        """Build a broker from ``CACHEBROKER_*`` environment variables.

        When ``CACHEBROKER_ADDRESS`` is set, the broker connects to the
        shared broker there (``Broker.connect``), whose settings are the
        daemon's: only ``logger`` may be given then. Otherwise
        ``CACHEBROKER_BUDGET`` is required: ``"24GiB"`` or
        ``"ram=16GiB,cuda:0=24GiB"``. ``CACHEBROKER_IDLE_TTL`` is seconds
        (0 = off), ``CACHEBROKER_POLICY`` a policy name and ``CACHEBROKER_TIERS``
        each space's lower tier (``"cuda:0=ram"``). Keyword arguments
        override the environment. A malformed value raises ``InvalidArgument``
        naming the variable and the value.
        """
        env = os.environ if environ is None else environ
        address = env.get("CACHEBROKER_ADDRESS", "").strip()
        if address:
            settings = sorted(set(overrides) - {"logger"})
            if settings:
                raise InvalidArgument(
                    f"CACHEBROKER_ADDRESS={address!r} connects to a shared broker, whose "
                    f"settings are its own: {', '.join(settings)} cannot be given here "
                    "(give them to 'cachebroker serve')"
                )
            return cls.connect(address, logger=overrides.get("logger"))
        return cls(**env_arguments(environ, overrides))

    async def __aenter__(self) -> Broker:
        """Start the broker: its task group and idle sweeper run until the block ends.

        Cancellation: nothing to undo; the broker was not started.
        """
        if self._runner.running or self._core.closed:
            raise RuntimeError("a Broker can be entered only once")
        await self._runner.start()
        self._core = self._runner.core  # (a connected broker builds its books on connecting)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        """Close every cache still open (see ``Cache``), then stop the sweeper.

        Waiting requests fail with ``BrokerClosed`` and loads are cancelled.
        Worker threads of plain loaders that the caches gave up while they ran
        are waited for (bounded by ``release_timeout``) so that what they make
        is released; those still running then are left to themselves and
        their entries quarantined.
        Cancellation: the closing of the caches is shielded, so it completes
        (each bounded by ``release_timeout``) even when the block is cancelled.
        """
        return await self._runner.stop(exc_type, exc, tb)

    def cache(
        self,
        name: str,
        releaser: Releaser | ReleaseFunction,
        *,
        concurrency: int | None = None,
        idle_ttl: float | None = None,
        priority: int = 0,
    ) -> AbstractAsyncContextManager[Cache]:
        """Open a plugin's view of the broker: ``async with broker.cache(name, releaser) as cache``.

        The block runs a task group in which this cache's loads and releases
        run. Keys are per cache. Leaving the block releases the cache's entries
        through ``releaser``, waiting (bounded by ``release_timeout``) for
        leases still held; see ``Cache`` for the rules. Cancellation: entering
        is not a cancellation point of its own; leaving is shielded up to
        ``release_timeout``, so the entries are released even when the block
        is cancelled.

        The keyword arguments are this cache's defaults for its entries, which
        an acquire may override (see ``Cache.acquire``): ``concurrency``, the
        most leases on one entry at once (``None``: unlimited; 1 for a backend
        that must not be called twice at once); ``idle_ttl``, seconds an entry
        may stay idle (``None``: the broker's); ``priority``, the eviction
        priority (lower is evicted first).
        """
        if not isinstance(name, str) or not name:
            raise TypeError(f"cache name must be a non-empty string, got {name!r}")
        slots = None if concurrency is None else lease_slots(concurrency)
        ttl = (
            None if idle_ttl is None else non_negative_seconds(idle_ttl, "idle_ttl", allow_inf=True)
        )
        defaults = (slots, eviction_priority(priority), ttl)
        return _CacheBlock(
            self._runner, name, resolve_releaser(releaser), defaults, resolve_mover(releaser)
        )

    # -------------------------------------------------------- operations

    async def evict_idle(self) -> EvictionReport:
        """Release every entry idle for at least ``idle_ttl``; wait for the acknowledgements.

        Without an ``idle_ttl`` nothing is idle long enough and the report is
        empty. Cancellation stops the wait, not the releases already asked for.
        """
        self._runner.check_running()
        runner = self._runner
        expired = self._core.sweep(runner.clock())
        runner.apply()
        return await runner.await_releases(expired)

    async def clear(self) -> EvictionReport:
        """Release every loaded entry of every cache; leased ones go when their last lease ends.

        Waits for the acknowledgements of the entries that were idle.
        Cancellation stops the wait, not the releases already asked for.
        """
        self._runner.check_running()
        core = self._core
        before = {
            entry
            for entry in core.entries()
            if entry.state in (State.READY, State.DEMOTED, State.MOVING)
        }
        core.clear()
        self._runner.apply()
        started = [entry for entry in before if entry.state is State.RELEASING]
        return await self._runner.await_releases(started)

    async def forget(self, cache: str, key: Hashable) -> int:
        """Write off the quarantined entries of ``key`` in cache ``cache``.

        A quarantined entry is one whose release raised or timed out; its bytes
        stay charged because nobody knows whether the memory came back. Call
        this once you have dealt with it (the process that held the memory is
        gone, the device was reset): its bytes are returned to the budget and
        waiting requests may be granted. Returns how many entries were written
        off (0 when none is quarantined under that name and key). A release
        that acknowledges after this changes nothing. Cancellation: the entries
        are written off in one step before the call's only checkpoint.
        """
        self._runner.check_running()
        core = self._core
        written_off = [
            entry for entry in core.quarantined if entry.owner.name == cache and entry.key == key
        ]
        for entry in written_off:
            core.forget(entry)
            self._runner.emit(
                "warning", ev.QUARANTINE_FORGOTTEN, cache=cache, key=key, bytes=dict(entry.charge)
            )
        self._runner.apply()
        await anyio.lowlevel.checkpoint()
        return len(written_off)

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(event, fields)`` for each event the broker logs from now on.

        ``event`` is a name from the event catalogue (``docs/events.md``) and
        ``fields`` its fields, as structlog gets them, whatever the logger's
        level. The per-request events (``cachebroker.hit``, ``.miss`` and
        ``.wait``) are not delivered: they are counted in ``stats()``.
        Listeners run synchronously on the event loop, in the step that
        produced the event: they must be quick and must not block. One that
        raises is removed, and ``cachebroker.listener.failed`` is logged.
        Metrics exporters (``cachebroker.metrics``) are built on this.
        """
        if not callable(listener):
            raise TypeError(f"listener must be a callable (event, fields), got {listener!r}")
        self._runner.listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        """Stop calling ``listener``; a listener that is not registered is ignored."""
        self._runner.remove_listener(listener)

    def _emit(self, level: str, event: str, **fields: Any) -> None:
        """Log ``event`` at ``level`` as the broker's own, and hand it to the listeners.

        For what runs beside the broker and speaks in its events (``cachebroker.ray``).
        """
        self._runner.emit(level, event, **fields)

    @property
    def _relay(self) -> Relay:
        """What a broker serving other processes steps for them (``_remote._daemon``)."""
        return self._runner

    async def stats(self) -> Stats:
        """Return a snapshot of the books (see ``Stats``).

        The snapshot is taken in one step; the call is a checkpoint, so it may
        raise the caller's cancellation, and nothing else.
        """
        await self._runner.remote.shared_totals()
        return self.stats_nowait()

    async def entries(self) -> list[EntryInfo]:
        """What the books hold, entry by entry (see ``EntryInfo``): by cache, then key.

        Every entry that holds memory or waits for it: waiting, loading,
        ready, releasing and quarantined. Keys are ordered by their ``repr``;
        one key may have two entries (a value still releasing, or
        quarantined, and the one loading after it): the older comes first.
        For a broker connected to a shared one (``Broker.connect``), this
        process's entries (``cachebroker ps`` lists every process's).

        The snapshot is taken in one step; the call is a checkpoint, so it
        may raise the caller's cancellation, and nothing else.

        .. versionadded:: 0.1.0
        """
        await anyio.lowlevel.checkpoint()
        return self._entries_now()

    def _entries_now(self) -> list[EntryInfo]:
        """``entries()``'s snapshot, in one step."""
        core = self._core
        idle_ttl = self._runner.idle_ttl
        now: float | None = None
        infos: list[tuple[str, str, int, EntryInfo]] = []
        admitting = self._runner.remote.admitting()
        for entry in core.entries():
            state = entry.state
            # (a load granted here that waits for the shared broker's grant waits for
            # space; a promotion that waits for it is a demoted entry's, queued)
            waiting = bool(admitting) and entry in admitting
            if waiting and state is State.MOVING:
                state, waiting = State.DEMOTED, False
            idle = None
            # Only where an idle TTL applies is the end of a lease timed (``Lease.release``).
            if (
                state is State.READY
                and not entry.leases
                and (entry.ttl is not None or idle_ttl is not None)
            ):
                now = self._runner.clock() if now is None else now
                idle = max(0.0, now - entry.idle_since)
            loads, seconds = core.load_history.get((entry.cache, entry.key), (0, None))
            info = EntryInfo(
                cache=entry.cache,
                key=entry.key,
                state=State.WAITING.value if waiting else state.value,
                charge={} if waiting else dict(entry.charge),
                leases=entry.leases,
                waiting=core.waiters(entry),
                pinned=entry.pinned,
                priority=entry.priority,
                idle_seconds=idle,
                loads=loads,
                load_seconds=seconds,
                home=None if entry.home is None else dict(entry.home),
                moving_to=None
                if entry.target is None or state is not State.MOVING
                else dict(entry.target),
                promote_seconds=entry.promote_cost,
            )
            age = _AGES.index(State.WAITING if waiting else state)
            infos.append((entry.cache, _key_text(entry.key), -age, info))
        infos.sort(key=lambda item: item[:3])
        return [item[3] for item in infos]

    def export_sizes(self) -> dict[str, dict[Hashable, dict[str, int]]]:
        """The measured size of every key measured so far: ``{cache: {key: {space: bytes}}}``.

        Sizes are remembered across evictions (and closed caches), so a load
        sized by measurement reserves what its key weighed last time. Save
        them (with string keys they are plain JSON) and give them to the next
        broker as ``Broker(..., sizes=...)``. A plain method: it may be called
        after the broker's block has ended.
        """
        exported: dict[str, dict[Hashable, dict[str, int]]] = {}
        for (cache_name, key), charge in self._core.sizes.items():
            exported.setdefault(cache_name, {})[key] = dict(charge)
        return exported

    def stats_nowait(self) -> Stats:
        """The same snapshot as ``stats()``, for synchronous callers (metrics exporters)."""
        core = self._core
        counts = dict.fromkeys(State, 0)
        for entry in core.entries():
            counts[entry.state] += 1
        waiting = sum(len(entry.joiners) for entry in core.queue)
        used = {name: space.used for name, space in core.spaces.items()}
        # Loads granted here that wait for the shared broker's grant wait for
        # space, as queued requests do: counted so, and not in ``used``.
        # (A promotion started here that waits for its room there is a demoted
        # entry's queued promotion: only its room is not taken yet.)
        admitting = self._runner.remote.admitting()
        for entry in admitting:
            waiting += len(entry.joiners)
            if entry.state is State.LOADING:
                counts[State.LOADING] -= 1
                taken = entry.charge
            else:
                counts[State.MOVING] -= 1
                counts[State.DEMOTED] += 1
                taken = reserved(entry)
            for name, amount in taken.items():
                used[name] -= amount
        waiting_for_lease = sum(
            len(entry.joiners) for entry in core.busy if entry.state is State.READY
        )
        return Stats(
            entries=counts[State.LOADING]
            + counts[State.READY]
            + counts[State.MOVING]
            + counts[State.DEMOTED]
            + counts[State.RELEASING]
            + counts[State.QUARANTINED],
            used=used,
            budget={name: space.budget for name, space in core.spaces.items()},
            hits=core.hits,
            misses=core.misses,
            loads=core.loads,
            load_failures=core.load_failures,
            load_seconds=core.load_seconds,
            evictions=core.evictions[Reason.CAPACITY]
            + core.evictions[Reason.IDLE]
            + core.evictions[Reason.RETRY],
            oom_retries=core.oom_retries + self._runner.loads.shared_retries,
            aliases=tuple(core.aliases()),
            releases={reason.value: n for reason, n in core.evictions.items()},
            releases_failed=core.releases_failed,
            releases_timed_out=self._runner.releases.timeouts,
            releases_blocking=self._runner.releases.blocking,
            waiting=waiting,
            waiting_for_lease=waiting_for_lease,
            loading=counts[State.LOADING],
            ready=counts[State.READY],
            leased=sum(1 for entry in core.busy if entry.leases),
            releasing=counts[State.RELEASING],
            quarantined=counts[State.QUARANTINED],
            quarantined_keys=tuple((entry.owner.name, entry.key) for entry in core.quarantined),
            broker_used=self._runner.remote.shared_used,
            moving=counts[State.MOVING],
            demoted=counts[State.DEMOTED],
            demotions=core.demotions,
            promotions=core.promotions,
            moves_failed=core.moves_failed,
        )


#: The states an entry goes through, in order: of two entries of one key, the
#: one further along is the older.
_AGES = tuple(State)


def _key_text(key: Hashable) -> str:
    """``repr(key)``, which orders ``entries()`` (a key whose ``repr`` fails sorts by its type)."""
    try:
        return repr(key)
    except Exception:
        return f"<{type(key).__name__}>"


def check_running(broker: Broker) -> None:
    """Raise ``BrokerClosed`` unless ``broker`` runs, ``WrongEventLoop`` off its loop's thread."""
    broker._runner.check_running()
