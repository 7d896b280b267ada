"""The async shell, on asyncio, asyncio+uvloop and trio."""

from __future__ import annotations

import math
import threading
from collections.abc import MutableMapping
from typing import Any

import anyio
import anyio.lowlevel
import pytest

import cachebroker
from cachebroker import (
    AcquireTimeout,
    Broker,
    BrokerClosed,
    DeadlockError,
    InvalidKey,
    LeaseReleased,
    RequestTooLarge,
)
from tests.brokers import open_broker
from tests.helpers import Recorder, loader, plugin_name, wait_until

pytestmark = pytest.mark.anyio


async def test_acquire_loads_once_and_hit_shares_value(kind: str) -> None:
    calls: list[str] = []
    async with open_broker(kind, "1KiB") as broker, broker.cache("p", Recorder()) as cache:
        lease = await cache.acquire("k", load=loader("v", calls), size=100)
        assert (lease.key, lease.value) == ("k", "v")
        await lease.release()
        async with cache.acquire("k", load=loader("other", calls), size=100) as again:
            assert again.value == "v"
        stats = await broker.stats()
        assert calls == ["v"]
        assert (stats.hits, stats.misses, stats.loads) == (1, 1, 1)
        assert stats.used == {"default": 100}
        assert stats.budget == {"default": 1024}
        assert stats.entries == 1


async def test_lease_release_is_idempotent_and_value_unusable_after(kind: str) -> None:
    async with open_broker(kind, 1000) as broker, broker.cache("p", Recorder()) as cache:
        lease = await cache.acquire("k", load=loader(1), size=10)
        await lease.release()
        await lease.release()
        assert lease.released
        with pytest.raises(LeaseReleased):
            _ = lease.value
        assert (await broker.stats()).leased == 0


async def test_a_lease_is_acquired_once_when_awaited_or_entered(kind: str) -> None:
    async with open_broker(kind, 1000) as broker, broker.cache("p", Recorder()) as cache:
        lease = cache.acquire("k", load=loader(1), size=10)
        assert repr(lease) == "<Lease 'k' not acquired>"
        assert not lease.released
        with pytest.raises(RuntimeError, match="not acquired yet"):
            _ = lease.value
        await lease.release()  # nothing to end yet
        assert (await lease) is lease
        assert lease.value == 1 and repr(lease) == "<Lease 'k' held>"
        with pytest.raises(RuntimeError, match="already awaited or entered"):
            await lease
        with pytest.raises(RuntimeError, match="already awaited or entered"):
            async with lease:
                pass
        assert broker.stats_nowait().leased == 1  # the refusals took nothing
        await lease.release()
        assert repr(lease) == "<Lease 'k' released>"
        with pytest.raises(RuntimeError, match="already awaited or entered"):
            await lease
        async with cache.acquire("k", load=loader(2), size=10) as entered:
            assert entered.value == 1
        assert entered.released


async def test_one_lease_awaited_by_two_tasks_is_acquired_once(kind: str) -> None:
    gate = anyio.Event()

    async def slow() -> int:
        await gate.wait()
        return 1

    async with open_broker(kind, 10) as broker, broker.cache("p", Recorder()) as cache:
        lease = cache.acquire("k", load=slow, size=10)
        async with anyio.create_task_group() as tg:
            tg.start_soon(_await, lease)
            await anyio.wait_all_tasks_blocked()
            with pytest.raises(RuntimeError, match="already awaited or entered"):
                await lease
            gate.set()
        assert lease.value == 1
        await lease.release()
        assert broker.stats_nowait().leased == 0


async def _await(lease: cachebroker.Lease[Any]) -> None:
    await lease


async def test_a_failed_acquire_may_be_awaited_again(kind: str) -> None:
    async with open_broker(kind, 10) as broker, broker.cache("p", Recorder()) as cache:
        held = await cache.acquire("a", load=loader(1), size=10)
        pending = cache.acquire("b", load=loader(2), size=10)
        with pytest.raises(DeadlockError):  # only this task's own lease is in the way
            await pending
        await held.release()
        assert (await pending).value == 2
        await pending.release()


