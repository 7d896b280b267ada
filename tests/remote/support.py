"""Helpers for the tests of connected brokers: a daemon in the test's own loop, and its books.

``serving`` runs a daemon (``cachebroker serve``'s ``Daemon``) on a fresh
socket for the duration of a block, ``stoppable`` one whose scope the test
cancels; ``until`` waits (bounded) while messages cross the socket.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Callable, Hashable
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel

from cachebroker import Broker
from cachebroker._remote._admission import LinkAdmission
from cachebroker._remote._client import Link
from cachebroker._remote._daemon import Daemon, DaemonBroker
from tests.helpers import socket_path


@contextlib.asynccontextmanager
async def serving(**settings: Any) -> AsyncIterator[Daemon]:
    """A daemon on a fresh socket, for the duration of the block."""
    settings.setdefault("budget", {"m": 100})
    with socket_path() as address:
        daemon = Daemon(DaemonBroker(**settings), address)
        # (bounded: a test that would hang fails instead)
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                await tg.start(daemon.run)
                try:
                    yield daemon
                finally:
                    tg.cancel_scope.cancel()


async def stoppable(tg: anyio.abc.TaskGroup, address: str) -> tuple[Daemon, anyio.CancelScope]:
    """A daemon at ``address``, run in ``tg``, and the scope whose cancelling makes it go."""
    daemon = Daemon(DaemonBroker(budget={"m": 100}), address)
    scope = anyio.CancelScope()

    async def run() -> None:
        with scope:
            await daemon.run()

    tg.start_soon(run)
    await until(lambda: daemon.runner.running and os.path.exists(address))
    return daemon, scope


async def until(condition: Callable[[], bool]) -> None:
    """Wait (bounded) until ``condition()`` holds: messages cross the socket meanwhile."""
    with anyio.fail_after(5):
        while not condition():
            await anyio.sleep(0.001)


def link_of(broker: Broker) -> Link | None:
    side = broker._runner.remote
    assert isinstance(side, LinkAdmission)
    return side.link


def states(daemon: Daemon) -> list[str]:
    return [entry["state"] for entry in daemon.listing()["entries"]]


def used(daemon: Daemon, space: str = "m") -> int:
    return daemon.runner.core.spaces[space].used


class Plugin:
    def __init__(self) -> None:
        self.released: list[Hashable] = []
        self.gate: anyio.Event | None = None

    async def release(self, key: Hashable, value: Any) -> None:
        if self.gate is not None:
            await self.gate.wait()
        self.released.append(key)


def value(v: Any) -> Callable[[], Any]:
    async def load() -> Any:
        await anyio.lowlevel.checkpoint()
        return v

    return load
