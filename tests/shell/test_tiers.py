"""Memory tiers in the async shell (``Broker(tiers=...)``, ``Releaser.move``), attacked.

On every backend: a model parked in RAM comes back without a load, a failed
move is quarantined, bad tiers are refused. Then the attacks: a value moved
down a tier and back, acquires racing moves (a demotion waiting for room, one
in flight, a promotion), the last requester of a promotion leaving, moves that
raise, cancel themselves, never return or call back into the broker, caches
closed and entries invalidated, cleared or expired mid-move or while demoted,
lower tiers full of leases or failing their releases, argument errors, the
event log and the views. The books, driven directly, are in
``tests/core/test_tiers.py``.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import logging
import os
import random
import subprocess
import sys
import textwrap
from collections.abc import Callable, Hashable, MutableMapping
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

import cachebroker
from cachebroker import (
    AcquireTimeout,
    Broker,
    BrokerClosed,
    BrokerError,
    Cache,
    DeadlockError,
    EntryInfo,
    InvalidArgument,
    OutOfSpace,
    ReleaseFailed,
)
from cachebroker._core import check_after_every_step
from cachebroker.sizes import measured
from tests.brokers import daemon_of, open_broker
from tests.helpers import steps_until, wait_until

BUDGET = {"gpu": 100, "ram": 100}
TIERS = {"gpu": "ram"}
GPU60 = {"gpu": 60}
GIB = 1 << 30


# -- helpers ---------------------------------------------------------------------


def loader(key: Hashable, where: str = "gpu") -> Callable[[], Any]:
    async def load() -> str:
        await anyio.lowlevel.checkpoint()
        return f"{key}@{where}"

    return load


class Mover:
    """A releaser that moves values between spaces (the value is tagged with its space).

    ``gate``: moves wait for it; ``started``: set when a move starts; ``fail``:
    what a move raises; ``release_gates`` / ``release_errors``: per key, what a
    release of that key waits for or raises.
    """

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.gate: anyio.Event | None = None
        self.started = anyio.Event()
        self.fail: Callable[[], BaseException] | None = None
        self.release_gates: dict[Hashable, anyio.Event] = {}
        self.release_errors: dict[Hashable, BaseException] = {}
        self.during: Callable[[Hashable, str], Any] | None = None
        #: Only this move (key, to) waits for ``gate`` (``None``: every move).
        self.gate_for: tuple[Hashable, str] | None = None

    async def release(self, key: Hashable, value: Any) -> None:
        self.log.append(("release", key, value))
        gate = self.release_gates.get(key)
        if gate is not None:
            await gate.wait()
        error = self.release_errors.get(key)
        if error is not None:
            raise error

    async def move(self, key: Hashable, value: Any, to: str) -> Any:
        self.log.append(("move", key, value, to))
        self.started.set()
        if self.during is not None:
            await self.during(key, to)
        if self.gate is not None and self.gate_for in (None, (key, to)):
            await self.gate.wait()
        if self.fail is not None:
            raise self.fail()
        await anyio.lowlevel.checkpoint()
        return f"{str(value).split('@')[0]}@{to}"

    def moves(self) -> list[tuple[Hashable, str]]:
        return [(entry[1], entry[3]) for entry in self.log if entry[0] == "move"]

    def releases(self) -> list[tuple[Hashable, Any]]:
        return [(entry[1], entry[2]) for entry in self.log if entry[0] == "release"]


def states(broker: Broker) -> dict[Hashable, tuple[str, dict[str, int]]]:
    return {e.key: (e.state, dict(e.charge)) for e in broker._entries_now()}


def decided(broker: Broker) -> dict[Hashable, tuple[str, dict[str, int]]]:
    """``states``, as the books that decide moves hold them: a connected broker's daemon's
    (a demotion waiting for room there is no move yet in the process)."""
    daemon = daemon_of(broker)
    if daemon is None:
        return states(broker)
    core = daemon.runner.core
    return {ast.literal_eval(repr(e.key)): (e.state.value, dict(e.charge)) for e in core.entries()}


def check(broker: Broker) -> None:
    broker._runner.core.check()


async def use(cache: Cache, key: Hashable, size: dict[str, int] = GPU60, **kw: Any) -> Any:
    """Acquire ``key`` and let it go; its reload cost is declared (10 s), so that whether
    a move is worth it does not depend on how fast the test's loads and moves ran."""
    kw.setdefault("cost", 10.0)
    async with cache.acquire(key, load=loader(key), size=size, **kw) as lease:
        return lease.value


async def demoted(broker: Broker, cache: Cache, key: str = "a") -> None:
    """Load ``key`` (60 of gpu) and have it demoted by loading ``b`` (60 of gpu)."""
    await use(cache, key)
    await use(cache, "b")
    assert states(broker)[key] == ("demoted", {"ram": 60})


# -- a model parked in RAM, and the arguments ------------------------------------


class Plugin:
    """Values are strings that say where they are; moves and releases are recorded."""

    def __init__(self) -> None:
        self.moves: list[tuple[Hashable, str]] = []
        self.released: list[tuple[Hashable, Any]] = []
        self.fail_moves = False

    async def release(self, key: Hashable, value: Any) -> None:
        self.released.append((key, value))

    async def move(self, key: Hashable, value: Any, to: str) -> Any:
        await anyio.lowlevel.checkpoint()
        if self.fail_moves:
            raise RuntimeError(f"cannot move {key!r}")
        self.moves.append((key, to))
        return f"{key}@{to}"


async def use_model(cache: Any, key: str) -> str:
    """Acquire ``key`` (6 GiB of gpu) and let it go; its value."""
    async with cache.acquire(key, load=loader(key), size={"gpu": 6 * GIB}) as lease:
        return str(lease.value)


def by_key(infos: list[EntryInfo]) -> dict[Hashable, EntryInfo]:
    return {info.key: info for info in infos}


@pytest.mark.anyio
async def test_a_model_parked_in_ram_comes_back_without_a_load(kind: str) -> None:
    plugin = Plugin()
    async with (
        open_broker(kind, {"gpu": "10GiB", "ram": "20GiB"}, tiers={"gpu": "ram"}) as broker,
        broker.cache("m", plugin) as cache,
    ):
        assert await use_model(cache, "a") == "a@gpu"
        assert await use_model(cache, "b") == "b@gpu"
        infos = by_key(await broker.entries())
        assert infos["a"].state == "demoted" and infos["a"].charge == {"ram": 6 * GIB}
        assert infos["a"].home == {"gpu": 6 * GIB}
        assert await use_model(cache, "a") == "a@gpu"  # moved back, not loaded
        stats = await broker.stats()
        assert stats.loads == 2 and stats.promotions == 1 and stats.demotions == 2
        assert stats.demoted == 1 and stats.used == {"gpu": 6 * GIB, "ram": 6 * GIB}
        assert plugin.moves == [("a", "ram"), ("b", "ram"), ("a", "gpu")]
        assert plugin.released == []
        info = by_key(await broker.entries())["a"]
        assert info.promote_seconds is not None and info.home is None