async def test_concurrent_acquires_of_one_key_load_once(kind: str) -> None:
    calls: list[int] = []
    gate = anyio.Event()

    async def slow_load() -> int:
        calls.append(1)
        await gate.wait()
        return 42

    values: list[int] = []
    async with open_broker(kind, 1000) as broker, broker.cache("p", Recorder()) as cache:

        async def user() -> None:
            async with cache.acquire("k", load=slow_load, size=10) as lease:
                values.append(lease.value)

        async with anyio.create_task_group() as tg:
            for _ in range(20):
                tg.start_soon(user)
            await wait_until(lambda: broker.stats_nowait().hits == 19)
            gate.set()
        assert calls == [1]
        assert values == [42] * 20


async def test_many_keys_under_tight_budget_never_over_commit(kind: str) -> None:
    budget = 100
    live: dict[int, int] = {}
    peak = 0

    class Plugin:
        async def release(self, key: int, value: int) -> None:
            await anyio.lowlevel.checkpoint()
            del live[key]

    async with open_broker(kind, budget) as broker, broker.cache("p", Plugin()) as cache:

        async def user(i: int) -> None:
            key = i % 12
            size = 10 + (key * 7) % 40

            async def load() -> int:
                nonlocal peak
                live[key] = size
                peak = max(peak, sum(live.values()))
                await anyio.lowlevel.checkpoint()
                return key

            async with cache.acquire(key, load=load, size=size) as lease:
                assert lease.value == key
                await anyio.lowlevel.checkpoint()

        async with anyio.create_task_group() as tg:
            for i in range(200):
                tg.start_soon(user, i)
        stats = await broker.stats()
    assert peak <= budget
    assert stats.evictions > 0
    assert stats.misses + stats.hits == 200


async def test_eviction_runs_release_in_owner_task_group_and_context(kind: str) -> None:
    owner = Recorder()
    async with open_broker(kind, 100) as broker:

        async def plugin_block(ready: anyio.Event, done: anyio.Event) -> None:
            plugin_name.set("whisper")
            async with broker.cache("whisper", owner) as cache:
                async with cache.acquire("m", load=loader("W"), size=80):
                    pass
                ready.set()
                await done.wait()

        ready, done = anyio.Event(), anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(plugin_block, ready, done)
            await ready.wait()
            plugin_name.set("llama")
            async with broker.cache("llama", Recorder()) as other:
                async with other.acquire("m", load=loader("L"), size=80) as lease:
                    assert lease.value == "L"
            done.set()
    assert owner.released == ["m"]
    assert owner.contexts == ["whisper"]


async def test_space_is_granted_only_after_every_release_is_acknowledged(kind: str) -> None:
    plugin = Recorder()
    plugin.gate = anyio.Event()
    async with open_broker(kind, 100) as broker, broker.cache("p", plugin) as cache:
        for key in "ab":
            async with cache.acquire(key, load=loader(key), size=50):
                pass
        loaded = anyio.Event()

        async def load_c() -> str:
            loaded.set()
            return "c"

        async with anyio.create_task_group() as tg:
            tg.start_soon(use, cache, "c", load_c, 100)
            await wait_until(lambda: broker.stats_nowait().releasing == 2)
            assert not loaded.is_set()
            stats = broker.stats_nowait()
            assert stats.waiting == 1 and stats.used == {"default": 100}
            plugin.gate.set()
        assert loaded.is_set()
        assert sorted(plugin.released) == ["a", "b"]


async def test_releases_of_several_victims_run_concurrently(kind: str) -> None:
    gate = anyio.Event()
    inside = 0

    class Slow:
        async def release(self, key: str, value: str) -> None:
            nonlocal inside
            inside += 1
            await gate.wait()

    async with open_broker(kind, 100) as broker, broker.cache("p", Slow()) as cache:
        for key in "abcd":
            async with cache.acquire(key, load=loader(key), size=25):
                pass
        async with anyio.create_task_group() as tg:
            tg.start_soon(use, cache, "big", loader("big"), 100)
            await wait_until(lambda: inside == 4)
            gate.set()


async def test_cancelled_requester_does_not_cancel_shared_load(kind: str) -> None:
    gate = anyio.Event()
    cancelled = False

    async def load() -> str:
        nonlocal cancelled
        try:
            await gate.wait()
        except anyio.get_cancelled_exc_class():
            cancelled = True
            raise
        return "v"

    async with open_broker(kind, 100) as broker, broker.cache("p", Recorder()) as cache:
        result: list[str] = []

        async def patient() -> None:
            async with cache.acquire("k", load=load, size=10) as lease:
                result.append(lease.value)

        async with anyio.create_task_group() as tg:
            with anyio.CancelScope() as impatient:
                tg.start_soon(patient)
                await wait_until(lambda: broker.stats_nowait().loading == 1)
                impatient.cancel()
                await cache.acquire("k", load=load, size=10)
            gate.set()
        assert result == ["v"]
        assert not cancelled
        assert broker.stats_nowait().leased == 0


