"""The scheduler's decisions, tested where they are made: the books, with no event loop.

Placement (which space a request with ``spaces=`` goes to), the grants of one
pass (never more than the bytes that pass has not promised), draining (which
leased entries stop taking leases for a long-waiting request), and merging
two spaces that turn out to be one memory while entries live in both. Each
test drives ``Core`` through ``tests.harness.Harness``, whose ``drain`` fails
a step that never settles instead of hanging.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from cachebroker import LRU, DeadlockError, OutOfSpace, PolicyEntry
from cachebroker._core import Entry, Reason, Request, State, Ticket
from tests.harness import Harness

GPUS = ("gpu0", "gpu1")


def gpus(budget: int = 100, **options: Any) -> Harness:
    return Harness({"gpu0": budget, "gpu1": budget}, **options)


def place(
    h: Harness,
    key: str,
    size: int,
    *,
    cost: float | None = None,
    task: Any = "t",
    priority: int | None = None,
) -> Ticket:
    ticket = h.core.request(
        h.owner, Request(key, {GPUS[0]: size}, cost=cost, places=GPUS, priority=priority), task
    )
    h.drain()
    return ticket


def load(
    h: Harness, key: str, need: dict[str, int], *, task: Any = "t", cost: float | None = None
) -> Ticket:
    """A lease on ``key``, loaded (``cost`` seconds, as measured)."""
    ticket = h.core.request(h.owner, Request(key, need, cost=cost), task)
    h.drain()
    h.finish(ticket.entry)
    return ticket


def idle(h: Harness, key: str, need: dict[str, int], *, cost: float | None = None) -> Entry:
    """``key`` loaded and idle."""
    ticket = load(h, key, need, cost=cost)
    h.end(ticket)
    return ticket.entry


def releases(h: Harness) -> list[str]:
    return [str(key) for key, _ in h.released]


# ---------------------------------------------------------------------- placement


def test_a_placed_request_passes_a_place_where_an_earlier_request_is_unfinished() -> None:
    """First come, first served per space: ``k``'s new load waits in gpu0 for its old
    value's release; a placed request that would fit beside it goes to gpu1 at once
    rather than queue behind it."""
    h = gpus()
    old = idle(h, "k", {"gpu0": 30})
    assert h.core.invalidate(h.owner, "k")
    h.drain()
    assert old.state is State.RELEASING
    again = h.core.request(h.owner, Request("k", {"gpu0": 30}), "u")
    h.drain()
    assert again.entry.state is State.WAITING  # (after the old value's release)
    ticket = place(h, "p", 30)
    assert ticket.entry.state is State.LOADING and ticket.entry.charge == {"gpu1": 30}
    h.ack(old)
    assert again.entry.state is State.LOADING
    h.core.check()


def test_a_place_that_quarantine_makes_too_small_is_left_out() -> None:
    h = gpus()
    stuck = idle(h, "q", {"gpu0": 60})
    h.core.invalidate(h.owner, "q")
    h.drain()
    h.refuse(stuck)  # quarantined: gpu0 can hold 40 at most until it is forgotten
    idle(h, "b", {"gpu1": 80}, cost=100.0)  # dear to evict, and the only way in
    ticket = place(h, "p", 60)
    assert releases(h) == ["q", "b"]
    h.ack(h.owner.entries["b"])
    assert ticket.entry.charge == {"gpu1": 60} and ticket.entry.state is State.LOADING
    h.core.check()


def test_a_place_blocked_by_an_earlier_request_comes_after_the_open_ones() -> None:
    """gpu0 is blocked by an earlier request that nothing can cover yet (a lease
    holds the room): a placed request evicts in gpu1, though gpu0's eviction
    would be cheaper, rather than wait behind it."""
    h = gpus()
    held = load(h, "held", {"gpu0": 70}, task="holder")
    idle(h, "cheap", {"gpu0": 30}, cost=1.0)
    first = h.core.request(h.owner, Request("first", {"gpu0": 90}), "u")
    h.drain()
    assert first.entry.state is State.WAITING and releases(h) == []
    idle(h, "dear", {"gpu1": 80}, cost=50.0)
    ticket = place(h, "p", 60, task="v")
    assert releases(h) == ["dear"]
    h.ack(h.owner.entries["dear"])
    assert ticket.entry.charge == {"gpu1": 60} and ticket.entry.state is State.LOADING
    h.end(held)
    h.core.check()


def test_the_cheapest_place_is_by_the_victims_reload_seconds_summed() -> None:
    """Two victims of 3 s each cost more than one of 5 s."""
    h = gpus()
    idle(h, "a1", {"gpu0": 50}, cost=3.0)
    idle(h, "a2", {"gpu0": 50}, cost=3.0)
    idle(h, "b", {"gpu1": 100}, cost=5.0)
    place(h, "p", 100)
    assert releases(h) == ["b"]


def test_a_request_no_place_can_take_yet_waits_in_its_first_open_place() -> None:
    h = gpus()
    a = load(h, "a", {"gpu0": 80}, task="x")
    b = load(h, "b", {"gpu1": 80}, task="y")
    ticket = place(h, "p", 60, task="z")
    assert ticket.entry.state is State.WAITING and ticket.entry.need == {"gpu0": 60}
    h.end(b)  # b is evicted for it, in gpu1, the place it may now use
    assert releases(h) == ["b"]
    h.ack(b.entry)
    assert ticket.entry.state is State.LOADING and ticket.entry.charge == {"gpu1": 60}
    h.end(a)
    h.core.check()


def test_room_being_freed_is_taken_before_anything_more_is_evicted() -> None:
    h = gpus()
    idle(h, "a", {"gpu0": 100}, cost=1.0)
    going = idle(h, "b", {"gpu1": 100}, cost=9.0)
    h.core.invalidate(h.owner, "b")
    h.drain()
    assert going.state is State.RELEASING
    ticket = place(h, "p", 60)  # gpu1 will have room: a, cheaper, is left alone
    assert releases(h) == ["b"] and ticket.entry.need == {"gpu1": 60}
    h.ack(going)
    assert ticket.entry.state is State.LOADING
    h.core.check()


def test_room_that_an_earlier_promise_takes_is_not_counted_for_a_placed_request() -> None:
    """gpu0's 50 B being released are promised, 30 of them to an earlier request:
    a placed request of 40 does not count on them, and evicts in gpu1."""
    h = gpus()
    going = idle(h, "going", {"gpu0": 50})
    held = load(h, "held", {"gpu0": 50}, task="x")
    h.core.invalidate(h.owner, "going")
    h.drain()
    earlier = h.core.request(h.owner, Request("earlier", {"gpu0": 30}), "u")
    h.drain()
    assert earlier.entry.state is State.WAITING
    idle(h, "other", {"gpu1": 100}, cost=1.0)
    ticket = place(h, "p", 40, task="v")
    assert ticket.entry.need == {"gpu1": 40} and releases(h) == ["going", "other"]
    h.ack(going)
    h.ack(h.owner.entries["other"])
    assert earlier.entry.state is State.LOADING and ticket.entry.state is State.LOADING
    h.end(held)
    h.core.check()


def test_a_place_blocked_by_a_request_of_a_higher_priority_is_not_open_to_a_lower_one() -> None:
    """gpu0 has 30 B free, but an earlier request of priority 5 waits there: a placed
    request of priority 0 goes to gpu1 instead of queueing behind it."""
    h = gpus()
    held = load(h, "held", {"gpu0": 70}, task="x")
    first = h.core.request(h.owner, Request("first", {"gpu0": 90}, priority=5), "u")
    h.drain()
    assert first.entry.state is State.WAITING
    ticket = place(h, "p", 20, task="v", priority=0)
    assert ticket.entry.need == {"gpu1": 20} and ticket.entry.state is State.LOADING
    h.end(held)
    h.core.check()


def test_room_being_freed_is_taken_before_an_eviction_that_costs_nothing() -> None:
    """Freeing gpu0 would cost no reload time, but gpu1 will have room anyway:
    nothing is evicted."""
    h = gpus()
    idle(h, "free", {"gpu0": 100}, cost=0.0)
    idle(h, "going", {"gpu1": 100})
    h.core.invalidate(h.owner, "going")
    h.drain()
    ticket = place(h, "p", 60)
    assert ticket.entry.need == {"gpu1": 60} and releases(h) == ["going"]


def test_the_cheaper_first_place_is_kept_over_a_dearer_later_one() -> None:
    h = gpus()
    idle(h, "a", {"gpu0": 100}, cost=1.0)
    idle(h, "b", {"gpu1": 100}, cost=5.0)
    place(h, "p", 60)
    assert releases(h) == ["a"]


def test_a_place_counts_what_the_same_pass_granted_there() -> None:
    """big's release frees both GPUs at once: one is granted 60 B of gpu0 in that pass,
    so the placed request (50 B) no longer fits beside it there and goes to gpu1."""
    h = gpus()
    big = load(h, "big", {"gpu0": 100, "gpu1": 100}, task="x")
    one = h.core.request(h.owner, Request("one", {"gpu0": 60}), "u")
    h.drain()
    ticket = place(h, "p", 50, task="v")
    assert one.entry.state is State.WAITING and ticket.entry.state is State.WAITING
    h.end(big)
    h.ack(big.entry)
    assert one.entry.state is State.LOADING and one.entry.charge == {"gpu0": 60}
    assert ticket.entry.state is State.LOADING and ticket.entry.charge == {"gpu1": 50}
    h.core.check()


def test_a_place_blocked_at_its_priority_is_closed_even_where_eviction_is_cheaper() -> None:
    """gpu0's 30 idle B would cover the request (and cost 1 s against 50), but an
    earlier request of the same priority is blocked there: the request evicts in gpu1."""
    h = gpus()
    held = load(h, "held", {"gpu0": 70}, task="holder")
    idle(h, "cheap", {"gpu0": 30}, cost=1.0)
    first = h.core.request(h.owner, Request("first", {"gpu0": 90}), "u")
    h.drain()
    assert first.entry.state is State.WAITING
    idle(h, "dear", {"gpu1": 80}, cost=50.0)
    ticket = place(h, "p", 30, task="v")
    assert ticket.entry.need == {"gpu1": 30} and releases(h) == ["dear"]
    h.end(held)


def test_a_place_the_request_fills_exactly_is_a_fit() -> None:
    """100 B fit an empty gpu0 of 100 B exactly: it goes there, the first place, though
    gpu1 (200 B) would have room to spare."""
    h = Harness({"gpu0": 100, "gpu1": 200})
    ticket = place(h, "p", 100)
    assert ticket.entry.need == {"gpu0": 100} and ticket.entry.state is State.LOADING


def test_room_being_freed_that_the_request_fills_exactly_is_room() -> None:
    """Neither place fits now; the 100 B gpu0 is releasing are just enough, and come
    before gpu1's 150 B."""
    h = Harness({"gpu0": 100, "gpu1": 200})
    going0 = idle(h, "going0", {"gpu0": 100})
    going1 = idle(h, "going1", {"gpu1": 150})
    held = load(h, "held", {"gpu1": 50}, task="x")
    for key in ("going0", "going1"):
        h.core.invalidate(h.owner, key)
    h.drain()
    assert going0.state is State.RELEASING and going1.state is State.RELEASING
    ticket = place(h, "p", 100, task="v")
    assert ticket.entry.need == {"gpu0": 100}
    h.ack(going0)
    assert ticket.entry.state is State.LOADING
    h.ack(going1)
    h.end(held)
    h.core.check()


