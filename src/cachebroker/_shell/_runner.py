"""The runner: the effect interpreter, and everything it runs.

The loop is single-threaded, so the broker needs no mailbox: every public
operation runs its bookkeeping as one synchronous step on the ``Core`` (which
never awaits), then performs the effects the step queued (``Runner.apply``):
starting loads and releases in the owners' task groups, waking waiters,
before it awaits anything. Steps are therefore atomic and served in the order
the loop runs them, and a cache hit costs a dictionary lookup and a counter,
not a round trip through a queue.

Loads (free and retry on out-of-memory errors, plain loaders in worker
threads, loads given up while their thread runs) and releases (watched by
``release_timeout`` and timed for blocking steps, then a wait for probed
memory to show) run as tasks of the owning ``broker.cache(...)`` block, so a
plugin's values are created and destroyed in its own context. Their outcomes
come back as further core steps. The idle sweeper also re-reads probes and
reports leases held while requests wait.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
import inspect
import itertools
import logging
import math
import time
import warnings
from collections.abc import (
    Awaitable,
    Callable,
    Collection,
    Coroutine,
    Generator,
    Hashable,
    Mapping,
)
from threading import get_ident
from types import TracebackType
from typing import Any, assert_never, cast

import anyio
import anyio.abc
import anyio.to_thread

from .. import _log_events as ev
from .._core import (
    CancelLoad,
    Core,
    Entry,
    Owner,
    OwnerEmpty,
    Quarantined,
    Reason,
    Settled,
    StartLoad,
    StartMove,
    StartRelease,
    State,
    Ticket,
)
from .._core._tiers import freed
from .._errors import (
    AcquireTimeout,
    BrokerClosed,
    BrokerError,
    DeadlockError,
    InvalidArgument,
    LeasesOutstanding,
    LoadFailed,
    OutOfSpace,
    ReleaseFailed,
)
from .._sizes import parse_bytes, parse_size
from .._stats import EvictionReport
from .._units import format_bytes
from ..probes import Probe
from . import _backend, _logging
from ._actor import Block
from ._backend import Fault, classify, task_name
from ._config import Listener, MoveFunction, ReleaseFunction, is_async_callable

__all__ = ["Runner"]

_DEBUG = logging.DEBUG

#: Seconds the exit of a cache block (or of the broker) waits for releases and
#: leases in silence; past them it says what it waits for, and for how long at
#: most (``cachebroker.close.waiting``). Releases usually take far less.
CLOSE_NOTICE = 1.0

#: The entries whose loader the current task (or thread) runs: a request made
#: from inside a loader must not wait for a load that waits for that loader.
_LOADING: contextvars.ContextVar[tuple[Entry, ...]] = contextvars.ContextVar(
    "cachebroker_loading", default=()
)


class _Slot:
    """What the shell keeps on an entry: how to load it and how to wake its waiters."""

    __slots__ = (
        "abandoned",
        "cancelled",
        "done",
        "is_async",
        "load",
        "measure",
        "moving_to",
        "placed",
        "queued_at",
        "release_started",
        "released",
        "scope",
        "thread_wait",
        "timed_out",
    )

    def __init__(
        self,
        load: Callable[..., Any],
        measure: Callable[[Any], Any] | None,
        now: float,
        *,
        placed: bool = False,
    ) -> None:
        self.load = load
        self.is_async = is_async_callable(load)
        #: The acquire gave places (``spaces=``): the loader takes the chosen
        #: one's name (the acquire's own, ``Core.owner_space``), and a plain
        #: measured size is charged there.
        self.placed = placed
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
        #: The space a move of the entry goes to while it runs (tiers).
        self.moving_to: str | None = None
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


class Runner:
    """Runs one broker: its books, effects and tasks (the ``Actor`` of ``Cache`` and ``Lease``).

    The ``Broker`` owns one and is its facade; ``Cache`` and ``Lease`` use only
    its ``Actor`` interface (``_actor``): the public attributes and methods
    below. The private ones are the interpreter's own.
    """

    # Slots: the hit path reads ``core``, ``thread``, ``checkpoint``, ``current_task``,
    # ``trace`` and ``idle_ttl`` on every call.
    __slots__ = (
        "_alias_threshold",
        "_blocking_warning",
        "_caches",
        "_call_soon",
        "_debug_check",
        "_drop_ids",
        "_dropped",
        "_held_reported",
        "_lease_warning",
        "_logger",
        "_memory_wait",
        "_oom_errors",
        "_oom_retries",
        "_probe_interval",
        "_probe_ok",
        "_probes",
        "_releasing_tasks",
        "_sweep_at",
        "_sweep_wake",
        "_tg",
        "_user_clock",
        "budget",
        "checkpoint",
        "clock",
        "core",
        "current_task",
        "held",
        "idle_ttl",
        "listeners",
        "log",
        "release_timeout",
        "release_timeouts",
        "releases_blocking",
        "running",
        "shared_used",
        "thread",
        "trace",
    )

    def __init__(
        self,
        core: Core,
        *,
        budget: dict[str, int],
        probes: dict[str, Probe],
        idle_ttl: float | None,
        release_timeout: float | None,
        blocking_warning: float | None,
        lease_warning: float | None,
        memory_wait: float | None,
        probe_interval: float | None,
        oom_errors: tuple[type[BaseException], ...],
        oom_retries: int,
        alias_threshold: int,
        clock: Callable[[], float] | None,
        logger: object,
    ) -> None:
        self.core = core
        self.budget = budget
        self._probes = probes
        self.idle_ttl = idle_ttl
        self.release_timeout = release_timeout
        self._blocking_warning = blocking_warning
        self._lease_warning = lease_warning
        self._memory_wait = memory_wait
        self._probe_interval = probe_interval
        self._oom_errors = oom_errors
        self._oom_retries = oom_retries
        self._alias_threshold = alias_threshold
        self._user_clock = clock
        self._logger = logger
        self.clock: Callable[[], float] = clock or _backend.unstarted_clock
        self.log: Any = None
        self._caches: dict[Owner, Block] = {}
        self._tg: anyio.abc.TaskGroup | None = None
        self.running = False
        self.current_task: Callable[[], object] = _backend.unstarted_task
        #: The thread whose event loop runs the broker, and a thread-safe way
        #: to have that loop call a function soon.
        self.thread = -1
        self._call_soon: Callable[..., object] = _backend.unstarted_task
        self.checkpoint: Callable[[], Awaitable[None]] | None = None
        # Whether the hit path builds its debug event at all. Asking the logger on
        # every hit costs ~60 ns, 5% of a hit, so the answer is re-read at every
        # other step instead: the start, each acquire that is not a hit, each
        # event logged. A level raised at runtime shows on hits after the next one.
        self._debug_check: Callable[[int], bool] = _logging.debug_check(None)
        self.trace = False
        self._sweep_at: float | None = None
        self._sweep_wake: anyio.Event | None = None
        self._releasing_tasks: set[object] = set()
        #: Leases garbage-collected while held and not ended yet (``lease_dropped``).
        self._dropped: dict[int, tuple[Entry, object]] = {}
        self._drop_ids = itertools.count()
        self.listeners: list[Listener] = []
        #: Counters for ``Broker.stats()``.
        self.release_timeouts = 0
        self.releases_blocking = 0
        #: Leased entries seen in a space that requests wait for, and since
        #: when; those already reported.
        self.held: dict[Entry, float] = {}
        self._held_reported: set[Entry] = set()
        #: Probed spaces that have had a good reading.
        self._probe_ok: set[str] = set()
        #: A connected broker's last news of the shared books: bytes used per space.
        self.shared_used: Mapping[str, int] | None = None
        self._refresh_probes()

    # ------------------------------------------------------------ life cycle

    async def start(self) -> None:
        """Bind the running event loop, open the broker's task group, start the sweeper."""
        backend = _backend.running_backend()
        self.current_task = _backend.current_task_getter(backend)
        self.thread = get_ident()
        self._call_soon = _backend.call_soon_threadsafe(backend)
        if backend == "trio":
            self.checkpoint = _backend.trio_hit_checkpoint()
        if self._user_clock is None:
            self.clock = _backend.loop_clock(backend)
        self.log = _logging.open_events(self._logger)
        self._debug_check = _logging.debug_check(self.log)
        self.trace = self._debug_check(_DEBUG)
        self._sweep_wake = anyio.Event()
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        self.running = True
        tg.start_soon(self._sweeper, name="cachebroker idle sweeper")

    async def stop(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        """Close every open cache, wait for orphaned loads, stop the task group (``Broker``)."""
        tg = self._tg
        assert tg is not None
        try:
            with anyio.CancelScope(shield=True):
                for cache in list(self._caches.values()):
                    await self._shut(cache, BrokerClosed("the broker was closed"))
                await self._await_orphans()
        finally:
            self.running = False
            self.core.closed = True
            tg.cancel_scope.cancel()
            suppressed = await _backend.exit_task_group(tg, exc_type, exc, tb)
        return suppressed

    async def open_block(
        self,
        name: str,
        release: ReleaseFunction,
        *,
        slots: int | None = None,
        priority: int = 0,
        ttl: float | None = None,
        move: MoveFunction | None = None,
    ) -> Block:
        """Open cache ``name``: its owner in the books (with its defaults), its task group."""
        owner = self.core.open_owner(
            name, slots=slots, priority=priority, ttl=ttl, moves=move is not None
        )
        tg = anyio.create_task_group()
        try:
            await tg.__aenter__()
        except BaseException:
            self.core.forget_owner(owner)
            raise
        cache = self._caches[owner] = Block(owner, release, tg, move)
        return cache

    async def close_block(
        self,
        cache: Block,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        """Close ``cache`` (see ``Cache``); raise ``LeasesOutstanding`` for leases still held."""
        try:
            with anyio.CancelScope(shield=True):
                outstanding = await self._shut(
                    cache, BrokerClosed(f"cache {cache.name!r} was closed")
                )
                if outstanding:
                    # Nobody is left to release them: they stay charged, visible
                    # and forgettable (quarantined); their holders keep the values.
                    self.core.abandon(cache.owner)
                    self.apply()
        finally:
            cache.closed = True
            cache.tg.cancel_scope.cancel()
            try:
                suppressed = await _backend.exit_task_group(cache.tg, exc_type, exc, tb)
            finally:
                self._caches.pop(cache.owner, None)
                self.core.forget_owner(cache.owner)
        if outstanding and exc_type is None:
            raise LeasesOutstanding(cache.name, outstanding, cache.shut_wait)
        return suppressed

    async def _shut(self, cache: Block, error: BaseException) -> list[Hashable]:
        """Close ``cache`` (see ``Cache``); return keys still leased.

        Waits at most ``release_timeout`` for leases to end and releases to be
        acknowledged; the caller then cancels what is left in the task group.
        """
        owner = cache.owner
        if not owner.closing:
            self.core.close_owner(owner, error)
            self.apply()
        started = self.clock()
        limit = self.release_timeout
        deadline = math.inf if limit is None else anyio.current_time() + limit
        with anyio.move_on_after(math.inf if limit is None else limit):
            notice = CLOSE_NOTICE
            if limit is None or limit > notice:
                with anyio.move_on_after(notice):
                    await cache.empty.wait()
                if not cache.empty.is_set():
                    self._note_close_wait(cache, deadline - anyio.current_time())
            await cache.empty.wait()
        cache.shut_wait = self.clock() - started
        return [entry.key for entry in owner.live if entry.leases]

    def _note_close_wait(self, cache: Block, seconds: float) -> None:
        """Say once what the exit of ``cache`` waits for, and ``seconds`` at most (inf: none)."""
        name = cache.owner.name
        live = sorted(cache.owner.live, key=lambda entry: repr(entry.key))
        self.emit(
            "warning",
            ev.CLOSE_WAITING,
            cache=name,
            releases=[f"{name}:{e.key!r}" for e in live if e.state is State.RELEASING],
            leases=[f"{name}:{e.key!r}" for e in live if e.leases],
            loads=[f"{name}:{e.key!r}" for e in live if e.state is State.LOADING],
            seconds=None if seconds == math.inf else round(max(0.0, seconds), 3),
        )

    # ------------------------------------------------------------ for Cache and Lease

    def check_running(self) -> None:
        if not self.running:
            raise BrokerClosed(
                "the broker is not running; use it inside 'async with Broker(...) as broker'"
            )
        if get_ident() != self.thread:
            raise _backend.wrong_thread("used")

    def refresh_trace(self) -> None:
        self.trace = self._debug_check(_DEBUG)

    def end_lease_soon(self, entry: Entry, task: object) -> None:
        self._call_soon(self._end_lease, entry, task)

    def _since(self, start: float) -> float:
        """Seconds from ``start`` to now, rounded for the events."""
        return round(max(0.0, self.clock() - start), 6)

    def remove_listener(self, listener: Listener) -> None:
        """Stop calling ``listener``; one that is not registered is ignored."""
        with contextlib.suppress(ValueError):
            self.listeners.remove(listener)

    def emit(self, level: str, event: str, **fields: Any) -> None:
        """Log ``event`` at ``level`` and hand it to the listeners."""
        self.trace = self._debug_check(_DEBUG)
        getattr(self.log, level)(event, **fields)
        for listener in tuple(self.listeners):
            try:
                listener(event, fields)
            except Exception as exc:
                self.remove_listener(listener)
                self.log.error(
                    ev.LISTENER_FAILED, listener=repr(listener), event_name=event, error=repr(exc)
                )

    def _end_lease(self, entry: Entry, task: object) -> None:
        """End a lease on the broker's loop (called soon, from any thread)."""
        self.core.lease_end(entry, task, self.clock())
        self.apply()
        if not entry.leases:
            self.note_idle(entry)

    def lease_dropped(self, entry: Entry, task: object, key: Hashable) -> None:
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

    def apply(self) -> None:
        """Perform the effects queued by the core's last steps (never awaits)."""
        core = self.core
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
                    case StartMove(entry, to):
                        self._start_move(entry, to)
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
                        moved = {} if slot.moving_to is None else {"to": slot.moving_to}
                        self.emit(
                            "error",
                            ev.RELEASE_FAILED if slot.moving_to is None else ev.MOVE_FAILED,
                            cache=entry.owner.name,
                            key=entry.key,
                            error=repr(entry.error),
                            timed_out=slot.timed_out,
                            seconds=self._since(slot.release_started),
                            bytes=dict(entry.charge),
                            **moved,
                        )
                    case OwnerEmpty(owner):
                        cache = self._caches.get(owner)
                        if cache is not None:
                            cache.empty.set()
                    case _:
                        assert_never(effect)

    def _start_load(self, entry: Entry) -> None:
        cache = self._caches[entry.owner]
        slot: _Slot = entry.shell
        if slot.placed:  # the loader learns where, by the name it gave
            space = self.core.owner_space(entry, next(iter(entry.charge)))
            slot.load = functools.partial(slot.load, space)
        if not self.admits_elsewhere:
            self._granted(entry)
        cache.spawn(self._run_load, entry, name=f"cachebroker load {cache.name}:{entry.key!r}")

    def _granted(self, entry: Entry) -> None:
        """``cachebroker.grant``: ``entry``'s bytes are its load's (the wait for space is over)."""
        self.emit(
            "debug",
            ev.GRANT,
            cache=entry.owner.name,
            key=entry.key,
            bytes=dict(entry.charge),
            waited=self._since(entry.shell.queued_at),
        )

    #: Whether a load these books granted waits for another broker's grant
    #: (``_admit``): until then it waits for space, as a queued request does.
    admits_elsewhere = False

    def admitting(self) -> Collection[Entry]:
        """The entries whose load waits in ``_admit`` for another broker's grant."""
        return ()

    async def _run_load(self, entry: Entry) -> None:
        _LOADING.set((*_LOADING.get(), entry))  # (this task's own context)
        slot: _Slot = entry.shell
        core = self.core
        cache_name = entry.owner.name
        with anyio.CancelScope() as scope:
            slot.scope = scope
            if slot.cancelled:
                scope.cancel()
            try:
                refused = await self._admit(entry)
            except BaseException as exc:
                if self._load_failed(entry, exc):
                    raise
                return
            if refused is not None:
                core.load_failed(entry, refused, cancelled=True)
                self.apply()
                return
            if self.admits_elsewhere:
                self._granted(entry)
            self.emit(
                "info", ev.LOAD_START, cache=cache_name, key=entry.key, bytes=dict(entry.charge)
            )
            started = self.clock()
            try:
                value = await self._load_freeing_on_oom(entry, slot)
            except _Abandoned:
                return  # booked by _abandon
            except BaseException as exc:
                if self._load_failed(entry, exc):
                    raise
                return
            seconds = max(0.0, self.clock() - started)
            where = core.owner_space(entry, next(iter(entry.charge))) if slot.placed else None
            measured, error, fatal = self._measure(entry, slot, value, where)
            core.load_done(entry, value, measured, seconds, self.clock(), error=error)
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
                self.note_idle(entry)
            self.emit(
                "info",
                ev.LOAD_DONE,
                cache=cache_name,
                key=entry.key,
                seconds=round(seconds, 6),
                bytes=dict(entry.charge),
            )
            self.apply()
            if fatal is not None:
                raise fatal

    async def _admit(self, entry: Entry) -> BaseException | None:
        """What a granted load awaits before it runs: nothing here.

        A broker connected to a shared one (``_remote``) waits there for the
        bytes this books granted; it returns the error that refused them.
        """
        return None

    def _load_failed(self, entry: Entry, exc: BaseException) -> bool:
        """Book a load that raised ``exc``; return whether ``exc`` must propagate.

        The broker's own cancellation cancels the load. Anything else fails it
        for every requester: they get the loader's exception, or, for what is
        no ordinary error (a ``CancelledError`` not meant for the broker, a
        process-level ``BaseException``), a ``LoadFailed`` chained to it.
        """
        fault = classify(exc)
        cache_name = entry.owner.name
        if fault is Fault.CANCELLED:
            self.emit("info", ev.LOAD_CANCELLED, cache=cache_name, key=entry.key)
            cancelled = BrokerClosed(f"the load of {cache_name}:{entry.key!r} was cancelled")
            self.core.load_failed(entry, cancelled, cancelled=True)
        else:
            self.emit("warning", ev.LOAD_FAILED, cache=cache_name, key=entry.key, error=repr(exc))
            error = exc
            if not isinstance(exc, Exception):
                error = LoadFailed(f"loading {cache_name}:{entry.key!r} raised {exc!r}")
                error.__cause__ = exc
            self.core.load_failed(entry, error)
        self.apply()
        return fault is not Fault.FAILED

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
                victims = self.core.free_for_retry(entry) if retries < self._oom_retries else []
                self.apply()
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
                self.emit(
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
        learned = self.core.note_alias_evidence(freed, entry.charge, self._alias_threshold)
        for keep, other in learned.merged:
            self.emit(
                "warning",
                ev.ALIAS_LEARNED,
                spaces=[keep, other],
                evidence=self._alias_threshold,
                cache=entry.owner.name,
                key=entry.key,
            )
        for refused in learned.refused:
            self.emit(
                "warning",
                ev.ALIAS_REFUSED,
                spaces=sorted(refused.spaces),
                circle=list(refused.circle),
                evidence=self._alias_threshold,
                cache=entry.owner.name,
                key=entry.key,
            )
        self.apply()

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
        slot.release_started = self.clock()
        self.emit("info", ev.LOAD_CANCELLED, cache=entry.owner.name, key=entry.key)
        self.core.load_abandoned(entry)
        self.emit(
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
            self.apply()

    async def _await_thread(self, cache: Block, entry: Entry, call: _ThreadCall) -> None:
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

    async def _release_orphan(self, cache: Block, entry: Entry, call: _ThreadCall) -> None:
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
            self.emit(
                "warning",
                ev.LOAD_FAILED,
                cache=entry.owner.name,
                key=entry.key,
                error=repr(call.error),
            )
        self.core.release_done(entry)
        self.apply()
        entry.shell.released.set()
        if call.error is not None and classify(call.error) is Fault.FATAL:
            raise call.error

    def _quarantine_lost(self, entry: Entry) -> None:
        """An abandoned load's thread can no longer be waited for: nobody will release its value."""
        self.core.release_failed(
            entry,
            ReleaseFailed(
                f"the broker was closed before the threaded load of "
                f"{entry.owner.name}:{entry.key!r} returned; what it makes is not released"
            ),
        )
        self.apply()
        entry.shell.released.set()

    async def _await_orphans(self) -> None:
        """Wait (at most ``release_timeout``) for abandoned loads' threads, and their releases."""
        limit = self.release_timeout
        with anyio.move_on_after(math.inf if limit is None else limit):
            for entry in list(self.core.orphans):
                await entry.shell.released.wait()

    def _spawn(
        self, func: Callable[..., Awaitable[Any]], *args: Any, name: str | None = None
    ) -> None:
        """Start ``func(*args)`` in the broker's own task group, in the current context."""
        assert self._tg is not None
        start_soon = cast(Callable[..., None], self._tg.start_soon)
        start_soon(func, *args, name=name)

    def _measure(
        self, entry: Entry, slot: _Slot, value: Any, where: str | None = None
    ) -> tuple[dict[str, int] | None, BaseException | None, BaseException | None]:
        """The measured size, else the error for the requesters, and what must propagate.

        ``where``: the space a plain amount is charged in (the space a placed
        load was given, or the one a move went to), instead of the default one.
        """
        if slot.measure is None:
            return None, None, None
        try:
            measured = slot.measure(value)
            if where is not None and not isinstance(measured, Mapping):
                return {where: parse_bytes(measured)}, None, None
            return parse_size(measured, self.budget), None, None
        except BaseException as exc:
            what = f"the size callable for {entry.owner.name}:{entry.key!r}"
            error: BrokerError
            if isinstance(exc, Exception):
                error = InvalidArgument(f"{what} failed on the loaded value: {exc}")
            else:
                error = LoadFailed(f"{what} raised {exc!r}")
            error.__cause__ = exc
            return None, error, exc if classify(exc) is Fault.FATAL else None

    def _start_release(self, entry: Entry, reason: Reason) -> None:
        cache = self._caches.get(entry.owner)
        slot: _Slot = entry.shell
        slot.released = anyio.Event()
        slot.release_started = self.clock()
        if entry.state is State.QUARANTINED:  # given up before it could start (_run_load)
            slot.released.set()
            return
        if cache is None or cache.closed:
            # The owner's block is gone: nobody is left to free the value.
            self.core.release_failed(
                entry,
                ReleaseFailed(
                    f"cache {entry.owner.name!r} was closed before "
                    f"{entry.owner.name}:{entry.key!r} could be released"
                ),
            )
            slot.released.set()
            return
        self.emit(
            "info",
            ev.RELEASE_REQUESTED,
            cache=cache.name,
            key=entry.key,
            reason=reason.value,
            bytes=dict(entry.charge),
        )
        cache.spawn(
            self._run_release, cache, entry, name=f"cachebroker release {cache.name}:{entry.key!r}"
        )

    async def _run_release(
        self, cache: Block, entry: Entry, spawn: Callable[..., None] | None = None
    ) -> None:
        """Ask ``cache``'s releaser to free ``entry``, watched by ``release_timeout``.

        The watchdog runs in the cache's task group, or through ``spawn``.
        """
        core = self.core
        slot: _Slot = entry.shell
        watchdog = anyio.CancelScope()
        if self.release_timeout is not None:
            (spawn or cache.spawn)(self._watch_release, entry, watchdog, self.release_timeout)
        task = self.current_task()
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
            self.emit(
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
            self.apply()
            assert slot.released is not None
            slot.released.set()

    def _start_move(self, entry: Entry, to: str) -> None:
        """Have the owner move ``entry``'s value to space ``to`` (a demotion or a promotion)."""
        cache = self._caches.get(entry.owner)
        slot: _Slot = entry.shell
        slot.release_started = self.clock()
        slot.timed_out = False
        slot.moving_to = to
        if cache is None or cache.closed or cache.move is None:
            self.core.move_failed(
                entry,
                ReleaseFailed(
                    f"cache {entry.owner.name!r} was closed before "
                    f"{entry.owner.name}:{entry.key!r} could be moved to {to!r}"
                ),
            )
            return
        self.emit(
            "info",
            ev.MOVE_START,
            cache=cache.name,
            key=entry.key,
            to=to,
            up=entry.promoting,
            bytes=dict(entry.charge),
        )
        cache.spawn(
            self._run_move, cache, entry, to, name=f"cachebroker move {cache.name}:{entry.key!r}"
        )

    async def _run_move(self, cache: Block, entry: Entry, to: str) -> None:
        """Run the owner's ``move``, watched by ``release_timeout``, and book how it ended.

        A move that raises, is cancelled or times out quarantines the entry
        with both charges (``Core.move_failed``): the value's state is unknown.
        """
        core = self.core
        slot: _Slot = entry.shell
        assert cache.move is not None
        watchdog = anyio.CancelScope()
        if self.release_timeout is not None:
            cache.spawn(self._watch_move, entry, to, watchdog, self.release_timeout)
        started = self.clock()
        task = self.current_task()
        self._releasing_tasks.add(task)  # (it may not wait for space: see request)
        try:
            # As after a release: the bytes it leaves on a probed device must show.
            going = freed(entry)
            probed = {n: free for n, free in self._free_before(entry).items() if n in going}
            # The owner's copy is the only one while it moves (so that what it
            # frees is free); the books hold the value again once it is back.
            moved, entry.value = entry.value, None
            value = await cache.move(entry.key, moved, to)
            del moved
            seconds = max(0.0, self.clock() - started)
            # A size callable that cannot measure the moved form (one made for
            # what the loader returns) leaves the charge as moved.
            measured, _, fatal = self._measure(entry, slot, value, to)
            if probed:
                await self._wait_for_memory(entry, probed, going)
        except BaseException as exc:
            watchdog.cancel()
            fault = classify(exc)
            if entry.state is State.MOVING and not slot.timed_out:
                failure = ReleaseFailed(
                    f"moving {entry.owner.name}:{entry.key!r} to {to!r} "
                    + ("was cancelled" if fault is Fault.CANCELLED else f"raised {exc!r}")
                )
                failure.__cause__ = exc
                self._move_failed(entry, failure)
            if fault is not Fault.FAILED:
                raise
            return
        finally:
            self._releasing_tasks.discard(task)
            if not self._releasing_tasks:
                self._releasing_tasks.clear()
        watchdog.cancel()
        if slot.timed_out:  # quarantined already: free what came back, as a late release
            await self._release_late_move(cache, entry, value)
            if fatal is not None:
                raise fatal
            return
        up = entry.promoting
        slot.moving_to = None
        stayed = core.move_done(entry, value, measured, seconds, self.clock())
        self.emit(
            "info",
            ev.MOVE_DONE,
            cache=cache.name,
            key=entry.key,
            to=to,
            up=up,
            seconds=round(seconds, 6),
            bytes=dict(entry.charge),
        )
        if stayed:  # (released: moving it down again would make no more room)
            self.emit(
                "warning", ev.MOVE_STAYED, cache=cache.name, key=entry.key, to=to, bytes=measured
            )
        if entry.idle_seq:
            self.note_idle(entry)
        self.apply()
        if fatal is not None:
            raise fatal

    async def _release_late_move(self, cache: Block, entry: Entry, value: Any) -> None:
        """A move that ended after ``release_timeout`` quarantined it: release the value it
        returned through the owner; acknowledged, both charges come back (``release_done``)."""
        slot: _Slot = entry.shell
        slot.released = anyio.Event()
        entry.value = value
        try:
            await self._released(cache, entry)
        except BaseException as exc:
            if classify(exc) is not Fault.FAILED:
                raise
            return  # the quarantine stands
        finally:
            slot.released.set()
        bytes_ = dict(entry.charge)
        self.core.release_done(entry)
        self.emit(
            "info",
            ev.RELEASE_FREED,
            cache=cache.name,
            key=entry.key,
            bytes=bytes_,
            late=True,
            seconds=self._since(slot.release_started),
        )
        self.apply()

    def _move_failed(self, entry: Entry, failure: BaseException) -> None:
        """Book a failed move: quarantined with both charges (logged by ``Quarantined``)."""
        self.core.move_failed(entry, failure)
        self.apply()

    async def _watch_move(
        self, entry: Entry, to: str, scope: anyio.CancelScope, timeout: float
    ) -> None:
        with scope:
            await anyio.sleep(timeout)
            entry.shell.timed_out = True  # (counted in moves_failed, not release_timeouts)
            self._move_failed(
                entry,
                ReleaseFailed(
                    f"moving {entry.owner.name}:{entry.key!r} to {to!r} was not "
                    f"acknowledged within {timeout:g}s"
                ),
            )

    async def _released(self, cache: Block, entry: Entry) -> None:
        """Run the releaser; warn if one of its steps blocked the event loop too long."""
        # The releaser holds the only reference from here: a ``del`` and an
        # allocator flush in ``release`` free the memory before it returns.
        value, entry.value = entry.value, None
        release = cache.release(entry.key, value)
        del value
        limit = self._blocking_warning
        if limit is None or not inspect.iscoroutine(release):
            await release
            return
        timed = _TimedSteps(release)
        try:
            await timed
        finally:
            if timed.longest > limit:
                self.releases_blocking += 1
                self.emit(
                    "warning",
                    ev.RELEASE_BLOCKING,
                    cache=cache.name,
                    key=entry.key,
                    seconds=round(timed.longest, 6),
                    limit=limit,
                )

    def _release_failed(self, entry: Entry, exc: BaseException) -> bool:
        """Book a release that raised ``exc`` (quarantined); return whether it must propagate."""
        fault = classify(exc)
        if fault is Fault.CANCELLED:
            failure = ReleaseFailed(f"releasing {entry.owner.name}:{entry.key!r} was cancelled")
        else:
            failure = ReleaseFailed(f"releasing {entry.owner.name}:{entry.key!r} raised {exc!r}")
            failure.__cause__ = exc
        self.core.release_failed(entry, failure)
        return fault is not Fault.FAILED

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
        """Quarantine ``entry`` once its release has run ``timeout`` seconds.

        The release runs on (a releaser cannot be stopped safely): its bytes
        are overdue, not lost, so requests may wait for them; ``_run_release``
        reports its end (``release_done`` frees them, ``release_failed``
        strands them until ``forget``).
        """
        with scope:
            await anyio.sleep(timeout)
            entry.shell.timed_out = True
            self.release_timeouts += 1
            self.core.release_overdue(
                entry,
                ReleaseFailed(
                    f"releasing {entry.owner.name}:{entry.key!r} was not acknowledged "
                    f"within {timeout:g}s"
                ),
            )
            self.apply()
            entry.shell.released.set()

    async def shared_totals(self) -> Mapping[str, int] | None:
        """The shared books' bytes used per space, for a connected broker; ``None`` here."""
        await anyio.lowlevel.checkpoint()
        return None

    async def await_releases(self, entries: list[Entry]) -> EvictionReport:
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
        core = self.core
        while True:
            deadline = core.next_expiry()
            self._sweep_at = deadline
            wake = self._sweep_wake = anyio.Event()
            delay = math.inf if deadline is None else max(0.0, deadline - self.clock())
            if self._probes:
                delay = min(delay, self._probe_interval or math.inf)
            if core.queue and self._lease_warning is not None:
                delay = min(delay, self._lease_warning / 4)
            with anyio.move_on_after(delay):
                await wake.wait()
            if self._probes:
                self._refresh_probes()
            core.sweep(self.clock())
            self.apply()
            self._check_held_leases()

    def _check_held_leases(self) -> None:
        """Report leases held for ``lease_warning`` seconds while requests wait for their space.

        Checked by the sweeper (woken when a request starts waiting, then every
        quarter of the threshold while any waits): a lease counts from the
        first check that saw it in a space somebody waits for, and is
        reported once while it stays so.
        """
        limit = self._lease_warning
        core = self.core
        if limit is None or not core.queue:
            self.held.clear()
            self._held_reported.clear()
            return
        now = self.clock()
        waited = {name for entry in core.queue for name in entry.need}
        held: dict[Entry, float] = {}
        for entry in core.busy:
            if entry.leases and not waited.isdisjoint(entry.charge):
                since = held[entry] = self.held.get(entry, now)
                if now - since >= limit and entry not in self._held_reported:
                    self._held_reported.add(entry)
                    self.emit(
                        "warning",
                        ev.LEASE_HELD,
                        cache=entry.owner.name,
                        key=entry.key,
                        holders=self._holder_names(entry),
                        seconds=round(now - since, 3),
                        waiting=sum(
                            len(w.joiners)
                            for w in core.queue
                            if not w.need.keys().isdisjoint(entry.charge)
                        ),
                    )
        self.held = held
        self._held_reported &= held.keys()

    def _holder_names(self, entry: Entry) -> list[str]:
        """How ``lease.held`` names ``entry``'s holders: by their tasks' names."""
        return [task_name(task) for task in entry.holders]

    def _refresh_probes(self) -> None:
        """Re-read every probed space's device and set its capacity.

        A space whose read fails keeps the capacity its last good reading gave;
        with no good reading yet, it is taken as full (what is used now).
        """
        core = self.core
        for name, probe in self._probes.items():
            reading = self._read_probe(name)
            held = core.spaces[name].used
            if reading is not None:
                total, free = reading
                capacity = max(0, min(total - probe.headroom, free + held - probe.headroom))
                core.set_capacity(name, capacity, limit=total - probe.headroom)
            elif name not in self._probe_ok:
                core.set_capacity(name, held)
        if self.running:
            self.apply()

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
            if self.log is None:  # from __init__: the broker has not bound its logger yet
                _logging.open_events(self._logger).warning(ev.PROBE_FAILED, **fields)
            else:
                self.emit("warning", ev.PROBE_FAILED, **fields)
            return None
        self._probe_ok.add(name)
        return reading

    async def _wait_for_memory(
        self, entry: Entry, before: dict[str, int], amounts: Mapping[str, int] | None = None
    ) -> None:
        """After a release (or a move: ``amounts``, the bytes it frees) on probed spaces,
        wait (bounded) for the device to show it."""
        freeing = entry.charge if amounts is None else amounts
        wanted = {name: free + int(0.75 * freeing.get(name, 0)) for name, free in before.items()}
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
        self.emit(
            "warning",
            ev.MEMORY_SLOW,
            cache=entry.owner.name,
            key=entry.key,
            spaces=sorted(short),
            waited=self._memory_wait,
        )

    def note_idle(self, entry: Entry) -> None:
        """Wake the sweeper if ``entry`` expires before its current deadline."""
        ttl = self.idle_ttl if entry.ttl is None else entry.ttl
        if ttl is None or ttl == math.inf or self._sweep_wake is None:
            return
        if self._sweep_at is None or entry.idle_since + ttl < self._sweep_at:
            self._sweep_wake.set()

    # ---------------------------------------------------------- the slow path

    async def request(
        self,
        owner: Owner,
        key: Hashable,
        load: Callable[[], Any],
        need: dict[str, int] | None,
        measure: Callable[[Any], Any] | None,
        cost: float | None,
        timeout: float | None,
        *,
        urgent: bool = False,
        held: tuple[Entry, ...] | None = None,
        slots: int | None = None,
        priority: int | None = None,
        places: tuple[str, ...] | None = None,
        bound: bool = True,
    ) -> tuple[Entry, object]:
        """Acquire ``key`` when it is not ready, or limited (a miss, a join, a slot wait):
        the entry and its holder.

        ``Cache._acquire_slow`` checked the arguments and parsed ``need``;
        ``urgent`` and ``held`` are for a request relayed from another process,
        ``bound`` says whether only this task can end the lease (``Core.request``).
        """
        task = self.current_task()
        core = self.core
        name = owner.name
        if self._probes:
            self._refresh_probes()
        if self._dropped:
            self._end_dropped()  # before their holder is taken to hold them still
        ticket = core.request(
            owner,
            key,
            need,
            task,
            cost=cost,
            loading=_LOADING.get(),
            urgent=urgent,
            held=held,
            slots=slots,
            priority=priority,
            places=places,
            bound=bound,
        )
        entry = ticket.entry
        if ticket.outcome is None and task in self._releasing_tasks:
            for_slot = entry.state is State.READY
            moving = entry.state in (State.MOVING, State.DEMOTED)
            if entry.state is State.WAITING or for_slot or moving:
                core.leave(ticket)
                self.apply()
                raise DeadlockError(
                    f"acquiring {name}:{key!r} from inside a release or a move would wait for "
                    + ("a lease slot" if for_slot else "a move" if moving else "space")
                    + ", and that may be waiting for this very release or move; a releaser "
                    "may only acquire what is loaded (with a free lease slot) or fits at once",
                    [],
                )
        if ticket.outcome is True:
            self.apply()
            self.log.debug(ev.HIT, cache=name, key=key)
            try:
                await anyio.lowlevel.checkpoint()
            except BaseException:  # cancelled here: nobody holds the lease but us
                core.lease_end(entry, task, self.clock())
                self.apply()
                raise
            return entry, task
        if entry.state is State.READY:  # waits for a lease slot
            self.log.debug(ev.WAIT_LEASE, cache=name, key=key, concurrency=entry.slots)
            self.apply()
            return await self._wait(ticket, timeout)
        if entry.shell is None:
            entry.shell = _Slot(load, measure, self.clock(), placed=places is not None)
            self.log.debug(ev.MISS, cache=name, key=key, bytes=need)
        if entry.state is State.WAITING:
            self.log.debug(ev.WAIT, cache=name, key=key, bytes=entry.need)
            if self._lease_warning is not None and self._sweep_wake is not None:
                self._sweep_wake.set()  # check on the leases it waits for from now on
        self.apply()
        return await self._wait(ticket, timeout)

    def adopt(
        self,
        owner: Owner,
        key: Hashable,
        load: Callable[[], Any],
        measure: Callable[[Any], Any],
        charge: dict[str, int],
        *,
        priority: int | None = None,
    ) -> Ticket:
        """Take on an entry another broker granted (``Core.adopt``), in this step.

        ``load`` returns what the entry's owner says of it once it says so
        (``measure`` reads its charge from that); ``settle(ticket)`` waits
        for it, as ``request`` waits for a load.
        """
        ticket = self.core.adopt(owner, key, charge, self.current_task(), priority=priority)
        ticket.entry.shell = _Slot(load, measure, self.clock())
        self.apply()
        return ticket

    async def settle(self, ticket: Ticket) -> tuple[Entry, object]:
        """Wait for an adopted entry's load (``adopt``): the entry and the lease's holder."""
        return await self._wait(ticket, None)

    async def prefetch(
        self,
        owner: Owner,
        key: Hashable,
        load: Callable[[], Any],
        need: dict[str, int] | None,
        measure: Callable[[Any], Any] | None,
        cost: float | None,
        timeout: float | None,
        idle_ttl: float | None,
        pin: bool,
        priority: int | None = None,
        places: tuple[str, ...] | None = None,
    ) -> None:
        """Have ``key`` loaded, holding no lease once it is (``Cache.prefetch``).

        As ``request``, from ``Core.prefetch``: no request is counted, and the
        lease the load's end grants is ended at once.
        """
        task = self.current_task()
        core = self.core
        if self._probes:
            self._refresh_probes()
        if self._dropped:
            self._end_dropped()
        ticket = core.prefetch(
            owner,
            key,
            need,
            task,
            self.clock(),
            cost=cost,
            idle_ttl=idle_ttl,
            pin=pin,
            loading=_LOADING.get(),
            priority=priority,
            places=places,
        )
        if ticket is None:  # loaded already
            self.apply()
            await anyio.lowlevel.checkpoint()
            return
        entry = ticket.entry
        if entry.state is State.WAITING and task in self._releasing_tasks:
            core.leave(ticket)
            self.apply()
            raise DeadlockError(
                f"prefetching {owner.name}:{key!r} from inside a release would wait for space, "
                "and that space may be waiting for this very release",
                [],
            )
        if entry.shell is None:
            entry.shell = _Slot(load, measure, self.clock(), placed=places is not None)
        if entry.state is State.WAITING:
            self.log.debug(ev.WAIT, cache=owner.name, key=key, bytes=entry.need)
            if self._lease_warning is not None and self._sweep_wake is not None:
                self._sweep_wake.set()
        self.apply()
        entry, holder = await self._wait(ticket, timeout, lease=False)
        # Loaded: the lease its end granted is given back in the same step.
        core.configure(entry, idle_ttl=idle_ttl, pin=pin or None)
        if holder is not None:
            core.lease_end(entry, holder, self.clock())
        self.apply()
        if not entry.leases:
            self.note_idle(entry)

    #: Whether these books choose among an acquire's places (``spaces=``).
    placement = True

    async def _wait(
        self, ticket: Ticket, timeout: float | None, *, lease: bool = True
    ) -> tuple[Entry, object]:
        """Wait for ``ticket``'s outcome: the entry and the lease's holder.

        ``lease=False`` (a prefetch): a loaded entry is enough; a ticket left
        waiting for a lease slot leaves the line instead, and the holder is
        ``None``.
        """
        core = self.core
        entry = ticket.entry

        def pending() -> bool:
            return ticket.outcome is None and (lease or entry.state is not State.READY)

        async def settled() -> None:
            slot = entry.shell
            if slot.done.is_set():
                # Set for earlier requesters (the load that ended): this one waits
                # for the next outcome (a lease slot, a move), not around a set event.
                slot.done = anyio.Event()
            await slot.done.wait()

        try:
            if timeout is None:
                while pending():
                    await settled()
            else:
                with anyio.fail_after(timeout):
                    while pending():
                        await settled()
        except TimeoutError:
            if ticket.outcome is None:
                waiting_for, what = self._waiting_for(entry)
                because = self._ask_why(entry)  # (asked before the request is withdrawn)
                core.leave(ticket)
                self.apply()
                if because is not None:
                    what = await because(what)
                name = entry.owner.name
                raise AcquireTimeout(
                    f"acquiring {name}:{entry.key!r} did not complete within {timeout:g}s: "
                    f"it was waiting for {what}",
                    entry=f"{name}:{entry.key!r}",
                    waiting_for=waiting_for,
                ) from None
            # Settled just as the deadline passed: the outcome stands.
        except BaseException:
            if ticket.outcome is True:  # Granted just as we were cancelled: give it back.
                core.lease_end(entry, ticket.task, self.clock())
            else:
                core.leave(ticket)
            self.apply()
            raise
        outcome = ticket.outcome
        if outcome is True:
            return entry, ticket.task
        if outcome is None:  # loaded, its slots taken: a prefetch needs no lease
            core.leave(ticket)
            self.apply()
            return entry, None
        assert isinstance(outcome, BaseException)
        raise _own_copy(outcome)

    def _ask_why(self, entry: Entry) -> Callable[[str], Awaitable[str]] | None:
        """For a request that timed out waiting for another broker's grant: ask it why.

        Called before the request is withdrawn; returns what completes the
        words of ``_waiting_for`` with that broker's answer. In-process the
        books know why themselves: ``None``.
        """
        return None

    def _waiting_for(self, entry: Entry) -> tuple[str | None, str]:
        """What a request of ``entry`` waits for: ``AcquireTimeout.waiting_for``, and in
        words; waiting for space, why there is none (``Core.why_no_room``)."""
        waiting_for, what = _waiting_for(entry)
        if waiting_for == "space" and not entry.gated and entry.need:
            what += f": {self.core.why_no_room(entry)}"
        return waiting_for, what


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


def _waiting_for(entry: Entry) -> tuple[str | None, str]:
    """What a request of ``entry`` still waits for: ``AcquireTimeout.waiting_for``, and in words."""
    if entry.state is State.LOADING:
        return "load", "its load to finish"
    if entry.state is State.READY:
        return "lease", (
            f"a lease slot: concurrency={entry.slots}, {entry.leases} lease(s) held, "
            f"{len(entry.joiners)} request(s) waiting"
        )
    need = ", ".join(f"{format_bytes(n)} in {name!r}" for name, n in entry.need.items())
    if entry.places is not None and entry.need:  # any of them would do
        places = ", ".join(map(repr, entry.places))
        need = f"{format_bytes(sum(entry.need.values()))} in any of {places}"
    if entry.state is State.MOVING:
        if entry.promoting:
            return "load", "its move back up from the lower tier"
        return "load", "its move down a tier to end, then its move back up"
    if entry.state is State.DEMOTED:
        return "space", f"space ({need}) to move it back up from the lower tier"
    if entry.state is not State.WAITING:
        return None, f"the entry, which was {entry.state.value}"
    if entry.after is not None:
        return "release", "the release of the key's previous value"
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
