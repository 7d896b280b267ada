"""``Overdue``: the quarantined entries whose release still runs past its timeout."""

from __future__ import annotations

from collections.abc import Mapping

from ._model import Entry, Space, State

__all__ = ["Overdue"]


class Overdue:
    """The quarantined entries whose release still runs past its timeout.

    Their bytes may come back (a late return frees them), so requests may wait
    for them, within their own timeout: ``Space.overdue`` is the part of
    ``Space.quarantined`` they hold, and only the rest (``Space.stranded``)
    makes a request fail fast. An entry leaves when its release ends: it
    returned (the bytes come back), raised or was refused (they are stranded
    until ``forget()``).
    """

    __slots__ = ("entries",)

    def __init__(self) -> None:
        self.entries: dict[Entry, None] = {}

    def __contains__(self, entry: Entry) -> bool:
        return entry in self.entries

    def add(self, entry: Entry) -> None:
        """``entry`` was just quarantined by its release's timeout; the release runs on."""
        self.entries[entry] = None
        for space, amount in entry.weights:
            space.overdue += amount

    def end(self, entry: Entry) -> bool:
        """``entry``'s release ended (or it left the books); return whether it was overdue."""
        if entry not in self.entries:
            return False
        del self.entries[entry]
        if not self.entries:
            self.entries.clear()  # give the emptied table back
        for space, amount in entry.weights:
            space.overdue -= amount
        return True

    def check(self, quarantined: Mapping[Entry, object], spaces: Mapping[str, Space]) -> None:
        """Every overdue entry is ``quarantined``, and the ``overdue`` bytes of each of
        ``spaces`` (by canonical name) are theirs."""
        overdue = dict.fromkeys(spaces, 0)
        for entry in self.entries:
            assert entry.state is State.QUARANTINED and entry in quarantined, entry
            for name, amount in entry.charge.items():
                overdue[name] += amount
        for name, space in spaces.items():
            assert space.overdue == overdue[name], (name, space.overdue, overdue[name])
            assert 0 <= space.overdue <= space.quarantined, (name, space.overdue)
