"""``Seam``: how books shared with another process plug into the core.

Books whose owners live in other processes (the daemon's), and books whose
budget is held by another process (a connected process's), run the same
``Core`` as a broker alone. What differs is what they must tell the other
side, and two questions the core asks it. The core holds one ``Seam`` (or
none, in a broker alone: then nothing is announced and nothing asked), and
calls it at the points below; a seam never changes the books itself, it
answers, and the core acts on the answer.

Announcements, each after the books changed:

- ``changed``: the other side's view of the entry may have to change (its
  pin, priority or idle TTL changed, its release passed its timeout and
  then raised, it was written off...); what changed is worked out when the
  next report is sent.
- ``leased`` / ``ended``: the entry took a lease, or its last lease ended.
  ``leased`` answers too: whether the entry's leases kept overlapping while
  the other side wanted it, so that it is drained now.
- ``loaded``: a load ended, the entry charged as measured.
- ``moved``: a move ended, the entry charged where it went (as measured).
- ``withdrawn``: every requester of a load left (the load is cancelled).
- ``releasing``: a release started, and why.
- ``quarantined`` and ``gone``: the entry left its key for good.
- ``wanted``: a waiter here has waited long for bytes held by the leases of
  the entry. In-process, the entry is drained (released when its last lease
  ends); the answer ``True`` says the other side was told instead (the
  daemon asks the entry's process, which sees every lease).

Questions:

- ``lets_go(entry)``, asked when a release the other side asked for is
  refused (the entry is leased or pinned): whether it goes when its last
  lease ends anyway, because it was offered idle meanwhile.
"""

from __future__ import annotations

from typing import Protocol

from ._model import Entry, Reason

__all__ = ["Seam"]


class Seam(Protocol):
    """What the core announces to another process's side of the books, and asks it."""

    def changed(self, entry: Entry) -> None: ...

    def leased(self, entry: Entry) -> bool:
        """A lease on ``entry`` began: whether its leases kept overlapping so long
        that it drains (new requests load afresh; it goes once its last lease ends)."""

    def ended(self, entry: Entry) -> None: ...

    def loaded(self, entry: Entry) -> None: ...

    def moved(self, entry: Entry) -> None: ...

    def withdrawn(self, entry: Entry) -> None: ...

    def releasing(self, entry: Entry, reason: Reason) -> None: ...

    def quarantined(self, entry: Entry) -> None: ...

    def gone(self, entry: Entry) -> None: ...

    def wanted(self, entry: Entry) -> bool: ...

    def lets_go(self, entry: Entry) -> bool: ...
