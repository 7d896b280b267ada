"""Fairness in one process, on every backend: no head-of-line blocking behind what a
request may never evict, and a release past its timeout that returns serves a waiter.

The books' rule is tested in ``test_core_fairness``; here the public surface:
who is served while a request waits aside, what ``AcquireTimeout`` says, and
a late release whose bytes go to the request waiting for them.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any

import anyio
import pytest
from anyio import wait_all_tasks_blocked
from anyio.abc import TaskStatus
from anyio.lowlevel import checkpoint

from cachebroker import AcquireTimeout, Broker, Cache, OutOfSpace
from tests.brokers import open_broker
from tests.helpers import wait_until

pytestmark = pytest.mark.anyio

MiB = 1 << 20


async def release(key: Hashable, value: Any) -> None:
    await checkpoint()


async def value() -> str:
    await checkpoint()
    return "v"


async def resident(cache: Cache, key: str, size: int, **options: Any) -> None:
    await (await cache.acquire(key, load=value, size=size, **options)).release()


async def waiting(
    cache: Cache,
    key: str,
    size: int,
    outcome: dict[str, Any],
    *,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    **options: Any,
) -> None:
    """Acquire ``key`` and record how it ended (``"granted"`` or the exception)."""
    task_status.started()
    try:
        async with cache.acquire(key, load=value, size=size, **options):
            outcome[key] = "granted"
    except Exception as exc:
        outcome[key] = exc


@pytest.mark.parametrize(
    "setup",
    [
        pytest.param({"dear": (6 * MiB, {"priority": 10})}, id="priority"),
        pytest.param({"pinned": (6 * MiB, {"pin": True})}, id="pin"),
        pytest.param(
            {"pinned": (3 * MiB, {"pin": True}), "dear": (3 * MiB, {"priority": 10})},
            id="both",
        ),
    ],
)
async def test_a_request_that_fits_is_served_past_one_that_no_eviction_could_serve(
    kind: str,
    setup: Mapping[str, tuple[int, dict[str, Any]]],
) -> None:
    """10 MiB; what ``setup`` loads a priority-0 request may never evict: a request for
    6 (5 with both) waits, and a later one for 1 MiB is served at once."""
    async with open_broker(kind, budget="10MiB") as broker, broker.cache("m", release) as cache:
        for key, (size, options) in setup.items():
            await resident(cache, key, size, **options)
        outcome: dict[str, Any] = {}
        big = 5 * MiB if len(setup) > 1 else 6 * MiB
        async with anyio.create_task_group() as tg:
            await tg.start(waiting, cache, "big", big, outcome)
            await wait_all_tasks_blocked()
            await tg.start(waiting, cache, "small", 1 * MiB, outcome)
            await wait_all_tasks_blocked()
            assert outcome == {"small": "granted"}  # and "big" still waits
            tg.cancel_scope.cancel()
        assert set(broker.stats_nowait().used) == {"default"}


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        pytest.param({"priority": 10}, ["higher priority than its 0", "m:'held'"], id="priority"),
        pytest.param({"pin": True}, ["pinned entries", "m:'held'"], id="pin"),
    ],
)
async def test_the_timeout_of_a_request_waiting_aside_says_what_holds_the_room(
    kind: str, options: dict[str, Any], expected: list[str]
) -> None:
    async with open_broker(kind, budget="10MiB") as broker, broker.cache("m", release) as cache:
        await resident(cache, "held", 6 * MiB, **options)
        with pytest.raises(AcquireTimeout) as caught:
            await cache.acquire("big", load=value, size=6 * MiB, timeout=0.02)
        assert caught.value.waiting_for == "space"
        message = str(caught.value)
        for part in ["4.0 MiB of 10.0 MiB free in 'default'", *expected]:
            assert part in message, message


async def test_an_aside_request_takes_its_place_in_line_once_the_pin_is_lifted(kind: str) -> None:
    async with open_broker(kind, budget="10MiB") as broker, broker.cache("m", release) as cache:
        await resident(cache, "pinned", 6 * MiB, pin=True)
        outcome: dict[str, Any] = {}
        async with anyio.create_task_group() as tg:
            await tg.start(waiting, cache, "big", 6 * MiB, outcome)
            await wait_all_tasks_blocked()
            assert await cache.unpin("pinned")
            await wait_until(lambda: outcome == {"big": "granted"})  # (messages cross, connected)


# ----------------------------------------------- a release that returns after its timeout


class LateReleaser:
    """Releases ``late`` only once ``go`` is set; any other key at once."""

    def __init__(self, late: str) -> None:
        self.late = late
        self.go = anyio.Event()
        self.raises = False

    async def release(self, key: Hashable, value: Any) -> None:
        if key == self.late:
            await self.go.wait()
            if self.raises:
                raise RuntimeError("the device would not let go")
        await checkpoint()


def timed_out(broker: Broker) -> anyio.Event:
    """Set when the broker logs a release's timeout (its entry is quarantined)."""
    event = anyio.Event()

    def listener(name: str, fields: Mapping[str, Any]) -> None:
        if name == "cachebroker.release.failed" and fields.get("timed_out"):
            event.set()

    broker.add_listener(listener)
    return event


