"""What must hold after every step (``check``), and the test build that checks it.

``check`` asserts the invariants listed in the package docstring by recounting
the books from the entries; ``check_after_every_step`` wraps each of the
steps in ``STEPS`` so that a test, the fault-injection machine or the soak
runs it after every step the shell takes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from . import _reach
from ._model import Entry, State
from ._tiers import freed, left_home, reserved

if TYPE_CHECKING:
    from ._state import Books

__all__ = ["STEPS", "check", "check_after_every_step"]


def check(books: Books) -> None:
    """Assert the invariants of the package docstring (for tests and debugging).

    Each entry is checked by itself (``_check_entry``) and counted; each owner
    of the books' state checks its own (``Queue``, ``Gate``, ``Canon``,
    ``Tiers``, and ``_reach.check`` for the pinned and ranked bytes); then each
    space's byte counts are compared with the recount (``_check_spaces``).
    """
    tally = _Tally(books.spaces)
    for entry in books.entries():
        _check_entry(books, entry)
        tally.count(books, entry)
    assert books.idle_count == sum(1 for e in books.entries() if e.idle_seq), books.idle_count
    for entry in books.busy:
        assert entry.leases or entry in books.settling, entry
    books.queue.check()
    books.gate.check()
    books.canon.check(books.spaces)
    books.tiers.check(books.canon)
    _reach.check(books)
    _check_spaces(books, tally)


class _Tally:
    """Each space's bytes, recounted from the entries."""

    def __init__(self, spaces: Iterable[str]) -> None:
        self.used = dict.fromkeys(spaces, 0)
        self.releasing = dict.fromkeys(self.used, 0)
        self.idle = dict.fromkeys(self.used, 0)
        self.quarantined = dict.fromkeys(self.used, 0)

    def count(self, books: Books, entry: Entry) -> None:
        for name, amount in entry.charge.items():
            if entry.state is not State.WAITING:
                self.used[name] += amount
            if entry.state is State.RELEASING:
                self.releasing[name] += amount
            if entry.state is State.QUARANTINED:
                self.quarantined[name] += amount
            if entry.idle_seq:
                self.idle[name] += amount
        if entry.state is State.MOVING:
            for name, amount in freed(entry).items():
                self.releasing[name] += amount
            if entry not in books.demoting:  # granted: its room is taken
                for name, amount in reserved(entry).items():
                    self.used[name] += amount


def _check_entry(books: Books, entry: Entry) -> None:
    """Assert what holds of ``entry`` in its state, and of where the books keep it."""
    assert entry.state is not State.GONE, entry
    # A placed wait chooses among places its acquire asked for.
    assert entry.places is None or set(entry.places) <= set(entry.asked_places or ()), entry
    if entry.state is State.MOVING:
        assert entry.target is not None and not entry.leases and not entry.idle_seq, entry
        assert entry in entry.owner.live, entry
        if entry in books.demoting:
            assert not entry.promoting and not entry.joiners, entry
            assert freed(entry), f"{entry!r} waits to move within one space"
    else:
        assert entry not in books.demoting and entry.target is None, entry
    if entry.state is State.DEMOTED:
        _check_demoted(books, entry)
    assert [(s.name, n) for s, n in entry.weights] == [
        (books.spaces[name].name, n) for name, n in entry.charge.items()
    ], entry
    if entry in books.orphans:
        assert entry.state is State.RELEASING, entry
        assert entry not in entry.owner.live, entry
    if entry.state is State.WAITING:
        assert (entry in books.queue) is not entry.gated, entry
        assert not entry.gated or entry in books.gate, entry
        assert not entry.charge, entry
        assert entry.joiners, f"{entry!r} waits for space on behalf of nobody"
        assert entry.holding == sum(t.holds for t in entry.joiners), entry
    if entry.state is State.READY and entry.joiners:
        # Requests wait for a lease slot only while every slot is taken.
        assert entry.slots is not None and entry.leases >= entry.slots, entry
        assert all(t.outcome is None and t.entry is entry for t in entry.joiners), entry
    if entry.state is State.READY and not entry.leases and entry.doomed is None:
        # Exactly one of: a candidate, pinned, or idle once the books settle.
        states = (bool(entry.idle_seq), entry.pinned, entry in books.settling)
        assert sum(states) == 1, (entry, states)
    elif entry in books.settling:
        raise AssertionError(f"{entry!r} is settling but not an idle-to-be entry")
    if entry.leases:
        assert entry.state in (State.READY, State.QUARANTINED), entry
        assert not entry.idle_seq, entry
        assert len(entry.holders) == entry.leases, entry
        assert (entry in books.busy) is (entry.state is State.READY), entry
    # The leases only their own task can end are some of its leases.
    bound = entry.bound
    assert all(bound.count(h) <= entry.holders.count(h) for h in bound), entry