async def test_last_requester_leaving_cancels_load_and_returns_reservation(kind: str) -> None:
    cancelled = anyio.Event()

    async def load() -> str:
        try:
            await anyio.sleep_forever()
        finally:
            cancelled.set()
        return "never"  # pragma: no cover

    async with open_broker(kind, 100) as broker, broker.cache("p", Recorder()) as cache:
        with anyio.move_on_after(0.05):
            await cache.acquire("k", load=load, size=60)
        await cancelled.wait()
        await wait_until(lambda: broker.stats_nowait().used == {"default": 0})
        stats = broker.stats_nowait()
        assert (stats.entries, stats.loading, stats.load_failures) == (0, 0, 0)


async def test_failed_load_reaches_every_waiter_chained_and_is_not_cached(kind: str) -> None:
    gate = anyio.Event()
    attempts = 0

    async def load() -> str:
        nonlocal attempts
        attempts += 1
        await gate.wait()
        raise ValueError("corrupt checkpoint")

    errors: list[BaseException] = []
    async with open_broker(kind, 100) as broker, broker.cache("p", Recorder()) as cache:

        async def user() -> None:
            try:
                await cache.acquire("k", load=load, size=10)
            except ValueError as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(user)
            await wait_until(lambda: broker.stats_nowait().hits == 2)
            gate.set()
        assert len(errors) == 3
        assert all(str(e) == "corrupt checkpoint" for e in errors)
        # Each waiter raises its own exception, chained to the one the loader
        # raised, whose traceback shows where the load failed.
        original = errors[0].__cause__
        assert isinstance(original, ValueError)
        assert original.__traceback__ is not None
        assert all(e.__cause__ is original for e in errors)
        assert len({id(e) for e in errors}) == 3
        stats = broker.stats_nowait()
        assert (stats.used, stats.load_failures, stats.entries) == ({"default": 0}, 1, 0)
        with pytest.raises(ValueError, match="corrupt"):
            await cache.acquire("k", load=load, size=10)
        assert attempts == 2


async def test_releasing_entry_takes_no_new_lease_then_loads_afresh(kind: str) -> None:
    plugin = Recorder()
    plugin.gate = anyio.Event()
    values = iter(["old", "new"])

    async def load() -> str:
        return next(values)

    async with open_broker(kind, 100) as broker, broker.cache("p", plugin) as cache:
        async with cache.acquire("k", load=load, size=50):
            pass
        async with anyio.create_task_group() as tg:
            tg.start_soon(cache.invalidate, "k")
            await plugin.started.wait()
            got: list[str] = []

            async def again() -> None:
                async with cache.acquire("k", load=load, size=50) as lease:
                    got.append(lease.value)

            tg.start_soon(again)
            await wait_until(lambda: broker.stats_nowait().waiting == 1)
            assert got == []
            plugin.gate.set()
        assert got == ["new"]


async def test_plain_loader_runs_in_worker_thread(kind: str) -> None:
    loop_thread = threading.get_ident()
    seen: list[int] = []

    def load() -> str:
        seen.append(threading.get_ident())
        return "v"

    async with open_broker(kind, 100) as broker, broker.cache("p", Recorder()) as cache:
        async with cache.acquire("k", load=load, size=1) as lease:
            assert lease.value == "v"
    assert seen and seen[0] != loop_thread


async def test_plain_loader_returning_coroutine_is_awaited(kind: str) -> None:
    async def load_model(name: str) -> str:
        await anyio.lowlevel.checkpoint()
        return f"model {name}"

    async with open_broker(kind, 100) as broker, broker.cache("p", Recorder()) as cache:
        async with cache.acquire("k", load=lambda: load_model("k"), size=1) as lease:
            assert lease.value == "model k"


async def test_plain_function_releaser_is_accepted(kind: str) -> None:
    freed: list[str] = []

    async def release(key: str, value: str) -> None:
        freed.append(key)

    async with open_broker(kind, 10) as broker, broker.cache("p", release) as cache:
        async with cache.acquire("a", load=loader("a"), size=10):
            pass
        async with cache.acquire("b", load=loader("b"), size=10):
            pass
        assert freed == ["a"]