def test_the_price_of_a_place_counts_its_room_being_freed() -> None:
    """gpu0 is 60 B short of room for the request, 20 of them being released: the other
    40 are cheap's (1 s); gpu1 would cost 5 s: cheap is evicted."""
    h = gpus()
    going = idle(h, "going", {"gpu0": 20})
    idle(h, "cheap", {"gpu0": 40}, cost=1.0)
    held = load(h, "held", {"gpu0": 40}, task="x")
    h.core.invalidate(h.owner, "going")
    h.drain()
    idle(h, "dear", {"gpu1": 100}, cost=5.0)
    ticket = place(h, "p", 60, task="v")
    assert ticket.entry.need == {"gpu0": 60} and releases(h) == ["going", "cheap"]
    h.ack(going)
    h.end(held)


def test_a_placed_request_no_place_can_hold_any_more_is_refused() -> None:
    """Each place's eviction for the request fails (quarantined), until neither can
    ever hold it without forget(): it is refused, as out of space."""
    h = gpus()
    for gpu in GPUS:
        load(h, f"held-{gpu}", {gpu: 30}, task=f"x-{gpu}")
        idle(h, f"q-{gpu}", {gpu: 70})
    ticket = place(h, "p", 60, task="v")
    assert ticket.outcome is None and releases(h) == ["q-gpu0"]
    h.refuse(h.owner.entries["q-gpu0"])  # gpu0 can hold 30 at most now: p tries gpu1
    assert ticket.outcome is None and ticket.entry.need == {"gpu1": 60}
    assert releases(h) == ["q-gpu0", "q-gpu1"]
    h.refuse(h.owner.entries["q-gpu1"])
    assert isinstance(ticket.outcome, OutOfSpace)


