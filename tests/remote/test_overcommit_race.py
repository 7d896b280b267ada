"""The daemon keeps a granted load's bytes charged until its process says nothing is left.

A cache that closes while a plain loader runs in a worker thread cannot stop
the thread: in one process the books keep the load's reservation charged,
``releasing``, until the thread returns and its value is released
(``Core.load_abandoned``). A connected process reports that entry as
``releasing``, but its report leaves ``loading`` without a measured charge,
which the daemon takes for a load that made nothing (``Connection._load``
raises ``LoadFailed``): the reservation comes back while the thread is still
making the value, and another process is granted bytes this one still holds.
No sleeps: the thread waits on an event the test sets.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest

from cachebroker import Broker, BrokerClosed
from tests.helpers import wait_until
from tests.remote.processes import check_books, serving

pytestmark = pytest.mark.anyio


async def test_a_threaded_load_abandoned_by_its_closing_cache_stays_charged() -> None:
    directory = Path(tempfile.mkdtemp(prefix="cb-", dir="/tmp"))  # (socket paths are short)
    address = str(directory / "broker.sock")
    started, finish = threading.Event(), threading.Event()
    released: list[Any] = []

    def load() -> str:  # a plain loader: the broker runs it in a worker thread
        started.set()
        finish.wait(30)  # (bounded: a failing test must not hang the thread)
        return "value"

    async def release(key: Any, value: Any) -> None:
        released.append((key, value))

    try:
        async with serving(address, 1000) as daemon:
            used = daemon.runner.core.spaces["default"]
            try:
                async with Broker.connect(address) as broker:
                    outcome: list[BaseException] = []
                    async with anyio.create_task_group() as tg:
                        async with broker.cache("c", release) as cache:

                            async def acquire() -> None:
                                try:
                                    async with cache.acquire("k", load=load, size=600):
                                        pass
                                except BrokerClosed as exc:
                                    outcome.append(exc)

                            tg.start_soon(acquire)
                            assert await anyio.to_thread.run_sync(started.wait, 10)
                            assert used.used == 600
                        # The cache closed while its loader's thread still runs.
                        assert not finish.is_set()
                        # Wait for the daemon to have the process's report of it.
                        await wait_until(
                            lambda: (
                                not any(
                                    e["state"] == "loading" for e in daemon.listing()["entries"]
                                )
                            )
                        )
                        check_books(daemon)
                        charged = used.used  # (while the thread still runs)
                        finish.set()
                        await wait_until(lambda: bool(released))
                    assert released == [("k", "value")]
                    assert len(outcome) == 1
                    await wait_until(lambda: used.used == 0)
            finally:
                finish.set()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert charged == 600, (
        f"the daemon charged {charged} bytes while the process's abandoned load "
        "was still making its 600-byte value"
    )