def _check_demoted(books: Books, entry: Entry) -> None:
    assert entry.home is not None and not entry.leases, entry
    # Queued for its promotion exactly while requests wait for it.
    assert (entry in books.queue) is bool(entry.joiners), entry
    assert not (entry.joiners and entry.idle_seq), entry
    assert entry.joiners or entry.idle_seq or entry.doomed is not None, entry
    # Never parked in its home, nor promoted to where it is parked: a
    # promotion would ask for its bytes again beside themselves.
    assert left_home(entry.home, entry.charge), (entry, entry.home, entry.charge)
    assert entry.places is None or entry.charge.keys().isdisjoint(entry.places), entry
    if entry in books.queue:
        assert not entry.charge.keys() >= entry.need.keys(), (entry, entry.need)


def _check_spaces(books: Books, tally: _Tally) -> None:
    for name in books.canon.names:
        space = books.spaces[name]
        assert space.used == tally.used[name], (name, space.used, tally.used[name])
        assert space.releasing == tally.releasing[name], (name, space.releasing)
        assert space.idle_bytes == tally.idle[name], (name, space.idle_bytes)
        assert space.quarantined == tally.quarantined[name], (name, space.quarantined)
        # Over budget only while a measured load overdraws it, and overdrawn only
        # while over: ``repay`` forgets the overdraft once the space is back within.
        overdrawn = name in books.overdrawn
        assert overdrawn == (space.used > space.capacity), (name, space.used, space.capacity)


#: Every step the shell takes on the books: what ``check_after_every_step`` wraps.
STEPS = (
    "abandon",
    "adopt",
    "clear",
    "close_owner",
    "configure",
    "drop_owner",
    "forget",
    "forget_owner",
    "free_for_retry",
    "give_up",
    "hit",
    "invalidate",
    "leave",
    "limit",
    "let_go",
    "lease_end",
    "load_abandoned",
    "load_done",
    "load_failed",
    "merge_spaces",
    "move_done",
    "move_failed",
    "note_alias_evidence",
    "open_owner",
    "prefetch",
    "release_done",
    "release_failed",
    "release_overdue",
    "release_refused",
    "reprioritize",
    "request",
    "retune",
    "set_capacity",
    "sweep",
    "unpin",
)


def check_after_every_step(
    core: Books, failures: list[str], count: list[int] | None = None
) -> None:
    """The test build: run ``check(core)`` after each of ``core``'s steps.

    A failed check is recorded in ``failures``, not raised: raised inside a
    load or release task, the assertion would pass for the plugin's fault and
    change what the broker does. ``count[0]``, if given, counts the checks.
    """
    for name in STEPS:
        step = getattr(core, name)

        def checked(*args: Any, _step: Any = step, _name: str = name, **kwargs: Any) -> Any:
            try:
                return _step(*args, **kwargs)
            finally:
                if count is not None:
                    count[0] += 1
                try:
                    check(core)
                except AssertionError as exc:
                    failures.append(f"Core.check() after Core.{_name}: {exc!r}")

        setattr(core, name, checked)