async def test_keys_are_per_cache(kind: str) -> None:
    async with (
        open_broker(kind, 100) as broker,
        broker.cache("whisper", Recorder()) as w,
        broker.cache("llama", Recorder()) as ll,
        w.acquire("base", load=loader("W"), size=1) as a,
    ):
        async with ll.acquire("base", load=loader("L"), size=1) as b:
            assert (a.value, b.value) == ("W", "L")


async def test_entry_may_weigh_in_several_spaces(kind: str) -> None:
    async with open_broker(kind, {"ram": "1KiB", "cuda:0": "2KiB"}) as broker:
        async with broker.cache("p", Recorder()) as cache:
            size: dict[str, int | str] = {"ram": 100, "cuda:0": "1KiB"}
            async with cache.acquire("k", load=loader(1), size=size):
                assert (await broker.stats()).used == {"ram": 100, "cuda:0": 1024}


async def test_size_callable_measures_loaded_value(kind: str) -> None:
    async with open_broker(kind, 1000) as broker, broker.cache("p", Recorder()) as cache:
        async with cache.acquire("k", load=loader(b"x" * 300), size=len):
            assert (await broker.stats()).used == {"default": 300}


@pytest.mark.parametrize("policy", ["lru", "fifo", "gdsf", "cost"])
async def test_a_measured_entry_is_a_victim_like_any_other(policy: str, kind: str) -> None:
    # The policy learns of the entry with its measured size, not the empty
    # declared one: otherwise FIFO and the ranked policies never evict it.
    plugin = Recorder()
    async with open_broker(kind, 15, policy=policy) as broker, broker.cache("p", plugin) as cache:
        async with cache.acquire("measured", load=loader(b"x" * 10), size=len):
            pass
        with anyio.fail_after(5):
            async with cache.acquire("declared", load=loader(1), size=10):
                pass
        assert plugin.released == ["measured"]


async def test_invalid_size_callable_result_fails_acquire_and_frees_value(kind: str) -> None:
    plugin = Recorder()
    async with open_broker(kind, 1000) as broker, broker.cache("p", plugin) as cache:
        with pytest.raises(cachebroker.InvalidArgument, match="size callable"):
            await cache.acquire("k", load=loader("v"), size=lambda v: -1)
        await wait_until(lambda: plugin.released == ["k"])
        assert (await broker.stats()).used == {"default": 0}


async def test_request_over_whole_budget_fails_fast(kind: str) -> None:
    async with open_broker(kind, "1MiB") as broker, broker.cache("p", Recorder()) as cache:
        with pytest.raises(RequestTooLarge, match="exceeds the space's whole budget"):
            await cache.acquire("k", load=loader(1), size="2MiB")
        with pytest.raises(ValueError, match=r"2\.0 MiB"):
            await cache.acquire("k", load=loader(1), size="2MiB")


async def test_self_deadlock_is_an_error_not_a_hang(kind: str) -> None:
    async with open_broker(kind, 100) as broker, broker.cache("p", Recorder()) as cache:
        async with cache.acquire("a", load=loader(1), size=80):
            with pytest.raises(DeadlockError, match="leased by the requesting task") as info:
                await cache.acquire("b", load=loader(2), size=50)
            assert info.value.leases == (("p", "a"),)


async def test_acquire_timeout_bounds_the_wait(kind: str) -> None:
    async with open_broker(kind, 100) as broker, broker.cache("p", Recorder()) as cache:
        held = anyio.Event()
        done = anyio.Event()

        async def holder() -> None:
            async with cache.acquire("a", load=loader(1), size=80):
                held.set()
                await done.wait()

        async with anyio.create_task_group() as tg:
            tg.start_soon(holder)
            await held.wait()
            with pytest.raises(AcquireTimeout, match="did not complete within"):
                await cache.acquire("b", load=loader(2), size=50, timeout=0.02)
            assert broker.stats_nowait().waiting == 0
            done.set()


async def test_invalidate_releases_idle_value_and_next_acquire_reloads(kind: str) -> None:
    plugin = Recorder()
    calls: list[str] = []
    async with open_broker(kind, 100) as broker, broker.cache("p", plugin) as cache:
        async with cache.acquire("k", load=loader("v", calls), size=10):
            pass
        assert await cache.invalidate("k") is True
        assert plugin.released == ["k"]
        assert await cache.invalidate("k") is False
        async with cache.acquire("k", load=loader("v", calls), size=10):
            pass
        assert calls == ["v", "v"]


