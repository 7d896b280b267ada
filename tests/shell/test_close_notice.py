"""Leaving a cache block or the broker says what it waits for, once, when the wait is long.

The exit waits up to ``release_timeout`` for releases to be acknowledged and
leases to end. Past ``CLOSE_NOTICE`` seconds it logs ``cachebroker.close.waiting``
(warning) naming the releases (``cache:key``), the leases and the loads it
waits for and how many seconds at most; a quick exit says nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

import anyio
import pytest

from cachebroker import Broker
from cachebroker._shell import _runner
from tests.brokers import open_broker
from tests.helpers import loader
from tests.shell.support import Faulty, fill

pytestmark = pytest.mark.anyio

WAITING = "cachebroker.close.waiting"


def waiting(events: list[MutableMapping[str, Any]]) -> list[MutableMapping[str, Any]]:
    return [e for e in events if e["event"] == WAITING]


@pytest.fixture
def prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    """A notice after a hundredth of a second, so that the tests do not wait one."""
    monkeypatch.setattr(_runner, "CLOSE_NOTICE", 0.01, raising=False)


@pytest.mark.usefixtures("prompt")
async def test_leaving_the_broker_while_a_release_hangs_says_which_and_for_how_long(
    events: list[MutableMapping[str, Any]],
) -> None:
    plugin = Faulty(slow="late")
    # (bounded: before the notice, the exit waited all of it in silence, shielded)
    broker = Broker(budget=100, release_timeout=5)

    def answer(event: str, fields: Mapping[str, Any]) -> None:
        if event == WAITING:
            plugin.late.set()  # the release returns once the wait is announced

    broker.add_listener(answer)
    filled, done = anyio.Event(), anyio.Event()

    async def plugin_task() -> None:
        async with broker.cache("p", plugin) as cache:
            await fill(cache, "slow", size=20)
            await fill(cache, "quick", size=20)
            filled.set()
            await done.wait()  # the broker is left first, its cache still open

    with anyio.fail_after(20):
        async with anyio.create_task_group() as outer:
            async with broker:
                outer.start_soon(plugin_task)
                await filled.wait()
            done.set()
    (notice,) = waiting(events)
    assert notice["log_level"] == "warning"
    assert notice["cache"] == "p"
    assert "p:'slow'" in notice["releases"]
    assert notice["leases"] == [] and notice["loads"] == []
    assert 0 < notice["seconds"] <= 5
    assert sorted(plugin.freed) == ["quick", "slow"]
    assert broker.stats_nowait().used == {"default": 0}


@pytest.mark.usefixtures("prompt")
async def test_leaving_a_cache_while_a_lease_is_held_names_the_lease(
    kind: str,
    events: list[MutableMapping[str, Any]],
) -> None:
    async with open_broker(kind, budget=100, release_timeout=5) as broker:
        ended = anyio.Event()

        def answer(event: str, fields: Mapping[str, Any]) -> None:
            if event == WAITING:
                ended.set()

        broker.add_listener(answer)
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                async with broker.cache("p", Faulty()) as cache:
                    lease = await cache.acquire("held", load=loader(1), size=10)

                    async def end_when_asked() -> None:
                        await ended.wait()
                        await lease.release()

                    tg.start_soon(end_when_asked)
    (notice,) = waiting(events)
    assert (notice["cache"], notice["leases"], notice["releases"]) == ("p", ["p:'held'"], [])
    assert 0 < notice["seconds"] <= 5


async def test_a_quick_exit_says_nothing(kind: str, events: list[MutableMapping[str, Any]]) -> None:
    async with open_broker(kind, budget=100) as broker:
        async with broker.cache("p", Faulty()) as cache:
            await fill(cache, "a", size=20)
            await fill(cache, "b", size=20)
        async with broker.cache("q", Faulty()) as cache:
            await fill(cache, "c", size=20)
            await broker.clear()
    assert waiting(events) == []


@pytest.mark.usefixtures("prompt")
async def test_without_a_release_timeout_the_notice_says_there_is_no_limit(
    kind: str,
    events: list[MutableMapping[str, Any]],
) -> None:
    plugin = Faulty(slow="late")
    async with open_broker(kind, budget=100, release_timeout=None) as broker:

        def answer(event: str, fields: Mapping[str, Any]) -> None:
            if event == WAITING:
                plugin.late.set()

        broker.add_listener(answer)
        async with broker.cache("p", plugin) as cache:
            await fill(cache, "slow", size=20)
    (notice,) = waiting(events)
    assert (notice["releases"], notice["seconds"]) == (["p:'slow'"], None)
