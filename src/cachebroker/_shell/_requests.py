"""The slow path of an acquire: requests that are no plain hit, and the wait for their outcome.

``Requests`` runs the step of a miss, a join, a wait for a lease slot, a
prefetch or an adopted entry (``Core.request``, ``Core.prefetch``,
``Core.adopt``), refuses the waits that would deadlock a releaser, and
waits for the ticket's outcome within the request's timeout (saying then
what it waited for, asking the other side why where one decides). It also
ends leases the garbage collector dropped, before the next request.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import warnings
from collections.abc import Callable, Hashable
from typing import Any

import anyio
import anyio.lowlevel

from .. import _log_events as ev
from .._core import Entry, Owner, Request, State, Ticket
from .._errors import AcquireTimeout, DeadlockError
from .._units import format_bytes
from ._releases import Releases
from ._seam import Remote
from ._steps import LOADING, Slot, Steps
from ._sweeper import Probes, Sweeper

__all__ = ["Requests"]


class Requests:
    """The requests that wait: misses, joins, slot waits, prefetches, adopted entries."""

    __slots__ = ("_drop_ids", "_dropped", "_probes", "_releases", "_remote", "_steps", "_sweeper")

    def __init__(
        self, steps: Steps, probes: Probes, releases: Releases, sweeper: Sweeper, remote: Remote
    ) -> None:
        self._steps = steps
        self._probes = probes
        self._releases = releases
        self._sweeper = sweeper
        self._remote = remote
        #: Leases garbage-collected while held and not ended yet (``dropped``).
        self._dropped: dict[int, tuple[Entry, object]] = {}
        self._drop_ids = itertools.count()

    async def request(
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
    ) -> tuple[Entry, object]:
        """``Runner.request``: the entry and the lease's holder."""
        ticket = self.submit(
            owner,
            request,
            urgent=urgent,
            held=held,
            bound=bound,
            loading=loading,
            counted=counted,
            releasing=releasing,
        )
        if ticket.outcome is True:  # a hit
            try:
                await anyio.lowlevel.checkpoint()
            except BaseException:  # cancelled here: nobody holds the lease but us
                steps = self._steps
                steps.core.lease_end(ticket.entry, ticket.task, steps.clock())
                steps.apply()
                raise
            return ticket.entry, ticket.task
        return await self._wait(ticket, request.timeout)

    def submit(
        self,
        owner: Owner,
        request: Request,
        *,
        task: object = None,
        urgent: bool = False,
        held: tuple[Entry, ...] | None = None,
        bound: bool = True,
        loading: tuple[Entry, ...] | None = None,
        counted: bool = True,
        releasing: bool = False,
    ) -> Ticket:
        """``Runner.submit``: ``request``'s step, its ticket settled (a hit) or pending.

        ``task``: the lease's holder (by default, the current task).
        """
        steps = self._steps
        if task is None:
            task = steps.current_task()
        core = steps.core
        name, key = owner.name, request.key
        self._before()
        loads = LOADING.get() if loading is None else loading
        if counted:
            ticket = core.request(
                owner, request, task, loading=loads, urgent=urgent, held=held, bound=bound
            )
        else:  # (a process's prefetch: its entries here are new, never ready)
            made = core.prefetch(
                owner, request, task, steps.clock(), loading=loads, urgent=urgent, held=held
            )
            assert made is not None
            ticket = made
        entry = ticket.entry
        releasing = releasing or task in self._releases.releasing_tasks
        if ticket.outcome is None and releasing:
            self._refuse_from_release(ticket)
        if ticket.outcome is True:
            steps.apply()
            steps.log.debug(ev.HIT, cache=name, key=key)
            return ticket
        if entry.state is State.READY:  # waits for a lease slot
            steps.log.debug(ev.WAIT_LEASE, cache=name, key=key, concurrency=entry.slots)
            steps.apply()
            return ticket
        if entry.shell is None:
            entry.shell = self._slot(request)
            # (Granted here, it may still wait for another broker's grant, which is
            # asked to refuse it rather than make it wait: ``_refuse_from_release``.)
            entry.shell.from_release = releasing
            steps.log.debug(ev.MISS, cache=name, key=key, bytes=request.need)
        if entry.state is State.WAITING:
            steps.log.debug(ev.WAIT, cache=name, key=key, bytes=entry.need)
            self._sweeper.waiting()
        steps.apply()
        return ticket

    def _slot(self, request: Request) -> Slot:
        """The shell's half of a new entry: its loader and measure, from ``request``."""
        assert request.load is not None, "a request that may load has a loader"
        return Slot(
            request.load, request.measure, self._steps.clock(), placed=request.places is not None
        )

    def _before(self) -> None:
        """Before a request's step: re-read the probes, end the leases dropped meanwhile."""
        if self._probes.probes:
            self._probes.refresh()
        if self._dropped:
            self._end_dropped()  # before their holder is taken to hold them still

    def _refuse_from_release(self, ticket: Ticket) -> None:
        """A releaser's (or a move's) request that would wait: ``DeadlockError``, if it may."""
        entry = ticket.entry
        for_slot = entry.state is State.READY
        moving = entry.state in (State.MOVING, State.DEMOTED)
        # (A load granted here that still waits for another broker's grant waits for
        # space there: ``Remote.admitting``.)
        waiting = entry.state is State.WAITING or entry in self._remote.admitting()
        if waiting or for_slot or moving:
            self._steps.core.leave(ticket)
            self._steps.apply()
            raise DeadlockError(
                f"acquiring {entry.owner.name}:{entry.key!r} from inside a release or a move "
                "would wait for "
                + ("a lease slot" if for_slot else "a move" if moving else "space")
                + ", and that may be waiting for this very release or move; a releaser "
                "may only acquire what is loaded (with a free lease slot) or fits at once",
                [],
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
        """``Runner.adopt``."""
        steps = self._steps
        ticket = steps.core.adopt(owner, key, charge, steps.current_task(), priority=priority)
        ticket.entry.shell = Slot(load, measure, steps.clock())
        steps.apply()
        return ticket

    async def settle(self, ticket: Ticket) -> tuple[Entry, object]:
        """``Runner.settle``."""
        return await self._wait(ticket, None)

    async def prefetch(self, owner: Owner, request: Request) -> None:
        """``Runner.prefetch``: as ``request``, from ``Core.prefetch``."""
        steps = self._steps
        task = steps.current_task()
        core = steps.core
        key = request.key
        self._before()
        ticket = core.prefetch(owner, request, task, steps.clock(), loading=LOADING.get())
        if ticket is None:  # loaded already
            steps.apply()
            await anyio.lowlevel.checkpoint()
            return
        entry = ticket.entry
        if entry.state is State.WAITING and task in self._releases.releasing_tasks:
            core.leave(ticket)
            steps.apply()
            raise DeadlockError(
                f"prefetching {owner.name}:{key!r} from inside a release would wait for space, "
                "and that space may be waiting for this very release",
                [],
            )
        if entry.shell is None:
            entry.shell = self._slot(request)
        if entry.state is State.WAITING:
            steps.log.debug(ev.WAIT, cache=owner.name, key=key, bytes=entry.need)
            self._sweeper.waiting()
        steps.apply()
        entry, holder = await self._wait(ticket, request.timeout, lease=False)
        # Loaded: the lease its end granted is given back in the same step.
        core.configure(entry, idle_ttl=request.idle_ttl, pin=request.pin or None)
        if holder is not None:
            core.lease_end(entry, holder, steps.clock())
        steps.apply()
        if not entry.leases:
            self._sweeper.note_idle(entry)

    async def _wait(
        self, ticket: Ticket, timeout: float | None, *, lease: bool = True
    ) -> tuple[Entry, object]:
        """Wait for ``ticket``'s outcome: the entry and the lease's holder.

        ``lease=False`` (a prefetch): a loaded entry is enough; a ticket left
        waiting for a lease slot leaves the line instead, and the holder is
        ``None``.
        """
        steps = self._steps
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
                await self._timed_out(ticket, timeout)
            # Settled just as the deadline passed: the outcome stands.
        except BaseException:
            if ticket.outcome is True:  # Granted just as we were cancelled: give it back.
                steps.core.lease_end(entry, ticket.task, steps.clock())
            else:
                steps.core.leave(ticket)
            steps.apply()
            raise
        outcome = ticket.outcome
        if outcome is True:
            return entry, ticket.task
        if outcome is None:  # loaded, its slots taken: a prefetch needs no lease
            steps.core.leave(ticket)
            steps.apply()
            return entry, None
        assert isinstance(outcome, BaseException)
        raise _own_copy(outcome)

    async def _timed_out(self, ticket: Ticket, timeout: float | None) -> None:
        """Withdraw ``ticket``'s request and raise ``AcquireTimeout``, saying what it waited for."""
        entry = ticket.entry
        waiting_for, what = self._waiting_for(entry)
        because = self._remote.ask_why(entry)  # (asked before the request is withdrawn)
        self._steps.core.leave(ticket)
        self._steps.apply()
        if because is not None:
            what = await because(what)
        name = entry.owner.name
        raise AcquireTimeout(
            f"acquiring {name}:{entry.key!r} did not complete within {timeout:g}s: "
            f"it was waiting for {what}",
            entry=f"{name}:{entry.key!r}",
            waiting_for=waiting_for,
        ) from None

    def _waiting_for(self, entry: Entry) -> tuple[str | None, str]:
        """What a request of ``entry`` waits for: ``AcquireTimeout.waiting_for``, and in
        words; waiting for space, why there is none (``Core.why_no_room``), unless it
        waits on the other side (``Remote.waiting_for``)."""
        elsewhere = self._remote.waiting_for(entry)
        if elsewhere is not None:
            return elsewhere
        waiting_for, what = _waiting_for(entry)
        if waiting_for == "space" and not entry.gated and entry.need:
            what += f": {self._steps.core.why_no_room(entry)}"
        return waiting_for, what

    # -------------------------------------------------------- ending leases

    def end_lease(self, entry: Entry, task: object) -> None:
        """End a lease on the broker's loop (called soon, from any thread)."""
        steps = self._steps
        steps.core.lease_end(entry, task, steps.clock())
        steps.apply()
        if not entry.leases:
            self._sweeper.note_idle(entry)

    def dropped(
        self, entry: Entry, task: object, key: Hashable, call_soon: Callable[..., object]
    ) -> None:
        """``Runner.lease_dropped``: end it soon (``call_soon``), or at the next request."""
        token = next(self._drop_ids)
        self._dropped[token] = (entry, task)
        with contextlib.suppress(Exception):  # the loop is gone: so are the books' users
            call_soon(self._end_dropped, token)
        warnings.warn(
            f"a lease on {entry.cache}:{key!r} was garbage-collected while held; it was "
            "ended for you, but end leases with 'async with cache.acquire(...)' or "
            "'await lease.release()'",
            ResourceWarning,
            stacklevel=3,
        )

    def _end_dropped(self, token: int | None = None) -> None:
        """End the dropped lease ``token`` if it is still pending, or (``None``) every one."""
        for pending in list(self._dropped) if token is None else [token]:
            dropped = self._dropped.pop(pending, None)
            if dropped is not None:
                self.end_lease(*dropped)


def need_words(entry: Entry) -> str:
    """What ``entry``'s request needs, in words: ``50 B in 'default'`` (or in any of its places)."""
    if entry.places is not None and entry.need:  # any of them would do
        places = ", ".join(map(repr, entry.places))
        return f"{format_bytes(sum(entry.need.values()))} in any of {places}"
    return ", ".join(f"{format_bytes(n)} in {name!r}" for name, n in entry.need.items())


def _waiting_for(entry: Entry) -> tuple[str | None, str]:
    """What a request of ``entry`` still waits for: ``AcquireTimeout.waiting_for``, and in words."""
    if entry.state is State.LOADING:
        return "load", "its load to finish"
    if entry.state is State.READY:
        return "lease", (
            f"a lease slot: concurrency={entry.slots}, {entry.leases} lease(s) held, "
            f"{len(entry.joiners)} request(s) waiting"
        )
    need = need_words(entry)
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
