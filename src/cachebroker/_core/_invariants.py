"""What must hold after every step (``check``), and the test build that checks it.

``check`` asserts the invariants listed in the package docstring by recounting
the books from the entries; ``check_after_every_step`` wraps each of the
steps in ``STEPS`` so that a test, the fault-injection machine or the soak
runs it after every step the shell takes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import _reach
from ._model import State
from ._tiers import freed, left_home, reserved

if TYPE_CHECKING:
    from ._state import Books

__all__ = ["STEPS", "check", "check_after_every_step"]


def check(books: Books) -> None:
    """Assert the invariants of the package docstring (for tests and debugging)."""
    used = dict.fromkeys(books.spaces, 0)
    releasing = dict.fromkeys(books.spaces, 0)
    idle = dict.fromkeys(books.spaces, 0)
    quarantined = dict.fromkeys(books.spaces, 0)
    for entry in books.entries():
        assert entry.state is not State.GONE, entry
        # A placed wait chooses among places its acquire asked for.
        assert entry.places is None or set(entry.places) <= set(entry.asked_places or ()), entry
        for name, amount in entry.charge.items():
            if entry.state is not State.WAITING:
                used[name] += amount
            if entry.state is State.RELEASING:
                releasing[name] += amount
            if entry.state is State.QUARANTINED:
                quarantined[name] += amount
            if entry.idle_seq:
                idle[name] += amount
        if entry.state is State.MOVING:
            assert entry.target is not None and not entry.leases and not entry.idle_seq, entry
            assert entry in entry.owner.live, entry
            for name, amount in freed(entry).items():
                releasing[name] += amount
            if entry not in books.demoting:  # granted: its room is taken
                for name, amount in reserved(entry).items():
                    used[name] += amount
            else:
                assert not entry.promoting and not entry.joiners, entry
                assert freed(entry), f"{entry!r} waits to move within one space"
        else:
            assert entry not in books.demoting and entry.target is None, entry
        if entry.state is State.DEMOTED:
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
        assert [(s.name, n) for s, n in entry.weights] == [
            (books.spaces[name].name, n) for name, n in entry.charge.items()
        ], entry
        if entry in books.orphans:
            assert entry.state is State.RELEASING, entry
            assert entry not in entry.owner.live, entry
        if entry in books.queue:
            assert entry.state in (State.WAITING, State.DEMOTED), entry
        if entry.state is State.WAITING:
            assert (entry in books.queue) is not entry.gated, entry
            assert not entry.gated or (entry in books.gate and not entry.need), entry
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
    assert books.idle_count == sum(1 for e in books.entries() if e.idle_seq), books.idle_count
    for entry in books.busy:
        assert entry.leases or entry in books.settling, entry
    assert books.holding_waiters == sum(1 for e in books.queue if e.holding)
    assert all(entry.gated for entry in books.gate)
    if books.unknown is not None:
        assert books.unknown.state in (State.WAITING, State.LOADING), books.unknown
        assert not books.unknown.gated, books.unknown
    else:
        assert not books.gate, "loads of unknown size wait, yet none is running"
    _reach.check(books)
    for name in books.canon_names:
        space = books.spaces[name]
        assert space.used == used[name], (name, space.used, used[name])
        assert space.releasing == releasing[name], (name, space.releasing, releasing[name])
        assert space.idle_bytes == idle[name], (name, space.idle_bytes, idle[name])
        assert space.quarantined == quarantined[name], (name, space.quarantined)
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