async def test_a_late_return_frees_the_bytes_for_the_request_waiting_for_them(kind: str) -> None:
    """``release_timeout`` passes while the releaser runs on: the request for the whole
    budget waits (no ``OutOfSpace``), and the late return grants it in the same step."""
    plugin = LateReleaser("old")
    async with (
        open_broker(kind, budget="10MiB", release_timeout=0.02) as broker,
        broker.cache("m", plugin) as cache,
    ):
        await resident(cache, "old", 10 * MiB)
        late = timed_out(broker)
        outcome: dict[str, Any] = {}
        async with anyio.create_task_group() as tg:
            await tg.start(waiting, cache, "big", 10 * MiB, outcome)
            await late.wait()
            await wait_all_tasks_blocked()
            assert outcome == {}  # still waiting for the bytes that may come back
            assert broker.stats_nowait().quarantined_keys == (("m", "old"),)
            plugin.go.set()
            await wait_all_tasks_blocked()
            assert outcome == {"big": "granted"}
        stats = broker.stats_nowait()
        assert stats.quarantined == 0 and stats.releases_failed == 1


async def test_a_release_that_raises_after_its_timeout_refuses_who_waited(kind: str) -> None:
    plugin = LateReleaser("old")
    plugin.raises = True
    async with (
        open_broker(kind, budget="10MiB", release_timeout=0.02) as broker,
        broker.cache("m", plugin) as cache,
    ):
        await resident(cache, "old", 10 * MiB)
        late = timed_out(broker)
        outcome: dict[str, Any] = {}
        async with anyio.create_task_group() as tg:
            await tg.start(waiting, cache, "big", 10 * MiB, outcome)
            await late.wait()
            await wait_all_tasks_blocked()
            assert outcome == {}
            plugin.go.set()
            await wait_all_tasks_blocked()
            assert isinstance(outcome["big"], OutOfSpace)
            assert "only broker.forget" in str(outcome["big"])
        assert await broker.forget("m", "old") == 1


async def test_the_timeout_of_a_request_waiting_for_a_late_release_names_it(kind: str) -> None:
    plugin = LateReleaser("old")
    async with (
        open_broker(kind, budget="10MiB", release_timeout=0.02) as broker,
        broker.cache("m", plugin) as cache,
    ):
        await resident(cache, "old", 10 * MiB)
        late = timed_out(broker)
        async with anyio.create_task_group() as tg:
            tg.start_soon(cache.invalidate, "old")
            await late.wait()
        with pytest.raises(AcquireTimeout) as caught:
            await cache.acquire("big", load=value, size=10 * MiB, timeout=0.02)
        message = str(caught.value)
        assert "release is still running past release_timeout" in message, message
        assert "m:'old'" in message
        plugin.go.set()
        await resident(cache, "big", 10 * MiB)


async def test_leaving_the_cache_while_a_late_release_runs_strands_its_bytes(kind: str) -> None:
    """The block's exit cancels the release still running: nobody is left to return the
    bytes, so they stay quarantined for ``forget()``, and a request waiting for them
    (from another cache) fails with ``OutOfSpace`` at that moment."""
    plugin = LateReleaser("old")
    async with open_broker(kind, budget="10MiB", release_timeout=0.02) as broker:
        async with broker.cache("other", release) as other:
            outcome: dict[str, Any] = {}
            async with anyio.create_task_group() as tg:
                async with broker.cache("m", plugin) as cache:
                    await resident(cache, "old", 10 * MiB)
                    late = timed_out(broker)
                    await tg.start(waiting, other, "big", 10 * MiB, outcome)
                    await late.wait()
                    await wait_all_tasks_blocked()
                    assert outcome == {}
                await wait_all_tasks_blocked()
                assert isinstance(outcome["big"], OutOfSpace)
            broker._runner.core.check()
            stats = broker.stats_nowait()
            assert stats.quarantined_keys == (("m", "old"),)
            assert await broker.forget("m", "old") == 1
            await resident(other, "big", 10 * MiB)