async def test_evict_idle_uses_injected_clock(kind: str) -> None:
    now = [0.0]
    plugin = Recorder()
    async with open_broker(kind, 100, idle_ttl=30, clock=lambda: now[0]) as broker:
        async with broker.cache("p", plugin) as cache:
            async with cache.acquire("a", load=loader(1), size=10):
                pass
            now[0] = 20
            async with cache.acquire("b", load=loader(2), size=20):
                pass
            now[0] = 35
            report = await broker.evict_idle()
            assert (report.entries, report.bytes) == (1, 10)
            assert plugin.released == ["a"]
            now[0] = 50
            report = await broker.evict_idle()
            assert (report.entries, report.bytes) == (1, 20)


async def test_broker_sweeps_idle_entries_on_its_own_timer(kind: str) -> None:
    plugin = Recorder()
    async with open_broker(kind, 100, idle_ttl=0.02) as broker, broker.cache("p", plugin) as cache:
        async with cache.acquire("a", load=loader(1), size=10):
            pass
        with anyio.fail_after(5):
            await plugin.started.wait()
        await wait_until(lambda: broker.stats_nowait().used == {"default": 0})
        assert broker.stats_nowait().releases["idle"] == 1


async def test_clear_releases_everything_idle(kind: str) -> None:
    plugin = Recorder()
    async with open_broker(kind, 100) as broker, broker.cache("p", plugin) as cache:
        for key in "abc":
            async with cache.acquire(key, load=loader(key), size=10):
                pass
        report = await broker.clear()
        assert (report.entries, report.bytes) == (3, 30)
        assert sorted(plugin.released) == ["a", "b", "c"]


async def test_budget_zero_turns_retention_off(kind: str) -> None:
    plugin = Recorder()
    calls: list[str] = []
    async with open_broker(kind, 0) as broker, broker.cache("p", plugin) as cache:
        for _ in range(2):
            async with cache.acquire("k", load=loader("v", calls), size="1GiB") as lease:
                assert lease.value == "v"
            await wait_until(lambda: broker.stats_nowait().entries == 0)
        assert calls == ["v", "v"]
        assert plugin.released == ["k", "k"]


async def test_leaving_cache_block_releases_its_entries(kind: str) -> None:
    plugin = Recorder()
    async with open_broker(kind, 100) as broker:
        async with broker.cache("p", plugin) as cache:
            for key in "ab":
                async with cache.acquire(key, load=loader(key), size=10):
                    pass
        assert sorted(plugin.released) == ["a", "b"]
        assert (await broker.stats()).used == {"default": 0}
        with pytest.raises(BrokerClosed):
            await cache.acquire("c", load=loader("c"), size=1)
        # The name is free again.
        async with broker.cache("p", plugin):
            pass


async def test_cache_name_in_use_is_rejected(kind: str) -> None:
    async with open_broker(kind, 100) as broker, broker.cache("p", Recorder()):
        with pytest.raises(ValueError, match="already open"):
            async with broker.cache("p", Recorder()):
                pass  # pragma: no cover


async def test_acquire_hit_and_miss_events_have_stable_names(
    events: list[MutableMapping[str, Any]], kind: str
) -> None:
    async with open_broker(kind, 10) as broker, broker.cache("p", Recorder()) as cache:
        for key in ["a", "a", "b"]:
            async with cache.acquire(key, load=loader(key), size=10):
                pass
    names = [entry["event"] for entry in events]
    for name in [
        "cachebroker.miss",
        "cachebroker.grant",
        "cachebroker.load.start",
        "cachebroker.load.done",
        "cachebroker.hit",
        "cachebroker.wait",
        "cachebroker.release.requested",
        "cachebroker.release.freed",
    ]:
        assert name in names, name
    freed = next(e for e in events if e["event"] == "cachebroker.release.freed")
    assert (freed["cache"], freed["key"], freed["bytes"]) == ("p", "a", {"default": 10})