@pytest.mark.anyio
async def test_a_failed_move_is_quarantined_with_both_charges_and_forget_frees_them(
    kind: str,
) -> None:
    plugin = Plugin()
    async with (
        open_broker(kind, {"gpu": "10GiB", "ram": "20GiB"}, tiers={"gpu": "ram"}) as broker,
        broker.cache("m", plugin) as cache,
    ):
        await use_model(cache, "a")
        plugin.fail_moves = True
        # Only forget() could return the gpu bytes of the quarantined value now.
        with pytest.raises(OutOfSpace, match=r"m:'a'"):
            await use_model(cache, "b")
        stats = await broker.stats()
        assert stats.quarantined_keys == (("m", "a"),) and stats.moves_failed == 1
        assert stats.used == {"gpu": 6 * GIB, "ram": 6 * GIB}
        assert await broker.forget("m", "a") == 1
        assert (await broker.stats()).used == {"gpu": 0, "ram": 0}
        assert await use_model(cache, "b") == "b@gpu"


@pytest.mark.anyio
async def test_a_releaser_with_a_plain_move_is_refused_when_the_cache_opens(kind: str) -> None:
    class Plain:
        async def release(self, key: Hashable, value: Any) -> None:
            pass

        def move(self, key: Hashable, value: Any, to: str) -> Any:
            return value

    async with open_broker(kind, {"gpu": 100, "ram": 100}, tiers={"gpu": "ram"}) as broker:
        with pytest.raises(TypeError, match="async def move"):
            broker.cache("m", Plain())


@pytest.mark.parametrize(
    ("tiers", "message"),
    [
        ({"gpu": "disk"}, "not in the budget"),
        ({"gpu": "gpu"}, "below itself"),
        ({"gpu": "ram", "ram": "gpu"}, "circle"),
        (["gpu", "ram"], "map a space"),
    ],
)
def test_bad_tiers_are_refused_with_what_was_wrong(tiers: Any, message: str) -> None:
    with pytest.raises((InvalidArgument, TypeError), match=message):
        Broker({"gpu": 100, "ram": 100}, tiers=tiers)


def test_tiers_come_from_the_environment() -> None:
    env = {"CACHEBROKER_BUDGET": "gpu=1GiB,ram=2GiB", "CACHEBROKER_TIERS": " gpu = ram "}
    assert Broker.from_env(env)._core.tiers == {"gpu": "ram"}
    for raw, message in [("gpu", "space=lower space"), ("gpu=ram,gpu=ram", "two lower")]:
        with pytest.raises(InvalidArgument, match=f"CACHEBROKER_TIERS.*{message}"):
            Broker.from_env({**env, "CACHEBROKER_TIERS": raw})
    with pytest.raises(InvalidArgument, match="not in the budget"):
        Broker.from_env({**env, "CACHEBROKER_TIERS": "gpu=disk"})


@pytest.mark.anyio
async def test_a_plain_measured_size_is_charged_where_the_move_went(kind: str) -> None:
    async with (
        open_broker(kind, {"default": "10GiB", "ram": "20GiB"}, tiers={"default": "ram"}) as broker,
        broker.cache("m", Plugin()) as cache,
    ):
        for key in ("a", "b"):
            async with cache.acquire(key, load=loader(key), size="6GiB", measure=lambda v: "5GiB"):
                pass
        infos = by_key(await broker.entries())
        assert infos["a"].state == "demoted" and infos["a"].charge == {"ram": 5 * GIB}
        assert infos["b"].charge == {"default": 5 * GIB}
        async with cache.acquire("a", load=loader("a"), size="6GiB", measure=lambda v: "5GiB"):
            pass
        assert by_key(await broker.entries())["a"].charge == {"default": 5 * GIB}


# -- the ordinary cycle, and the views -------------------------------------------


@pytest.mark.anyio
async def test_a_value_goes_down_and_comes_back_through_the_releaser(kind: str) -> None:
    mover = Mover()
    async with open_broker(kind, BUDGET, tiers=TIERS) as broker, broker.cache("m", mover) as cache:
        await demoted(broker, cache)
        assert mover.moves() == [("a", "ram")] and mover.releases() == []
        # Promoted: b must make room in gpu, and ram has none for it while a is
        # there: b is released.
        assert await use(cache, "a") == "a@gpu"
        assert mover.moves() == [("a", "ram"), ("a", "gpu")]
        assert mover.releases() == [("b", "b@gpu")]
        assert states(broker) == {"a": ("ready", {"gpu": 60})}
        stats = await broker.stats()
        assert stats.used == {"gpu": 60, "ram": 0} and stats.loads == 2
        assert stats.misses == 3  # the promotion waited for its value: a miss, not a load
        check(broker)
    assert broker.stats_nowait().used == {"gpu": 0, "ram": 0}
    assert mover.releases() == [("b", "b@gpu"), ("a", "a@gpu")]


@pytest.mark.anyio
async def test_with_room_below_a_promotion_swaps_the_two_values(kind: str) -> None:
    mover = Mover()
    async with (
        open_broker(kind, {"gpu": 100, "ram": 150}, tiers=TIERS) as broker,
        broker.cache("m", mover) as cache,
    ):
        await demoted(broker, cache)
        assert await use(cache, "a") == "a@gpu"
        assert mover.moves() == [("a", "ram"), ("b", "ram"), ("a", "gpu")]
        assert states(broker) == {"a": ("ready", {"gpu": 60}), "b": ("demoted", {"ram": 60})}
        assert broker.stats_nowait().used == {"gpu": 60, "ram": 60}
        check(broker)
    assert sorted(mover.releases()) == [("a", "a@gpu"), ("b", "b@ram")]


@pytest.mark.anyio
async def test_entries_during_a_move_show_it_moving_and_charged_in_both(kind: str) -> None:
    mover = Mover()
    async with open_broker(kind, BUDGET, tiers=TIERS) as broker, broker.cache("m", mover) as cache:
        await use(cache, "a")
        mover.gate = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(use, cache, "b")
            await mover.started.wait()
            assert states(broker)["a"][0] == "moving"
            assert broker.stats_nowait().used == {"gpu": 60, "ram": 60}
            mover.gate.set()
        assert states(broker)["a"] == ("demoted", {"ram": 60})
        check(broker)


