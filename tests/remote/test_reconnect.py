"""A connected broker outlives its daemon's restart (``Broker.connect(reconnect=True)``).

The daemon and the brokers run in the test's event loop, on every backend,
so that the books of each daemon can be read between steps. A restart is a
daemon cancelled (its socket removed, as SIGTERM does) and a new one started
at the same address. Real processes are in ``test_processes.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import pytest

from cachebroker import AcquireTimeout, Broker, BrokerClosed, InvalidArgument
from cachebroker._remote._admission import LinkAdmission
from cachebroker._remote._client import Link
from cachebroker._remote._daemon import Daemon, DaemonBroker
from tests.remote.support import Plugin, used

pytestmark = pytest.mark.anyio


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A live process that is not this one: a peer of a daemon before, say."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield process
    finally:
        process.kill()
        process.wait()


def write_peers(address: str, pids: list[int]) -> None:
    """The peers file a daemon before this one would have left at ``address``."""
    with open(address + ".peers", "w") as file:
        json.dump({"pids": pids}, file)


class Daemons:
    """Daemons started and stopped at one address, in the test's task group."""

    def __init__(self, tg: anyio.abc.TaskGroup, address: str) -> None:
        self.tg = tg
        self.address = address
        self.scope: anyio.CancelScope | None = None

    async def start(
        self, budget: Any = None, *, tiers: dict[str, str] | None = None, **options: Any
    ) -> Daemon:
        broker = DaemonBroker(budget or {"m": 100}, release_timeout=3, tiers=tiers)
        daemon = Daemon(broker, self.address, **options)
        scope = self.scope = anyio.CancelScope()

        async def run() -> None:
            with scope:
                await daemon.run()

        self.tg.start_soon(run)
        await until(lambda: daemon.runner.running and os.path.exists(self.address))
        return daemon

    async def stop(self) -> None:
        assert self.scope is not None
        self.scope.cancel()
        await until(lambda: not os.path.exists(self.address))


@contextlib.asynccontextmanager
async def daemons(address: str) -> AsyncIterator[Daemons]:
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            yield Daemons(tg, address)
            tg.cancel_scope.cancel()


async def until(condition: Callable[[], bool]) -> None:
    with anyio.fail_after(10):
        while not condition():
            await anyio.sleep(0.002)


def link_of(broker: Broker) -> Link:
    side = broker._runner.remote
    assert isinstance(side, LinkAdmission) and side.link is not None
    return side.link


def listed(daemon: Daemon) -> list[tuple[str, str, int, dict[str, int]]]:
    return sorted(
        (e["key"], e["state"], e["leases"], e["charge"]) for e in daemon.listing()["entries"]
    )


def value(v: Any, gate: anyio.Event | None = None) -> Callable[[], Any]:
    async def load() -> Any:
        if gate is not None:
            await gate.wait()
        await anyio.lowlevel.checkpoint()
        return v

    return load


async def test_a_restarted_daemon_learns_what_a_process_holds_before_others_get_room(
    address: str,
) -> None:
    """Invariant: after a restart the new daemon charges every byte the process still
    holds (a lease, an idle entry, a request made during the outage), so a second
    process is not granted room the first one holds."""
    async with daemons(address) as run:
        first = await run.start()
        async with Broker.connect(address) as one, one.cache("w", Plugin()) as c1:
            held = await c1.acquire("held", load=value("H"), size=60)
            async with c1.acquire("idle", load=value("I"), size=20):
                pass
            await until(lambda: used(first) == 80)
            await run.stop()
            await until(lambda: not link_of(one).online)
            assert held.value == "H"  # leases and hits go on during the outage
            async with c1.acquire("idle", load=value("again"), size=20) as hit:
                assert hit.value == "I"
            async with anyio.create_task_group() as tg:
                late: list[Any] = []

                async def during_the_outage() -> None:
                    lease = await c1.acquire("late", load=value("L"), size=20, timeout=10)
                    late.append(lease)

                tg.start_soon(during_the_outage)
                await until(lambda: one.stats_nowait().waiting == 1)
                second = await run.start()
            assert [lease.value for lease in late] == ["L"]
            await until(
                lambda: (
                    listed(second)
                    == [
                        ("'held'", "ready", 1, {"m": 60}),
                        ("'idle'", "ready", 0, {"m": 20}),
                        ("'late'", "ready", 1, {"m": 20}),
                    ]
                )
            )
            second.runner.core.check()
            async with Broker.connect(address) as two, two.cache("w", Plugin()) as c2:
                # 80 leased, 20 idle: 20 at most for another process, by eviction.
                with pytest.raises(AcquireTimeout):
                    await c2.acquire("x", load=value("X"), size=30, timeout=0.3)
                async with c2.acquire("y", load=value("Y"), size=20, timeout=5) as lease:
                    assert lease.value == "Y"  # by evicting the first process's idle entry
                assert used(second) <= 100
            await held.release()
            await late[0].release()