# ------------------------------------------------------------ the grants of one pass


def test_one_pass_grants_no_more_than_the_bytes_it_has_not_promised() -> None:
    """Two waiters of 60 B, and 100 B free at once: the first is granted; the second
    is not, though it would fit the free bytes if the first's were not counted."""
    h = Harness({"m": 100})
    big = load(h, "big", {"m": 100}, task="x")
    one = h.core.request(h.owner, Request("one", {"m": 60}), "u")
    two = h.core.request(h.owner, Request("two", {"m": 60}), "v")
    h.drain()
    h.end(big)
    h.ack(big.entry)
    assert one.entry.state is State.LOADING and two.entry.state is State.WAITING
    assert h.used() == 60
    h.core.check()
    h.finish(one.entry)
    h.end(one)  # one is evicted for two
    h.ack(one.entry)
    assert two.entry.state is State.LOADING and h.used() == 60
    h.core.check()


def test_bytes_still_being_released_are_promised_but_not_granted_twice() -> None:
    """The room of a release in flight counts toward a waiter's promise, not toward
    a grant: with 40 B still releasing, a pass that grants 50 B does not grant the
    next 50 B too, though the two fit the promise."""
    h = Harness({"m": 100})
    slow = idle(h, "slow", {"m": 40})
    quick = load(h, "quick", {"m": 60}, task="x")
    one = h.core.request(h.owner, Request("one", {"m": 50}), "u")
    two = h.core.request(h.owner, Request("two", {"m": 50}), "v")
    h.drain()
    h.end(quick)  # both idle entries go for them
    assert releases(h) == ["slow", "quick"]
    h.ack(quick.entry)  # 40 B still releasing
    assert one.entry.state is State.LOADING and two.entry.state is State.WAITING
    assert h.used() == 90
    h.core.check()
    h.ack(slow)
    assert two.entry.state is State.LOADING and h.used() == 100
    h.core.check()


def test_a_request_of_a_lower_priority_waits_behind_a_blocked_higher_one() -> None:
    """An earlier request of priority 5 that nothing can cover yet blocks its space
    for later ones up to its priority, even one that would fit the free bytes."""
    h = Harness({"m": 100})
    held = load(h, "held", {"m": 80}, task="x")
    first = h.core.request(h.owner, Request("first", {"m": 50}, priority=5), "u")
    low = h.core.request(h.owner, Request("low", {"m": 10}, priority=0), "v")
    h.drain()
    assert first.entry.state is State.WAITING and low.entry.state is State.WAITING
    h.end(held)  # evicted for first; then both fit
    h.ack(held.entry)
    assert first.entry.state is State.LOADING and low.entry.state is State.LOADING
    h.core.check()


def test_a_later_request_that_fits_is_not_granted_ahead_in_the_same_space() -> None:
    """FIFO per space: a small request behind an unfinished earlier one waits,
    though its bytes are free."""
    h = Harness({"m": 100})
    old = idle(h, "k", {"m": 30})
    h.core.invalidate(h.owner, "k")
    h.drain()
    first = h.core.request(h.owner, Request("k", {"m": 30}), "u")  # after its old value's release
    late = h.core.request(h.owner, Request("late", {"m": 10}), "v")
    h.drain()
    assert first.entry.state is State.WAITING and late.entry.state is State.WAITING
    h.ack(old)
    assert first.entry.state is State.LOADING and late.entry.state is State.LOADING
    h.core.check()


# ------------------------------------------------------------------------ draining


def draining(h: Harness) -> set[str]:
    return {str(e.key) for e in h.core.entries() if e.doomed is not None}


def crowded(**options: Any) -> tuple[Harness, dict[str, Ticket]]:
    """100 B held by three leases of 30 B, requested in the order a, b, c, then a again."""
    h = Harness({"m": 100}, **options)
    h.core.fair_requests = 3
    held = {key: load(h, key, {"m": 30}, task=f"task-{key}") for key in "abc"}
    again = h.core.request(h.owner, Request("a"), "task-a2")  # a: the most recently requested
    h.drain()
    held["a2"] = again
    return h, held


def serve_requests(h: Harness, n: int) -> None:
    """``n`` requests served (hits on an entry of another cache), which let time pass."""
    other = h.core.open_owner("other")
    for i in range(n):
        ticket = h.core.request(other, Request(f"tiny-{i}", {}), "w")
        h.drain()
        h.finish(ticket.entry)
        h.end(ticket)


def test_draining_waits_for_its_turn_then_dooms_the_least_recently_requested_first() -> None:
    h, held = crowded()
    waiter = h.core.request(h.owner, Request("w", {"m": 50}), "u")  # 10 B free: short of 40
    h.drain()
    assert draining(h) == set()  # not before fair_requests more requests were served
    serve_requests(h, 3)
    assert draining(h) == {"b", "c"}  # b then c cover 40; a was requested last
    for key in ("b", "c"):
        h.end(held[key])
        h.ack(held[key].entry)
    assert waiter.entry.state is State.LOADING
    h.core.check()


def test_draining_stops_as_soon_as_the_shortfall_is_covered_exactly() -> None:
    h, _held = crowded()
    h.core.request(h.owner, Request("w", {"m": 40}), "u")  # 10 B free: short of exactly 30
    h.drain()
    serve_requests(h, 3)
    assert draining(h) == {"b"}