@pytest.mark.anyio
async def test_stats_count_a_demoted_entry_among_the_entries_holding_memory(kind: str) -> None:
    async with (
        open_broker(kind, BUDGET, tiers=TIERS) as broker,
        broker.cache("m", Mover()) as cache,
    ):
        await demoted(broker, cache)
        stats = await broker.stats()
        assert stats.used == {"gpu": 60, "ram": 60}
        assert stats.entries == len(await broker.entries()) == 2


@pytest.mark.anyio
async def test_a_releaser_without_move_is_never_asked_to_move(kind: str) -> None:
    released: list[Hashable] = []

    async def release(key: Hashable, value: Any) -> None:
        released.append(key)

    async with (
        open_broker(kind, BUDGET, tiers=TIERS) as broker,
        broker.cache("m", release) as cache,
    ):
        await use(cache, "a")
        await use(cache, "b")
        assert released == ["a"] and states(broker) == {"b": ("ready", {"gpu": 60})}
        assert broker.stats_nowait().used == {"gpu": 60, "ram": 0}


@pytest.mark.anyio
async def test_a_releaser_whose_move_is_none_is_never_asked_to_move(kind: str) -> None:
    class NoMove:
        move = None

        def __init__(self) -> None:
            self.released: list[Hashable] = []

        async def release(self, key: Hashable, value: Any) -> None:
            self.released.append(key)

    releaser = NoMove()
    async with (
        open_broker(kind, BUDGET, tiers=TIERS) as broker,
        broker.cache("m", releaser) as cache,
    ):
        await use(cache, "a")
        await use(cache, "b")
        assert releaser.released == ["a"] and broker.stats_nowait().used["ram"] == 0


@pytest.mark.anyio
async def test_two_caches_one_moving_one_not(kind: str) -> None:
    mover = Mover()
    released: list[Hashable] = []

    async def release(key: Hashable, value: Any) -> None:
        released.append(key)

    async with (
        open_broker(kind, BUDGET, tiers=TIERS) as broker,
        broker.cache("m", mover) as moving,
        broker.cache("r", release) as plain,
    ):
        await use(plain, "x", {"gpu": 40})
        await use(moving, "a", {"gpu": 40})
        await use(moving, "b", {"gpu": 40})  # evicts x (oldest): released, not moved
        assert released == ["x"] and mover.moves() == []
        await use(plain, "y", {"gpu": 40})  # evicts a: moved
        assert mover.moves() == [("a", "ram")]
        check(broker)


# -- acquires racing moves ---------------------------------------------------------


@pytest.mark.anyio
async def test_an_acquire_during_a_demotion_in_flight_waits_then_promotes(kind: str) -> None:
    mover = Mover()
    async with (
        open_broker(kind, {"gpu": 100, "ram": 200}, tiers=TIERS) as broker,
        broker.cache("m", mover) as cache,
    ):
        await use(cache, "a")
        mover.gate = anyio.Event()
        got: list[Any] = []

        async def again() -> None:
            got.append(await use(cache, "a"))

        async with anyio.create_task_group() as tg:
            tg.start_soon(use, cache, "b")
            await mover.started.wait()
            tg.start_soon(again)
            assert await steps_until(lambda: broker._entries_now()[0].waiting == 1)
            assert states(broker)["a"][0] == "moving"
            mover.gate.set()
        assert got == ["a@gpu"]
        assert broker.stats_nowait().loads == 2  # a and b: a came back by moving
        assert ("a", "gpu") in mover.moves()
        check(broker)


@pytest.mark.anyio
async def test_acquires_during_a_promotion_join_it(kind: str) -> None:
    mover = Mover()
    async with (
        open_broker(kind, {"gpu": 100, "ram": 200}, tiers=TIERS) as broker,
        broker.cache("m", mover) as cache,
    ):
        await demoted(broker, cache)
        mover.gate = anyio.Event()
        mover.gate_for = ("a", "gpu")
        got: list[Any] = []

        async def again() -> None:
            got.append(await use(cache, "a"))

        async with anyio.create_task_group() as tg:
            tg.start_soon(again)
            assert await steps_until(lambda: ("a", "gpu") in mover.moves())
            for _ in range(3):
                tg.start_soon(again)
            assert await steps_until(lambda: broker._entries_now()[0].waiting == 4)
            mover.gate.set()
        assert got == ["a@gpu"] * 4 and mover.moves().count(("a", "gpu")) == 1
        assert broker.stats_nowait().loads == 2
        check(broker)


@pytest.mark.anyio
async def test_an_acquire_during_a_demotion_waiting_for_room_takes_it_back_at_once(
    kind: str,
) -> None:
    mover = Mover()
    async with open_broker(kind, BUDGET, tiers=TIERS) as broker, broker.cache("m", mover) as cache:
        await use(cache, "r", {"ram": 80})
        await use(cache, "a")
        mover.release_gates["r"] = anyio.Event()
        served: list[Any] = []

        async def b() -> None:
            served.append(await use(cache, "b"))

        async with anyio.create_task_group() as tg:
            tg.start_soon(b)
            # r's release makes a's room in ram; a waits for it (no move yet).
            assert await steps_until(lambda: ("r", "r@gpu") in mover.releases())
            assert decided(broker)["a"][0] == "moving" and mover.moves() == []
            with anyio.fail_after(5):  # (a hang guard, not a timing)
                async with cache.acquire("a", load=loader("a"), size=GPU60) as lease:
                    assert lease.value == "a@gpu"
                    assert states(broker)["a"][0] == "ready"
                    mover.release_gates["r"].set()
                    await anyio.lowlevel.checkpoint()
            # Once a is idle again it goes down for b.
        assert served == ["b@gpu"] and mover.moves() == [("a", "ram")]
        assert broker.stats_nowait().loads == 3
        check(broker)


@pytest.mark.anyio
async def test_a_promotion_refused_for_one_task_s_own_lease_still_serves_another(
    kind: str,
) -> None:
    """Only the lease holder's request is refused (its own lease fills the room); another
    task's request for the same demoted key waits, and is served once that lease ends."""
    mover = Mover()
    async with open_broker(kind, BUDGET, tiers=TIERS) as broker, broker.cache("m", mover) as cache:
        await demoted(broker, cache)  # a in ram, b in gpu
        served: list[Any] = []

        async def other() -> None:
            served.append(await use(cache, "a"))

        with anyio.fail_after(5):  # (a hang guard, not a timing)
            async with anyio.create_task_group() as tg:
                async with cache.acquire("b", load=loader("b"), size=GPU60, cost=10.0):
                    tg.start_soon(other)
                    with pytest.raises(DeadlockError):
                        await use(cache, "a")
                    assert served == []
        assert served == ["a@gpu"]
        check(broker)


