"""A lease granted in the very step its waiter is cancelled is given back, not leaked.

The loader cancels the waiter's scope and returns in the same step: the load's
end grants the waiter's ticket (``Ticket.outcome is True``) while the waiter is
already cancelled, so it never sees the lease. ``Runner._wait`` must end that
lease (``Core.lease_end``); ``Core.leave`` would do nothing for a ticket already
granted, and the entry would stay leased for good: never idle, never evicted,
and the cache's close would wait for it. No sleeps: the race is arranged, not
hoped for, on asyncio, uvloop and trio alike.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from tests.brokers import open_broker

pytestmark = pytest.mark.anyio


class Releaser:
    def __init__(self) -> None:
        self.released: list[Hashable] = []

    async def release(self, key: Hashable, value: Any) -> None:
        await anyio.lowlevel.checkpoint()
        self.released.append(key)


async def test_a_lease_granted_as_its_waiter_is_cancelled_is_given_back(kind: str) -> None:
    releaser = Releaser()
    # release_timeout bounds the close only if the lease leaked (the test fails then).
    async with open_broker(kind, budget=100, release_timeout=2) as broker:
        async with broker.cache("p", releaser) as cache:
            scope = anyio.CancelScope()

            async def load() -> str:
                await anyio.lowlevel.checkpoint()  # the waiter is parked by now
                scope.cancel()  # ... and cancelled in the step that grants it the lease
                return "v"

            acquired = []
            with scope:
                acquired.append(await cache.acquire("k", load=load, size=40))
            assert scope.cancelled_caught, "the waiter was not cancelled: nothing was tested"
            assert acquired == []

            stats = await broker.stats()
            assert (stats.leased, stats.ready, stats.loads) == (0, 1, 1)
            assert stats.used == {"default": 40}
            broker._core.check()
            # Idle, so evictable: clear() releases it at once.
            report = await broker.clear()
            assert (report.entries, report.bytes) == (1, 40)
            assert releaser.released == ["k"]
            assert (await broker.stats()).used == {"default": 0}


async def test_only_the_cancelled_joiner_gives_its_lease_back(kind: str) -> None:
    """Two tasks wait for one load; one is cancelled in the granting step, the other keeps its."""
    releaser = Releaser()
    async with open_broker(kind, budget=100, release_timeout=2) as broker:
        async with broker.cache("p", releaser) as cache:
            cancelled = anyio.CancelScope()
            both_waiting = anyio.Event()
            kept: list[Any] = []
            kept_done = anyio.Event()

            async def load() -> str:
                await both_waiting.wait()
                await anyio.lowlevel.checkpoint()  # the second waiter is parked too
                cancelled.cancel()
                return "v"

            async def keeper() -> None:
                lease = await cache.acquire("k", load=load, size=40)
                kept.append(lease)
                kept_done.set()

            async with anyio.create_task_group() as tg:
                tg.start_soon(keeper)
                await anyio.lowlevel.checkpoint()  # the keeper asks first, starting the load
                with cancelled:
                    both_waiting.set()
                    await cache.acquire("k", load=load, size=40)
                assert cancelled.cancelled_caught
                await kept_done.wait()

            (lease,) = kept
            assert lease.value == "v"
            assert cache._entries["k"].leases == 1  # the keeper's, not the cancelled one's
            assert (await broker.stats()).leased == 1
            broker._core.check()
            await lease.release()
            assert (await broker.stats()).leased == 0
            report = await broker.clear()
            assert report.entries == 1
            assert releaser.released == ["k"]
