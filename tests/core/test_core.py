"""Unit tests of the sans-I/O core: one synchronous step at a time."""

from __future__ import annotations

import pytest

from cachebroker import DeadlockError, RequestTooLarge
from cachebroker._core import Reason, State
from tests.harness import Harness


def test_miss_reserves_before_load_and_grants_lease_when_loaded() -> None:
    h = Harness({"m": 100})
    ticket = h.acquire("a", 40)
    entry = ticket.entry
    assert entry.state is State.LOADING
    assert h.used() == 40  # reserved before the load ran
    assert ticket.outcome is None
    h.finish(entry)
    assert ticket.outcome is True
    assert entry.leases == 1
    h.core.check()


def test_hit_leases_ready_entry_without_load() -> None:
    h = Harness({"m": 100}, instant=True)
    first = h.acquire("a", 40)
    again = h.acquire("a", 40, task="u")
    assert again.outcome is True
    assert first.entry is again.entry
    assert again.entry.leases == 2
    assert (h.core.hits, h.core.misses, h.core.loads) == (1, 1, 1)


def test_concurrent_requests_share_one_load() -> None:
    h = Harness({"m": 100})
    tickets = [h.acquire("a", 10, task=i) for i in range(5)]
    assert len(h.loading) == 1
    h.finish(tickets[0].entry)
    assert all(t.outcome is True for t in tickets)
    assert tickets[0].entry.leases == 5
    h.core.check()


def test_failed_load_fails_every_joiner_and_returns_space() -> None:
    h = Harness({"m": 100})
    tickets = [h.acquire("a", 30, task=i) for i in range(3)]
    error = RuntimeError("boom")
    h.fail(tickets[0].entry, error)
    assert all(t.outcome is error for t in tickets)
    assert h.used() == 0
    assert "a" not in h.cached_keys()  # not cached: the next acquire loads again
    h.acquire("a", 30)
    assert len(h.loading) == 1


def test_last_requester_leaving_cancels_load() -> None:
    h = Harness({"m": 100})
    t1 = h.acquire("a", 30, task=1)
    t2 = h.acquire("a", 30, task=2)
    h.leave(t1)
    assert not h.cancelled
    h.leave(t2)
    assert h.cancelled == [t1.entry]
    h.core.load_failed(t1.entry, RuntimeError("cancelled"), cancelled=True)
    assert h.used() == 0
    assert h.core.load_failures == 0


def test_eviction_asks_idle_lru_victims_and_grants_only_after_ack() -> None:
    h = Harness({"m": 100})
    for key in "abc":
        t = h.acquire(key, 30)
        h.finish(t.entry)
        h.end(t)
    # Touch "a" so that "b" is the least recently used.
    h.end(h.acquire("a", 30))
    waiting = h.acquire("d", 50)
    assert waiting.entry.state is State.WAITING
    assert [e.key for e in h.releasing] == ["b", "c"]
    h.ack(h.releasing[0])
    assert waiting.entry.state is State.WAITING  # 30 freed is not enough
    h.ack(h.releasing[0])
    assert waiting.entry.state is State.LOADING
    assert h.used() == 80
    h.core.check()


def test_leased_entry_is_never_a_victim_and_request_waits_for_lease() -> None:
    h = Harness({"m": 100})
    held = h.acquire("a", 60, task="holder")
    h.finish(held.entry)
    waiting = h.acquire("b", 60, task="other")
    assert not h.releasing
    assert waiting.entry.state is State.WAITING
    h.end(held)
    assert [e.key for e in h.releasing] == ["a"]
    h.ack(h.releasing[0])
    assert waiting.entry.state is State.LOADING


def test_no_victims_asked_when_idle_entries_cannot_cover_shortfall() -> None:
    h = Harness({"m": 100})
    held = h.acquire("a", 50, task=1)
    h.finish(held.entry)
    idle = h.acquire("b", 30, task=1)
    h.finish(idle.entry)
    h.end(idle)
    h.acquire("c", 80, task=2)  # needs 60 more than free; only 30 idle
    assert not h.releasing
    assert "b" in h.cached_keys()


