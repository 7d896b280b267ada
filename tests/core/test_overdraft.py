"""A load measured larger than declared overdraws its space: the broker repays just the overdraft.

``Core.load_done(..., measured=...)`` recharges the entry; a space driven over
budget is repaid by evicting idle entries (``_core._scheduler.repay``), and only enough of
them: the shortfall counts what is already being released, so the scheduling
passes that run while those releases are in flight evict nothing more. When the
idle entries cannot cover the whole overdraft, those there are go anyway.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from cachebroker import Broker, Cache
from cachebroker._core import Reason
from tests.harness import Harness


def resident(h: Harness, key: str, size: int) -> None:
    """Load ``key`` and end its lease: an idle entry of ``size`` bytes."""
    ticket = h.acquire(key, size)
    h.finish(ticket.entry)
    h.end(ticket)


def releasing(h: Harness) -> list[Hashable]:
    return [entry.key for entry in h.releasing]


def test_an_overdraft_evicts_just_the_idle_entries_that_cover_it() -> None:
    h = Harness({"m": 100})
    for key in "abcd":
        resident(h, key, 20)
    x = h.acquire("x", 10)
    assert h.used() == 90
    h.finish(x.entry, measured={"m": 50})  # 40 more than declared: 130 charged, 30 over
    assert h.used() == 130
    assert releasing(h) == ["a", "b"]  # 40 covers the 30 over; c and d stay
    h.core.check()

    # Scheduling passes while those releases are in flight: the 40 on their
    # way out already cover the overdraft, so nothing more is evicted.
    h.end(x)  # the measured entry goes idle (a pass with the space overdrawn)
    hit = h.acquire("c")  # a hit on c, and its lease's end
    assert hit.outcome is True
    h.end(hit)
    y = h.acquire("y", 0)  # a new entry that needs no space
    h.finish(y.entry)
    h.end(y)
    assert releasing(h) == ["a", "b"]
    h.core.check()

    for entry in list(h.releasing):
        h.ack(entry)
    assert h.used() == 90
    assert h.released == [("a", Reason.CAPACITY), ("b", Reason.CAPACITY)]
    assert h.cached_keys() == {"c", "d", "x", "y"}
    h.core.check()


def test_victims_of_uneven_sizes_stop_once_the_overdraft_is_covered() -> None:
    h = Harness({"m": 100})
    for key, size in [("a", 5), ("b", 10), ("c", 25), ("d", 40)]:
        resident(h, key, size)
    x = h.acquire("x", 10)  # 90 charged
    h.finish(x.entry, measured={"m": 22})  # 102 charged: 2 over
    assert releasing(h) == ["a"]  # 5 covers 2; the least recently used goes first
    h.end(x)
    assert releasing(h) == ["a"]
    h.ack(h.releasing[0])
    assert h.used() == 97
    assert h.cached_keys() == {"b", "c", "d", "x"}
    h.core.check()


def test_an_overdraft_idle_entries_cannot_cover_evicts_those_there_are() -> None:
    h = Harness({"m": 100})
    resident(h, "a", 20)
    held = h.acquire("held", 50)
    h.finish(held.entry)
    x = h.acquire("x", 10)  # 80 charged
    h.finish(x.entry, measured={"m": 60})  # 130 charged, 30 over; only a (20) is idle
    assert releasing(h) == ["a"]
    h.ack(h.releasing[0])
    assert h.used() == 110  # still 10 over: the next idle entry repays it
    h.end(held)
    assert releasing(h) == ["held"]
    h.ack(h.releasing[0])
    assert h.used() == 60
    assert h.cached_keys() == {"x"}
    h.core.check()


# ------------------------------------------------------------ through the broker


def buffer(size: int) -> Any:
    async def load() -> bytearray:
        await anyio.lowlevel.checkpoint()
        return bytearray(size)

    return load


class GatedReleaser:
    """Records the keys it is asked to release; acknowledges once ``gate`` is set."""

    def __init__(self) -> None:
        self.asked: list[Hashable] = []
        self.done: list[Hashable] = []
        self.gate = anyio.Event()
        self.all_done = anyio.Event()
        self.expected = 0

    async def release(self, key: Hashable, value: Any) -> None:
        self.asked.append(key)
        await self.gate.wait()
        self.done.append(key)
        if len(self.done) == self.expected:
            self.all_done.set()


@pytest.mark.anyio
async def test_a_measured_load_evicts_only_what_its_overdraft_needs() -> None:
    releaser = GatedReleaser()
    # release_timeout: a broken repayment must not stall the test for the default 30 s.
    async with Broker(budget=100, policy="lru", release_timeout=5) as broker:
        async with broker.cache("p", releaser) as cache:
            try:
                await overdraw_and_repay(broker, cache, releaser)
            finally:
                releaser.gate.set()  # a failed assertion must not hold the close for good


async def overdraw_and_repay(broker: Broker, cache: Cache, releaser: GatedReleaser) -> None:
    """Four idle entries of 20 in 100; a load declared 10 measures 50: 30 over."""
    for key in "abcd":
        async with cache.acquire(key, load=buffer(20), size=20):
            pass
    releaser.expected = 2
    lease = await cache.acquire("x", load=buffer(50), size=10, measure=len)
    stats = await broker.stats()
    assert stats.used == {"default": 130}
    assert (stats.releasing, stats.evictions) == (2, 2)
    await lease.release()  # passes while the releases are in flight
    stats = await broker.stats()
    assert (stats.releasing, stats.evictions) == (2, 2)
    async with cache.acquire("c", load=buffer(20), size=20):  # a hit
        pass
    stats = await broker.stats()
    assert (stats.releasing, stats.evictions) == (2, 2)

    releaser.gate.set()
    await releaser.all_done.wait()
    while (await broker.stats()).releasing:  # the acknowledgements are booked
        await anyio.lowlevel.checkpoint()
    assert (len(releaser.done), set(releaser.done)) == (2, {"a", "b"})
    stats = await broker.stats()
    assert stats.used == {"default": 90}
    assert (stats.entries, stats.evictions) == (3, 2)