@pytest.mark.parametrize("how", ["cancelled", "timed out"])
@pytest.mark.anyio
async def test_the_last_requester_of_a_queued_promotion_leaving_leaves_it_demoted(
    kind: str,
    how: str,
) -> None:
    mover = Mover()
    async with (
        open_broker(kind, {"gpu": 100, "ram": 200}, tiers=TIERS) as broker,
        broker.cache("m", mover) as cache,
    ):
        await demoted(broker, cache)
        async with cache.acquire("b", load=loader("b"), size=GPU60):
            # b is leased: a's promotion waits for room that cannot come.
            # (Another task asks: this one would wait on its own lease.)
            if how == "cancelled":
                scope = anyio.CancelScope()

                async def cancelled() -> None:
                    with scope:
                        await use(cache, "a")

                async with anyio.create_task_group() as tg:
                    tg.start_soon(cancelled)
                    assert await steps_until(lambda: broker.stats_nowait().waiting == 1)
                    scope.cancel()
                assert scope.cancelled_caught
            else:

                async def timed_out() -> None:
                    with pytest.raises(AcquireTimeout) as caught:
                        await use(cache, "a", timeout=0.01)
                    assert caught.value.entry == "m:'a'"

                async with anyio.create_task_group() as tg:
                    tg.start_soon(timed_out)
            assert states(broker)["a"] == ("demoted", {"ram": 60})
            assert broker.stats_nowait().waiting == 0
            check(broker)
        assert await use(cache, "a") == "a@gpu"  # and it can still come back
        assert mover.releases() == [] and broker.stats_nowait().loads == 2
        check(broker)


@pytest.mark.anyio
async def test_the_only_requester_of_a_promotion_in_flight_cancelled_leaves_it_ready(
    kind: str,
) -> None:
    mover = Mover()
    async with (
        open_broker(kind, {"gpu": 100, "ram": 200}, tiers=TIERS) as broker,
        broker.cache("m", mover) as cache,
    ):
        await demoted(broker, cache)
        mover.gate = anyio.Event()
        mover.gate_for = ("a", "gpu")
        scope = anyio.CancelScope()

        async def cancelled() -> None:
            with scope:
                await use(cache, "a")

        async with anyio.create_task_group() as tg:
            tg.start_soon(cancelled)
            assert await steps_until(lambda: ("a", "gpu") in mover.moves())
            scope.cancel()
            await anyio.lowlevel.checkpoint()
            assert states(broker)["a"][0] == "moving"
            mover.gate.set()
        assert scope.cancelled_caught
        assert await steps_until(lambda: states(broker)["a"] == ("ready", {"gpu": 60}))
        stats = broker.stats_nowait()
        assert stats.leased == 0 and stats.used == {"gpu": 60, "ram": 60}
        assert await use(cache, "a") == "a@gpu" and stats.loads == 2
        check(broker)


@pytest.mark.anyio
async def test_a_prefetch_promotes_a_demoted_entry_without_keeping_a_lease(kind: str) -> None:
    mover = Mover()
    async with (
        open_broker(kind, {"gpu": 100, "ram": 200}, tiers=TIERS) as broker,
        broker.cache("m", mover) as cache,
    ):
        await demoted(broker, cache)
        hits = broker.stats_nowait().hits
        await cache.prefetch("a", load=loader("a"), size=GPU60)
        assert states(broker)["a"] == ("ready", {"gpu": 60})
        stats = broker.stats_nowait()
        assert stats.leased == 0 and stats.hits == hits and stats.loads == 2
        check(broker)


@pytest.mark.anyio
async def test_closing_the_cache_fails_a_queued_promotion_and_releases_the_value(kind: str) -> None:
    mover = Mover()
    failures: list[BaseException] = []
    async with open_broker(kind, BUDGET, tiers=TIERS) as broker:
        async with anyio.create_task_group() as tg:
            async with broker.cache("m", mover) as cache:
                await demoted(broker, cache)
                holder = await cache.acquire("b", load=loader("b"), size=GPU60, cost=10.0)

                async def waiter() -> None:
                    try:
                        await use(cache, "a")
                    except BrokerClosed as exc:
                        failures.append(exc)

                async def let_go_once_closing() -> None:
                    assert await steps_until(lambda: cache._owner.closing)
                    await holder.release()

                tg.start_soon(waiter)
                assert await steps_until(lambda: broker.stats_nowait().waiting == 1)
                tg.start_soon(let_go_once_closing)
        assert len(failures) == 1 and "m:'a'" in str(failures[0])
        assert broker.stats_nowait().used == {"gpu": 0, "ram": 0}
        assert sorted(mover.releases()) == [("a", "a@ram"), ("b", "b@gpu")]
        check(broker)


@pytest.mark.anyio
async def test_a_timed_out_queued_promotion_says_it_waited_for_space(kind: str) -> None:
    async with (
        open_broker(kind, BUDGET, tiers=TIERS) as broker,
        broker.cache("m", Mover()) as cache,
    ):
        await demoted(broker, cache)
        async with cache.acquire("b", load=loader("b"), size=GPU60):

            async def other_task() -> None:
                with pytest.raises(AcquireTimeout) as caught:
                    await use(cache, "a", timeout=0.01)
                assert caught.value.waiting_for == "space", caught.value

            async with anyio.create_task_group() as tg:
                tg.start_soon(other_task)


# -- moves that fail, cancel themselves, never return, call back -------------------


@pytest.mark.anyio
async def test_a_move_that_raises_quarantines_with_both_charges_and_fails_its_waiters(
    kind: str,
) -> None:
    mover = Mover()
    async with open_broker(kind, BUDGET, tiers=TIERS) as broker, broker.cache("m", mover) as cache:
        await use(cache, "a")
        mover.gate = anyio.Event()
        mover.fail = lambda: RuntimeError("dma fault")
        errors: list[BaseException] = []

        async def waiter(key: str) -> None:
            try:
                await use(cache, key)
            except BrokerError as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter, "b")
            await mover.started.wait()
            tg.start_soon(waiter, "a")
            assert await steps_until(lambda: broker._entries_now()[0].waiting == 1)
            mover.gate.set()
        assert len(errors) == 2 and all(isinstance(e, BrokerError) for e in errors)
        texts = sorted(str(e) for e in errors)
        assert any("m:'a'" in t and "dma fault" in t for t in texts), texts
        assert states(broker)["a"] == ("quarantined", {"gpu": 60, "ram": 60})
        stats = broker.stats_nowait()
        assert stats.quarantined_keys == (("m", "a"),) and stats.used == {"gpu": 60, "ram": 60}
        assert await broker.forget("m", "a") == 1
        assert broker.stats_nowait().used == {"gpu": 0, "ram": 0}
        assert await use(cache, "a") == "a@gpu"  # loaded afresh
        check(broker)


