"""The async shell: Broker, Cache, Lease — the actor around the sans-I/O core.

The loop is single-threaded, so the broker needs no mailbox: every public
operation runs its bookkeeping as one synchronous step on the ``Core`` (which
never awaits), then performs the effects the step queued — starting loads and
releases in the owners' task groups, waking waiters — before it awaits
anything. Steps are therefore atomic and served in the order the loop runs
them, and a cache hit costs a dictionary lookup and a counter, not a round
trip through a queue.

Loads and releases run as tasks of the owning ``broker.cache(...)`` block, so
a plugin's values are created and destroyed in its own context. Their
outcomes come back as further core steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import copy
import enum
import functools
import inspect
import itertools
import logging
import math
import numbers
import os
import time
import warnings
from collections.abc import (
    Awaitable,
    Callable,
    Coroutine,
    Generator,
    Hashable,
    Iterable,
    Iterator,
    Mapping,
)
from contextlib import AbstractAsyncContextManager
from threading import get_ident
from types import TracebackType
from typing import (
    Any,
    Generic,
    Protocol,
    SupportsIndex,
    TypeVar,
    assert_never,
    cast,
    overload,
    runtime_checkable,
)

import anyio
import anyio.abc
import anyio.to_thread

from . import _log_events as ev
from . import _logging
from ._core import (
    CancelLoad,
    Core,
    Entry,
    Owner,
    OwnerEmpty,
    Quarantined,
    Reason,
    Settled,
    StartLoad,
    StartRelease,
    State,
    Ticket,
)
from ._errors import (
    AcquireTimeout,
    BrokerClosed,
    BrokerError,
    DeadlockError,
    InvalidArgument,
    InvalidKey,
    LeaseReleased,
    LeasesOutstanding,
    LoadFailed,
    OutOfSpace,
    ReleaseFailed,
    WrongEventLoop,
)
from ._policies import Policy, make_policy
from ._sizes import parse_budget, parse_bytes, parse_size
from ._stats import EvictionReport, Stats
from ._units import DEFAULT_SPACE, format_bytes
from .probes import Probe

__all__ = ["Broker", "Cache", "Lease", "Releaser"]

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)

_READY = State.READY
#: Sizes checked once and remembered per cache (hashable, immutable).
_PLAIN = frozenset({int, str})
_DEBUG = logging.DEBUG

#: The entries whose loader the current task (or thread) runs: a request made
#: from inside a loader must not wait for a load that waits for that loader.
_LOADING: contextvars.ContextVar[tuple[Entry, ...]] = contextvars.ContextVar(
    "cachebroker_loading", default=()
)


@runtime_checkable
class Releaser(Protocol):
    """What a plugin implements so the broker can ask it to free a value.

    ``release`` runs in the plugin's own task group (its ``broker.cache(...)``
    block). Returning is the "freed" acknowledgement: the broker then counts
    the value's bytes as free and may hand them to another plugin. Raising, or
    not returning within the broker's ``release_timeout``, means the release
    failed: the entry is quarantined and its bytes stay charged.
    """

    async def release(self, key: Any, value: Any) -> None:
        """Free ``value``, the value loaded for ``key``.

        Return only once the memory is really free (for a GPU, once the
        framework's allocator gave it back). Cancellation: the broker cancels
        a release only when the plugin's cache block is torn down past
        ``release_timeout`` (for a value that a plain loader's thread returned
        after the block was left: when the broker is); the entry is then
        quarantined.
        """


ReleaseFunction = Callable[[Any, Any], Awaitable[None]]
#: ``listener(event, fields)``: see ``Broker.add_listener``.
Listener = Callable[[str, Mapping[str, Any]], None]
#: Bytes: an ``int`` (numpy integers too), a whole ``float``, or ``"3GiB"``.
Quantity = SupportsIndex | float | str
SizeSpec = Quantity | Mapping[str, Quantity] | Callable[[Any], Any] | None
BudgetValue = int | str | Probe | Callable[[], tuple[int, int]]


class _Slot:
    """What the shell keeps on an entry: how to load it and how to wake its waiters."""

    __slots__ = (
        "abandoned",
        "cancelled",
        "done",
        "is_async",
        "load",
        "measure",
        "queued_at",
        "release_started",
        "released",
        "scope",
        "thread_wait",
        "timed_out",
    )

    def __init__(
        self, load: Callable[[], Any], measure: Callable[[Any], Any] | None, now: float
    ) -> None:
        self.load = load
        self.is_async = _is_async_callable(load)
        self.measure = measure
        self.done = anyio.Event()
        self.released: anyio.Event | None = None
        self.scope: anyio.CancelScope | None = None
        self.cancelled = False
        #: The wait for a worker thread (``_load_in_thread``), and whether the
        #: closing cache gave the load up.
        self.thread_wait: anyio.CancelScope | None = None
        self.abandoned = False
        #: When the request that created the entry asked for space, when its
        #: release was requested, and whether that release timed out.
        self.queued_at = now
        self.release_started = now
        self.timed_out = False


class _ThreadCall:
    """A plain loader's run in a worker thread, awaited by a task of the broker."""

    __slots__ = ("done", "error", "load", "lost", "orphaned", "value")

    def __init__(self, load: Callable[[], Any]) -> None:
        self.load = load
        self.value: Any = None
        self.error: BaseException | None = None
        #: Set once the broker's task stopped waiting for the thread.
        self.done = anyio.Event()
        #: It stopped without the thread's outcome: it was cancelled with the broker.
        self.lost = False
        #: The load gave the thread up (its cache closed): the broker's task
        #: releases what the thread makes.
        self.orphaned = False

    def run(self) -> None:
        """The worker thread's function: keep the outcome, whatever it is, for the loop."""
        try:
            self.value = self.load()
        except BaseException as exc:  # raised again where the outcome is taken
            self.error = exc


class _Abandoned(BaseException):
    """The load was given up while its worker thread runs; the books say so already.

    A ``BaseException``, so that no ``oom_errors`` type (an ``Exception``) catches it.
    """


class _Fault(enum.Enum):
    """What the plugin's code (a loader, a size callable, a releaser) raised, for the books."""

    #: The broker's own cancellation of the task: the load is cancelled, the release failed.
    CANCELLED = "cancelled"
    #: An ordinary failure: an ``Exception``, or a ``CancelledError`` the broker did not cause.
    FAILED = "failed"
    #: A process-level event (``KeyboardInterrupt``, ``SystemExit``, any other
    #: ``BaseException``): booked as a failure, then propagated.
    FATAL = "fatal"


def _classify(exc: BaseException) -> _Fault:
    """Classify ``exc``, in the ``except`` clause of the task that ran the plugin's code.

    A ``CancelledError`` is the broker's own only when that task really is in
    a cancelled scope; one raised by a library (a cancelled inner future, an
    internal timeout on asyncio), or asyncio's on trio, is an ordinary failure.
    """
    if isinstance(exc, anyio.get_cancelled_exc_class()):
        cancelled = anyio.current_effective_deadline() == -math.inf
        return _Fault.CANCELLED if cancelled else _Fault.FAILED
    if isinstance(exc, Exception | asyncio.CancelledError):
        return _Fault.FAILED
    return _Fault.FATAL


async def _exit_task_group(
    tg: anyio.abc.TaskGroup,
    exc_type: type[BaseException] | None,
    exc: BaseException | None,
    tb: TracebackType | None,
) -> bool:
    """Exit a block's own task group so that what happened comes out as itself.

    The broker's and each cache's task group are an implementation detail;
    anyio wraps whatever leaves one in an exception group. What leaves the
    block instead is chosen by ``_outcome``: the body's own exception
    (``exc``; the caller returns ``False`` and it propagates untouched, its
    traceback, ``__cause__`` and ``__context__`` as the body set them), a
    single failure of the group's own tasks, raised as itself, or the group,
    for several independent failures at once.
    """
    try:
        return bool(await tg.__aexit__(exc_type, exc, tb))
    except BaseExceptionGroup as group:
        outcome = _outcome(group, exc)
        if outcome is group:
            raise
    if outcome is exc or outcome is None:
        return False
    context = outcome.__context__
    try:
        raise outcome
    finally:
        # Raised here, it would be chained to the body's exception (usually the
        # cancellation that this very failure caused): keep the chain it had.
        outcome.__context__ = context
        del outcome, context


def _outcome(group: BaseExceptionGroup[Any], body: BaseException | None) -> BaseException | None:
    """What leaves a block instead of ``group``, the exception group of its task group.

    ``body`` (the block's own exception, or ``None``) when that is all that
    happened; else the one failure of the group's tasks (a process-level
    exception of a loader, a size callable or a releaser); else ``group``
    itself. Not failures: cancellations (the task group's own doing, or an
    outer scope's, which cancels again at the next checkpoint), and on asyncio
    a ``KeyboardInterrupt`` or ``SystemExit`` of a task, which left through
    the event loop already (asyncio re-raises them from the loop); raised
    again from the main task, it would stop the runner's cleanup, leaving
    worker threads that hold the process at exit.
    """
    ignored: tuple[type[BaseException], ...] = (anyio.get_cancelled_exc_class(),)
    if _running_backend() == "asyncio":
        ignored += (KeyboardInterrupt, SystemExit)
    failures = [error for error in group.exceptions if not isinstance(error, ignored)]
    if body is not None and not isinstance(body, anyio.get_cancelled_exc_class()):
        return body if all(_same(error, body) for error in failures) else group
    if not failures:
        return body
    return failures[0] if len(failures) == 1 else group


def _same(error: BaseException, body: BaseException) -> bool:
    """Whether ``error`` is ``body``, or (trio copies groups it passes on) a copy of its group."""
    if error is body:
        return True
    if not isinstance(error, BaseExceptionGroup) or not isinstance(body, BaseExceptionGroup):
        return False
    return {id(leaf) for leaf in _leaves(error)} == {id(leaf) for leaf in _leaves(body)}


def _leaves(error: BaseException) -> Iterator[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            yield from _leaves(inner)
    else:
        yield error


def _is_async_callable(func: object) -> bool:
    if inspect.iscoroutinefunction(func):
        return True
    call = getattr(type(func), "__call__", None)  # noqa: B004 - instances with async __call__
    return call is not None and inspect.iscoroutinefunction(call) and not inspect.isroutine(func)


def _resolve_releaser(releaser: object) -> ReleaseFunction:
    method = getattr(releaser, "release", None)
    if method is not None and _is_async_callable(method):
        return cast(ReleaseFunction, method)
    if _is_async_callable(releaser):
        return cast(ReleaseFunction, releaser)
    raise TypeError(
        "releaser must be an object with an 'async def release(self, key, value)' method "
        f"or an async function (key, value) -> None, got {releaser!r}"
    )


def _current_task_getter(backend: str) -> Callable[[], object]:
    if backend == "trio":
        import trio

        return trio.lowlevel.current_task
    import asyncio
    import asyncio.tasks

    try:
        import _asyncio
    except ImportError:  # pragma: no cover - CPython always has it
        return asyncio.current_task
    c_current = getattr(_asyncio, "current_task", None)
    if c_current is not None and c_current is asyncio.current_task:
        return cast(Callable[[], object], c_current)
    # Python 3.11's asyncio.current_task() is written in Python and costs ~0.4 us,
    # and even get_running_loop() ~0.2 us: a broker lives on one loop, so read
    # that loop's entry in the current-task table directly (~0.05 us).
    table = getattr(asyncio.tasks, "_current_tasks", None)
    if not isinstance(table, dict):
        return asyncio.current_task
    loop = asyncio.get_running_loop()
    return functools.partial(table.get, loop)


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
            of these. A single quantity means one space named
            ``"default"``. A budget of 0 everywhere turns retention off: every
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
            (the larger budget) and evict from each other.
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

    .. versionadded:: 0.1.0
    """

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
    ) -> None:
        budget, self._probes = _split_probes(budget)
        spaces = parse_budget(budget)
        self._memory_wait = _positive_seconds(memory_wait, "memory_wait") if memory_wait else None
        self._probe_interval = _positive_seconds(probe_interval, "probe_interval")
        self._oom_errors = _oom_error_types(oom_errors)
        if isinstance(oom_retries, bool) or not isinstance(oom_retries, int) or oom_retries < 0:
            raise InvalidArgument(f"oom_retries must be a non-negative int, got {oom_retries!r}")
        self._oom_retries = oom_retries
        self._idle_ttl = _positive_seconds(idle_ttl, "idle_ttl", inf_is_none=True)
        self._release_timeout = _positive_seconds(
            release_timeout, "release_timeout", inf_is_none=True
        )
        self._blocking_warning = _positive_seconds(
            blocking_warning, "blocking_warning", inf_is_none=True
        )
        self._releases_blocking = 0
        self._lease_warning = _positive_seconds(lease_warning, "lease_warning", inf_is_none=True)
        #: Leased entries seen in a space that requests wait for, and since
        #: when; those already reported.
        self._held: dict[Entry, float] = {}
        self._held_reported: set[Entry] = set()
        if clock is not None and not callable(clock):
            raise TypeError(f"clock must be a callable returning seconds, got {clock!r}")
        self._core = Core(
            spaces,
            make_policy(policy),
            idle_ttl=self._idle_ttl,
            retain=True if self._probes else None,
        )
        if isinstance(alias_threshold, bool) or not isinstance(alias_threshold, int):
            raise TypeError(f"alias_threshold must be an int, got {alias_threshold!r}")
        if alias_threshold < 1:
            raise InvalidArgument(f"alias_threshold must be at least 1, got {alias_threshold}")
        self._alias_threshold = alias_threshold
        for cache_name, key, charge in _remembered_sizes(sizes, spaces):
            self._core.remember(cache_name, key, charge)
        for group in _alias_groups(aliases, spaces):
            for name in group[1:]:
                self._core.merge_spaces(group[0], name)
        self._budget = dict(spaces)
        self._user_clock = clock
        self._clock: Callable[[], float] = clock or _unstarted_clock
        self._logger = _logging.check_logger(logger)
        self._log: Any = None
        self._caches: dict[Owner, Cache] = {}
        self._tg: anyio.abc.TaskGroup | None = None
        self._running = False
        self._current_task: Callable[[], object] = _unstarted_task
        #: The thread whose event loop runs the broker, and a thread-safe way
        #: to have that loop call a function soon.
        self._thread = -1
        self._call_soon: Callable[..., object] = _unstarted_task
        self._checkpoint: Callable[[], Awaitable[None]] | None = None
        # Whether the hit path builds its debug event at all. Asking the logger on
        # every hit costs ~60 ns, 5% of a hit, so the answer is re-read at every
        # other step instead: the start, each acquire that is not a hit, each
        # event logged. A level raised at runtime shows on hits after the next one.
        self._debug_check: Callable[[int], bool] = _logging.debug_check(None)
        self._trace = False
        self._sweep_at: float | None = None
        self._releasing_tasks: set[object] = set()
        #: Leases garbage-collected while held and not ended yet (``_lease_dropped``).
        self._dropped: dict[int, tuple[Entry, object]] = {}
        self._drop_ids = itertools.count()
        self._listeners: list[Listener] = []
        self._release_timeouts = 0
        #: Probed spaces that have had a good reading.
        self._probe_ok: set[str] = set()
        self._refresh_probes()
        self._sweep_wake: anyio.Event | None = None

    # ------------------------------------------------------------ life cycle

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Broker:
        """Build a broker from ``CACHEBROKER_*`` environment variables.

        ``CACHEBROKER_BUDGET`` is required: ``"24GiB"`` or
        ``"ram=16GiB,cuda:0=24GiB"``. ``CACHEBROKER_IDLE_TTL`` is seconds
        (0 = off) and ``CACHEBROKER_POLICY`` a policy name. Keyword arguments
        override the environment. A malformed value raises ``InvalidArgument``
        naming the variable and the value.
        """
        env = os.environ if environ is None else environ
        kwargs: dict[str, Any] = {}
        raw = env.get("CACHEBROKER_BUDGET")
        if "budget" not in overrides:
            if raw is None or not raw.strip():
                raise InvalidArgument(
                    "CACHEBROKER_BUDGET is not set; set it to e.g. '24GiB' or "
                    "'ram=16GiB,cuda:0=24GiB'"
                )
            kwargs["budget"] = _env_value("CACHEBROKER_BUDGET", raw, _parse_env_budget)
        raw = env.get("CACHEBROKER_IDLE_TTL")
        if raw is not None and raw.strip():
            kwargs["idle_ttl"] = _env_value("CACHEBROKER_IDLE_TTL", raw, _parse_env_ttl)
        raw = env.get("CACHEBROKER_POLICY")
        if raw is not None and raw.strip():
            kwargs["policy"] = _env_value("CACHEBROKER_POLICY", raw, _parse_env_policy)
        kwargs.update(overrides)
        return cls(**kwargs)

    async def __aenter__(self) -> Broker:
        """Start the broker: its task group and idle sweeper run until the block ends.

        Cancellation: nothing to undo; the broker was not started.
        """
        if self._running or self._core.closed:
            raise RuntimeError("a Broker can be entered only once")
        backend = _running_backend()
        self._current_task = _current_task_getter(backend)
        self._thread = get_ident()
        self._call_soon = _call_soon_threadsafe(backend)
        if backend == "trio":
            self._checkpoint = _trio_hit_checkpoint()
        if self._user_clock is None:
            self._clock = _loop_clock(backend)
        self._log = _logging.open_events(self._logger)
        self._debug_check = _logging.debug_check(self._log)
        self._trace = self._debug_check(_DEBUG)
        self._sweep_wake = anyio.Event()
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        self._running = True
        tg.start_soon(self._sweeper, name="cachebroker idle sweeper")
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
        tg = self._tg
        assert tg is not None
        try:
            with anyio.CancelScope(shield=True):
                for cache in list(self._caches.values()):
                    await cache._shut(BrokerClosed("the broker was closed"))
                await self._await_orphans()
        finally:
            self._running = False
            self._core.closed = True
            tg.cancel_scope.cancel()
            suppressed = await _exit_task_group(tg, exc_type, exc, tb)
        return suppressed

    def cache(
        self, name: str, releaser: Releaser | ReleaseFunction
    ) -> AbstractAsyncContextManager[Cache]:
        """Open a plugin's view of the broker: ``async with broker.cache(name, releaser) as cache``.

        The block runs a task group in which this cache's loads and releases
        run. Keys are per cache. Leaving the block releases the cache's entries
        through ``releaser``, waiting (bounded by ``release_timeout``) for
        leases still held; see ``Cache`` for the rules. Cancellation: entering
        is not a cancellation point of its own; leaving is shielded up to
        ``release_timeout``, so the entries are released even when the block
        is cancelled.
        """
        if not isinstance(name, str) or not name:
            raise TypeError(f"cache name must be a non-empty string, got {name!r}")
        return _CacheBlock(self, name, _resolve_releaser(releaser))

    # -------------------------------------------------------- operations

    async def evict_idle(self) -> EvictionReport:
        """Release every entry idle for at least ``idle_ttl``; wait for the acknowledgements.

        Without an ``idle_ttl`` nothing is idle long enough and the report is
        empty. Cancellation stops the wait, not the releases already asked for.
        """
        self._check_running()
        expired = self._core.sweep(self._clock())
        self._apply()
        return await self._await_releases(expired)

    async def clear(self) -> EvictionReport:
        """Release every loaded entry of every cache; leased ones go when their last lease ends.

        Waits for the acknowledgements of the entries that were idle.
        Cancellation stops the wait, not the releases already asked for.
        """
        self._check_running()
        core = self._core
        before = {entry for entry in core.entries() if entry.state is State.READY}
        core.clear()
        self._apply()
        started = [entry for entry in before if entry.state is State.RELEASING]
        return await self._await_releases(started)

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
        self._check_running()
        core = self._core
        written_off = [
            entry for entry in core.quarantined if entry.owner.name == cache and entry.key == key
        ]
        for entry in written_off:
            core.forget(entry)
            self._emit(
                "warning", ev.QUARANTINE_FORGOTTEN, cache=cache, key=key, bytes=dict(entry.charge)
            )
        self._apply()
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
        self._listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        """Stop calling ``listener``; a listener that is not registered is ignored."""
        with contextlib.suppress(ValueError):
            self._listeners.remove(listener)

    def _since(self, start: float) -> float:
        """Seconds from ``start`` to now, rounded for the events."""
        return round(max(0.0, self._clock() - start), 6)

    def _emit(self, level: str, event: str, **fields: Any) -> None:
        """Log ``event`` at ``level`` and hand it to the listeners."""
        self._trace = self._debug_check(_DEBUG)
        getattr(self._log, level)(event, **fields)
        for listener in tuple(self._listeners):
            try:
                listener(event, fields)
            except Exception as exc:
                self.remove_listener(listener)
                self._log.error(
                    ev.LISTENER_FAILED, listener=repr(listener), event_name=event, error=repr(exc)
                )

    async def stats(self) -> Stats:
        """Return a snapshot of the books (see ``Stats``).

        The snapshot is taken in one step; the call is a checkpoint, so it may
        raise the caller's cancellation, and nothing else.
        """
        await anyio.lowlevel.checkpoint()
        return self.stats_nowait()

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
        return Stats(
            entries=counts[State.LOADING]
            + counts[State.READY]
            + counts[State.RELEASING]
            + counts[State.QUARANTINED],
            used={name: space.used for name, space in core.spaces.items()},
            budget={name: space.budget for name, space in core.spaces.items()},
            hits=core.hits,
            misses=core.misses,
            loads=core.loads,
            load_failures=core.load_failures,
            load_seconds=core.load_seconds,
            evictions=core.evictions[Reason.CAPACITY]
            + core.evictions[Reason.IDLE]
            + core.evictions[Reason.RETRY],
            oom_retries=core.oom_retries,
            aliases=tuple(core.aliases()),
            releases={reason.value: n for reason, n in core.evictions.items()},
            releases_failed=core.releases_failed,
            releases_timed_out=self._release_timeouts,
            releases_blocking=self._releases_blocking,
            waiting=waiting,
            loading=counts[State.LOADING],
            ready=counts[State.READY],
            leased=sum(1 for entry in core.busy if entry.leases),
            releasing=counts[State.RELEASING],
            quarantined=counts[State.QUARANTINED],
            quarantined_keys=tuple((entry.owner.name, entry.key) for entry in core.quarantined),
        )

    # ------------------------------------------------------------ internals

    def _check_running(self) -> None:
        if not self._running:
            raise BrokerClosed(
                "the broker is not running; use it inside 'async with Broker(...) as broker'"
            )
        if get_ident() != self._thread:
            raise self._wrong_thread("used")

    def _wrong_thread(self, what: str) -> WrongEventLoop:
        return WrongEventLoop(
            f"this broker runs on the event loop of another thread and was {what} from "
            "this one: its books are not thread-safe; call into it on its own loop, e.g. "
            "with anyio.from_thread.run() or asyncio.run_coroutine_threadsafe()"
        )

    def _end_lease(self, entry: Entry, task: object) -> None:
        """End a lease on the broker's loop (called soon, from any thread)."""
        self._core.lease_end(entry, task, self._clock())
        self._apply()
        if not entry.leases:
            self._note_idle(entry)

    def _lease_dropped(self, entry: Entry, task: object, key: Hashable) -> None:
        """A held lease was garbage-collected: end it on the broker's loop, and warn.

        Not here: a collection may run inside a step of the books, or in
        another thread. A callback ends it soon; the next request that is not
        a hit ends it first (``_end_dropped``), so that the dropping task,
        asking again at once, is not told that its own lease is in the way.
        """
        token = next(self._drop_ids)
        self._dropped[token] = (entry, task)
        with contextlib.suppress(Exception):  # the loop is gone: so are the books' users
            self._call_soon(self._end_dropped, token)
        warnings.warn(
            f"a lease on {entry.cache}:{key!r} was garbage-collected while held; it was "
            "ended for you, but end leases with 'async with cache.acquire(...)' or "
            "'await lease.release()'",
            ResourceWarning,
            stacklevel=2,
        )

    def _end_dropped(self, token: int | None = None) -> None:
        """End the dropped lease ``token`` if it is still pending, or (``None``) every one."""
        for pending in list(self._dropped) if token is None else [token]:
            dropped = self._dropped.pop(pending, None)
            if dropped is not None:
                self._end_lease(*dropped)

    def _apply(self) -> None:
        """Perform the effects queued by the core's last steps (never awaits)."""
        core = self._core
        while core.effects:
            effects, core.effects = core.effects, []
            for effect in effects:
                match effect:
                    case Settled(entry):
                        slot = entry.shell
                        slot.done.set()
                        if entry.joiners:  # one requester was refused alone: the rest wait on
                            slot.done = anyio.Event()
                    case StartLoad(entry):
                        self._start_load(entry)
                    case StartRelease(entry, reason):
                        self._start_release(entry, reason)
                    case CancelLoad(entry):
                        slot = entry.shell
                        slot.cancelled = True
                        if slot.scope is not None:
                            slot.scope.cancel()
                        if entry.owner.closing:
                            # Its cache closes: stop waiting for a worker thread, which
                            # cannot be stopped (see _load_in_thread).
                            slot.abandoned = True
                            if slot.thread_wait is not None:
                                slot.thread_wait.cancel()
                    case Quarantined(entry):
                        slot = entry.shell
                        self._emit(
                            "error",
                            ev.RELEASE_FAILED,
                            cache=entry.owner.name,
                            key=entry.key,
                            error=repr(entry.error),
                            timed_out=slot.timed_out,
                            seconds=self._since(slot.release_started),
                            bytes=dict(entry.charge),
                        )
                    case OwnerEmpty(owner):
                        cache = self._caches.get(owner)
                        if cache is not None:
                            cache._empty.set()
                    case _:
                        assert_never(effect)

    def _start_load(self, entry: Entry) -> None:
        cache = self._caches[entry.owner]
        slot: _Slot = entry.shell
        self._emit(
            "debug",
            ev.GRANT,
            cache=cache.name,
            key=entry.key,
            bytes=dict(entry.charge),
            waited=self._since(slot.queued_at),
        )
        cache._spawn(self._run_load, entry, name=f"cachebroker load {cache.name}:{entry.key!r}")

    async def _run_load(self, entry: Entry) -> None:
        _LOADING.set((*_LOADING.get(), entry))  # (this task's own context)
        slot: _Slot = entry.shell
        core = self._core
        cache_name = entry.owner.name
        with anyio.CancelScope() as scope:
            slot.scope = scope
            if slot.cancelled:
                scope.cancel()
            self._emit(
                "info", ev.LOAD_START, cache=cache_name, key=entry.key, bytes=dict(entry.charge)
            )
            started = self._clock()
            try:
                value = await self._load_freeing_on_oom(entry, slot)
            except _Abandoned:
                return  # booked by _abandon
            except BaseException as exc:
                if self._load_failed(entry, exc):
                    raise
                return
            seconds = max(0.0, self._clock() - started)
            measured, error, fatal = self._measure(entry, slot, value)
            core.load_done(entry, value, measured, seconds, self._clock(), error=error)
            if fatal is not None:
                # No time is left to release the value through its owner: it is
                # quarantined before its release starts (see _start_release).
                core.release_failed(
                    entry,
                    ReleaseFailed(
                        f"{cache_name}:{entry.key!r} was not released: "
                        f"its size callable raised {fatal!r}"
                    ),
                )
            if entry.idle_seq:
                self._note_idle(entry)
            self._emit(
                "info",
                ev.LOAD_DONE,
                cache=cache_name,
                key=entry.key,
                seconds=round(seconds, 6),
                bytes=dict(entry.charge),
            )
            self._apply()
            if fatal is not None:
                raise fatal

    def _load_failed(self, entry: Entry, exc: BaseException) -> bool:
        """Book a load that raised ``exc``; return whether ``exc`` must propagate.

        The broker's own cancellation cancels the load. Anything else fails it
        for every requester: they get the loader's exception, or, for what is
        no ordinary error (a ``CancelledError`` not meant for the broker, a
        process-level ``BaseException``), a ``LoadFailed`` chained to it.
        """
        fault = _classify(exc)
        cache_name = entry.owner.name
        if fault is _Fault.CANCELLED:
            self._emit("info", ev.LOAD_CANCELLED, cache=cache_name, key=entry.key)
            cancelled = BrokerClosed(f"the load of {cache_name}:{entry.key!r} was cancelled")
            self._core.load_failed(entry, cancelled, cancelled=True)
        else:
            self._emit("warning", ev.LOAD_FAILED, cache=cache_name, key=entry.key, error=repr(exc))
            error = exc
            if not isinstance(exc, Exception):
                error = LoadFailed(f"loading {cache_name}:{entry.key!r} raised {exc!r}")
                error.__cause__ = exc
            self._core.load_failed(entry, error)
        self._apply()
        return fault is not _Fault.FAILED

    async def _load_freeing_on_oom(self, entry: Entry, slot: _Slot) -> Any:
        """Run the loader; on an out-of-memory error free the next victim and retry.

        Bounded by ``oom_retries``; when nothing is left to free (or the bound
        is reached) raises ``OutOfSpace`` chained to the last out-of-memory error.
        """
        retries = 0
        freed: set[str] = set()
        while True:
            try:
                if slot.is_async:
                    value = await slot.load()
                else:
                    value = await self._load_in_thread(entry, slot)
            except self._oom_errors as exc:
                victims = self._core.free_for_retry(entry) if retries < self._oom_retries else []
                self._apply()
                if not victims:
                    why = (
                        "nothing is left to free"
                        if retries < self._oom_retries
                        else f"{retries} retries after freeing did not help"
                    )
                    raise OutOfSpace(
                        f"loading {entry.owner.name}:{entry.key!r} ran out of memory and {why}"
                    ) from exc
                retries += 1
                self._emit(
                    "warning",
                    ev.LOAD_RETRY,
                    cache=entry.owner.name,
                    key=entry.key,
                    attempt=retries,
                    error=repr(exc),
                    freed=[(v.owner.name, v.key) for v in victims],
                )
                freed = {name for victim in victims for name in victim.charge}
                for victim in victims:
                    released = victim.shell.released
                    if released is not None:
                        await released.wait()
            else:
                if retries and entry.charge:
                    self._learn_aliases(freed - set(entry.charge), entry)
                return value

    def _learn_aliases(self, freed: set[str], entry: Entry) -> None:
        """The load fit only after freeing in ``freed``: evidence of one memory."""
        if not freed:
            return
        merged = self._core.note_alias_evidence(freed, entry.charge, self._alias_threshold)
        for keep, other in merged:
            self._emit(
                "warning",
                ev.ALIAS_LEARNED,
                spaces=[keep, other],
                evidence=self._alias_threshold,
                cache=entry.owner.name,
                key=entry.key,
            )
        self._apply()

    async def _load_in_thread(self, entry: Entry, slot: _Slot) -> Any:
        """Run a plain loader in a worker thread, awaited by a task of the broker.

        A thread cannot be interrupted. Its requesters leaving does not stop the
        wait: the load keeps what the thread makes (see ``Core.load_done``).
        Its cache closing does: the load is abandoned so that the cache's exit
        is not held, and the broker's task releases the value through the
        cache's releaser once the thread returns (``_await_thread``).
        """
        await anyio.lowlevel.checkpoint_if_cancelled()  # no thread for a load cancelled already
        call = _ThreadCall(slot.load)
        # Started from this task, so the thread runs in this load's context.
        self._spawn(
            self._await_thread,
            self._caches[entry.owner],
            entry,
            call,
            name=f"cachebroker thread {entry.owner.name}:{entry.key!r}",
        )
        with anyio.CancelScope(shield=True) as waiting:
            slot.thread_wait = waiting
            if slot.abandoned:
                waiting.cancel()
            await call.done.wait()
        slot.thread_wait = None
        if call.lost or not call.done.is_set():
            self._abandon(entry, call)
            raise _Abandoned
        if call.error is not None:
            raise call.error
        value = call.value
        if inspect.isawaitable(value):
            # ``load=lambda: load_model(name)``: a plain callable handing back a coroutine.
            try:
                return await value
            except BaseException:
                if inspect.iscoroutine(value):
                    value.close()
                raise
        return value

    def _abandon(self, entry: Entry, call: _ThreadCall) -> None:
        """Give up a load whose worker thread still runs: its cache closes (or the broker did).

        The entry stays charged, ``releasing``, until the thread returns and the
        broker's task releases what it made. When that task is gone already
        (cancelled with the broker), nobody will: the entry is quarantined.
        """
        call.orphaned = True
        slot: _Slot = entry.shell
        slot.released = anyio.Event()
        slot.release_started = self._clock()
        self._emit("info", ev.LOAD_CANCELLED, cache=entry.owner.name, key=entry.key)
        self._core.load_abandoned(entry)
        self._emit(
            "info",
            ev.RELEASE_REQUESTED,
            cache=entry.owner.name,
            key=entry.key,
            reason=Reason.CLOSE.value,
            bytes=dict(entry.charge),
        )
        if call.lost:
            self._quarantine_lost(entry)
        else:
            self._apply()

    async def _await_thread(self, cache: Cache, entry: Entry, call: _ThreadCall) -> None:
        """Await a plain loader's worker thread, as a task of the broker (it may outlive the cache).

        The load takes the outcome. Once the load was abandoned, what the thread
        made is released here, through the cache's releaser. Cancelled with the
        broker, it leaves the thread to itself.
        """
        try:
            await anyio.to_thread.run_sync(call.run, abandon_on_cancel=True)
        except BaseException:
            call.lost = True
            if call.orphaned:
                self._quarantine_lost(entry)
            raise
        finally:
            call.done.set()
        if call.orphaned:
            await self._release_orphan(cache, entry, call)

    async def _release_orphan(self, cache: Cache, entry: Entry, call: _ThreadCall) -> None:
        """Release what an abandoned load's thread made, now that it returned."""
        value = call.value
        if call.error is None and not inspect.isawaitable(value):
            entry.value = value
            await self._run_release(cache, entry, self._spawn)
            return
        # Nothing was made (the loader raised, or handed back an awaitable that
        # nobody will run): nothing is left to free.
        if inspect.iscoroutine(value):
            value.close()
        if call.error is not None:
            self._emit(
                "warning",
                ev.LOAD_FAILED,
                cache=entry.owner.name,
                key=entry.key,
                error=repr(call.error),
            )
        self._core.release_done(entry)
        self._apply()
        entry.shell.released.set()
        if call.error is not None and _classify(call.error) is _Fault.FATAL:
            raise call.error

    def _quarantine_lost(self, entry: Entry) -> None:
        """An abandoned load's thread can no longer be waited for: nobody will release its value."""
        self._core.release_failed(
            entry,
            ReleaseFailed(
                f"the broker was closed before the threaded load of "
                f"{entry.owner.name}:{entry.key!r} returned; what it makes is not released"
            ),
        )
        self._apply()
        entry.shell.released.set()

    async def _await_orphans(self) -> None:
        """Wait (at most ``release_timeout``) for abandoned loads' threads, and their releases."""
        limit = self._release_timeout
        with anyio.move_on_after(math.inf if limit is None else limit):
            for entry in list(self._core.orphans):
                await entry.shell.released.wait()

    def _spawn(
        self, func: Callable[..., Awaitable[Any]], *args: Any, name: str | None = None
    ) -> None:
        """Start ``func(*args)`` in the broker's own task group, in the current context."""
        assert self._tg is not None
        start_soon = cast(Callable[..., None], self._tg.start_soon)
        start_soon(func, *args, name=name)

    def _measure(
        self, entry: Entry, slot: _Slot, value: Any
    ) -> tuple[dict[str, int] | None, BaseException | None, BaseException | None]:
        """The measured size, else the error for the requesters, and what must propagate."""
        if slot.measure is None:
            return None, None, None
        try:
            return parse_size(slot.measure(value), self._budget), None, None
        except BaseException as exc:
            what = f"the size callable for {entry.owner.name}:{entry.key!r}"
            error: BrokerError
            if isinstance(exc, Exception):
                error = InvalidArgument(f"{what} failed on the loaded value: {exc}")
            else:
                error = LoadFailed(f"{what} raised {exc!r}")
            error.__cause__ = exc
            return None, error, exc if _classify(exc) is _Fault.FATAL else None

    def _start_release(self, entry: Entry, reason: Reason) -> None:
        cache = self._caches.get(entry.owner)
        slot: _Slot = entry.shell
        slot.released = anyio.Event()
        slot.release_started = self._clock()
        if entry.state is State.QUARANTINED:  # given up before it could start (_run_load)
            slot.released.set()
            return
        if cache is None or cache._closed:
            # The owner's block is gone: nobody is left to free the value.
            self._core.release_failed(
                entry,
                ReleaseFailed(
                    f"cache {entry.owner.name!r} was closed before "
                    f"{entry.owner.name}:{entry.key!r} could be released"
                ),
            )
            slot.released.set()
            return
        self._emit(
            "info",
            ev.RELEASE_REQUESTED,
            cache=cache.name,
            key=entry.key,
            reason=reason.value,
            bytes=dict(entry.charge),
        )
        cache._spawn(
            self._run_release, cache, entry, name=f"cachebroker release {cache.name}:{entry.key!r}"
        )

    async def _run_release(
        self, cache: Cache, entry: Entry, spawn: Callable[..., None] | None = None
    ) -> None:
        """Ask ``cache``'s releaser to free ``entry``, watched by ``release_timeout``.

        The watchdog runs in the cache's task group, or through ``spawn``.
        """
        core = self._core
        slot: _Slot = entry.shell
        watchdog = anyio.CancelScope()
        if self._release_timeout is not None:
            (spawn or cache._spawn)(self._watch_release, entry, watchdog, self._release_timeout)
        task = self._current_task()
        self._releasing_tasks.add(task)
        try:
            probed = self._free_before(entry)
            await self._released(cache, entry)
            if probed:
                await self._wait_for_memory(entry, probed)
        except BaseException as exc:
            if self._release_failed(entry, exc):
                raise
        else:
            entry.value = None
            late = entry.state is State.QUARANTINED
            core.release_done(entry)
            self._emit(
                "info",
                ev.RELEASE_FREED,
                cache=cache.name,
                key=entry.key,
                bytes=dict(entry.charge),
                late=late,
                seconds=self._since(slot.release_started),
            )
        finally:
            self._releasing_tasks.discard(task)
            if not self._releasing_tasks:
                self._releasing_tasks.clear()  # give the emptied table back
            watchdog.cancel()
            self._apply()
            assert slot.released is not None
            slot.released.set()

    async def _released(self, cache: Cache, entry: Entry) -> None:
        """Run the releaser; warn if one of its steps blocked the event loop too long."""
        release = cache._release(entry.key, entry.value)
        limit = self._blocking_warning
        if limit is None or not inspect.iscoroutine(release):
            await release
            return
        timed = _TimedSteps(release)
        try:
            await timed
        finally:
            if timed.longest > limit:
                self._releases_blocking += 1
                self._emit(
                    "warning",
                    ev.RELEASE_BLOCKING,
                    cache=cache.name,
                    key=entry.key,
                    seconds=round(timed.longest, 6),
                    limit=limit,
                )

    def _release_failed(self, entry: Entry, exc: BaseException) -> bool:
        """Book a release that raised ``exc`` (quarantined); return whether it must propagate."""
        fault = _classify(exc)
        if fault is _Fault.CANCELLED:
            failure = ReleaseFailed(f"releasing {entry.owner.name}:{entry.key!r} was cancelled")
        else:
            failure = ReleaseFailed(f"releasing {entry.owner.name}:{entry.key!r} raised {exc!r}")
            failure.__cause__ = exc
        self._core.release_failed(entry, failure)
        return fault is not _Fault.FAILED

    def _free_before(self, entry: Entry) -> dict[str, int]:
        """Free bytes of ``entry``'s probed spaces before its release, to wait for them after.

        A space whose probe cannot be read now is not waited for.
        """
        if not self._memory_wait:
            return {}
        before: dict[str, int] = {}
        for name in entry.charge:
            if name in self._probes:
                reading = self._read_probe(name)
                if reading is not None:
                    before[name] = reading[1]
        return before

    async def _watch_release(self, entry: Entry, scope: anyio.CancelScope, timeout: float) -> None:
        with scope:
            await anyio.sleep(timeout)
            entry.shell.timed_out = True
            self._release_timeouts += 1
            self._core.release_failed(
                entry,
                ReleaseFailed(
                    f"releasing {entry.owner.name}:{entry.key!r} was not acknowledged "
                    f"within {timeout:g}s"
                ),
            )
            self._apply()
            entry.shell.released.set()

    async def _await_releases(self, entries: list[Entry]) -> EvictionReport:
        freed = failed = 0
        for entry in entries:
            released = entry.shell.released
            if released is not None:
                await released.wait()
            if entry.state is State.QUARANTINED:
                failed += 1
            else:
                freed += sum(entry.charge.values())
        await anyio.lowlevel.checkpoint()
        return EvictionReport(entries=len(entries) - failed, bytes=freed, failed=failed)

    async def _sweeper(self) -> None:
        core = self._core
        while True:
            deadline = core.next_expiry()
            self._sweep_at = deadline
            wake = self._sweep_wake = anyio.Event()
            delay = math.inf if deadline is None else max(0.0, deadline - self._clock())
            if self._probes:
                delay = min(delay, self._probe_interval or math.inf)
            if core.queue and self._lease_warning is not None:
                delay = min(delay, self._lease_warning / 4)
            with anyio.move_on_after(delay):
                await wake.wait()
            if self._probes:
                self._refresh_probes()
            core.sweep(self._clock())
            self._apply()
            self._check_held_leases()

    def _check_held_leases(self) -> None:
        """Report leases held for ``lease_warning`` seconds while requests wait for their space.

        Checked by the sweeper (woken when a request starts waiting, then every
        quarter of the threshold while any waits): a lease counts from the
        first check that saw it in a space somebody waits for, and is
        reported once while it stays so.
        """
        limit = self._lease_warning
        core = self._core
        if limit is None or not core.queue:
            self._held.clear()
            self._held_reported.clear()
            return
        now = self._clock()
        waited = {name for entry in core.queue for name in entry.need}
        held: dict[Entry, float] = {}
        for entry in core.busy:
            if entry.leases and not waited.isdisjoint(entry.charge):
                since = held[entry] = self._held.get(entry, now)
                if now - since >= limit and entry not in self._held_reported:
                    self._held_reported.add(entry)
                    self._emit(
                        "warning",
                        ev.LEASE_HELD,
                        cache=entry.owner.name,
                        key=entry.key,
                        holders=[_task_name(task) for task in entry.holders],
                        seconds=round(now - since, 3),
                        waiting=sum(
                            len(w.joiners)
                            for w in core.queue
                            if not w.need.keys().isdisjoint(entry.charge)
                        ),
                    )
        self._held = held
        self._held_reported &= held.keys()

    def _refresh_probes(self) -> None:
        """Re-read every probed space's device and set its capacity.

        A space whose read fails keeps the capacity its last good reading gave;
        with no good reading yet, it is taken as full (what is used now).
        """
        core = self._core
        for name, probe in self._probes.items():
            reading = self._read_probe(name)
            held = core.spaces[name].used
            if reading is not None:
                total, free = reading
                capacity = max(0, min(total - probe.headroom, free + held - probe.headroom))
                core.set_capacity(name, capacity, limit=total - probe.headroom)
            elif name not in self._probe_ok:
                core.set_capacity(name, held)
        if self._running:
            self._apply()

    def _read_probe(self, name: str) -> tuple[int, int] | None:
        """Read space ``name``'s probe: ``(total, free)`` bytes, or ``None`` if the read failed.

        A failed read (a transient NVML or psutil error) is logged, never
        raised: the caller keeps what it knew, or stops waiting, and the probe
        is read again next time.
        """
        probe = self._probes[name]
        try:
            reading = probe.read()
        except Exception as exc:
            fields = {"space": name, "probe": probe.name, "error": repr(exc)}
            if self._log is None:  # from __init__: the broker has not bound its logger yet
                _logging.open_events(self._logger).warning(ev.PROBE_FAILED, **fields)
            else:
                self._emit("warning", ev.PROBE_FAILED, **fields)
            return None
        self._probe_ok.add(name)
        return reading

    async def _wait_for_memory(self, entry: Entry, before: dict[str, int]) -> None:
        """After a release on probed spaces, wait (bounded) for the device to show it."""
        wanted = {
            name: free + int(0.75 * entry.charge.get(name, 0)) for name, free in before.items()
        }
        with anyio.move_on_after(self._memory_wait or 0):
            while True:
                short: dict[str, int] = {}
                for name, need in wanted.items():
                    reading = self._read_probe(name)
                    if reading is None:
                        return  # the device cannot be read: do not wait for it
                    if reading[1] < need:
                        short[name] = need
                if not short:
                    return
                await anyio.sleep(0.02)
        self._emit(
            "warning",
            ev.MEMORY_SLOW,
            cache=entry.owner.name,
            key=entry.key,
            spaces=sorted(short),
            waited=self._memory_wait,
        )

    def _note_idle(self, entry: Entry) -> None:
        """Wake the sweeper if ``entry`` expires before its current deadline."""
        ttl = self._idle_ttl if entry.ttl is None else entry.ttl
        if ttl is None or ttl == math.inf or self._sweep_wake is None:
            return
        if self._sweep_at is None or entry.idle_since + ttl < self._sweep_at:
            self._sweep_wake.set()


class _CacheBlock:
    """The async context manager returned by ``Broker.cache``."""

    __slots__ = ("_broker", "_cache", "_name", "_releaser")

    def __init__(self, broker: Broker, name: str, releaser: ReleaseFunction) -> None:
        self._broker = broker
        self._name = name
        self._releaser = releaser
        self._cache: Cache | None = None

    async def __aenter__(self) -> Cache:
        broker = self._broker
        broker._check_running()
        owner = broker._core.open_owner(self._name)
        tg = anyio.create_task_group()
        try:
            await tg.__aenter__()
        except BaseException:
            broker._core.forget_owner(owner)
            raise
        cache = self._cache = Cache(broker, owner, self._releaser, tg)
        broker._caches[owner] = cache
        return cache

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        cache = self._cache
        assert cache is not None
        try:
            with anyio.CancelScope(shield=True):
                outstanding = await cache._shut(BrokerClosed(f"cache {cache.name!r} was closed"))
                if outstanding:
                    # Nobody is left to release them: they stay charged, visible
                    # and forgettable (quarantined); their holders keep the values.
                    self._broker._core.abandon(cache._owner)
                    self._broker._apply()
        finally:
            cache._closed = True
            cache._tg.cancel_scope.cancel()
            broker = self._broker
            try:
                suppressed = await _exit_task_group(cache._tg, exc_type, exc, tb)
            finally:
                broker._caches.pop(cache._owner, None)
                broker._core.forget_owner(cache._owner)
        if outstanding and exc_type is None:
            raise LeasesOutstanding(cache.name, outstanding, cache._shut_wait)
        return suppressed


class Cache:
    """A plugin's view of the broker, yielded by ``broker.cache(name, releaser)``.

    Keys are this cache's own: another cache's ``"base"`` is a different entry.
    Loads and releases of this cache's entries run in its block's task group.

    Leaving the block closes the cache: new acquires fail with
    ``BrokerClosed``, requests still waiting fail with ``BrokerClosed``, loads
    in flight are cancelled (the worker thread of a plain loader, which cannot
    be stopped, is not waited for: what it makes is released through the
    releaser once it returns), idle entries are released through the releaser
    and awaited. Leased entries are released when their last lease ends; the
    exit waits for that up to ``release_timeout``. Leases still held then are
    never freed under their holders: the exit raises ``LeasesOutstanding``
    naming them, and their bytes stay charged (quarantined) since nobody is
    left to release them.
    """

    __slots__ = (
        "_broker",
        "_closed",
        "_context",
        "_empty",
        "_entries",
        "_owner",
        "_release",
        "_shut_wait",
        "_sizes_seen",
        "_tg",
        "name",
    )

    def __init__(
        self, broker: Broker, owner: Owner, release: ReleaseFunction, tg: anyio.abc.TaskGroup
    ) -> None:
        self._broker = broker
        self._owner = owner
        self._entries = owner.entries
        self._release = release
        self._tg = tg
        self._closed = False
        self._empty = anyio.Event()
        self._shut_wait = 0.0
        #: Plain sizes (ints, strings) already checked, so a hit checks them cheaply.
        self._sizes_seen: dict[object, None] = {}
        self.name = owner.name
        # Loads and releases run in the plugin's own context (its contextvars),
        # whichever task's request set them off.
        self._context = contextvars.copy_context()

    def _spawn(
        self, func: Callable[..., Awaitable[Any]], *args: Any, name: str | None = None
    ) -> None:
        start_soon = cast(Callable[..., None], self._tg.start_soon)
        self._context.run(start_soon, func, *args, name=name)

    def __repr__(self) -> str:
        return f"<Cache {self.name!r} entries={len(self._owner.live)}>"

    @overload
    def acquire(
        self,
        key: Hashable,
        *,
        load: Callable[[], Awaitable[T]],
        size: SizeSpec = None,
        measure: Callable[[T], Any] | None = None,
        timeout: float | None = None,
        cost: float | None = None,
        idle_ttl: float | None = None,
        pin: bool = False,
    ) -> Lease[T]: ...

    @overload
    def acquire(
        self,
        key: Hashable,
        *,
        load: Callable[[], T],
        size: SizeSpec = None,
        measure: Callable[[T], Any] | None = None,
        timeout: float | None = None,
        cost: float | None = None,
        idle_ttl: float | None = None,
        pin: bool = False,
    ) -> Lease[T]: ...

    def acquire(
        self,
        key: Hashable,
        *,
        load: Callable[[], Any],
        size: SizeSpec = None,
        measure: Callable[[Any], Any] | None = None,
        timeout: float | None = None,
        cost: float | None = None,
        idle_ttl: float | None = None,
        pin: bool = False,
    ) -> Lease[Any]:
        """Lease the value of ``key``, loading it first if needed.

        Use as ``lease = await cache.acquire(...)`` (then ``await
        lease.release()``) or ``async with cache.acquire(...) as lease``.

        Args:
            key: Any hashable; keys are per cache.
            load: Called with no argument to make the value on a miss; an async
                callable runs in this cache's task group, a plain one in a
                worker thread (an awaitable it returns, as from
                ``lambda: load_model(name)``, is then awaited in the task
                group). Concurrent acquires of one key share one load.
            size: What admission reserves before ``load`` runs: bytes or
                ``"3GiB"`` in the default space, or a mapping of space to
                either. A callable here means ``measure=`` with no declared
                size.
            measure: Called with the loaded value, returns its real size (as
                for ``size``); the books are corrected to it (evicting more if
                it is larger) and it is remembered for the key, across
                evictions (``Broker.export_sizes``). Without ``size``, a load
                reserves the key's remembered size; a key never measured is a
                load of unknown size: such loads run one at a time, each
                reserving the largest size its cache has measured in each
                space, so together they never overshoot the budget by more
                than one load's error, which its measurement corrects.
            timeout: Seconds to wait for space and for the load; ``None`` waits
                as long as it takes. On expiry ``AcquireTimeout`` is raised.
            cost: What reloading the value costs, in seconds, for cost-aware
                policies; by default the measured load time.
            idle_ttl: This entry's idle TTL in seconds, overriding the broker's
                (like Ollama's per-request keep_alive; the latest acquire's
                setting wins). 0 releases it as soon as its last lease ends;
                ``math.inf`` keeps it until evicted for space.
            pin: Keep the entry resident regardless of policy and idle time
                while this cache is open (until ``unpin(key)``). It is still
                released by ``invalidate``, ``clear`` and closing the cache.

        Raises:
            RequestTooLarge: the size exceeds a space's whole budget.
            DeadlockError: room could only be made by evicting leases this task holds.
            AcquireTimeout: ``timeout`` expired.
            BrokerClosed: the cache or the broker is closed.

        Cancellation: cancelling the caller while it waits withdraws its request;
        the shared load goes on for the other requesters and is cancelled (its
        reservation returned) when the last one leaves. On trio a cache hit is a
        cancellation point, and every 32nd one a schedule point too; on
        asyncio a hit completes without suspending.
        """
        # Arguments are checked on every call, hits included: code that works
        # with a warm cache must not fail after an eviction.
        if not callable(load):
            raise TypeError(
                f"acquiring {self.name}:{key!r}: load must be a callable taking no argument, "
                f"got {load!r}"
            )
        if size is not None and (size.__class__ not in _PLAIN or size not in self._sizes_seen):
            self._check_size(key, size)
        if timeout is not None:
            timeout = _positive_seconds(timeout, "timeout", inf_is_none=True)
        if cost is None and idle_ttl is None and pin is False and measure is None:
            return Lease(self, key, load, size, timeout)  # The hit path's usual call.
        if cost is not None:
            cost = _non_negative_seconds(cost, "cost")
        if idle_ttl is not None:
            idle_ttl = _non_negative_seconds(idle_ttl, "idle_ttl", allow_inf=True)
        if not isinstance(pin, bool):
            raise TypeError(f"pin must be True or False, got {pin!r}")
        if measure is not None and not callable(measure):
            raise TypeError(f"measure must be a callable taking the loaded value, got {measure!r}")
        if measure is not None and callable(size):
            raise TypeError(
                "give the measurement once: either size=callable or measure=callable, not both"
            )
        tuned: _Tuned[Any] = _Tuned(self, key, load, size, timeout)
        tuned._cost = cost
        tuned._measure = measure
        tuned._options = None if idle_ttl is None and not pin else (idle_ttl, pin)
        return tuned

    async def invalidate(self, key: Hashable) -> bool:
        """Drop ``key``'s value so the next acquire loads afresh.

        An idle value is released at once and its acknowledgement awaited; a
        leased one is released when its last lease ends. Returns whether there
        was a value to drop. Cancellation stops the wait for the
        acknowledgement; the value is dropped either way.
        """
        broker = self._broker
        if self._closed:
            raise BrokerClosed(
                f"cache {self.name!r} is closed: cannot invalidate {self.name}:{key!r}"
            )
        broker._check_running()
        entry = self._find(key)
        dropped = broker._core.invalidate(self._owner, key)
        broker._apply()
        if dropped and entry is not None and entry.shell.released is not None:
            await broker._await_releases([entry])
        else:
            await anyio.lowlevel.checkpoint()
        return dropped

    async def unpin(self, key: Hashable) -> bool:
        """Let the policy and the idle TTL govern ``key`` again (see ``acquire(pin=True)``).

        Returns whether it was pinned. Cancellation: the entry is unpinned in
        one step before the call's only checkpoint.
        """
        broker = self._broker
        if self._closed:
            raise BrokerClosed(f"cache {self.name!r} is closed: cannot unpin {self.name}:{key!r}")
        broker._check_running()
        self._find(key)
        unpinned = broker._core.unpin(self._owner, key, broker._clock())
        broker._apply()
        entry = self._entries.get(key)
        if entry is not None and entry.idle_seq:
            broker._note_idle(entry)
        await anyio.lowlevel.checkpoint()
        return unpinned

    def _check_size(self, key: Hashable, size: object) -> None:
        """Check a size given to ``acquire`` (raising as ``parse_size``); remember plain ones."""
        if callable(size):
            return
        try:
            parse_size(size, self._broker._budget)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"acquiring {self.name}:{key!r}: {exc}") from None
        if size.__class__ in _PLAIN and len(self._sizes_seen) < 1024:
            self._sizes_seen[size] = None

    def _find(self, key: Hashable) -> Entry | None:
        try:
            return self._entries.get(key)
        except TypeError:
            raise InvalidKey(
                f"keys of cache {self.name!r} must be hashable, got {type(key).__name__} {key!r}"
            ) from None

    async def _acquire_slow(
        self,
        key: Hashable,
        load: Callable[[], Any],
        size: SizeSpec,
        timeout: float | None,
        cost: float | None = None,
        measure: Callable[[Any], Any] | None = None,
    ) -> tuple[Entry, object]:
        """Acquire ``key`` when it is not ready (a miss, or a join): the entry and its holder."""
        broker = self._broker
        broker._trace = broker._debug_check(_DEBUG)  # see Broker.__init__
        self._find(key)  # an unhashable key is an InvalidKey
        if self._closed or not broker._running:
            raise BrokerClosed(f"cache {self.name!r} is closed: cannot acquire {self.name}:{key!r}")
        if callable(size):
            measure, size = size, None
        need = None
        if size is not None or measure is None:
            try:
                need = parse_size(size, broker._budget)
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"acquiring {self.name}:{key!r}: {exc}") from None
        task = broker._current_task()
        core = broker._core
        if broker._probes:
            broker._refresh_probes()
        if broker._dropped:
            broker._end_dropped()  # before their holder is taken to hold them still
        ticket = core.request(self._owner, key, need, task, cost=cost, loading=_LOADING.get())
        entry = ticket.entry
        if entry.state is State.WAITING and task in broker._releasing_tasks:
            core.leave(ticket)
            broker._apply()
            raise DeadlockError(
                f"acquiring {self.name}:{key!r} from inside a release would wait for space, "
                "and that space may be waiting for this very release; a releaser may only "
                "acquire what is loaded or fits at once",
                [],
            )
        if ticket.outcome is True:
            broker._apply()
            broker._log.debug(ev.HIT, cache=self.name, key=key)
            await anyio.lowlevel.checkpoint()
            return entry, task
        if entry.shell is None:
            entry.shell = _Slot(load, measure, broker._clock())
            broker._log.debug(ev.MISS, cache=self.name, key=key, bytes=need)
        if entry.state is State.WAITING:
            broker._log.debug(ev.WAIT, cache=self.name, key=key, bytes=entry.need)
            if broker._lease_warning is not None and broker._sweep_wake is not None:
                broker._sweep_wake.set()  # check on the leases it waits for from now on
        broker._apply()
        return await self._wait(ticket, timeout)

    async def _wait(self, ticket: Ticket, timeout: float | None) -> tuple[Entry, object]:
        broker = self._broker
        core = broker._core
        entry = ticket.entry
        try:
            if timeout is None:
                while ticket.outcome is None:
                    await entry.shell.done.wait()
            else:
                with anyio.fail_after(timeout):
                    while ticket.outcome is None:
                        await entry.shell.done.wait()
        except TimeoutError:
            if ticket.outcome is None:
                waiting_for, what = _waiting_for(entry)
                core.leave(ticket)
                broker._apply()
                raise AcquireTimeout(
                    f"acquiring {self.name}:{entry.key!r} did not complete within {timeout:g}s: "
                    f"it was waiting for {what}",
                    entry=f"{self.name}:{entry.key!r}",
                    waiting_for=waiting_for,
                ) from None
            # Settled just as the deadline passed: the outcome stands.
        except BaseException:
            if ticket.outcome is True:  # Granted just as we were cancelled: give it back.
                core.lease_end(entry, ticket.task, broker._clock())
            else:
                core.leave(ticket)
            broker._apply()
            raise
        outcome = ticket.outcome
        if outcome is True:
            return entry, ticket.task
        assert isinstance(outcome, BaseException)
        raise _own_copy(outcome)

    async def _shut(self, error: BaseException) -> list[Hashable]:
        """Close this cache (see the class docstring); return keys still leased.

        Waits at most ``release_timeout`` for leases to end and releases to be
        acknowledged; the caller then cancels what is left in the task group.
        """
        broker = self._broker
        owner = self._owner
        if not owner.closing:
            broker._core.close_owner(owner, error)
            broker._apply()
        started = broker._clock()
        limit = broker._release_timeout
        with anyio.move_on_after(math.inf if limit is None else limit):
            await self._empty.wait()
        self._shut_wait = broker._clock() - started
        return [entry.key for entry in owner.live if entry.leases]


