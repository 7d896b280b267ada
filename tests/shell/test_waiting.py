"""A request waiting for space shows as waiting, in one process and through the daemon.

Through ``cachebroker serve`` a load these books granted waits for the
daemon's grant; that wait is a wait for space, and the figures say so as
they do in one process: ``stats().waiting``, ``entries()`` (state
``"waiting"``, nothing charged yet), the ``cachebroker.grant`` event's
``waited`` (the ``cachebroker_space_wait_seconds`` histogram) and the
``cachebroker_waiting_requests`` gauge.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from tests.brokers import loaded, open_broker, quick, until

pytestmark = pytest.mark.anyio


async def test_a_request_waiting_for_space_is_counted_listed_and_timed(kind: str) -> None:
    """Invariant: while a request waits for room, ``stats().waiting`` counts it,
    ``entries()`` lists it as waiting with no charge, and ``used`` holds only what is
    granted; once granted, its ``cachebroker.grant`` event says how long it waited."""
    grants: list[dict[str, Any]] = []
    async with open_broker(kind, {"m": 100}) as broker:
        broker.add_listener(
            lambda event, fields: (
                grants.append(dict(fields)) if event == "cachebroker.grant" else None
            )
        )
        async with broker.cache("c", quick) as cache:
            held = await cache.acquire("a", load=loaded(1), size={"m": 100})
            async with anyio.create_task_group() as tg:
                got: list[Any] = []
                asked_at = 0.0

                async def wait_for_b() -> None:
                    nonlocal asked_at
                    asked_at = anyio.current_time()
                    async with cache.acquire("b", load=loaded(2), size={"m": 50}) as lease:
                        got.append(lease.value)

                tg.start_soon(wait_for_b)
                await until(lambda: broker.stats_nowait().waiting == 1)
                await anyio.sleep(0.05)  # (a wait long enough to be seen in ``waited``)
                stats = await broker.stats()
                assert stats.waiting == 1
                assert stats.used == {"m": 100}
                assert stats.entries == 1
                assert stats.loading == 0
                waiting = [e for e in await broker.entries() if e.key == "b"]
                assert [(e.state, e.charge, e.waiting) for e in waiting] == [("waiting", {}, 1)]
                released_at = anyio.current_time()
                await held.release()
            assert got == [2]
    waited = {g["key"]: g["waited"] for g in grants}
    # (uvloop's clock ticks in milliseconds and ``waited`` is rounded to them: one
    # tick either way at each end)
    assert waited["b"] >= released_at - asked_at - 0.002, grants
    assert waited["b"] >= 0.05, grants
    assert (await _stats_after(kind)).waiting == 0


async def _stats_after(kind: str) -> Any:
    """A fresh broker of ``kind`` waits for nothing (the figures start at zero)."""
    async with open_broker(kind, {"m": 100}) as broker:
        return await broker.stats()


async def test_the_waiting_gauge_follows_the_wait(kind: str) -> None:
    """The ``cachebroker_waiting_requests`` series reads ``stats().waiting``: 1 while the
    request waits for the daemon's grant (or the local books' room), 0 once granted."""
    from cachebroker._series import SERIES

    gauge = next(s for s in SERIES if s.name == "waiting_requests")
    async with open_broker(kind, {"m": 100}) as broker, broker.cache("c", quick) as cache:
        held = await cache.acquire("a", load=loaded(1), size={"m": 100})
        async with anyio.create_task_group() as tg:
            tg.start_soon(_acquire_and_release, cache, "b")
            await until(lambda: broker.stats_nowait().waiting == 1)
            assert gauge.read(broker.stats_nowait()) == 1
            await held.release()
        assert gauge.read(broker.stats_nowait()) == 0


async def _acquire_and_release(cache: Any, key: str) -> None:
    async with cache.acquire(key, load=loaded(key), size={"m": 50}):
        pass
