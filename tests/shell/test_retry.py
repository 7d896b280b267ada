"""Free and retry: loads that run out of memory free victims and try again.

On both kinds of broker (``kind``): connected, the daemon chooses the victims,
among every process's idle entries, and asks their owners to release them.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import pytest

from cachebroker import Broker, Cache, OutOfSpace
from tests.brokers import open_broker
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
