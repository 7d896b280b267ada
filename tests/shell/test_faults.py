"""Misbehaving plugins and callers: quarantine, timeouts, re-entrancy, cancellation, shutdown."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import anyio
import pytest

from cachebroker import (
    Broker,
    BrokerClosed,
    Cache,
    DeadlockError,
    LeasesOutstanding,
    OutOfSpace,
)
from tests.brokers import daemon_of, open_broker
from tests.helpers import Recorder, loader, wait_until
from tests.shell.support import Faulty, fill

pytestmark = pytest.mark.anyio


async def test_release_that_raises_quarantines_keeps_bytes_and_evicts_another(
    events: list[MutableMapping[str, Any]], kind: str
) -> None:
    plugin = Faulty(a="raise")
    async with open_broker(kind, 100) as broker, broker.cache("p", plugin) as cache:
        await fill(cache, "a")
        await fill(cache, "b")
        async with cache.acquire("c", load=loader("c"), size=50):
            stats = await broker.stats()
            assert stats.quarantined == 1
            assert stats.quarantined_keys == (("p", "a"),)
            assert stats.used == {"default": 100}  # a (quarantined) + c
            assert plugin.freed == ["b"]
        failed = [e for e in events if e["event"] == "cachebroker.release.failed"]
        assert failed[0]["key"] == "a"
        assert failed[0]["log_level"] == "error"
        assert "device busy" in failed[0]["error"]


async def test_waiter_that_only_forget_could_serve_fails_fast_and_forget_returns_the_bytes() -> (
    None
):
    plugin = Faulty(a="raise")
    async with Broker(budget=100) as broker, broker.cache("p", plugin) as cache:
        await fill(cache, "a", size=100)
        # b waits for a's release; a's release raises: only forget() could make room.
        with pytest.raises(OutOfSpace, match=r"p:'b' needs .*quarantined.*p:'a'.*forget"):
            await fill(cache, "b")
        assert broker.stats_nowait().waiting == 0
        with pytest.raises(OutOfSpace, match="quarantined"):  # and at once from now on
            await fill(cache, "b")
        assert await broker.forget("p", "a") == 1
        await fill(cache, "b")
        stats = await broker.stats()
        assert (stats.quarantined, stats.used) == (0, {"default": 50})
        assert await broker.forget("p", "a") == 0


async def test_release_past_timeout_is_quarantined_and_late_ack_frees_bytes(kind: str) -> None:
    plugin = Faulty(a="late")
    async with (
        open_broker(kind, 100, release_timeout=0.02) as broker,
        broker.cache("p", plugin) as cache,
    ):
        await fill(cache, "a", size=60)
        report_task_done = anyio.Event()

        async def invalidate() -> None:
            assert await cache.invalidate("a") is True
            report_task_done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(invalidate)
            await report_task_done.wait()  # bounded by the release timeout
            stats = await broker.stats()
            assert (stats.quarantined, stats.used) == (1, {"default": 60})
            plugin.late.set()
            await wait_until(lambda: broker.stats_nowait().used == {"default": 0})
        assert broker.stats_nowait().quarantined == 0
        assert plugin.freed == ["a"]


async def test_releaser_may_call_stats_and_invalidate() -> None:
    seen: list[int] = []
    broker = Broker(budget=100)

    class Curious:
        cache: Cache

        async def release(self, key: str, value: Any) -> None:
            seen.append((await broker.stats()).releasing)
            if key == "a":
                await self.cache.invalidate("b")

    plugin = Curious()
    async with broker, broker.cache("p", plugin) as cache:
        plugin.cache = cache
        await fill(cache, "a", size=40)
        await fill(cache, "b", size=40)
        await fill(cache, "c", size=60)  # evicts a, whose release invalidates b
        assert seen[0] >= 1
        await wait_until(lambda: broker.stats_nowait().used == {"default": 60})


async def test_releaser_waiting_for_space_is_a_clear_error_not_a_deadlock(kind: str) -> None:
    errors: list[BaseException] = []

    class Greedy:
        cache: Cache

        async def release(self, key: str, value: Any) -> None:
            try:
                await self.cache.acquire("x", load=loader("x"), size=100)
            except DeadlockError as exc:
                errors.append(exc)

    plugin = Greedy()
    async with open_broker(kind, 100) as broker, broker.cache("p", plugin) as cache:
        plugin.cache = cache
        await fill(cache, "a", size=100)
        await fill(cache, "b", size=50)
        assert "inside a release" in str(errors[0])
        assert broker.stats_nowait().waiting == 0


async def test_releaser_may_lease_what_is_already_loaded(kind: str) -> None:
    got: list[str] = []

    class Sharing:
        cache: Cache

        async def release(self, key: str, value: Any) -> None:
            if key == "a":
                async with self.cache.acquire("shared", load=loader("never"), size=10) as lease:
                    got.append(lease.value)

    plugin = Sharing()
    async with open_broker(kind, 100) as broker, broker.cache("p", plugin) as cache:
        plugin.cache = cache
        async with cache.acquire("shared", load=loader("S"), size=10):
            await fill(cache, "a", size=80)
            await fill(cache, "b", size=80)
        assert got == ["S"]


async def test_loader_may_acquire_other_keys_and_read_stats(kind: str) -> None:
    async with open_broker(kind, 100) as broker, broker.cache("p", Recorder()) as cache:

        async def load_pipeline() -> str:
            async with cache.acquire("tokenizer", load=loader("tok"), size=10) as tok:
                stats = await broker.stats()
                return f"pipeline({tok.value}, loading={stats.loading})"

        async with cache.acquire("pipeline", load=load_pipeline, size=50) as lease:
            assert lease.value == "pipeline(tok, loading=1)"


async def test_cancelled_lease_holder_gives_its_lease_back(kind: str) -> None:
    async with open_broker(kind, 100) as broker, broker.cache("p", Recorder()) as cache:
        with anyio.move_on_after(0.01):
            async with cache.acquire("k", load=loader(1), size=10):
                await anyio.sleep_forever()
        stats = await broker.stats()
        assert (stats.leased, stats.ready, stats.used) == (0, 1, {"default": 10})


async def test_cancelled_waiter_for_space_leaves_no_trace(kind: str) -> None:
    async with open_broker(kind, 100) as broker, broker.cache("p", Recorder()) as cache:
        async with cache.acquire("held", load=loader(1), size=80):
            async with anyio.create_task_group() as tg:
                tg.start_soon(fill, cache, "big")
                await wait_until(lambda: broker.stats_nowait().waiting == 1)
                tg.cancel_scope.cancel()
            stats = await broker.stats()
            assert (stats.waiting, stats.loading, stats.used) == (0, 0, {"default": 80})
        await fill(cache, "after", size=100)


async def test_big_request_is_not_starved_by_small_ones_that_fit(
    events: list[MutableMapping[str, Any]], kind: str
) -> None:
    async with open_broker(kind, 100) as broker, broker.cache("p", Recorder()) as cache:
        release_held = anyio.Event()
        # The books that grant: these, or the daemon's (where ``p`` is ``p@pid``).
        granting = "p" if daemon_of(broker) is None else "p@"

        async def holder() -> None:
            async with cache.acquire("held", load=loader("held"), size=60):
                await release_held.wait()

        async with anyio.create_task_group() as tg:
            tg.start_soon(holder)
            await wait_until(lambda: broker.stats_nowait().leased == 1)
            tg.start_soon(fill, cache, "big", 90)
            await wait_until(lambda: broker.stats_nowait().waiting == 1)
            for i in range(5):
                tg.start_soon(fill, cache, f"small{i}", 10)
            await wait_until(lambda: broker.stats_nowait().waiting == 6)
            assert broker.stats_nowait().loading == 0  # the small ones fit, but queue
            release_held.set()
    # Grants follow arrival order (tasks may then resume in any order: trio shuffles them).
    # (Connected, the daemon's events are logged here too: its keys show as ``repr``.)
    asked = [
        repr(e["key"]) for e in events if e["event"] == "cachebroker.miss" and e["cache"] == "p"
    ]
    granted = [
        repr(e["key"])
        for e in events
        if e["event"] == "cachebroker.grant" and e["cache"].startswith(granting)
    ]
    assert asked[:2] == ["'held'", "'big'"]
    assert granted == asked


async def test_leaving_cache_waits_for_leases_then_releases(kind: str) -> None:
    plugin = Recorder()
    async with open_broker(kind, 100, release_timeout=5) as broker:
        lease_ended = anyio.Event()
        async with anyio.create_task_group() as tg:
            async with broker.cache("p", plugin) as cache:
                lease = await cache.acquire("k", load=loader(1), size=10)

                async def user_finishes_later() -> None:
                    await anyio.sleep(0.01)
                    await lease.release()
                    lease_ended.set()

                tg.start_soon(user_finishes_later)
            assert lease_ended.is_set()
            assert plugin.released == ["k"]
        assert (await broker.stats()).used == {"default": 0}


async def test_leaving_cache_with_lease_held_past_bound_fails_loudly_and_frees_nothing(
    kind: str,
) -> None:
    plugin = Recorder()
    async with open_broker(kind, 100, release_timeout=0.02) as broker:
        with pytest.raises(LeasesOutstanding, match="still leased") as info:
            async with broker.cache("p", plugin) as cache:
                lease = await cache.acquire("k", load=loader("in use"), size=10)
        assert info.value.keys == ("k",)
        assert plugin.released == []
        assert lease.value == "in use"  # never freed under its user
        await lease.release()
        stats = await broker.stats()
        assert stats.quarantined_keys == (("p", "k"),)
        assert stats.used == {"default": 10}  # nobody could free it: still charged


async def test_leaving_broker_with_work_in_flight_fails_waiters_and_cancels_loads() -> None:
    plugin = Faulty(hung="hang")
    outcomes: dict[str, BaseException | str] = {}
    load_cancelled = anyio.Event()

    async def endless() -> str:
        try:
            await anyio.sleep_forever()
        finally:
            load_cancelled.set()
        return "never"  # pragma: no cover

    async def request(cache: Cache, key: str, load: Any, size: int) -> None:
        try:
            async with cache.acquire(key, load=load, size=size):
                outcomes[key] = "ok"
        except BrokerClosed as exc:
            outcomes[key] = exc

    with anyio.fail_after(5):
        async with anyio.create_task_group() as outer:
            broker = Broker(budget=100, release_timeout=0.05)
            async with broker:
                ready = anyio.Event()

                async def plugin_task() -> None:
                    async with broker.cache("p", plugin) as cache:
                        await fill(cache, "idle", size=20)
                        await fill(cache, "hung", size=20)
                        async with anyio.create_task_group() as tg:
                            tg.start_soon(request, cache, "loading", endless, 20)
                            await wait_until(lambda: broker.stats_nowait().loading == 1)
                            async with cache.acquire("held", load=loader(1), size=40):
                                tg.start_soon(request, cache, "waiting", loader(2), 60)
                                await wait_until(lambda: broker.stats_nowait().waiting == 1)
                                ready.set()
                                await anyio.sleep(0.2)

                outer.start_soon(plugin_task)
                await ready.wait()
    assert load_cancelled.is_set()
    assert isinstance(outcomes["waiting"], BrokerClosed)
    assert isinstance(outcomes["loading"], BrokerClosed)
    assert "idle" in plugin.freed
    assert "held" in plugin.freed  # released once its lease ended
    stats = broker.stats_nowait()
    assert stats.quarantined_keys == (("p", "hung"),)
