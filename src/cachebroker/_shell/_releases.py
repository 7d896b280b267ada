"""Releases and moves, run by the owners' releasers, and their watchdogs.

``Releases`` starts each release (``StartRelease``) and move (``StartMove``)
the books ask for as a task of the owning cache's block, watched by
``release_timeout`` (past it the entry is quarantined, its bytes overdue)
and timed for steps that block the event loop; after a release on a probed
space it waits for the device to show the freed bytes. How a release done
in another process ended comes through the seam (``Remote.release_outcome``).
``HeldLeases`` is the other watchdog: leases held for ``lease_warning``
seconds while requests wait for their space.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable, Coroutine, Generator, Mapping
from typing import Any

import anyio

from .. import _log_events as ev
from .._core import Entry, Owner, Reason, State
from .._core._tiers import destination, freed
from .._errors import BrokerClosed, DeadlockError, ReleaseFailed
from .._stats import EvictionReport
from ._actor import Block
from ._backend import Fault, classify, task_name
from ._deadlines import Deadlines
from ._seam import FailedThere, Refused, Remote
from ._steps import Slot, Steps, measure, since
from ._sweeper import Probes

__all__ = ["HeldLeases", "Releases"]


class Releases:
    """The releases and moves of the books' entries, through their owners, and their watchdog."""

    __slots__ = (
        "_blocking_warning",
        "_caches",
        "_deadlines",
        "_note_idle",
        "_probes",
        "_remote",
        "_steps",
        "blocking",
        "releasing_tasks",
        "timeouts",
    )

    def __init__(
        self,
        steps: Steps,
        caches: Mapping[Owner, Block],
        probes: Probes,
        remote: Remote,
        *,
        deadlines: Deadlines,
        note_idle: Callable[[Entry], None],
        blocking_warning: float | None,
    ) -> None:
        self._steps = steps
        #: The broker's timers: each release's and move's watchdog.
        self._deadlines = deadlines
        self._caches = caches
        self._probes = probes
        self._remote = remote
        self._note_idle = note_idle
        self._blocking_warning = blocking_warning
        #: The tasks running a release or a move: they may not wait for space.
        self.releasing_tasks: set[object] = set()
        #: Counters for ``Broker.stats()``: releases timed out, releases that blocked.
        self.timeouts = 0
        self.blocking = 0

    # -------------------------------------------------------------- releases

    def start(self, entry: Entry, reason: Reason) -> None:
        """``StartRelease``: have the owner release ``entry``, in its block's task group."""
        cache = self._caches.get(entry.owner)
        slot: Slot = entry.shell
        slot.released = anyio.Event()
        slot.release_started = self._steps.clock()
        slot.release_reason = reason
        if entry.state is State.QUARANTINED:  # given up before it could start (Loads)
            slot.released.set()
            return
        if cache is None or cache.closed:
            # The owner's block is gone: nobody is left to free the value.
            self._steps.core.release_failed(
                entry,
                ReleaseFailed(
                    f"cache {entry.owner.name!r} was closed before "
                    f"{entry.owner.name}:{entry.key!r} could be released"
                ),
            )
            slot.released.set()
            return
        self._steps.emit(
            "info",
            ev.RELEASE_REQUESTED,
            cache=cache.name,
            key=entry.key,
            reason=reason.value,
            bytes=dict(entry.charge),
        )
        probed = self.prepare(cache, entry)
        cache.spawn(
            self.run, cache, entry, probed, name=f"cachebroker release {cache.name}:{entry.key!r}"
        )

    def prepare(self, cache: Block, entry: Entry) -> dict[str, int]:
        """In the step that starts ``entry``'s release: read the memory probes before the
        release can free anything (``Probes.free_before``), then ask a block whose values
        live in another process (``Elsewhere``); ``run`` takes the reading."""
        probed = self._probes.free_before(entry)
        _ask_elsewhere(cache, entry)
        return probed

    async def run(self, cache: Block, entry: Entry, probed: dict[str, int]) -> None:
        """Ask ``cache``'s releaser to free ``entry``, watched by ``release_timeout``.

        ``probed``: the memory probes' reading before the release (``prepare``).
        """
        steps = self._steps
        slot: Slot = entry.shell
        timeout = steps.release_timeout
        watchdog = None
        if timeout is not None:
            watchdog = self._deadlines.after(
                timeout, functools.partial(self._release_overdue, entry, timeout)
            )
        task = steps.current_task()
        self.releasing_tasks.add(task)
        try:
            await self._released(cache, entry)
            if probed:
                await self._probes.wait_for_memory(entry, probed)
        except BaseException as exc:
            if self._release_failed(entry, exc):
                raise
        else:
            entry.value = None
            late = entry.state is State.QUARANTINED
            steps.core.release_done(entry)
            steps.emit(
                "info",
                ev.RELEASE_FREED,
                cache=cache.name,
                key=entry.key,
                bytes=dict(entry.charge),
                late=late,
                seconds=since(steps.clock, slot.release_started),
            )
        finally:
            self._done_with(task)
            if watchdog is not None:
                watchdog.cancel()
            steps.apply()
            assert slot.released is not None
            slot.released.set()

    def _done_with(self, task: object) -> None:
        self.releasing_tasks.discard(task)
        if not self.releasing_tasks:
            self.releasing_tasks.clear()  # give the emptied table back

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
                self.blocking += 1
                self._steps.emit(
                    "warning",
                    ev.RELEASE_BLOCKING,
                    cache=cache.name,
                    key=entry.key,
                    seconds=round(timed.longest, 6),
                    limit=limit,
                )

    def _release_failed(self, entry: Entry, exc: BaseException) -> bool:
        """Book a release that raised ``exc`` (quarantined); return whether it must propagate.

        A release done elsewhere may have ended there otherwise (``Remote.release_outcome``).
        """
        core = self._steps.core
        outcome = self._remote.release_outcome(exc)
        if isinstance(outcome, Refused):
            core.release_refused(entry, outcome.holder)
            outcome.then()  # (pinned there: pinned here, the lease just given back ends)
            self._steps.emit("info", ev.RELEASE_REFUSED, cache=entry.owner.name, key=entry.key)
            return False
        if isinstance(outcome, FailedThere):
            if outcome.overdue:
                core.release_overdue(entry, outcome.error)
            else:
                core.release_failed(entry, outcome.error)
            return False
        fault = classify(exc)
        if fault is Fault.CANCELLED:
            failure = ReleaseFailed(f"releasing {entry.owner.name}:{entry.key!r} was cancelled")
        else:
            failure = ReleaseFailed(f"releasing {entry.owner.name}:{entry.key!r} raised {exc!r}")
            failure.__cause__ = exc
        core.release_failed(entry, failure)
        return fault is not Fault.FAILED

    def _release_overdue(self, entry: Entry, timeout: float) -> None:
        """Quarantine ``entry``: its release has run ``timeout`` seconds (a deadline).

        The release runs on (a releaser cannot be stopped safely): its bytes
        are overdue, not lost, so requests may wait for them; ``run`` reports
        its end (``release_done`` frees them, ``release_failed`` strands them
        until ``forget``).
        """
        entry.shell.timed_out = True
        self.timeouts += 1
        self._steps.core.release_overdue(
            entry,
            ReleaseFailed(
                f"releasing {entry.owner.name}:{entry.key!r} was not acknowledged "
                f"within {timeout:g}s"
            ),
        )
        self._steps.apply()
        entry.shell.released.set()

    async def await_releases(self, entries: list[Entry]) -> EvictionReport:
        """Wait for the releases of ``entries`` to be acknowledged (or to fail)."""
        freed_bytes = failed = 0
        for entry in entries:
            released = entry.shell.released
            if released is not None:
                await released.wait()
            if entry.state is State.QUARANTINED:
                failed += 1
            else:
                freed_bytes += sum(entry.charge.values())
        await anyio.lowlevel.checkpoint()
        return EvictionReport(entries=len(entries) - failed, bytes=freed_bytes, failed=failed)

    # ----------------------------------------------------------------- moves

    def start_move(self, entry: Entry, to: str) -> None:
        """``StartMove``: have the owner move ``entry``'s value to space ``to`` (down or up)."""
        cache = self._caches.get(entry.owner)
        slot: Slot = entry.shell
        slot.release_started = self._steps.clock()
        slot.timed_out = False
        slot.moving_to = to
        if cache is None or cache.closed or cache.move is None:
            self._steps.core.move_failed(
                entry,
                ReleaseFailed(
                    f"cache {entry.owner.name!r} was closed before "
                    f"{entry.owner.name}:{entry.key!r} could be moved to {to!r}"
                ),
            )
            return
        if not (entry.promoting and self._remote.admits_elsewhere):
            self._announce(cache, entry, to)  # (else once the other broker made its room)
        cache.spawn(
            self._run_move, cache, entry, to, name=f"cachebroker move {cache.name}:{entry.key!r}"
        )

    def _announce(self, cache: Block, entry: Entry, to: str) -> None:
        self._steps.emit(
            "info",
            ev.MOVE_START,
            cache=cache.name,
            key=entry.key,
            to=to,
            up=entry.promoting,
            bytes=dict(entry.charge),
        )

    async def _run_move(self, cache: Block, entry: Entry, to: str) -> None:
        """Run the owner's ``move``, watched by ``release_timeout``, and book how it ended.

        A move that raises, is cancelled or times out quarantines the entry
        with both charges (``Core.move_failed``): the value's state is unknown.
        """
        steps = self._steps
        slot: Slot = entry.shell
        assert cache.move is not None
        if entry.promoting and self._remote.admits_elsewhere:
            # Another broker's books decide: the move up waits for their room.
            if not await self._admitted(entry):
                return
            to = steps.core.owner_space(entry, destination(entry))
            slot.moving_to = to
            self._announce(cache, entry, to)
        timeout = steps.release_timeout
        watchdog = None
        if timeout is not None:
            watchdog = self._deadlines.after(
                timeout, functools.partial(self._move_overdue, entry, to, timeout)
            )
        started = steps.clock()
        task = steps.current_task()
        self.releasing_tasks.add(task)  # (it may not wait for space: see Requests)
        try:
            # As after a release: the bytes it leaves on a probed device must show.
            going = freed(entry)
            probed = {n: free for n, free in self._probes.free_before(entry).items() if n in going}
            # The owner's copy is the only one while it moves (so that what it
            # frees is free); the books hold the value again once it is back.
            moved, entry.value = entry.value, None
            value = await cache.move(entry.key, moved, to)
            del moved
            seconds = max(0.0, steps.clock() - started)
            # A size callable that cannot measure the moved form (one made for
            # what the loader returns) leaves the charge as moved.
            measured, _, fatal = measure(entry, slot, value, steps.budget, to)
            if probed:
                await self._probes.wait_for_memory(entry, probed, going)
        except BaseException as exc:
            if watchdog is not None:
                watchdog.cancel()
            if self._move_raised(entry, to, exc):
                raise
            return
        finally:
            self._done_with(task)
        if watchdog is not None:
            watchdog.cancel()
        if slot.timed_out:  # quarantined already: free what came back, as a late release
            await self._release_late_move(cache, entry, value)
        else:
            self._moved(cache, entry, to, value, measured, seconds)
        if fatal is not None:
            raise fatal

    async def _admitted(self, entry: Entry) -> bool:
        """Wait for the other broker's room for ``entry``'s promotion; whether it was given.

        Refused (or cancelled while it waits), the move is called off: the
        value stays a tier down, and its requesters get the error.
        """
        core = self._steps.core
        while True:
            try:
                error = await self._remote.admit_move(entry)
            except BaseException as exc:
                core.move_failed(entry, BrokerClosed("the move up was cancelled"), ran=False)
                self._steps.apply()
                if classify(exc) is Fault.FAILED:
                    return False
                raise
            if not isinstance(error, DeadlockError) or len(entry.joiners) < 2:
                break
            # Refused for its first requester's own leases: as in one process, only
            # that task gets the error; asked again for the others.
            core.leave(entry.joiners[0], error)
            self._steps.apply()
        if error is not None:
            core.move_failed(entry, error, ran=False)
            self._steps.apply()
            self._steps.emit(
                "info", ev.MOVE_REFUSED, cache=entry.owner.name, key=entry.key, error=str(error)
            )
            return False
        return True

    def _move_raised(self, entry: Entry, to: str, exc: BaseException) -> bool:
        """Book a move that raised ``exc`` (unless timed out already); whether it propagates.

        A move done elsewhere may have ended there otherwise (``Remote.release_outcome``):
        refused (the owner leased the entry again), or failed there.
        """
        outcome = self._remote.release_outcome(exc)
        if isinstance(outcome, Refused):
            self._steps.core.release_refused(entry, outcome.holder)
            outcome.then()
            self._steps.apply()
            self._steps.emit("info", ev.MOVE_REFUSED, cache=entry.owner.name, key=entry.key)
            return False
        if isinstance(outcome, FailedThere):
            self._move_failed(entry, outcome.error)
            return False
        fault = classify(exc)
        if entry.state is State.MOVING and not entry.shell.timed_out:
            failure = ReleaseFailed(
                f"moving {entry.owner.name}:{entry.key!r} to {to!r} "
                + ("was cancelled" if fault is Fault.CANCELLED else f"raised {exc!r}")
            )
            failure.__cause__ = exc
            self._move_failed(entry, failure)
        return fault is not Fault.FAILED

    def _moved(
        self,
        cache: Block,
        entry: Entry,
        to: str,
        value: Any,
        measured: dict[str, int] | None,
        seconds: float,
    ) -> None:
        """Book a move that ended in time (``Core.move_done``)."""
        steps = self._steps
        up = entry.promoting
        entry.shell.moving_to = None
        stayed = steps.core.move_done(entry, value, measured, seconds, steps.clock())
        steps.emit(
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
            steps.emit(
                "warning", ev.MOVE_STAYED, cache=cache.name, key=entry.key, to=to, bytes=measured
            )
        if entry.idle_seq:
            self._note_idle(entry)
        steps.apply()

    async def _release_late_move(self, cache: Block, entry: Entry, value: Any) -> None:
        """A move that ended after ``release_timeout`` quarantined it: release the value it
        returned through the owner; acknowledged, both charges come back (``release_done``)."""
        slot: Slot = entry.shell
        slot.released = anyio.Event()
        entry.value = value
        _ask_elsewhere(cache, entry)
        try:
            await self._released(cache, entry)
        except BaseException as exc:
            if classify(exc) is not Fault.FAILED:
                raise
            return  # the quarantine stands
        finally:
            slot.released.set()
        bytes_ = dict(entry.charge)
        self._steps.core.release_done(entry)
        self._steps.emit(
            "info",
            ev.RELEASE_FREED,
            cache=cache.name,
            key=entry.key,
            bytes=bytes_,
            late=True,
            seconds=since(self._steps.clock, slot.release_started),
        )
        self._steps.apply()

    def _move_failed(self, entry: Entry, failure: BaseException) -> None:
        """Book a failed move: quarantined with both charges (logged by ``Quarantined``)."""
        self._steps.core.move_failed(entry, failure)
        self._steps.apply()

    def _move_overdue(self, entry: Entry, to: str, timeout: float) -> None:
        """Quarantine ``entry``: its move has run ``timeout`` seconds (a deadline)."""
        entry.shell.timed_out = True  # (counted in moves_failed, not release_timeouts)
        self._move_failed(
            entry,
            ReleaseFailed(
                f"moving {entry.owner.name}:{entry.key!r} to {to!r} was not "
                f"acknowledged within {timeout:g}s"
            ),
        )


class HeldLeases:
    """Leases held for ``lease_warning`` seconds while requests wait for their space.

    Checked by the sweeper (woken when a request starts waiting, then every
    quarter of the threshold while any waits): a lease counts from the first
    check that saw it in a space somebody waits for, and is reported once
    while it stays so.
    """

    __slots__ = ("_remote", "_reported", "_steps", "held", "limit")

    def __init__(self, steps: Steps, remote: Remote, lease_warning: float | None) -> None:
        self._steps = steps
        self._remote = remote
        self.limit = lease_warning
        #: Leased entries seen in a space that requests wait for, and since
        #: when; those already reported.
        self.held: dict[Entry, float] = {}
        self._reported: set[Entry] = set()

    def check(self) -> None:
        """Report the leases held ``lease_warning`` seconds by now (``cachebroker.lease.held``)."""
        limit = self.limit
        core = self._steps.core
        if limit is None or not core.queue:
            self.held.clear()
            self._reported.clear()
            return
        now = self._steps.clock()
        waited = {name for entry in core.queue for name in entry.need}
        held: dict[Entry, float] = {}
        for entry in core.busy:
            if entry.leases and not waited.isdisjoint(entry.charge):
                since_ = held[entry] = self.held.get(entry, now)
                if now - since_ >= limit and entry not in self._reported:
                    self._reported.add(entry)
                    self._report(entry, round(now - since_, 3))
        self.held = held
        self._reported &= held.keys()

    def _report(self, entry: Entry, seconds: float) -> None:
        core = self._steps.core
        self._steps.emit(
            "warning",
            ev.LEASE_HELD,
            cache=entry.owner.name,
            key=entry.key,
            holders=self._holder_names(entry),
            seconds=seconds,
            waiting=sum(
                len(w.joiners) for w in core.queue if not w.need.keys().isdisjoint(entry.charge)
            ),
        )

    def _holder_names(self, entry: Entry) -> list[str]:
        """How ``lease.held`` names ``entry``'s holders: by their tasks' names, unless the
        remote side names them (the daemon's: processes)."""
        names = self._remote.holder_names(entry)
        return [task_name(task) for task in entry.holders] if names is None else names


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


def _ask_elsewhere(cache: Block, entry: Entry) -> None:
    """Ask a block whose values live in another process to release ``entry``, in this
    step (``Elsewhere``): its releaser then only waits for the outcome."""
    if cache.elsewhere is not None:
        cache.elsewhere.releasing(entry.key)
