"""The runner: the event loop's actor, which applies the books' effects through its parts.

The loop is single-threaded, so the broker needs no mailbox: every public
operation runs its bookkeeping as one synchronous step on the ``Core`` (which
never awaits), then performs the effects the step queued (``Runner.apply``):
starting loads and releases in the owners' task groups, waking waiters,
before it awaits anything. Steps are therefore atomic and served in the order
the loop runs them, and a cache hit costs a dictionary lookup and a counter,
not a round trip through a queue.

The runner keeps the life cycle (the loop it is bound to, its task group,
the caches' blocks) and dispatches each effect to the part that performs
it, each in a module of its own and each seeing the runner only as
``Steps``: loads and their free-and-retry (``_loads``), releases, moves and
their watchdogs (``_releases``), the idle sweeper and the probes
(``_sweeper``), the requests that wait (``_requests``). Where another
broker's books decide, the runner asks and tells it through one seam
(``_seam.Remote``).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Awaitable, Callable, Coroutine, Hashable, Iterable
from threading import get_ident
from types import TracebackType
from typing import Any, assert_never, cast

import anyio
import anyio.abc

from .. import _log_events as ev
from .._core import (
    CancelLoad,
    Core,
    Entry,
    Owner,
    OwnerEmpty,
    Quarantined,
    Request,
    Settled,
    StartLoad,
    StartMove,
    StartRelease,
    State,
    Ticket,
)
from .._errors import BrokerClosed, LeasesOutstanding
from .._stats import EvictionReport
from ..probes import Probe
from . import _backend, _logging
from ._actor import Block, Elsewhere
from ._config import Listener, MoveFunction, ReleaseFunction
from ._deadlines import Deadlines
from ._loads import Loads
from ._releases import HeldLeases, Releases
from ._requests import Requests
from ._seam import LOCAL, Remote
from ._steps import since
from ._sweeper import Probes, Sweeper

__all__ = ["Runner"]

_DEBUG = logging.DEBUG

#: Seconds the exit of a cache block (or of the broker) waits for releases and
#: leases in silence; past them it says what it waits for, and for how long at
#: most (``cachebroker.close.waiting``). Releases usually take far less.
CLOSE_NOTICE = 1.0


class Runner:
    """Runs one broker: its books, effects and tasks (the ``Actor`` of ``Cache`` and ``Lease``).

    The ``Broker`` owns one and is its facade; ``Cache`` and ``Lease`` use only
    its ``Actor`` interface (``_actor``): the public attributes and methods
    below. Its parts (``loads``, ``releases``, ``sweeper``, ``probes``,
    ``held_leases``, ``requests``) see it as ``Steps``; ``remote`` is its other side.
    """

    # Slots: the hit path reads ``core``, ``thread``, ``checkpoint``, ``current_task``,
    # ``trace`` and ``idle_ttl`` on every call.
    __slots__ = (
        "_caches",
        "_call_soon",
        "_debug_check",
        "_depth",
        "_logger",
        "_stepped",
        "_tg",
        "_user_clock",
        "budget",
        "checkpoint",
        "clock",
        "core",
        "current_task",
        "deadlines",
        "held_leases",
        "idle_ttl",
        "listeners",
        "loads",
        "log",
        "probes",
        "release_timeout",
        "releases",
        "remote",
        "requests",
        "running",
        "sweeper",
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
        remote: Remote = LOCAL,
    ) -> None:
        self.core = core
        self.budget = budget
        self.idle_ttl = idle_ttl
        self.release_timeout = release_timeout
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
        self.listeners: list[Listener] = []
        self.remote = remote
        #: How deep ``apply`` calls are nested now, and what their outermost one calls last.
        self._depth = 0
        self._stepped: list[Callable[[], None]] = []
        self.probes = Probes(self, probes, memory_wait, logger)
        self.held_leases = HeldLeases(self, remote, lease_warning)
        self.sweeper = Sweeper(self, self.probes, self.held_leases, probe_interval)
        #: Every watchdog's timer (``Releases``), run by one task of the broker's.
        self.deadlines = Deadlines()
        self.releases = Releases(
            self,
            self._caches,
            self.probes,
            remote,
            deadlines=self.deadlines,
            note_idle=self.sweeper.note_idle,
            blocking_warning=blocking_warning,
        )
        self.loads = Loads(
            self,
            self._caches,
            self.releases,
            remote,
            spawn=self._spawn,
            note_idle=self.sweeper.note_idle,
            oom_errors=oom_errors,
            oom_retries=oom_retries,
            alias_threshold=alias_threshold,
        )
        self.requests = Requests(self, self.probes, self.releases, self.sweeper, remote)
        self.probes.refresh()

    # ------------------------------------------------------------ life cycle

    async def start(self) -> None:
        """Connect the remote side, bind the running event loop, open the task group, start
        the sweeper (and what the remote side runs)."""
        terms = await self.remote.start(self)
        try:
            if terms is not None:  # the books and settings of the broker that decides
                self.core = terms.core
                self.budget = terms.budget
                self.idle_ttl = terms.idle_ttl
                self.release_timeout = terms.release_timeout
            backend = _backend.running_backend()
            self.current_task = _backend.current_task_getter(backend)
            self.thread = get_ident()
            self._call_soon = _backend.call_soon_threadsafe(backend)
            if backend == "trio":
                self.checkpoint = _backend.trio_hit_checkpoint()
            if self._user_clock is None:
                self.clock = _backend.loop_clock(backend)
            self.log = _logging.open_events(self._logger)
            self.probes.bound = True
            self._debug_check = _logging.debug_check(self.log)
            self.trace = self._debug_check(_DEBUG)
            self.sweeper.prepare()
            tg = anyio.create_task_group()
            await tg.__aenter__()
        except BaseException:
            await self.remote.stop()
            raise
        self._tg = tg
        self.running = True
        tg.start_soon(self.sweeper.run, name="cachebroker idle sweeper")
        tg.start_soon(self.deadlines.run, name="cachebroker deadlines")
        self.remote.started(self._spawn)

    async def stop(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        """Close every open cache, wait for orphaned loads, stop the remote side and the task
        group (``Broker``)."""
        tg = self._tg
        assert tg is not None
        try:
            with anyio.CancelScope(shield=True):
                for cache in list(self._caches.values()):
                    await self._shut(cache, BrokerClosed("the broker was closed"))
                await self.loads.await_orphans()
                await self.remote.stop()
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
        elsewhere: Elsewhere | None = None,
        quiet: bool = False,
    ) -> Block:
        """Open cache ``name``: its owner in the books (with its defaults), its task group
        (``quiet``: the broker's own, ``Block.quiet``)."""
        owner = self.core.open_owner(
            name, slots=slots, priority=priority, ttl=ttl, moves=move is not None
        )
        tg = anyio.create_task_group()
        try:
            await tg.__aenter__()
        except BaseException:
            self.core.forget_owner(owner)
            raise
        cache = self._caches[owner] = Block(owner, release, tg, move, elsewhere, quiet=quiet)
        self.remote.cache_opened(name, move is not None)
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
            return await self._close(cache, exc_type, exc, tb)
        finally:
            self.remote.cache_closed(cache.name)

    async def _close(
        self,
        cache: Block,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
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
                    self.emit("warning", ev.CLOSE_WAITING, **_close_waiting(cache, deadline))
            await cache.empty.wait()
        cache.shut_wait = self.clock() - started
        return [entry.key for entry in owner.live if entry.leases]

    def _spawn(
        self, func: Callable[..., Awaitable[Any]], *args: Any, name: str | None = None
    ) -> None:
        """Start ``func(*args)`` in the broker's own task group, in the current context."""
        assert self._tg is not None
        start_soon = cast(Callable[..., None], self._tg.start_soon)
        start_soon(func, *args, name=name)

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
        self._call_soon(self.requests.end_lease, entry, task)

    def lease_dropped(self, entry: Entry, task: object, key: Hashable) -> None:
        """A held lease was garbage-collected: end it on the broker's loop, and warn.

        Not here: a collection may run inside a step of the books, or in
        another thread. A callback ends it soon; the next request that is not
        a hit ends it first, so that the dropping task, asking again at once,
        is not told that its own lease is in the way.
        """
        self.requests.dropped(entry, task, key, self._call_soon)

    def note_idle(self, entry: Entry) -> None:
        """Wake the sweeper if ``entry`` expires before its current deadline."""
        self.sweeper.note_idle(entry)

    def learn_aliases(
        self, freed: Iterable[str], loaded: Iterable[str], cache: str, key: Hashable
    ) -> list[tuple[str, str]]:
        """Evidence that ``freed`` and ``loaded`` are one memory (``Loads.learn``): the
        pairs of spaces merged by it."""
        return self.loads.learn(freed, loaded, cache, key)

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

    def at_step_end(self, callback: Callable[[], None]) -> bool:
        """Call ``callback`` once the effects being applied now are (``apply``), after
        every watcher they woke; false if no effect is being applied.

        What a step decides for another process leaves with it in one write
        (``_sockets.Outlet.flush``), rather than a turn of the loop later.
        """
        if not self._depth:
            return False
        self._stepped.append(callback)
        return True

    def apply(self) -> None:
        """Perform the effects queued by the core's last steps (never awaits); then
        call the watchers they woke, and once the outermost call is over, what was
        left for the step's end (``at_step_end``)."""
        core = self.core
        watching: list[Callable[[], None]] | None = None
        self._depth += 1
        try:
            while core.effects:
                effects, core.effects = core.effects, []
                for effect in effects:
                    match effect:
                        case Settled(entry):
                            slot = entry.shell
                            slot.done.set()
                            if entry.joiners:  # one requester was refused alone: the rest wait
                                slot.done = anyio.Event()
                            if slot.watchers:
                                watching = (watching or []) + slot.watchers
                                slot.watchers = []
                        case StartLoad(entry):
                            self.loads.start(entry)
                        case StartRelease(entry, reason):
                            self.releases.start(entry, reason)
                        case StartMove(entry, to):
                            self.releases.start_move(entry, to)
                        case CancelLoad(entry):
                            _cancel_load(entry)
                        case Quarantined(entry):
                            self._quarantined(entry)
                        case OwnerEmpty(owner):
                            cache = self._caches.get(owner)
                            if cache is not None:
                                cache.empty.set()
                        case _:
                            assert_never(effect)
            for callback in watching or ():  # (the books are as these effects left them)
                callback()
        finally:
            self._depth -= 1
            if not self._depth and self._stepped:
                stepped, self._stepped = self._stepped, []
                for callback in stepped:
                    callback()

    def _quarantined(self, entry: Entry) -> None:
        """``Quarantined``: say that ``entry``'s release (or move) failed."""
        slot = entry.shell
        moved = {} if slot.moving_to is None else {"to": slot.moving_to}
        self.emit(
            "error",
            ev.RELEASE_FAILED if slot.moving_to is None else ev.MOVE_FAILED,
            cache=entry.owner.name,
            key=entry.key,
            error=repr(entry.error),
            timed_out=slot.timed_out,
            seconds=since(self.clock, slot.release_started),
            bytes=dict(entry.charge),
            **moved,
        )

    # ---------------------------------------------------------- the slow path

    def request(
        self,
        owner: Owner,
        request: Request,
        *,
        urgent: bool = False,
        held: tuple[Entry, ...] | None = None,
        bound: bool = True,
        loading: tuple[Entry, ...] | None = None,
        counted: bool = True,
        releasing: bool = False,
    ) -> Coroutine[Any, Any, tuple[Entry, object]]:
        """Acquire ``request.key`` when it is not ready, or limited (a miss, a join, a slot
        wait): the entry and its holder (``Requests.request``).

        ``Cache._acquire_slow`` checked the request and parsed its ``need``;
        ``urgent``, ``held`` and ``loading`` (the loads it is made from, by default
        those this task runs in) are for a request relayed from another process,
        ``bound`` says whether only this task can end the lease (``Core.request``);
        ``counted=False``: a prefetch's, relayed (``Core.prefetch``); ``releasing``: a
        release's there (refused rather than made to wait).
        """
        return self.requests.request(
            owner,
            request,
            urgent=urgent,
            held=held,
            bound=bound,
            loading=loading,
            counted=counted,
            releasing=releasing,
        )

    def submit(
        self,
        owner: Owner,
        request: Request,
        *,
        task: object,
        urgent: bool = False,
        held: tuple[Entry, ...] | None = None,
        loading: tuple[Entry, ...] | None = None,
        counted: bool = True,
        releasing: bool = False,
    ) -> Ticket:
        """``request``'s step, in this step (``Requests.submit``): its ticket, settled
        or pending. The broker that serves other processes relays a request with no
        task waiting for it: ``task`` holds the lease, and a watcher
        (``entry.shell.watch``) hears the ticket's outcome."""
        return self.requests.submit(
            owner,
            request,
            task=task,
            urgent=urgent,
            held=held,
            loading=loading,
            counted=counted,
            releasing=releasing,
        )

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
        return self.requests.adopt(owner, key, load, measure, charge, priority=priority)

    def settle(self, ticket: Ticket) -> Coroutine[Any, Any, tuple[Entry, object]]:
        """Wait for an adopted entry's load (``adopt``): the entry and the lease's holder."""
        return self.requests.settle(ticket)

    def prefetch(self, owner: Owner, request: Request) -> Coroutine[Any, Any, None]:
        """Have ``request.key`` loaded, holding no lease once it is (``Cache.prefetch``).

        As ``request``, from ``Core.prefetch``: no request is counted, and the
        lease the load's end grants is ended at once.
        """
        return self.requests.prefetch(owner, request)

    def await_releases(self, entries: list[Entry]) -> Coroutine[Any, Any, EvictionReport]:
        """Wait for the releases of ``entries`` to be acknowledged (or to fail)."""
        return self.releases.await_releases(entries)


def _cancel_load(entry: Entry) -> None:
    """``CancelLoad``: stop ``entry``'s load, and, when its cache closes, its thread's wait."""
    slot = entry.shell
    slot.cancelled = True
    if slot.scope is not None:
        slot.scope.cancel()
    if entry.owner.closing:
        # Its cache closes: stop waiting for a worker thread, which cannot be
        # stopped (see Loads._load_in_thread).
        slot.abandoned = True
        if slot.thread_wait is not None:
            slot.thread_wait.cancel()


def _close_waiting(cache: Block, deadline: float) -> dict[str, Any]:
    """What the exit of ``cache`` waits for, and for how long at most (``deadline``; inf: none)."""
    name = cache.owner.name
    seconds = deadline - anyio.current_time()
    live = sorted(cache.owner.live, key=lambda entry: repr(entry.key))
    return {
        "cache": name,
        "releases": [f"{name}:{e.key!r}" for e in live if e.state is State.RELEASING],
        "leases": [f"{name}:{e.key!r}" for e in live if e.leases],
        "loads": [f"{name}:{e.key!r}" for e in live if e.state is State.LOADING],
        "seconds": None if seconds == math.inf else round(max(0.0, seconds), 3),
    }
