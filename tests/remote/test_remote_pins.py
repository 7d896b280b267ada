"""A process's pin, as the shared broker knows it: pinned, not leased, and never a victim.

The daemon books a process's pinned entry as pinned (``cachebroker ps`` shows
it ``ready pinned``, with no lease), so that ``cachebroker.lease.held`` never names a pin as a
forgotten lease; a lease it does report is named by its process and cache,
as the user knows them, never by a task of the daemon's own.
"""

from __future__ import annotations

import os
import socket
from collections.abc import MutableMapping
from typing import Any

import anyio
import anyio.abc
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

from cachebroker import AcquireTimeout, Broker, DeadlockError
from cachebroker._remote import _protocol as wire
from cachebroker._remote._daemon import Daemon
from tests.remote.support import Plugin, serving, until, used, value

pytestmark = pytest.mark.anyio


def listed(daemon: Daemon) -> list[dict[str, Any]]:
    return [
        {name: entry[name] for name in ("cache", "key", "leases", "pinned", "state")}
        for entry in daemon.listing()["entries"]
    ]


def held_events(events: list[MutableMapping[str, Any]]) -> list[MutableMapping[str, Any]]:
    return [e for e in events if e["event"] == "cachebroker.lease.held"]


async def queued(daemon: Daemon, count: int = 1) -> None:
    await until(lambda: sum(len(w.joiners) for w in daemon.runner.core.queue) == count)


async def test_a_pinned_entry_is_pinned_not_leased_in_the_daemon(
    events: list[MutableMapping[str, Any]],
) -> None:
    now = [0.0]
    async with serving(clock=lambda: now[0], lease_warning=0.4) as daemon:
        async with Broker.connect(daemon.address) as one, Broker.connect(daemon.address) as two:
            async with one.cache("whisper", Plugin()) as c1, two.cache("llama", Plugin()) as c2:
                async with c1.acquire("a", load=value(1), size=60, pin=True):
                    pass
                expected = {"cache": "whisper", "key": "'a'", "leases": 0, "pinned": True}
                await until(lambda: listed(daemon) == [{**expected, "state": "ready"}])
                async with anyio.create_task_group() as tg:
                    outcome: list[BaseException] = []

                    async def wait_for_room() -> None:
                        try:
                            lease = await c2.acquire("b", load=value(2), size=60, timeout=60)
                        except AcquireTimeout as exc:
                            outcome.append(exc)
                        else:
                            await lease.release()

                    tg.start_soon(wait_for_room)
                    await queued(daemon)
                    # The pin holds the room against the waiter: never a victim, no lease.
                    for _ in range(2):
                        daemon.broker._runner.held_leases.check()
                        now[0] += 1.0
                    daemon.broker._runner.held_leases.check()
                    assert held_events(events) == []
                    assert listed(daemon)[0] == {**expected, "state": "ready"}
                    assert used(daemon) == 60
                    daemon.runner.core.check()
                    # Unpinned, it is an ordinary idle entry: the waiter gets its room.
                    await c1.unpin("a")
                    await until(lambda: not daemon.runner.core.queue)
                assert outcome == []
                await until(lambda: [e["key"] for e in listed(daemon)] == ["'b'"])
                daemon.runner.core.check()


async def test_a_pin_taken_and_lifted_while_idle_keeps_the_books_exact() -> None:
    """Idle -> pinned -> idle, with and without a lease between, never leaves a lease behind."""
    async with serving() as daemon:
        async with Broker.connect(daemon.address) as broker:
            async with broker.cache("w", Plugin()) as cache:
                async with cache.acquire("a", load=value(1), size=10):
                    await until(lambda: [e["leases"] for e in listed(daemon)] == [1])
                await until(lambda: [e["leases"] for e in listed(daemon)] == [0])
                await cache.prefetch("a", load=value(1), size=10, pin=True)
                await until(lambda: [e["pinned"] for e in listed(daemon)] == [True])
                assert [e["leases"] for e in listed(daemon)] == [0]
                daemon.runner.core.check()
                async with cache.acquire("a", load=value(1), size=10):
                    # Pinned and leased in the process: the daemon knows it pinned.
                    assert [(e["leases"], e["pinned"]) for e in listed(daemon)] == [(0, True)]
                await cache.unpin("a")
                await until(lambda: [e["pinned"] for e in listed(daemon)] == [False])
                assert [e["leases"] for e in listed(daemon)] == [0]
                entry = next(iter(daemon.runner.core.entries()))
                # An eviction candidate again (or about to be, at the books' next step: the
                # lease taken while pinned counted as a request there, ``touched``).
                assert entry.idle_seq or entry in daemon.runner.core.settling
                daemon.runner.core.check()
                assert await cache.invalidate("a")
                await until(lambda: used(daemon) == 0)


