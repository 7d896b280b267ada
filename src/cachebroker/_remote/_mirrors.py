"""The daemon's side of a connected process's entries: ``_Mirror`` (one entry), ``_Space``
(one cache), the keys and holders its books know them by, and how a request was made.

Plain state, owned by a ``_connection.Connection``; the connection reads the
process's messages into it and steps the books by it.
"""

from __future__ import annotations

import anyio
import attrs

from .._core import Entry, Reason, Ticket
from .._shell._actor import Block

__all__ = ["_Holder", "_How", "_Key", "_Mirror", "_Space", "_loading", "_measured"]


class _Key:
    """A process's key in the daemon's books: its number there, shown as the key's ``repr``."""

    __slots__ = ("id", "text")

    def __init__(self, id: int, text: str) -> None:
        self.id = id
        self.text = text

    def __repr__(self) -> str:
        return self.text


@attrs.frozen
class _How:
    """How a process made a request, as its ``acquire`` says (``Relay.request``)."""

    #: A load of unknown size from inside a loader, or by a lease holder: past the gate.
    urgent: bool
    #: A request, not a prefetch's (which the policy does not count).
    counted: bool
    #: Made by a release (or a move) there: refused rather than made to wait.
    releasing: bool


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
        "adopted",
        "asking",
        "cancelled",
        "charge",
        "entry",
        "error",
        "granted",
        "held",
        "holder",
        "home",
        "id",
        "key",
        "loads",
        "moved",
        "promoting",
        "reason",
        "refused",
        "reported",
        "scope",
        "settled",
        "space",
        "state",
        "ticket",
        "touched",
        "wants_back",
    )

    def __init__(self, id: int, key: _Key, space: _Space) -> None:
        self.id = id
        self.key = key
        self.space = space
        #: The process's last report: ``loading`` until its load's outcome.
        self.state = "loading"
        self.granted = False
        #: Registered again with this daemon (``adopt``): granted by the one before it.
        self.adopted = False
        self.charge: dict[str, int] | None = None
        self.reason = Reason.CAPACITY
        self.error = ""
        #: How many times the process has loaded this key (it says so with the
        #: load's outcome; ``None`` from a process that does not).
        self.loads: int | None = None
        #: Set at the next report, while a load, a release or a move waits for one.
        self.reported: anyio.Event | None = None
        #: The daemon's entry once granted and loaded, and whether (and by whom) it is leased.
        self.entry: Entry | None = None
        self.held = False
        self.holder: object = None
        self.scope: anyio.CancelScope | None = None
        #: The daemon's request for it while pending (``Connection._ask``).
        self.ticket: Ticket | None = None
        self.cancelled = False
        #: While the daemon asks for its release (``_release``): whether the process
        #: reported it held since, which refuses the request even if it is idle again.
        self.asking = False
        self.refused = False
        #: Set once the daemon's request for it is over: loaded, failed or withdrawn.
        self.settled = anyio.Event()
        #: While the daemon moves it (``_move``): how the process said the move ended,
        #: its charge where it went, or ``"refused"``.
        self.moved: dict[str, int] | str | None = None
        #: The request of the process's ``promote`` (its scope), while it waits here;
        #: and whether one was asked at all since its last move (a release asked
        #: meanwhile is refused: the process wants the value back).
        self.promoting: anyio.CancelScope | None = None
        self.wants_back = False
        #: Whether the process leased it (and ended the lease) since its last report.
        self.touched = False
        #: Where an entry the process holds demoted was loaded (``adopt``, or the
        #: outcome of a move under way when it was adopted): parked once booked.
        self.home: dict[str, int] | None = None

    async def next_report(self) -> None:
        """Wait for the process's next report of it (or for its end)."""
        if self.reported is None:
            self.reported = anyio.Event()
        await self.reported.wait()


class _Space:
    """One cache a process opened: its owner in the daemon's books."""

    __slots__ = ("block", "closed", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self.block: Block | None = None
        self.closed = anyio.Event()


def _measured(charge: object) -> object:
    """A process's entry weighs what the process measured (its load returns that)."""
    return charge


def _loading(loads: tuple[_Mirror, ...]) -> tuple[Entry, ...]:
    """The entries of ``loads`` (a request's outer loads) in these books: still loading, so
    their mirrors have no entry yet; they are found under their keys."""
    found = []
    for mirror in loads:
        block = mirror.space.block
        entry = block.owner.entries.get(mirror.key) if block is not None else None
        if entry is not None:
            found.append(entry)
    return tuple(found)
