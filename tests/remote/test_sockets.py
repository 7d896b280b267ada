"""The daemon's and the clients' Unix sockets (``cachebroker._remote._sockets``).

On asyncio, an accept or a receive cancelled in the loop turn its socket
turns readable must leave no callback to fail in the loop (anyio's pytest
plugin fails a test whose loop reported one), and must lose nothing: the
connection is accepted, and the bytes received, by the next call.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
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
    directory = tempfile.mkdtemp(prefix="cb-", dir="/tmp")  # (socket paths are short)
    try:
        yield os.path.join(directory, "s.sock")
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def blocking_client(path: str) -> socket.socket:
    """A plain socket connected at once (the listener's backlog takes it)."""
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(path)
    return client


@contextlib.asynccontextmanager
async def pair(path: str) -> AsyncIterator[tuple[anyio.abc.SocketStream, anyio.abc.SocketStream]]:
    async with await listen(path) as listener:
        client = await connect(path)
        server = await listener.accept()
        async with client, server:
            yield client, server


async def test_an_accept_cancelled_as_a_connection_arrives_leaves_it_to_the_next(
    path: str,
) -> None:
    """On asyncio the loop's next turn polls first (the listener is readable), then
    runs this task, which cancels the accept before its wake-up runs; elsewhere the
    accept may win. Either way the connection is accepted once, and nothing fails."""
    async with await listen(path) as listener:
        got: list[anyio.abc.SocketStream] = []
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with client:
            async with anyio.create_task_group() as tg:
                scope = anyio.CancelScope()

                async def accepting() -> None:
                    with scope:
                        got.append(await listener.accept())

                tg.start_soon(accepting)
                await anyio.wait_all_tasks_blocked()  # (the accept waits for its socket)
                client.connect(path)  # (at once: the listener's backlog takes it)
                await anyio.lowlevel.checkpoint()
                scope.cancel()
            with anyio.fail_after(5):
                stream = got[0] if got else await listener.accept()
            async with stream:
                client.sendall(b"after")
                assert await stream.receive() == b"after"


async def test_a_receive_cancelled_as_bytes_arrive_leaves_them_to_the_next(path: str) -> None:
    async with await listen(path) as listener:
        with blocking_client(path) as client:
            stream = await listener.accept()
            async with stream:
                got: list[bytes] = []
                async with anyio.create_task_group() as tg:
                    scope = anyio.CancelScope()

                    async def receiving() -> None:
                        with scope:
                            got.append(await stream.receive())

                    tg.start_soon(receiving)
                    await anyio.wait_all_tasks_blocked()
                    client.sendall(b"bytes")
                    await anyio.lowlevel.checkpoint()
                    scope.cancel()
                with anyio.fail_after(5):
                    if not got:
                        got.append(await stream.receive())
                assert got == [b"bytes"]


async def test_bytes_go_both_ways_in_order_through_backpressure(path: str) -> None:
    """A send far bigger than the socket's buffers completes once the peer reads it."""
    big = os.urandom(4 << 20)
    async with pair(path) as (client, server):
        got = bytearray()
        async with anyio.create_task_group() as tg:

            async def read_all() -> None:
                while len(got) < len(big):
                    got.extend(await server.receive(1 << 16))
                    await anyio.lowlevel.checkpoint()

            tg.start_soon(read_all)
            with anyio.fail_after(20):
                await client.send(big)
        assert bytes(got) == big
        await server.send(b"back")
        assert await client.receive(2) == b"ba"  # (a chunk bigger than asked is split)
        assert await client.receive() == b"ck"


async def test_the_end_of_a_stream_and_a_closed_stream_are_told_apart(path: str) -> None:
    async with pair(path) as (client, server):
        await client.send(b"last")
        await client.send_eof()
        assert await server.receive() == b"last"
        with pytest.raises(anyio.EndOfStream):
            await server.receive()
        await server.send(b"still open the other way")
        assert await client.receive() == b"still open the other way"
        await client.aclose()
        with pytest.raises(anyio.ClosedResourceError):
            await client.receive()
        with pytest.raises(anyio.ClosedResourceError):
            await client.send(b"x")


async def test_a_peer_gone_ends_the_stream_and_breaks_sending(path: str) -> None:
    async with pair(path) as (client, server):
        await server.aclose()
        with anyio.fail_after(5):
            with pytest.raises((anyio.EndOfStream, anyio.BrokenResourceError)):
                await client.receive()
            with pytest.raises((anyio.BrokenResourceError, anyio.ClosedResourceError)):  # noqa: PT012
                for _ in range(100):  # (the first sends may still be buffered)
                    await client.send(b"x" * 65536)


async def test_a_stream_knows_its_peer_and_refuses_two_readers(path: str) -> None:
    async with pair(path) as (client, server):
        assert wire.peer(server) == (os.getuid(), os.getpid())
        assert wire.peer(client) == (os.getuid(), os.getpid())
        async with anyio.create_task_group() as tg:
            tg.start_soon(server.receive)
            await anyio.wait_all_tasks_blocked()
            with pytest.raises(anyio.BusyResourceError):
                await server.receive()
            await client.send(b"x")
        with pytest.raises(ValueError, match="max_bytes"):
            await server.receive(0)


async def test_an_outlet_drains_when_its_last_batch_is_empty_and_writes_batches_in_order(
    path: str,
) -> None:
    """``Outlet.drain`` (what a closing broker awaits) returns once the writer has
    taken the batch asked for, even an empty one; the batches arrive whole, in order."""
    batches: list[list[dict[str, object]]] = [[{"op": "a"}, {"op": "b"}], [], [{"op": "c"}]]

    def batch() -> list[dict[str, object]]:
        return batches.pop(0)

    async with pair(path) as (client, server):
        outlet = _sockets.Outlet(client, batch, wire.encode)
        reader = _sockets.Frames(server)
        async with anyio.create_task_group() as tg:
            tg.start_soon(outlet.run)
            for _ in range(3):
                outlet.soon()
                with anyio.fail_after(5):  # (a bound on a hang, not a measurement)
                    await outlet.drain()
            assert batches == [] and outlet.unsent == 0
            received = [(await wire.receive(reader))["op"] for _ in range(3)]
            tg.cancel_scope.cancel()
        assert received == ["a", "b", "c"]
        assert not outlet.open


async def test_an_outlet_writes_a_steps_batch_at_its_end_and_nothing_once_its_writer_is_cancelled(
    path: str, anyio_backend_name: str
) -> None:
    """On asyncio a step's messages leave in one write at the step's end
    (``at_step_end``), not a turn later; without a live writer they wait for it,
    and once the writer is cancelled nothing more is taken or written. On trio
    the writer sends every batch, and the step is not asked."""
    batches: list[list[dict[str, object]]] = [[{"op": "a"}, {"op": "b"}], [{"op": "c"}]]
    taken: list[list[dict[str, object]]] = []
    ends: list[object] = []

    def batch() -> list[dict[str, object]]:
        taken.append(batches.pop(0) if batches else [])
        return taken[-1]

    def at_step_end(callback: object) -> bool:
        ends.append(callback)
        return True

    transport = anyio_backend_name == "asyncio"
    async with pair(path) as (client, server):
        outlet = _sockets.Outlet(client, batch, wire.encode, at_step_end)
        reader = _sockets.Frames(server)
        async with anyio.create_task_group() as tg:
            outlet.soon()  # no writer yet: the step's end leaves it to the writer
            outlet.soon()
            if transport:
                assert len(ends) == 1
                outlet.flush()
            assert taken == []
            tg.start_soon(outlet.run)
            with anyio.fail_after(5):  # (a bound on a hang, not a measurement)
                await outlet.drain()
            assert [(await wire.receive(reader))["op"] for _ in range(2)] == ["a", "b"]
            outlet.soon()
            if transport:
                assert len(ends) == 2 and len(taken) == 1  # asked of the step, not yet taken
                outlet.flush()
                assert len(taken) == 2  # taken and written in the step, before any await
            with anyio.fail_after(5):
                await outlet.drain()
            assert (await wire.receive(reader))["op"] == "c"
            tg.cancel_scope.cancel()
            outlet.soon()
            outlet.flush()
            assert len(taken) == 2  # the writer is cancelled: nothing more is taken
        assert not outlet.open
        assert ends == ([outlet.flush] * 3 if transport else [])


class _Steps:
    """The books' steps as an outlet sees them (``Runner.at_step_end``), and its outbox."""

    def __init__(self) -> None:
        self.outbox: list[dict[str, object]] = []
        self.inside = False
        self.ends: list[Callable[[], None]] = []

    def batch(self) -> list[dict[str, object]]:
        taken, self.outbox = self.outbox, []
        return taken

    def at_step_end(self, callback: Callable[[], None]) -> bool:
        if self.inside:
            self.ends.append(callback)
        return self.inside

    def step(self, outlet: _sockets.Outlet, message: dict[str, object]) -> None:
        """One step that posts ``message``; at its end, what it left for its end."""
        self.inside = True
        self.outbox.append(message)
        outlet.soon()
        self.inside = False
        ends, self.ends = self.ends, []
        for callback in ends:
            callback()


async def _the_rest(client: anyio.abc.SocketStream, reader: _sockets.Frames) -> list[str]:
    """The ops of every frame the peer still gets once ``client`` is closed."""
    await client.aclose()
    ops: list[str] = []
    with anyio.fail_after(5), contextlib.suppress(anyio.EndOfStream, anyio.IncompleteRead):
        while True:
            ops.append((await wire.receive(reader))["op"])
    return ops


async def test_nothing_is_written_by_a_step_after_the_writer_is_cancelled_mid_checkpoint(
    path: str, anyio_backend_name: str
) -> None:
    """The writer just wrote a batch the loop asked for (outside a step) and sits in
    its shielded checkpoint; the connection's task group is cancelled; then a step
    posts. Nothing posted after the cancellation may leave."""
    if anyio_backend_name != "asyncio":
        pytest.skip("trio's writer sends every batch (and schedules in random order)")
    steps = _Steps()
    async with pair(path) as (client, server):
        outlet = _sockets.Outlet(client, steps.batch, wire.encode, steps.at_step_end)
        reader = _sockets.Frames(server)
        async with anyio.create_task_group() as tg:
            tg.start_soon(outlet.run)
            await anyio.wait_all_tasks_blocked()
            steps.outbox.append({"op": "before"})
            outlet.soon()  # (not in a step: the writer is woken)
            await anyio.lowlevel.checkpoint()  # the writer writes, then its shielded checkpoint
            assert not steps.outbox  # the writer took "before"
            tg.cancel_scope.cancel()  # the connection ends (its broker stops)
            steps.step(outlet, {"op": "after-cancel"})
        with anyio.fail_after(5):
            assert (await wire.receive(reader))["op"] == "before"
        assert await _the_rest(client, reader) == []


async def test_a_batch_after_one_that_failed_to_encode_is_not_written(path: str) -> None:
    """A step's batch fails to encode at its end (the writer is to raise it); a later
    step in the same turn posts: that batch must not reach the peer without the one
    before it."""
    steps = _Steps()

    def encode(message: object) -> bytes:
        if message == {"op": "poison"}:
            raise TypeError("cannot encode")
        return wire.encode(message)  # type: ignore[arg-type]

    async with pair(path) as (client, server):
        outlet = _sockets.Outlet(client, steps.batch, encode, steps.at_step_end)
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
            steps.step(outlet, {"op": "poison"})
            steps.step(outlet, {"op": "second"})
        assert raised  # the failure was not lost
        assert await _the_rest(client, reader) == []