@pytest.mark.anyio
async def test_a_move_raising_a_cancellation_of_its_own_quarantines(
    kind: str,
    anyio_backend: tuple[str, dict[str, Any]],
) -> None:
    mover = Mover()
    async with open_broker(kind, BUDGET, tiers=TIERS) as broker, broker.cache("m", mover) as cache:
        await use(cache, "a")
        # (trio's Cancelled cannot be raised by hand: there, asyncio's, a foreign one)
        own = anyio_backend[0] != "trio"
        mover.fail = anyio.get_cancelled_exc_class() if own else asyncio.CancelledError
        with pytest.raises(BrokerError):
            await use(cache, "b")  # a's bytes are quarantined: b can never fit
        assert states(broker)["a"] == ("quarantined", {"gpu": 60, "ram": 60})
        assert await broker.forget("m", "a") == 1
        mover.fail = None
        assert await use(cache, "b") == "b@gpu"
        check(broker)
    assert broker.stats_nowait().used == {"gpu": 0, "ram": 0}


@pytest.mark.anyio
async def test_a_move_that_never_returns_times_out_into_quarantine(kind: str) -> None:
    mover = Mover()
    async with (
        open_broker(kind, BUDGET, tiers=TIERS, release_timeout=0.05) as broker,
        broker.cache("m", mover) as cache,
    ):
        await use(cache, "a")
        mover.gate = anyio.Event()  # never set
        errors: dict[str, BaseException] = {}

        async def waiter(key: str, timeout: float | None = None) -> None:
            try:
                await use(cache, key, timeout=timeout)
            except BrokerError as exc:
                errors[key] = exc

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter, "b")
            await mover.started.wait()
            tg.start_soon(waiter, "a")
            assert await steps_until(lambda: broker._entries_now()[0].waiting == 1)
        assert isinstance(errors["a"], ReleaseFailed), errors
        assert "m:'a'" in str(errors["a"]) and "'ram'" in str(errors["a"])
        assert states(broker)["a"] == ("quarantined", {"gpu": 60, "ram": 60})
        stats = broker.stats_nowait()
        assert stats.moves_failed == 1 and stats.releases_timed_out == 0
        assert await broker.forget("m", "a") == 1
        check(broker)
        mover.gate.set()  # the late move changes nothing
        await anyio.lowlevel.checkpoint()
        check(broker)


@pytest.mark.anyio
async def test_a_move_returning_after_its_timeout_has_its_value_released(kind: str) -> None:
    mover = Mover()
    async with (
        open_broker(kind, BUDGET, tiers=TIERS, release_timeout=0.05) as broker,
        broker.cache("m", mover) as cache,
    ):
        await use(cache, "a")
        mover.gate = anyio.Event()
        with pytest.raises(OutOfSpace):  # a timed out: quarantined, b can never fit
            await use(cache, "b")
        # (connected, the daemon's watchdog may fire a moment before the process's own)
        await wait_until(lambda: states(broker)["a"][0] == "quarantined")
        mover.gate.set()  # the move ends late, its value at ram
        assert await steps_until(lambda: ("a", "a@ram") in mover.releases())


@pytest.mark.anyio
async def test_a_timed_out_move_keeps_the_release_counters_consistent(kind: str) -> None:
    mover = Mover()
    async with (
        open_broker(kind, BUDGET, tiers=TIERS, release_timeout=0.05) as broker,
        broker.cache("m", mover) as cache,
    ):
        await use(cache, "a")
        mover.gate = anyio.Event()  # never set
        with pytest.raises(OutOfSpace):
            await use(cache, "b")
        stats = broker.stats_nowait()
        assert stats.releases_timed_out <= stats.releases_failed, stats


@pytest.mark.anyio
async def test_an_acquire_timing_out_on_a_move_in_flight_names_the_key(kind: str) -> None:
    mover = Mover()
    async with open_broker(kind, BUDGET, tiers=TIERS) as broker, broker.cache("m", mover) as cache:
        await use(cache, "a")
        mover.gate = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(use, cache, "b")
            await mover.started.wait()
            with pytest.raises(AcquireTimeout) as caught:
                await use(cache, "a", timeout=0.01)
            assert caught.value.entry == "m:'a'" and "m:'a'" in str(caught.value)
            mover.gate.set()
        assert states(broker)["a"] == ("demoted", {"ram": 60})
        check(broker)


@pytest.mark.anyio
async def test_a_move_that_acquires_its_own_key_is_refused_at_once(kind: str) -> None:
    mover = Mover()
    inner: list[BaseException] = []
    async with (
        open_broker(kind, BUDGET, tiers=TIERS, release_timeout=0.5) as broker,
        broker.cache("m", mover) as cache,
    ):

        async def during(key: Hashable, to: str) -> None:
            try:
                await use(cache, key)
            except BrokerError as exc:
                inner.append(exc)

        await use(cache, "a")
        mover.during = during
        with contextlib.suppress(BrokerError):  # (a's bytes end up quarantined)
            await use(cache, "b")
        assert inner and isinstance(inner[0], DeadlockError), inner
        assert states(broker)["a"] == ("demoted", {"ram": 60})


@pytest.mark.anyio
async def test_a_move_that_acquires_a_ready_key_of_its_cache_gets_it(kind: str) -> None:
    mover = Mover()
    inner: list[Any] = []
    async with (
        open_broker(kind, {"gpu": 100, "ram": 100, "cpu": 100}, tiers=TIERS) as broker,
        broker.cache("m", mover) as cache,
    ):

        async def during(key: Hashable, to: str) -> None:
            if key == "a":
                inner.append(await use(cache, "table", {"cpu": 10}))

        await use(cache, "table", {"cpu": 10})
        await use(cache, "a")
        mover.during = during
        await use(cache, "b")
        assert inner == ["table@gpu"] and states(broker)["a"] == ("demoted", {"ram": 60})
        check(broker)


@pytest.mark.anyio
async def test_a_move_that_acquires_a_key_needing_room_is_refused_at_once(kind: str) -> None:
    mover = Mover()
    inner: list[BaseException] = []
    async with open_broker(kind, BUDGET, tiers=TIERS) as broker, broker.cache("m", mover) as cache:

        async def during(key: Hashable, to: str) -> None:
            if key == "a":
                try:
                    await use(cache, "big", {"gpu": 60})
                except BrokerError as exc:
                    inner.append(exc)

        await use(cache, "a")
        mover.during = during
        with anyio.fail_after(5):  # (a hang guard, not a timing)
            assert await use(cache, "b") == "b@gpu"
        assert len(inner) == 1 and isinstance(inner[0], DeadlockError), inner
        assert states(broker)["a"] == ("demoted", {"ram": 60})
        check(broker)


