"""``Cache`` and ``Lease`` as views over the ``Actor``: the paths the layout refactor moved.

Invalidating an entry that is leased or still loading must not wait on that
lease or load (the view asks the actor to await only releases in flight), and
a lease given options (``pin``, ``idle_ttl``, ``cost``) applies them whether it
is awaited or entered.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from tests.brokers import open_broker
from tests.helpers import Recorder, loader, wait_until

pytestmark = pytest.mark.anyio


async def test_invalidating_a_leased_entry_returns_at_once_and_releases_at_lease_end(
    kind: str,
) -> None:
    plugin = Recorder()
    async with open_broker(kind, budget=100) as broker, broker.cache("p", plugin) as cache:
        lease = await cache.acquire("a", load=loader("v1"), size=10)
        with anyio.fail_after(5):  # it must not wait for the lease it cannot end
            assert await cache.invalidate("a") is True
        assert lease.value == "v1"  # the holder keeps its value
        assert plugin.released == []
        fresh = await cache.acquire("a", load=loader("v2"), size=10)  # a new load, not a hit
        assert fresh.value == "v2"
        await lease.release()
        await wait_until(lambda: plugin.released == ["a"])
        await fresh.release()
        stats = await broker.stats()
        assert stats.used == {"default": 10}


async def test_invalidating_an_entry_that_is_loading_does_not_wait_for_the_load(kind: str) -> None:
    plugin = Recorder()
    started, finish = anyio.Event(), anyio.Event()
    got: list[Any] = []

    async def slow() -> str:
        started.set()
        await finish.wait()
        return "old"

    async with open_broker(kind, budget=100) as broker, broker.cache("p", plugin) as cache:

        async def requester() -> None:
            async with cache.acquire("a", load=slow, size=10) as lease:
                got.append(lease.value)

        async with anyio.create_task_group() as tg:
            tg.start_soon(requester)
            await started.wait()
            with anyio.fail_after(5):
                assert await cache.invalidate("a") is True
            finish.set()
        # The requester got what its load made; the value was released after its lease.
        assert got == ["old"]
        await wait_until(lambda: plugin.released == ["a"])
        async with cache.acquire("a", load=loader("new"), size=10) as lease:
            assert lease.value == "new"


@pytest.mark.parametrize("entered", [False, True], ids=["awaited", "entered"])
async def test_a_lease_with_options_applies_them_awaited_or_entered(
    kind: str, entered: bool
) -> None:
    plugin = Recorder()
    async with open_broker(kind, budget=100) as broker, broker.cache("p", plugin) as cache:
        # pin=True: kept although a later request needs its space and nothing else is idle.
        if entered:
            async with cache.acquire("pinned", load=loader(1), size=60, pin=True, cost=5):
                pass
        else:
            await (await cache.acquire("pinned", load=loader(1), size=60, pin=True)).release()
        # idle_ttl=0: released as soon as its lease ends.
        if entered:
            async with cache.acquire("brief", load=loader(2), size=10, idle_ttl=0):
                pass
        else:
            await (await cache.acquire("brief", load=loader(2), size=10, idle_ttl=0)).release()
        await wait_until(lambda: plugin.released == ["brief"])
        got: list[Any] = []

        async def big() -> None:
            async with cache.acquire("big", load=loader(3), size=60) as lease:
                got.append(lease.value)

        async with anyio.create_task_group() as tg:
            tg.start_soon(big)
            await wait_until(lambda: broker.stats_nowait().waiting == 1)
            assert plugin.released == ["brief"]  # the pinned entry is not asked to go
            assert await cache.unpin("pinned") is True
        assert got == [3]
        assert plugin.released == ["brief", "pinned"]