async def test_loads_and_releases_in_flight_over_a_restart_stay_charged(address: str) -> None:
    """A load granted by the old daemon and still running, and a release still running,
    are registered as such: the new daemon charges them until the process says so."""
    async with daemons(address) as run:
        first = await run.start()
        plugin = Plugin()
        plugin.gate = anyio.Event()
        loaded = anyio.Event()
        async with Broker.connect(address) as one, one.cache("w", plugin) as c1:
            async with c1.acquire("going", load=value("G"), size=30):
                pass
            async with anyio.create_task_group() as tg:
                coming: list[Any] = []

                async def acquire() -> None:
                    coming.append(await c1.acquire("coming", load=value("C", loaded), size=40))

                async def invalidate() -> None:
                    await c1.invalidate("going")  # (waits for the releaser, held by its gate)

                tg.start_soon(acquire)
                await until(lambda: ("'coming'", "loading", 0, {"m": 40}) in listed(first))
                tg.start_soon(invalidate)
                await until(lambda: ("'going'", "releasing", 0, {"m": 30}) in listed(first))
                await run.stop()
                await until(lambda: not link_of(one).online)
                second = await run.start()
                await until(lambda: link_of(one).online and used(second) == 70)
                assert sorted((k, s) for k, s, _, _ in listed(second)) == [
                    ("'coming'", "loading"),
                    ("'going'", "releasing"),
                ]
                loaded.set()
                plugin.gate.set()
            await until(lambda: listed(second) == [("'coming'", "ready", 1, {"m": 40})])
            second.runner.core.check()
            assert plugin.released == ["going"]
            await coming[0].release()


async def test_a_restarted_daemon_grants_nothing_until_the_processes_before_it_registered(
    address: str, sleeper: subprocess.Popen[bytes]
) -> None:
    """The peers file names the processes of the daemon before; while one of them lives
    and has not registered, the new daemon grants nobody (here: until it ends)."""
    write_peers(address, [sleeper.pid, 2**22 + 12345])  # (the second: no such pid)
    async with daemons(address) as run:
        daemon = await run.start(grace=30)
        assert not daemon.gate.is_set() and daemon.expected == {sleeper.pid}
        async with Broker.connect(address) as broker, broker.cache("w", Plugin()) as cache:
            async with anyio.create_task_group() as tg:
                got: list[Any] = []

                async def ask() -> None:
                    async with cache.acquire("k", load=value(1), size=10) as lease:
                        got.append(lease.value)

                tg.start_soon(ask)
                await until(lambda: broker.stats_nowait().waiting == 1)
                await anyio.sleep(0.2)
                assert not got and used(daemon) == 0  # held at the gate
                sleeper.kill()
            assert got == [1]
            assert daemon.gate.is_set()


async def test_the_gate_opens_at_the_end_of_the_grace(
    address: str, sleeper: subprocess.Popen[bytes]
) -> None:
    write_peers(address, [sleeper.pid])
    async with daemons(address) as run:
        daemon = await run.start(grace=0.2)
        async with Broker.connect(address) as broker, broker.cache("w", Plugin()) as cache:
            async with cache.acquire("k", load=value(1), size=10, timeout=10) as lease:
                assert lease.value == 1
        assert daemon.gate.is_set() and not daemon.expected


def peers(daemon: Daemon) -> Any:
    with open(daemon.peers_path) as file:
        return json.load(file)


async def test_the_peers_file_lists_the_processes_that_opened_a_cache(address: str) -> None:
    async with daemons(address) as run:
        daemon = await run.start()
        async with Broker.connect(address) as broker:
            assert peers(daemon) == {"pids": []}  # no cache opened yet
            async with broker.cache("w", Plugin()):
                pass
            # (the daemon excludes its own pid: here every peer is this process)
            assert peers(daemon) == {"pids": []}
        assert os.stat(daemon.peers_path).st_mode & 0o077 == 0