@pytest.mark.anyio
async def test_a_move_that_acquires_a_demoted_key_does_not_wait_on_itself(kind: str) -> None:
    mover = Mover()
    inner: list[BaseException] = []
    async with (
        open_broker(kind, {"gpu": 100, "ram": 200}, tiers=TIERS, release_timeout=0.5) as broker,
        broker.cache("m", mover) as cache,
    ):
        await use(cache, "d", {"gpu": 40})
        await use(cache, "a", {"gpu": 60})
        await use(cache, "c", {"gpu": 40})  # d goes down
        assert states(broker)["d"][0] == "demoted"

        async def during(key: Hashable, to: str) -> None:
            if key == "a":
                try:
                    await use(cache, "d", {"gpu": 40})
                except BrokerError as exc:
                    inner.append(exc)

        mover.during = during
        done = anyio.Event()

        async def hold_c() -> None:
            async with cache.acquire("c", load=loader("c"), size={"gpu": 40}):
                await done.wait()

        async with anyio.create_task_group() as tg:
            tg.start_soon(hold_c)
            assert await steps_until(lambda: broker.stats_nowait().leased == 1)
            # b needs a's room (c is leased): a goes down, and its move asks for d,
            # whose promotion queues behind b, which waits for that very move.
            try:
                with contextlib.suppress(BrokerError):  # (a's bytes end up quarantined)
                    await use(cache, "b", {"gpu": 60})
            finally:
                done.set()
        assert inner and isinstance(inner[0], DeadlockError), inner
        assert states(broker)["a"] == ("demoted", {"ram": 60})


# -- closing, invalidating, clearing, expiring -------------------------------------


@pytest.mark.anyio
async def test_closing_the_cache_during_a_move_releases_the_moved_value(kind: str) -> None:
    mover = Mover()
    failures: list[BaseException] = []
    async with open_broker(kind, BUDGET, tiers=TIERS) as broker:
        async with anyio.create_task_group() as tg:
            async with broker.cache("m", mover) as cache:
                await use(cache, "a")
                mover.gate = anyio.Event()

                async def b() -> None:
                    try:
                        await use(cache, "b")
                    except BrokerClosed as exc:
                        failures.append(exc)

                async def open_gate() -> None:
                    assert await steps_until(lambda: cache._owner.closing)
                    assert mover.gate is not None
                    mover.gate.set()

                tg.start_soon(b)
                await mover.started.wait()
                tg.start_soon(open_gate)
        assert len(failures) == 1
        assert mover.releases() == [("a", "a@ram")]
        stats = broker.stats_nowait()
        assert stats.used == {"gpu": 0, "ram": 0} and stats.quarantined == 0
        check(broker)


@pytest.mark.anyio
async def test_closing_the_cache_with_a_move_that_never_returns_quarantines_it(kind: str) -> None:
    mover = Mover()
    async with open_broker(kind, BUDGET, tiers=TIERS, release_timeout=0.05) as broker:
        async with anyio.create_task_group() as tg:
            async with broker.cache("m", mover) as cache:
                await use(cache, "a")
                mover.gate = anyio.Event()  # never set

                async def b() -> None:
                    with pytest.raises(BrokerClosed):
                        await use(cache, "b")

                tg.start_soon(b)
                await mover.started.wait()
        stats = broker.stats_nowait()
        assert stats.quarantined_keys == (("m", "a"),)
        assert stats.used == {"gpu": 60, "ram": 60}
        check(broker)


@pytest.mark.anyio
async def test_closing_the_broker_with_a_demoted_entry_releases_it_from_the_lower_tier(
    kind: str,
) -> None:
    mover = Mover()
    async with open_broker(kind, BUDGET, tiers=TIERS) as broker:
        cache_block = broker.cache("m", mover)
        cache = await cache_block.__aenter__()
        try:
            await demoted(broker, cache)
        finally:
            await cache_block.__aexit__(None, None, None)
    assert sorted(mover.releases()) == [("a", "a@ram"), ("b", "b@gpu")]
    assert broker.stats_nowait().used == {"gpu": 0, "ram": 0}


@pytest.mark.anyio
async def test_invalidating_during_a_move_releases_the_moved_value(kind: str) -> None:
    mover = Mover()
    async with open_broker(kind, BUDGET, tiers=TIERS) as broker, broker.cache("m", mover) as cache:
        await use(cache, "a")
        mover.gate = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(use, cache, "b")
            await mover.started.wait()
            assert await cache.invalidate("a")
            # A new acquire loads afresh (the moving value is not its value any more).
            fresh = anyio.Event()

            async def again() -> None:
                assert await use(cache, "a", {"gpu": 30}) == "a@gpu"
                fresh.set()

            tg.start_soon(again)
            mover.gate.set()
            await fresh.wait()
        assert ("a", "a@ram") in mover.releases()
        assert broker.stats_nowait().loads == 3
        check(broker)


@pytest.mark.anyio
async def test_invalidating_a_demoted_entry_releases_it_and_waits_for_that(kind: str) -> None:
    mover = Mover()
    async with open_broker(kind, BUDGET, tiers=TIERS) as broker, broker.cache("m", mover) as cache:
        await demoted(broker, cache)
        assert await cache.invalidate("a")
        assert mover.releases() == [("a", "a@ram")]
        assert "a" not in states(broker)
        assert broker.stats_nowait().used == {"gpu": 60, "ram": 0}
        assert await use(cache, "a") == "a@gpu"
        assert broker.stats_nowait().loads == 3
        check(broker)


@pytest.mark.anyio
async def test_clear_releases_a_demoted_entry(kind: str) -> None:
    mover = Mover()
    async with open_broker(kind, BUDGET, tiers=TIERS) as broker, broker.cache("m", mover) as cache:
        await demoted(broker, cache)
        await broker.clear()
        assert await steps_until(lambda: len(mover.releases()) == 2)
        assert sorted(mover.releases()) == [("a", "a@ram"), ("b", "b@gpu")]
        assert broker.stats_nowait().used == {"gpu": 0, "ram": 0}
        check(broker)


@pytest.mark.anyio
async def test_clear_waits_for_and_reports_a_demoted_entry(kind: str) -> None:
    mover = Mover()
    async with open_broker(kind, BUDGET, tiers=TIERS) as broker, broker.cache("m", mover) as cache:
        await demoted(broker, cache)
        mover.release_gates["a"] = gate = anyio.Event()

        async def open_gate() -> None:
            assert await steps_until(lambda: ("a", "a@ram") in mover.releases())
            gate.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(open_gate)
            report = await broker.clear()
        assert report.entries == 2 and report.bytes == 120
        assert broker.stats_nowait().used == {"gpu": 0, "ram": 0}


