"""One connected process, as the daemon sees it (``Connection``), and its entries there.

The daemon (``_daemon.Daemon``) accepts each connection and keeps the
machine-wide state; a ``Connection`` reads the process's messages, mirrors
its entries in the daemon's books (``_Mirror``) and writes what the books
decide back to it. What it needs of the daemon is ``Host``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Hashable
from typing import Any, Protocol

import anyio
import anyio.abc
import anyio.lowlevel

from .. import _log_events as ev
from .._core import Entry, Reason, Request, State, Ticket
from .._errors import LeasesOutstanding, LoadFailed, ReleaseFailed
from .._shell._seam import Relay
from . import _answers
from . import _protocol as wire
from ._daemon_books import _FailedThere, _Refused, pin
from ._mirrors import _Holder, _How, _Key, _loading, _measured, _Mirror, _Space
from ._protocol import ProtocolError
from ._sockets import Outlet

__all__ = ["Connection", "Host"]


#: How many messages may wait to be sent to a process before the daemon stops reading
#: from it until it reads (``Connection.room``).
MAX_UNSENT = 64


#: What a process's report may say of its entry.
_REPORTS = frozenset(
    {"held", "pinned", "idle", "demoted", "releasing", "overdue", "quarantined", "gone"}
)

#: How an entry may stand when a process registers it again (``adopt``).
_ADOPTED = frozenset(
    {"loading", "held", "pinned", "idle", "demoted", "releasing", "overdue", "quarantined"}
)

#: Reports of an entry on its way out.
_LETTING_GO = frozenset({"releasing", "overdue", "quarantined", "gone"})

#: Reports that hold the entry (leased, or pinned): it is no victim.
_HOLDING = frozenset({"held", "pinned"})


_REASONS = {reason.value: reason for reason in Reason}


class Host(Protocol):
    """What a connection needs of the daemon that accepted it (``_daemon.Daemon``)."""

    address: str
    #: The daemon broker's runner, as the daemon steps it (``Broker._relay``).
    runner: Relay
    connections: dict[int, Connection]
    #: Each owner of the books (a cache of a process) -> its connection and cache name.
    owners: dict[Any, tuple[Connection, str]]
    #: The processes the reconnection gate waits for, by pid; set once none is left.
    expected: set[int]
    gate: anyio.Event
    #: How many acquires wait in a task to be asked (``Connection._acquire``): while
    #: any does, a new one waits behind it, so that they are asked in order.
    behind: int

    def note_peer(self, connection: Connection) -> None: ...
    def forget_peer(self, connection: Connection) -> None: ...
    def registered(self, connection: Connection) -> None: ...
    def keep(self, connection: Connection, charge: dict[str, int]) -> None: ...
    def tell_aliases(self, **fields: Any) -> None: ...
    def forget(self, owner: Any, name: str) -> None: ...
    def owner_name(self, cache: str, connection: Connection) -> str: ...
    def totals(self) -> dict[str, Any]: ...
    def listing(self, asking: Connection | None = None) -> dict[str, Any]: ...


class Connection:
    """One connected process."""

    def __init__(
        self,
        daemon: Host,
        stream: anyio.abc.SocketStream,
        serial: int,
        pid: int,
        session: str | None = None,
    ):
        self.daemon = daemon
        #: The connected broker's name across its reconnections (``hello``).
        self.session = session
        self.runner = daemon.runner
        self.stream = stream
        self.serial = serial
        self.pid = pid
        self.holder = _Holder(pid)
        self.caches: dict[str, _Space] = {}
        #: Every cache it opened, closed ones too (their quarantined entries stay theirs).
        self.opened: list[_Space] = []
        self.mirrors: dict[int, _Mirror] = {}
        self.outbox: list[dict[str, Any]] = []
        #: Writes what was posted, one batch per step of the books.
        self.outlet = Outlet(stream, self._batch, wire.encode, self.runner.at_step_end)
        self.tg: anyio.abc.TaskGroup | None = None
        #: The level of its ``peer.connected`` and ``peer.gone`` (debug for ``cachebroker ps``).
        self.level = "info"

    def post(self, message: dict[str, Any]) -> None:
        """Queue ``message``: it leaves with what else this step posts (``Outlet.soon``)."""
        self.outbox.append(message)
        self.outlet.soon()

    def _batch(self) -> list[dict[str, Any]]:
        batch, self.outbox = self.outbox, []
        return batch

    async def writer(self) -> None:
        """Send what was posted, a batch per write, until the connection breaks."""
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            await self.outlet.run()  # (the reader sees the end too)

    async def room(self) -> bool:
        """Wait while ``MAX_UNSENT`` messages or more wait to be sent to the process;
        false once nothing can be sent to it any more (the connection is over).

        A process that does not read what it asked for is not read either, so
        that it cannot make the daemon hold an answer per request (``ps``
        answers are large): its requests wait in its socket, not here. A
        process that reads (every ``Broker.connect()`` reads all the time)
        never waits here but for the moment one write takes.
        """
        outlet = self.outlet
        while outlet.open and len(self.outbox) + outlet.unsent >= MAX_UNSENT:
            await outlet.written()
        return outlet.open

    # ------------------------------------------------------------ messages

    async def dispatch(self, message: dict[str, Any]) -> None:
        op = message["op"]
        if op == "report":
            self.report(message)
        elif op == "acquire":
            self.acquire(message)
        elif op == "adopt":
            self.adopt(message)
        elif op == "registered":
            self.daemon.registered(self)
        elif op == "why":
            _answers.why(self, wire.field(message, "id", int))
        elif op == "free":
            _answers.free(self, wire.field(message, "id", int))
        elif op == "cancel":
            if message.get("promote"):
                self.call_off(wire.field(message, "id", int))
            else:
                self.cancel(wire.field(message, "id", int))
        elif op == "moved":
            self.moved(message)
        elif op == "evidence":
            _answers.evidence(self, message)
        elif op == "aliases":
            _answers.aliases(self, message)
        elif op == "promote":
            self.promote(message)
        elif op == "open":
            await self.open(wire.field(message, "cache", str), bool(message.get("moves")))
        elif op == "close":
            space = self.caches.pop(wire.field(message, "cache", str), None)
            if space is not None:
                space.closed.set()
        elif op == "ps":
            self.post({"op": "ps", **self.daemon.listing(asking=self)})
        elif op == "totals":
            self.post({"op": "totals", **self.daemon.totals()})
        else:
            raise ProtocolError(f"unknown op {op!r}")

    async def open(self, cache: str, moves: bool = False) -> None:
        if not cache or cache in self.caches:
            raise ProtocolError(f"cache {cache!r} is opened twice or has no name")
        space = self.caches[cache] = _Space(self.daemon.owner_name(cache, self))
        self.opened.append(space)
        assert self.tg is not None
        await self.tg.start(self._run_cache, cache, space, moves)
        self.daemon.note_peer(self)

    async def _run_cache(
        self,
        cache: str,
        space: _Space,
        moves: bool,
        *,
        task_status: anyio.abc.TaskStatus[None],
    ) -> None:
        """Hold the daemon-side block of ``cache`` open until the process closes it (or goes).

        ``moves``: its releaser moves values, so the daemon's tiers move them
        (``_move``) rather than release them.
        """
        block = await self.runner.open_block(
            space.name, self._release, move=self._move if moves else None, elsewhere=self
        )
        space.block = block
        self.daemon.owners[block.owner] = (self, cache)
        task_status.started()
        try:
            try:
                await space.closed.wait()
            except BaseException as exc:
                # The connection ended, or the daemon stops: either way nothing is
                # asked of the process (it keeps its values, and registers them with
                # the next daemon): its entries just leave these books.
                self.runner.core.drop_owner(block.owner)
                self.runner.apply()
                await self.runner.close_block(block, type(exc), exc, exc.__traceback__)
                raise
            with contextlib.suppress(LeasesOutstanding):  # (quarantined: the books say so)
                await self.runner.close_block(block, None, None, None)
        finally:
            if self.daemon.connections.get(self.serial) is not self:
                self.daemon.forget(block.owner, space.name)  # the connection ended
            elif not any(entry.owner is block.owner for entry in self.runner.core.quarantined):
                # Closed, and nothing of it is left: its name may be used again.
                self.opened.remove(space)
                self.daemon.forget(block.owner, space.name)

    def acquire(self, message: dict[str, Any]) -> None:
        id = wire.field(message, "id", int)
        cache = wire.field(message, "cache", str)
        key = _Key(id, wire.field(message, "key", str))
        space = self.caches.get(cache)
        if space is None or space.block is None or id in self.mirrors:
            raise ProtocolError(f"'acquire' of #{id} in cache {cache!r}, which is not open")
        holding = message.get("holding", [])
        if not isinstance(holding, list) or not all(type(i) is int for i in holding):
            raise ProtocolError(f"'acquire' message: 'holding' is {holding!r}")
        held = tuple(mirror for mirror in map(self.mirrors.get, holding) if mirror is not None)
        loading = message.get("loading", [])
        if not isinstance(loading, list) or not all(type(i) is int for i in loading):
            raise ProtocolError(f"'acquire' message: 'loading' is {wire.shown(loading)}")
        loads = tuple(m for m in map(self.mirrors.get, loading) if m is not None)
        mirror = _Mirror(id, key, space)
        request = wire.decode_request(
            message, key, load=functools.partial(self._load, mirror), measure=_measured
        )
        self.mirrors[id] = mirror
        how = _How(
            urgent=bool(message.get("urgent")),
            counted=not message.get("prefetch"),
            releasing=bool(message.get("releasing")),
        )
        if (
            self.daemon.gate.is_set()
            and not self.daemon.behind
            and all(other.settled.is_set() for other in held)
        ):
            self._ask(mirror, request, how, held, loads)  # (in this step: no task)
        else:
            assert self.tg is not None
            self.tg.start_soon(self._acquire, mirror, request, how, held, loads)

    async def _acquire(
        self,
        mirror: _Mirror,
        request: Request,
        how: _How,
        holding: tuple[_Mirror, ...],
        loads: tuple[_Mirror, ...],
    ) -> None:
        """Ask for ``request`` once the daemon may grant it and the leases it is made
        under have settled here; meanwhile later acquires line up behind (``Host.behind``)."""
        self.daemon.behind += 1
        try:
            with anyio.CancelScope() as scope:
                mirror.scope = scope
                if mirror.cancelled:  # (withdrawn before this task started: never asked)
                    scope.cancel()
                    await anyio.lowlevel.checkpoint()
                # A restarted daemon grants nothing until the processes of the one
                # before it have said what they hold (``Daemon.gate``).
                if not self.daemon.gate.is_set():
                    await self.daemon.gate.wait()
                # The entries the requesting task leases may still be settling here
                # (their loads' reports came in the same batch): wait for them, so
                # that a request only those leases could make room for is refused.
                for other in holding:
                    if not other.settled.is_set():
                        await other.settled.wait()
        finally:
            self.daemon.behind -= 1
        mirror.scope = None
        if scope.cancelled_caught:
            mirror.settled.set()
            return
        self._ask(mirror, request, how, holding, loads)

    def _ask(
        self,
        mirror: _Mirror,
        request: Request,
        how: _How,
        holding: tuple[_Mirror, ...],
        loads: tuple[_Mirror, ...],
    ) -> None:
        """The daemon's request for ``mirror``, in this step; its outcome comes to
        ``_outcome`` (no task waits for it)."""
        block = mirror.space.block
        assert block is not None
        held = tuple(other.entry for other in holding if other.entry is not None)
        try:
            ticket = self.runner.submit(
                block.owner,
                request,
                task=mirror,  # (each request of the process holds its own lease)
                urgent=how.urgent,
                held=held,
                loading=_loading(loads),
                counted=how.counted,
                releasing=how.releasing,
            )
        except Exception as exc:
            self._refused(mirror, exc)
            return
        mirror.ticket = ticket
        self._outcome(mirror)

    def _outcome(self, mirror: _Mirror) -> None:
        """``mirror``'s request settled here (or is still pending: watched again)."""
        ticket = mirror.ticket
        if ticket is None:
            return  # (withdrawn: ``cancel``)
        outcome = ticket.outcome
        if outcome is None:
            ticket.entry.shell.watch(functools.partial(self._outcome, mirror))
            return
        mirror.ticket = None
        if outcome is True:
            self._loaded(mirror, ticket.entry, ticket.task)
        else:
            assert isinstance(outcome, BaseException)
            self._refused(mirror, outcome)

    def _refused(self, mirror: _Mirror, exc: BaseException) -> None:
        """The daemon's books refused ``mirror``'s request (or its load failed)."""
        block = mirror.space.block
        loaded = None if block is None else block.owner.entries.get(mirror.key)
        if loaded is not None and loaded.state in (State.RELEASING, State.READY):
            # Loaded there, refused here (measured too large, or not beside
            # quarantined bytes): its bytes stay charged until the process's
            # "gone"; one it holds already (the release refused) stays its entry.
            mirror.entry = loaded
            mirror.settled.set()
            self.reconcile(mirror)
            return
        self.mirrors.pop(mirror.id, None)
        mirror.settled.set()
        if not mirror.cancelled:
            error = wire.encode_error(exc, self.names())
            self.post({"op": "fail", "id": mirror.id, "error": error})

    def _loaded(self, mirror: _Mirror, entry: Entry, task: object) -> None:
        """``mirror``'s entry is in the books, leased to ``task`` until the process's report."""
        mirror.entry = entry
        mirror.held = True
        mirror.holder = task
        mirror.settled.set()
        self.reconcile(mirror)
        if mirror.home is not None:
            home, mirror.home = mirror.home, None
            self.runner.core.park(entry, home)
            self.runner.apply()

    def granted(self, key: Hashable, space: str | None) -> None:
        """The daemon's books granted the load of ``key``: say so, in this step (``Elsewhere``).

        ``space``: where they placed it (``spaces=``). An adopted entry
        (``adopt``) was granted by the daemon before this one.
        """
        mirror = self.mirrors.get(key.id) if isinstance(key, _Key) else None
        if mirror is None:
            return
        mirror.granted = True
        if mirror.adopted:
            mirror.adopted = False  # (its grant came from the daemon before this one)
            return
        message: dict[str, Any] = {"op": "grant", "id": mirror.id}
        if space is not None:
            message["space"] = space
        self.post(message)

    async def _load(self, mirror: _Mirror, space: str | None = None) -> dict[str, int]:
        """The daemon's load of a process's entry, granted (``granted``): the process's outcome.

        ``space``: where these books placed it, as a loader given ``spaces=`` is told.
        """
        while mirror.state == "loading":
            await mirror.next_report()
        if mirror.charge is not None:
            return mirror.charge
        if mirror.state == "gone":  # the load failed (or was given up) and made nothing
            raise LoadFailed(f"the load of {mirror.key!r} failed in process {self.pid}")
        # Releasing or quarantined, unmeasured: what it holds there is unknown, so
        # the grant stays taken until the process says the value is gone.
        block = mirror.space.block
        loading = None if block is None else block.owner.entries.get(mirror.key)
        return {} if loading is None else dict(loading.charge)

    def names(self) -> dict[str, str]:
        """This process's owner names in the books, each with its cache's name there."""
        return {
            owner.name: name
            for owner, (connection, name) in self.daemon.owners.items()
            if connection is self
        }

    def entry_of(self, id: int) -> Entry | None:
        """The daemon's entry of this process's request ``id`` (``None``: none here)."""
        mirror = self.mirrors.get(id)
        block = None if mirror is None else mirror.space.block
        return None if mirror is None or block is None else block.owner.entries.get(mirror.key)

    def adopt(self, message: dict[str, Any]) -> None:
        """An entry the process holds since before this daemon started (``register``).

        Booked in this step, as it stands there (loading, held, pinned, idle,
        releasing or quarantined), with its charge, whatever the budget says:
        the process holds that memory (``Core.adopt``).
        """
        id = wire.field(message, "id", int)
        cache = wire.field(message, "cache", str)
        key = _Key(id, wire.field(message, "key", str))
        state = wire.field(message, "state", str)
        if state not in _ADOPTED:
            raise ProtocolError(f"'adopt' message: 'state' is {state!r}")
        charge = self._charge(message, state)
        if not charge:
            raise ProtocolError(f"'adopt' message: 'charge' is {message.get('charge')!r}")
        priority = message.get("priority", 0)
        if type(priority) is not int:
            raise ProtocolError(f"'adopt' message: 'priority' is {priority!r}")
        space = self.caches.get(cache)
        if space is None or space.block is None or id in self.mirrors:
            raise ProtocolError(f"'adopt' of #{id} in cache {cache!r}, which is not open")
        mirror = self.mirrors[id] = _Mirror(id, key, space)
        mirror.granted = mirror.adopted = True
        mirror.state = state
        mirror.charge = None if state == "loading" else charge
        if state == "demoted":
            mirror.home = self._home(message)
        loads = message.get("loads")
        if type(loads) is int and loads >= 0:
            mirror.loads = loads
        if "reason" in message:
            mirror.reason = _REASONS.get(str(message["reason"]), Reason.CAPACITY)
        if state in ("quarantined", "overdue"):
            mirror.error = str(message.get("error", ""))
        ticket = self.runner.adopt(
            space.block.owner,
            key,
            functools.partial(self._load, mirror),
            _measured,
            charge,
            priority=priority,
        )
        assert self.tg is not None
        self.tg.start_soon(self._settle, mirror, ticket)

    async def _settle(self, mirror: _Mirror, ticket: Ticket) -> None:
        try:
            entry, task = await self.runner.settle(ticket)
        except Exception:  # its load failed there meanwhile: the bytes are back
            self.mirrors.pop(mirror.id, None)
            mirror.settled.set()
            return
        self._loaded(mirror, entry, task)

    def cancel(self, id: int) -> None:
        """The process stopped waiting for ``id``'s grant (or never started its load)."""
        mirror = self.mirrors.get(id)
        if mirror is None:
            return
        mirror.cancelled = True
        if mirror.entry is None:
            self.mirrors.pop(id, None)
            if mirror.scope is not None:
                mirror.scope.cancel()
            ticket, mirror.ticket = mirror.ticket, None
            if ticket is not None:  # (asked, and not settled yet: withdrawn)
                self.runner.core.leave(ticket)
                self.runner.apply()
            mirror.settled.set()
            mirror.state = "gone"
            self._wake(mirror)
        else:
            mirror.state = "gone"
            self.reconcile(mirror)

    def report(self, message: dict[str, Any]) -> None:
        id = wire.field(message, "id", int)
        state = wire.field(message, "state", str)
        if state not in _REPORTS:
            raise ProtocolError(f"'report' message: 'state' is {state!r}")
        priority = message.get("priority")
        if priority is not None and type(priority) is not int:
            raise ProtocolError(f"'report' message: 'priority' is {priority!r}")
        mirror = self.mirrors.get(id)
        if mirror is None:
            return  # cancelled meanwhile, or gone already
        if not mirror.granted:
            raise ProtocolError(f"'report' of #{id}, which was never granted")
        if priority is not None:
            self._reprioritize(mirror, priority)
        if mirror.state == "loading":
            mirror.charge = self._charge(message, state)
            if state == "demoted":  # (a move under way when it was adopted ended so)
                mirror.home = self._home(message)
            loads = message.get("loads")
            if type(loads) is int and loads >= 0:
                mirror.loads = loads
        mirror.state = state
        if mirror.asking and state in _HOLDING:
            mirror.refused = True
        if "reason" in message:
            mirror.reason = _REASONS.get(str(message["reason"]), Reason.CAPACITY)
        if state in ("quarantined", "overdue"):
            mirror.error = str(message.get("error", ""))
        if message.get("touched") and state == "idle":
            mirror.touched = True
        self.reconcile(mirror)

    def _touch(self, mirror: _Mirror) -> None:
        """The process leased the idle entry and ended the lease between two reports: a
        request all the same, which the daemon's policy counts (its recency, its count)."""
        entry = mirror.entry
        if entry is None or entry.state is not State.READY:
            return  # (once it is booked: ``_loaded`` reconciles again)
        mirror.touched = False
        if entry.leases or entry.pinned:
            return
        core = self.runner.core
        core.hit(entry, self.holder)
        core.lease_end(entry, self.holder, self.runner.clock())
        self.runner.apply()
        self.runner.note_idle(entry)

    def _reprioritize(self, mirror: _Mirror, priority: int) -> None:
        """Evict ``mirror``'s entry by the priority a later acquire there gave it.

        As in-process, the latest acquire's priority wins (``Core.reprioritize``).
        """
        entry = mirror.entry
        block = mirror.space.block
        if entry is None and block is not None:  # granted, still loading there
            entry = block.owner.entries.get(mirror.key)
        if entry is None or entry.state is State.GONE:
            return
        self.runner.core.reprioritize(entry, priority)

    def _charge(self, message: dict[str, Any], state: str) -> dict[str, int] | None:
        """A loaded entry's measured charge: in the daemon's spaces, and kept only within them.

        A process refuses a value measured above a space's whole budget
        (``RequestTooLarge``) and releases it: one that keeps it breaks the protocol.
        """
        charge = wire.charge(message, "charge")
        spaces = self.runner.core.spaces
        for name, amount in (charge or {}).items():
            space = spaces.get(name)
            if space is None:
                raise ProtocolError(f"'report' message: no space {name!r} in {charge!r}")
            if amount > space.limit and state not in _LETTING_GO:
                raise ProtocolError(
                    f"'report' message: {state!r} with {charge!r}, above the space's whole budget"
                )
        return charge

    def _home(self, message: dict[str, Any]) -> dict[str, int]:
        """A demoted entry's home (``home``): where it was loaded, in the daemon's spaces."""
        home = wire.charge(message, "home")
        if not home or any(name not in self.runner.core.spaces for name in home):
            raise ProtocolError(f"{message['op']!r} message: 'home' is {message.get('home')!r}")
        return home

    def reconcile(self, mirror: _Mirror) -> None:
        """Bring the daemon's entry in line with the process's last report."""
        entry = mirror.entry
        core = self.runner.core
        state = mirror.state
        if entry is not None:
            if entry.state in (State.READY, State.DEMOTED, State.MOVING):
                self._hold(mirror)
                if state in _LETTING_GO:
                    core.let_go(entry, mirror.reason)
            elif entry.state is State.QUARANTINED and state == "gone":
                core.release_done(entry)  # a late acknowledgement, or forgotten in the process
            elif entry.state is State.QUARANTINED and state == "quarantined":
                # (after "overdue": the release that ran on there raised after all)
                core.release_failed(entry, ReleaseFailed(mirror.error))
            elif entry.state is State.QUARANTINED and state == "idle":
                # Its release timed out here, then was refused there (leased meanwhile):
                # it is an ordinary entry there, which forget() cannot write off. Ask
                # again, now that it is idle; its "gone" is a late acknowledgement.
                self._ask_release(mirror)
            if state == "gone" and entry.state is State.GONE:
                self.mirrors.pop(mirror.id, None)
            if mirror.touched:
                self._touch(mirror)
        self.runner.apply()
        self._wake(mirror)

    def _hold(self, mirror: _Mirror) -> None:
        """The daemon's lease and pin on a ready entry, as its process last reported them.

        ``held``: leased there, so leased here, by the process. ``pinned``:
        pinned here too, with no lease (pins are not leases: ``ps`` shows it
        pinned, and ``lease.held`` never reports it); a pinned entry is no
        candidate, so never a victim, nor a candidate for drain.
        """
        entry = mirror.entry
        if entry is None or entry.state is not State.READY:
            return
        core = self.runner.core
        now = self.runner.clock()
        leased = mirror.state == "held"
        if leased and not mirror.held:
            core.hit(entry, self.holder)
            mirror.held, mirror.holder = True, self.holder
        # Pinned before its lease ends, so that the end leaves it resident.
        pinned = mirror.state == "pinned"
        if pinned != entry.pinned:
            pin(core, entry, pinned, now)
        if not leased and mirror.held:
            mirror.held = False
            core.lease_end(entry, mirror.holder, now)
            if not entry.leases and not entry.pinned:
                self.runner.note_idle(entry)

    def _wake(self, mirror: _Mirror) -> None:
        event, mirror.reported = mirror.reported, None
        if event is not None:  # (made by a wait: ``_Mirror.next_report``)
            event.set()

    def _ask_release(self, mirror: _Mirror) -> None:
        """Ask the process to release ``mirror``'s entry, saying why (its stats count it so)."""
        # (Released in the step of its load's outcome, it is not ``mirror.entry`` yet.)
        entry = mirror.entry if mirror.entry is not None else self.entry_of(mirror.id)
        reason = None if entry is None else entry.shell.release_reason
        message: dict[str, Any] = {"op": "release", "id": mirror.id}
        if reason is not None:
            message["reason"] = reason.value
        self.post(message)

    def releasing(self, key: Hashable) -> None:
        """The daemon's books release ``key``: ask the process, in this step (``Elsewhere``)."""
        mirror = self.mirrors.get(key.id) if isinstance(key, _Key) else None
        if mirror is None:
            return
        if mirror.state in ("idle", "loading", "held", "demoted"):
            # (held: leased again since, maybe right after offering it idle, which
            # the process then accepts to release at that lease's end)
            self._ask_release(mirror)
        mirror.asking, mirror.refused = True, False

    async def _release(self, key: _Key, value: object) -> None:
        """The daemon's releaser for a process's entries, asked (``releasing``): the answer."""
        mirror = self.mirrors.get(key.id)
        if mirror is None:
            return
        try:
            while True:
                state = mirror.state
                if state == "gone":
                    self.mirrors.pop(mirror.id, None)
                    return
                if state in ("quarantined", "overdue"):
                    name = mirror.space.name
                    raise _FailedThere(
                        ReleaseFailed(
                            f"releasing {name}:{key!r} failed in process {self.pid}: {mirror.error}"
                        ),
                        overdue=state == "overdue",
                    )
                if state in _HOLDING:
                    mirror.held, mirror.holder = True, self.holder
                    raise _Refused(self.holder, functools.partial(self._hold, mirror))
                entry = mirror.entry
                if mirror.wants_back and entry is not None and entry.home is not None:
                    # Its process asked for it back up (``promote``): it keeps it (a
                    # release asked there meanwhile finds it moving), and the
                    # promotion goes on.
                    raise _Refused(None, functools.partial(self.reconcile, mirror))
                if mirror.refused and state == "idle":
                    # Refused (held when asked), then idle again before this task
                    # looked: the process will not release it unless asked again.
                    mirror.refused = False
                    self._ask_release(mirror)
                await mirror.next_report()
        finally:
            mirror.asking = False
            self._wake(mirror)  # (a promotion waits for the release to be refused)

    async def _move(self, key: _Key, value: object, to: str) -> dict[str, int]:
        """The daemon's ``move`` for a process's entries: ask, and await how it ended.

        The process moves the value (``Link.move``); its charge where it went
        is what the daemon's books take as the moved value (``_measured``). A
        move it refused (the entry was leased there meanwhile, or is on its way
        out) is called off here too (``Core.release_refused``); one that failed
        there quarantines the entry, as in-process.
        """
        mirror = self.mirrors.get(key.id)
        entry = None if mirror is None else mirror.entry
        if mirror is None or entry is None or entry.target is None:
            raise ReleaseFailed(f"{key!r} of process {self.pid} is not there to move")
        if mirror.wants_back and not entry.promoting:
            # Its process asked for it back up (``promote``): it stays (and is promoted).
            raise _Refused(None, functools.partial(self.reconcile, mirror))
        self._ask_move(mirror, to, entry)
        while True:
            moved, state = mirror.moved, mirror.state
            if isinstance(moved, dict):
                mirror.moved = None
                return moved
            if state in ("quarantined", "overdue"):
                raise _FailedThere(
                    ReleaseFailed(
                        f"moving {mirror.space.name}:{key!r} to {to!r} failed in process "
                        f"{self.pid}: {mirror.error}"
                    )
                )
            if moved == "refused" or state in _LETTING_GO:
                # Leased or pinned there meanwhile, or on its way out there: it stays
                # (a lease given back, a pin kept), or goes from where it is.
                mirror.moved = None
                holder = None
                if state == "held":
                    mirror.held, mirror.holder = True, self.holder
                    holder = self.holder
                elif state in _LETTING_GO:
                    self.runner.core.let_go(entry, mirror.reason)
                raise _Refused(holder, functools.partial(self.reconcile, mirror))
            await mirror.next_report()

    def _ask_move(self, mirror: _Mirror, to: str, entry: Entry) -> None:
        mirror.moved = None  # (what the process answers to this ask)
        assert entry.target is not None
        message: dict[str, Any] = {"op": "move", "id": mirror.id, "to": to}
        message["charge"] = dict(entry.target)
        if entry.promoting:  # (the grant of its ``promote``)
            message["up"] = True
        self.post(message)

    def moved(self, message: dict[str, Any]) -> None:
        """How a move the daemon asked for ended in the process (``_move`` awaits it)."""
        id = wire.field(message, "id", int)
        mirror = self.mirrors.get(id)
        if message.get("refused"):
            outcome: dict[str, int] | str | None = "refused"
        else:
            outcome = self._charge(message, "moved")
            if not outcome:
                raise ProtocolError(f"'moved' message: 'charge' is {message.get('charge')!r}")
        if mirror is not None:
            mirror.moved = outcome
            self._wake(mirror)

    def promote(self, message: dict[str, Any]) -> None:
        """The process asks for its demoted entry ``id`` back up: a request for it here.

        Granted when the daemon's books have brought it up (``_move``, whose
        ``move`` message the process awaits); refused with ``fail``.
        """
        id = wire.field(message, "id", int)
        holding = message.get("holding", [])
        if not isinstance(holding, list) or not all(type(i) is int for i in holding):
            raise ProtocolError(f"'promote' message: 'holding' is {wire.shown(holding)}")
        mirror = self.mirrors.get(id)
        if mirror is None or mirror.entry is None or mirror.promoting is not None:
            error = {"type": "BrokerClosed", "message": f"#{id} is not demoted here"}
            self.post({"op": "fail", "id": id, "error": error})
            return
        mirror.wants_back = True
        self._wake(mirror)  # (a release asked meanwhile is refused: ``_release``)
        held = tuple(m for m in map(self.mirrors.get, holding) if m is not None)
        scope = mirror.promoting = anyio.CancelScope()
        assert self.tg is not None
        self.tg.start_soon(self._promote, mirror, held, scope)

    async def _promote(
        self, mirror: _Mirror, holding: tuple[_Mirror, ...], scope: anyio.CancelScope
    ) -> None:
        block = mirror.space.block
        assert block is not None
        with scope:
            try:
                await self.daemon.gate.wait()
                # A release decided meanwhile is refused first (the process wants the
                # value back: ``_release``), so that this request finds it demoted.
                current = mirror.entry
                while current is not None and current.state is State.RELEASING:
                    released = current.shell.released
                    if released is None or released.is_set():
                        break
                    await released.wait()
                held = tuple(other.entry for other in holding if other.entry is not None)
                request = Request(
                    mirror.key, None, load=functools.partial(self._load, mirror), measure=_measured
                )
                entry, task = await self.runner.request(block.owner, request, held=held)
            except Exception as exc:
                self.post(
                    {"op": "fail", "id": mirror.id, "error": wire.encode_error(exc, self.names())}
                )
                return
            finally:
                if mirror.promoting is scope:  # (not asked again since: ``call_off``)
                    mirror.promoting = None
                    mirror.wants_back = False
        if scope.cancelled_caught:
            return
        if mirror.held:  # (held already: one lease of the process's is enough)
            self.runner.core.lease_end(entry, task, self.runner.clock())
        else:
            mirror.held, mirror.holder = True, task
        self.reconcile(mirror)

    def call_off(self, id: int) -> None:
        """Nobody in the process waits for ``id``'s promotion any more (``promote``)."""
        mirror = self.mirrors.get(id)
        if mirror is not None and mirror.promoting is not None:
            mirror.promoting.cancel()
            mirror.promoting = None
            mirror.wants_back = False

    def lost(self) -> None:
        """The process is gone: its entries leave the daemon's books at once."""
        runner = self.runner
        core = runner.core
        freed: dict[str, int] = {}
        count = 0
        for entry in list(core.entries()):
            found = self.daemon.owners.get(entry.owner)
            if found is not None and found[0] is self and entry.state is not State.WAITING:
                count += 1
                for name, amount in entry.charge.items():
                    freed[name] = freed.get(name, 0) + amount
        if freed:
            self.daemon.keep(self, freed)  # (before they leave: never a moment uncharged)
        for space in self.opened:
            if space.block is not None:
                core.drop_owner(space.block.owner)
        for mirror in self.mirrors.values():
            mirror.cancelled = True
            mirror.state = "gone"
            mirror.settled.set()
            self._wake(mirror)
        runner.apply()
        for space in self.caches.values():
            space.closed.set()
        self.daemon.expected.discard(self.pid)  # (gone before it registered: nothing held)
        self.daemon.forget_peer(self)
        runner.emit(
            self.level,
            ev.PEER_GONE,
            address=self.daemon.address,
            pid=self.pid,
            entries=count,
            bytes=freed,
        )