def test_draining_looks_past_leased_entries_of_other_spaces() -> None:
    h = Harness({"m": 100, "n": 100})
    h.core.fair_requests = 3
    elsewhere = load(h, "elsewhere", {"n": 50}, task="e")  # leased first, in another space
    for key in "ab":
        load(h, key, {"m": 50}, task=f"task-{key}")
    h.core.request(h.owner, Request("w", {"m": 50}), "u")
    h.drain()
    serve_requests(h, 3)
    assert draining(h) == {"a"}
    assert elsewhere.entry.doomed is None


def hits(h: Harness, n: int, *, end: bool = True) -> list[Ticket]:
    """``n`` hits on an entry of another cache: each moves the request clock by one;
    a lease that ends is when a waiter's turn to drain is looked at."""
    other = h.core.owners.get("other") or h.core.open_owner("other")
    if "tiny" not in other.entries:
        first = h.core.request(other, Request("tiny", {}), "w")
        h.drain()
        h.finish(first.entry)
        h.end(first)
    tickets = []
    for i in range(n):
        ticket = h.core.request(other, Request("tiny"), f"hit-{i}")
        h.drain()
        assert ticket.outcome is True  # a hit
        if end:
            h.end(ticket)
        tickets.append(ticket)
    return tickets


def test_draining_starts_exactly_at_its_turn() -> None:
    h, _held = crowded()
    hits(h, 0)  # (the entry hit is loaded before the waiter asks)
    h.core.request(h.owner, Request("w", {"m": 50}), "u")
    h.drain()
    hits(h, 1)
    assert draining(h) == set()
    hits(h, 1)  # fair_requests (3) requests since it was queued, its own the first
    assert draining(h) == {"b", "c"}


def test_a_turn_passed_unnoticed_is_taken_at_the_next_lease_end() -> None:
    h, _held = crowded()
    hits(h, 0)
    h.core.request(h.owner, Request("w", {"m": 50}), "u")
    h.drain()
    held = hits(h, 5, end=False)  # past its turn, and no lease ended meanwhile
    assert draining(h) == set()
    h.end(held[0])
    assert draining(h) == {"b", "c"}


def test_draining_spares_pinned_entries_and_those_of_a_higher_priority() -> None:
    h, held = crowded()
    h.core.configure(held["b"].entry, pin=True)
    h.core.limit(held["c"].entry, priority=5)
    waiter = h.core.request(h.owner, Request("w", {"m": 40}), "u")  # short of 30
    h.drain()
    serve_requests(h, 3)
    assert draining(h) == {"a"}
    assert waiter.entry.state is State.WAITING
    h.core.check()


def test_a_request_of_a_higher_priority_drains_entries_of_lower_ones() -> None:
    h, _held = crowded()
    waiter = h.core.request(h.owner, Request("w", {"m": 50}, priority=5), "u")
    h.drain()
    serve_requests(h, 3)
    assert draining(h) == {"b", "c"}
    assert waiter.entry.state is State.WAITING
    h.core.check()


def test_draining_leaves_entries_with_no_lease_alone() -> None:
    """A loading entry is busy but has no lease to end: it is not drained."""
    h = Harness({"m": 100})
    h.core.fair_requests = 3
    loading = h.core.request(h.owner, Request("loading", {"m": 10}), "l")  # requested first
    h.drain()
    held = {key: load(h, key, {"m": 30}, task=f"task-{key}") for key in "abc"}
    waiter = h.core.request(h.owner, Request("w", {"m": 50}), "u")
    h.drain()
    serve_requests(h, 3)
    assert draining(h) == {"a", "b"}
    assert loading.entry.state is State.LOADING and waiter.entry.state is State.WAITING
    assert held["c"].entry.doomed is None
    h.core.check()


def test_draining_counts_what_is_already_coming() -> None:
    """An idle entry and one already draining cover part of the shortfall: only
    what is still missing is drained."""
    h, _held = crowded()
    h.core.invalidate(h.owner, "b")  # b gives its key up: released at its last lease's end
    h.drain()
    waiter = h.core.request(h.owner, Request("w", {"m": 60}), "u")  # short of 50: b brings 30
    h.drain()
    serve_requests(h, 3)
    assert draining(h) == {"b", "c"}
    assert waiter.entry.state is State.WAITING
    h.core.check()


# ------------------------------------------------------------------ merging spaces


def test_merging_spaces_with_live_entries_adds_their_books_and_keeps_every_promise() -> None:
    h = Harness({"gpu": 100, "cuda": 100})
    leased = load(h, "leased", {"gpu": 40}, task="x")
    spare = idle(h, "spare", {"cuda": 30})
    going = idle(h, "going", {"cuda": 20})
    h.core.invalidate(h.owner, "going")
    h.drain()
    waiting = h.core.request(h.owner, Request("w", {"cuda": 60}), "u")  # promised going's 20
    h.drain()
    assert waiting.entry.state is State.WAITING and releases(h) == ["going"]
    h.core.merge_spaces("gpu", "cuda")
    h.drain()
    space = h.core.spaces["gpu"]
    assert h.core.spaces["cuda"] is space and h.core.canon["cuda"] == "gpu"
    assert spare.charge == {"gpu": 30} and leased.entry.charge == {"gpu": 40}
    assert waiting.entry.need == {"gpu": 60}
    # One memory of 100 B holds 40 + 30 + 20 (releasing): the waiter is 30 short,
    # and the idle entry covers it.
    assert space.used == 90 and space.releasing == 50 and releases(h) == ["going", "spare"]
    h.core.check()
    h.ack(going)
    assert waiting.entry.state is State.WAITING
    h.ack(spare)
    assert waiting.entry.state is State.LOADING and space.used == 100
    h.core.check()
    h.end(leased)
    h.core.check()


def test_a_waiter_of_a_merged_space_waits_in_the_one_memory() -> None:
    h = Harness({"gpu": 100, "cuda": 100})
    leased = load(h, "leased", {"gpu": 70}, task="x")
    h.core.merge_spaces("gpu", "cuda")
    h.drain()
    waiter = h.core.request(h.owner, Request("w", {"cuda": 50}), "u")
    h.drain()
    assert waiter.entry.need == {"gpu": 50} and waiter.entry.state is State.WAITING
    h.end(leased)  # evicted for it
    assert releases(h) == ["leased"]
    h.ack(leased.entry)
    assert waiter.entry.state is State.LOADING
    assert h.released == [("leased", Reason.CAPACITY)]
    h.core.check()


