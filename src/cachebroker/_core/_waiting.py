"""The books' two lines of waiters, each an owner with its own ``check``.

``Queue``: the entries waiting for space (and demoted ones waiting for
their promotion's room), in arrival order, with the count of those whose
requesters hold leases where they need room (they may pass blocked waiters)
and the request tick at which a blocked waiter becomes due for draining.

``Gate``: the loads of unknown size waiting for their turn, and the one
whose turn it is (``turn``): such loads run one at a time, so that together
they never overshoot the budget by more than one load's error.

Both are dicts (an entry -> ``None``, in insertion order) so that the
scheduler walks, tests and empties them as it would a dict; what else
changes with an entry's place in them goes through their methods.
"""

from __future__ import annotations

import math

from ._model import Entry, State, _shrink_if_empty

__all__ = ["Gate", "Queue"]


class Queue(dict[Entry, None]):
    """The entries queued for space, in arrival order (see the module docstring)."""

    __slots__ = ("fair_at", "holding")

    def __init__(self) -> None:
        super().__init__()
        #: How many queued entries have ``holding`` tickets: they may pass
        #: blocked spaces (``_scheduler``), so a pass must look at them all.
        self.holding = 0
        #: The request tick at which a blocked waiter becomes due for
        #: ``_scheduler.drain`` (checked as leases end).
        self.fair_at = math.inf

    def add(self, entry: Entry, tick: int) -> None:
        """Queue ``entry`` last, at request tick ``tick``."""
        entry.queued_tick = tick
        self[entry] = None
        if entry.holding:
            self.holding += 1

    def take(self, entry: Entry) -> None:
        """Take ``entry`` out of the queue (granted, withdrawn or refused)."""
        del self[entry]
        _shrink_if_empty(self)
        if entry.holding:
            self.holding -= 1

    def held(self, entry: Entry) -> None:
        """``entry`` got its first ticket that holds (``Ticket.holds``)."""
        if entry in self:
            self.holding += 1

    def released(self, entry: Entry) -> None:
        """``entry``'s last ticket that holds left it."""
        if entry in self:
            self.holding -= 1

    def check(self) -> None:
        """Assert what the queue keeps of its entries."""
        for entry in self:
            assert entry.state in (State.WAITING, State.DEMOTED), entry
            assert not entry.gated, entry
        assert self.holding == sum(1 for entry in self if entry.holding), self.holding


class Gate(dict[Entry, None]):
    """The loads of unknown size waiting for their turn, oldest first, and ``turn``."""

    __slots__ = ("turn",)

    def __init__(self) -> None:
        super().__init__()
        #: The load of unknown size whose turn it is (queued or loading), if any.
        self.turn: Entry | None = None

    def wait(self, entry: Entry) -> None:
        """``entry`` waits for its turn."""
        entry.gated = True
        self[entry] = None

    def leave(self, entry: Entry) -> None:
        """``entry`` stops waiting for its turn (it is let through, or withdrawn)."""
        del self[entry]
        _shrink_if_empty(self)
        entry.gated = False

    def next(self, entry: Entry) -> Entry | None:
        """``entry``'s load is over: the next load whose turn it is now, if ``entry``'s turn
        it was and one waits (taken out of the line, for the caller to queue)."""
        if entry is not self.turn:
            return None
        self.turn = None
        if not self:
            return None
        following = next(iter(self))
        self.leave(following)
        self.turn = following
        return following

    def check(self) -> None:
        """Assert that the line waits only while a load of unknown size has its turn."""
        for entry in self:
            assert entry.gated and entry.state is State.WAITING and not entry.need, entry
        turn = self.turn
        if turn is not None:
            assert turn.state in (State.WAITING, State.LOADING), turn
            assert not turn.gated and turn not in self, turn
        else:
            assert not self, "loads of unknown size wait, yet none has its turn"
