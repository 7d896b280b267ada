"""Free and retry: loads that run out of memory free victims and try again.

On both kinds of broker (``kind``): connected, the daemon chooses the victims,
among every process's idle entries, and asks their owners to release them.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import anyio
import pytest

from cachebroker import Broker, Cache, OutOfSpace
from tests.brokers import daemon_of, open_broker, until
from tests.helpers import Device

pytestmark = pytest.mark.anyio


class DeviceFull(Exception):
    """What the fake device raises, like torch.cuda.OutOfMemoryError."""


async def load_all(cache: Cache, device: Device, *items: tuple[str, int]) -> None:
    for key, size in items:
        async with cache.acquire(key, load=device.loader(key, size)):
            pass


async def test_out_of_memory_frees_victims_in_policy_order_and_retries(
    kind: str, events: list[MutableMapping[str, Any]]
) -> None:
    device = Device(100)
    async with open_broker(kind, "1GiB") as broker, broker.cache("gpu", device) as cache:
        await load_all(cache, device, ("a", 40), ("b", 40), ("c", 20))
        async with cache.acquire("big", load=device.loader("big", 70)) as lease:
            assert lease.value == ("big", 70)
        assert device.freed == ["a", "b"]  # oldest first, until the load fit
        stats = await broker.stats()
        assert (stats.oom_retries, stats.releases["retry"], stats.load_failures) == (2, 2, 0)
    retries = [e for e in events if e["event"] == "cachebroker.load.retry"]
    assert [e["freed"] for e in retries] == [[("gpu", "a")], [("gpu", "b")]]


async def test_nothing_left_to_free_fails_chained_to_the_out_of_memory_error(kind: str) -> None:
    device = Device(100)
    async with open_broker(kind, "1GiB") as broker, broker.cache("gpu", device) as cache:
        await load_all(cache, device, ("a", 30))
        with pytest.raises(OutOfSpace, match="nothing is left to free") as info:
            await cache.acquire("huge", load=device.loader("huge", 150))
        causes = []
        error: BaseException | None = info.value
        while error is not None:
            causes.append(error)
            error = error.__cause__
        assert any(isinstance(e, MemoryError) for e in causes)
        assert device.freed == ["a"]
        assert (await broker.stats()).used == {"default": 0}


async def test_configured_error_types_count_as_out_of_memory(kind: str) -> None:
    device = Device(50, error=DeviceFull)
    async with open_broker(kind, "1GiB", oom_errors=DeviceFull) as broker:
        async with broker.cache("gpu", device) as cache:
            await load_all(cache, device, ("a", 40), ("b", 40))
            assert device.freed == ["a"]


async def test_other_errors_are_not_retried(kind: str) -> None:
    device = Device(50, error=DeviceFull)
    async with open_broker(kind, "1GiB") as broker, broker.cache("gpu", device) as cache:
        await load_all(cache, device, ("a", 40))
        with pytest.raises(DeviceFull):
            await load_all(cache, device, ("b", 40))
        assert device.freed == []


async def test_retries_are_bounded(kind: str) -> None:
    device = Device(100)
    async with (
        open_broker(kind, "1GiB", oom_retries=1) as broker,
        broker.cache("gpu", device) as cache,
    ):
        await load_all(cache, device, ("a", 30), ("b", 30), ("c", 30))
        with pytest.raises(OutOfSpace, match="1 retries after freeing did not help"):
            await load_all(cache, device, ("big", 80))
        assert device.freed == ["a"]


async def test_loader_raising_out_of_space_is_retried(kind: str) -> None:
    device = Device(60, error=OutOfSpace)
    async with open_broker(kind, "1GiB") as broker, broker.cache("gpu", device) as cache:
        await load_all(cache, device, ("a", 40), ("b", 40))
        assert device.freed == ["a"]


def test_bad_oom_settings_are_rejected() -> None:
    with pytest.raises(TypeError, match="oom_errors must be exception classes"):
        Broker(budget=1, oom_errors=(ValueError, "MemoryError"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="oom_retries must be a non-negative int"):
        Broker(budget=1, oom_retries=-1)
    with pytest.raises(ValueError, match="oom_retries must be a non-negative int, got True"):
        Broker.connect("/nonexistent.sock", oom_retries=True)


async def test_a_load_cancelled_while_victims_are_freed_leaves_nothing_behind(kind: str) -> None:
    """A load out of memory whose acquire is cancelled while its victim's release runs:
    the victim's release still ends (its bytes come back), the load leaves the books,
    and a later acquire of the key loads afresh; connected, the daemon's late answer
    to the cancelled load is ignored and its books agree."""
    device = Device(100)
    go_on = anyio.Event()
    releasing = anyio.Event()

    async def slow_release(key: str, value: tuple[str, int]) -> None:
        releasing.set()
        await go_on.wait()
        await device.release(key, value)

    async with open_broker(kind, 100) as broker, broker.cache("gpu", slow_release) as cache:
        await load_all(cache, device, ("a", 70))
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:

                async def cancel_once_releasing() -> None:
                    await releasing.wait()
                    scope.cancel()

                tg.start_soon(cancel_once_releasing)
                await cache.acquire("b", load=device.loader("b", 50), size=20)
        assert scope.cancelled_caught
        go_on.set()
        await until(lambda: device.freed == ["a"])
        async with cache.acquire("b", load=device.loader("b", 50), size=20) as lease:
            assert lease.value == ("b", 50)
        await until(lambda: broker.stats_nowait().used == {"default": 20})
        daemon = daemon_of(broker)
        if daemon is not None:
            await until(lambda: daemon.totals()["used"] == {"default": 20})


async def test_two_loads_out_of_memory_at_once_free_one_victim_each(kind: str) -> None:
    """Two loads run out of memory together: each gets its own victim (a victim
    being released is no victim any more), both retry and succeed."""
    device = Device(100)
    async with open_broker(kind, 200) as broker, broker.cache("gpu", device) as cache:
        await load_all(cache, device, ("a", 40), ("c", 40))
        got: list[object] = []

        async def load(key: str) -> None:
            async with cache.acquire(key, load=device.loader(key, 30), size=10) as lease:
                got.append(lease.value)
                await until(lambda: len(got) == 2)  # (both held at once)

        async with anyio.create_task_group() as tg:
            tg.start_soon(load, "b")
            tg.start_soon(load, "d")
        assert sorted(got) == [("b", 30), ("d", 30)]  # type: ignore[type-var]
        assert sorted(device.freed[:2]) == ["a", "c"]
        stats = await broker.stats()
        assert stats.oom_retries == 2, stats