# ----------------------------------------------------------------------- refusal


def test_a_holders_request_left_to_its_own_leases_by_a_failed_release_is_refused() -> None:
    """t holds 50 B and asks for 50 more: the idle 50 B are evicted for it; their
    release fails, so only t's own lease could make room: t's request is refused
    (a wait on itself), where before it waited for the release."""
    h = Harness({"m": 100})
    mine = load(h, "mine", {"m": 50}, task="t")
    other = idle(h, "other", {"m": 50})
    ticket = h.core.request(h.owner, Request("more", {"m": 50}), "t")
    h.drain()
    assert ticket.outcome is None and releases(h) == ["other"]
    h.refuse(other)
    assert isinstance(ticket.outcome, DeadlockError)
    assert "more" not in h.owner.entries or h.owner.entries["more"].state is State.GONE
    h.end(mine)
    h.core.check()


# ----------------------------------------------------------------------- overdraft


def test_an_overdraft_is_repaid_with_what_idle_entries_there_are_even_if_short() -> None:
    """A load measured 40 B over what it declared: the 20 B idle go at once, though
    they repay only half; the rest waits for the lease to end."""
    h = Harness({"m": 100})
    spare = idle(h, "spare", {"m": 20})
    held = load(h, "held", {"m": 40}, task="x")
    big = h.core.request(h.owner, Request("big", {"m": 30}), "u")
    h.drain()
    h.finish(big.entry, measured={"m": 70})
    assert releases(h) == ["spare"]
    h.ack(spare)
    assert h.used() == 110
    h.end(held)  # the rest of the overdraft
    assert releases(h) == ["spare", "held"]
    h.ack(held.entry)
    assert h.used() == 70
    h.core.check()


# ------------------------------------------------------------------ blocked spaces


def test_a_space_stays_blocked_up_to_the_highest_priority_blocked_there() -> None:
    """A request of priority 0 held back behind a blocked one of priority 5 blocks the
    space too, but does not lower its bar: a request of priority 3 that fits the free
    bytes still waits behind the one of priority 5."""
    h = Harness({"m": 100})
    held = load(h, "held", {"m": 80}, task="x")
    first = h.core.request(h.owner, Request("first", {"m": 50}, priority=5), "u")
    low = h.core.request(h.owner, Request("low", {"m": 10}, priority=0), "v")
    mid = h.core.request(h.owner, Request("mid", {"m": 10}, priority=3), "w")
    h.drain()
    assert [t.entry.state for t in (first, low, mid)] == [State.WAITING] * 3
    h.end(held)  # evicted for first; then all three fit
    h.ack(held.entry)
    assert [t.entry.state for t in (first, low, mid)] == [State.LOADING] * 3
    h.core.check()


def test_a_higher_priority_blocked_after_a_lower_one_raises_the_bar() -> None:
    """m is blocked by a request of priority 0, then by one of priority 5 (which may
    pass it, but nothing can cover it either): a request of priority 3 that fits the
    free bytes waits behind the one of priority 5."""
    h = Harness({"m": 100})
    held = load(h, "held", {"m": 80}, task="x")
    low = h.core.request(h.owner, Request("low", {"m": 50}, priority=0), "u")
    high = h.core.request(h.owner, Request("high", {"m": 50}, priority=5), "v")
    mid = h.core.request(h.owner, Request("mid", {"m": 10}, priority=3), "w")
    h.drain()
    assert [t.entry.state for t in (low, high, mid)] == [State.WAITING] * 3
    h.end(held)
    h.ack(held.entry)
    assert [t.entry.state for t in (low, high, mid)] == [State.LOADING] * 2 + [State.WAITING]
    h.core.check()


def test_a_request_held_back_in_one_space_blocks_its_other_spaces_too() -> None:
    """b waits behind a in m (and is short there); it blocks n as well, where it would
    fit: c, which needs only n, waits behind it rather than take n first."""
    h = Harness({"m": 100, "n": 100})
    held = load(h, "held", {"m": 80}, task="x")
    a = h.core.request(h.owner, Request("a", {"m": 50}), "u")
    b = h.core.request(h.owner, Request("b", {"m": 30, "n": 10}), "v")
    c = h.core.request(h.owner, Request("c", {"n": 10}), "w")
    h.drain()
    assert [t.entry.state for t in (a, b, c)] == [State.WAITING] * 3
    h.end(held)
    h.ack(held.entry)
    assert [t.entry.state for t in (a, b, c)] == [State.LOADING] * 3
    h.core.check()


@pytest.mark.parametrize("first_priority", [0, 5])
def test_a_lease_holder_passing_a_blocked_space_drains_none_of_it(first_priority: int) -> None:
    """first (of t's priority 0, or higher) is blocked in m and drains a for its 30 B.
    t holds a lease in m and asks for 70 B there: it may pass first, but m is first's
    to drain: t's request drains nothing more there (not b)."""
    h = Harness({"m": 100})
    h.core.fair_requests = 3
    load(h, "a", {"m": 30}, task="task-a")
    load(h, "b", {"m": 30}, task="task-b")
    load(h, "mine", {"m": 20}, task="t")
    first = h.core.request(h.owner, Request("first", {"m": 50}, priority=first_priority), "u")
    more = h.core.request(h.owner, Request("more", {"m": 70}, priority=0), "t")
    h.drain()
    assert first.entry.state is State.WAITING and more.entry.state is State.WAITING
    serve_requests(h, 3)
    assert draining(h) == {"a"}


def test_a_request_that_waits_aside_behind_another_blocks_none_of_its_spaces() -> None:
    """b waits behind a in m, and no eviction could let it in there (60 B are pinned):
    it waits aside, blocking nobody, so c takes n at once, though b needs n too."""
    h = Harness({"m": 100, "n": 100})
    pinned = load(h, "pinned", {"m": 60}, task="x")
    h.core.configure(pinned.entry, pin=True)
    held = load(h, "held", {"m": 40}, task="y")
    a = h.core.request(h.owner, Request("a", {"m": 30}), "u")
    b = h.core.request(h.owner, Request("b", {"m": 50, "n": 10}), "v")
    c = h.core.request(h.owner, Request("c", {"n": 10}), "w")
    h.drain()
    assert a.entry.state is State.WAITING and b.entry.state is State.WAITING
    assert c.entry.state is State.LOADING
    h.end(held)
    h.ack(held.entry)
    assert a.entry.state is State.LOADING and b.entry.state is State.WAITING
    h.core.check()


