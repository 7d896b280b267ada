"""Deadlock among lease holders: a request that would close a cycle of them is refused.

A task waiting in ``acquire`` does not end the leases it holds. Two lease
holders that each wait for room only the other's leases could make wait for
ever: task 1 holds ``a`` and waits for room that ``b`` fills, task 2 holds
``b`` and waits for room that ``a`` fills. ``_refusals.check_deadlock``
catches a task waiting on its own leases; this module catches the cycles,
of any length, in one process or, on the daemon's books, across processes
(a relayed request names what its task leases there: ``Ticket.held``).

The check counts bytes, not single entries. On asking, for a request that
would wait and whose task holds a lease, take the set of waiting lease
holders: this request, and every queued request whose task holds a lease.
Then take out of the set, again and again, each one that could be served if
every lease of a task *outside* the set ended, every idle entry were evicted
and every load and release in flight finished: only the bytes it may never
evict (``_reach``: pins, higher priorities, stranded quarantine) and the
leases of the set's own tasks stay. Those taken out can progress, and then
end their leases, so the rest may count those bytes too. What is left can
never progress; if the new request is among them, it is refused with a
``DeadlockError`` that names the cycle, and the others wait on (the refused
task can now end its leases).

Every doubt counts as progress (a load finishes, a lease of a task outside
the set ends, an overdue release returns), so a set that could progress is
never refused: the check has no false positives.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

from .._errors import DeadlockError
from ._model import Entry, Owner
from ._reach import _beyond, _mine_in
from ._state import Books
from ._tiers import beyond

__all__ = ["check_cycle_of_holders"]


class _Waiter:
    """One waiting lease holder: what it asks for and what its task leases."""

    __slots__ = ("key", "leases", "need", "owner", "places", "priority", "task")

    def __init__(
        self,
        owner: Owner,
        key: Hashable,
        task: object,
        need: Mapping[str, int],
        places: tuple[str, ...] | None,
        priority: int,
        leases: Sequence[Entry],
    ) -> None:
        self.owner = owner
        self.key = key
        self.task = task
        self.need = need
        self.places = places
        self.priority = priority
        self.leases = leases

    def could_be_served(self, books: Books, held: Sequence[Entry]) -> bool:
        """Whether this request fits once every byte but those it may never evict and
        ``held`` (the leases of the waiting set) came back."""
        spaces = books.spaces
        priority = self.priority
        if self.places is None:
            for name, amount in self.need.items():
                space = spaces[name]
                reach = space.limit - _beyond(space, priority) - _mine_in(name, priority, held)
                if amount > reach:
                    return False
            return True
        amount = sum(self.need.values())
        for name in self.places:
            space = spaces[name]
            if amount <= space.limit - _beyond(space, priority) - _mine_in(name, priority, held):
                return True
        return False


def _leases_by_task(books: Books) -> dict[object, list[Entry]]:
    leases: dict[object, list[Entry]] = {}
    for entry in books.busy:
        for holder in dict.fromkeys(entry.holders):
            leases.setdefault(holder, []).append(entry)
    return leases


def _queued_holders(books: Books, leases: Mapping[object, list[Entry]]) -> list[_Waiter]:
    """The queued requests whose task holds a lease (here, or there for a relayed one)."""
    waiters = []
    for entry in books.queue:
        need = beyond(entry.need, entry.charge)  # (a promotion keeps what stays put)
        for ticket in entry.joiners:
            held = ticket.held
            if held is not None:
                mine = [e for e in held if e.leases or e.pinned]
            else:
                mine = leases.get(ticket.task, [])
            if mine:
                waiters.append(
                    _Waiter(
                        entry.owner,
                        entry.key,
                        ticket.task,
                        need,
                        entry.places,
                        entry.priority,
                        mine,
                    )
                )
    return waiters


def _stuck(books: Books, waiters: list[_Waiter]) -> list[_Waiter]:
    """The waiters that can never progress: what is left once every one that could be
    served, with the leases of the rest still held, was taken out (in turn)."""
    left = waiters
    while left:
        held = list(dict.fromkeys(e for waiter in left for e in waiter.leases))
        going = [waiter for waiter in left if waiter.could_be_served(books, held)]
        if not going:
            break
        left = [waiter for waiter in left if waiter not in going]
    return left


def check_cycle_of_holders(
    books: Books,
    owner: Owner,
    key: Hashable,
    need: Mapping[str, int],
    places: tuple[str, ...] | None,
    priority: int,
    task: object,
    held: tuple[Entry, ...] | None,
) -> None:
    """Refuse a request of ``task`` (a lease holder) that would close a cycle of lease
    holders waiting on each other's leases (see the module docstring).

    Only called for a request that would wait: it does not fit now.
    """
    if held is not None:
        mine = [e for e in held if e.leases or e.pinned]
    else:
        mine = [e for e in books.busy if task in e.holders]
    if not mine:
        return  # (the usual case: a task that holds nothing closes no cycle)
    leases = _leases_by_task(books)
    asking = _Waiter(owner, key, task, need, places, priority, mine)
    stuck = _stuck(books, [asking, *_queued_holders(books, leases)])
    if asking not in stuck:
        return
    cycle = [waiter for waiter in stuck if waiter is not asking]
    named = list(dict.fromkeys((e.owner.name, e.key) for w in stuck for e in w.leases))
    raise DeadlockError(
        f"acquiring {owner.name}:{key!r} would wait for ever: its task holds "
        f"{_entries(mine)} and waits for room that only the leases of tasks waiting "
        "in turn could make: "
        + "; ".join(
            f"{_task_name(w.task)} holds {_entries(w.leases)} and waits for "
            f"{w.owner.name}:{w.key!r}"
            for w in cycle
        )
        + ". A lease holder must not wait for room that other waiting lease holders "
        "hold; this request is refused so that its task can end its leases",
        named,
    )


def _entries(entries: Sequence[Entry]) -> str:
    return ", ".join(f"{e.owner.name}:{e.key!r}" for e in entries)


def _task_name(task: object) -> str:
    """A task's name as its library gives it (asyncio's ``get_name``, trio's ``name``)."""
    get_name = getattr(task, "get_name", None)
    if callable(get_name):
        return f"task {get_name()!r}"
    name = getattr(task, "name", None)
    if isinstance(name, str):
        return f"task {name!r}"
    return f"task {task!r}"
