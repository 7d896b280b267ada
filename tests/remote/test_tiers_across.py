"""Tiers across processes: the daemon decides moves, the owning process makes them.

``cachebroker serve --tiers``: a process's idle value is moved down a tier
by its own releaser when another process needs the room, and back up when
it is acquired again; a move the process cannot make (the value is leased
there again) is called off. Over a daemon restart, demoted values, moves
under way and promotions waiting for room are registered as they are. The
shell-level tier tests run on both kinds of broker in
``tests/shell/test_tiers.py``; real processes are in ``test_processes.py``.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Hashable
from typing import Any, NamedTuple

import anyio
import anyio.lowlevel
import pytest

from cachebroker import AcquireTimeout, Broker, Cache
from cachebroker._remote._daemon import Daemon
from cachebroker._remote._ps import render
from tests.remote.support import serving
from tests.remote.test_reconnect import Daemons, daemons, link_of, listed, until, value

pytestmark = pytest.mark.anyio

BUDGET = {"gpu": 100, "ram": 100}
TIERS = {"gpu": "ram"}


class Mover:
    """A releaser that moves values (``key@space``), each move waiting for ``gate`` if set."""

    def __init__(self) -> None:
        self.moves: list[tuple[Hashable, str]] = []
        self.released: list[Hashable] = []
        self.gate: anyio.Event | None = None
        self.started = anyio.Event()

    async def release(self, key: Hashable, value: Any) -> None:
        self.released.append(key)

    async def move(self, key: Hashable, value: Any, to: str) -> Any:
        self.moves.append((key, to))
        self.started.set()
        if self.gate is not None:
            await self.gate.wait()
        await anyio.lowlevel.checkpoint()
        return f"{key}@{to}"


class Releaser:
    async def release(self, key: Hashable, value: Any) -> None:
        pass


class Two(NamedTuple):
    """Two processes of one daemon: ``one`` with a moving cache ``w`` (``mover``), and
    ``two`` with a cache ``v`` whose releaser cannot move."""

    daemon: Daemon
    mover: Mover
    one: Broker
    c1: Cache
    two: Broker
    c2: Cache


@contextlib.asynccontextmanager
async def two_processes(budget: dict[str, int]) -> AsyncIterator[Two]:
    async with serving(budget=budget, tiers=TIERS) as daemon:
        mover = Mover()
        async with (
            Broker.connect(daemon.address) as one,
            one.cache("w", mover) as c1,
            Broker.connect(daemon.address) as two,
            two.cache("v", Releaser()) as c2,
        ):
            yield Two(daemon, mover, one, c1, two, c2)


async def use(cache: Any, key: str, size: int = 60, **kw: Any) -> Any:
    async with cache.acquire(key, load=value(f"{key}@gpu"), size={"gpu": size}, **kw) as lease:
        return lease.value


async def test_another_process_s_room_demotes_an_idle_value_and_an_acquire_brings_it_back() -> None:
    async with two_processes(BUDGET) as (daemon, mover, one, c1, _two, c2):
        assert await use(c1, "a") == "a@gpu"
        assert await use(c2, "b") == "b@gpu"  # a goes down to ram, in its process
        assert mover.moves == [("a", "ram")] and mover.released == []
        entries = {e.key: e for e in await one.entries()}
        assert entries["a"].state == "demoted" and entries["a"].charge == {"ram": 60}
        assert entries["a"].home == {"gpu": 60}
        assert ("'a'", "demoted", 0, {"ram": 60}) in listed(daemon)
        # Back up: b (whose releaser cannot move) is released for it.
        assert await use(c1, "a") == "a@gpu"  # moved back, not loaded
        assert mover.moves == [("a", "ram"), ("a", "gpu")]
        stats = await one.stats()
        assert stats.demotions == 1 and stats.promotions == 1 and stats.loads == 1
        assert stats.broker_used == {"gpu": 60, "ram": 0}
        assert listed(daemon) == [("'a'", "ready", 0, {"gpu": 60})]
        daemon.runner.core.check()


async def test_a_value_leased_again_before_its_move_is_asked_stays_and_is_not_moved() -> None:
    async with two_processes(BUDGET) as (daemon, mover, one, c1, _two, c2):
        await use(c1, "a")
        link = link_of(one)
        # The daemon's ask and this process's new lease cross: the ask finds it held.
        real = link.move

        def move_after_a_lease(message: dict[str, Any]) -> None:
            lease_now()
            real(message)

        held: list[Any] = []

        def lease_now() -> None:
            entry = one._runner.core.owners["w"].entries["a"]
            one._runner.core.hit(entry, "another task")
            held.append(entry)

        link.move = move_after_a_lease  # type: ignore[method-assign]
        with pytest.raises(AcquireTimeout):
            await c2.acquire("b", load=value("B"), size={"gpu": 60}, timeout=0.5)
        assert mover.moves == []
        assert ("'a'", "ready", 1, {"gpu": 60}) in listed(daemon)
        daemon.runner.core.check()
        link.move = real  # type: ignore[method-assign]
        one._runner.core.lease_end(held[0], "another task", 0.0)
        one._runner.apply()
        assert await use(c2, "b") == "b@gpu"  # now a goes down
        assert mover.moves == [("a", "ram")]


# -- over a daemon restart ---------------------------------------------------------

SWAP = {"gpu": 100, "ram": 150}  # room in ram for both: a promotion swaps a and b


async def restarted(run: Daemons, broker: Broker, listing: list[Any]) -> Daemon:
    """Stop the daemon and start another (with ``SWAP`` and ``TIERS``); wait until
    ``broker`` has registered with it and its books list ``listing``."""
    await run.stop()
    await until(lambda: not link_of(broker).online)
    second = await run.start(SWAP, tiers=TIERS)
    await until(lambda: link_of(broker).online and listed(second) == listing)
    second.runner.core.check()
    return second


async def test_a_restarted_daemon_books_a_demoted_value_demoted_and_brings_it_back(
    address: str,
) -> None:
    async with daemons(address) as run:
        first = await run.start(SWAP, tiers=TIERS)
        mover = Mover()
        async with Broker.connect(address) as one, one.cache("w", mover) as c1:
            await use(c1, "a")
            await use(c1, "b")
            assert ("'a'", "demoted", 0, {"ram": 60}) in listed(first)
            second = await restarted(
                run, one, [("'a'", "demoted", 0, {"ram": 60}), ("'b'", "ready", 0, {"gpu": 60})]
            )
            assert await use(c1, "a") == "a@gpu"  # its home, as the daemon before knew it
            assert mover.moves == [("a", "ram"), ("b", "ram"), ("a", "gpu")]
            await until(
                lambda: (
                    listed(second)
                    == [("'a'", "ready", 0, {"gpu": 60}), ("'b'", "demoted", 0, {"ram": 60})]
                )
            )
            second.runner.core.check()


async def test_a_move_under_way_over_a_restart_is_charged_in_both_spaces_until_it_ends(
    address: str,
) -> None:
    async with daemons(address) as run:
        first = await run.start(SWAP, tiers=TIERS)
        mover = Mover()
        mover.gate = anyio.Event()
        async with Broker.connect(address) as one, one.cache("w", mover) as c1:
            await use(c1, "a")
            async with anyio.create_task_group() as tg:
                got: list[Any] = []

                async def b() -> None:
                    got.append(await use(c1, "b", timeout=20))

                tg.start_soon(b)
                await mover.started.wait()  # a's move down runs, held by the gate
                # The move's two charges: nobody is granted room it may still hold
                # (b's request, asked again, waits for a's).
                second = await restarted(
                    run,
                    one,
                    [("'a'", "loading", 0, {"gpu": 60, "ram": 60}), ("'b'", "waiting", 0, {})],
                )
                assert second.runner.core.spaces["gpu"].used == 60
                mover.gate.set()
            assert got == ["b@gpu"]
            await until(
                lambda: (
                    listed(second)
                    == [("'a'", "demoted", 0, {"ram": 60}), ("'b'", "ready", 0, {"gpu": 60})]
                )
            )
            second.runner.core.check()
            mover.gate = None
            assert await use(c1, "a") == "a@gpu"  # demoted there: it comes back up
            assert first is not second


async def test_a_promotion_waiting_for_room_over_a_restart_is_asked_for_again(
    address: str,
) -> None:
    async with daemons(address) as run:
        await run.start(SWAP, tiers=TIERS)
        mover = Mover()
        async with Broker.connect(address) as one, one.cache("w", mover) as c1:
            await use(c1, "a")
            holder = await c1.acquire("b", load=value("b@gpu"), size={"gpu": 60})
            async with anyio.create_task_group() as tg:
                got: list[Any] = []

                async def a() -> None:
                    got.append(await use(c1, "a", timeout=20))

                tg.start_soon(a)
                await until(lambda: one.stats_nowait().waiting == 1)  # b is leased
                second = await restarted(
                    run, one, [("'a'", "demoted", 0, {"ram": 60}), ("'b'", "ready", 1, {"gpu": 60})]
                )
                await holder.release()
            assert got == ["a@gpu"]
            assert mover.moves == [("a", "ram"), ("b", "ram"), ("a", "gpu")]
            second.runner.core.check()


# -- cachebroker serve --tiers ----------------------------------------------------


@pytest.mark.parametrize(
    ("tiers", "message"),
    [("gpu", "space=lower space"), ("gpu=disk", "not in the budget"), ("gpu=gpu", "below itself")],
)
def test_serve_refuses_bad_tiers_saying_what_was_wrong(tiers: str, message: str) -> None:
    done = subprocess.run(
        [
            *(sys.executable, "-m", "cachebroker", "serve", "--budget", "gpu=1GiB,ram=2GiB"),
            *("--tiers", tiers, "--socket", "/tmp/cb-never.sock"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and message in done.stderr, done.stderr


# -- cachebroker ps ---------------------------------------------------------------


async def test_ps_shows_moves_demoted_entries_and_placements_of_every_process() -> None:
    budget = {"gpu": 100, "g1": 100, "ram": 100}
    async with two_processes(budget) as (daemon, mover, _one, c1, _two, c2):
        await use(c1, "a")
        mover.gate = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(use, c2, "b")  # a moves down for it: held by the gate
            await mover.started.wait()
            await until(lambda: any(e["moving_to"] for e in daemon.listing()["entries"]))
            moving = render(daemon.listing())
            mover.gate.set()

        async def placed(space: str) -> str:
            return f"p@{space}"

        async with c2.acquire("p", load=placed, size=30, spaces=["gpu", "g1"]) as lease:
            assert lease.value == "p@gpu"
        await until(lambda: len(daemon.listing()["entries"]) == 3)
        listing = {e["key"]: e for e in daemon.listing()["entries"]}
        assert listing["'a'"]["state"] == "demoted" and listing["'a'"]["home"] == {"gpu": 60}
        assert listing["'a'"]["pid"] == os.getpid() and listing["'a'"]["moving_to"] is None
        assert listing["'p'"]["places"] == ["gpu", "g1"] and listing["'p'"]["home"] is None
        table = render(daemon.listing())
    [row] = [line for line in moving.splitlines() if "'a'" in line]
    assert "moving" in row and row.endswith("to ram")
    rows = {line.split()[2]: line for line in table.splitlines() if line.split()[2:3]}
    assert rows["'a'"].endswith("home gpu") and "demoted" in rows["'a'"]
    assert rows["'p'"].endswith("of gpu|g1") and rows["'b'"].endswith("-")


async def test_a_move_that_ends_after_release_timeout_is_released_through_its_process() -> None:
    """A move down the daemon asked for runs past the daemon's ``release_timeout``
    (quarantined, both charges held); once it ends there, the daemon releases the
    moved value through the process (``Releases._release_late_move``): it must ask
    the process, and both charges come back, so another process's request fits."""
    async with serving(budget=BUDGET, tiers=TIERS, release_timeout=30) as daemon:
        mover = Mover()
        mover.gate = anyio.Event()
        async with (
            Broker.connect(daemon.address) as one,
            one.cache("w", mover) as c1,
            Broker.connect(daemon.address) as two,
            two.cache("v", Releaser()) as c2,
        ):
            # (the processes took 30 s: only the daemon's watchdog fires)
            daemon.runner.release_timeout = 0.2  # type: ignore[misc]
            async with c1.acquire("a", load=value("a@gpu"), size={"gpu": 60}):
                pass
            outcome: list[Any] = []

            async def want_b() -> None:
                try:
                    async with c2.acquire("b", load=value("b@gpu"), size={"gpu": 60}) as lease:
                        outcome.append(lease.value)
                except Exception as exc:  # (refused while a is quarantined: fine)
                    outcome.append(type(exc).__name__)

            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(want_b)
                    await mover.started.wait()
                    # The daemon's watchdog quarantines the move (it runs on there).
                    await until(lambda: bool(daemon.runner.core.quarantined))
                    mover.gate.set()  # it ends there: the daemon releases what it moved
            # The daemon asks the process to release the late-moved value; both
            # charges come back.
            await until(lambda: mover.released == ["a"])
            await until(lambda: all(key != "'a'" for key, *_ in listed(daemon)))
            async with c2.acquire("b2", load=value("B"), size={"gpu": 60}, timeout=5) as lease:
                assert lease.value == "B"
            daemon.runner.core.check()
