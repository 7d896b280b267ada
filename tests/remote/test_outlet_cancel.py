"""Outlet's step-end write: nothing once its writer is cancelled, nor after a failed batch."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator

import anyio
import anyio.abc
import anyio.lowlevel
import pytest

from cachebroker._remote import _protocol as wire
from cachebroker._remote import _sockets
from cachebroker._remote._sockets import connect, listen

pytestmark = pytest.mark.anyio


@pytest.fixture
def path() -> Iterator[str]:
    directory = tempfile.mkdtemp(prefix="cb-", dir="/tmp")
    try:
        yield os.path.join(directory, "s.sock")
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.asynccontextmanager
async def pair(path: str) -> AsyncIterator[tuple[anyio.abc.SocketStream, anyio.abc.SocketStream]]:
    async with await listen(path) as listener:
        client = await connect(path)
        server = await listener.accept()
        async with client, server:
            yield client, server


async def test_nothing_is_written_by_a_step_after_the_writer_is_cancelled_mid_checkpoint(
    path: str, anyio_backend_name: str
) -> None:
    """The writer just wrote a batch the loop asked for (outside a step) and sits in
    its shielded checkpoint; the connection's task group is cancelled; then a step
    posts. Nothing posted after the cancellation may leave. (Passes at 0505626: there
    the writer's next wait is a checkpoint, which delivers the cancellation.)"""
    if anyio_backend_name != "asyncio":
        pytest.skip("trio's writer sends every batch (and schedules in random order)")
    outbox: list[dict[str, object]] = []
    in_step = [False]
    stepped: list[Callable[[], None]] = []

    def batch() -> list[dict[str, object]]:
        b = outbox[:]
        outbox.clear()
        return b

    def at_step_end(cb: Callable[[], None]) -> bool:
        if in_step[0]:
            stepped.append(cb)
            return True
        return False

    async with pair(path) as (client, server):
        outlet = _sockets.Outlet(client, batch, wire.encode, at_step_end)
        reader = _sockets.Frames(server)
        async with anyio.create_task_group() as tg:
            tg.start_soon(outlet.run)
            await anyio.wait_all_tasks_blocked()
            outbox.append({"op": "before"})
            outlet.soon()  # (not in a step: the writer is woken)
            await anyio.lowlevel.checkpoint()  # the writer writes, then its shielded checkpoint
            assert not outbox  # the writer took "before"
            tg.cancel_scope.cancel()  # the connection ends (its broker stops)
            in_step[0] = True
            outbox.append({"op": "after-cancel"})
            outlet.soon()
            in_step[0] = False
            for cb in stepped:
                cb()  # the step's end
        with anyio.fail_after(5):
            assert (await wire.receive(reader))["op"] == "before"
        await client.aclose()
        got: list[str] = []
        with anyio.fail_after(5), contextlib.suppress(anyio.EndOfStream, anyio.IncompleteRead):
            while True:
                got.append((await wire.receive(reader))["op"])
        assert got == []


async def test_a_batch_after_one_that_failed_to_encode_is_not_written(path: str) -> None:
    """A step's batch fails to encode at its end (the writer is to raise it); a later
    step in the same turn posts: that batch must not reach the peer without the one
    before it."""
    outbox: list[dict[str, object]] = []
    in_step = [False]
    stepped: list[Callable[[], None]] = []

    def batch() -> list[dict[str, object]]:
        b = outbox[:]
        outbox.clear()
        return b

    def encode(message: object) -> bytes:
        if message == {"op": "poison"}:
            raise TypeError("cannot encode")
        return wire.encode(message)  # type: ignore[arg-type]

    def at_step_end(cb: Callable[[], None]) -> bool:
        if in_step[0]:
            stepped.append(cb)
            return True
        return False

    def step(message: dict[str, object]) -> None:
        in_step[0] = True
        outbox.append(message)
        outlet.soon()
        in_step[0] = False
        for cb in stepped:
            cb()
        stepped.clear()

    async with pair(path) as (client, server):
        outlet = _sockets.Outlet(client, batch, encode, at_step_end)
        reader = _sockets.Frames(server)
        raised: list[BaseException] = []

        async def writer() -> None:
            try:
                await outlet.run()
            except TypeError as exc:
                raised.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(writer)
            await anyio.wait_all_tasks_blocked()
            step({"op": "poison"})
            step({"op": "second"})
        assert raised  # the failure was not lost
        await client.aclose()
        got: list[str] = []
        with anyio.fail_after(5), contextlib.suppress(anyio.EndOfStream, anyio.IncompleteRead):
            while True:
                got.append((await wire.receive(reader))["op"])
        assert got == []
