"""The core's promises at the edges real applications reach, one step at a time.

Measured sizes under concurrency, a task that waits on itself through FIFO
order, loaders that ask for their own key, quarantined bytes, hits that would
starve a large request, leases that outlive their cache.
"""

from __future__ import annotations

import pytest

from cachebroker import DeadlockError, OutOfSpace, RequestTooLarge
from cachebroker._core import FAIR_REQUESTS, Reason, Request, State, Ticket
from tests.harness import Harness


def resident(h: Harness, key: str, size: int) -> None:
    """Load ``key`` and end its lease: an idle entry of ``size`` bytes."""
    ticket = h.acquire(key, size)
    h.finish(ticket.entry)
    h.end(ticket)


def measured(h: Harness, key: str, size: int) -> Ticket:
    """Load ``key`` of unknown size, measured as ``size`` bytes, and end its lease."""
    ticket = h.core.request(h.owner, Request(key), "t")
    h.drain()
    h.finish(ticket.entry, "v", measured={"m": size})
    h.end(ticket)
    return ticket


# ------------------------------------------------------------ measured sizes


def test_loads_of_unknown_size_run_one_at_a_time() -> None:
    h = Harness({"m": 100})
    first = h.core.request(h.owner, Request("a"), "t1")
    second = h.core.request(h.owner, Request("b"), "t2")
    h.drain()
    assert first.entry.state is State.LOADING
    assert second.entry.state is State.WAITING  # at the gate, reserving nothing yet
    assert second.entry not in h.core.queue
    h.core.check()
    h.finish(first.entry, measured={"m": 70})
    # Its turn: it reserves the largest size this cache has measured, which
    # does not fit beside the leased a: it waits for space like any request.
    assert second.entry in h.core.queue
    assert second.entry.need == {"m": 70}
    h.end(first)
    assert h.released == [("a", Reason.CAPACITY)]
    h.ack(h.releasing[0])
    assert second.entry.state is State.LOADING
    assert h.used() == 70
    h.core.check()


def test_unknown_load_reserves_largest_measured_size_and_evicts_for_it() -> None:
    h = Harness({"m": 100})
    measured(h, "a", 60)
    b = h.core.request(h.owner, Request("b"), "t")
    h.drain()
    # b's size is unknown: it reserves 60 (the largest measured), so a must go first.
    assert h.released == [("a", Reason.CAPACITY)]
    assert b.entry.state is State.WAITING
    h.ack(h.releasing[0])
    assert b.entry.state is State.LOADING
    assert b.entry.charge == {"m": 60}
    h.core.check()


def test_measured_size_is_remembered_across_evictions_and_reserved() -> None:
    h = Harness({"m": 100})
    a = measured(h, "a", 45)
    assert h.core.sizes[("p", "a")] == {"m": 45}
    h.core.invalidate(h.owner, "a")
    h.drain()
    h.ack(a.entry)
    h2 = h.core.request(h.owner, Request("a"), "t")
    assert h2.entry.need == {"m": 45}  # reserved before the load, from memory


def test_a_measured_size_beyond_the_limit_is_the_keys_alone_not_the_caches_estimate() -> None:
    h = Harness({"m": 100})
    measured(h, "a", 10)
    oops = h.core.request(h.owner, Request("oops"), "t")
    h.drain()
    h.finish(oops.entry, measured={"m": 800})  # (a measure in the wrong unit, say)
    assert isinstance(oops.outcome, RequestTooLarge)
    h.ack(h.releasing[0])
    # The key keeps its size: asked again, it is refused before its loader runs.
    with pytest.raises(RequestTooLarge, match="p:'oops' needs 800 B"):
        h.core.request(h.owner, Request("oops"), "t")
    # Another load of unknown size reserves the largest size that fits (a's),
    # not the whole space: a stays.
    b = h.core.request(h.owner, Request("b"), "t")
    h.drain()
    assert b.entry.state is State.LOADING
    assert b.entry.charge == {"m": 10}
    assert h.released == [("oops", Reason.REJECTED)]
    h.core.check()


def test_measured_size_above_what_quarantine_leaves_is_refused() -> None:
    h = Harness({"m": 100})
    resident(h, "q", 60)
    h.core.invalidate(h.owner, "q")
    h.drain()
    h.refuse(h.releasing[0])
    a = h.acquire("a", 10)
    h.finish(a.entry, measured={"m": 50})  # only 40 can ever be had without forget()
    assert isinstance(a.outcome, OutOfSpace)
    assert h.released[-1] == ("a", Reason.REJECTED)
    h.core.check()


def test_nested_unknown_load_passes_the_gate_held_by_its_own_loader() -> None:
    h = Harness({"m": 100})
    outer = h.core.request(h.owner, Request("a"), "load-a")
    h.drain()
    inner = h.core.request(h.owner, Request("b"), "load-a", loading=(outer.entry,))
    h.drain()
    assert inner.entry.state is State.LOADING  # not waiting for its own loader's turn
    h.core.check()


def test_unknown_load_of_a_lease_holder_does_not_wait_for_a_turn_that_waits_for_it() -> None:
    h = Harness({"m": 100})
    x = h.core.request(h.owner, Request("x"), "B")
    h.drain()
    h.finish(x.entry, measured={"m": 60})  # B holds x (60)
    first = h.core.request(h.owner, Request("u1"), "A")  # reserves 60: waits for x's lease
    h.drain()
    assert first.entry.state is State.WAITING
    second = h.core.request(h.owner, Request("u2"), "B")  # B must not wait behind u1
    h.drain()
    assert second.entry.state is State.LOADING
    assert second.entry.charge == {}
    joined = h.core.request(h.owner, Request("u3"), "C")  # an ordinary request waits its turn
    h.drain()
    assert joined.entry.gated
    h.core.request(h.owner, Request("u3"), "B")  # until a lease holder joins it
    h.drain()
    assert not joined.entry.gated
    h.core.check()