# ------------------------------------------------------------------------- tiers


def tiered(budget: dict[str, int]) -> Harness:
    return Harness(budget, tiers={"gpu": "ram"}, moves=True)


def test_the_room_a_waiting_demotion_takes_is_promised_to_it_first() -> None:
    """a's demotion waits in ram for r's release (50 of the 60 B it takes there): ram
    will have 10 B beside it, so a later request of 11 B in ram is 1 B short, and
    evicts s for it, rather than count on the room a will fill."""
    h = tiered({"gpu": 100, "ram": 100})
    r = idle(h, "r", {"ram": 50})
    idle(h, "s", {"ram": 30})
    a = idle(h, "a", {"gpu": 60})
    b = h.core.request(h.owner, Request("b", {"gpu": 60}), "u")
    h.drain()
    assert a in h.core.demoting and releases(h) == ["r"] and not h.moving
    c = h.core.request(h.owner, Request("c", {"ram": 11}), "v")
    h.drain()
    assert releases(h) == ["r", "s"] and c.entry.state is State.WAITING
    h.ack(r)
    h.ack(h.owner.entries["s"])
    h.move(a)
    assert b.entry.state is State.LOADING and c.entry.state is State.LOADING
    h.core.check()


def test_a_value_as_large_as_its_space_comes_back_up_from_the_tier_below() -> None:
    """A promotion of 100 B into a space of 100 B is attainable (at most the space's
    size, not under it): it is granted, not refused."""
    h = tiered({"gpu": 100, "ram": 150})
    a = idle(h, "a", {"gpu": 100})
    b = h.core.request(h.owner, Request("b", {"gpu": 100}), "u")
    h.drain()
    assert h.moving == [(a, "ram")]
    h.move(a)
    assert a.state is State.DEMOTED and b.entry.state is State.LOADING
    h.fail(b.entry, RuntimeError("no"))
    again = h.core.request(h.owner, Request("a", {"gpu": 100}), "v")
    h.drain()
    assert again.outcome is None and again.entry is a and h.moving == [(a, "gpu")]
    h.move(a)
    assert again.outcome is True and a.charge == {"gpu": 100}
    h.core.check()


def test_a_promotion_asks_only_for_the_bytes_it_does_not_hold_already() -> None:
    """a keeps its 10 B of cpu (no tier there) while demoted from gpu: brought back
    up, it asks for gpu's 60 B only; asking for its cpu bytes again, beside
    themselves, it would wait for ever (cpu holds 15)."""
    h = tiered({"gpu": 100, "cpu": 15, "ram": 100})
    a = idle(h, "a", {"gpu": 60, "cpu": 10})
    b = h.core.request(h.owner, Request("b", {"gpu": 60}), "u")
    h.drain()
    h.move(a)
    h.finish(b.entry)
    h.end(b)
    assert a.state is State.DEMOTED and a.charge == {"cpu": 10, "ram": 60}
    ticket = h.core.request(h.owner, Request("a", {"gpu": 60, "cpu": 10}), "v")
    h.drain()
    for _ in range(10):  # b goes down (or out), a comes up
        if ticket.outcome is not None:
            break
        if h.moving:
            h.move(h.moving[0][0])
        else:
            h.ack(h.releasing[0])
    assert ticket.outcome is True and a.charge == {"gpu": 60, "cpu": 10}
    assert h.used("cpu") == 10
    h.core.check()


# ------------------------------------------------------------- the policy's answer


class Asked(LRU):
    """LRU that records each shortfall it is asked to cover, and answers ``answer``'s
    victims instead when a test sets it (a policy that breaks its contract)."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[dict[str, int]] = []
        self.answer: list[Any] | None = None

    def victims(self, shortfall: Mapping[str, int]) -> list[PolicyEntry]:
        self.asked.append(dict(shortfall))
        if self.answer is not None:
            return list(self.answer)
        return super().victims(shortfall)


class Stranger:
    """Looks like an entry to a policy, but is none of the books' own."""

    def __init__(self) -> None:
        self.key = "stranger"
        self.cache = "p"
        self.charge = {"m": 100}
        self.cost = 1.0
        self.requests = 1
        self.last_request = 1
        self.idle = True
        self.idle_seq = 1


def rogue(answer: Any) -> tuple[Harness, Asked]:
    """A full space of one idle entry, whose policy answers ``answer(h)`` for victims."""
    policy = Asked()
    h = Harness({"m": 100}, policy=policy)
    idle(h, "a", {"m": 100})
    policy.answer = [answer(h)]
    return h, policy


def test_a_victim_that_is_not_one_of_the_books_entries_is_an_error() -> None:
    h, _ = rogue(lambda h: Stranger())
    with pytest.raises(RuntimeError, match="not an idle entry"):
        h.core.request(h.owner, Request("b", {"m": 10}), "u")


def test_a_leased_victim_is_an_error() -> None:
    """c, idle, could cover the request; the policy names a instead, which is leased."""
    h = Harness({"m": 100}, policy=(policy := Asked()))
    a = load(h, "a", {"m": 50}, task="x")
    idle(h, "c", {"m": 50})
    policy.answer = [a.entry]
    with pytest.raises(RuntimeError, match="not an idle entry"):
        h.core.request(h.owner, Request("b", {"m": 40}), "u")
    assert policy.asked == [{"m": 40}]


def test_a_victim_still_loading_is_an_error() -> None:
    """An entry whose load runs on with no lease is not idle either: no victim."""
    h = Harness({"m": 100}, policy=(policy := Asked()))
    idle(h, "c", {"m": 50})
    loading = h.core.request(h.owner, Request("l", {"m": 50}), "x")
    h.drain()
    h.core.leave(loading)
    h.drain()
    assert loading.entry.state is State.LOADING and not loading.entry.leases
    policy.answer = [loading.entry]
    with pytest.raises(RuntimeError, match="not an idle entry"):
        h.core.request(h.owner, Request("b", {"m": 40}), "u")