@pytest.mark.anyio
async def test_an_idle_demoted_entry_expires(kind: str) -> None:
    now = [0.0]
    mover = Mover()
    async with (
        open_broker(kind, BUDGET, tiers=TIERS, idle_ttl=10, clock=lambda: now[0]) as broker,
        broker.cache("m", mover) as cache,
    ):
        await use(cache, "a")
        now[0] = 1.0
        await use(cache, "b")  # a goes down at 1.0
        assert states(broker)["a"][0] == "demoted"
        now[0] = 10.5  # a has been idle since its lease ended at 0, wherever it is
        report = await broker.evict_idle()
        assert report.entries == 1 and mover.releases() == [("a", "a@ram")]
        now[0] = 11.0
        report = await broker.evict_idle()
        assert report.entries == 1 and sorted(mover.releases()) == [("a", "a@ram"), ("b", "b@gpu")]
        assert broker.stats_nowait().used == {"gpu": 0, "ram": 0}
        check(broker)


# -- the lower tier: full of leases, failing its releases ---------------------------


@pytest.mark.anyio
async def test_a_lower_tier_full_of_leases_makes_the_demotion_a_release(kind: str) -> None:
    mover = Mover()
    async with open_broker(kind, BUDGET, tiers=TIERS) as broker, broker.cache("m", mover) as cache:
        async with cache.acquire("r", load=loader("r", "ram"), size={"ram": 80}):
            await use(cache, "a")
            with anyio.fail_after(5):  # (a hang guard, not a timing)
                assert await use(cache, "b") == "b@gpu"
            assert mover.moves() == [] and mover.releases() == [("a", "a@gpu")]
        check(broker)


@pytest.mark.anyio
async def test_a_demotion_waiting_for_a_release_that_fails_releases_instead(kind: str) -> None:
    mover = Mover()
    async with open_broker(kind, BUDGET, tiers=TIERS) as broker, broker.cache("m", mover) as cache:
        await use(cache, "r", {"ram": 80})
        await use(cache, "a")
        mover.release_errors["r"] = RuntimeError("stuck")
        with anyio.fail_after(5):  # (a hang guard, not a timing)
            assert await use(cache, "b") == "b@gpu"
        assert mover.moves() == []
        assert mover.releases() == [("r", "r@gpu"), ("a", "a@gpu")]
        stats = broker.stats_nowait()
        assert stats.quarantined_keys == (("m", "r"),)
        assert stats.used == {"gpu": 60, "ram": 80}
        check(broker)


# -- arguments ------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_move_that_is_not_async_is_a_type_error_at_cache(kind: str) -> None:
    class Plain:
        async def release(self, key: Hashable, value: Any) -> None:
            pass

        def move(self, key: Hashable, value: Any, to: str) -> Any:
            return value

    async with open_broker(kind, BUDGET, tiers=TIERS) as broker:
        with pytest.raises(TypeError, match="async def move"):
            broker.cache("m", Plain())


@pytest.mark.parametrize(
    ("tiers", "message"),
    [
        ({"gpu": "disk"}, "'disk', which is not in the budget"),
        ({"vram": "ram"}, "'vram', which is not in the budget"),
        ({"gpu": "gpu"}, "puts space 'gpu' below itself"),
        ({"gpu": "ram", "ram": "gpu"}, "circle: gpu -> ram -> gpu"),
        ({"a": "b", "b": "c", "c": "a"}, "circle"),
    ],
)
def test_bad_tiers_are_invalid_arguments(tiers: dict[str, str], message: str) -> None:
    budget = {"gpu": 1, "ram": 1, "a": 1, "b": 1, "c": 1}
    with pytest.raises(InvalidArgument, match=message):
        Broker(budget, tiers=tiers)


@pytest.mark.parametrize("tiers", [["gpu", "ram"], {"gpu": 1}, {1: "ram"}])
def test_tiers_of_the_wrong_type_are_type_errors(tiers: Any) -> None:
    with pytest.raises(TypeError, match="tiers"):
        Broker(BUDGET, tiers=tiers)


# -- measuring moved values ---------------------------------------------------------


@pytest.mark.anyio
async def test_a_value_measured_at_load_time_can_still_be_moved(kind: str) -> None:
    free = {"gpu": 1000}

    def probe() -> tuple[int, int]:
        return 1000, free["gpu"]

    async def load_a() -> str:
        free["gpu"] -= 60
        return "a@gpu"

    load, measure = measured(load_a, {"gpu": probe})
    mover = Mover()
    async with open_broker(kind, BUDGET, tiers=TIERS) as broker, broker.cache("m", mover) as cache:
        async with cache.acquire("a", load=load, size=GPU60, measure=measure, cost=10):
            pass
        with contextlib.suppress(BrokerError):  # (b cannot fit beside a quarantined a)
            await use(cache, "b")
        assert states(broker)["a"] == ("demoted", {"ram": 60})


@pytest.mark.anyio
async def test_a_moved_value_measured_per_device_is_charged_where_it_went(kind: str) -> None:
    def weigh(value: str) -> dict[str, int]:
        return {value.split("@")[1]: 50}

    mover = Mover()
    async with open_broker(kind, BUDGET, tiers=TIERS) as broker, broker.cache("m", mover) as cache:
        async with cache.acquire("a", load=loader("a"), size=GPU60, measure=weigh, cost=10):
            pass
        assert states(broker)["a"] == ("ready", {"gpu": 50})
        await use(cache, "b")
        assert states(broker)["a"] == ("demoted", {"ram": 50})
        async with cache.acquire("a", load=loader("a"), size=GPU60, measure=weigh) as lease:
            assert lease.value == "a@gpu"
        assert states(broker)["a"][1] == {"gpu": 50}
        check(broker)


# -- the event log -----------------------------------------------------------------


@pytest.mark.anyio
async def test_move_events_are_logged_when_logging_is_configured(
    kind: str,
    events: list[MutableMapping[str, Any]],
) -> None:
    mover = Mover()
    async with (
        open_broker(kind, {"gpu": 100, "ram": 150}, tiers=TIERS) as broker,
        broker.cache("m", mover) as cache,
    ):
        await demoted(broker, cache)
        await use(cache, "a")  # b goes down, a comes up
        mover.fail = lambda: RuntimeError("dma fault")
        with pytest.raises(OutOfSpace):  # a goes down, that move fails: quarantined
            await use(cache, "c")
    # (The process's events: a daemon in this loop logs its own, under "m@pid".)
    moves = [e for e in events if e["event"].startswith("cachebroker.move") and e["cache"] == "m"]
    names = [(e["event"], e["key"], e.get("to"), e.get("up")) for e in moves]
    assert names[:4] == [
        ("cachebroker.move.start", "a", "ram", False),
        ("cachebroker.move.done", "a", "ram", False),
        ("cachebroker.move.start", "b", "ram", False),
        ("cachebroker.move.done", "b", "ram", False),
    ]
    assert ("cachebroker.move.start", "a", "gpu", True) in names
    assert ("cachebroker.move.done", "a", "gpu", True) in names
    failed = [e for e in moves if e["event"] == "cachebroker.move.failed"]
    assert len(failed) == 1 and failed[0]["key"] == "a" and failed[0]["log_level"] == "error"
    assert failed[0]["bytes"] == {"gpu": 60, "ram": 60} and failed[0]["to"] == "ram"
    assert all(e["cache"] == "m" for e in moves)


