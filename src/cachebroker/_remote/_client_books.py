"""The books of a process connected to a shared broker: ``client_books`` and their seam.

Their spaces never run short (the daemon's do): they keep this process's
leases, loads and releases and admit at once, and ``ClientSeam`` marks every
change of an entry that the daemon must know, for the link to report.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from .._core import FAIR_REQUESTS, UNBOUNDED, Core, Entry, Reason, State
from .._policies import make_policy

__all__ = ["ClientSeam", "client_books"]


class ClientSeam:
    """This process's side of books shared with a daemon (``Seam``): it marks every change.

    The books admit at once (``client_books``); ``mark(entry)`` is called
    whenever the daemon's view of ``entry`` may have to change, and what
    changed is worked out when the next batch is sent (``Link.collect``).
    """

    __slots__ = (
        "books",
        "charges",
        "dirty",
        "due",
        "moves",
        "offer",
        "offered",
        "reasons",
        "touched",
        "wake",
        "waking",
        "withdraw",
    )

    def __init__(
        self,
        wake: Callable[[], None],
        withdraw: Callable[[Entry], None],
        offer: Callable[[Entry], None],
    ) -> None:
        #: The entries marked since the last batch (``Link.collect`` reports them).
        self.dirty: dict[Entry, None] = {}
        #: Have the next batch sent (``Link``): called at the first mark after a batch.
        self.wake = wake
        #: Whether the next batch was asked for since the last one (``wake``).
        self.waking = False
        #: Called when every requester of a load left: the daemon must know now,
        #: before any later change of these books (not when the load task notices).
        self.withdraw = withdraw
        self.offer = offer
        #: The books this is the seam of (``client_books``): for their request clock.
        self.books: Core | None = None
        #: The measured charge of each loaded entry, until the daemon was told it.
        self.charges: dict[Entry, dict[str, int]] = {}
        #: Entries leased since the daemon was last told of them: a lease taken and
        #: ended between two batches is still a request its policy counts (``touched``).
        self.touched: dict[Entry, None] = {}
        #: The charge of each entry whose move ended, until the daemon was told it.
        self.moves: dict[Entry, dict[str, int]] = {}
        #: Why each releasing entry is released.
        self.reasons: dict[Entry, Reason] = {}
        #: Leased entries the shared broker wants (``want``), and the request
        #: clock at which they are drained if their leases keep overlapping.
        self.due: dict[Entry, int] = {}
        #: Wanted entries whose last lease ended, reported idle at once (``offer``):
        #: a release asked for now is accepted, even if leased again meanwhile.
        self.offered: dict[Entry, None] = {}

    def want(self, entry: Entry) -> None:
        """The shared broker has a request blocked by leased ``entry`` (``want``).

        In-process, that request gets the bytes at the entry's next idle
        moment, which the shared broker may never see (a lease's end and the
        next hit can fall in one batch): that moment is reported at once
        (``offered``) and a release asked for then is accepted, the entry
        going when its last lease ends. Leases that keep overlapping are
        drained after ``FAIR_REQUESTS`` requests, as in-process (``leased``).
        """
        assert self.books is not None
        if (
            entry.state is State.READY
            and entry.leases
            and not entry.pinned
            and entry.doomed is None
            and entry not in self.due
        ):
            self.due[entry] = self.books.tick + FAIR_REQUESTS

    def mark(self, entry: Entry) -> None:
        """Report ``entry`` in the next batch: the daemon's view of it may have to change."""
        self.dirty[entry] = None
        if not self.waking:
            self.waking = True
            self.wake()

    def untouch(self, entry: Entry) -> bool:
        """Whether ``entry`` was leased since the daemon was last told of it (then forgotten)."""
        if not self.touched or entry not in self.touched:
            return False
        del self.touched[entry]
        return True

    # The seam's announcements.

    def changed(self, entry: Entry) -> None:
        self.mark(entry)

    def leased(self, entry: Entry) -> bool:
        # (``mark``, inlined: this is the hit path.)
        if entry.leases == 1:
            self.touched[entry] = None
            self.dirty[entry] = None
            if not self.waking:
                self.waking = True
                self.wake()
        due = self.due
        if due and entry in due:  # (wanted: ``want``)
            assert self.books is not None
            if due[entry] <= self.books.tick:
                del due[entry]
                return True
        return False

    def ended(self, entry: Entry) -> None:
        self.dirty[entry] = None  # (``mark``, inlined: this is the hit path)
        if not self.waking:
            self.waking = True
            self.wake()
        if self.offered:
            self.offered.pop(entry, None)
        wanted = self.due and self.due.pop(entry, None) is not None
        if wanted and entry.state is State.READY:
            self.offered[entry] = None
            self.offer(entry)

    def loaded(self, entry: Entry) -> None:
        self.charges[entry] = dict(entry.charge)
        self.mark(entry)

    def moved(self, entry: Entry) -> None:
        self.moves[entry] = dict(entry.charge)
        self.mark(entry)

    def withdrawn(self, entry: Entry) -> None:
        self.withdraw(entry)

    def releasing(self, entry: Entry, reason: Reason) -> None:
        self.reasons[entry] = reason
        self._unwant(entry)
        self.mark(entry)

    def quarantined(self, entry: Entry) -> None:
        if entry not in self.reasons:
            # Quarantined with no release started: its cache closed while it was
            # leased (``abandon``) or while its thread loaded it; the report says so.
            self.reasons[entry] = entry.doomed or Reason.CLOSE
        self.mark(entry)

    def gone(self, entry: Entry) -> None:
        self.mark(entry)
        self._unwant(entry)
        if self.touched:
            self.touched.pop(entry, None)

    def _unwant(self, entry: Entry) -> None:
        if self.due:
            self.due.pop(entry, None)
        if self.offered:
            self.offered.pop(entry, None)

    # The seam's questions.

    def wanted(self, entry: Entry) -> bool:
        return False  # (drained here: this process sees every lease)

    def lets_go(self, entry: Entry) -> bool:
        if entry in self.offered:
            del self.offered[entry]
            return True
        return False


def client_books(
    budget: Mapping[str, int],
    idle_ttl: float | None,
    limit: Mapping[str, int] | None = None,
    *,
    seam: ClientSeam | None = None,
) -> Core:
    """This process's books under a shared broker: their spaces never run short.

    The daemon's books say no, not these; except to a size above a space's
    whole budget (``limit``), which fails here as in-process: before its load,
    or once measured (the value is released through its owner, never kept).
    """
    books = Core(budget, make_policy("lru"), idle_ttl=idle_ttl, retain=True)
    for space in books.spaces.values():
        space.capacity = UNBOUNDED
        space.limit = UNBOUNDED if limit is None else limit.get(space.name, UNBOUNDED)
    if seam is not None:
        seam.books = books
        books.seam = seam
    return books