def test_a_place_counts_only_the_victims_bytes_in_that_place() -> None:
    """For gpu0 the policy offers b, an idle entry of gpu1 only: that covers nothing in
    gpu0, so gpu0 is no option (though b's reload would cost what it costs in gpu1);
    the request goes to gpu1, where b is evicted for it."""
    policy = Asked()
    h = gpus(policy=policy)
    idle(h, "a", {"gpu0": 100}, cost=9.0)
    b = idle(h, "b", {"gpu1": 100}, cost=5.0)
    policy.answer = None
    original = policy.victims

    def sloppy(shortfall: Mapping[str, int]) -> list[PolicyEntry]:
        return [b] if "gpu0" in shortfall else original(shortfall)

    policy.victims = sloppy  # type: ignore[method-assign]
    ticket = place(h, "p", 1)
    assert ticket.entry.need == {"gpu1": 1} and releases(h) == ["b"]


@pytest.mark.parametrize("spare_size", [30, 40])
def test_an_overdraft_the_releases_in_flight_repay_asks_for_no_more_victims(
    spare_size: int,
) -> None:
    """Measured 30 B over what it declared, a load overdraws m by 30; the idle spare
    (30 or 40 B) repays it. Once it is releasing, the overdraft is covered: the policy
    is not asked again while it lasts, though a lease ends meanwhile."""
    policy = Asked()
    h = Harness({"m": 100}, policy=policy)
    spare = idle(h, "spare", {"m": spare_size})
    held = load(h, "held", {"m": 40}, task="x")
    big = h.core.request(h.owner, Request("big", {"m": 60 - spare_size}), "u")
    h.drain()
    h.finish(big.entry, measured={"m": 90 - spare_size})
    assert releases(h) == ["spare"] and policy.asked == [{"m": 30}]
    h.end(held)
    assert releases(h) == ["spare"] and policy.asked == [{"m": 30}]
    h.ack(spare)
    assert h.used() == 130 - spare_size
    h.core.check()


def test_an_overdraft_of_one_byte_is_repaid() -> None:
    policy = Asked()
    h = Harness({"m": 100}, policy=policy)
    spare = idle(h, "spare", {"m": 10})
    big = h.core.request(h.owner, Request("big", {"m": 90}), "u")
    h.drain()
    h.finish(big.entry, measured={"m": 91})
    assert releases(h) == ["spare"] and policy.asked == [{"m": 1}]
    h.ack(spare)
    h.core.check()


def test_a_place_whose_idle_bytes_fall_a_byte_short_is_no_option() -> None:
    """gpu0 is 50 B short and holds 49 idle (cheap to reload): no eviction there could
    let the request in, so it evicts the dearer b in gpu1."""
    h = gpus()
    held = load(h, "held", {"gpu0": 51}, task="x")
    idle(h, "a", {"gpu0": 49}, cost=1.0)
    idle(h, "b", {"gpu1": 100}, cost=5.0)
    ticket = place(h, "p", 50, task="v")
    assert ticket.entry.need == {"gpu1": 50} and releases(h) == ["b"]
    h.end(held)
    h.core.check()


def test_a_placed_holder_that_waits_on_itself_in_one_place_only_is_not_refused() -> None:
    """t holds 50 B of gpu1 and asks for 50 B in gpu0 or gpu1. Once 10 B of gpu1 are
    quarantined, only t's own lease could make room there; but in gpu0 another's
    lease will end: t's request is not refused (it waits in gpu0, and gets in)."""
    h = gpus()
    mine = load(h, "mine", {"gpu1": 50}, task="t")
    filler = load(h, "filler", {"gpu1": 40}, task="y")
    stuck = idle(h, "stuck", {"gpu1": 10})
    other = load(h, "other", {"gpu0": 60}, task="x")
    ticket = place(h, "p", 50, task="t")
    assert ticket.outcome is None and ticket.holds and ticket.entry.need == {"gpu0": 50}
    h.core.invalidate(h.owner, "stuck")
    h.drain()
    h.refuse(stuck)  # gpu1 can hold 90 at most until it is forgotten
    assert ticket.outcome is None and stuck.state is State.QUARANTINED
    h.end(other)
    h.ack(other.entry)
    assert ticket.entry.state is State.LOADING and ticket.entry.charge == {"gpu0": 50}
    h.end(mine)
    h.end(filler)
    h.core.check()


def test_a_drain_of_a_higher_priority_counts_the_idle_bytes_of_lower_ones_as_coming() -> None:
    """A request of priority 5 is 40 B short; the 10 B idle (of priority 0, which it
    may evict) are coming, so draining b (30 B) covers the rest: c is not drained."""
    h, _held = crowded()
    idle(h, "spare", {"m": 10})
    waiter = h.core.request(h.owner, Request("w", {"m": 40}, priority=5), "u")
    h.drain()
    serve_requests(h, 3)
    assert draining(h) == {"b"}
    assert waiter.entry.state is State.WAITING
    h.core.check()


def test_a_placed_victim_choice_counts_no_bytes_of_victims_charged_elsewhere() -> None:
    """For gpu0 the policy offers a (exactly the 60 B short there) and d, of gpu1: a
    covers gpu0, at 1 + 5 s, cheaper than gpu1's 105 s, so the request goes to gpu0."""
    policy = Asked()
    h = gpus(policy=policy)
    held = load(h, "held", {"gpu0": 40}, task="x")
    idle(h, "a", {"gpu0": 60}, cost=1.0)
    idle(h, "e", {"gpu1": 50}, cost=100.0)
    d = idle(h, "d", {"gpu1": 50}, cost=5.0)
    original = policy.victims

    def sloppy(shortfall: Mapping[str, int]) -> list[PolicyEntry]:
        found = original(shortfall)
        return [*found, d] if "gpu0" in shortfall else found

    policy.victims = sloppy  # type: ignore[method-assign]
    ticket = place(h, "p", 60, task="v")
    assert ticket.entry.need == {"gpu0": 60}
    h.end(held)