TIERED_RUN = """
import anyio, cachebroker

class Mover:
    moves = 0

    async def release(self, key, value):
        pass

    async def move(self, key, value, to):
        self.moves += 1
        return value

async def main():
    budget = {"gpu": 100, "ram": 100}
    async with cachebroker.Broker(budget, tiers={"gpu": "ram"}) as broker:
        mover = Mover()
        async with broker.cache("p", mover) as cache:
            for key in ["a", "b", "a", "c", "b", "a"]:
                async with cache.acquire(key, load=lambda: key, size={"gpu": 60}, cost=10):
                    pass
        assert mover.moves >= 4, mover.moves

anyio.run(main)
"""


def run_fresh(prelude: str = "") -> subprocess.CompletedProcess[str]:
    src = str(Path(cachebroker.__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(prelude) + TIERED_RUN],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    )


def test_moves_print_nothing_by_default() -> None:
    result = run_fresh()
    assert (result.stdout, result.stderr) == ("", "")


def test_moves_show_through_stdlib_logging_at_info() -> None:
    result = run_fresh(f"import logging\nlogging.basicConfig(level={logging.INFO})\n")
    lines = [line.split()[0] for line in result.stderr.splitlines()]
    assert "INFO:cachebroker:cachebroker.move.start" in lines
    assert "INFO:cachebroker:cachebroker.move.done" in lines
    assert lines.count("INFO:cachebroker:cachebroker.move.start") == lines.count(
        "INFO:cachebroker:cachebroker.move.done"
    )


# -- many clients at once -----------------------------------------------------------


class Flaky(Mover):
    """Moves and releases that take a few checkpoints, and sometimes fail."""

    def __init__(self, rng: random.Random, fail: float) -> None:
        super().__init__()
        self.rng = rng
        self.failure = fail

    async def _steps(self) -> None:
        for _ in range(self.rng.randrange(4)):
            await anyio.lowlevel.checkpoint()

    async def release(self, key: Hashable, value: Any) -> None:
        self.log.append(("release", key, value))
        await self._steps()
        if self.rng.random() < self.failure:
            raise RuntimeError(f"release of {key!r} failed")

    async def move(self, key: Hashable, value: Any, to: str) -> Any:
        self.log.append(("move", key, value, to))
        await self._steps()
        if self.rng.random() < self.failure:
            raise RuntimeError(f"move of {key!r} failed")
        return f"{str(value).split('@')[0]}@{to}"


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.anyio
async def test_many_clients_keep_the_books_through_moves_failures_and_cancellations(
    seed: int,
) -> None:
    """Clients acquire random keys (some sized in ram), some time out or are cancelled,
    and the releaser's moves and releases sometimes fail; the books are checked after
    every step, every value a lease shows is in the space its entry is charged in,
    and once the caches close and the quarantined entries are forgotten, all is zero."""
    rng = random.Random(seed)
    mover = Flaky(rng, fail=0.05)
    violations: list[str] = []
    chain = {"gpu": "ram", "ram": "disk"}
    broker = Broker({"gpu": 100, "ram": 120, "disk": 150}, tiers=chain, release_timeout=5)
    check_after_every_step(broker._core, violations)
    sizes = {f"k{i}": rng.choice([{"gpu": 30}, {"gpu": 50}, {"ram": 40}]) for i in range(8)}
    seen: list[str] = []
    async with broker:
        async with broker.cache("m", mover) as cache:

            async def client(n: int) -> None:
                for _ in range(25):
                    key = rng.choice(sorted(sizes))
                    timeout = rng.choice([None, None, 0.5])
                    scope = anyio.CancelScope()
                    if rng.random() < 0.1:
                        scope.cancel()
                    with scope, contextlib.suppress(BrokerError):
                        async with cache.acquire(
                            key,
                            load=loader(key, next(iter(sizes[key]))),
                            size=sizes[key],
                            cost=10.0,
                            timeout=timeout,
                        ) as lease:
                            where = str(lease.value).split("@")[1]
                            assert lease._entry is not None
                            charge = lease._entry.charge
                            if where not in charge:
                                seen.append(f"{key}: {lease.value} charged {charge}")
                            for _ in range(rng.randrange(3)):
                                await anyio.lowlevel.checkpoint()
                    if rng.random() < 0.05:
                        for quarantined in list(broker._core.quarantined):
                            await broker.forget("m", quarantined.key)

            with anyio.fail_after(60):  # (a hang guard, not a timing)
                async with anyio.create_task_group() as tg:
                    for n in range(6):
                        tg.start_soon(client, n)
            assert not violations, violations[:3]
            assert not seen, seen[:3]
        for quarantined in list(broker._core.quarantined):
            await broker.forget("m", quarantined.key)
        assert broker.stats_nowait().used == {"gpu": 0, "ram": 0, "disk": 0}
        assert not violations, violations[:3]
    assert broker._core.demotions > 0 and broker._core.promotions > 0


# -- process-level exceptions --------------------------------------------------------


class Meltdown(BaseException):
    """A process-level exception of the application's own."""


def meltdown_run(anyio_backend: tuple[str, dict[str, Any]], mover: Mover, **acquire: Any) -> Broker:
    """Load ``a``, then have it demoted by ``b``: ``Meltdown`` must come out of the block."""
    broker = Broker(BUDGET, tiers=TIERS)

    async def main() -> None:
        with anyio.fail_after(5):  # (a hang guard, not a timing)
            async with broker, broker.cache("m", mover) as cache:
                async with cache.acquire("a", load=loader("a"), cost=10.0, **acquire):
                    pass
                with contextlib.suppress(BrokerError):
                    await use(cache, "b")

    backend, options = anyio_backend
    with pytest.raises(Meltdown):
        anyio.run(main, backend=backend, backend_options=options)
    return broker


def test_a_process_level_exception_from_a_move_propagates(
    anyio_backend: tuple[str, dict[str, Any]],
) -> None:
    mover = Mover()
    mover.fail = Meltdown
    broker = meltdown_run(anyio_backend, mover, size=GPU60)
    assert broker.stats_nowait().quarantined_keys == (("m", "a"),)


def test_a_process_level_exception_from_measuring_a_moved_value_propagates(
    anyio_backend: tuple[str, dict[str, Any]],
) -> None:
    def weigh(value: str) -> dict[str, int]:
        if value.endswith("@ram"):
            raise Meltdown
        return GPU60

    meltdown_run(anyio_backend, Mover(), size=GPU60, measure=weigh)
