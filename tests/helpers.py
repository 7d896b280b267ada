"""Helpers shared by tests in more than one directory: plugins, loaders, bounded waits.

``Recorder`` is a releaser that records what it frees, ``loader`` a loader
that returns its value after a checkpoint, ``Device`` a memory the broker
knows nothing about. ``wait_until`` waits (bounded in time) for a condition;
``steps_until`` lets other tasks run a bounded number of steps until it holds.
``socket_path`` gives a Unix socket path in a fresh directory under ``/tmp``
(socket paths are short).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import shutil
import tempfile
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import anyio
import anyio.lowlevel

plugin_name: contextvars.ContextVar[str] = contextvars.ContextVar("plugin_name", default="?")


class Recorder:
    """A releaser that records what it was asked to free, and where."""

    def __init__(self) -> None:
        self.released: list[Any] = []
        self.contexts: list[str] = []
        self.gate: anyio.Event | None = None
        self.started = anyio.Event()
        self.live: set[Hashable] = set()

    async def release(self, key: Hashable, value: Any) -> None:
        self.started.set()
        self.contexts.append(plugin_name.get())
        if self.gate is not None:
            await self.gate.wait()
        self.live.discard(key)
        self.released.append(key)


def loader(value: Any, calls: list[Any] | None = None) -> Any:
    async def load() -> Any:
        if calls is not None:
            calls.append(value)
        await anyio.lowlevel.checkpoint()
        return value

    return load


async def wait_until(predicate: Any, limit: float = 5.0) -> None:
    """Let other tasks run until ``predicate()`` holds (bounded; no fixed sleeps)."""
    with anyio.fail_after(limit):
        while not predicate():
            await anyio.sleep(0.001)


async def steps_until(condition: Callable[[], Any], *, steps: int = 5_000) -> bool:
    """Let other tasks run until ``condition()`` holds; whether it did (no sleeping)."""
    for _ in range(steps):
        if condition():
            return True
        await anyio.lowlevel.checkpoint()
    return bool(condition())


class Device:
    """A memory the broker knows nothing about: sizes are never declared."""

    def __init__(self, capacity: int, error: type[Exception] = MemoryError) -> None:
        self.capacity = capacity
        self.used = 0
        self.error = error
        self.freed: list[str] = []

    def loader(self, key: str, size: int) -> Any:
        async def load() -> tuple[str, int]:
            await anyio.lowlevel.checkpoint()
            if self.used + size > self.capacity:
                raise self.error(f"cannot allocate {size} for {key}")
            self.used += size
            return (key, size)

        return load

    async def release(self, key: str, value: tuple[str, int]) -> None:
        self.used -= value[1]
        self.freed.append(key)


@contextlib.contextmanager
def socket_path(name: str = "s.sock") -> Iterator[str]:
    """A Unix socket path in a fresh directory under ``/tmp``, removed after the block.

    (Socket paths are short: ``tmp_path`` may be too long for ``AF_UNIX``.)
    """
    directory = tempfile.mkdtemp(prefix="cb-", dir="/tmp")
    try:
        yield os.path.join(directory, name)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def watch(module: Any, name: str, books: object, before: Callable[..., None]) -> Callable[[], None]:
    """Run ``before(*args)`` ahead of each call of ``module.name`` (a transition, as
    ``_core._transitions.grant``) on ``books``; return what undoes it (a teardown's).

    The books change an entry's state only through ``_transitions``' functions,
    looked up in the module at each call: a watch there sees every change.
    """
    original = getattr(module, name)

    def watched(on: object, *args: Any, **kwargs: Any) -> Any:
        if on is books:
            before(*args, **kwargs)
        return original(on, *args, **kwargs)

    setattr(module, name, watched)
    return lambda: setattr(module, name, original)
