"""Loads: the loaders' runs, their free-and-retry on out-of-memory errors, and their threads.

``Loads`` starts each load the books grant (``StartLoad``) as a task of the
owning cache's block, in its context: it waits for another broker's grant
where one decides (``Remote.admit``), runs the loader (a plain one in a
worker thread), frees the next victims and retries on an ``oom_errors``
error (learning aliased spaces from what freeing helped), measures the
value and books the outcome (``Core.load_done``, ``Core.load_failed``). A
load given up while its thread runs (its cache closed) is abandoned: the
broker's own task releases what the thread makes once it returns.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any

import anyio
import anyio.to_thread

from .. import _log_events as ev
from .._core import Entry, Owner, Reason
from .._errors import BrokerClosed, DeadlockError, LoadFailed, OutOfSpace, ReleaseFailed
from ._actor import Block
from ._backend import Fault, classify
from ._releases import Releases
from ._seam import Remote
from ._steps import LOADING, Slot, Spawn, Steps, measure, since

__all__ = ["Loads"]


class Loads:
    """The loads of the books' entries: admission, the loader's run, OOM retries, threads."""

    __slots__ = (
        "_alias_threshold",
        "_caches",
        "_note_idle",
        "_oom_errors",
        "_oom_retries",
        "_releases",
        "_remote",
        "_spawn",
        "_steps",
        "shared_retries",
    )

    def __init__(
        self,
        steps: Steps,
        caches: Mapping[Owner, Block],
        releases: Releases,
        remote: Remote,
        *,
        spawn: Callable[..., None],
        note_idle: Callable[[Entry], None],
        oom_errors: tuple[type[BaseException], ...],
        oom_retries: int,
        alias_threshold: int,
    ) -> None:
        self._steps = steps
        self._caches = caches
        self._releases = releases
        self._remote = remote
        #: Start a task in the broker's own task group (it may outlive the cache).
        self._spawn: Spawn = spawn
        self._note_idle = note_idle
        self._oom_errors = oom_errors
        self._oom_retries = oom_retries
        self._alias_threshold = alias_threshold
        #: Retries after the shared books freed victims (``Stats.oom_retries`` beside the
        #: books' own count of theirs).
        self.shared_retries = 0

    def start(self, entry: Entry) -> None:
        """``StartLoad``: run ``entry``'s loader in its cache's block."""
        self._remote.load_started(entry)
        cache = self._caches[entry.owner]
        if not self._remote.admits_elsewhere:
            self._granted(entry)
            if cache.elsewhere is not None:  # (asked in this step: its loader only waits)
                cache.elsewhere.granted(entry.key, self._space(entry))
        cache.spawn(self._run, entry, name=f"cachebroker load {cache.name}:{entry.key!r}")

    def _announce(self, entry: Entry, level: str, event: str, **fields: Any) -> None:
        """Emit a load's ``event``, unless its cache is the broker's own (``Block.quiet``)."""
        cache = self._caches.get(entry.owner)
        if cache is None or not cache.quiet:
            self._steps.emit(level, event, **fields)

    def _space(self, entry: Entry) -> str | None:
        """Where the books placed ``entry``, for a request that let them choose (``spaces=``)."""
        if not entry.shell.placed:
            return None
        return self._steps.core.owner_space(entry, next(iter(entry.charge)))

    def _granted(self, entry: Entry) -> None:
        """``cachebroker.grant``: ``entry``'s bytes are its load's (the wait for space is over)."""
        self._announce(
            entry,
            "debug",
            ev.GRANT,
            cache=entry.owner.name,
            key=entry.key,
            bytes=dict(entry.charge),
            waited=since(self._steps.clock, entry.shell.queued_at),
        )

    async def _run(self, entry: Entry) -> None:
        LOADING.set((*LOADING.get(), entry))  # (this task's own context)
        slot: Slot = entry.shell
        steps = self._steps
        with anyio.CancelScope() as scope:
            slot.scope = scope
            if slot.cancelled:
                scope.cancel()
            while True:
                try:
                    refused = await self._remote.admit(entry)
                except BaseException as exc:
                    if self._failed(entry, exc):
                        raise
                    return
                if refused is None:
                    break
                if not self._ask_again(entry, refused):
                    steps.core.load_failed(entry, refused, cancelled=True)
                    steps.apply()
                    return
            if self._remote.admits_elsewhere:
                self._granted(entry)
            space = self._space(entry)
            if space is not None:  # the loader learns where (once granted), by the name it gave
                slot.load = functools.partial(slot.load, space)
            self._announce(
                entry,
                "info",
                ev.LOAD_START,
                cache=entry.owner.name,
                key=entry.key,
                bytes=dict(entry.charge),
            )
            started = steps.clock()
            try:
                value = await self._load_freeing_on_oom(entry, slot)
            except _Abandoned:
                return  # booked by _abandon
            except BaseException as exc:
                if self._failed(entry, exc):
                    raise
                return
            self._done(entry, slot, value, max(0.0, steps.clock() - started))

    def _done(self, entry: Entry, slot: Slot, value: Any, seconds: float) -> None:
        """Book a load that returned ``value``: measured, or failed by its size callable."""
        steps = self._steps
        core = steps.core
        cache_name = entry.owner.name
        where = core.owner_space(entry, next(iter(entry.charge))) if slot.placed else None
        measured, error, fatal = measure(entry, slot, value, steps.budget, where)
        core.load_done(entry, value, measured, seconds, steps.clock(), error=error)
        if fatal is not None:
            # No time is left to release the value through its owner: it is
            # quarantined before its release starts (see Releases.start).
            core.release_failed(
                entry,
                ReleaseFailed(
                    f"{cache_name}:{entry.key!r} was not released: "
                    f"its size callable raised {fatal!r}"
                ),
            )
        if entry.idle_seq:
            self._note_idle(entry)
        self._announce(
            entry,
            "info",
            ev.LOAD_DONE,
            cache=cache_name,
            key=entry.key,
            seconds=round(seconds, 6),
            bytes=dict(entry.charge),
        )
        steps.apply()
        if fatal is not None:
            raise fatal

    def _failed(self, entry: Entry, exc: BaseException) -> bool:
        """Book a load that raised ``exc``; return whether ``exc`` must propagate.

        The broker's own cancellation cancels the load. Anything else fails it
        for every requester: they get the loader's exception, or, for what is
        no ordinary error (a ``CancelledError`` not meant for the broker, a
        process-level ``BaseException``), a ``LoadFailed`` chained to it.
        """
        fault = classify(exc)
        cache_name = entry.owner.name
        steps = self._steps
        if fault is Fault.CANCELLED:
            self._announce(entry, "info", ev.LOAD_CANCELLED, cache=cache_name, key=entry.key)
            cancelled = BrokerClosed(f"the load of {cache_name}:{entry.key!r} was cancelled")
            steps.core.load_failed(entry, cancelled, cancelled=True)
        else:
            self._announce(
                entry, "warning", ev.LOAD_FAILED, cache=cache_name, key=entry.key, error=repr(exc)
            )
            error = exc
            if not isinstance(exc, Exception):
                error = LoadFailed(f"loading {cache_name}:{entry.key!r} raised {exc!r}")
                error.__cause__ = exc
            steps.core.load_failed(entry, error)
        steps.apply()
        return fault is not Fault.FAILED

    def _ask_again(self, entry: Entry, refused: BaseException) -> bool:
        """Whether ``entry``'s load asks the other broker again after ``refused``.

        A ``DeadlockError`` refused the request for its first requester's own
        leases (``Link.request`` names them): as in one process, only that
        task gets the error, and the load is asked for again for the others.
        """
        if not isinstance(refused, DeadlockError) or len(entry.joiners) < 2:
            return False
        self._steps.core.leave(entry.joiners[0], refused)
        self._steps.apply()
        self._remote.load_started(entry)
        return True

    # ------------------------------------------------------- free and retry

    async def _load_freeing_on_oom(self, entry: Entry, slot: Slot) -> Any:
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
                room = retries < self._oom_retries
                victims = await self._free_for_retry(entry, exc, retries + 1) if room else None
                if victims is None:
                    why = (
                        "nothing is left to free"
                        if room
                        else f"{retries} retries after freeing did not help"
                    )
                    raise OutOfSpace(
                        f"loading {entry.owner.name}:{entry.key!r} ran out of memory and {why}"
                    ) from exc
                retries += 1
                freed = victims
            else:
                if retries and entry.charge:
                    self._learn_aliases(freed - set(entry.charge), entry)
                return value

    async def _free_for_retry(
        self, entry: Entry, exc: BaseException, attempt: int
    ) -> set[str] | None:
        """Free the next victims for ``entry``'s retry and await their releases: the
        spaces they were in (``None``: nothing is left to free).

        The shared books free, when the broker answers to them (any process's
        idle entries, in their policy's order); else these books.
        """
        steps = self._steps
        shared = await self._remote.free_for_retry(entry)
        if shared is not None:
            victims: list[tuple[str, Hashable]] = list(shared.victims)
            spaces = set(shared.spaces)
            released: list[anyio.Event] = []
            self.shared_retries += bool(victims)
        else:
            chosen = steps.core.free_for_retry(entry)
            steps.apply()
            victims = [(v.owner.name, v.key) for v in chosen]
            spaces = {name for victim in chosen for name in victim.charge}
            released = [v.shell.released for v in chosen if v.shell.released is not None]
        if not victims:
            return None
        self._announce(
            entry,
            "warning",
            ev.LOAD_RETRY,
            cache=entry.owner.name,
            key=entry.key,
            attempt=attempt,
            error=repr(exc),
            freed=victims,
        )
        for event in released:
            await event.wait()
        return spaces

    def _learn_aliases(self, freed: set[str], entry: Entry) -> None:
        """The load fit only after freeing in ``freed``: evidence of one memory (learned
        by the shared books, when the broker answers to them: ``Remote.learns_aliases``)."""
        if freed and not self._remote.learns_aliases(entry, freed):
            self.learn(freed, entry.charge, entry.owner.name, entry.key)

    def learn(
        self, freed: Iterable[str], loaded: Iterable[str], cache: str, key: Hashable
    ) -> list[tuple[str, str]]:
        """A load of ``cache:key`` in ``loaded`` fit only after freeing in ``freed``: note
        the evidence, merge at the threshold, say so; the pairs merged."""
        steps = self._steps
        threshold = self._alias_threshold
        learned = steps.core.note_alias_evidence(freed, loaded, threshold)
        for keep, other in learned.merged:
            steps.emit(
                "warning",
                ev.ALIAS_LEARNED,
                spaces=[keep, other],
                evidence=threshold,
                cache=cache,
                key=key,
            )
        for refused in learned.refused:
            steps.emit(
                "warning",
                ev.ALIAS_REFUSED,
                spaces=sorted(refused.spaces),
                circle=list(refused.circle),
                evidence=threshold,
                cache=cache,
                key=key,
            )
        steps.apply()
        return learned.merged

    # --------------------------------------------------------------- threads

    async def _load_in_thread(self, entry: Entry, slot: Slot) -> Any:
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
        steps = self._steps
        call.orphaned = True
        slot: Slot = entry.shell
        slot.released = anyio.Event()
        slot.release_started = steps.clock()
        self._announce(entry, "info", ev.LOAD_CANCELLED, cache=entry.owner.name, key=entry.key)
        steps.core.load_abandoned(entry)
        self._announce(
            entry,
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
            steps.apply()

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
            await self._releases.run(cache, entry, self._releases.prepare(cache, entry))
            return
        # Nothing was made (the loader raised, or handed back an awaitable that
        # nobody will run): nothing is left to free.
        if inspect.iscoroutine(value):
            value.close()
        if call.error is not None:
            self._announce(
                entry,
                "warning",
                ev.LOAD_FAILED,
                cache=entry.owner.name,
                key=entry.key,
                error=repr(call.error),
            )
        self._steps.core.release_done(entry)
        self._steps.apply()
        entry.shell.released.set()
        if call.error is not None and classify(call.error) is Fault.FATAL:
            raise call.error

    def _quarantine_lost(self, entry: Entry) -> None:
        """An abandoned load's thread can no longer be waited for: nobody will release its value."""
        self._steps.core.release_failed(
            entry,
            ReleaseFailed(
                f"the broker was closed before the threaded load of "
                f"{entry.owner.name}:{entry.key!r} returned; what it makes is not released"
            ),
        )
        self._steps.apply()
        entry.shell.released.set()

    async def await_orphans(self) -> None:
        """Wait (at most ``release_timeout``) for abandoned loads' threads, and their releases."""
        limit = self._steps.release_timeout
        with anyio.move_on_after(math.inf if limit is None else limit):
            for entry in list(self._steps.core.orphans):
                await entry.shell.released.wait()


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