class Lease(Generic[T_co]):
    """A hold on a loaded value: while any lease is held the value is never asked to release.

    ``cache.acquire(...)`` returns the lease before it is granted; awaiting it
    (``lease = await cache.acquire(...)``) or entering it (``async with
    cache.acquire(...) as lease``) acquires it, once. Leaving the ``async
    with`` block, or ``await lease.release()``, ends it.

    Attributes:
        key: The key the value was acquired under.
    """

    __slots__ = ("_cache", "_entry", "_load", "_size", "_task", "_timeout", "key")

    # The hit path builds one lease per call: the options most calls leave at
    # their defaults are read from the class (``_Tuned`` carries them).
    _cost: float | None = None
    _measure: Callable[[Any], Any] | None = None
    _options: tuple[float | None, bool] | None = None

    def __init__(
        self,
        cache: Cache,
        key: Hashable,
        load: Callable[[], Any],
        size: SizeSpec,
        timeout: float | None,
    ) -> None:
        self._cache = cache
        self.key = key
        self._load = load
        self._size = size
        self._timeout = timeout
        self._entry: Entry | None = None
        #: The holder task once granted; else _PENDING, _ACQUIRING or _RELEASED.
        self._task: object = _PENDING

    def __await__(self) -> Generator[Any, Any, Lease[T_co]]:
        """Acquire: ``lease = await cache.acquire(...)`` (see ``Cache.acquire``).

        Cancellation withdraws the request; nothing is held afterwards and the
        lease may be awaited again.
        """
        # The hit path, written out in one frame: a ready entry is leased in
        # this step, without building a coroutine (docs/architecture.md).
        if self._task is not _PENDING:
            raise RuntimeError(
                f"this lease on {self._cache.name}:{self.key!r} was already awaited or entered; "
                "a lease is acquired once: call cache.acquire() again for another"
            )
        self._task = _ACQUIRING
        cache = self._cache
        broker = cache._broker
        try:
            if get_ident() != broker._thread:
                raise broker._wrong_thread(f"asked for {cache.name}:{self.key!r}")
            checkpoint = broker._checkpoint
            if checkpoint is not None:  # trio: every acquire is a cancellation point
                yield from checkpoint().__await__()
            try:
                entry = cache._entries.get(self.key)
            except TypeError:
                entry = None  # _acquire_slow raises InvalidKey
            if entry is not None and entry.state is _READY and not cache._owner.closing:
                task = broker._current_task()
                broker._core.hit(entry, task)
                if broker._trace:
                    broker._log.debug(ev.HIT, cache=cache.name, key=self.key)
            else:
                slow = cache._acquire_slow(
                    self.key, self._load, self._size, self._timeout, self._cost, self._measure
                )
                entry, task = yield from slow.__await__()
        except BaseException:
            self._task = _PENDING  # nothing was acquired: it may be awaited again
            raise
        self._entry = entry
        self._task = task
        if self._options is not None:
            idle_ttl, pin = self._options
            broker._core.configure(entry, idle_ttl=idle_ttl, pin=pin or None)
        return self

    def __aenter__(self) -> Awaitable[Lease[T_co]]:
        """Acquire the lease (as ``await``), for ``async with cache.acquire(...) as lease``.

        Cancellation: as for ``await``; the block is not entered.
        """
        # Plain methods returning awaitables: ``async with`` costs no coroutines.
        return self

    def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Awaitable[None]:
        """End the lease (``release()``); never a cancellation point, never raises."""
        return self.release()

    @property
    def value(self) -> T_co:
        """The loaded value.

        Raises:
            LeaseReleased: the lease was released.
            RuntimeError: the lease was not acquired (awaited or entered) yet.
        """
        entry = self._entry
        if entry is None:
            if self._task is _RELEASED:
                raise LeaseReleased(
                    f"the lease on {self._cache.name}:{self.key!r} was released; acquire it again"
                )
            raise RuntimeError(
                f"the lease on {self._cache.name}:{self.key!r} is not acquired yet: "
                "await cache.acquire(...) or use it with 'async with'"
            )
        return cast(T_co, entry.value)

    @property
    def released(self) -> bool:
        """Whether the lease was acquired and then released."""
        return self._task is _RELEASED

    def release(self) -> Awaitable[None]:
        """End the lease: ``await lease.release()``. Idempotent; never raises.

        The lease ends when ``release()`` is called, in one synchronous step,
        so cancellation cannot leave it half-ended; the awaitable it returns
        is already complete (it is not a cancellation point). When this was
        the last lease the value becomes idle (kept while space allows) or, if
        it was invalidated or retention is off, it is released. On a lease
        not acquired yet it does nothing.
        """
        entry = self._entry
        if entry is None:
            return _DONE
        self._entry = None
        task = self._task
        self._task = _RELEASED
        broker = self._cache._broker
        if get_ident() != broker._thread:  # Ended from another thread: end it on the loop.
            broker._call_soon(broker._end_lease, entry, task)
            return _DONE
        core = broker._core
        # When the entry went idle only matters to an idle TTL: skip the clock otherwise.
        timed = entry.ttl is not None or broker._idle_ttl is not None
        core.lease_end(entry, task, broker._clock() if timed else 0.0)
        if core.effects:
            broker._apply()
        if timed and not entry.leases:
            broker._note_idle(entry)
        return _DONE

    def __del__(self) -> None:
        # A lease garbage-collected while held (its task died, or it was
        # dropped): end it, or its bytes would stay pinned for good.
        entry = self._entry
        if entry is not None:
            self._cache._broker._lease_dropped(entry, self._task, self.key)

    def __repr__(self) -> str:
        if self._entry is not None:
            state = "held"
        else:
            state = "released" if self._task is _RELEASED else "not acquired"
        return f"<Lease {self.key!r} {state}>"


