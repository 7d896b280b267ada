"""The core's steps for owners in other processes: refused releases, owners gone, victims.

``give_up`` is a client's books answering the shared broker; ``release_refused``,
``let_go`` and ``drop_owner`` are the shared broker's books following a process.
"""

from __future__ import annotations

import pytest

from cachebroker import BrokerClosed
from cachebroker._core import Reason, Request, State, check_after_every_step
from tests.harness import Harness


def resident(h: Harness, key: str, size: int) -> None:
    ticket = h.acquire(key, size)
    h.finish(ticket.entry)
    h.end(ticket)


def checked(h: Harness) -> list[str]:
    failures: list[str] = []
    check_after_every_step(h.core, failures)
    return failures


# ------------------------------------------------------------- release_refused


def test_a_refused_release_leases_the_entry_again_and_the_waiter_takes_another_victim() -> None:
    h = Harness({"m": 100})
    failures = checked(h)
    resident(h, "a", 40)
    resident(h, "b", 40)
    waiter = h.acquire("c", 40)
    a = h.owner.entries["a"]
    assert h.released == [("a", Reason.CAPACITY)]
    # The owner (another process) had leased a again: it refuses.
    h.releasing.remove(a)
    h.core.release_refused(a, "process 7")
    h.drain()
    assert a.state is State.READY and a.leases == 1 and a.holders == ["process 7"]
    assert h.released[-1] == ("b", Reason.CAPACITY)  # the next victim
    h.ack(h.owner.entries["b"])
    assert waiter.entry.state is State.LOADING
    assert h.used() == 80
    # The lease ends like any other.
    h.core.lease_end(a, "process 7", 0.0)
    h.drain()
    h.core.next_expiry()  # (reads the books: settles the entries whose leases ended)
    assert a.idle_seq
    assert failures == []


def test_release_refused_ignores_an_entry_no_longer_releasing() -> None:
    h = Harness({"m": 100})
    resident(h, "a", 40)
    a = h.owner.entries["a"]
    h.core.release_refused(a, "p")  # ready, never asked
    assert a.leases == 0
    h.core.invalidate(h.owner, "a")
    h.drain()
    h.ack(a)
    h.core.release_refused(a, "p")  # gone
    assert a.state is State.GONE and h.used() == 0
    h.core.check()


# ----------------------------------------------------------------------- let_go


def test_let_go_releases_an_idle_entry_now_and_a_leased_one_at_its_last_lease() -> None:
    h = Harness({"m": 100})
    failures = checked(h)
    resident(h, "a", 30)
    held = h.acquire("b", 30)
    h.finish(held.entry)
    h.core.let_go(h.owner.entries["a"], Reason.IDLE)
    h.core.let_go(held.entry, Reason.INVALIDATE)
    h.drain()
    assert h.released == [("a", Reason.IDLE)]
    h.end(held)
    assert h.released[-1] == ("b", Reason.INVALIDATE)
    h.core.let_go(held.entry, Reason.IDLE)  # releasing already: nothing more
    assert len(h.released) == 2
    assert failures == []


# ------------------------------------------------------------------ drop_owner


def test_drop_owner_frees_every_state_at_once_and_fails_its_waiters() -> None:
    h = Harness({"m": 100})
    failures = checked(h)
    core = h.core
    other = core.open_owner("other")
    resident(h, "idle", 10)
    leased = h.acquire("leased", 10)
    h.finish(leased.entry)
    loading = h.acquire("loading", 10)
    releasing = h.acquire("releasing", 10)
    h.finish(releasing.entry)
    h.end(releasing)
    core.invalidate(h.owner, "releasing")
    h.drain()
    quarantined = h.acquire("quarantined", 10)
    h.finish(quarantined.entry)
    h.end(quarantined)
    core.invalidate(h.owner, "quarantined")
    h.drain()
    h.refuse(quarantined.entry)
    assert core.spaces["m"].used == 50
    # Another owner fills the rest and waits for more.
    big = core.request(other, Request("big", {"m": 50}), "o")
    h.drain()
    h.finish(big.entry)
    waiting = h.acquire("waiting", 40)
    theirs = core.request(other, Request("theirs", {"m": 40}), "o2")
    h.drain()
    assert waiting.entry.state is State.WAITING and theirs.entry.state is State.WAITING

    core.drop_owner(h.owner)
    h.drain()
    assert core.spaces["m"].used == 50 + 40  # big, and theirs now granted
    assert theirs.entry.state is State.LOADING
    assert isinstance(waiting.outcome, BrokerClosed) and isinstance(loading.outcome, BrokerClosed)
    assert "process" in str(waiting.outcome)
    assert not h.owner.live and not h.owner.entries and not core.quarantined
    assert h.owner in h.emptied
    # The shell's tasks still running for them change nothing now.
    core.load_done(loading.entry, "late", None, 1.0, 0.0)
    core.load_failed(loading.entry, RuntimeError("late"))
    core.release_done(releasing.entry)
    core.release_failed(releasing.entry, RuntimeError("late"))
    core.lease_end(leased.entry, "t", 0.0) if leased.entry.leases else None
    h.drain()
    assert core.spaces["m"].used == 90
    assert failures == [], failures


def test_drop_owner_of_a_load_of_unknown_size_opens_the_gate_for_the_next() -> None:
    h = Harness({"m": 100})
    failures = checked(h)
    other = h.core.open_owner("other")
    first = h.core.request(h.owner, Request("a"), "t1")
    second = h.core.request(other, Request("b"), "t2")
    h.drain()
    assert first.entry.state is State.LOADING and second.entry.state is State.WAITING
    h.core.drop_owner(h.owner)
    h.drain()
    assert second.entry.state is State.LOADING
    assert failures == []


# ---------------------------------------------------------------------- give_up


@pytest.mark.parametrize("pinned", [False, True])
def test_give_up_refuses_a_leased_or_pinned_entry_and_releases_an_idle_one(pinned: bool) -> None:
    h = Harness({"m": 100})
    failures = checked(h)
    held = h.acquire("a", 10)
    h.finish(held.entry)
    assert h.core.give_up(held.entry) is False
    h.end(held)
    if pinned:
        h.core.configure(held.entry, pin=True)
        assert h.core.give_up(held.entry) is False
        return
    assert h.core.give_up(held.entry) is True  # (it was settling: settled first)
    h.drain()
    assert h.released == [("a", Reason.CAPACITY)]
    assert h.core.give_up(held.entry) is True  # under way
    h.ack(held.entry)
    assert h.core.give_up(held.entry) is True  # over
    assert failures == []
