"""Prometheus metrics, checked by scraping a registry, on every backend."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import anyio
import anyio.to_thread
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from cachebroker import Broker, BrokerClosed
from cachebroker.metrics import BrokerMetrics, instrument
from tests.brokers import open_broker

pytestmark = pytest.mark.anyio


class Plugin:
    """Releases at once, except the keys it is told to fail or hang on."""

    def __init__(self) -> None:
        self.fail: set[Hashable] = set()
        self.hang: set[Hashable] = set()

    async def release(self, key: Hashable, value: Any) -> None:
        if key in self.fail:
            raise RuntimeError("device busy")
        if key in self.hang:
            await anyio.sleep_forever()


async def load() -> str:
    return "value"


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


async def test_metrics_follow_the_books(kind: str) -> None:
    registry = CollectorRegistry()
    plugin = Plugin()
    async with open_broker(kind, budget=100, release_timeout=0.05) as broker:
        metrics = instrument(broker, registry)
        async with broker.cache("p", plugin) as cache:
            for key in ("a", "b", "a"):  # two loads, one hit
                await (await cache.acquire(key, load=load, size=40)).release()
            held = await cache.acquire("c", load=load, size=40)  # evicts one for space
            assert sample(registry, "cachebroker_used_bytes", space="default") == 80
            assert sample(registry, "cachebroker_budget_bytes", space="default") == 100
            assert sample(registry, "cachebroker_entries", state="ready") == 2
            assert sample(registry, "cachebroker_entries", state="leased") == 1
            assert sample(registry, "cachebroker_waiting_requests") == 0
            assert sample(registry, "cachebroker_hits_total") == 1
            assert sample(registry, "cachebroker_misses_total") == 3
            assert sample(registry, "cachebroker_loads_total") == 3
            assert sample(registry, "cachebroker_evictions_total", reason="capacity") == 1
            assert sample(registry, "cachebroker_evictions_total", reason="idle") == 0
            assert sample(registry, "cachebroker_load_seconds_count") == 3
            assert sample(registry, "cachebroker_load_seconds_bucket", le="+Inf") == 3
            assert sample(registry, "cachebroker_space_wait_seconds_count") == 3
            assert sample(registry, "cachebroker_release_seconds_count") == 1
            await held.release()

            # One release raises, one hangs past release_timeout: both quarantined.
            plugin.fail.add("c")
            # (the one of a and b not evicted for c: b in-process; connected, the daemon's
            # books may have seen a's hit after b's load, which one batch can carry both)
            [left] = [e.key for e in await broker.entries() if e.key in ("a", "b")]
            plugin.hang.add(left)
            assert await cache.invalidate("c")
            assert await cache.invalidate(left)
            await anyio.sleep(0.1)
            assert sample(registry, "cachebroker_releases_failed_total") == 2
            assert sample(registry, "cachebroker_releases_timed_out_total") == 1
            assert sample(registry, "cachebroker_entries", state="quarantined") == 2
            assert sample(registry, "cachebroker_evictions_total", reason="invalidate") == 2
            assert sample(registry, "cachebroker_release_seconds_count") == 3
            await broker.forget("p", "c")
            await broker.forget("p", left)
            text = generate_latest(registry).decode()
            assert "# TYPE cachebroker_load_seconds histogram" in text
            assert "# TYPE cachebroker_hits_total counter" in text
            metrics.close()
            await (await cache.acquire("d", load=load, size=10)).release()
            assert sample(registry, "cachebroker_load_seconds_count") == 3  # closed
            assert sample(registry, "cachebroker_loads_total") == 4  # still read from stats


async def test_a_scrape_from_another_thread_is_taken_on_the_loop(kind: str) -> None:
    registry = CollectorRegistry()
    async with open_broker(kind, budget=100) as broker, broker.cache("p", Plugin()) as cache:
        registry.register(BrokerMetrics(broker, namespace="models"))
        await (await cache.acquire("a", load=load, size=30)).release()
        used = await anyio.to_thread.run_sync(
            lambda: registry.get_sample_value("models_used_bytes", {"space": "default"})
        )
        assert used == 30


async def test_metrics_need_a_running_broker_and_valid_options() -> None:
    broker = Broker(budget=100)
    with pytest.raises(BrokerClosed):
        BrokerMetrics(broker)
    async with broker:
        with pytest.raises(ValueError, match="namespace must be"):
            BrokerMetrics(broker, namespace="bad-name")
        with pytest.raises(ValueError, match="buckets must be increasing"):
            BrokerMetrics(broker, load_buckets=(5, 1))
        with pytest.raises(TypeError, match=r"must be a cachebroker\.Broker"):
            BrokerMetrics("broker")  # type: ignore[arg-type]
