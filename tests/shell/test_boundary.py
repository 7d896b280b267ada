"""The promises at the head of the queue, kept alike in one process and through the daemon.

Each test takes the ``kind`` fixture (``tests/brokers.py``): it runs with an
in-process ``Broker`` and with a ``Broker.connect()`` to a daemon in the same
event loop. No head-of-line blocking behind bytes a request may never evict;
a release past its timeout that returns late serves the request waiting for
its bytes; ``AcquireTimeout`` says why the room is not there.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import anyio
import pytest

from cachebroker import AcquireTimeout
from tests.brokers import loaded, open_broker, quick, until

pytestmark = pytest.mark.anyio

MiB = 1 << 20


@pytest.mark.parametrize("blocker", ["priority", "pin"])
async def test_a_request_that_fits_is_not_held_up_behind_one_that_never_can(
    kind: str, blocker: str
) -> None:
    """10 MiB; 6 MiB held by an idle priority-10 entry (or a pinned one): a 6 MiB
    request of priority 0 waits aside, and a later 1 MiB request is served at once."""
    async with open_broker(kind, 10 * MiB) as broker, broker.cache("c", quick) as cache:
        if blocker == "priority":
            async with cache.acquire("high", load=loaded(1), size=6 * MiB, priority=10):
                pass
        else:
            await cache.prefetch("high", load=loaded(1), size=6 * MiB, pin=True)
        async with anyio.create_task_group() as tg:
            big: list[BaseException] = []

            async def ask_big() -> None:
                try:
                    await cache.acquire("big", load=loaded(2), size=6 * MiB, timeout=3)
                except AcquireTimeout as exc:
                    big.append(exc)

            tg.start_soon(ask_big)
            await until(lambda: broker.stats_nowait().waiting == 1)
            with anyio.fail_after(2):  # (long before the big one's timeout)
                async with cache.acquire("small", load=loaded(3), size=MiB) as lease:
                    assert lease.value == 3
        (error,) = big
        assert ("pinned" if blocker == "pin" else "priority") in str(error), error


async def test_a_release_that_returns_after_its_timeout_serves_the_waiter(kind: str) -> None:
    """``release_timeout`` passes while the releaser still runs: the entry is quarantined,
    but its bytes may come back, so a request for the whole budget waits (within its own
    timeout) instead of failing, and is served when the release returns."""
    gate = anyio.Event()

    async def slow(key: Hashable, value: Any) -> None:
        await gate.wait()

    async with open_broker(kind, {"m": 100}, release_timeout=0.1) as broker:
        async with broker.cache("c", slow) as cache:
            async with cache.acquire("a", load=loaded(1), size={"m": 100}):
                pass
            async with anyio.create_task_group() as tg:
                got: list[Any] = []

                async def whole() -> None:
                    lease = cache.acquire("b", load=loaded(2), size={"m": 100}, timeout=20)
                    async with lease:
                        got.append(lease.value)

                tg.start_soon(whole)
                await until(lambda: broker.stats_nowait().quarantined == 1)
                await anyio.sleep(0.2)  # past the timeout: still waiting, not refused
                assert not got and broker.stats_nowait().waiting == 1
                gate.set()
            assert got == [2]
