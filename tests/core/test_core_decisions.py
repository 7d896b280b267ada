"""The scheduler's decisions, tested where they are made: the books, with no event loop.

Placement (which space a request with ``spaces=`` goes to), the grants of one
pass (never more than the bytes that pass has not promised), draining (which
leased entries stop taking leases for a long-waiting request), and merging
two spaces that turn out to be one memory while entries live in both. Each
test drives ``Core`` through ``tests.harness.Harness``, whose ``drain`` fails
a step that never settles instead of hanging.
"""

from __future__ import annotations

from typing import Any

from cachebroker import DeadlockError
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