def test_the_policy_is_not_asked_when_idle_bytes_cannot_cover_the_shortfall() -> None:
    """30 B short with 10 idle: no victims could let the request in; the policy is not
    even asked, and nothing is released."""
    policy = Asked()
    h = Harness({"m": 100}, policy=policy)
    held = load(h, "held", {"m": 80}, task="x")
    idle(h, "spare", {"m": 10})
    ticket = h.core.request(h.owner, Request("w", {"m": 50}), "u")
    h.drain()
    assert ticket.entry.state is State.WAITING and policy.asked == [] and releases(h) == []
    h.end(held)


def test_victims_a_byte_short_of_the_shortfall_are_not_released() -> None:
    """The policy offers 49 B for a 50 B shortfall: releasing them would let nobody in."""
    policy = Asked()
    h = Harness({"m": 100}, policy=policy)
    a = idle(h, "a", {"m": 49})
    idle(h, "b", {"m": 51})
    policy.answer = [a]
    ticket = h.core.request(h.owner, Request("w", {"m": 50}), "u")
    h.drain()
    assert policy.asked == [{"m": 50}] and releases(h) == []
    assert ticket.entry.state is State.WAITING


def test_a_pinned_victim_is_an_error() -> None:
    """A pinned entry is no candidate, idle or not: a policy may not name it."""
    h = Harness({"m": 100}, policy=(policy := Asked()))
    pinned = idle(h, "pinned", {"m": 50})
    h.core.configure(pinned, pin=True)
    idle(h, "c", {"m": 50})
    policy.answer = [pinned]
    with pytest.raises(RuntimeError, match="not an idle entry"):
        h.core.request(h.owner, Request("b", {"m": 40}), "u")


def test_a_covered_request_drains_nothing() -> None:
    """Draining is for a request no eviction covers: one that its victims cover dooms
    no leased entry, even past its turn."""
    h = Harness({"m": 100})
    h.core.fair_requests = 0
    load(h, "a", {"m": 30}, task="x")
    idle(h, "i", {"m": 50})
    ticket = h.core.request(h.owner, Request("w", {"m": 70}), "u")
    h.drain()
    assert releases(h) == ["i"] and draining(h) == set()
    h.ack(h.owner.entries["i"])
    assert ticket.entry.state is State.LOADING


def test_a_demotion_granted_room_lets_a_waiter_in_beside_it_in_the_same_step() -> None:
    """a's demotion waits for r's release in ram; c waits behind it, for the 10 B left
    beside it (no eviction: it is not short). r's release gives a its room, and c is
    granted in that same step."""
    h = tiered({"gpu": 100, "ram": 100})
    r = idle(h, "r", {"ram": 50})
    idle(h, "s", {"ram": 30})
    a = idle(h, "a", {"gpu": 60})
    b = h.core.request(h.owner, Request("b", {"gpu": 60}), "u")
    h.drain()
    assert a in h.core.demoting and releases(h) == ["r"]
    c = h.core.request(h.owner, Request("c", {"ram": 10}), "v")
    h.drain()
    assert c.entry.state is State.WAITING and releases(h) == ["r"]
    h.ack(r)
    assert h.moving == [(a, "ram")] and c.entry.state is State.LOADING
    h.move(a)
    assert b.entry.state is State.LOADING
    h.core.check()


def test_a_holders_request_passing_a_blocked_space_drains_its_other_spaces() -> None:
    """t holds a lease in m, where first is blocked (and drains a); t's request needs n
    too, which nobody blocks: it drains there (b), and nothing more in m."""
    h = Harness({"m": 100, "n": 100})
    h.core.fair_requests = 3
    load(h, "a", {"m": 80}, task="x")
    load(h, "mine", {"m": 20}, task="t")
    load(h, "b", {"n": 100}, task="y")
    first = h.core.request(h.owner, Request("first", {"m": 50}), "u")
    more = h.core.request(h.owner, Request("more", {"m": 30, "n": 50}), "t")
    h.drain()
    assert first.entry.state is State.WAITING and more.entry.state is State.WAITING
    serve_requests(h, 3)
    assert draining(h) == {"a", "b"}


def test_a_self_wait_is_judged_by_the_most_a_space_can_hold_not_its_capacity_now() -> None:
    """m shrinks to 80 B for a while (limit 100). t holds 50 B and waits for 40 more;
    a quarantine of 5 B refuses the waiters left to their own leases: not t's, which
    could get in once m is back to its limit."""
    h = Harness({"m": 100})
    mine = load(h, "mine", {"m": 50}, task="t")
    other = load(h, "other", {"m": 35}, task="x")
    stuck = idle(h, "stuck", {"m": 5})
    ticket = h.core.request(h.owner, Request("more", {"m": 40}), "t")
    h.drain()
    assert ticket.outcome is None and ticket.holds
    h.core.set_capacity("m", 80)
    h.drain()
    assert releases(h) == ["stuck"]  # (repaying the shrink)
    h.refuse(stuck)
    assert ticket.outcome is None
    h.core.set_capacity("m", 100)
    h.end(other)
    h.ack(other.entry)
    assert ticket.entry.state is State.LOADING
    h.end(mine)
    h.core.check()


@pytest.mark.parametrize(("short", "drained"), [(40, {"b"}), (41, {"b", "c"})])
def test_a_drain_counts_idle_bytes_of_its_own_priority_in_its_space_only(
    short: int, drained: set[str]
) -> None:
    """A request of priority 5 short of 40 (or 41) B: the 10 idle B of its own priority
    in m are coming (those in n are not), so b (30 B) covers 40 but not 41."""
    h = Harness({"m": 100, "n": 100})
    h.core.fair_requests = 3
    for key in "abc":
        load(h, key, {"m": 30}, task=f"task-{key}")
    again = h.core.request(h.owner, Request("a"), "task-a2")  # a: the most recently requested
    h.drain()
    assert again.outcome is True
    spare = h.core.request(h.owner, Request("spare", {"m": 10}, priority=5), "s")
    h.drain()
    h.finish(spare.entry)
    h.end(spare)
    idle(h, "far", {"n": 10})
    waiter = h.core.request(h.owner, Request("w", {"m": short}, priority=5), "u")
    h.drain()
    serve_requests(h, 3)
    assert draining(h) == drained
    assert waiter.entry.state is State.WAITING
    h.core.check()
