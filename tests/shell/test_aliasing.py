"""Learned space aliasing: spaces that turn out to be one memory are merged."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import pytest

from cachebroker import Broker, Cache
from tests.brokers import open_broker
from tests.helpers import Device

pytestmark = pytest.mark.anyio

SPACES = {"whisper:cuda:0": 24, "llama:cuda:0": 24}


async def use(cache: Cache, device: Device, key: str, size: int, space: str) -> None:
    async with cache.acquire(key, load=device.loader(key, size), size={space: size}):
        pass


async def churn(broker: Broker, device: Device, rounds: int) -> None:
    """Each round, whisper's load only fits once llama's model is freed."""
    async with broker.cache("llama", device) as llama, broker.cache("whisper", device) as whisper:
        for i in range(rounds):
            await use(llama, device, f"llama-{i}", 20, "llama:cuda:0")
            await use(whisper, device, f"whisper-{i}", 10, "whisper:cuda:0")
            await whisper.invalidate(f"whisper-{i}")


async def test_spaces_freed_for_each_other_are_learned_as_one(
    kind: str,
    events: list[MutableMapping[str, Any]],
) -> None:
    device = Device(24)
    async with open_broker(kind, budget=SPACES, alias_threshold=3) as broker:
        await churn(broker, device, 3)
        stats = await broker.stats()
        assert stats.aliases == (("llama:cuda:0", "whisper:cuda:0"),)
        assert stats.oom_retries == 3
        # (the process's own: a daemon in this loop logs its own too, under "whisper@pid")
        learned = [
            e
            for e in events
            if e["event"] == "cachebroker.alias.learned" and "@" not in str(e["cache"])
        ]
        assert len(learned) == 1
        # From now on the books know: a whisper model evicts llama's by accounting alone.
        async with broker.cache("llama", device) as llama, broker.cache("whisper", device) as wh:
            await use(llama, device, "l", 20, "llama:cuda:0")
            await use(wh, device, "w", 10, "whisper:cuda:0")
            stats = await broker.stats()
            assert stats.used == {"whisper:cuda:0": 10, "llama:cuda:0": 10}
            assert stats.oom_retries == 3  # no new out-of-memory error was needed


async def test_coincidences_below_the_threshold_are_not_learned(kind: str) -> None:
    device = Device(24)
    async with open_broker(kind, budget=SPACES, alias_threshold=3) as broker:
        await churn(broker, device, 2)
        stats = await broker.stats()
        assert stats.aliases == ()
        assert stats.oom_retries == 2


async def test_given_aliases_share_capacity_and_victims() -> None:
    device = Device(1000)
    broker = Broker(budget={"a": 100, "b": 60, "c": 50}, aliases=[("a", "b")])
    async with broker, broker.cache("p", device) as cache:
        await use(cache, device, "in-a", 70, "a")
        await use(cache, device, "in-b", 50, "b")  # 70 + 50 > 100: evicts the one in "a"
        assert device.freed == ["in-a"]
        stats = await broker.stats()
        assert stats.used == {"a": 50, "b": 50, "c": 0}
        assert stats.aliases == (("a", "b"),)


async def test_learned_aliases_round_trip_into_a_new_broker(kind: str) -> None:
    device = Device(24)
    async with open_broker(kind, budget=SPACES, alias_threshold=1) as first:
        await churn(first, device, 1)
        learned = (await first.stats()).aliases
    assert learned
    async with open_broker(kind, budget=SPACES, aliases=learned) as second:
        assert (await second.stats()).aliases == learned


@pytest.mark.parametrize(
    ("aliases", "error", "match"),
    [
        ([("a", "zz")], ValueError, "unknown space 'zz'"),
        ([("a",)], ValueError, "at least two spaces"),
        (["ab"], TypeError, "groups of space names"),
    ],
)
def test_bad_aliases_are_rejected(aliases: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        Broker(budget={"a": 1, "b": 1}, aliases=aliases)


def test_bad_alias_threshold_is_rejected() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        Broker(budget=1, alias_threshold=0)
