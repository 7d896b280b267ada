"""Tiers: an idle value moved down a tier instead of released, and back up for an acquire.

The books driven directly: which entry is demoted or dropped, what is
charged where while a move runs, promotions queued like loads, and what the
shell cannot reach on demand (a demotion waiting to go further down, tiers
merged mid-move, the misses a joined demotion counts). The shell is in
``tests/shell/test_tiers.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

from cachebroker import OutOfSpace
from cachebroker._core import Reason, Request, State
from cachebroker._policies import make_policy
from tests.harness import Harness

GIB = 1 << 30
BUDGET = {"gpu": 100, "ram": 100}
TIERS = {"gpu": "ram"}
GPU60 = {"gpu": 60}


def tiered(**options: Any) -> Harness:
    return Harness({"gpu": 100, "ram": 100}, tiers={"gpu": "ram"}, moves=True, **options)


def load(h: Harness, key: str, size: int = 60, space: str = "gpu") -> None:
    """Request ``key`` (a miss), let the moves it sets off end, finish its load and
    end its lease: an idle entry."""
    ticket = h.acquire(key, {space: size})
    while ticket.entry.state is State.WAITING and h.moving:
        h.move(h.moving[0][0])
    if ticket.outcome is None:
        h.finish(ticket.entry)
    h.end(ticket)


# -- the books -----------------------------------------------------------------


def test_a_victim_is_moved_down_a_tier_charged_in_both_spaces_until_it_lands() -> None:
    h = tiered()
    load(h, "a")
    b = h.acquire("b", {"gpu": 60})
    a = h.owner.entries["a"]
    assert a.state is State.MOVING and h.moving == [(a, "ram")]
    gpu, ram = h.core.spaces["gpu"], h.core.spaces["ram"]
    assert (gpu.used, gpu.releasing, ram.used) == (60, 60, 60)  # both charged
    assert b.entry.state is State.WAITING  # the bytes come back when the move ends
    h.move(a)
    assert a.state is State.DEMOTED and a.charge == {"ram": 60} and a.home == {"gpu": 60}
    assert a.value == "v-a@ram" and a.idle
    assert b.entry.state is State.LOADING and (gpu.used, ram.used) == (60, 60)
    assert h.released == [] and h.core.demotions == 1


def test_an_acquire_moves_a_demoted_value_back_up_and_learns_the_promotion_cost() -> None:
    h = tiered()
    load(h, "a")
    load(h, "b")  # demotes a
    misses = h.core.misses
    ticket = h.acquire("a", {"gpu": 60})  # b goes down; a waits for its room
    a, b = ticket.entry, h.owner.entries["b"]
    assert a.state is State.DEMOTED and a in h.core.queue and ticket.outcome is None
    assert b.state is State.RELEASING  # ram holds a still: no room for b there
    h.ack(b)
    assert a.state is State.MOVING and a.promoting and h.moving == [(a, "gpu")]
    h.move(a, seconds=0.5)
    assert ticket.outcome is True and a.state is State.READY and a.charge == {"gpu": 60}
    assert a.value == "v-a@ram@gpu" and a.home is None and a.promote_cost == 0.5
    assert h.core.misses == misses + 1 and h.core.loads == 2 and h.core.promotions == 1
    h.end(ticket)
    assert h.core.spaces["ram"].used == 0


def test_a_releaser_that_cannot_move_has_its_values_released() -> None:
    h = Harness({"gpu": 100, "ram": 100}, tiers={"gpu": "ram"}, moves=False)
    load(h, "a")
    h.acquire("b", {"gpu": 60})
    assert h.released == [("a", Reason.CAPACITY)] and h.moving == []


def test_a_value_whose_promotion_costs_a_cold_load_is_released_not_demoted() -> None:
    h = tiered()
    load(h, "a")
    a = h.owner.entries["a"]
    a.promote_cost = a.reload  # (the harness's loads take 1 s)
    h.acquire("b", {"gpu": 60})
    assert h.released == [("a", Reason.CAPACITY)] and a.state is State.RELEASING


@pytest.mark.parametrize("policy", ["lru", "fifo", "gdsf", "cost"])
def test_the_lower_tier_makes_room_by_its_policy_and_the_demoted_can_be_dropped(
    policy: str,
) -> None:
    h = tiered(policy=make_policy(policy))
    load(h, "a")
    load(h, "b")  # a goes down to ram (60 of 100)
    h.acquire("c", {"gpu": 60})  # b must go down; ram can take it only without a
    b = h.owner.entries["b"]
    a = h.owner.entries.get("a")
    if b.state is State.MOVING:  # the policy kept b over a: a is dropped from ram
        assert a is not None and a.state is State.RELEASING
        assert ("a", Reason.CAPACITY) in h.released
        h.ack(a)
        h.move(b)
        assert b.state is State.DEMOTED
    else:  # the policy kept a: b is released
        assert b.state is State.RELEASING and a is not None and a.state is State.DEMOTED
    h.core.check()
    assert h.core.spaces["ram"].used <= 100 and h.core.spaces["gpu"].used <= 100


def test_under_lru_the_value_just_evicted_displaces_the_least_recently_demoted() -> None:
    h = tiered()
    load(h, "a")
    load(h, "b")  # a goes down to ram
    h.acquire("c", {"gpu": 60})
    assert h.released == [("a", Reason.CAPACITY)]
    assert h.owner.entries["b"].state is State.MOVING


def test_a_demotion_that_waits_for_room_is_taken_back_by_an_acquire() -> None:
    h = tiered()
    load(h, "a")
    load(h, "b")  # a goes down to ram
    h.acquire("c", {"gpu": 60})  # b waits for a's release from ram
    b, a = h.owner.entries["b"], h.owner.entries["a"]
    assert b.state is State.MOVING and b in h.core.demoting and h.moving == []
    again = h.acquire("b", {"gpu": 60})
    assert again.outcome is True and b.state is State.READY and b.charge == {"gpu": 60}
    assert h.core.spaces["gpu"].releasing == 0
    h.core.check()
    h.ack(a)  # the waiter for c gets its room some other way, once there is any
    h.end(again)
    c = h.owner.entries["c"]
    assert c.state in (State.WAITING, State.LOADING)


def test_a_demotion_gives_up_when_the_room_it_waits_for_is_not_coming() -> None:
    h = tiered()
    load(h, "a")
    load(h, "b")  # a goes down to ram
    a = h.owner.entries["a"]
    h.acquire("c", {"gpu": 60})  # b waits for a's release from ram
    b = h.owner.entries["b"]
    h.refuse(a)  # the release fails: a's bytes stay in ram for good
    assert a.state is State.QUARANTINED and b.state is State.RELEASING
    assert ("b", Reason.CAPACITY) in h.released
    h.ack(b)
    assert h.owner.entries["c"].state is State.LOADING
    h.core.check()


def test_a_failed_move_quarantines_the_entry_with_both_charges() -> None:
    h = tiered()
    load(h, "a")
    ticket = h.acquire("b", {"gpu": 60})
    a = h.owner.entries["a"]
    h.move(a, error=RuntimeError("device lost"))
    assert a.state is State.QUARANTINED and a.charge == {"gpu": 60, "ram": 60}
    assert h.core.spaces["gpu"].quarantined == 60 and h.core.spaces["ram"].quarantined == 60
    assert h.core.moves_failed == 1
    # Only forget() could make room for b now: it is refused, naming a.
    assert isinstance(ticket.outcome, OutOfSpace) and "p:'a'" in str(ticket.outcome)
    h.core.forget(a)
    assert h.used("gpu") == 0 and h.used("ram") == 0
    assert h.acquire("b", {"gpu": 60}).entry.state is State.LOADING
    h.core.check()


def test_requests_joined_to_a_demotion_get_the_value_after_its_promotion() -> None:
    h = tiered()
    load(h, "a")
    b = h.acquire("b", {"gpu": 60})
    a = h.owner.entries["a"]
    joined = h.acquire("a", {"gpu": 60}, task="u")  # during the move down: it waits
    assert joined.outcome is None and joined.entry is a and a.state is State.MOVING
    h.move(a)  # demoted, with a request waiting: queued to come back up at once
    assert a.state is State.DEMOTED and a in h.core.queue and joined.outcome is None
    assert b.entry.state is State.LOADING  # (b was first in line for the gpu)
    h.finish(b.entry)
    h.end(b)  # b goes (ram is a's until it moves up), and a comes back up
    h.ack(b.entry)
    assert a.state is State.MOVING and a.promoting
    h.move(a)
    assert joined.outcome is True and a.state is State.READY and a.value == "v-a@ram@gpu"
    h.core.check()


def test_a_queued_promotion_left_by_its_last_requester_stays_demoted_and_idle() -> None:
    h = tiered()
    load(h, "a")
    b = h.acquire("b", {"gpu": 60})
    a = h.owner.entries["a"]
    h.move(a)
    h.finish(b.entry)  # b is leased: a's promotion cannot get gpu room
    ticket = h.acquire("a", {"gpu": 60}, task="u")
    assert a in h.core.queue and not a.idle
    h.leave(ticket)
    assert a.state is State.DEMOTED and a not in h.core.queue and a.idle
    assert h.core.spaces["ram"].idle_bytes == 60
    h.core.check()


def test_closing_the_owner_releases_demoted_and_moving_entries() -> None:
    h = tiered()
    load(h, "a")
    load(h, "b")  # a demoted; b is loaded, idle
    h.acquire("c", {"gpu": 60})  # b waits for room in ram
    h.core.close_owner(h.owner, RuntimeError("closed"))
    h.drain()
    released = {key for key, _ in h.released}
    assert {"a", "b"} <= released
    for entry in list(h.releasing):
        h.ack(entry)
    h.core.check()
    assert h.core.spaces["gpu"].used == 0 and h.core.spaces["ram"].used == 0


def test_idle_ttl_expires_a_demoted_entry() -> None:
    h = tiered(idle_ttl=10.0)
    load(h, "a")
    h.acquire("b", {"gpu": 60})
    a = h.owner.entries["a"]
    h.now = 5.0
    h.move(a)  # idle since its lease ended at 0, wherever it is now
    assert h.core.next_expiry() == 10.0
    assert h.core.sweep(10.0) == [a]
    h.drain()
    assert ("a", Reason.IDLE) in h.released


def test_a_measured_move_charges_the_measured_size_where_it_lands() -> None:
    h = tiered()
    load(h, "a")
    h.acquire("b", {"gpu": 60})
    a = h.owner.entries["a"]
    h.move(a, measured={"ram": 30})  # e.g. a compressed copy
    assert a.charge == {"ram": 30} and h.core.spaces["ram"].used == 30
    h.core.check()


def test_a_chain_of_tiers_moves_a_value_down_twice() -> None:
    h = Harness(
        {"gpu": 100, "ram": 100, "disk": 100},
        tiers={"gpu": "ram", "ram": "disk"},
        moves=True,
        instant=True,
    )
    for key in "abc":
        load(h, key)
    entries = h.owner.entries
    assert entries["a"].charge == {"disk": 60} and entries["a"].home == {"gpu": 60}
    assert entries["b"].charge == {"ram": 60} and entries["c"].charge == {"gpu": 60}
    ticket = h.acquire("a", {"gpu": 60})
    assert ticket.outcome is True and entries["a"].charge == {"gpu": 60}
    h.core.check()


def test_spaces_merged_as_one_memory_mid_move_keep_the_books_exact() -> None:
    h = Harness({"gpu": 100, "gpu-b": 100, "ram": 100}, tiers={"gpu": "ram"}, moves=True)
    load(h, "a")
    load(h, "x", 30, "gpu-b")
    h.acquire("b", {"gpu": 60})
    a = h.owner.entries["a"]
    assert a.state is State.MOVING
    h.core.merge_spaces("gpu", "ram")  # the tier turns out to be the same memory
    h.core.check()
    h.move(a)
    h.core.check()
    assert h.core.tiers == {}
    h.core.merge_spaces("gpu", "gpu-b")
    h.core.check()


def test_an_entry_evicted_for_a_space_a_demotion_keeps_is_released_not_demoted() -> None:
    """A demotion frees only the tiered part of a charge: evicted for room in
    its other space, the entry must be released, or the waiter waits for ever."""
    h = Harness({"gpu": 10, "cpu": 4, "ram": 5}, tiers={"gpu": "ram"}, moves=True)
    k1 = h.acquire("k1", {"gpu": 4, "cpu": 2})
    k4 = h.acquire("k4", {"cpu": 3}, task="u")
    h.finish(k1.entry)
    h.end(k1)
    assert ("k1", Reason.CAPACITY) in h.released and h.moving == []
    h.ack(k1.entry)
    assert k4.entry.state is State.LOADING
    h.core.check()


def test_a_request_joining_a_move_down_counts_one_miss_and_the_promotion_is_remembered() -> None:
    h = tiered()
    load(h, "a")
    b = h.acquire("b", {"gpu": 60})
    a = h.owner.entries["a"]
    misses = h.core.misses
    first = h.acquire("a", {"gpu": 60}, task="u")
    second = h.acquire("a", {"gpu": 60}, task="v")
    assert h.core.misses == misses + 1 and first.outcome is None
    h.move(a)  # down, then queued to come back up for its two requesters
    h.finish(b.entry)
    h.end(b)
    h.ack(b.entry)
    h.move(a, seconds=2.0)
    assert first.outcome is True and second.outcome is True
    h.end(first)
    h.end(second)
    h.core.invalidate(h.owner, "a")
    h.drain()
    h.ack(a)
    again = h.acquire("a", {"gpu": 60})  # a new entry of the key: a cold load
    assert again.entry is not a and again.entry.promote_cost == 2.0
    h.core.check()


# -- attacks: what the shell cannot reach on demand ------------------------------------


def settle(h: Harness) -> None:
    while h.loading or h.moving or h.releasing:
        if h.loading:
            h.finish(h.loading[0])
        elif h.moving:
            h.move(h.moving[0][0])
        else:
            h.ack(h.releasing[0])


def test_a_request_for_a_demoted_entry_waiting_to_go_further_down_promotes_it() -> None:
    chain = {"gpu": "ram", "ram": "disk"}
    h = Harness({"gpu": 100, "ram": 100, "disk": 100}, tiers=chain, moves=True)
    for key, size in [("r", {"disk": 80}), ("a", GPU60), ("b", GPU60)]:
        ticket = h.acquire(key, size, task=key.upper())
        settle(h)
        h.end(ticket)
    (a,) = [e for e in h.core.entries() if e.key == "a"]
    assert a.state is State.DEMOTED and a.charge == {"ram": 60}
    h.acquire("x", {"ram": 60}, task="X")  # a must go to disk, once r's release ends
    assert a in h.core.demoting
    again = h.acquire("a", GPU60, task="A2")
    h.core.check()
    assert again.outcome is None or a.charge == {"gpu": 60}, (a, a.charge, a.value)
    settle(h)
    assert again.outcome is True and a.value.endswith("@gpu"), (a.charge, a.value)


def test_a_promotion_forgets_its_lease_holding_requesters() -> None:
    h = Harness({"gpu": 100, "ram": 150}, tiers=TIERS, moves=True)
    a = h.acquire("a", GPU60, task="A")
    settle(h)
    h.end(a)
    h.acquire("x", {"gpu": 30}, task="H")  # H holds x in gpu for good
    settle(h)
    b = h.acquire("b", {"gpu": 40}, task="B")
    settle(h)
    h.end(b)
    assert a.entry.state is State.DEMOTED
    again = h.acquire("a", GPU60, task="H")  # H holds a lease in gpu: a "holding" request
    settle(h)
    assert again.outcome is True
    h.end(again)
    c = h.acquire("c", {"gpu": 70}, task="C")  # a goes down again
    settle(h)
    h.end(c)
    assert a.entry.state is State.DEMOTED
    # w waits for room that only H's lease can free: gpu is blocked for those behind it.
    w = h.acquire("w", {"gpu": 80}, task="W")
    assert w.outcome is None
    late = h.acquire("a", GPU60, task="D")  # D holds nothing: it waits behind w
    assert late.outcome is None and not h.releasing and not h.moving, (
        "a request holding no lease passed an earlier waiter of its space",
        h.releasing,
        h.moving,
    )
    h.core.check()


def merged_mid_move() -> tuple[Harness, Any, Any]:
    """``a`` moving from gpu to ram for ``b``'s room (``b``'s ticket returned too)."""
    h = Harness({"gpu": 100, "ram": 150}, tiers=TIERS, moves=True)
    a = h.acquire("a", GPU60, task="A")
    settle(h)
    h.end(a)
    b = h.acquire("b", GPU60, task="B")
    assert h.moving == [(a.entry, "ram")]
    return h, a.entry, b


def test_merging_the_tiers_during_a_demotion_keeps_the_books() -> None:
    h, a, b = merged_mid_move()
    h.core.merge_spaces("ram", "gpu")
    h.drain()
    h.move(a)
    assert b.entry.state is State.LOADING, (b.entry, h.core.spaces["ram"].used)
    h.core.check()


def test_a_demoted_entry_comes_back_after_its_tiers_merge() -> None:
    h, a, b = merged_mid_move()
    settle(h)
    h.end(b)  # a is demoted in ram, b idle in gpu
    h.core.merge_spaces("ram", "gpu")
    h.drain()
    h.core.check()
    ticket = h.acquire("a", GPU60, task="A2")
    settle(h)
    assert ticket.outcome is True, (a, list(h.core.queue))
    h.core.check()


def test_a_request_joining_a_demotion_counts_as_the_miss_it_is() -> None:
    h = Harness({"gpu": 100, "ram": 150}, tiers=TIERS, moves=True)
    a = h.acquire("a", GPU60, task="A")
    settle(h)
    h.end(a)
    h.acquire("b", GPU60, task="B")  # a goes down
    assert a.entry.state is State.MOVING
    misses = h.core.misses
    joined = h.acquire("a", GPU60, task="J")
    settle(h)
    assert joined.outcome is None and a.entry in h.core.queue  # it waits for a promotion
    assert h.core.misses == misses + 1


def test_a_prefetch_of_an_entry_whose_demotion_waits_counts_no_request() -> None:
    h = Harness(BUDGET, tiers=TIERS, moves=True)
    r = h.acquire("r", {"ram": 80}, task="R")
    settle(h)
    h.end(r)
    a = h.acquire("a", GPU60, task="A")
    settle(h)
    h.end(a)
    h.acquire("b", GPU60, task="B")
    assert a.entry in h.core.demoting
    tick = h.core.tick
    ticket = h.core.prefetch(h.owner, Request("a", dict(GPU60)), "P", h.now)
    h.drain()
    assert ticket is None or ticket.outcome is True
    if ticket is not None:
        h.end(ticket)
    assert h.core.tick == tick, "a prefetch counted as a request"
