"""A broker in a client process, backed by the machine's shared one (``Broker.connect``).

The client runs the ordinary shell (``Runner``, ``Cache``, ``Lease``) over
books of its own (``client_books``) whose spaces never run short: they keep
this process's leases, loads and releases, and admit at once. What they
admit waits for the daemon (``Link.admit``) before its loader runs, so a
process never loads before the daemon granted its bytes. Every change of an
entry that the daemon must know (it became leased or idle, released,
quarantined, gone) is marked by the books and reported in the next batch the
writer sends (``Link.collect``): a hit costs no round trip, and a hit and
its release within one batch cost no message at all.

A release the daemon asks for (``Link.give_up``) starts only on an idle
entry; one that this process leased again meanwhile is refused, by the
``held`` report the lease produced.
"""

from __future__ import annotations

import itertools
import math
import os
import socket
from collections.abc import Awaitable, Callable, Hashable, Mapping
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import attrs

from .. import _log_events as ev
from .._core import Entry, Reason, Request, State
from .._errors import BrokerClosed, DeadlockError, InvalidArgument
from .._shell._seam import Freed
from .._shell._steps import Steps
from . import _protocol as wire
from ._client_books import ClientSeam
from ._protocol import ProtocolError
from ._questions import Questions
from ._sockets import Frames, Outlet, connect

__all__ = ["Link", "Reconnect"]

#: Seconds to connect and be welcomed, to be told the daemon's totals, and to
#: send what is left when the broker closes.
CONNECT_TIMEOUT = 10.0
TOTALS_TIMEOUT = 5.0
FINISH_TIMEOUT = 5.0

#: The longest key text sent (``repr(key)``, for ``cachebroker ps`` and errors).
KEY_TEXT = 200

_LOST = (
    anyio.EndOfStream,
    anyio.IncompleteRead,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    OSError,
    ProtocolError,
)


#: Reports of an entry on its way out, which say why (``reason``).
_LETTING_GO = frozenset({"releasing", "overdue", "quarantined", "gone"})

#: Reports that carry no changed priority: a loading entry's waits for the load's
#: outcome (a report of "loading" is no report), one on its way out needs none.
_QUIET_PRIORITY = _LETTING_GO | {"loading"}

#: Reports of an entry on its way out whose bytes this process may still hold.
_HOLDING_BYTES = frozenset({"releasing", "overdue", "quarantined"})


def _report(entry: Entry, overdue: bool = False) -> str:
    """What the daemon is to know of ``entry`` now (``overdue``: in ``Core.overdue``)."""
    state = entry.state
    if state is State.READY:
        return "pinned" if entry.pinned else "held" if entry.leases else "idle"
    if state is State.LOADING or state is State.WAITING:
        return "loading"
    if state is State.QUARANTINED and overdue:
        return "overdue"  # (its release runs on past its timeout: the bytes may come back)
    return str(state.value)  # releasing, quarantined, gone


def _opening(cache: str, moves: bool) -> dict[str, Any]:
    """The ``open`` message of ``cache`` (``moves``: its releaser moves values between tiers)."""
    message: dict[str, Any] = {"op": "open", "cache": cache}
    if moves:
        message["moves"] = True
    return message


def _key_text(key: Hashable) -> str:
    try:
        text = repr(key)
    except Exception:
        text = f"<{type(key).__name__}>"
    return text if len(text) <= KEY_TEXT else text[: KEY_TEXT - 3] + "..."


class _Admission:
    """A load waiting for the daemon's grant: its ``acquire``, sent again after a restart."""

    __slots__ = ("called_off", "error", "event", "message", "space")

    def __init__(self, message: dict[str, Any]) -> None:
        self.event = anyio.Event()
        self.error: BaseException | None = None
        #: A promotion nobody waited for any more (``Link._call_off``).
        self.called_off = False
        self.message = message
        #: Where the daemon placed it (``spaces=``), with its grant.
        self.space: str | None = None