async def test_a_held_lease_is_named_by_its_process_and_cache(
    events: list[MutableMapping[str, Any]],
) -> None:
    now = [0.0]
    async with serving(clock=lambda: now[0], lease_warning=0.4) as daemon:
        async with Broker.connect(daemon.address) as one, Broker.connect(daemon.address) as two:
            async with one.cache("whisper", Plugin()) as c1, two.cache("llama", Plugin()) as c2:
                forgotten = await c1.acquire("a", load=value(1), size=60)
                await until(lambda: [e["leases"] for e in listed(daemon)] == [1])

                async def wait_for_room() -> None:
                    await c2.acquire("b", load=value(2), size=60)  # (cancelled below)

                with anyio.move_on_after(60) as scope:
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(wait_for_room)
                        await queued(daemon)
                        daemon.broker._runner.held_leases.check()
                        now[0] += 1.0
                        daemon.broker._runner.held_leases.check()
                        (held,) = held_events(events)
                        tg.cancel_scope.cancel()
                assert not scope.cancelled_caught
                await forgotten.release()
    assert (held["cache"], repr(held["key"]), held["waiting"]) == (
        f"whisper@{os.getpid()}",
        "'a'",
        1,
    )
    assert held["holders"] == [f"process {os.getpid()} (cache whisper)"]


async def test_a_request_only_its_own_pinned_lease_could_serve_is_refused_at_once() -> None:
    """Pinned, not leased, in the daemon's books: the task's lease there still counts as its own."""
    async with serving() as daemon:
        async with Broker.connect(daemon.address) as broker:
            async with broker.cache("w", Plugin()) as cache:
                async with cache.acquire("p", load=value(1), size=60, pin=True):
                    await until(lambda: [e["pinned"] for e in listed(daemon)] == [True])
                    with pytest.raises(DeadlockError, match="leased by the requesting task"):
                        await cache.acquire("q", load=value(2), size=60, timeout=30)
                await cache.unpin("p")
                daemon.runner.core.check()


async def test_a_release_refused_because_the_process_pinned_its_entry_leaves_it_pinned() -> None:
    """The daemon asked for an idle entry; the process had pinned it meanwhile and refuses.

    The entry is ready again here, pinned and with no lease; unpinned there, it
    is a victim like any other and the request that wanted its room gets it.
    """
    async with serving() as daemon:
        stream = await anyio.connect_unix(daemon.address)
        reader = BufferedByteReceiveStream(stream)

        async def next_op(op: str) -> dict[str, Any]:
            with anyio.fail_after(5):
                while True:
                    message = await wire.receive(reader)
                    if message["op"] == op:
                        return message

        async def report(state: str) -> None:
            await wire.send(stream, {"op": "report", "id": 1, "state": state, "charge": {"m": 60}})

        async with Broker.connect(daemon.address) as broker:
            await wire.send(stream, {"op": "hello", "version": wire.VERSION, "pid": 1})
            await wire.send(stream, {"op": "open", "cache": "h"})
            await next_op("welcome")
            await wire.send(
                stream, {"op": "acquire", "id": 1, "cache": "h", "key": "'x'", "need": {"m": 60}}
            )
            await next_op("grant")
            await report("idle")
            await until(lambda: [e["state"] for e in listed(daemon)] == ["ready"])
            async with broker.cache("w", Plugin()) as cache, anyio.create_task_group() as tg:
                got: list[Any] = []

                async def wait_for_room() -> None:
                    async with cache.acquire("b", load=value(2), size=60, timeout=30) as lease:
                        got.append(lease.value)

                tg.start_soon(wait_for_room)
                await next_op("release")
                await report("pinned")
                await until(lambda: listed(daemon)[0]["pinned"])
                assert listed(daemon)[0] == {
                    "cache": "h",
                    "key": "'x'",
                    "leases": 0,
                    "pinned": True,
                    "state": "ready",
                }
                daemon.runner.core.check()
                await report("idle")  # unpinned there
                await next_op("release")
                await report("gone")
            assert got == [2]
            daemon.runner.core.check()
            # (shut down, not closed under the daemon's reader: anyio#1267 on asyncio)
            stream.extra(anyio.abc.SocketAttribute.raw_socket).shutdown(socket.SHUT_RDWR)
            await until(lambda: len(daemon.connections) == 1)
            await stream.aclose()


async def test_a_process_that_dies_with_a_pinned_entry_frees_its_bytes() -> None:
    async with serving() as daemon:
        stream = await anyio.connect_unix(daemon.address)
        reader = BufferedByteReceiveStream(stream)
        await wire.send(stream, {"op": "hello", "version": wire.VERSION, "pid": 1})
        await wire.send(stream, {"op": "open", "cache": "h"})
        assert (await wire.receive(reader))["op"] == "welcome"
        await wire.send(
            stream, {"op": "acquire", "id": 1, "cache": "h", "key": "'x'", "need": {"m": 60}}
        )
        assert (await wire.receive(reader))["op"] == "grant"
        await wire.send(stream, {"op": "report", "id": 1, "state": "pinned", "charge": {"m": 60}})
        await until(lambda: [e["pinned"] for e in listed(daemon)] == [True])
        daemon.runner.core.check()
        # (shut down, not closed under the daemon's reader: anyio#1267 on asyncio)
        stream.extra(anyio.abc.SocketAttribute.raw_socket).shutdown(socket.SHUT_RDWR)
        await until(lambda: not daemon.connections and used(daemon) == 0)
        await stream.aclose()
        assert listed(daemon) == []
        daemon.runner.core.check()
        async with Broker.connect(daemon.address) as broker, broker.cache("w", Plugin()) as cache:
            async with cache.acquire("y", load=value(1), size=100, timeout=5) as lease:
                assert lease.value == 1
