"""Placement: ``acquire(spaces=[...])`` puts a value where there is room, or where
eviction costs least, and tells the loader where.

The books driven directly (which space is chosen, FIFO per space, refusal),
then the shell on every backend.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import anyio
import pytest

from cachebroker import Broker, DeadlockError, InvalidArgument, RequestTooLarge
from cachebroker._core import Entry, State, Ticket
from tests.harness import Harness

GPUS = ("gpu0", "gpu1")


def gpus(**options: Any) -> Harness:
    return Harness({"gpu0": 100, "gpu1": 100}, **options)


def place(
    h: Harness, key: str, size: int = 60, *, cost: float | None = None, task: Any = "t"
) -> Ticket:
    ticket = h.core.request(h.owner, key, {GPUS[0]: size}, task, cost=cost, places=GPUS)
    h.drain()
    return ticket


def loaded(h: Harness, key: str, size: int = 60, *, cost: float | None = None) -> Ticket:
    ticket = place(h, key, size, cost=cost)
    h.finish(ticket.entry)
    return ticket


def test_the_first_space_with_room_is_chosen_without_evicting() -> None:
    h = gpus()
    a = loaded(h, "a")
    b = loaded(h, "b")
    assert a.entry.charge == {"gpu0": 60} and b.entry.charge == {"gpu1": 60}
    c = place(h, "c", 30)  # fits beside a
    assert c.entry.charge == {"gpu0": 30} and h.released == []


def test_the_space_whose_eviction_costs_least_reload_time_is_chosen() -> None:
    h = gpus()
    h.end(loaded(h, "a", cost=50.0))
    h.end(loaded(h, "b", cost=5.0))
    ticket = place(h, "c")
    assert [key for key, _ in h.released] == ["b"]  # gpu1's victim reloads faster
    h.ack(h.owner.entries["b"])
    assert ticket.entry.state is State.LOADING and ticket.entry.charge == {"gpu1": 60}


def test_ties_go_to_the_earlier_space() -> None:
    h = gpus()
    h.end(loaded(h, "a", cost=5.0))
    h.end(loaded(h, "b", cost=5.0))
    place(h, "c")
    assert [key for key, _ in h.released] == ["a"]


def test_releases_under_way_are_waited_for_before_anything_more_is_evicted() -> None:
    h = gpus()
    h.end(loaded(h, "a", cost=50.0))
    h.end(loaded(h, "b", cost=5.0))
    place(h, "c")  # b's release is under way on gpu1
    d = place(h, "d", 30)  # fits gpu0 beside a: no eviction, no wait
    assert d.entry.state is State.LOADING and d.entry.charge == {"gpu0": 30}
    assert [key for key, _ in h.released] == ["b"]


def test_first_come_first_served_holds_in_every_space_it_may_use() -> None:
    h = gpus()
    a = loaded(h, "a", 80)  # leased: nothing on gpu0 can be evicted
    b = loaded(h, "b", 80)  # leased on gpu1
    waiter = place(h, "c", 60, task="u")  # cannot be covered anywhere: first in both
    late = h.acquire("d", {"gpu1": 30}, task="v")
    assert waiter.entry.state is State.WAITING and late.entry.state is State.WAITING
    h.end(b)  # b idle: c is first in line for gpu1, so c gets it, not d
    h.ack(h.owner.entries["b"])
    assert waiter.entry.state is State.LOADING and waiter.entry.charge == {"gpu1": 60}
    assert late.entry.state is State.LOADING  # then d fits beside it
    h.end(a)
    h.core.check()


def test_a_space_too_small_is_left_out_and_all_too_small_is_refused() -> None:
    h = Harness({"gpu0": 50, "gpu1": 100})
    ticket = place(h, "a", 60)
    assert ticket.entry.places is None and ticket.entry.charge == {"gpu1": 60}
    with pytest.raises(RequestTooLarge):
        place(h, "b", 150)


def test_a_space_only_the_requesters_own_leases_could_free_is_left_out() -> None:
    h = gpus()
    mine = loaded(h, "a", 80)  # held by task "t"
    h.end(loaded(h, "b", 80))
    ticket = place(h, "c", 60, task="t")
    assert [key for key, _ in h.released] == ["b"]  # not a wait on its own lease
    h.ack(h.owner.entries["b"])
    assert ticket.entry.charge == {"gpu1": 60}
    h.end(mine)
    h.core.check()


def test_only_its_own_leases_anywhere_is_a_deadlock() -> None:
    h = gpus()
    loaded(h, "a", 80)
    loaded(h, "b", 80)
    with pytest.raises(DeadlockError):
        place(h, "c", 60, task="t")


def test_a_demoted_value_is_placed_again_when_it_comes_back_up() -> None:
    h = Harness(
        {"gpu0": 100, "gpu1": 100, "ram": 100},
        tiers={"gpu0": "ram", "gpu1": "ram"},
        moves=True,
    )
    h.end(loaded(h, "a", cost=50.0))  # gpu0
    busy = loaded(h, "b", cost=50.0)  # gpu1, leased
    c = place(h, "c")  # a goes down to ram
    a = h.owner.entries["a"]
    h.move(a)
    h.finish(c.entry)  # c on gpu0, leased
    h.end(busy)  # gpu1's b is idle now
    ticket = place(h, "a")  # a comes back up where eviction is possible: gpu1
    assert a.state is State.DEMOTED and a in h.core.queue
    b = h.owner.entries["b"]
    assert b.state in (State.MOVING, State.RELEASING)
    if b.state is State.MOVING:
        h.move(b)
    else:
        h.ack(b)
    assert a.state is State.MOVING and h.moving[-1] == (a, "gpu1")
    h.move(a)
    assert ticket.outcome is True and a.charge == {"gpu1": 60}
    h.core.check()


def demoted_from_gpu1(h: Harness) -> tuple[Ticket, Entry]:
    """``a`` placed while task ``t`` holds 80 of gpu0 (so loaded on gpu1), then moved
    down to ram; returns ``t``'s lease on gpu0 and ``a``'s entry."""
    mine = h.acquire("x", {"gpu0": 80}, task="t")
    h.finish(mine.entry)
    first = place(h, "a", task="t")  # gpu0 left out of this request: t's own lease
    a = first.entry
    assert a.places is None and a.need == {"gpu1": 60}
    assert a.asked_places == GPUS  # the entry keeps every place asked for
    h.finish(a)
    h.end(first)
    busy = h.acquire("c", {"gpu1": 90}, task="u")  # a moves down to ram
    h.move(a)
    h.finish(busy.entry)
    assert a.state is State.DEMOTED
    return mine, a


def tiered_gpus() -> Harness:
    return Harness(
        {"gpu0": 100, "gpu1": 100, "ram": 100},
        tiers={"gpu0": "ram", "gpu1": "ram"},
        moves=True,
    )


def test_a_promotion_chooses_again_among_every_place_its_acquire_asked_for() -> None:
    h = tiered_gpus()
    mine, a = demoted_from_gpu1(h)
    h.end(mine)
    assert h.core.invalidate(h.owner, "x")
    h.drain()
    h.ack(h.owner.entries["x"])  # gpu0 is empty; gpu1 is c's, leased
    again = h.core.request(h.owner, "a", None, "t")
    h.drain()
    assert a.places == GPUS  # t holds no lease now: both places are open to it
    assert a.state is State.MOVING and h.moving == [(a, "gpu0")]
    h.move(a)
    assert again.outcome is True and a.charge == {"gpu0": 60}
    h.core.check()


def test_a_place_left_out_for_the_promoting_requesters_own_lease_is_out_of_that_wait_only() -> None:
    h = tiered_gpus()
    _, a = demoted_from_gpu1(h)  # t still holds x, 80 of gpu0
    again = h.core.request(h.owner, "a", None, "t")
    h.drain()
    # In gpu0 only t's own lease could make room: this promotion waits in gpu1.
    assert a in h.core.queue and a.places is None and a.need == {"gpu1": 60}
    assert a.asked_places == GPUS
    h.leave(again)
    again = h.core.request(h.owner, "a", None, "v")  # another task: gpu0 is open to it
    h.drain()
    assert a in h.core.queue and a.places == GPUS
    h.core.check()


# -- the shell -----------------------------------------------------------------


async def release(key: Hashable, value: Any) -> None:
    pass


def device_loader(key: str, seen: list[str]) -> Any:
    async def load(space: str) -> str:
        seen.append(space)
        await anyio.lowlevel.checkpoint()
        return f"{key}@{space}"

    return load


@pytest.mark.anyio
async def test_the_loader_is_told_where_its_value_was_placed() -> None:
    seen: list[str] = []
    async with (
        Broker({"cuda:0": "10GiB", "cuda:1": "10GiB"}) as broker,
        broker.cache("m", release) as cache,
    ):
        spaces = ["cuda:0", "cuda:1"]
        first = await cache.acquire("a", load=device_loader("a", seen), size="6GiB", spaces=spaces)
        second = await cache.acquire("b", load=device_loader("b", seen), size="6GiB", spaces=spaces)
        assert (first.value, second.value) == ("a@cuda:0", "b@cuda:1")
        infos = {info.key: info.charge for info in await broker.entries()}
        assert infos == {"a": {"cuda:0": 6 << 30}, "b": {"cuda:1": 6 << 30}}
        await first.release()
        await second.release()
        assert seen == ["cuda:0", "cuda:1"]


@pytest.mark.anyio
async def test_a_plain_loader_in_a_thread_and_a_plain_measure_follow_the_placement() -> None:
    async with (
        Broker({"cuda:0": "10GiB", "cuda:1": "10GiB"}) as broker,
        broker.cache("m", release) as cache,
    ):
        blocker = await cache.acquire("x", load=lambda space: space, size="8GiB", spaces=["cuda:0"])
        lease = await cache.acquire(
            "y",
            load=lambda space: space,
            size="6GiB",
            measure=lambda value: "5GiB",
            spaces=["cuda:0", "cuda:1"],
        )
        assert (blocker.value, lease.value) == ("cuda:0", "cuda:1")
        assert (await broker.stats()).used == {"cuda:0": 8 << 30, "cuda:1": 5 << 30}
        await lease.release()
        await blocker.release()


@pytest.mark.anyio
async def test_prefetch_places_too() -> None:
    async with (
        Broker({"cuda:0": "10GiB", "cuda:1": "10GiB"}) as broker,
        broker.cache("m", release) as cache,
    ):
        await cache.prefetch("a", load=lambda space: space, size="8GiB", spaces=["cuda:0"])
        await cache.prefetch(
            "b", load=lambda space: space, size="8GiB", spaces=["cuda:0", "cuda:1"]
        )
        infos = {info.key: info.charge for info in await broker.entries()}
        assert infos["b"] == {"cuda:1": 8 << 30}


@pytest.mark.parametrize(
    ("spaces", "size", "error", "message"),
    [
        ("cuda:0", "1GiB", TypeError, "list of space names"),
        ([], "1GiB", InvalidArgument, "at least one"),
        (["cuda:0", "cuda:9"], "1GiB", InvalidArgument, "not in the budget"),
        (["cuda:0", "cuda:0"], "1GiB", InvalidArgument, "twice"),
        (["cuda:0", 1], "1GiB", TypeError, "names"),
        (["cuda:0"], {"cuda:0": "1GiB"}, InvalidArgument, "size must be"),
        (["cuda:0"], None, InvalidArgument, "size must be"),
        (["cuda:0"], "lots", InvalidArgument, "lots"),
    ],
)
@pytest.mark.anyio
async def test_bad_spaces_are_refused_naming_the_entry(
    spaces: Any, size: Any, error: type[Exception], message: str
) -> None:
    async with (
        Broker({"cuda:0": "10GiB", "cuda:1": "10GiB"}) as broker,
        broker.cache("m", release) as cache,
    ):
        with pytest.raises(error, match=message):
            cache.acquire("k", load=lambda space: space, size=size, spaces=spaces)
        with pytest.raises(error, match=message):
            await cache.prefetch("k", load=lambda space: space, size=size, spaces=spaces)
