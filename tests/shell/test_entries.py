"""``broker.entries()``: what is loaded, entry by entry, in one snapshot.

On every backend. Timing comes from events and ``wait_all_tasks_blocked``,
durations from an injected clock; every broker here checks the books'
invariants after each step of its core.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from cachebroker import AcquireTimeout, Broker, EntryInfo, LeasesOutstanding
from cachebroker._remote import _ps
from tests.remote.support import Plugin, serving, until, value
from tests.shell.support import Gated, checked, counting, never

pytestmark = pytest.mark.anyio


class Releaser:
    """Records releases; ``gate`` holds them, ``fail`` makes them raise."""

    def __init__(self) -> None:
        self.released: list[Hashable] = []
        self.started = anyio.Event()
        self.gate: anyio.Event | None = None
        self.fail = False

    async def release(self, key: Hashable, value: Any) -> None:
        self.started.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            raise OSError("the device did not let go")
        self.released.append(key)


def timed(result: Any, now: list[float], seconds: float) -> Any:
    """A loader that takes ``seconds`` on the injected clock ``now``."""

    async def load() -> Any:
        await anyio.lowlevel.checkpoint()
        now[0] += seconds
        return result

    return load


def info(**fields: Any) -> EntryInfo:
    """An ``EntryInfo`` of cache ``p``, key ``a``, ready and idle unless told otherwise."""
    defaults: dict[str, Any] = {
        "cache": "p",
        "key": "a",
        "state": "ready",
        "charge": {"default": 10},
        "leases": 0,
        "waiting": 0,
        "pinned": False,
        "priority": 0,
        "idle_seconds": None,
        "loads": 1,
        "load_seconds": None,
    }
    return EntryInfo(**{**defaults, **fields})


async def test_an_entry_is_followed_through_its_load_a_lease_idle_time_and_release() -> None:
    now = [0.0]
    releaser = Releaser()
    async with (
        checked(budget=100, idle_ttl=100, clock=lambda: now[0]) as broker,
        broker.cache("p", releaser) as cache,
    ):
        load = Gated("A")
        held, done = anyio.Event(), anyio.Event()

        async def hold() -> None:
            async with cache.acquire("a", load=load, size=10):
                held.set()
                await done.wait()

        async with anyio.create_task_group() as tg:
            tg.start_soon(hold)
            await load.started.wait()
            assert await broker.entries() == [info(state="loading", waiting=1, loads=0)]
            now[0] = 2.5  # the load takes 2.5 s
            load.open.set()
            await held.wait()
            assert await broker.entries() == [info(leases=1, load_seconds=2.5)]
            now[0] = 4.0
            done.set()
        now[0] = 7.0
        assert await broker.entries() == [info(idle_seconds=3.0, load_seconds=2.5)]

        releaser.gate = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(cache.invalidate, "a")
            await releaser.started.wait()
            assert await broker.entries() == [info(state="releasing", load_seconds=2.5)]
            releaser.gate.set()
        assert (await broker.entries(), releaser.released) == ([], ["a"])


async def test_a_quarantined_entry_is_listed_until_it_is_forgotten(kind: str) -> None:
    releaser = Releaser()
    async with checked(kind, budget=100) as broker, broker.cache("p", releaser) as cache:
        async with cache.acquire("a", load=counting("A", []), size=10):
            pass
        releaser.fail = True
        await cache.invalidate("a")
        (entry,) = await broker.entries()
        assert (entry.state, entry.charge, entry.leases, entry.loads) == (
            "quarantined",
            {"default": 10},
            0,
            1,
        )
        assert await broker.forget("p", "a") == 1
        assert await broker.entries() == []


async def test_waiting_counts_the_requests_joined_to_a_slow_load(kind: str) -> None:
    load = Gated("A")
    async with checked(kind, budget=100) as broker, broker.cache("p", Releaser()) as cache:
        got: list[str] = []

        async def acquire() -> None:
            async with cache.acquire("a", load=load, size=10) as lease:
                got.append(lease.value)

        async with anyio.create_task_group() as tg:
            tg.start_soon(acquire)
            await load.started.wait()
            for _ in range(2):
                tg.start_soon(acquire)
            tg.start_soon(lambda: cache.prefetch("a", load=never, size=10))
            await anyio.wait_all_tasks_blocked()
            assert [(e.state, e.waiting, e.leases) for e in await broker.entries()] == [
                ("loading", 4, 0)
            ]
            load.open.set()
        assert (got, load.calls) == (["A"] * 3, 1)
        assert [(e.waiting, e.leases) for e in await broker.entries()] == [(0, 0)]


async def test_an_entry_waiting_for_space_is_listed_with_its_requests() -> None:
    async with (
        checked(budget=10, clock=lambda: 0.0) as broker,
        broker.cache("p", Releaser()) as cache,
    ):
        lease = await cache.acquire("a", load=counting("A", []), size=10)
        async with anyio.create_task_group() as tg:
            for _ in range(2):
                tg.start_soon(lambda: cache.prefetch("b", load=counting("B", []), size=10))
            await anyio.wait_all_tasks_blocked()
            assert await broker.entries() == [
                info(leases=1, load_seconds=0.0),
                info(key="b", state="waiting", charge={}, waiting=2, loads=0),
            ]
            await lease.release()
        (entry,) = await broker.entries()
        assert (entry.key, entry.state, entry.waiting, entry.loads) == ("b", "ready", 0, 1)


async def test_an_old_value_and_the_one_loading_after_it_are_listed_oldest_first(kind: str) -> None:
    releaser = Releaser()
    async with checked(kind, budget=100) as broker, broker.cache("p", releaser) as cache:
        async with cache.acquire("a", load=counting("A1", []), size=10):
            pass
        releaser.gate = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(cache.invalidate, "a")
            await releaser.started.wait()
            tg.start_soon(lambda: cache.prefetch("a", load=counting("A2", []), size=10))
            await anyio.wait_all_tasks_blocked()
            assert [(e.key, e.state, e.waiting) for e in await broker.entries()] == [
                ("a", "releasing", 0),
                ("a", "waiting", 1),
            ]
            releaser.gate.set()
        assert [(e.state, e.loads) for e in await broker.entries()] == [("ready", 2)]


async def test_pinned_entries_and_idle_time_only_where_an_idle_ttl_applies() -> None:
    now = [0.0]
    async with (
        checked(budget=100, clock=lambda: now[0]) as broker,
        broker.cache("p", Releaser()) as cache,
    ):
        async with cache.acquire("pinned", load=counting(1, []), size=10, pin=True):
            pass
        async with cache.acquire("plain", load=counting(2, []), size=10):
            pass
        async with cache.acquire("timed", load=counting(3, []), size=10, idle_ttl=math.inf):
            pass
        now[0] = 4.0
        found = {e.key: (e.pinned, e.idle_seconds) for e in await broker.entries()}
        # No idle TTL for the broker: only the entry with its own is timed.
        assert found == {"pinned": (True, None), "plain": (False, None), "timed": (False, 4.0)}


async def test_entries_of_two_caches_are_ordered_by_cache_then_key(kind: str) -> None:
    async with checked(kind, budget=1000) as broker:
        async with broker.cache("tokens", Releaser()) as tokens:
            async with broker.cache("models", Releaser()) as models:
                for cache, key in (
                    (tokens, "vocab"),
                    (models, ("whisper", 3)),
                    (models, 7),
                    (tokens, "merges"),
                    (models, "base"),
                ):
                    await cache.prefetch(key, load=counting(key, []), size=10)
                listed = [(e.cache, e.key) for e in await broker.entries()]
                # Keys by their repr: "'base'" < "('whisper', 3)" < "7".
                assert listed == [
                    ("models", "base"),
                    ("models", ("whisper", 3)),
                    ("models", 7),
                    ("tokens", "merges"),
                    ("tokens", "vocab"),
                ]


async def test_loads_are_counted_across_evictions_and_reopened_caches() -> None:
    now = [0.0]
    async with checked(budget=100, clock=lambda: now[0]) as broker:
        async with broker.cache("p", Releaser()) as cache:
            await cache.prefetch("a", load=timed("A", now, 1.0), size=10)
            assert await cache.invalidate("a")
            await cache.prefetch("a", load=timed("A", now, 3.0), size=10)
            assert [(e.loads, e.load_seconds) for e in await broker.entries()] == [(2, 3.0)]

            async def broken() -> Any:
                raise OSError("disk")

            await cache.invalidate("a")
            with pytest.raises(OSError, match="disk"):
                await cache.prefetch("a", load=broken, size=10)  # not a load that finished
        async with broker.cache("p", Releaser()) as cache, broker.cache("q", Releaser()) as q:
            await cache.prefetch("a", load=timed("A", now, 0.5), size=10)
            await q.prefetch("a", load=timed("A", now, 2.0), size=10)
            assert [(e.cache, e.loads, e.load_seconds) for e in await broker.entries()] == [
                ("p", 3, 0.5),
                ("q", 1, 2.0),
            ]


async def test_priority_is_read_from_the_entry(kind: str) -> None:
    async with checked(kind, budget=100) as broker, broker.cache("p", Releaser()) as cache:
        await cache.prefetch("a", load=counting("A", []), size=10)
        assert [e.priority for e in await broker.entries()] == [0]
        cache._entries["a"].priority = 3  # (set by acquire(priority=...) once it exists)
        assert [e.priority for e in await broker.entries()] == [3]


async def test_entries_is_a_checkpoint(kind: str) -> None:
    async with checked(kind, budget=100) as broker, broker.cache("p", Releaser()) as cache:
        await cache.prefetch("a", load=counting("A", []), size=10)
        with anyio.CancelScope() as scope:
            scope.cancel()
            await broker.entries()
        assert scope.cancelled_caught
    assert await broker.entries() == []  # (after the block: nothing is left)


# ------------------------------------------------------------ Broker.connect


async def test_a_connected_broker_lists_its_own_entries_and_ps_every_process() -> None:
    async with serving(budget={"m": 100}) as daemon:
        async with Broker.connect(daemon.address) as one, Broker.connect(daemon.address) as two:
            async with one.cache("w", Plugin()) as c1, two.cache("w", Plugin()) as c2:
                await c1.prefetch("a", load=value("A"), size={"m": 10})
                assert await c1.invalidate("a")
                lease = await c1.acquire("a", load=value("A"), size={"m": 60})
                await c2.prefetch("b", load=value("B"), size={"m": 30})
                (mine,) = await one.entries()
                assert (mine.cache, mine.key, mine.state, mine.leases, mine.loads) == (
                    "w",
                    "a",
                    "ready",
                    1,
                    2,
                )
                assert [(e.key, e.loads) for e in await two.entries()] == [("b", 1)]

                def listed() -> list[tuple[str, str, Any, Any, Any]]:
                    return sorted(
                        (e["key"], e["state"], e["loads"], e["waiting"], e["priority"])
                        for e in daemon.listing()["entries"]
                    )

                await until(
                    lambda: listed() == [("'a'", "ready", 2, 0, 0), ("'b'", "ready", 1, 0, 0)]
                )
                # A request the shared broker queues waits for space: "waiting" in its
                # process (for the daemon's grant) as in the daemon's listing.
                async with anyio.create_task_group() as tg:
                    tg.start_soon(lambda: c2.prefetch("c", load=value("C"), size={"m": 50}))
                    await until(lambda: ("'c'", "waiting", None, 1, 0) in listed())
                    assert [(e.key, e.state) for e in await two.entries()] == [
                        ("b", "ready"),
                        ("c", "waiting"),
                    ]
                    await lease.release()
                assert [e.key for e in await two.entries()] == ["c"]
                table = _ps.render(daemon.listing())
                assert "WAITING  PRIORITY  LOADS" in table


async def test_a_lease_abandoned_by_a_closing_cache_is_released_for_close_in_the_daemon() -> None:
    """A process's cache closed with a lease still held: the entry is quarantined there,
    and the shared broker's release of it gives the reason, ``close``."""
    async with serving(budget={"m": 100}, release_timeout=0.05) as daemon:
        reasons: list[str] = []
        daemon.broker.add_listener(
            lambda event, fields: (
                reasons.append(fields["reason"])
                if event == "cachebroker.release.requested"
                else None
            )
        )
        async with Broker.connect(daemon.address) as broker:
            with pytest.raises(LeasesOutstanding):
                async with broker.cache("w", Plugin()) as cache:
                    lease = await cache.acquire("a", load=value("A"), size={"m": 10})
            await until(
                lambda: [e["state"] for e in daemon.listing()["entries"]] == ["quarantined"]
            )
            assert reasons == ["close"]
            assert [e.state for e in await broker.entries()] == ["quarantined"]
            await lease.release()


async def test_a_timed_out_prefetch_leaves_nothing_listed(kind: str) -> None:
    async with checked(kind, budget=10) as broker, broker.cache("p", Releaser()) as cache:
        lease = await cache.acquire("a", load=counting("A", []), size=10)
        async with anyio.create_task_group() as tg:

            async def prefetch() -> None:
                with pytest.raises(AcquireTimeout):
                    await cache.prefetch("b", load=never, size=10, timeout=0.01)

            tg.start_soon(prefetch)
        assert [e.key for e in await broker.entries()] == ["a"]
        await lease.release()