@attrs.frozen
class Reconnect:
    """How a connected broker comes back after its daemon's restart (``Broker.connect``).

    Attributes:
        enabled: Whether it connects again at all (``reconnect=``).
        delay: Seconds before the first try; each failed try doubles it...
        max_delay: ... up to this.
        timeout: Seconds without a daemon after which it gives up (``None``: never).
    """

    enabled: bool = True
    delay: float = 0.05
    max_delay: float = 1.0
    timeout: float | None = None


class Link:
    """The connection to the daemon, and what this process has told it."""

    def __init__(
        self,
        address: str,
        runner: Steps,
        opened: Mapping[str, bool],
        reconnect: Reconnect | None = None,
    ) -> None:
        self.address = address
        #: The runner it steps, seen as its parts see it.
        self.runner = runner
        #: The caches open in this process, in the order they were opened.
        self.opened = opened
        self.reconnect = Reconnect() if reconnect is None else reconnect
        #: False while the daemon is away and this process tries to connect again.
        self.online = True
        #: Whether ``run`` serves the connection (once it ended, nothing more is sent).
        self.running = False
        #: Names this broker to the daemon across reconnections: the bytes a daemon
        #: kept for it after a lost connection are given back once it registered again.
        self.session = os.urandom(8).hex()
        self.stream: anyio.abc.SocketStream | None = None
        self.rx: Frames | None = None
        #: Writes the batches of the connection being served (``_serve``).
        self.outlet: Outlet | None = None
        self._ids = itertools.count(1)
        #: Entries the daemon knows (from their ``acquire`` on), by number and back.
        self.ids: dict[Entry, int] = {}
        self.by_id: dict[int, Entry] = {}
        #: What the daemon was last told of each entry (``None``: not granted yet).
        self.told: dict[Entry, str | None] = {}
        #: The eviction priority the daemon was last told of each entry it knows:
        #: a later ``acquire(priority=)`` is reported with the entry's state.
        self.priorities: dict[Entry, int] = {}
        self.admitting: dict[int, _Admission] = {}
        #: The entries whose load waits for the daemon's grant (``LinkAdmission.admitting``).
        self.awaiting: dict[Entry, None] = {}
        #: What this process asked the daemon and awaits the answer to (why, free).
        self.questions = Questions(self.post)
        #: Entries whose release the daemon asked for, and not yet told "releasing"
        #: (it need not be: the daemon waits for "gone" or "quarantined").
        self.asked: dict[Entry, bool] = {}
        self.outbox: list[dict[str, Any]] = []
        #: The error every operation that needs the daemon raises once it is gone.
        self.error: BrokerClosed | None = None
        self.closing = False
        self.totals: dict[str, Any] | None = None
        #: Set (and renewed) at each ``totals`` answer; the answers asked for and
        #: had, in order, so that concurrent ``stats()`` each wait for their own.
        self._totals_wait: anyio.Event | None = None
        self._totals_asked = self._totals_had = 0
        #: This process's side of the books (``client_books``): what it marks is reported.
        self.seam = ClientSeam(self._wake_writer, self.withdraw, self.offer)

    # ------------------------------------------------------------ life cycle

    async def open(self) -> dict[str, Any]:
        """Connect and be welcomed; ``BrokerClosed`` naming the address if nobody answers."""
        address = self.address
        if not hasattr(socket, "AF_UNIX"):
            raise BrokerClosed(
                "Broker.connect() needs Unix-domain sockets (Linux, macOS): "
                "this platform is not supported yet"
            )
        try:
            with anyio.fail_after(CONNECT_TIMEOUT):
                stream = await connect(address)
                try:
                    uid, _pid = wire.peer(stream)
                    if uid is not None and uid != os.getuid():
                        raise BrokerClosed(
                            f"the socket at {address} is served by user {uid}, not by you "
                            f"(user {os.getuid()}): refusing to use it"
                        )
                    self.rx, welcome = await wire.greet(stream, self.session)
                except BaseException:
                    await anyio.aclose_forcefully(stream)
                    raise
        except (OSError, TimeoutError) as exc:
            raise BrokerClosed(
                f"no broker answers at {address} ({exc}); start one with "
                "'cachebroker serve' or give Broker.connect() its socket"
            ) from None
        except _LOST as exc:
            raise BrokerClosed(f"the broker at {address} closed the connection ({exc!r})") from None
        if welcome["op"] != "welcome":
            await anyio.aclose_forcefully(stream)
            raise BrokerClosed(
                f"the broker at {address} refused this process: {welcome.get('message')}"
            )
        self.stream = stream
        return welcome

    async def finish(self) -> None:
        """Send what is left, then close the connection (the daemon forgets this process)."""
        self.closing = True
        outlet = self.outlet
        if self.error is None and self.online and self.running and outlet is not None:
            self.collect()
            outlet.soon()
            with anyio.move_on_after(FINISH_TIMEOUT):
                await outlet.drain()
        if self.stream is not None:
            await anyio.aclose_forcefully(self.stream)

    def lost(self, exc: BaseException) -> None:
        """The connection ended: fail what waits for the daemon, and all that will."""
        if self.error is not None:
            return
        self.error = BrokerClosed(
            f"the broker at {self.address} is gone ({exc!r:.200}); leases held go on "
            "working; connect again with Broker.connect()"
        )
        if not self.closing:
            self.runner.emit("error", ev.BROKER_LOST, address=self.address, error=repr(exc))
        for admission in self.admitting.values():
            admission.error = self.error
            admission.event.set()
        self.questions.unanswered()
        if self._totals_wait is not None:
            self._totals_wait.set()

    # --------------------------------------------------------------- sending

    def mark(self, entry: Entry) -> None:
        """The books changed ``entry``: report it in the next batch (``ClientSeam``)."""
        self.seam.mark(entry)

    def offer(self, entry: Entry) -> None:
        """Report ``entry`` idle now, whatever the next batch would say (``ClientSeam.want``)."""
        self.seam.dirty[entry] = None
        self.collect()
        self._wake_writer()

    def post(self, message: dict[str, Any]) -> None:
        """Queue ``message`` after every change marked before it."""
        self.collect()
        self.outbox.append(message)
        self._wake_writer()

    def _wake_writer(self) -> None:
        if self.outlet is not None:
            self.outlet.soon()

    def _batch(self) -> list[dict[str, Any]]:
        """The next write (``Outlet``): the reports of what changed, then the messages posted."""
        self.seam.waking = False  # (a mark from here on asks for the next batch)
        if self.error is not None:
            return []
        self.collect()
        batch, self.outbox = self.outbox, []
        return batch

    def collect(self) -> None:
        """Turn the entries marked since the last batch into reports of what changed."""
        seam = self.seam
        dirty = seam.dirty
        if not dirty:
            return
        seam.dirty = {}
        core = self.runner.core
        for entry in dirty:
            told = self.told.get(entry)
            if told is None:
                continue  # not granted yet: nothing the daemon needs
            now = _report(entry, entry in core.overdue)
            moved = seam.moves.pop(entry, None) if seam.moves else None
            touched = seam.untouch(entry)
            if now == "moving":
                # (the daemon asked for the move: "moved" says how it ended; one that
                # ended demoted, its promotion already asked for, is demoted there)
                now = "demoted" if moved is not None and entry.home is not None else told
            # A changed priority goes with the entry's next report, or alone when
            # its state is as told; a loading one's goes with the load's outcome,
            # and one on its way out needs none (a refused release reports "held").
            priority = None if now in _QUIET_PRIORITY else self._new_priority(entry)
            if now == told:
                if priority is not None or (touched and now == "idle"):
                    # (a lease taken and ended since the last batch: its request, which
                    # the daemon's policy counts, goes with the state as last told)
                    alone = self._report_priority(entry, now, priority)
                    if touched and now == "idle":
                        alone["touched"] = True
                    self.outbox.append(alone)
                if moved is not None:
                    self.outbox.append({"op": "moved", "id": self.ids[entry], "charge": moved})
                continue
            message: dict[str, Any] = {"op": "report", "id": self.ids[entry], "state": now}
            if priority is not None:
                message["priority"] = priority
            if touched and now == "idle":
                message["touched"] = True
            if told == "loading":
                charge = seam.charges.pop(entry, None)
                if charge is None and moved is not None:
                    # A move under way when it was adopted: its outcome is the charge.
                    charge, moved = moved, None
                    if entry.home is not None and now == "demoted":
                        message["home"] = dict(entry.home)
                if charge is None and now in _HOLDING_BYTES:
                    # Abandoned while its thread still makes the value (its cache
                    # closed), or quarantined with it: the reservation is still taken.
                    charge = dict(entry.charge)
                message["charge"] = charge
                # (for ``cachebroker ps``; a daemon that does not know the field ignores it)
                message["loads"] = core.load_history.get((entry.cache, entry.key), (0, 0.0))[0]
            if now in _LETTING_GO:
                reason = seam.reasons.get(entry)
                if reason is not None:
                    message["reason"] = reason.value
                if now == "releasing" and self.asked.pop(entry, False):
                    self.told[entry] = now  # the daemon asked for it: it knows
                    continue
            if now in ("quarantined", "overdue"):
                message["error"] = f"{entry.error!s:.500}"
            if now == "gone":
                self._forget(entry)
                seam.reasons.pop(entry, None)
                self.asked.pop(entry, None)
            else:
                self.told[entry] = now
            self.outbox.append(message)
            if moved is not None and now != "gone":
                self.outbox.append({"op": "moved", "id": message["id"], "charge": moved})

    def _new_priority(self, entry: Entry) -> int | None:
        """``entry``'s priority if the daemon knows another one (it is then told it)."""
        priority = entry.priority
        if self.priorities.get(entry, priority) == priority:
            return None
        self.priorities[entry] = priority
        return priority

    def _report_priority(self, entry: Entry, state: str, priority: int | None) -> dict[str, Any]:
        """A report that changes only ``entry``'s priority: its state is as last told."""
        message: dict[str, Any] = {"op": "report", "id": self.ids[entry], "state": state}
        if priority is not None:
            message["priority"] = priority
        return message

    # ------------------------------------------------------------- receiving

    async def reader(self) -> None:
        assert self.stream is not None and self.rx is not None
        while True:
            message = await wire.receive(self.rx)
            op = message["op"]
            if op == "grant":
                admission = self.admitting.get(wire.field(message, "id", int))
                space = message.get("space")
                if space is not None and space not in self.runner.core.spaces:
                    raise ProtocolError(f"'grant' message: 'space' is {wire.shown(space)}")
                if admission is not None:
                    admission.space = space
                    admission.event.set()
            elif op == "fail":
                admission = self.admitting.get(wire.field(message, "id", int))
                if admission is not None:
                    admission.error = self._refusal(message.get("error"))
                    admission.event.set()
            elif op == "release":
                self.give_up(wire.field(message, "id", int), wire.reason(message))
            elif op == "move":
                self.move(message)
            elif op == "aliases":
                self.merge(wire.decode_aliases(message, self.runner.core.spaces), message)
            elif op == "want":
                entry = self.by_id.get(wire.field(message, "id", int))
                if entry is not None:  # (else it is gone: its report is on its way)
                    self.seam.want(entry)
            elif op == "why":
                self.questions.answer_why(message)
            elif op == "freed":
                self.questions.answer_freed(message)
            elif op == "totals":
                self.totals = message
                self._totals_had += 1
                if self._totals_wait is not None:
                    self._totals_wait.set()
                    self._totals_wait = None
            elif op == "error":
                raise ProtocolError(f"the broker said: {message.get('message')}")
            else:
                raise ProtocolError(f"unknown op {op!r}")

    async def run(self) -> None:
        """Serve the connection; when it ends, connect again (``Reconnect``) and register.

        Until this process is registered with a daemon again, requests that
        need one wait (each within its own timeout); leases and hits go on.
        """
        self.running = True
        try:
            while True:
                ended = await self._serve()
                if self.closing or not self.reconnect.enabled or self.error is not None:
                    self.lost(ended)
                    return
                if not await self._come_back(ended):
                    return
        finally:
            self.running = False

    async def _serve(self) -> BaseException:
        """Read and write until the connection ends; what ended it.

        Whichever of the reader and the writer ends first stops the other
        (a receive cancelled in ``_sockets``' streams leaves nothing behind).
        """
        stream = self.stream
        assert stream is not None
        ended: list[BaseException] = []
        outlet = self.outlet = Outlet(stream, self._batch, wire.encode, self.runner.at_step_end)
        self.seam.waking = False  # (asked of the writer before, if at all)
        if self.outbox or self.seam.dirty:
            self.seam.waking = True
            outlet.soon()
        async with anyio.create_task_group() as tg:

            async def write() -> None:
                try:
                    await outlet.run()
                except Exception as exc:  # (the connection's end, never the application's)
                    ended.append(exc)
                    tg.cancel_scope.cancel()

            tg.start_soon(write)
            try:
                await self.reader()
            except Exception as exc:
                ended.insert(0, exc)
            tg.cancel_scope.cancel()
        await anyio.aclose_forcefully(stream)
        return ended[0] if ended else anyio.EndOfStream()

    async def _come_back(self, cause: BaseException) -> bool:
        """Connect again with backoff and register; ``False`` once it gives up (``lost``)."""
        settings = self.reconnect
        runner = self.runner
        self.online = False
        self.outbox, self.seam.dirty = [], {}  # (what the next daemon hears is ``register``'s)
        if self._totals_wait is not None:
            self._totals_wait.set()
        self.questions.unanswered()
        runner.emit("warning", ev.PEER_RECONNECTING, address=self.address, error=repr(cause))
        started = anyio.current_time()
        delay = settings.delay
        attempts = 0
        while True:
            left = math.inf
            if settings.timeout is not None:
                left = settings.timeout - (anyio.current_time() - started)
                if left <= 0:
                    self.lost(cause)
                    return False
            await anyio.sleep(min(delay, left))
            attempts += 1
            try:
                welcome = await self.open()
            except BrokerClosed as exc:
                cause = exc
                delay = min(delay * 2, settings.max_delay)
                continue
            if self.closing:
                return True  # (``run`` ends with the connection ``finish`` closes)
            registered = self.register(welcome)
            runner.emit(
                "info",
                ev.PEER_RECONNECTED,
                address=self.address,
                attempts=attempts,
                seconds=round(anyio.current_time() - started, 3),
                entries=registered,
            )
            return True

    def register(self, welcome: Mapping[str, Any]) -> int:
        """Tell a new daemon everything this process holds, then the requests that wait.

        Every cache open (and every closed one whose quarantined entries the
        daemon must keep charging), every entry the last daemon granted, as
        it stands now (``adopt``), and every request still waiting for a
        grant, in the order they were made; then ``registered``, after which
        the daemon may grant to others. Returns how many entries were adopted.
        """
        runner = self.runner
        core = runner.core
        seam = self.seam
        budget = wire.charge(welcome, "budget") or {}
        limit = wire.charge(welcome, "limit") or {}
        for name, space in core.spaces.items():
            space.budget = budget.get(name, space.budget)
            space.limit = limit.get(name, space.limit)
        messages: list[dict[str, Any]] = []
        open_caches = list(self.opened)
        messages.extend(_opening(name, moves) for name, moves in self.opened.items())
        self.merge(wire.decode_aliases(welcome, core.spaces), {})
        if core.canon:  # (what the daemon before learned: this one is told it again)
            messages.append({"op": "aliases", "aliases": wire.encode_aliases(core.canon)})
        closed: dict[str, None] = {}
        adopted = 0
        for entry, id in sorted(self.ids.items(), key=lambda item: item[1]):
            told = self.told.get(entry)
            if told is None:
                continue  # waiting for a grant: asked for again below
            if entry.state is State.GONE:
                self._forget(entry)
                continue
            cache = entry.owner.name
            if cache not in open_caches and cache not in closed:
                closed[cache] = None
                messages.append({"op": "open", "cache": cache})
            now = _report(entry, entry in core.overdue)
            charge = dict(entry.charge)
            home = entry.home
            if entry.state is State.MOVING and entry in self.awaiting:
                now = "demoted"  # (its promotion waits for room: asked again below)
            elif entry.state is State.MOVING:
                # Under way: charged in both spaces until it ends; its outcome is
                # what the new daemon hears, as of a load (``collect``).
                now, home = "loading", None
                for name, amount in (entry.target or {}).items():
                    charge[name] = max(charge.get(name, 0), amount)
            message: dict[str, Any] = {
                "op": "adopt",
                "id": id,
                "cache": cache,
                "key": _key_text(entry.key),
                "state": now,
                "charge": charge,
                "priority": entry.priority,  # (as it is now: a later acquire's, if any)
                "loads": core.load_history.get((entry.cache, entry.key), (0, 0.0))[0],
            }
            if now == "demoted" and home is not None:
                message["home"] = dict(home)
            seam.charges.pop(entry, None)
            seam.moves.pop(entry, None)
            reason = seam.reasons.get(entry)
            if now in _LETTING_GO and reason is not None:
                message["reason"] = reason.value
            if now in ("quarantined", "overdue"):
                message["error"] = f"{entry.error!s:.500}"
            self.told[entry] = now
            self.priorities[entry] = entry.priority
            messages.append(message)
            adopted += 1
        self.asked.clear()
        for id in sorted(self.admitting):
            if id in self.by_id:  # (not withdrawn meanwhile)
                messages.append(self.admitting[id].message)
        messages.extend({"op": "close", "cache": cache} for cache in closed)
        messages.append({"op": "registered"})
        self.outbox = messages
        self.seam.dirty = {}
        self.online = True
        self._wake_writer()
        return adopted

    def _refusal(self, fields: Any) -> BaseException:
        """The error a ``fail`` stands for; a deadlock names this process's leases by key."""
        error = wire.decode_error(fields, self.address)
        if isinstance(error, DeadlockError) and isinstance(fields, dict):
            ids = fields.get("leases")
            ids = ids if isinstance(ids, list) else []
            entries = [self.by_id.get(id) for id in ids if type(id) is int]
            error.leases = tuple((e.owner.name, e.key) for e in entries if e is not None)
        return error

    def give_up(self, id: int, reason: Reason = Reason.CAPACITY) -> None:
        """The daemon asks for entry ``id``'s release: start it, unless the entry is in use."""
        entry = self.by_id.get(id)
        if entry is None:
            self.post({"op": "report", "id": id, "state": "gone"})
            return
        self.questions.releasing(id, (entry.owner.name, entry.key))
        runner = self.runner
        if runner.core.give_up(entry, reason):
            if entry.state is State.RELEASING and self.told.get(entry) != "releasing":
                self.asked[entry] = True
            runner.apply()
        elif entry.state is State.READY and self.told.get(entry) == "idle":
            # Refused: leased (or pinned) now, though the daemon last heard it idle. Said
            # at once: the lease may end before the next batch, whose report would then
            # say "idle" again, or nothing, and the daemon would wait for ever.
            self.collect()
            now = _report(entry)
            self.told[entry] = now
            self.outbox.append({"op": "report", "id": id, "state": now})
        # The answer is the entry's next report: releasing then gone, or held (refused).
        self.mark(entry)

    def merge(self, pairs: list[tuple[str, str]], message: Mapping[str, Any]) -> None:
        """The daemon learned (or was told) that spaces are one memory: so are they here.

        Logged as in-process (``cachebroker.alias.learned``), naming the load
        whose evidence tipped it, in whichever process it ran.
        """
        core = self.runner.core
        canon = core.canon
        for keep, other in pairs:
            if canon.get(keep, keep) == canon.get(other, other):
                continue
            try:
                core.merge_spaces(keep, other)
            except InvalidArgument:  # (these books have no tiers: never a circle)
                continue
            self.runner.emit(
                "warning",
                ev.ALIAS_LEARNED,
                spaces=[keep, other],
                evidence=message.get("evidence"),
                cache=message.get("cache", f"?@{message.get('pid', '?')}"),
                key=message.get("key"),
            )
        self.runner.apply()

    def move(self, message: dict[str, Any]) -> None:
        """The daemon moves entry ``id`` between tiers, to be charged as ``charge``.

        The grant of a promotion this process asked for (``promote``), or a
        demotion the daemon decided: started now if the entry is idle here,
        else refused (``moved`` with ``refused``; the entry's report says why).
        """
        id = wire.field(message, "id", int)
        to = wire.field(message, "to", str)
        target = wire.charge(message, "charge")
        spaces = self.runner.core.spaces
        if to not in spaces or not target or any(name not in spaces for name in target):
            raise ProtocolError(f"'move' message: to {wire.shown(to)}, charge {target!r}")
        entry = self.by_id.get(id)
        admission = self.admitting.get(id)
        up = bool(message.get("up"))
        if up and entry is not None and admission is not None and entry.state is State.MOVING:
            admission.space = to  # (the room this process's promotion waits for)
            admission.event.set()
            return
        core = self.runner.core
        if entry is None or not core.give_up(entry, Reason.CAPACITY, to=target):
            if entry is not None:
                self.mark(entry)
            self.post({"op": "moved", "id": id, "refused": True})
            return
        self.runner.apply()

    async def promote(self, entry: Entry) -> BaseException | None:
        """Ask the daemon for room to bring demoted ``entry`` back up; wait for its ``move``.

        The error that refused it, if any (its requesters get it, and the
        value stays a tier down).
        """
        id = self.ids.get(entry)
        if id is None or self.error is not None:
            await anyio.lowlevel.checkpoint_if_cancelled()
            return BrokerClosed(str(self.error) if self.error else "the entry is gone")
        while True:
            first = entry.joiners[0] if entry.joiners else None
            message: dict[str, Any] = {
                "op": "promote",
                "id": id,
                "holding": self._holding(None if first is None else first.task),
            }
            admission = self.admitting[id] = _Admission(message)
            self.awaiting[entry] = None
            if self.online:
                self.post(message)
            try:
                await admission.event.wait()
            except BaseException:
                self._call_off(entry)
                raise
            finally:
                self.admitting.pop(id, None)
                self.awaiting.pop(entry, None)
            # Called off, then asked for again before this task ran: asked anew.
            if not (admission.called_off and entry.joiners and self.error is None):
                break
        if admission.error is not None:
            return admission.error
        if entry.owner.closing:  # (granted as its cache closed: released from where it is)
            self.post({"op": "moved", "id": id, "refused": True})
            return BrokerClosed(f"cache {entry.owner.name!r} is closed")
        if admission.space is not None:  # (the daemon may bring it back elsewhere)
            self.runner.core.place(entry, admission.space)
        return None

    def _call_off(self, entry: Entry) -> None:
        """Nobody here waits for ``entry``'s promotion any more: the daemon need not bring
        it up (``cancel``); a ``move`` already on its way is made all the same."""
        id = self.ids.get(entry)
        admission = None if id is None else self.admitting.get(id)
        if admission is None or admission.event.is_set():
            return
        admission.error = BrokerClosed("nobody waits for the move up any more")
        admission.called_off = True
        admission.event.set()
        if self.error is None and self.online:
            self.post({"op": "cancel", "id": id, "promote": True})

    def _holding(self, task: object) -> list[int]:
        """The ids of the entries ``task`` leases (the daemon refuses a request that only
        those leases could make room for: ``DeadlockError``, as in-process)."""
        if task is None:
            return []
        return [
            self.ids[held]
            for held in self.runner.core.busy
            if held.leases and task in held.holders and held in self.ids
        ]

    # ------------------------------------------------------------- requests

    def request(self, entry: Entry) -> None:
        """Ask the daemon for ``entry``'s bytes, which these books just granted.

        Sent as the books grant, so that requests reach the daemon in the
        order this process made them, whatever order the load tasks start in.
        """
        if self.error is not None:
            return
        id = next(self._ids)
        self.ids[entry] = id
        self.by_id[id] = entry
        self.told[entry] = None
        self.awaiting[entry] = None
        core = self.runner.core
        unknown = entry.unknown
        first = entry.joiners[0] if entry.joiners else None
        holding = self._holding(first.task if first is not None else None)
        # The request as these books grant it: its size (``None``: measured after the
        # load), its declared cost (finite: Cache.acquire checked it), and its
        # priority, by which the shared broker evicts too: as it is when requested,
        # and as later acquires change it (reported with its state: ``collect``).
        places = entry.places
        need = None if unknown else dict(entry.need)
        if places is not None and need is not None:  # the daemon chooses (``place``)
            need = {places[0]: sum(need.values())}
        request = Request(
            entry.key, need, cost=entry.declared_cost, priority=entry.priority, places=places
        )
        message = {
            "op": "acquire",
            "id": id,
            "cache": entry.owner.name,
            "key": _key_text(entry.key),
            **wire.encode_request(request),
            # A load of unknown size let past these books' gate (from inside a
            # loader, or by a task holding a lease) must pass the daemon's too.
            "urgent": unknown and entry is not core.gate.turn,
            "holding": holding,
            # The loads this request is made from (their loaders wait for it): the
            # daemon refuses it if only their reservations could make room.
            "loading": [self.ids[e] for e in (first.loading if first else ()) if e in self.ids],
        }
        if not entry.requests:  # made by a prefetch: no request for the policy there either
            message["prefetch"] = True
        if entry.shell.from_release:  # refused there rather than made to wait, as here
            message["releasing"] = True
        self.priorities[entry] = entry.priority
        self.admitting[id] = _Admission(message)
        if self.online:
            self.post(message)

    async def admit(self, entry: Entry) -> BaseException | None:
        """Wait for the daemon's grant of ``entry`` (``request``); the error that refused it."""
        id = self.ids.get(entry)
        admission = None if id is None else self.admitting.get(id)
        if id is None or admission is None:  # withdrawn already, or the daemon is gone
            await anyio.lowlevel.checkpoint_if_cancelled()
            return BrokerClosed(str(self.error) if self.error else "the request was withdrawn")
        try:
            await admission.event.wait()
        except BaseException:
            self.withdraw(entry)
            raise
        finally:
            del self.admitting[id]
            self.awaiting.pop(entry, None)
        if admission.error is not None:
            self._forget(entry)
            return admission.error
        if self.ids.get(entry) != id:  # granted, but withdrawn before this task ran
            await anyio.lowlevel.checkpoint_if_cancelled()
            return BrokerClosed("the request was withdrawn")
        self.told[entry] = "loading"
        if admission.space is not None:  # the daemon chose among its places
            self.runner.core.place(entry, admission.space)
        return None

    def withdraw(self, entry: Entry) -> None:
        """Nobody here waits for ``entry``'s grant any more: tell the daemon (``cancel``)."""
        id = self.ids.get(entry)
        if entry.state is State.MOVING:  # (a promotion's requesters all left)
            self._call_off(entry)
            return
        if id is None or self.told.get(entry) is not None:
            return  # unknown to the daemon, or granted: its report says what became of it
        self._forget(entry)
        if self.error is None and self.online:
            self.post({"op": "cancel", "id": id})

    def _forget(self, entry: Entry) -> None:
        self.awaiting.pop(entry, None)
        id = self.ids.pop(entry, None)
        self.by_id.pop(id, None)  # type: ignore[arg-type]
        self.told.pop(entry, None)
        self.priorities.pop(entry, None)

    async def free(self, entry: Entry) -> Freed | None:
        """Have the daemon free the next victims for ``entry``'s load, which ran out of
        memory: idle entries of any process, in its policy's order. What it freed,
        once their releases ended; ``None`` when the daemon cannot answer (gone, or
        reconnecting): these books free their own instead."""
        id = self.ids.get(entry)
        if id is None or self.error is not None or not self.online:
            return None
        return await self.questions.free(id)

    def ask_why(self, entry: Entry) -> Callable[[], Awaitable[str | None]]:
        """Ask the daemon why ``entry``'s request has no room yet; what awaits its answer."""
        return self.questions.ask_why(self.ids[entry])

    async def fetch_totals(self) -> dict[str, Any] | None:
        """The daemon's books per space now (``Stats.broker_used``); ``None`` when it is gone
        (or the link no longer runs: the broker closed)."""
        if self.error is not None or not self.online or not self.running:
            return None
        self._totals_asked += 1
        mine = self._totals_asked
        self.post({"op": "totals"})
        with anyio.move_on_after(TOTALS_TIMEOUT):
            while self._totals_had < mine and self.error is None and self.online:
                if self._totals_wait is None:
                    self._totals_wait = anyio.Event()
                await self._totals_wait.wait()
        return self.totals