async def test_listeners_get_the_events_and_a_failing_one_is_removed(
    events: list[MutableMapping[str, Any]], kind: str
) -> None:
    seen: list[tuple[str, dict[str, Any]]] = []

    def broken(event: str, fields: Any) -> None:
        raise ValueError("boom")

    async with open_broker(kind, 10) as broker, broker.cache("p", Recorder()) as cache:
        broker.add_listener(lambda event, fields: seen.append((event, dict(fields))))
        broker.add_listener(broken)
        with pytest.raises(TypeError, match="listener must be a callable"):
            broker.add_listener("print")  # type: ignore[arg-type]
        for key in ["a", "a", "b"]:
            async with cache.acquire(key, load=loader(key), size=10):
                pass
        broker.remove_listener(broken)  # already gone: ignored
    names = [event for event, _ in seen]
    assert names[:3] == ["cachebroker.grant", "cachebroker.load.start", "cachebroker.load.done"]
    assert "cachebroker.hit" not in names and "cachebroker.miss" not in names
    assert "cachebroker.release.requested" in names
    grant = seen[0][1]
    assert grant["waited"] >= 0 and grant["bytes"] == {"default": 10}
    freed = next(fields for event, fields in seen if event == "cachebroker.release.freed")
    assert freed["seconds"] >= 0 and freed["late"] is False
    failures = [e for e in events if e["event"] == "cachebroker.listener.failed"]
    assert len(failures) == 1
    assert failures[0]["error"] == "ValueError('boom')"


async def test_unhashable_key_is_a_clear_type_error(kind: str) -> None:
    async with open_broker(kind, 10) as broker, broker.cache("p", Recorder()) as cache:
        with pytest.raises(InvalidKey, match="hashable"):
            await cache.acquire(["not", "hashable"], load=loader(1), size=1)  # type: ignore[call-overload]
        with pytest.raises(TypeError):
            await cache.invalidate({})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("size", "error", "match"),
    [
        (-1, ValueError, "must not be negative"),
        ("lots", ValueError, "not a byte quantity"),
        (1.5, ValueError, "whole"),
        (object(), TypeError, "must be an int or a string"),
        ({"gpu": 1}, ValueError, "unknown space 'gpu'"),
        (True, TypeError, "number of bytes"),
    ],
)
async def test_bad_sizes_are_rejected_with_clear_errors(
    size: Any, error: type, match: str, kind: str
) -> None:
    async with open_broker(kind, 10) as broker, broker.cache("p", Recorder()) as cache:
        with pytest.raises(error, match=match):
            await cache.acquire("k", load=loader(1), size=size)
        assert (await broker.stats()).entries == 0


async def test_bad_loader_and_timeout_are_rejected(kind: str) -> None:
    async with open_broker(kind, 10) as broker, broker.cache("p", Recorder()) as cache:
        with pytest.raises(TypeError, match="load must be a callable"):
            await cache.acquire("k", load="nope", size=1)  # type: ignore[call-overload]
        with pytest.raises(ValueError, match="timeout must be a positive"):
            await cache.acquire("k", load=loader(1), size=1, timeout=-1)


async def test_releaser_without_async_release_is_rejected(kind: str) -> None:
    class Sync:
        def release(self, key: str, value: str) -> None:
            pass

    async with open_broker(kind, 10) as broker:
        with pytest.raises(TypeError, match="async def release"):
            broker.cache("p", Sync())  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="async def release"):
            broker.cache("p", object())  # type: ignore[arg-type]


async def test_operations_outside_the_broker_block_fail_clearly() -> None:
    broker = Broker(budget=10)
    with pytest.raises(BrokerClosed, match="not running"):
        async with broker.cache("p", Recorder()):
            pass  # pragma: no cover
    with pytest.raises(BrokerClosed, match="not running"):
        await broker.evict_idle()


async def use(
    cache: cachebroker.Cache, key: str, load: Any, size: int, cost: float | None = None
) -> None:
    async with cache.acquire(key, load=load, size=size, cost=cost):
        pass


async def test_cost_aware_policy_keeps_the_model_that_is_slow_to_reload(kind: str) -> None:
    plugin = Recorder()
    async with open_broker(kind, 100, policy="cost") as broker, broker.cache("p", plugin) as cache:
        await use(cache, "slow", loader("s"), 40, cost=90)
        await use(cache, "fast", loader("f"), 40, cost=3)
        await use(cache, "new", loader("n"), 40, cost=1)
        assert plugin.released == ["fast"]  # LRU would have evicted "slow"


