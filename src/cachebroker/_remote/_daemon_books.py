"""The daemon's own broker: its books plugged into the processes (``DaemonSeam``), and its
releases, which end in the processes (``DaemonReleases``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from .._core import Core, Entry, Reason
from .._errors import ReleaseFailed
from .._shell._broker import Broker
from .._shell._config import positive_seconds
from .._shell._seam import FailedThere, Local, Refused

__all__ = ["DaemonBroker", "DaemonReleases", "DaemonSeam", "pin", "plug_daemon"]


class Peer(Protocol):
    """A connected process, as the daemon's releases name it (``_connection.Connection``)."""

    pid: int


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
        self.owners: Mapping[Any, tuple[Peer, str]] = {}

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

    def leased(self, entry: Entry) -> bool:
        return False  # (the entry's process drains it: it sees every lease)

    def loaded(self, entry: Entry) -> None:
        pass

    def moved(self, entry: Entry) -> None:
        pass  # (its process reported the move's outcome: ``Connection._move``)

    def withdrawn(self, entry: Entry) -> None:
        pass

    def releasing(self, entry: Entry, reason: Reason) -> None:
        pass

    def quarantined(self, entry: Entry) -> None:
        pass

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
