"""The daemon asks a process for a grant or a release in the step that decides it
(``Elsewhere``), and steps a process's acquire as it reads it (``Runner.submit``).

Tests of the grant and the release posted in the deciding step, and of the
ticket watchers that take the place of a task per acquire.
"""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
import pytest

from cachebroker import Broker
from tests.remote.support import Plugin, serving, used
from tests.remote.test_reconnect import link_of, listed, until, value

pytestmark = pytest.mark.anyio


def connection_of(daemon: Any, cache: str) -> Any:
    """The daemon's ``Connection`` of the process that opened ``cache``."""
    (found,) = [c for c in daemon.connections.values() if cache in c.caches]
    return found


def acquire_message(id: int, key: str, size: int, **fields: Any) -> dict[str, Any]:
    return {
        "op": "acquire",
        "id": id,
        "cache": "w",
        "key": repr(key),
        "need": {"m": size},
        "cost": None,
        "priority": 0,
        **fields,
    }


@pytest.mark.parametrize("room", [True, False])
async def test_an_acquire_and_its_cancel_read_in_one_batch_leave_nothing_behind(room: bool) -> None:
    """The daemon steps the acquire as it reads it (granted, and the grant posted, or
    queued behind another process's lease); the cancel read right behind it withdraws
    the pending ticket (``core.leave``): no bytes stay charged, the grant is ignored
    there, and the process's next acquire of the key loads afresh."""
    async with serving() as daemon:
        async with (
            Broker.connect(daemon.address) as other,
            other.cache("o", Plugin()) as oc,
            Broker.connect(daemon.address) as broker,
            broker.cache("w", Plugin()) as cache,
        ):
            held = None if room else await oc.acquire("h", load=value("H"), size=60)
            try:
                base = used(daemon)
                await until(lambda: any("w" in c.caches for c in daemon.connections.values()))
                connection = connection_of(daemon, "w")
                connection.acquire(acquire_message(10_000, "k", 50))  # (as one batch reads)
                assert bool(connection.mirrors[10_000].ticket) is True
                assert used(daemon) == base + (50 if room else 0)
                connection.cancel(10_000)
                assert 10_000 not in connection.mirrors
                await until(lambda: not daemon.runner.core.queue and used(daemon) == base)
                await until(lambda: all(key != "'k'" for key, *_ in listed(daemon)))
                daemon.runner.core.check()
            finally:
                if held is not None:
                    await held.release()
            async with cache.acquire("k", load=value("K2"), size=50, timeout=5) as lease:
                assert lease.value == "K2"
            await until(lambda: ("'k'", "ready", 0, {"m": 50}) in listed(daemon))
            daemon.runner.core.check()


async def test_a_request_pending_when_its_daemon_stops_is_asked_again_of_the_next(
    address: str,
) -> None:
    """A request waiting for room, watched (no task of the daemon waits for it), when
    the daemon stops: the daemon's books drop the process's owner (``_run_cache``), the
    watcher hears ``BrokerClosed``; that must not reach the process as a refusal: the
    request is asked again of the next daemon, and granted there."""
    from tests.remote.test_reconnect import daemons

    async with daemons(address) as run:
        first = await run.start()
        async with Broker.connect(address) as one, one.cache("w", Plugin()) as c1:
            async with Broker.connect(address) as two, two.cache("v", Plugin()) as c2:
                held = await c2.acquire("h", load=value("H"), size=60)
                got: list[Any] = []

                async def wait_for_room() -> None:
                    try:
                        lease = await c1.acquire("k", load=value("K"), size=50, timeout=10)
                    except Exception as exc:
                        got.append(exc)
                        return
                    got.append(lease.value)
                    await lease.release()

                async with anyio.create_task_group() as tg:
                    tg.start_soon(wait_for_room)
                    await until(lambda: bool(first.runner.core.queue))
                    await run.stop()
                    await until(lambda: not link_of(one).online)
                    second = await run.start()
                    await until(lambda: link_of(one).online and link_of(two).online)
                    await held.release()
            assert got == ["K"]
            second.runner.core.check()