# ---------------------------------------------------- waiting on oneself


def test_request_of_a_lease_holder_passes_a_waiter_blocked_on_that_lease() -> None:
    h = Harness({"m": 100}, instant=True)
    a = h.acquire("A", 60, task="t1")
    x = h.acquire("X", 50, task="t2")  # needs A gone: waits for t1
    assert x.outcome is None
    b = h.acquire("B", 30, task="t1")  # fits in the 40 free; FIFO must not make it wait on X
    assert b.outcome is True
    h.end(b)
    h.end(a)
    assert x.outcome is True
    h.core.check()


def test_request_that_only_its_own_leases_could_serve_is_a_deadlock() -> None:
    h = Harness({"m": 100}, instant=True)
    h.acquire("A", 60, task="t1")
    h.acquire("X", 50, task="t2")
    with pytest.raises(DeadlockError):
        h.acquire("B", 50, task="t1")
    h.core.check()


def test_loader_joining_its_own_load_is_a_deadlock() -> None:
    h = Harness({"m": 100})
    a = h.acquire("a", 10, task="t")
    with pytest.raises(DeadlockError, match="p:'a'"):
        h.core.request(h.owner, Request("a", {"m": 10}), "load-task", loading=(a.entry,))
    h.core.check()
    h.leave(a)  # the requester times out: the load is cancelled, nothing kept it alive
    assert h.cancelled == [a.entry]


def test_loaders_waiting_on_each_other_are_a_deadlock() -> None:
    h = Harness({"m": 100})
    a = h.acquire("a", 10, task="t")
    b = h.core.request(h.owner, Request("b", {"m": 10}), "load-a", loading=(a.entry,))
    h.drain()
    with pytest.raises(DeadlockError):
        h.core.request(h.owner, Request("a", {"m": 10}), "load-b", loading=(b.entry,))
    h.core.check()


# -------------------------------------------------------- quarantined bytes


def test_waiter_that_only_forget_could_serve_is_refused_and_does_not_block_others() -> None:
    h = Harness({"m": 100})
    resident(h, "a", 70)
    big = h.acquire("big", 60)  # evicts a
    small = h.acquire("small", 20)  # behind big in FIFO
    assert (big.outcome, small.outcome) == (None, None)
    h.refuse(h.releasing[0])  # a's release fails: 70 quarantined, 30 left for good
    assert isinstance(big.outcome, OutOfSpace)
    assert "forget" in str(big.outcome)
    assert small.entry.state is State.LOADING  # no longer held up by big
    with pytest.raises(OutOfSpace):
        h.acquire("again", 40)
    with pytest.raises(RequestTooLarge):
        h.acquire("huge", 101)
    h.core.check()


def test_forget_makes_room_again() -> None:
    h = Harness({"m": 100})
    resident(h, "a", 70)
    (entry,) = h.owner.live
    h.core.invalidate(h.owner, "a")
    h.drain()
    h.refuse(h.releasing[0])
    h.core.forget(entry)
    assert h.acquire("b", 90).entry.state is State.LOADING
    h.core.check()


# ----------------------------------------------------------------- fairness


def test_hits_do_not_starve_a_request_that_needs_their_entries() -> None:
    """Leases that overlap forever would never leave A and B idle together."""
    h = Harness({"m": 100}, instant=True)
    held = [h.acquire("A", 50, task="t1"), h.acquire("B", 50, task="t2")]
    x = h.acquire("X", 100, task="big")
    served = 0
    while x.outcome is None and served < 4 * 256:
        # End the oldest lease and take a new one on the same entry: A or B is always leased.
        old = held.pop(0)
        key = old.entry.key
        fresh = h.acquire(key, 50, task=f"t{served}")
        h.end(old)
        if fresh.outcome is True:
            held.append(fresh)
        served += 1
        h.core.check()
    for ticket in held:
        h.end(ticket)
    assert x.outcome is True, served
    assert served <= FAIR_REQUESTS + 2
    h.core.check()


def test_pinned_leases_are_never_drained() -> None:
    h = Harness({"m": 100}, instant=True)
    a = h.acquire("A", 60, task="t1")
    h.core.configure(a.entry, pin=True)
    x = h.acquire("X", 60, task="t2")
    for i in range(FAIR_REQUESTS + 5):
        h.end(h.acquire("A", 60, task=f"u{i}"))
    assert x.outcome is None
    assert a.entry.doomed is None
    h.core.check()


# --------------------------------------------- leases outliving their cache


def test_entries_leased_when_their_cache_closes_are_quarantined_and_forgettable() -> None:
    h = Harness({"m": 100}, instant=True)
    a = h.acquire("a", 40, task="t")
    h.core.close_owner(h.owner, RuntimeError("closed"))
    h.drain()
    assert h.core.abandon(h.owner) == [a.entry]
    h.drain()
    assert a.entry.state is State.QUARANTINED
    assert h.core.spaces["m"].quarantined == 40
    h.core.check()
    h.end(a)  # the holder lets go: still quarantined, nobody released it
    assert a.entry.value is None
    assert h.used() == 40
    h.core.forget(a.entry)
    assert h.used() == 0
    h.core.check()
