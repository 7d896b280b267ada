"""Helpers shared by the tests of the async shell: plugins that misbehave, gated loaders.

``Faulty`` is a releaser whose behaviour is chosen per key, ``fill`` an entry
loaded and left idle, ``checked`` a broker whose books are checked after
every step, ``Gated`` a loader that waits to be let through.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Hashable
from typing import Any

import anyio
import anyio.lowlevel

from cachebroker import Broker, Cache
from cachebroker._core import check_after_every_step
from tests.brokers import daemon_of, open_broker
from tests.helpers import loader


async def fill(cache: Cache, key: str, size: int = 50) -> None:
    async with cache.acquire(key, load=loader(key), size=size):
        pass


class Faulty:
    """A releaser whose behaviour is chosen per key: ok, raise, hang, or late."""

    def __init__(self, **modes: str) -> None:
        self.modes = modes
        self.freed: list[str] = []
        self.late = anyio.Event()

    async def release(self, key: str, value: Any) -> None:
        mode = self.modes.get(key, "ok")
        if mode == "raise":
            raise OSError(f"device busy freeing {key}")
        if mode == "hang":
            await anyio.sleep_forever()
        if mode == "late":
            await self.late.wait()
        self.freed.append(key)


@contextlib.asynccontextmanager
async def checked(kind: str = "local", **options: Any) -> AsyncIterator[Broker]:
    """A broker of ``kind`` (``open_broker``) whose books are checked after every step
    (``Core.check``): a connected one's, and its daemon's."""
    failures: list[str] = []
    budget = options.pop("budget")
    async with open_broker(kind, budget, **options) as broker:
        check_after_every_step(broker._core, failures)
        daemon = daemon_of(broker)
        if daemon is not None:
            check_after_every_step(daemon.runner.core, failures)
        yield broker
    assert failures == []


class Gated:
    """A loader that waits for ``open`` (and counts its calls)."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.calls = 0
        self.started = anyio.Event()
        self.open = anyio.Event()
        self.cancelled = False

    async def __call__(self) -> Any:
        self.calls += 1
        self.started.set()
        try:
            await self.open.wait()
        except anyio.get_cancelled_exc_class():
            self.cancelled = True
            raise
        return self.value


def counting(result: Any, calls: list[Any]) -> Any:
    async def load() -> Any:
        calls.append(result)
        await anyio.lowlevel.checkpoint()
        return result

    return load


async def never() -> Any:
    raise AssertionError("this loader must not be called")


async def release(key: Hashable, value: Any) -> None:
    pass


class Loads:
    """A loader that counts its calls and returns a new value each time."""

    def __init__(self) -> None:
        self.count = 0

    async def __call__(self) -> str:
        self.count += 1
        return f"value-{self.count}"
