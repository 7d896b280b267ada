"""Tiers where an entry's home and the space it is parked in meet.

A demoted entry is never charged in every space of its home, and its
promotion never goes to where it is parked: either would have it ask for its
own bytes again beside themselves, and wait for ever. Three ways they met:
a size callable (``measure=``) that still finds a moved value in the space it
left (the broker moved it down again and again while the waiter waited), a
learned alias that makes a space and its lower tier one memory (the
promotion of a value demoted there waited for ever), and a placement over
spaces that are tiers of each other (``ram`` kept as a place of the value
parked there). The books driven directly, then the shell on every backend;
every hang is bounded by steps. ``Core.check()`` refuses those states. Last,
a refused request for a value whose move further down waits for room must
leave it idle, not neither idle nor queued (holding its room for good).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable, MutableMapping
from typing import Any

import anyio
import pytest

from cachebroker import Broker, DeadlockError
from cachebroker._core import Reason, Request, State, Ticket
from tests.harness import Harness

STEPS = 2_000


def tiered(budget: dict[str, int] | None = None) -> Harness:
    return Harness(budget or {"gpu": 100, "ram": 100}, tiers={"gpu": "ram"}, moves=True)


def idle(h: Harness, key: str, need: dict[str, int], **options: Any) -> None:
    """Load ``key`` and end its lease: an idle entry."""
    ticket = h.core.request(h.owner, Request(key, need, **options), "t")
    h.drain()
    h.finish(ticket.entry)
    h.end(ticket)


def settle(h: Harness, ticket: Ticket, measured: dict[str, int] | None = None) -> None:
    """Finish the moves, loads and releases ``ticket`` waits on, a bounded number of times."""
    for _ in range(20):
        if ticket.outcome is not None:
            return
        if h.moving:
            h.move(h.moving[0][0], measured=measured)
        elif h.releasing:
            h.ack(h.releasing[0])
        elif ticket.entry in h.loading:
            h.finish(ticket.entry)
        else:
            return


# -- a move measured where it started ----------------------------------------------


def test_a_demotion_measured_in_the_space_it_left_is_released_not_moved_again() -> None:
    h = tiered()
    idle(h, "a", {"gpu": 60})
    b = h.acquire("b", {"gpu": 60})
    a = h.owner.entries["a"]
    settle(h, b, measured={"gpu": 60})  # the plugin's measure: still on the gpu
    assert h.moved == [("a", "ram")]  # moved once, not again and again
    assert h.released == [("a", Reason.CAPACITY)]
    assert a.state is State.GONE and b.outcome is True
    assert b.entry.charge == {"gpu": 60} and h.used("gpu") == 60 and h.used("ram") == 0
    h.core.check()


def test_a_demotion_measured_partly_where_it_was_made_no_room_and_is_released() -> None:
    h = tiered()
    idle(h, "a", {"gpu": 60})
    b = h.acquire("b", {"gpu": 60})
    a = h.owner.entries["a"]
    h.move(a, measured={"gpu": 30, "ram": 30})
    assert a.state is State.RELEASING and a.home is None and h.moving == []
    h.core.check()
    h.ack(a)
    assert b.entry.state is State.LOADING
    h.core.check()


def test_requests_joined_to_a_move_that_stayed_get_the_value_then_it_is_released() -> None:
    h = tiered()
    idle(h, "a", {"gpu": 60})
    b = h.acquire("b", {"gpu": 60})
    a = h.owner.entries["a"]
    joined = h.acquire("a", {"gpu": 60}, task="u")
    h.move(a, measured={"gpu": 60})
    assert joined.outcome is True and a.state is State.READY and a.home is None
    assert h.owner.entries.get("a") is not a  # new acquires load afresh
    h.core.check()
    h.end(joined)
    assert h.released == [("a", Reason.CAPACITY)] and h.moved == [("a", "ram")]
    h.ack(a)
    assert b.entry.state is State.LOADING
    h.core.check()


# -- a tier merged into one memory with the space above it -------------------------


def demoted(h: Harness, upper: str = "gpu") -> Any:
    """``a`` parked a tier down (for ``b``, now idle in ``upper``): the demoted entry."""
    idle(h, "a", {upper: 60})
    b = h.acquire("b", {upper: 60})
    a = h.owner.entries["a"]
    h.move(a)
    h.finish(b.entry)
    h.end(b)
    assert a.state is State.DEMOTED
    return a


@pytest.mark.parametrize(("keep", "other"), [("gpu", "ram"), ("ram", "gpu")])
def test_a_value_demoted_into_a_tier_merged_with_its_home_is_home_again(
    keep: str, other: str
) -> None:
    h = tiered({"gpu": 100, "ram": 150})
    a = demoted(h)
    h.core.merge_spaces(keep, other)
    h.drain()
    assert a.state is State.READY and a.home is None and a.idle
    h.core.check()
    ticket = h.acquire("a", {"gpu": 60}, task="u")
    assert ticket.outcome is True and h.moved == [("a", "ram")]  # a hit: no move, no load
    assert h.used(h.core.canon.get("gpu", "gpu")) == 120
    h.core.check()


def test_a_promotion_queued_when_its_tier_merges_with_its_home_is_granted_at_once() -> None:
    h = tiered()
    a = demoted(h)
    held = h.acquire("b", {"gpu": 60}, task="v")  # the gpu's room: leased
    ticket = h.acquire("a", {"gpu": 60}, task="u")
    assert ticket.outcome is None and a in h.core.queue
    h.core.merge_spaces("gpu", "ram")
    h.drain()
    assert ticket.outcome is True and a.state is State.READY and a not in h.core.queue
    assert h.moved == [("a", "ram")]
    h.core.check()
    h.end(ticket)
    h.end(held)
    h.core.check()


def test_a_demotion_waiting_for_room_in_a_tier_merged_with_its_space_is_no_move() -> None:
    h = tiered({"gpu": 100, "ram": 130})
    idle(h, "x", {"ram": 100})
    idle(h, "a", {"gpu": 60})
    b = h.acquire("b", {"gpu": 60})
    a = h.owner.entries["a"]
    assert a in h.core.demoting and h.releasing == [h.owner.entries["x"]]
    h.core.merge_spaces("gpu", "ram")
    h.drain()
    assert a.state is State.READY and a.idle and h.moving == []
    h.core.check()
    settle(h, b)
    assert b.outcome is True and h.moved == []
    h.core.check()


def test_a_promotion_asks_only_for_what_it_does_not_hold_already() -> None:
    """Its charge in a space it is not moved out of stays: asked for again, the
    promotion would wait for ever for room beside itself."""
    h = tiered({"gpu": 100, "cpu": 15, "ram": 100})
    idle(h, "a", {"gpu": 60, "cpu": 10})
    b = h.acquire("b", {"gpu": 60})
    a = h.owner.entries["a"]
    h.move(a)
    h.finish(b.entry)
    h.end(b)
    assert a.state is State.DEMOTED and a.charge == {"cpu": 10, "ram": 60}
    ticket = h.acquire("a", {"gpu": 60, "cpu": 10}, task="u")
    settle(h, ticket)
    assert ticket.outcome is True and a.charge == {"gpu": 60, "cpu": 10}
    assert h.used("cpu") == 10
    h.core.check()


# -- placement over spaces that are tiers of each other ----------------------------


PLACES = ("cuda:0", "ram")


def test_a_demoted_value_is_never_placed_back_where_it_is_parked() -> None:
    h = Harness({"cuda:0": 100, "ram": 100}, tiers={"cuda:0": "ram"}, moves=True)
    idle(h, "a", {"cuda:0": 60}, places=PLACES)
    b = h.core.request(h.owner, Request("b", {"cuda:0": 60}), "u")
    h.drain()
    a = h.owner.entries["a"]
    h.move(a)
    h.finish(b.entry)
    assert a.state is State.DEMOTED and a.charge == {"ram": 60}
    # Only evicting its own lease could make room in the one place left: ram
    # would count the value there twice.
    with pytest.raises(DeadlockError, match="leased by the requesting task itself"):
        h.core.request(h.owner, Request("a", {"cuda:0": 60}, places=PLACES), "u")
    h.drain()
    assert a.state is State.DEMOTED and a.idle and a not in h.core.queue
    assert a.places == ("cuda:0",)
    h.core.check()


def test_a_demoted_value_placed_elsewhere_comes_back_up_there() -> None:
    h = Harness(
        {"cuda:0": 100, "cuda:1": 100, "ram": 100},
        tiers={"cuda:0": "ram", "cuda:1": "ram"},
        moves=True,
    )
    idle(h, "a", {"cuda:0": 60}, places=("cuda:0", "ram", "cuda:1"))
    b = h.core.request(h.owner, Request("b", {"cuda:0": 60}), "u")
    h.drain()
    a = h.owner.entries["a"]
    h.move(a)
    h.finish(b.entry)
    ticket = h.core.request(h.owner, Request("a", {"cuda:0": 60}, places=PLACES), "u")
    h.drain()
    settle(h, ticket)
    assert ticket.outcome is True and a.charge == {"cuda:1": 60}  # (not ram: parked there)
    h.core.check()


# -- the shell ---------------------------------------------------------------------


class Plugin:
    """Values are strings that say where they are; moves and releases are recorded.
    A move after ``most`` of them raises: a livelock ends in a failure, not a hang."""

    def __init__(self, most: int = 5) -> None:
        self.moves: list[tuple[Hashable, str]] = []
        self.released: list[Hashable] = []
        self.most = most

    async def release(self, key: Hashable, value: Any) -> None:
        self.released.append(key)

    async def move(self, key: Hashable, value: Any, to: str) -> Any:
        await anyio.lowlevel.checkpoint()
        if len(self.moves) >= self.most:
            raise RuntimeError(f"moved {key!r} {len(self.moves)} times")
        self.moves.append((key, to))
        return f"{key}@{to}"


def loader(key: str, where: str = "gpu") -> Callable[..., Awaitable[str]]:
    """A loader whose value says where it went (the space it is told, if placed)."""

    async def load(*placed: str) -> str:
        await anyio.lowlevel.checkpoint()
        return f"{key}@{placed[0] if placed else where}"

    return load


async def within_steps(run: Callable[[], Awaitable[Any]]) -> Any:
    """What ``run()`` returns or raises, if it ends within ``STEPS`` checkpoints of this
    task; else the test fails (the run is cancelled)."""
    outcome: list[Any] = []

    async def call() -> None:
        try:
            outcome.append(await run())
        except Exception as exc:
            outcome.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(call)
        for _ in range(STEPS):
            if outcome:
                break
            await anyio.lowlevel.checkpoint()
        tg.cancel_scope.cancel()
    assert outcome, f"still waiting after {STEPS} steps"
    return outcome[0]


@pytest.mark.anyio
async def test_a_move_whose_measure_finds_it_where_it_was_releases_it_for_the_waiter(
    events: list[MutableMapping[str, Any]],
) -> None:
    plugin = Plugin()
    async with (
        Broker({"gpu": 100, "ram": 100}, tiers={"gpu": "ram"}) as broker,
        broker.cache("m", plugin) as cache,
    ):
        where = {"gpu": 60}  # the measure always finds the value on the gpu
        async with cache.acquire("a", load=loader("a"), size=where, measure=lambda v: where):
            pass

        async def use_b() -> str:
            async with cache.acquire("b", load=loader("b"), size={"gpu": 60}) as lease:
                return str(lease.value)

        assert await within_steps(use_b) == "b@gpu"
        assert plugin.moves == [("a", "ram")] and plugin.released == ["a"]
        stats = await broker.stats()
        assert stats.demotions == 0 and stats.used == {"gpu": 60, "ram": 0}
    stayed = [e for e in events if e["event"] == "cachebroker.move.stayed"]
    assert [(e["log_level"], e["key"], e["to"], e["bytes"]) for e in stayed] == [
        ("warning", "a", "ram", {"gpu": 60})
    ]


@pytest.mark.anyio
async def test_a_value_demoted_into_a_space_learned_to_be_its_home_comes_back_as_a_hit() -> None:
    plugin = Plugin()
    other: list[Hashable] = []

    async def release_other(key: Hashable, value: Any) -> None:
        other.append(key)

    async def load_x() -> str:
        # The device is full until y's memory (in "ram", the same memory) is freed.
        await anyio.lowlevel.checkpoint()
        if "y" not in other:
            raise MemoryError("cannot allocate 30 bytes")
        return "x@cuda:0"

    async with (
        Broker({"cuda:0": 100, "ram": 100}, tiers={"cuda:0": "ram"}, alias_threshold=1) as broker,
        broker.cache("n", release_other) as n,
        broker.cache("m", plugin) as m,
    ):
        async with n.acquire("y", load=loader("y", "ram"), size={"ram": 30}):
            pass
        for key in ("b", "c"):  # b goes down to ram for c
            async with m.acquire(key, load=loader(key, "cuda:0"), size={"cuda:0": 60}):
                pass
        assert {i.key: i.state for i in await broker.entries()}["b"] == "demoted"
        async with m.acquire("x", load=load_x, size={"cuda:0": 30}):
            pass
        stats = await broker.stats()
        assert stats.aliases == (("cuda:0", "ram"),) and stats.used["cuda:0"] == 90

        async def use_b() -> str:
            async with m.acquire("b", load=loader("b"), size={"cuda:0": 60}) as lease:
                return str(lease.value)

        assert await within_steps(use_b) == "b@ram"  # home: no move, no load
        assert plugin.moves == [("b", "ram")]
        assert (await broker.stats()).loads == 4


@pytest.mark.anyio
async def test_a_lease_holder_acquiring_its_demoted_value_placed_over_tiers_is_a_deadlock() -> None:
    plugin = Plugin()
    async with (
        Broker({"cuda:0": 100, "ram": 100}, tiers={"cuda:0": "ram"}) as broker,
        broker.cache("m", plugin) as cache,
    ):
        places = ["cuda:0", "ram"]
        async with cache.acquire("a", load=loader("a", "cuda:0"), size=60, spaces=places):
            pass

        async def hold_b_then_acquire_a() -> Any:
            async with cache.acquire("b", load=loader("b", "cuda:0"), size={"cuda:0": 60}):
                assert {i.key: i.state for i in await broker.entries()}["a"] == "demoted"
                async with cache.acquire("a", load=loader("a"), size=60, spaces=places) as lease:
                    return lease.value

        error = await within_steps(hold_b_then_acquire_a)
        assert isinstance(error, DeadlockError), error
        assert "leased by the requesting task itself" in str(error)


# -- what Core.check() holds ---------------------------------------------------------


@pytest.mark.parametrize("broken", ["home", "places", "promotion"])
def test_check_refuses_a_demoted_entry_parked_in_its_home_or_asking_for_its_own_bytes(
    broken: str,
) -> None:
    h = tiered()
    a = demoted(h)
    h.core.check()
    if broken == "home":
        a.home = dict(a.charge)
    elif broken == "places":
        a.places = a.asked_places = ("gpu", "ram")
    else:
        h.acquire("b", {"gpu": 60}, task="v")  # leased: the promotion waits
        ticket = h.acquire("a", {"gpu": 60}, task="u")
        assert ticket.outcome is None and a in h.core.queue
        h.core.check()
        a.need = dict(a.charge)
    with pytest.raises(AssertionError):
        h.core.check()


# -- a refused request for an entry whose demotion waits for room --------------------


def test_a_refused_request_for_a_value_waiting_to_move_further_down_leaves_it_idle() -> None:
    """The request calls the demotion off before it is refused: the entry must idle
    again (and be demoted anew), not stay neither idle nor queued, which held the
    room the waiter it was evicted for waits for, for ever."""
    h = Harness(
        {"gpu": 100, "ram": 100, "disk": 100}, tiers={"gpu": "ram", "ram": "disk"}, moves=True
    )
    idle(h, "x", {"disk": 100})
    idle(h, "a", {"gpu": 60})
    b = h.acquire("b", {"gpu": 60}, task="T")
    a = h.owner.entries["a"]
    h.move(a)
    h.finish(b.entry)
    c = h.acquire("c", {"ram": 60}, task="U")  # a waits for room in disk (x is released)
    assert a in h.core.demoting
    with pytest.raises(DeadlockError, match="leased by the requesting task itself"):
        h.core.request(h.owner, Request("a", {"gpu": 60}), "T")  # only T's own b could make room
    h.drain()
    h.core.check()
    h.ack(h.owner.entries["x"])
    settle(h, c)
    assert c.outcome is True and a.state is State.DEMOTED and a.charge == {"disk": 60}
    h.core.check()
