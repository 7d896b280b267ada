"""The shared broker: ``cachebroker serve``'s daemon.

The daemon runs an ordinary broker (the same books, policy, probes, idle
sweeper and release timeout); what is new is who its owners are. Each cache
a connected process opens is an owner of the daemon's books, named
``cache@pid``, and each entry that process loads is one entry there, keyed by
the number the process gave it and shown by its key's ``repr``:

* an ``acquire`` is the daemon's request for that entry; when the books grant
  it, the entry's load is a ``grant`` sent to the process, which loads and
  reports the value's measured size (``_Mirror.load``);
* a ``report`` says where the process's entry stands (``held``, ``idle``,
  ``releasing``, ``quarantined``, ``gone``); the daemon's lease on the entry
  follows it (``Connection.reconcile``);
* a release the books start is a ``release`` asked of the process, whose
  answer is its next report: ``gone`` (the bytes are free), ``quarantined``
  (the release failed), or ``held`` (the process leased the entry again
  before the request arrived: the release is refused and the books look
  for other room, ``Core.release_refused``);
* a connection that ends takes its process's entries out of the books at once
  (``Core.drop_owner``): the operating system has its memory back.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import json
import math
import os
import stat
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import anyio
import anyio.abc
from anyio.streams.buffered import BufferedByteReceiveStream

from .. import _log_events as ev
from .._core import Core, Entry, Reason, State, Ticket
from .._errors import InvalidArgument, LeasesOutstanding, LoadFailed, ReleaseFailed
from .._shell._actor import Block
from .._shell._broker import Broker
from .._shell._config import positive_seconds
from .._shell._seam import FailedThere, Local, Refused
from . import _protocol as wire
from ._protocol import ProtocolError
from ._sockets import connect, listen

__all__ = ["Daemon", "DaemonBroker", "DaemonReleases"]

#: Seconds a new connection has to say hello (``Daemon(hello_timeout=...)``).
HELLO_TIMEOUT = 10.0

#: Seconds a restarted daemon waits at most for the processes of the one
#: before it to register again before it grants anything (``serve --grace``).
GRACE = 10.0

#: Seconds between looks at whether an expected process still lives.
GATE_POLL = 0.1
#: How many connections may await their hello at once (``Daemon(max_pending=...)``);
#: one more closes the oldest (``_Awaiting``).
MAX_PENDING = 128

#: How many messages may wait to be sent to a process before the daemon stops reading
#: from it until it reads (``Connection.room``).
MAX_UNSENT = 64

#: Seconds to wait after ``accept()`` failed, at first and at most: the wait doubles
#: from one failure to the next, and starts again at the first once one succeeds.
ACCEPT_BACKOFF = (0.01, 1.0)

#: How ``accept()`` may fail and then succeed again: out of file descriptors, buffers
#: or memory (until connections close), or a connection aborted before it was accepted.
_TRANSIENT = frozenset(
    {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED, errno.EPROTO}
)

#: What a process's report may say of its entry.
_REPORTS = frozenset({"held", "pinned", "idle", "releasing", "overdue", "quarantined", "gone"})

#: How an entry may stand when a process registers it again (``adopt``).
_ADOPTED = frozenset({"loading", "held", "pinned", "idle", "releasing", "overdue", "quarantined"})

#: Reports of an entry on its way out.
_LETTING_GO = frozenset({"releasing", "overdue", "quarantined", "gone"})

#: Reports that hold the entry (leased, or pinned): it is no victim.
_HOLDING = frozenset({"held", "pinned"})

#: How reading from a process ends when it closed its connection, or died.
_ENDED = (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, OSError)

_REASONS = {reason.value: reason for reason in Reason}


class _Refused(BaseException):
    """The process leased the entry again before the release request arrived.

    A ``BaseException``, so that nothing on its way to the runner's ``Releases`` takes it
    for a failure (``DaemonReleases.release_outcome`` says what it is).
    """

    def __init__(self, holder: object, then: Callable[[], None]) -> None:
        super().__init__()
        self.holder = holder
        #: What the books do once the entry is ready again (its process's report, applied).
        self.then = then


class _FailedThere(Exception):
    """The release failed in the owner's process: ``error`` says so, as the books will.

    ``overdue``: it did not return within its timeout there, and still runs
    (its bytes may come back: ``Core.release_overdue``).
    """

    def __init__(self, error: ReleaseFailed, *, overdue: bool = False) -> None:
        super().__init__(str(error))
        self.error = error
        self.overdue = overdue


class DaemonReleases(Local):
    """The daemon's side of its runner (``Remote``): its releases end in the processes.

    A release the process refused (it leased the entry again) gives the
    entry back its lease; one that failed or overran there says so. Its
    entries' holders are processes: events name them by pid and cache
    (``owners``, the daemon's map of each owner to its connection and cache).
    """

    __slots__ = ("owners",)

    def __init__(self) -> None:
        self.owners: Mapping[Any, tuple[Connection, str]] = {}

    def release_outcome(self, exc: BaseException) -> Refused | FailedThere | None:
        if isinstance(exc, _Refused):
            return Refused(exc.holder, exc.then)
        if isinstance(exc, _FailedThere):
            return FailedThere(exc.error, overdue=exc.overdue)
        return None

    def holder_names(self, entry: Entry) -> list[str] | None:
        """``process 1234 (cache whisper)``: the process whose entry it is holds every lease."""
        found = self.owners.get(entry.owner)
        if found is None:
            return None
        connection, cache = found
        return [f"process {connection.pid} (cache {cache})"] if entry.holders else []


class DaemonSeam:
    """The daemon's side of its books (``Seam``): a waiter blocked by leased entries says so.

    In-process, a waiter blocked by leased entries gets their bytes when
    their last lease ends. Here a lease's end and the next hit in the
    owner's process may fall in one batch, or the leases overlap: the daemon
    might never see the entry idle. So it tells the owner's process at once
    that it wants the entry (``want``: the ``want`` message): that process
    reports the entry's next idle moment even if it leases it again at once,
    and accepts the release asked then; one whose leases overlap drains it
    after ``FAIR_REQUESTS`` requests of its own, as in-process.
    """

    __slots__ = ("want", "wanting")

    def __init__(self, want: Callable[[Entry], None]) -> None:
        self.want = want
        #: Leased entries their processes were told are wanted, until their lease ends.
        self.wanting: dict[Entry, None] = {}

    def wanted(self, entry: Entry) -> bool:
        if entry not in self.wanting:
            self.wanting[entry] = None
            self.want(entry)
        return True

    def ended(self, entry: Entry) -> None:
        if self.wanting:
            self.wanting.pop(entry, None)

    def gone(self, entry: Entry) -> None:
        if self.wanting:
            self.wanting.pop(entry, None)

    # (Every other change reaches the processes from the processes themselves.)

    def changed(self, entry: Entry) -> None:
        pass

    def leased(self, entry: Entry) -> None:
        pass

    def loaded(self, entry: Entry) -> None:
        pass

    def withdrawn(self, entry: Entry) -> None:
        pass

    def releasing(self, entry: Entry, reason: Reason) -> None:
        pass

    def quarantined(self, entry: Entry) -> None:
        pass

    def drains(self, entry: Entry) -> bool:
        return False  # (the entry's process drains it: it sees every lease)

    def lets_go(self, entry: Entry) -> bool:
        return False


def plug_daemon(books: Core, want: Callable[[Entry], None]) -> DaemonSeam:
    """Make ``books`` the daemon's: its processes are told what it wants, and they
    count their own loads (each of a process's loads is a key of its own here)."""
    seam = DaemonSeam(want)
    books.seam = seam
    books.fair_requests = 0
    books.counts_loads = False
    return seam


def pin(books: Core, entry: Entry, pinned: bool, now: float) -> None:
    """Pin or unpin a ready entry, as its process reports it: no lease taken or ended.

    Pinned, an idle entry leaves the idle books (no candidate, never a
    victim); unpinned, an entry with no lease becomes a candidate again.
    """
    if pinned:
        books.retune(entry, None, True, now)
    else:
        books.unpin(entry.owner, entry.key, now)


class DaemonBroker(Broker):
    """The broker the daemon runs (its runner's side: ``DaemonReleases``).

    Its ``idle_ttl`` is the processes' default, not a timer of its own: each
    process runs its entries' idle timers, so that an entry's own
    ``acquire(idle_ttl=...)`` wins there as in-process.
    """

    def __init__(self, budget: Any, *, idle_ttl: float | None = None, **settings: Any) -> None:
        #: How its releases end in the processes, and who holds its entries.
        self.releases = self._remote = DaemonReleases()
        super().__init__(budget, **settings)
        #: What the processes take as their default idle TTL (``welcome``).
        self.idle_ttl = positive_seconds(idle_ttl, "idle_ttl", inf_is_none=True)


class _Key:
    """A process's key in the daemon's books: its number there, shown as the key's ``repr``."""

    __slots__ = ("id", "text")

    def __init__(self, id: int, text: str) -> None:
        self.id = id
        self.text = text

    def __repr__(self) -> str:
        return self.text


class _Holder:
    """Who holds the daemon's lease on a process's entry (shown in ``lease.held`` events)."""

    __slots__ = ("pid",)

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def __repr__(self) -> str:
        return f"<process {self.pid}>"


class _Mirror:
    """The daemon's side of one entry of a connected process."""

    __slots__ = (
        "asking",
        "cancelled",
        "charge",
        "entry",
        "error",
        "granted",
        "held",
        "holder",
        "id",
        "key",
        "loads",
        "reason",
        "refused",
        "reported",
        "scope",
        "settled",
        "space",
        "state",
    )

    def __init__(self, id: int, key: _Key, space: _Space) -> None:
        self.id = id
        self.key = key
        self.space = space
        #: The process's last report: ``loading`` until its load's outcome.
        self.state = "loading"
        self.granted = False
        self.charge: dict[str, int] | None = None
        self.reason = Reason.CAPACITY
        self.error = ""
        #: How many times the process has loaded this key (it says so with the
        #: load's outcome; ``None`` from a process that does not).
        self.loads: int | None = None
        #: Set (and renewed) at each report: what a load or a release waits on.
        self.reported = anyio.Event()
        #: The daemon's entry once granted and loaded, and whether (and by whom) it is leased.
        self.entry: Entry | None = None
        self.held = False
        self.holder: object = None
        self.scope: anyio.CancelScope | None = None
        self.cancelled = False
        #: While the daemon asks for its release (``_release``): whether the process
        #: reported it held since, which refuses the request even if it is idle again.
        self.asking = False
        self.refused = False
        #: Set once the daemon's request for it is over: loaded, failed or withdrawn.
        self.settled = anyio.Event()


class _Space:
    """One cache a process opened: its owner in the daemon's books."""

    __slots__ = ("block", "closed", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self.block: Block | None = None
        self.closed = anyio.Event()


class Connection:
    """One connected process."""

    def __init__(
        self,
        daemon: Daemon,
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
        self.wake = anyio.Event()
        self.tg: anyio.abc.TaskGroup | None = None
        #: The level of its ``peer.connected`` and ``peer.gone`` (debug for ``cachebroker ps``).
        self.level = "info"
        #: How many messages the writer is sending; set (and renewed) after each write.
        self.sending = 0
        self.sent = anyio.Event()
        #: Until the writer is gone (the connection broke, or is ending).
        self.writing = True

    def post(self, message: dict[str, Any]) -> None:
        """Queue ``message`` for the writer."""
        self.outbox.append(message)
        self.wake.set()

    async def writer(self) -> None:
        """Send what was posted, a batch per write."""
        try:
            while True:
                await self.wake.wait()
                self.wake = anyio.Event()
                batch, self.outbox = self.outbox, []
                self.sending = len(batch)
                try:
                    await wire.send(self.stream, *batch)
                except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                    return  # the reader sees the end too
                finally:
                    self.sending = 0
                    self.sent.set()
                    self.sent = anyio.Event()
        finally:
            self.writing = False

    async def room(self) -> bool:
        """Wait while more than ``MAX_UNSENT`` messages wait to be sent to the process;
        false once nothing can be sent to it any more (the connection is over).

        A process that does not read what it asked for is not read either, so
        that it cannot make the daemon hold an answer per request (``ps``
        answers are large): its requests wait in its socket, not here. A
        process that reads (every ``Broker.connect()`` reads all the time)
        never waits here but for the moment one write takes.
        """
        while self.writing and len(self.outbox) + self.sending > MAX_UNSENT:
            await self.sent.wait()
        return self.writing

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
            self.why(wire.field(message, "id", int))
        elif op == "cancel":
            self.cancel(wire.field(message, "id", int))
        elif op == "open":
            await self.open(wire.field(message, "cache", str))
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

    async def open(self, cache: str) -> None:
        if not cache or cache in self.caches:
            raise ProtocolError(f"cache {cache!r} is opened twice or has no name")
        space = self.caches[cache] = _Space(self.daemon.owner_name(cache, self))
        self.opened.append(space)
        assert self.tg is not None
        await self.tg.start(self._run_cache, cache, space)
        self.daemon.note_peer(self)

    async def _run_cache(
        self, cache: str, space: _Space, *, task_status: anyio.abc.TaskStatus[None]
    ) -> None:
        """Hold the daemon-side block of ``cache`` open until the process closes it (or goes)."""
        block = await self.runner.open_block(space.name, self._release)
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
        need = wire.charge(message, "need")
        cost = message.get("cost")
        if cost is not None and (not isinstance(cost, (int, float)) or cost < 0):
            raise ProtocolError(f"'acquire' message: 'cost' is {cost!r}")
        space = self.caches.get(cache)
        if space is None or space.block is None or id in self.mirrors:
            raise ProtocolError(f"'acquire' of #{id} in cache {cache!r}, which is not open")
        holding = message.get("holding", [])
        if not isinstance(holding, list) or not all(type(i) is int for i in holding):
            raise ProtocolError(f"'acquire' message: 'holding' is {holding!r}")
        held = tuple(mirror for mirror in map(self.mirrors.get, holding) if mirror is not None)
        priority = message.get("priority", 0)
        if type(priority) is not int:
            raise ProtocolError(f"'acquire' message: 'priority' is {priority!r}")
        mirror = self.mirrors[id] = _Mirror(id, key, space)
        assert self.tg is not None
        self.tg.start_soon(
            self._acquire, mirror, cache, need, cost, bool(message.get("urgent")), held, priority
        )

    async def _acquire(
        self,
        mirror: _Mirror,
        cache: str,
        need: dict[str, int] | None,
        cost: float | None,
        urgent: bool,
        holding: tuple[_Mirror, ...],
        priority: int = 0,
    ) -> None:
        block = mirror.space.block
        assert block is not None
        with anyio.CancelScope() as scope:
            mirror.scope = scope
            if mirror.cancelled:
                scope.cancel()
            # A restarted daemon grants nothing until the processes of the one
            # before it have said what they hold (``Daemon.gate``).
            await self.daemon.gate.wait()
            # The entries the requesting task leases may still be settling here
            # (their loads' reports came in the same batch): wait for them, so
            # that a request only those leases could make room for is refused.
            for other in holding:
                await other.settled.wait()
            held = tuple(other.entry for other in holding if other.entry is not None)
            try:
                entry, task = await self.runner.request(
                    block.owner,
                    mirror.key,
                    functools.partial(self._load, mirror),
                    need,
                    _measured,
                    cost,
                    None,
                    urgent=urgent,
                    held=held,
                    priority=priority,
                )
            except Exception as exc:
                loaded = block.owner.entries.get(mirror.key)
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
                return
        if scope.cancelled_caught:
            mirror.settled.set()
            return
        self._loaded(mirror, entry, task)

    def _loaded(self, mirror: _Mirror, entry: Entry, task: object) -> None:
        """``mirror``'s entry is in the books, leased to ``task`` until the process's report."""
        mirror.entry = entry
        mirror.held = True
        mirror.holder = task
        mirror.settled.set()
        self.reconcile(mirror)

    async def _load(self, mirror: _Mirror, *, grant: bool = True) -> dict[str, int]:
        """The daemon's load of a process's entry: the grant, then the process's outcome.

        An adopted entry (``adopt``) was granted by the daemon before this one.
        """
        if grant:
            self.post({"op": "grant", "id": mirror.id})
        mirror.granted = True
        while mirror.state == "loading":
            await mirror.reported.wait()
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

    def why(self, id: int) -> None:
        """Say why request ``id`` has no room yet, in the books' words (``Core.why_no_room``)."""
        mirror = self.mirrors.get(id)
        block = None if mirror is None else mirror.space.block
        entry = None if mirror is None or block is None else block.owner.entries.get(mirror.key)
        text = None
        if entry is not None and entry.state is State.WAITING and entry.need:
            text = wire.rename(self.runner.core.why_no_room(entry), self.names())
        self.post({"op": "why", "id": id, "text": text})

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
        mirror.granted = True
        mirror.state = state
        mirror.charge = None if state == "loading" else charge
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
            functools.partial(self._load, mirror, grant=False),
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
        self.reconcile(mirror)

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

    def reconcile(self, mirror: _Mirror) -> None:
        """Bring the daemon's entry in line with the process's last report."""
        entry = mirror.entry
        core = self.runner.core
        state = mirror.state
        if entry is not None:
            if entry.state is State.READY:
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
                self.post({"op": "release", "id": mirror.id})
            if state == "gone" and entry.state is State.GONE:
                self.mirrors.pop(mirror.id, None)
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
        mirror.reported.set()
        mirror.reported = anyio.Event()

    async def _release(self, key: _Key, value: object) -> None:
        """The daemon's releaser for a process's entries: ask, and await the answer."""
        mirror = self.mirrors.get(key.id)
        if mirror is None:
            return
        if mirror.state in ("idle", "loading", "held"):
            # (held: leased again since, maybe right after offering it idle, which
            # the process then accepts to release at that lease's end)
            self.post({"op": "release", "id": mirror.id})
        mirror.asking, mirror.refused = True, False
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
                if mirror.refused and state == "idle":
                    # Refused (held when asked), then idle again before this task
                    # looked: the process will not release it unless asked again.
                    mirror.refused = False
                    self.post({"op": "release", "id": mirror.id})
                await mirror.reported.wait()
        finally:
            mirror.asking = False

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


def _measured(charge: object) -> object:
    """A process's entry weighs what the process measured (its load returns that)."""
    return charge


class Daemon:
    """Serves one broker to the processes that connect to ``address``.

    No peer stops it: what one connection does ends that connection at most
    (``_connection``), connections awaiting their hello are bounded
    (``max_pending``, ``hello_timeout``), and ``accept()`` failing for want
    of descriptors is waited out (``_accept``).

    A restarted daemon does not know what the processes of the one before it
    hold until they register again, so it grants nothing (``gate``) until
    every process listed in the peers file (``address`` + ``.peers``, kept
    by every daemon: the pids of the processes that opened a cache) has
    registered, or ended, or ``grace`` seconds passed.
    """

    def __init__(
        self,
        broker: DaemonBroker,
        address: str,
        *,
        uid: int | None = None,
        grace: float = GRACE,
        max_pending: int = MAX_PENDING,
        hello_timeout: float = HELLO_TIMEOUT,
    ) -> None:
        self.broker = broker
        self.runner = broker._relay
        self.address = address
        #: The only user whose processes may connect.
        self.uid = os.getuid() if uid is None else uid
        if isinstance(max_pending, bool) or not isinstance(max_pending, int):
            raise TypeError(f"max_pending must be a number of connections, got {max_pending!r}")
        if max_pending < 1:
            raise InvalidArgument(f"max_pending must be at least 1, got {max_pending!r}")
        #: The connections awaiting their hello.
        self.awaiting = _Awaiting(max_pending)
        if isinstance(hello_timeout, bool) or not isinstance(hello_timeout, (int, float)):
            raise TypeError(f"hello_timeout must be a number of seconds, got {hello_timeout!r}")
        if not 0 < hello_timeout < math.inf:
            raise InvalidArgument(
                f"hello_timeout must be a positive number of seconds, got {hello_timeout!r}"
            )
        self.hello_timeout = float(hello_timeout)
        self.owners: dict[Any, tuple[Connection, str]] = {}
        self.connections: dict[int, Connection] = {}
        #: The owner names in use.
        self.names: set[str] = set()
        self._serials = itertools.count(1)
        plug_daemon(self.runner.core, self.want)
        if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not grace >= 0:
            raise InvalidArgument(f"grace must be a non-negative number of seconds, got {grace!r}")
        self.grace = float(grace)
        #: Set once requests may be granted (``run``).
        self.gate = anyio.Event()
        #: The previous daemon's processes, still alive, that have not registered yet.
        self.expected: set[int] = set()
        #: The pids in the peers file as last written (``None``: not written yet).
        self._peers: frozenset[int] | None = None
        #: The daemon's own owner of the bytes kept for lost connections (``keep``),
        #: and each kept broker's event, set when it registers again.
        self._gone_block: Block | None = None
        self._kept: dict[str, anyio.Event] = {}
        #: How many kept holds each process has (``keep``).
        self._holding: dict[int, int] = {}
        broker.releases.owners = self.owners

    @property
    def peers_path(self) -> str:
        """The file listing the processes this daemon serves, for the daemon after it."""
        return self.address + ".peers"

    def note_peer(self, connection: Connection) -> None:
        """``connection`` opened a cache: its process holds what it loads from now on."""
        self._write_peers()

    def forget_peer(self, connection: Connection) -> None:
        """``connection`` ended: unless its bytes are kept (``keep``), it is no peer any more."""
        self._write_peers(leaving=connection)

    def registered(self, connection: Connection) -> None:
        """``connection``'s process said all it holds (after a restart: ``register``)."""
        back = self._kept.pop(connection.session, None) if connection.session else None
        if back is not None:
            back.set()  # what it held before is charged again by its own entries
        if connection.pid in self.expected:
            self.expected.discard(connection.pid)
            self._open_gate_if_due()

    def keep(self, connection: Connection, charge: dict[str, int]) -> None:
        """``connection`` ended, its process may live on: keep ``charge`` booked meanwhile.

        A process that lost its connection (or closed its broker with values
        quarantined or still leased) may still hold that memory. It stays
        charged, as a loading entry of the daemon's own that nobody can evict,
        until the process ends or the same broker registers again
        (``registered``). A peer of this very process (or of no known pid) is
        taken at its word: its bytes come back at once.
        """
        if connection.pid in (0, os.getpid()) or self._gone_block is None:
            return
        back = anyio.Event()
        if connection.session:
            self._kept[connection.session] = back
        key = _Key(-connection.serial, f"<held by process {connection.pid}>")
        self._holding[connection.pid] = self._holding.get(connection.pid, 0) + 1
        self.runner.adopt(
            self._gone_block.owner,
            key,
            functools.partial(self._hold, connection.pid, back),
            _measured,
            charge,
        )

    async def _hold(self, pid: int, back: anyio.Event) -> object:
        """Hold a lost connection's bytes until process ``pid`` ends or registers again.

        Meanwhile ``pid`` stays in the peers file: a daemon started after this
        one waits for it too.
        """
        try:
            while not back.is_set() and _alive(pid):
                with anyio.move_on_after(GATE_POLL):
                    await back.wait()
        finally:
            self._holding[pid] -= 1
            if not self._holding[pid]:
                del self._holding[pid]
        self._write_peers()  # (not when the daemon stops: the next one waits for it)
        raise LoadFailed(f"process {pid} ended or registered again: its bytes are back")

    def _open_gate_if_due(self) -> None:
        if not self.gate.is_set() and not self.expected:
            self.gate.set()
            self.runner.emit("info", ev.DAEMON_READY, address=self.address, waited_for=[])

    def _write_peers(self, leaving: Connection | None = None) -> None:
        pids = frozenset(
            c.pid
            for c in self.connections.values()
            if c.opened and c is not leaving and c.pid != os.getpid()
        )
        pids |= self.expected  # (not registered yet: still the memory of the daemon before)
        pids |= self._holding.keys()  # (their bytes are kept: ``keep``)
        if pids == self._peers:
            return
        self._peers = pids
        temporary = f"{self.peers_path}.{os.getpid()}"
        try:
            with open(temporary, "w", opener=_private) as file:
                json.dump({"pids": sorted(pids)}, file)
            os.replace(temporary, self.peers_path)
        except OSError as exc:
            self.runner.emit("warning", ev.PEERS_UNSAVED, address=self.address, error=repr(exc))

    def _read_peers(self) -> set[int]:
        """The live processes of the daemon before this one (an unreadable file: none)."""
        try:
            with open(self.peers_path) as file:
                pids = json.load(file).get("pids", [])
        except (OSError, ValueError, AttributeError):
            return set()
        return {pid for pid in pids if type(pid) is int and pid > 0 and _alive(pid)}

    async def _hold_gate(self) -> None:
        """Open the gate once the expected processes registered or ended, or at the grace's end."""
        waited = sorted(self.expected)
        self.runner.emit(
            "warning", ev.DAEMON_WAITING, address=self.address, pids=waited, grace=self.grace
        )
        with anyio.move_on_after(self.grace):
            while self.expected:
                self.expected = {pid for pid in self.expected if _alive(pid)}
                if not self.expected:
                    break
                await anyio.sleep(GATE_POLL)
        if not self.gate.is_set():
            missing = sorted(self.expected)
            self.expected.clear()
            self.gate.set()
            self.runner.emit(
                "info", ev.DAEMON_READY, address=self.address, waited_for=waited, missing=missing
            )

    def want(self, entry: Entry) -> None:
        """A waiter is blocked by leased ``entry``: its process is to offer it when idle."""
        found = self.owners.get(entry.owner)
        key = entry.key
        if found is not None and isinstance(key, _Key):
            found[0].post({"op": "want", "id": key.id})

    def forget(self, owner: Any, name: str) -> None:
        """A connection's cache is gone from the books: its name may be used again."""
        self.owners.pop(owner, None)
        self.names.discard(name)

    def owner_name(self, cache: str, connection: Connection) -> str:
        """The name of ``connection``'s cache ``cache`` in the books: ``cache@pid``, made unique."""
        base = name = f"{cache}@{connection.pid}"
        taken = self.runner.core.owners
        for again in itertools.count(1):
            if name not in self.names and name not in taken:
                break
            # (a cache of that name still closing, or another connection's)
            name = f"{base}.{connection.serial}" + (f".{again}" if again > 1 else "")
        self.names.add(name)
        return name

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Listen on ``address`` until cancelled; the socket is removed on the way out."""
        listener = await _listen(self.address)
        inode = os.stat(self.address).st_ino
        self.expected = self._read_peers() - {os.getpid()}
        try:
            async with self.broker:
                gone = self._gone_block = await self.runner.open_block(_GONE, _nothing)
                try:
                    async with listener, anyio.create_task_group() as connections:
                        if self.expected:
                            connections.start_soon(self._hold_gate)
                        else:
                            self.gate.set()
                        self._write_peers()
                        task_status.started()
                        await self._accept(listener, connections)
                finally:
                    self._gone_block = None
                    with contextlib.suppress(LeasesOutstanding):
                        await self.runner.close_block(gone, None, None, None)
        finally:
            _unlink(self.address, inode)
            if self._peers is not None and not self._peers:  # nobody to wait for next time
                with contextlib.suppress(OSError):
                    os.unlink(self.peers_path)

    async def _accept(
        self, listener: anyio.abc.SocketListener, connections: anyio.abc.TaskGroup
    ) -> None:
        """Accept connections until cancelled, each served in ``connections``.

        ``listener.serve()`` would end the daemon at the first failure of
        ``accept()``; but running out of file descriptors (``EMFILE``,
        ``ENFILE``) or of buffers, or a connection aborted before it was
        accepted, passes: such a failure is logged (``accept.failed``), waited
        out (``ACCEPT_BACKOFF``, doubling from one failure to the next) and
        ``accept()`` tried again, while the connections already there are
        served and may close.
        """
        failures = 0
        while True:
            try:
                stream = await listener.accept()
            except (anyio.BrokenResourceError, OSError) as exc:
                # (anyio raises BrokenResourceError from the OSError)
                error = exc if isinstance(exc, OSError) else exc.__cause__
                if not isinstance(error, OSError) or error.errno not in _TRANSIENT:
                    raise
                failures += 1
                delay = backoff(failures)
                self.runner.emit(
                    "error",
                    ev.ACCEPT_FAILED,
                    address=self.address,
                    error=str(error),
                    errno=errno.errorcode.get(error.errno or 0, str(error.errno)),
                    failures=failures,
                    retry_in=delay,
                )
                await anyio.sleep(delay)
            else:
                failures = 0
                connections.start_soon(self._connection, stream)

    async def _connection(self, stream: anyio.abc.SocketStream) -> None:
        """One connection, from its accept to its end: whatever it raises ends it alone.

        This is the one place where a connection's failure is contained:
        before its hello, on the way to refusing another user, and while it
        is served. Any ``Exception`` (a ``ProtocolError``, and a bug's error
        too) is logged (``peer.failed``) and closes that connection; the
        daemon's own cancellation, ``KeyboardInterrupt`` and ``SystemExit``
        are no connection's doing and go through, so that the daemon stops.
        """
        pid: int | None = None
        try:
            async with stream:
                uid, pid = wire.peer(stream)
                reader = BufferedByteReceiveStream(stream)
                if uid is not None and uid != self.uid:
                    await self._refuse_user(stream, reader, uid, pid)
                    return
                hello = await self._hello(reader)
                if hello is None:
                    return  # it closed without a word (another daemon checking the socket is live)
                if hello["op"] != "hello" or hello.get("version") != wire.VERSION:
                    await _refuse(
                        stream,
                        f"this broker speaks protocol version {wire.VERSION}, "
                        f"got {wire.shown(hello)}",
                    )
                    return
                claimed = hello.get("pid")
                if pid is None:
                    pid = claimed if type(claimed) is int else 0
                session = hello.get("session")
                session = session if isinstance(session, str) and len(session) <= 64 else None
                await self._serve(
                    stream, reader, pid, observer=hello.get("observer") is True, session=session
                )
        except* Exception as failed:
            self.runner.emit(
                "error",
                ev.PEER_FAILED,
                address=self.address,
                pid=pid,
                error="; ".join(map(_why, _leaves(failed))),
            )

    async def _hello(self, reader: BufferedByteReceiveStream) -> dict[str, Any] | None:
        """A new connection's first message (``None``: it closed without one).

        ``ProtocolError`` for a first frame that is no message or is over
        ``MAX_HELLO`` bytes, for none within ``hello_timeout``, and for a
        connection closed to make room for newer ones (``max_pending``).
        """
        with self.awaiting.hello():
            try:
                with anyio.fail_after(self.hello_timeout):
                    return await wire.receive(reader, wire.MAX_HELLO)
            except (anyio.EndOfStream, anyio.IncompleteRead):
                return None
            except TimeoutError:
                raise ProtocolError(f"no hello within {self.hello_timeout:g} s") from None
        raise ProtocolError(
            f"closed before its hello, the oldest of {self.awaiting.limit} connections "
            "awaiting theirs (max_pending)"
        )

    async def _refuse_user(
        self,
        stream: anyio.abc.SocketStream,
        reader: BufferedByteReceiveStream,
        uid: int,
        pid: int | None,
    ) -> None:
        self.runner.emit("error", ev.PEER_REFUSED, address=self.address, uid=uid, pid=pid)
        # Take its hello first (whatever it is): a socket closed with the hello unread
        # (or before it was sent) resets the connection, and the peer may never read
        # why it was refused.
        with contextlib.suppress(ProtocolError, anyio.BrokenResourceError, OSError):
            await self._hello(reader)
        await _refuse(stream, f"user {uid} may not use the broker of user {self.uid}")

    async def _serve(
        self,
        stream: anyio.abc.SocketStream,
        reader: BufferedByteReceiveStream,
        pid: int,
        *,
        observer: bool,
        session: str | None = None,
    ) -> None:
        """Welcome a process that said hello, and serve it until it goes."""
        connection = Connection(self, stream, next(self._serials), pid, session)
        # (an observer, ``cachebroker ps``, comes and goes unremarked: at debug level)
        connection.level = "debug" if observer else "info"
        self.connections[connection.serial] = connection
        try:
            connection.post({"op": "welcome", "version": wire.VERSION, **self.settings()})
            self.runner.emit(connection.level, ev.PEER_CONNECTED, address=self.address, pid=pid)
            async with anyio.create_task_group() as tg:
                connection.tg = tg
                tg.start_soon(connection.writer)
                try:
                    while await connection.room():
                        await connection.dispatch(await wire.receive(reader))
                except _ENDED:
                    pass  # the process closed the connection, or died
                finally:
                    connection.lost()
                    tg.cancel_scope.cancel()
        finally:
            del self.connections[connection.serial]
            for space in connection.opened:
                if space.block is not None and space.closed.is_set():
                    self.forget(space.block.owner, space.name)

    def settings(self) -> dict[str, Any]:
        runner = self.runner
        return {
            "pid": os.getpid(),
            "budget": {name: space.budget for name, space in runner.core.spaces.items()},
            "limit": {name: space.limit for name, space in runner.core.spaces.items()},
            "idle_ttl": self.broker.idle_ttl,
            "release_timeout": runner.release_timeout,
        }

    def totals(self) -> dict[str, Any]:
        spaces = self.runner.core.spaces
        return {
            "used": {name: space.used for name, space in spaces.items()},
            "budget": {name: space.budget for name, space in spaces.items()},
            "limit": {name: space.limit for name, space in spaces.items()},
        }

    def listing(self, asking: Connection | None = None) -> dict[str, Any]:
        """What ``cachebroker ps`` shows (``asking``: the connection of ``ps`` itself, left out)."""
        runner = self.runner
        core = runner.core
        now = runner.clock()
        entries = []
        for entry in core.entries():
            found = self.owners.get(entry.owner)
            if found is None:
                continue
            connection, cache = found
            idle = entry.state is State.READY and not entry.leases
            key = entry.key
            mirror = connection.mirrors.get(key.id) if isinstance(key, _Key) else None
            entries.append(
                {
                    "pid": connection.pid,
                    "cache": cache,
                    "key": repr(entry.key),
                    "charge": dict(entry.charge),
                    "state": "waiting" if entry.state is State.WAITING else entry.state.value,
                    "leases": entry.leases,
                    "idle_seconds": round(max(0.0, now - entry.idle_since), 3) if idle else None,
                    "pinned": entry.pinned,
                    "priority": entry.priority,
                    "waiting": core.waiters(entry),
                    "loads": None if mirror is None else mirror.loads,
                }
            )
        return {
            "daemon": {"pid": os.getpid(), "address": self.address, **self.totals()},
            "processes": sorted({c.pid for c in self.connections.values() if c is not asking}),
            "entries": entries,
        }


#: The daemon's own owner of the bytes it keeps for lost connections (``Daemon.keep``).
_GONE = "(connections ended)"


async def _nothing(key: object, value: object) -> None:
    """The releaser of kept bytes: never asked (they are loading until given back)."""


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (one of another user's counts; a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    try:  # (Linux: a process that ended, not yet reaped by its parent, holds no memory)
        with open(f"/proc/{pid}/stat", "rb") as file:
            return file.read().rpartition(b")")[2].split()[:1] != [b"Z"]
    except OSError:
        return True


def _private(path: str, flags: int) -> int:
    return os.open(path, flags, 0o600)


def backoff(failures: int) -> float:
    """Seconds to wait after ``failures`` failures of ``accept()`` in a row."""
    first, longest = ACCEPT_BACKOFF
    return min(longest, first * 2.0 ** min(failures - 1, 64))


class _Awaiting:
    """The connections awaiting their hello, oldest first: at most ``limit`` of them.

    One more closes the oldest. A flood of connections that never speak then
    ages out as fast as it comes, while a process, which says hello as it
    connects, is read long before it is the oldest; refusing new connections
    instead would lock every process out for as long as a flood lasts.
    """

    __slots__ = ("limit", "scopes")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.scopes: dict[anyio.CancelScope, None] = {}

    @contextlib.contextmanager
    def hello(self) -> Iterator[anyio.CancelScope]:
        """A scope around the wait for one connection's hello, cancelled if it becomes too old."""
        while len(self.scopes) >= self.limit:
            oldest = next(iter(self.scopes))
            del self.scopes[oldest]
            oldest.cancel()
        scope = anyio.CancelScope()
        self.scopes[scope] = None
        try:
            with scope:
                yield scope
        finally:
            self.scopes.pop(scope, None)


def _leaves(group: BaseExceptionGroup[Exception]) -> Iterator[Exception]:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from _leaves(exc)
        else:
            yield exc


def _why(exc: Exception) -> str:
    """What a connection's failure says in ``peer.failed``: the protocol's words, or a repr."""
    return str(exc) if isinstance(exc, ProtocolError) else repr(exc)


# ---------------------------------------------------------------- the socket


async def _listen(address: str) -> anyio.abc.SocketListener:
    """A Unix-socket listener at ``address``, mode 0600, replacing a stale socket.

    Refuses to start when a daemon already answers there, or when the
    directory is writable by other users (they could replace the socket).
    """
    directory = os.path.dirname(os.path.abspath(address))  # noqa: ASYNC240 - once, at start
    info = os.stat(directory)
    if info.st_mode & 0o022 and not info.st_mode & 0o1000:
        raise InvalidArgument(
            f"the socket's directory {directory} is writable by other users: "
            "choose a directory only you can write (--socket)"
        )
    if os.path.lexists(address):  # noqa: ASYNC240
        found = os.lstat(address)
        if not stat.S_ISSOCK(found.st_mode):
            raise InvalidArgument(
                f"{address} exists and is not a socket: remove it or choose another path (--socket)"
            )
        if found.st_uid != os.getuid():
            raise InvalidArgument(
                f"{address} belongs to user {found.st_uid}: another user's socket is in the way; "
                "remove it or choose another path (--socket)"
            )
        try:
            stream = await connect(address)
        except OSError:
            os.unlink(address)  # a stale socket: its daemon is gone
        else:
            await stream.aclose()
            raise InvalidArgument(f"a broker already serves {address}")
    return await listen(address)


def _unlink(address: str, inode: int) -> None:
    """Remove the socket file, unless another daemon has replaced it since."""
    with contextlib.suppress(FileNotFoundError):
        if os.stat(address).st_ino == inode:
            os.unlink(address)


async def _refuse(stream: anyio.abc.SocketStream, why: str) -> None:
    with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
        await wire.send(stream, {"op": "error", "message": why})