def test_size_above_whole_budget_fails_fast() -> None:
    h = Harness({"m": 100})
    with pytest.raises(RequestTooLarge, match="exceeds the space's whole budget"):
        h.acquire("a", 101)
    assert not h.core.queue


def test_request_only_met_by_own_leases_is_a_deadlock() -> None:
    h = Harness({"m": 100})
    mine = h.acquire("a", 70, task="me")
    h.finish(mine.entry)
    with pytest.raises(DeadlockError) as info:
        h.acquire("b", 40, task="me")
    assert info.value.leases == (("p", "a"),)
    # Another task may wait for that lease to end.
    other = h.acquire("b", 40, task="you")
    assert other.entry.state is State.WAITING


def test_releasing_entry_takes_no_new_lease_and_reload_waits_for_release() -> None:
    h = Harness({"m": 100})
    t = h.acquire("a", 60)
    h.finish(t.entry)
    h.end(t)
    old = t.entry
    assert h.core.invalidate(h.owner, "a") is True
    assert old.state is State.RELEASING
    again = h.acquire("a", 60)
    assert again.entry is not old
    assert again.entry.state is State.WAITING  # waits for the release, then loads afresh
    h.ack(old)
    assert again.entry.state is State.LOADING
    h.finish(again.entry)
    assert again.outcome is True
    assert h.owner.entries["a"] is again.entry


def test_waiters_are_granted_in_arrival_order_per_space() -> None:
    h = Harness({"m": 100})
    held = h.acquire("held", 60, task=0)
    h.finish(held.entry)
    big = h.acquire("big", 90, task=1)
    small = h.acquire("small", 10, task=2)  # fits now, but must not overtake "big"
    assert big.entry.state is State.WAITING
    assert small.entry.state is State.WAITING
    h.end(held)
    h.ack(h.releasing[0])
    assert big.entry.state is State.LOADING
    assert small.entry.state is State.LOADING


def test_waiter_in_another_space_is_not_blocked() -> None:
    h = Harness({"m": 100, "g": 100})
    held = h.acquire("held", {"m": 100}, task=0)
    h.finish(held.entry)
    blocked = h.acquire("x", {"m": 50}, task=1)
    free = h.acquire("y", {"g": 50}, task=2)
    assert blocked.entry.state is State.WAITING
    assert free.entry.state is State.LOADING


def test_entry_weighs_in_several_spaces() -> None:
    h = Harness({"m": 100, "g": 100}, instant=True)
    t = h.acquire("a", {"m": 10, "g": 80})
    assert (h.used("m"), h.used("g")) == (10, 80)
    h.end(t)
    h.acquire("b", {"g": 50})
    assert h.released == [("a", Reason.CAPACITY)]
    assert (h.used("m"), h.used("g")) == (0, 50)


def test_measured_size_corrects_books_and_evicts_more() -> None:
    h = Harness({"m": 100})
    for key in "ab":
        t = h.acquire(key, 40)
        h.finish(t.entry)
        h.end(t)
    grown = h.acquire("c", 10)
    h.finish(grown.entry, measured={"m": 50})
    assert h.used() == 130 - 0  # over budget until the eviction lands
    assert [e.key for e in h.releasing] == ["a"]
    h.ack(h.releasing[0])
    assert h.used() == 90
    h.core.check()


def test_measured_size_above_budget_fails_and_releases_value() -> None:
    h = Harness({"m": 100})
    t = h.acquire("a", 10)
    h.finish(t.entry, measured={"m": 150})
    assert isinstance(t.outcome, RequestTooLarge)
    assert h.released == [("a", Reason.REJECTED)]
    h.ack(h.releasing[0])
    assert h.used() == 0


def test_failed_release_quarantines_and_keeps_bytes_charged() -> None:
    h = Harness({"m": 100})
    for key in "ab":
        t = h.acquire(key, 50)
        h.finish(t.entry)
        h.end(t)
    waiting = h.acquire("c", 50)
    victim = h.releasing[0]
    h.refuse(victim)
    assert victim.state is State.QUARANTINED
    assert h.used() == 100  # the books do not assume the memory came back
    # ... and the broker looks for another victim.
    assert [e.key for e in h.releasing] == ["b"]
    h.ack(h.releasing[0])
    assert waiting.entry.state is State.LOADING
    # A late acknowledgement frees the bytes.
    h.core.release_done(victim)
    assert h.used() == 50
    h.core.check()