async def test_cost_aware_policy_counts_the_room_a_victim_frees(kind: str) -> None:
    """The new entry is 25 bytes short: "small" (30 bytes, 6 s) is the cheaper reload and
    LRU's victim, but "big" (60 bytes, 7 s) frees 35 bytes more than that, credited
    at half the least value per byte among the candidates (big's 7/60 s): about
    7 - 2.0 against small's 6 - 0.3."""
    plugin = Recorder()
    async with open_broker(kind, 100, policy="cost") as broker, broker.cache("p", plugin) as cache:
        await use(cache, "small", loader("s"), 30, cost=6)
        await use(cache, "big", loader("b"), 60, cost=7)
        await use(cache, "new", loader("n"), 35, cost=1)
        assert plugin.released == ["big"]


async def test_bad_cost_is_rejected(kind: str) -> None:
    async with open_broker(kind, 10) as broker, broker.cache("p", Recorder()) as cache:
        with pytest.raises(ValueError, match="cost must be a non-negative"):
            await cache.acquire("k", load=loader(1), size=1, cost=-2)


async def test_per_entry_idle_ttl_overrides_the_broker_one(kind: str) -> None:
    now = [0.0]
    plugin = Recorder()
    async with open_broker(kind, 100, idle_ttl=300, clock=lambda: now[0]) as broker:
        async with broker.cache("p", plugin) as cache:
            async with cache.acquire("short", load=loader(1), size=10, idle_ttl=5):
                pass
            async with cache.acquire("forever", load=loader(2), size=10, idle_ttl=math.inf):
                pass
            async with cache.acquire("default", load=loader(3), size=10):
                pass
            now[0] = 10
            assert (await broker.evict_idle()).entries == 1
            assert plugin.released == ["short"]
            now[0] = 1000
            await broker.evict_idle()
            assert plugin.released == ["short", "default"]


async def test_idle_ttl_zero_releases_at_last_lease_end(kind: str) -> None:
    plugin = Recorder()
    async with open_broker(kind, 100) as broker, broker.cache("p", plugin) as cache:
        async with cache.acquire("k", load=loader(1), size=10, idle_ttl=0):
            pass
        assert broker.stats_nowait().releasing == 1  # in the lease's last step
        await wait_until(lambda: plugin.released == ["k"])


async def test_sweeper_honours_per_entry_ttl_without_a_broker_ttl(kind: str) -> None:
    plugin = Recorder()
    async with open_broker(kind, 100) as broker, broker.cache("p", plugin) as cache:
        async with cache.acquire("k", load=loader(1), size=10, idle_ttl=0.02):
            pass
        with anyio.fail_after(5):
            await plugin.started.wait()
        assert plugin.released == ["k"]


async def test_pinned_entry_stays_resident_until_unpinned(kind: str) -> None:
    now = [0.0]
    plugin = Recorder()
    async with open_broker(kind, 100, idle_ttl=10, clock=lambda: now[0]) as broker:
        async with broker.cache("p", plugin) as cache:
            async with cache.acquire("pinned", load=loader(1), size=60, pin=True):
                pass
            async with cache.acquire("other", load=loader(2), size=40):
                pass
            now[0] = 100
            await broker.evict_idle()
            assert plugin.released == ["other"]  # the pinned one does not expire
            with pytest.raises(AcquireTimeout):  # ... nor is it evicted for space
                await cache.acquire("big", load=loader(3), size=50, timeout=0.02)
            assert await cache.unpin("pinned") is True
            assert await cache.unpin("pinned") is False
            async with cache.acquire("big", load=loader(3), size=50):
                pass
            assert plugin.released == ["other", "pinned"]


async def test_bad_per_entry_settings_are_rejected(kind: str) -> None:
    async with open_broker(kind, 10) as broker, broker.cache("p", Recorder()) as cache:
        with pytest.raises(ValueError, match="idle_ttl must be a non-negative"):
            cache.acquire("k", load=loader(1), idle_ttl=-1)
        with pytest.raises(TypeError, match="pin must be True or False"):
            cache.acquire("k", load=loader(1), pin="yes")  # type: ignore[call-overload]


def test_broker_runs_on_asyncio_without_sniffio(monkeypatch: pytest.MonkeyPatch) -> None:
    """anyio no longer needs sniffio; only trio brings it. A plain install must work."""
    import asyncio
    import sys

    monkeypatch.setitem(sys.modules, "sniffio", None)  # makes "import sniffio" fail

    async def main() -> str:
        async with Broker(budget=100) as broker, broker.cache("p", Recorder()) as cache:
            async with cache.acquire("k", load=loader("v"), size=10) as lease:
                return str(lease.value)

    assert asyncio.run(main()) == "v"
