"""An owner in another process is gone, and its memory with it (``Core.drop_owner``).

Its entries leave the books at once, whatever state each is in: the
requests for them fail, the bytes they held come back. For books whose
owners live in other processes (the daemon of ``cachebroker serve``).
"""

from __future__ import annotations

from .._errors import BrokerClosed
from . import _transitions
from ._model import Owner, State
from ._state import Books
from ._tiers import freed, reserved

__all__ = ["drop_owner"]


def drop_owner(books: Books, owner: Owner) -> None:
    """The state changes of ``Core.drop_owner`` (its docstring says what they are)."""
    owner.closing = True
    lost = BrokerClosed(f"cache {owner.name!r} is gone: the process that opened it ended")
    mine = [
        *owner.live,
        *(entry for entry in books.orphans if entry.owner is owner),
        *(entry for entry in books.quarantined if entry.owner is owner),
    ]
    for entry in mine:
        state = entry.state
        if state is State.WAITING:
            _transitions.fail_joiners(books, entry, lost)
            _transitions.drop_waiting(books, entry)
            continue
        if state is State.QUARANTINED:  # (gone from its key and owner already)
            _transitions.unquarantine(books, entry)
            entry.state = State.GONE
            continue
        if state is State.LOADING:
            _transitions.fail_joiners(books, entry, lost)
            entry.nested = []
            _transitions.open_gate(books, entry)
        elif state is State.READY:
            if entry.idle_seq:
                _transitions.unidle(books, entry)
            books.settling.pop(entry, None)
            books.busy.pop(entry, None)
            entry.leases = 0
            entry.holders = []
            entry.bound = []
        elif state is State.RELEASING:
            for name, amount in entry.charge.items():
                books.spaces[name].releasing -= amount
            _transitions.unorphan(books, entry)
        elif state is State.DEMOTED:
            _transitions.fail_joiners(books, entry, lost)
            if entry in books.queue:
                _transitions.dequeue(books, entry)
            _transitions.leave_idle(books, entry)
        elif state is State.MOVING:
            _transitions.fail_joiners(books, entry, lost)
            for name, amount in freed(entry).items():
                books.spaces[name].releasing -= amount
            if entry in books.demoting:
                del books.demoting[entry]
            else:
                for name, amount in reserved(entry).items():
                    books.spaces[name].used -= amount
            entry.target = None
        entry.value = None
        _transitions.discharge(books, entry)
        _transitions.detach(books, entry)
        _transitions.gone(books, entry)
    _transitions.check_empty(books, owner)
