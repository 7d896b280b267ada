"""Learned aliasing across processes: evidence from any process is learned at the daemon.

Two processes' spaces (``whisper:cuda:0`` and ``llama:cuda:0``) turn out to
be one GPU: each time one process's load fits only after the daemon freed
another process's entry (free and retry), that is evidence; at the daemon's
threshold its books merge the two, and every process's books do too, so
``stats().aliases`` says so in each, and from then on accounting alone
makes the room. A daemon restart is told what the processes learned.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import pytest

from cachebroker import Broker, Cache
from tests.helpers import Device
from tests.remote.support import serving, until
from tests.remote.test_reconnect import daemons, link_of

pytestmark = pytest.mark.anyio

SPACES = {"whisper:cuda:0": 24, "llama:cuda:0": 24}
ONE = (("llama:cuda:0", "whisper:cuda:0"),)


async def use(cache: Cache, device: Device, key: str, size: int, space: str) -> None:
    async with cache.acquire(key, load=device.loader(key, size), size={space: size}):
        pass


async def test_evidence_from_one_process_merges_the_spaces_for_every_process(
    events: list[MutableMapping[str, Any]],
) -> None:
    device = Device(24)  # one GPU, which the two processes name apart
    async with serving(budget=SPACES, alias_threshold=3) as daemon:
        async with (
            Broker.connect(daemon.address) as one,
            one.cache("llama", device) as llama,
            Broker.connect(daemon.address) as two,
            two.cache("whisper", device) as whisper,
            Broker.connect(daemon.address) as three,
        ):
            for i in range(3):  # whisper's load fits only once llama's model is freed
                await use(llama, device, f"llama-{i}", 20, "llama:cuda:0")
                await use(whisper, device, f"whisper-{i}", 10, "whisper:cuda:0")
                await whisper.invalidate(f"whisper-{i}")
            assert (await two.stats()).oom_retries == 3
            assert daemon.broker.stats_nowait().aliases == ONE
            # Every process's books merged them, the one that never loaded too.
            for broker in (one, two, three):
                await until(lambda b=broker: b.stats_nowait().aliases == ONE)  # type: ignore[misc]
            learned = [e for e in events if e["event"] == "cachebroker.alias.learned"]
            # The daemon's, and one in each process; the loader's own names its cache.
            assert len(learned) == 4
            assert {e["cache"] for e in learned} >= {"whisper"}
            # From now on the daemon's books make the room: no out-of-memory error.
            await use(llama, device, "l", 20, "llama:cuda:0")
            await use(whisper, device, "w", 10, "whisper:cuda:0")
            assert (await two.stats()).oom_retries == 3
            assert device.freed[-1] == "l"
            daemon.runner.core.check()


async def test_a_restarted_daemon_is_told_the_aliases_the_processes_learned(
    address: str,
) -> None:
    async with daemons(address) as run:
        first = await run.start(SPACES)
        first.runner.core.merge_spaces("llama:cuda:0", "whisper:cuda:0")
        async with Broker.connect(address) as one:
            assert (await one.stats()).aliases == ONE  # (from the welcome)
            await run.stop()
            await until(lambda: not link_of(one).online)
            second = await run.start(SPACES)
            await until(lambda: second.broker.stats_nowait().aliases == ONE)
            assert link_of(one).online
            assert (await one.stats()).aliases == ONE
