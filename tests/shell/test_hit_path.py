"""The hit path's shortcuts keep every rule of the forms they shorten (``_shell/_lease.py``).

``async with`` runs ``Lease.__aenter__``, a twin of ``__await__`` whose
generator is awaited as it is, and ``Lease.__aexit__``, which ends the lease
without calling ``release()``; ``release()`` returns one shared, finished
awaitable; the hit path builds leases without ``__init__``.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any

import pytest

from cachebroker import Lease, LeaseReleased
from tests.brokers import open_broker
from tests.helpers import Recorder, loader, wait_until

pytestmark = pytest.mark.anyio


async def test_async_with_ends_the_lease_as_release_does(kind: str) -> None:
    async with (
        open_broker(kind, budget=100, idle_ttl=60) as broker,
        broker.cache("p", Recorder()) as cache,
    ):
        async with cache.acquire("a", load=loader("v"), size=10) as lease:
            assert isinstance(lease, Lease)
            assert lease.value == "v"
            assert broker.stats_nowait().leased == 1
        assert lease.released
        assert broker.stats_nowait().leased == 0
        with pytest.raises(LeaseReleased):
            _ = lease.value
        # Leaving the block again (a second __aexit__) is a no-op, as a second release() is.
        await lease.__aexit__(None, None, None)
        assert broker.stats_nowait().leased == 0


async def test_a_lease_is_entered_or_awaited_once(kind: str) -> None:
    async with open_broker(kind, budget=100) as broker, broker.cache("p", Recorder()) as cache:
        lease = cache.acquire("a", load=loader("v"), size=10)
        async with lease:
            with pytest.raises(RuntimeError, match="already awaited or entered"):
                await lease
            with pytest.raises(RuntimeError, match="already awaited or entered"):
                async with lease:
                    pass
        assert broker.stats_nowait().leased == 0


async def test_release_returns_a_finished_awaitable_that_can_be_awaited_again(kind: str) -> None:
    async with open_broker(kind, budget=100) as broker, broker.cache("p", Recorder()) as cache:
        first = await cache.acquire("a", load=loader("v"), size=10)
        second = await cache.acquire("a", load=loader("v"), size=10)
        done = first.release()
        await done
        await done  # finished: nothing is left to run
        await second.release()
        await second.release()  # idempotent
        assert broker.stats_nowait().leased == 0


async def test_lease_entered_with_async_with_and_left_by_an_exception_is_ended(kind: str) -> None:
    async with open_broker(kind, budget=100) as broker, broker.cache("p", Recorder()) as cache:
        with pytest.raises(KeyError):
            async with cache.acquire("a", load=loader("v"), size=60):
                raise KeyError("body")
        assert broker.stats_nowait().leased == 0
        async with cache.acquire("b", load=loader("w"), size=60):
            pass


async def test_hit_lease_dropped_while_held_warns_and_is_ended(kind: str) -> None:
    """A lease built by the hit path (no __init__) still reports being dropped."""
    async with open_broker(kind, budget=100) as broker, broker.cache("p", Recorder()) as cache:
        await (await cache.acquire("a", load=loader("v"), size=60)).release()

        async def dies() -> None:
            await cache.acquire("a", load=loader("v"), size=60)  # a hit
            raise RuntimeError("the task died holding its lease")

        with pytest.warns(ResourceWarning, match="p:'a'"):  # noqa: PT031
            with pytest.raises(RuntimeError):
                await dies()
            gc.collect()
        await wait_until(lambda: broker.stats_nowait().leased == 0)


async def test_unawaited_hit_lease_holds_nothing_and_warns_nothing(kind: str) -> None:
    async with open_broker(kind, budget=100) as broker, broker.cache("p", Recorder()) as cache:
        await (await cache.acquire("a", load=loader("v"), size=60)).release()
        lease = cache.acquire("a", load=loader("v"), size=60)
        assert repr(lease) == "<Lease 'a' not acquired>"
        await lease.release()
        del lease
        gc.collect()
        assert broker.stats_nowait().leased == 0


async def test_leases_entered_through_an_async_exit_stack(kind: str) -> None:
    """``AsyncExitStack`` calls ``__aenter__`` and awaits its result, as ``async with`` does."""
    async with open_broker(kind, budget=100) as broker, broker.cache("p", Recorder()) as cache:
        async with contextlib.AsyncExitStack() as stack:
            # (Any: to type checkers a Lease is no AbstractAsyncContextManager, whose
            # __aexit__ is a coroutine function.)
            enter: Any = stack.enter_async_context
            plain = await enter(cache.acquire("a", load=loader("v"), size=10))
            tuned = await enter(cache.acquire("b", load=loader("w"), size=10, pin=True))
            assert (plain.value, tuned.value) == ("v", "w")
            assert broker.stats_nowait().leased == 2
        assert plain.released and tuned.released
        assert broker.stats_nowait().leased == 0