def test_invalidate_leased_entry_releases_at_last_lease_end() -> None:
    h = Harness({"m": 100}, instant=True)
    t = h.acquire("a", 30)
    assert h.core.invalidate(h.owner, "a") is True
    assert h.released == []
    assert "a" not in h.cached_keys()
    fresh = h.acquire("a", 30, task="u")
    assert fresh.entry is not t.entry
    h.end(t)
    assert h.released == [("a", Reason.INVALIDATE)]
    assert h.used() == 30


def test_idle_entries_expire_after_ttl() -> None:
    h = Harness({"m": 100}, idle_ttl=10, instant=True)
    h.end(h.acquire("a", 10))
    h.now = 5
    h.end(h.acquire("b", 10))
    assert h.core.next_expiry() == 10
    assert h.core.sweep(9.9) == []
    assert [e.key for e in h.core.sweep(10)] == ["a"]
    assert h.core.next_expiry() == 15
    h.drain()
    assert h.released == [("a", Reason.IDLE)]


def test_lease_resets_idle_clock() -> None:
    h = Harness({"m": 100}, idle_ttl=10, instant=True)
    t = h.acquire("a", 10)
    h.end(t)
    h.now = 8
    h.end(h.acquire("a", 10))
    assert h.core.sweep(12) == []
    assert [e.key for e in h.core.sweep(18)] == ["a"]


def test_retention_off_releases_at_last_lease_and_still_shares_load() -> None:
    h = Harness({"m": 0})
    t1 = h.acquire("a", 10**9, task=1)
    t2 = h.acquire("a", 10**9, task=2)
    assert len(h.loading) == 1
    h.finish(t1.entry)
    h.end(t1)
    assert h.released == []
    h.end(t2)
    assert h.released == [("a", Reason.UNRETAINED)]


def test_closing_owner_fails_waiters_and_releases_idle_entries() -> None:
    from cachebroker import BrokerClosed

    h = Harness({"m": 100})
    held = h.acquire("held", 60, task=1)
    h.finish(held.entry)
    idle = h.acquire("idle", 40, task=1)
    h.finish(idle.entry)
    h.end(idle)
    waiting = h.acquire("w", 50, task=2)
    h.core.close_owner(h.owner, BrokerClosed("closed"))
    h.drain()
    assert isinstance(waiting.outcome, BrokerClosed)
    assert ("idle", Reason.CLOSE) in h.released
    h.end(held)
    assert ("held", Reason.CLOSE) in h.released
    for entry in list(h.releasing):
        h.ack(entry)
    assert not h.owner.live
    assert h.used() == 0


def test_request_arriving_after_a_load_was_cancelled_starts_afresh() -> None:
    h = Harness({"m": 100})
    first = h.acquire("a", 30, task=1)
    h.leave(first)  # its only requester left: the load is being cancelled
    assert h.cancelled == [first.entry]
    second = h.acquire("a", 30, task=2)  # before the load task noticed
    assert second.entry is not first.entry
    h.core.load_failed(first.entry, RuntimeError("cancelled"), cancelled=True)
    h.loading.remove(first.entry)
    h.drain()
    assert second.outcome is None  # not failed by the other load's cancellation
    h.finish(second.entry)
    assert second.outcome is True


def test_cancelled_load_that_finished_anyway_is_kept_or_released() -> None:
    h = Harness({"m": 100})
    first = h.acquire("a", 30, task=1)
    h.leave(first)
    h.finish(first.entry)  # a threaded load cannot be stopped: it finished
    assert h.owner.entries["a"] is first.entry  # the key was free: kept
    again = h.acquire("b", 30, task=1)
    h.leave(again)
    newer = h.acquire("b", 30, task=2)
    h.finish(again.entry)  # finished, but a newer request owns the key
    assert ("b", Reason.ABANDONED) in h.released
    assert h.owner.entries["b"] is newer.entry
