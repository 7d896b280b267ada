"""Both kinds of broker from one fixture: in this process, and connected to ``cachebroker serve``.

``open_broker(kind, budget, **settings)`` yields a ``Broker``: for ``"local"``
an in-process one, for ``"connected"`` a ``Broker.connect()`` to a daemon run
in the test's own event loop with the same settings (``daemon_of(broker)``
gives its daemon, whose books the test may read). A test that takes the ``kind``
fixture runs once with each, so a promise is checked where it is made in one
process and through the daemon alike.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Hashable
from typing import Any

import anyio

from cachebroker import Broker
from cachebroker._remote._daemon import Daemon, DaemonBroker

KINDS = ("local", "connected")
#: The settings a connected broker takes itself (``Broker.connect``), not its daemon.
CONNECT_SETTINGS = ("oom_errors", "oom_retries", "sizes", "blocking_warning", "logger")

_DAEMONS: dict[int, Daemon] = {}


@contextlib.asynccontextmanager
async def open_broker(kind: str, budget: Any, **settings: Any) -> AsyncIterator[Broker]:
    """A running broker of ``kind`` with ``budget`` and ``settings`` (a daemon's for "connected").

    Its release timeout is short unless given (3 s, not 30): a test that fails
    with a lease held closes its caches in seconds.
    """
    settings.setdefault("release_timeout", 3)
    if kind == "local":
        async with Broker(budget, **settings) as broker:
            yield broker
        return
    assert kind == "connected", kind
    # (the process's own settings: how its loads retry; the rest are the daemon's)
    mine = {name: settings.pop(name) for name in CONNECT_SETTINGS if name in settings}
    if "clock" in settings:  # (both run timers: the process its entries' idle TTLs)
        mine["clock"] = settings["clock"]
    directory = tempfile.mkdtemp(prefix="cb-", dir="/tmp")  # (socket paths are short)
    daemon = Daemon(DaemonBroker(budget, **settings), os.path.join(directory, "s.sock"))
    # What the test's block raised, held while the daemon's task group ends (where
    # it would be wrapped in a group): it comes out as from an in-process broker.
    error: BaseException | None = None
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(daemon.run)
            try:
                async with Broker.connect(daemon.address, **mine) as broker:
                    _DAEMONS[id(broker)] = daemon
                    try:
                        yield broker
                    finally:
                        del _DAEMONS[id(broker)]
            except anyio.get_cancelled_exc_class():
                raise
            except BaseException as exc:
                error = exc
            finally:
                tg.cancel_scope.cancel()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    if error is not None:
        raise error


def daemon_of(broker: Broker) -> Daemon | None:
    """The daemon a ``"connected"`` broker of ``open_broker`` talks to (``None`` for "local")."""
    return _DAEMONS.get(id(broker))


async def quick(key: Hashable, value: Any) -> None:
    """A releaser with nothing to free."""


def loaded(value: Any) -> Callable[[], Any]:
    """A loader that returns ``value``."""

    async def load() -> Any:
        return value

    return load


async def until(condition: Callable[[], bool]) -> None:
    """Wait (bounded) until ``condition()`` holds."""
    with anyio.fail_after(10):
        while not condition():
            await anyio.sleep(0.001)