async def test_without_reconnect_requests_fail_once_the_daemon_is_gone(address: str) -> None:
    async with daemons(address) as run:
        await run.start()
        async with Broker.connect(address, reconnect=False) as one, one.cache("w", Plugin()) as c:
            held = await c.acquire("a", load=value(1), size=10)
            await run.stop()
            await until(lambda: link_of(one).error is not None)
            with pytest.raises(BrokerClosed, match="is gone"):
                await c.acquire("b", load=value(2), size=10)
            assert held.value == 1
            await held.release()


async def test_reconnect_gives_up_after_its_timeout(address: str) -> None:
    async with daemons(address) as run:
        await run.start()
        async with Broker.connect(address, reconnect_timeout=0.2) as one:
            async with one.cache("w", Plugin()) as c:
                await run.stop()
                with anyio.fail_after(5):
                    with pytest.raises(BrokerClosed):
                        await c.acquire("b", load=value(2), size=10)


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"reconnect": "yes"}, TypeError),
        ({"reconnect_delay": 0}, InvalidArgument),
        ({"reconnect_delay": 2.0, "reconnect_max_delay": 1.0}, InvalidArgument),
        ({"reconnect_max_delay": -1}, InvalidArgument),
        ({"reconnect_timeout": 0}, InvalidArgument),
        ({"reconnect_timeout": "5"}, TypeError),
    ],
)
def test_reconnect_settings_are_checked(options: dict[str, Any], error: type) -> None:
    with pytest.raises(error, match="reconnect"):
        Broker.connect("/tmp/nowhere.sock", **options)


async def test_restarts_in_quick_succession_leave_the_last_daemon_with_the_true_books(
    address: str,
) -> None:
    """A daemon that goes again while the process registers with it (at any step of
    that, the stops falling where they may): the process registers with the next one,
    whose books charge exactly what it holds, once each."""
    async with daemons(address) as run:
        await run.start()
        async with Broker.connect(address, reconnect_delay=0.001) as one:
            async with one.cache("w", Plugin()) as c1:
                held = await c1.acquire("held", load=value("H"), size=60)
                async with c1.acquire("idle", load=value("I"), size=20):
                    pass
                for steps in range(6):
                    await run.stop()
                    await run.start()
                    for _ in range(steps):  # (a few turns of registration, then gone)
                        await anyio.lowlevel.checkpoint()
                await run.stop()
                last = await run.start()
                await until(lambda: link_of(one).online and used(last) == 80)
                await until(
                    lambda: (
                        listed(last)
                        == [("'held'", "ready", 1, {"m": 60}), ("'idle'", "ready", 0, {"m": 20})]
                    )
                )
                last.runner.core.check()
                async with c1.acquire("more", load=value("M"), size=20, timeout=5) as lease:
                    assert lease.value == "M"
                assert held.value == "H"
                await held.release()


def priorities(daemon: Daemon) -> dict[str, int]:
    return {e["key"]: e["priority"] for e in daemon.listing()["entries"]}


async def test_the_latest_acquire_s_priority_is_the_daemon_s_and_the_next_one_s(
    address: str,
) -> None:
    """A priority given by a later acquire reaches the shared broker: of a ready entry,
    at once; of one asked for during an outage (whose request still says the first
    acquire's), with its load's outcome; and a restarted daemon registers the latest."""
    async with daemons(address) as run:
        first = await run.start()
        async with Broker.connect(address) as one, one.cache("w", Plugin()) as c1:
            async with c1.acquire("x", load=value("X"), size=10):
                pass
            async with c1.acquire("x", load=value("X"), size=10, priority=9):
                pass
            await until(lambda: priorities(first) == {"'x'": 9})
            await run.stop()
            await until(lambda: not link_of(one).online)
            async with anyio.create_task_group() as tg:
                late: list[Any] = []

                async def during_the_outage(priority: int | None) -> None:
                    late.append(
                        await c1.acquire(
                            "late", load=value("L"), size=10, timeout=10, priority=priority
                        )
                    )

                tg.start_soon(during_the_outage, None)
                await until(lambda: one.stats_nowait().waiting == 1)
                tg.start_soon(during_the_outage, 7)  # joins the first one's load
                await until(lambda: c1._owner.entries["late"].priority == 7)
                second = await run.start()
            await until(lambda: priorities(second) == {"'x'": 9, "'late'": 7})
            second.runner.core.check()
            for lease in late:
                await lease.release()