class _Tuned(Lease[T_co]):
    """A ``Lease`` whose acquire was given ``cost``, ``measure``, ``idle_ttl`` or ``pin``."""

    __slots__ = ("_cost", "_measure", "_options")


class _Marker:
    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return self._name


_PENDING = _Marker("<not acquired>")
_ACQUIRING = _Marker("<acquiring>")
_RELEASED = _Marker("<released>")


# ---------------------------------------------------------------------- helpers


class _TimedSteps:
    """Await a coroutine, timing each of its steps (how long it held the event loop).

    Each value the coroutine yields goes to the event loop and each answer
    back, as ``await`` would do; only the wall-clock time of every step is
    taken, and the longest kept.
    """

    __slots__ = ("_coro", "longest")

    def __init__(self, coro: Coroutine[Any, Any, Any]) -> None:
        self._coro = coro
        self.longest = 0.0

    def __await__(self) -> Generator[Any, Any, Any]:
        coro = self._coro
        value: Any = None
        error: BaseException | None = None
        while True:
            started = time.perf_counter()
            try:
                yielded = coro.send(value) if error is None else coro.throw(error)
            except StopIteration as stop:
                return stop.value
            finally:
                self.longest = max(self.longest, time.perf_counter() - started)
            try:
                value, error = (yield yielded), None
            except BaseException as exc:  # (cancellation too: the coroutine gets it)
                value, error = None, exc


