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
import sys
from collections.abc import Iterator
from typing import Any

import anyio
import anyio.abc

from .. import _log_events as ev
from .._core import Entry, State
from .._errors import InvalidArgument, LeasesOutstanding, LoadFailed
from .._shell._actor import Block
from . import _protocol as wire
from ._connection import Connection
from ._daemon_books import DaemonBroker, DaemonReleases, plug_daemon
from ._mirrors import _Key, _measured
from ._protocol import ProtocolError
from ._sockets import Frames, connect, listen

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


#: Seconds to wait after ``accept()`` failed, at first and at most: the wait doubles
#: from one failure to the next, and starts again at the first once one succeeds.
ACCEPT_BACKOFF = (0.01, 1.0)

#: How ``accept()`` may fail and then succeed again: out of file descriptors, buffers
#: or memory (until connections close), or a connection aborted before it was accepted.
_TRANSIENT = frozenset(
    {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED, errno.EPROTO}
)


#: How reading from a process ends when it closed its connection, or died.
_ENDED = (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, OSError)


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
        #: Acquires waiting in a task to be asked (``Host.behind``).
        self.behind = 0
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
            functools.partial(self._hold, connection.pid, back, charge),
            _measured,
            charge,
        )
        self.runner.emit(
            "info", ev.PEER_KEPT, address=self.address, pid=connection.pid, bytes=charge
        )

    async def _hold(self, pid: int, back: anyio.Event, charge: dict[str, int]) -> object:
        """Hold a lost connection's bytes until process ``pid`` ends or registers again.

        Meanwhile ``pid`` stays in the peers file: a daemon started after this
        one waits for it too. The hold is a load that never returns: its end
        (``LoadFailed``) takes the bytes out of the books, and its cache is
        quiet (``Block.quiet``), so what is said of it is ``peer.kept`` and
        ``peer.returned``.
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
        self.runner.emit(
            "info",
            ev.PEER_RETURNED,
            address=self.address,
            pid=pid,
            bytes=charge,
            why="registered again" if back.is_set() else "ended",
        )
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
                gone = self._gone_block = await self.runner.open_block(_GONE, _nothing, quiet=True)
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
                reader = Frames(stream)
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

    async def _hello(self, reader: Frames) -> dict[str, Any] | None:
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
        reader: Frames,
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
        reader: Frames,
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
            "aliases": wire.encode_aliases(runner.core.canon),
        }

    def tell_aliases(self, **fields: Any) -> None:
        """The books merged spaces into one memory: every process merges them too
        (``fields``: what made it, for the processes' ``cachebroker.alias.learned``)."""
        message = {"op": "aliases", "aliases": wire.encode_aliases(self.runner.core.canon)}
        cache = fields.get("cache")
        for connection in self.connections.values():
            if cache is not None:  # (a process's own cache by its own name)
                fields["cache"] = connection.names().get(cache, cache)
            connection.post({**message, **fields})

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
            idle = entry.state in (State.READY, State.DEMOTED) and not entry.leases
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
                    # Tiers and placement: where a demoted entry comes back to, where a
                    # move takes it (both charged meanwhile), the spaces it may be put in.
                    "home": None if entry.home is None else dict(entry.home),
                    "moving_to": (
                        dict(entry.target)
                        if entry.state is State.MOVING and entry.target is not None
                        else None
                    ),
                    "places": None if entry.places is None else list(entry.places),
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

#: The longest path a Unix socket can be bound at (``sun_path`` holds 108 bytes, with
#: the terminating NUL on Linux; macOS's holds 104).
MAX_SOCKET_PATH = 107 if sys.platform.startswith("linux") else 103


async def _listen(address: str) -> anyio.abc.SocketListener:
    """A Unix-socket listener at ``address``, mode 0600, replacing a stale socket.

    Refuses to start when a daemon already answers there, or when the
    directory is writable by other users (they could replace the socket).
    """
    directory = os.path.dirname(os.path.abspath(address))  # noqa: ASYNC240 - once, at start
    length = len(os.fsencode(address))
    if length > MAX_SOCKET_PATH:
        raise InvalidArgument(
            f"the socket path {address} is {length} bytes; a Unix socket's path holds at most "
            f"{MAX_SOCKET_PATH}: choose a shorter one (--socket)"
        )
    try:
        info = os.stat(directory)
    except OSError as exc:
        raise InvalidArgument(
            f"the socket's directory {directory} cannot be used ({exc.strerror}): "
            "create it or choose another path (--socket)"
        ) from None
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
    try:
        return await listen(address)
    except OSError as exc:
        raise InvalidArgument(
            f"cannot listen on {address} ({exc.strerror or exc}): choose another path (--socket)"
        ) from None


def _unlink(address: str, inode: int) -> None:
    """Remove the socket file, unless another daemon has replaced it since."""
    with contextlib.suppress(FileNotFoundError):
        if os.stat(address).st_ino == inode:
            os.unlink(address)


async def _refuse(stream: anyio.abc.SocketStream, why: str) -> None:
    with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
        await wire.send(stream, {"op": "error", "message": why})