class _Done(tuple):  # type: ignore[type-arg]
    """An awaitable that is already complete (what ``Lease.release`` returns).

    Awaiting it iterates an empty tuple: the ``await`` finishes at once, and
    the iterator comes from C, without a Python-level ``__await__`` call.
    """

    __slots__ = ()
    __await__ = tuple.__iter__


_DONE = cast(Awaitable[None], _Done())


def _non_negative_seconds(value: object, what: str, *, allow_inf: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a number of seconds, got {value!r}")
    if math.isnan(value) or value < 0 or (math.isinf(value) and not allow_inf):
        raise InvalidArgument(f"{what} must be a non-negative number of seconds, got {value!r}")
    return float(value)


def _positive_seconds(value: object, what: str, *, inf_is_none: bool = False) -> float | None:
    """``value`` as positive seconds; ``None`` (and ``math.inf`` where allowed) for "no limit"."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a number of seconds or None, got {value!r}")
    seconds = float(value)
    if seconds == math.inf and inf_is_none:
        return None
    if not math.isfinite(seconds) or seconds <= 0:
        raise InvalidArgument(f"{what} must be a positive number of seconds or None, got {value!r}")
    return seconds


def _waiting_for(entry: Entry) -> tuple[str | None, str]:
    """What a request of ``entry`` still waits for: ``AcquireTimeout.waiting_for``, and in words."""
    if entry.state is State.LOADING:
        return "load", "its load to finish"
    if entry.state is not State.WAITING:
        return None, f"the entry, which was {entry.state.value}"
    if entry.after is not None:
        return "release", "the release of the key's previous value"
    need = ", ".join(f"{format_bytes(n)} in {name!r}" for name, n in entry.need.items())
    if entry.gated:
        return "space", "space, behind another load of unknown size (measured first)"
    return "space", f"space ({need})" if need else "space"


def _own_copy(error: BaseException) -> BaseException:
    """The exception one waiter raises for a failure shared by several.

    Every waiter of a failed load raises its own exception of the loader's
    type and arguments, chained (``__cause__``) to the one the loader raised,
    whose traceback shows where it failed. Raising one object in many tasks
    would splice their tracebacks together. An exception that cannot be
    copied faithfully is raised as it is.
    """
    try:
        twin = copy.copy(error)
    except Exception:
        return error
    if type(twin) is not type(error) or twin.args != error.args:
        return error
    twin.__cause__ = error if error.__traceback__ is not None else error.__cause__
    twin.__traceback__ = None
    return twin


def _split_probes(budget: Any) -> tuple[Any, dict[str, Probe]]:
    """Separate probed spaces from fixed ones; probed ones start at their first reading."""

    if isinstance(budget, Probe):
        budget = {DEFAULT_SPACE: budget}
    if not isinstance(budget, Mapping):
        return budget, {}
    fixed: dict[str, Any] = {}
    probes: dict[str, Probe] = {}
    for name, amount in budget.items():
        if isinstance(amount, Probe):
            probes[name] = amount
            fixed[name] = 0
        elif callable(amount):
            probes[name] = Probe(amount, name=str(name))
            fixed[name] = 0
        else:
            fixed[name] = amount
    return fixed, probes


def _remembered_sizes(
    sizes: Mapping[str, Mapping[Any, Any]] | None, spaces: Mapping[str, int]
) -> list[tuple[str, Hashable, dict[str, int]]]:
    """Check ``Broker(sizes=...)``: ``{cache: {key: size}}`` as ``export_sizes()`` returns it."""
    if sizes is None:
        return []
    if not isinstance(sizes, Mapping):
        raise TypeError(f"sizes must be a mapping {{cache: {{key: size}}}}, got {sizes!r}")
    remembered = []
    for cache_name, keys in sizes.items():
        if not isinstance(cache_name, str) or not isinstance(keys, Mapping):
            raise TypeError(
                "sizes must map each cache name (a string) to a mapping {key: size}, "
                f"got {cache_name!r}: {keys!r}"
            )
        for key, size in keys.items():
            try:
                charge = parse_size(size, spaces)
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"sizes[{cache_name!r}][{key!r}]: {exc}") from None
            remembered.append((cache_name, key, charge))
    return remembered


def _alias_groups(groups: Iterable[Iterable[str]], spaces: Mapping[str, int]) -> list[list[str]]:
    result = []
    for group in groups:
        if isinstance(group, str):
            raise TypeError(f"aliases must be groups of space names, got the string {group!r}")
        names = list(group)
        for name in names:
            if name not in spaces:
                raise InvalidArgument(
                    f"alias names unknown space {name!r}; the budget has spaces {sorted(spaces)}"
                )
        if len(names) < 2:
            raise InvalidArgument(f"an alias group needs at least two spaces, got {names!r}")
        result.append(names)
    return result


def _oom_error_types(
    extra: type[BaseException] | tuple[type[BaseException], ...],
) -> tuple[type[BaseException], ...]:
    given = extra if isinstance(extra, tuple) else (extra,)
    for kind in given:
        if not (isinstance(kind, type) and issubclass(kind, Exception)):
            raise TypeError(f"oom_errors must be exception classes, got {kind!r}")
    return (MemoryError, OutOfSpace, *given)


def _running_backend() -> str:
    """The event loop library running this task: "asyncio" or "trio"."""
    try:
        import sniffio
    except ImportError:  # trio depends on sniffio: without it, only asyncio can run
        return "asyncio"
    return sniffio.current_async_library()


#: On trio, one hit in this many is a full checkpoint (a schedule point too).
TRIO_SCHEDULE_EVERY = 32


def _trio_hit_checkpoint() -> Callable[[], Awaitable[None]]:
    """What a hit awaits on trio: a cancellation point, and a schedule point every so often.

    trio's rule is that every async operation of a library is a checkpoint.
    A full one on every hit would double the hit's cost, so a hit is always
    a cancellation point and, every ``TRIO_SCHEDULE_EVERY`` hits, a schedule
    point too: a loop of hits cannot starve the other tasks (as trio's own
    fast paths do it).
    """
    import itertools

    import trio

    if_cancelled = trio.lowlevel.checkpoint_if_cancelled
    full = trio.lowlevel.checkpoint
    count = itertools.count(1)
    mask = TRIO_SCHEDULE_EVERY - 1

    def checkpoint() -> Awaitable[None]:
        return if_cancelled() if next(count) & mask else full()

    return checkpoint


def _task_name(task: object) -> str:
    """How events name a holder task (asyncio's or trio's)."""
    get_name = getattr(task, "get_name", None)
    if callable(get_name):
        return str(get_name())
    return str(getattr(task, "name", task))


def _call_soon_threadsafe(backend: str) -> Callable[..., object]:
    """A function that has the running loop call ``func(*args)`` soon, from any thread."""
    if backend == "trio":
        import trio

        return trio.lowlevel.current_trio_token().run_sync_soon
    import asyncio

    return asyncio.get_running_loop().call_soon_threadsafe


def _loop_clock(backend: str) -> Callable[[], float]:
    if backend == "trio":
        import trio

        return trio.current_time
    import asyncio

    return asyncio.get_running_loop().time


def _unstarted_clock() -> float:
    raise BrokerClosed("the broker is not running; use it inside 'async with Broker(...)'")


def _unstarted_task() -> object:
    raise BrokerClosed("the broker is not running; use it inside 'async with Broker(...)'")


def _env_value(name: str, raw: str, parse: Callable[[str], T]) -> T:
    try:
        return parse(raw)
    except (ValueError, TypeError) as exc:
        raise InvalidArgument(f"{name}={raw!r} is invalid: {exc}") from exc


def _parse_env_budget(raw: str) -> int | dict[str, int]:
    if "=" not in raw:
        return parse_bytes(raw.strip(), what="budget")
    spaces: dict[str, int] = {}
    for part in raw.split(","):
        name, sep, amount = part.partition("=")
        name = name.strip()
        if not sep or not name:
            raise InvalidArgument(f"expected SPACE=SIZE pairs separated by commas, got {part!r}")
        if name in spaces:
            raise InvalidArgument(f"space {name!r} is given twice")
        spaces[name] = parse_bytes(amount.strip(), what=f"budget of space {name!r}")
    return spaces


def _parse_env_ttl(raw: str) -> float | None:
    try:
        seconds = float(raw)
    except ValueError:
        raise InvalidArgument("expected a number of seconds (0 turns idle eviction off)") from None
    if not math.isfinite(seconds) or seconds < 0:
        raise InvalidArgument("expected a non-negative number of seconds")
    return seconds or None


def _parse_env_policy(raw: str) -> str:
    make_policy(raw.strip())
    return raw.strip()
