"""A broker connected to a shared one (``Broker.connect``), daemon and clients in one event loop.

Each test runs a daemon (``cachebroker serve``'s ``Daemon``) and one or more
connected brokers in the test's own loop, on every backend, so that the
daemon's books can be read between steps. Real processes are in
``test_processes.py``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Hashable
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import pytest

import cachebroker
from cachebroker import (
    AcquireTimeout,
    Broker,
    BrokerClosed,
    InvalidArgument,
    RequestTooLarge,
)
from cachebroker._remote import _protocol as wire
from cachebroker._remote._client import Link, LinkAdmission
from cachebroker._remote._daemon import Connection, Daemon, DaemonBroker
from cachebroker.probes import Probe

pytestmark = pytest.mark.anyio


@contextlib.asynccontextmanager
async def serving(**settings: Any) -> AsyncIterator[Daemon]:
    """A daemon on a fresh socket, for the duration of the block."""
    directory = tempfile.mkdtemp(prefix="cb-", dir="/tmp")  # (socket paths are short)
    settings.setdefault("budget", {"m": 100})
    daemon = Daemon(DaemonBroker(**settings), os.path.join(directory, "s.sock"))
    try:
        # (bounded: a test that would hang fails instead)
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                await tg.start(daemon.run)
                try:
                    yield daemon
                finally:
                    tg.cancel_scope.cancel()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


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


async def test_a_connected_broker_has_the_brokers_api_and_the_daemons_settings() -> None:
    async with serving(budget={"m": 100, "n": 50}, idle_ttl=30, release_timeout=7) as daemon:
        async with Broker.connect(daemon.address) as broker:
            assert isinstance(broker, Broker)
            runner = broker._runner
            assert isinstance(runner.remote, LinkAdmission)
            assert runner.budget == {"m": 100, "n": 50}
            assert runner.idle_ttl == 30 and runner.release_timeout == 7
            plugin = Plugin()
            async with broker.cache("w", plugin) as cache:
                async with cache.acquire("a", load=value("A"), size={"m": 40}) as lease:
                    assert lease.value == "A"
                lease = await cache.acquire("a", load=value("other"), size={"m": 40})
                assert lease.value == "A"  # a hit, served here
                await lease.release()
                stats = await broker.stats()
                assert stats.used == {"m": 40, "n": 0} and stats.budget == {"m": 100, "n": 50}
                assert stats.hits == 1 and stats.misses == 1
                assert stats.broker_used == {"m": 40, "n": 0}
                assert await cache.invalidate("a")
                assert plugin.released == ["a"]
                await until(lambda: used(daemon) == 0)
                held = await cache.acquire("b", load=value("B"), size={"m": 10})
                report = await broker.clear()
                assert report.entries == 0  # b is leased: released when its lease ends
                await held.release()
                await until(lambda: plugin.released == ["a", "b"] and used(daemon) == 0)
        await until(lambda: used(daemon) == 0 and not daemon.connections)


async def test_a_process_idle_entry_is_released_in_that_process_for_another_process() -> None:
    async with serving() as daemon:
        async with Broker.connect(daemon.address) as one, Broker.connect(daemon.address) as two:
            first, second = Plugin(), Plugin()
            async with one.cache("w", first) as c1, two.cache("w", second) as c2:
                async with c1.acquire("a", load=value("A"), size=60):
                    pass
                async with c2.acquire("b", load=value("B"), size=60) as lease:
                    assert lease.value == "B"
                    assert first.released == ["a"]  # freed in its own process first
                    assert used(daemon) == 60
                    assert (await one.stats()).used == {"m": 0}
                # The daemon's listing names each process's entries.
                await until(lambda: [e["leases"] for e in daemon.listing()["entries"]] == [0])
                (entry,) = daemon.listing()["entries"]
                assert (entry["cache"], entry["key"], entry["state"]) == ("w", "'b'", "ready")


async def test_a_victim_leased_again_before_the_request_arrives_is_refused_and_another_goes() -> (
    None
):
    async with serving() as daemon:
        async with Broker.connect(daemon.address) as one, Broker.connect(daemon.address) as two:
            async with one.cache("w", Plugin()) as c1, two.cache("w", Plugin()) as c2:
                for key in ("x", "y"):
                    async with c1.acquire(key, load=value(key), size=40):
                        pass
                await until(lambda: [e["leases"] for e in daemon.listing()["entries"]] == [0, 0])
                # Hold back the first release request the process receives.
                link = link_of(one)
                assert link is not None
                asked: list[int] = []
                arrived = anyio.Event()
                give_up = link.give_up

                def hold(id: int) -> None:
                    if not asked:
                        asked.append(id)
                        arrived.set()
                    else:
                        give_up(id)

                link.give_up = hold  # type: ignore[method-assign]
                async with anyio.create_task_group() as tg:
                    got: list[Any] = []

                    async def request() -> None:
                        async with c2.acquire("z", load=value("Z"), size=40) as lease:
                            got.append(lease.value)

                    tg.start_soon(request)
                    await arrived.wait()
                    assert link.by_id[asked[0]].key == "x"  # least recently used
                    # Meanwhile the process leases x again: its report refuses the release.
                    lease = await c1.acquire("x", load=value("again"), size=40)
                    await until(lambda: got == ["Z"])
                    give_up(asked[0])  # the request arrives late: x is in use
                    assert lease.value == "x"
                    await lease.release()
                entries = {(e["key"], e["state"]) for e in daemon.listing()["entries"]}
                assert ("'y'", "ready") not in entries and ("'x'", "ready") in entries
                assert used(daemon) == 80
                daemon.runner.core.check()


async def test_errors_from_the_daemon_name_the_cache_and_key_and_are_the_brokers_own() -> None:
    async with serving() as daemon:
        async with Broker.connect(daemon.address) as broker:
            async with broker.cache("speech", Plugin()) as cache:
                with pytest.raises(RequestTooLarge) as too_large:
                    await cache.acquire("huge", load=value(1), size=1000)
                assert too_large.value.entry == "speech:'huge'"
                assert "speech:'huge'" in str(too_large.value) and "@" not in str(too_large.value)
                outcome: list[BaseException] = []

                async def wait_for_b() -> None:  # (another task: no deadlock)
                    try:
                        await cache.acquire("b", load=value(2), size=80, timeout=0.05)
                    except AcquireTimeout as exc:
                        outcome.append(exc)

                async with cache.acquire("a", load=value(1), size=80):
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(wait_for_b)
                (timed_out,) = outcome
                assert isinstance(timed_out, AcquireTimeout)
                assert timed_out.waiting_for == "space"
                assert daemon.address in str(timed_out)
                await until(lambda: not daemon.runner.core.queue)
                assert used(daemon) == 80

                async def broken() -> Any:
                    raise ValueError("no weights")

                with pytest.raises(ValueError, match="no weights"):
                    await cache.acquire("c", load=broken, size=10)
                await until(lambda: used(daemon) == 80)
                daemon.runner.core.check()


async def test_a_cancelled_request_leaves_nothing_in_the_daemons_books() -> None:
    async with serving() as daemon:
        async with Broker.connect(daemon.address) as broker:
            async with broker.cache("w", Plugin()) as cache:
                held = await cache.acquire("a", load=value(1), size=90)

                async def give_up_on_b() -> None:  # (another task: no deadlock)
                    with anyio.move_on_after(0.05):
                        await cache.acquire("b", load=value(2), size=50)

                async with anyio.create_task_group() as tg:
                    tg.start_soon(give_up_on_b)
                await until(lambda: not daemon.runner.core.queue)
                await held.release()
                async with cache.acquire("b", load=value(2), size=50) as lease:
                    assert lease.value == 2
                await until(lambda: used(daemon) == 50)
                daemon.runner.core.check()


async def test_sizes_measured_in_the_process_are_the_daemons_charge() -> None:
    async with serving() as daemon:
        async with Broker.connect(daemon.address) as broker:
            async with broker.cache("w", Plugin()) as cache:
                async with cache.acquire("a", load=value(b"x" * 30), size=len) as lease:
                    assert lease.value == b"x" * 30
                    await until(lambda: used(daemon) == 30)
                # Measured larger than declared: the daemon evicts for the difference.
                async with cache.acquire("b", load=value(b"y" * 60), size=10, measure=len):
                    await until(lambda: used(daemon) == 90)
                async with cache.acquire("c", load=value(b"z" * 20), size=len):
                    await until(lambda: used(daemon) <= 100 and "a" not in cache._entries)
                daemon.runner.core.check()


async def test_a_pinned_entry_is_never_the_daemons_victim() -> None:
    async with serving() as daemon:
        async with Broker.connect(daemon.address) as one, Broker.connect(daemon.address) as two:
            async with one.cache("w", Plugin()) as c1, two.cache("w", Plugin()) as c2:
                async with c1.acquire("a", load=value(1), size=60, pin=True):
                    pass
                with pytest.raises(AcquireTimeout):
                    await c2.acquire("b", load=value(2), size=60, timeout=0.1)
                await c1.unpin("a")
                async with c2.acquire("b", load=value(2), size=60, timeout=5):
                    pass


async def test_a_process_that_disconnects_frees_its_bytes_and_others_are_granted() -> None:
    async with serving() as daemon:
        async with Broker.connect(daemon.address) as two:
            async with two.cache("w", Plugin()) as c2:
                one = Broker.connect(daemon.address, reconnect=False)
                await one.__aenter__()
                async with one.cache("w", Plugin()) as c1:
                    held = await c1.acquire("a", load=value(1), size=90)
                    async with anyio.create_task_group() as tg:
                        got: list[Any] = []

                        async def request() -> None:
                            async with c2.acquire("b", load=value(2), size=50) as lease:
                                got.append(lease.value)

                        tg.start_soon(request)
                        await until(lambda: bool(daemon.runner.core.queue))
                        # The process goes: its connection ends under it.
                        link = link_of(one)
                        assert link is not None and link.stream is not None
                        await link.stream.aclose()
                        await until(lambda: got == [2])
                    assert held.value == 1  # its lease still works here
                    with pytest.raises(BrokerClosed, match=daemon.address):
                        await c1.acquire("c", load=value(3), size=1)
                    await held.release()
                await one.__aexit__(None, None, None)
                assert used(daemon) == 50
                daemon.runner.core.check()


async def test_when_the_daemon_goes_held_leases_work_and_requests_raise_broker_closed() -> None:
    directory = tempfile.mkdtemp(prefix="cb-", dir="/tmp")
    address = os.path.join(directory, "s.sock")
    try:
        async with anyio.create_task_group() as tg:
            _daemon, scope = await stoppable(tg, address)
            async with Broker.connect(address, reconnect=False) as broker:
                async with broker.cache("w", Plugin()) as cache:
                    held = await cache.acquire("a", load=value("A"), size=10)
                    async with cache.acquire("b", load=value("B"), size=10):
                        pass
                    scope.cancel()
                    link = link_of(broker)
                    assert link is not None
                    await until(lambda: link.error is not None)
                    assert held.value == "A"
                    async with cache.acquire("b", load=value("other"), size=10) as hit:
                        assert hit.value == "B"  # loaded here: a hit needs no daemon
                    with pytest.raises(BrokerClosed, match=address):
                        await cache.acquire("c", load=value("C"), size=10)
                    await held.release()
            assert not os.path.exists(address)  # noqa: ASYNC240
        # Nobody answers now: connecting says so, naming the address.
        with pytest.raises(BrokerClosed, match=address):
            async with Broker.connect(address):
                pass
    finally:
        shutil.rmtree(directory, ignore_errors=True)


async def test_a_daemon_without_retention_has_each_entry_released_when_its_lease_ends() -> None:
    async with serving(budget={"m": 0}) as daemon:
        async with Broker.connect(daemon.address) as broker:
            plugin = Plugin()
            async with broker.cache("w", plugin) as cache:
                async with cache.acquire("a", load=value(1), size=0):
                    pass
                await until(lambda: plugin.released == ["a"])


async def test_from_env_connects_when_cachebroker_address_is_set() -> None:
    async with serving() as daemon:
        environ = {"CACHEBROKER_ADDRESS": daemon.address, "CACHEBROKER_BUDGET": "1GiB"}
        async with Broker.from_env(environ) as broker:
            assert isinstance(broker._runner.remote, LinkAdmission)
            assert broker._runner.budget == {"m": 100}
        with pytest.raises(InvalidArgument, match="budget"):
            Broker.from_env(environ, budget="2GiB")


async def test_a_load_abandoned_after_its_grant_returns_the_bytes() -> None:
    async with serving() as daemon:
        async with Broker.connect(daemon.address) as broker:
            async with broker.cache("w", Plugin()) as cache:
                started = anyio.Event()

                async def stuck() -> Any:
                    started.set()
                    await anyio.sleep_forever()

                # (given up once its load runs, whatever the machine's load: not on a timer)
                with anyio.CancelScope() as scope:
                    async with anyio.create_task_group() as tg:

                        async def ask() -> None:
                            await cache.acquire("a", load=stuck, size=50)

                        tg.start_soon(ask)
                        await started.wait()
                        assert used(daemon) == 50
                        scope.cancel()
                await until(lambda: used(daemon) == 0 and not daemon.listing()["entries"])
                daemon.runner.core.check()


def test_the_protocol_refuses_what_is_not_a_message() -> None:
    frame = wire.encode({"op": "ps"})
    assert frame[:4] == len(frame[4:]).to_bytes(4, "big")
    error = wire.decode_error(
        {"type": "RequestTooLarge", "space": "m", "size": 5, "budget": 1}, "x"
    )
    assert isinstance(error, RequestTooLarge) and error.size == 5
    unknown = wire.decode_error({"type": "SystemExit", "message": "m"}, "/s")
    assert type(unknown).__name__ == "BrokerError" and "/s" in str(unknown)
    assert isinstance(wire.decode_error("junk", "/s"), BrokerClosed)
    with pytest.raises(InvalidArgument):
        wire.resolve_address("")
    with pytest.raises(TypeError):
        wire.resolve_address(3)  # type: ignore[arg-type]


async def test_a_client_refuses_a_socket_served_by_another_user(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with serving() as daemon:
        monkeypatch.setattr(wire, "peer", lambda stream: (os.getuid() + 1, 1))
        with pytest.raises(BrokerClosed, match="served by user"):
            async with Broker.connect(daemon.address):
                pass
        monkeypatch.undo()
        async with Broker.connect(daemon.address) as broker:  # the daemon goes on
            async with broker.cache("w", Plugin()) as cache:
                async with cache.acquire("a", load=value(1), size=1) as lease:
                    assert lease.value == 1


async def test_a_release_never_acknowledged_is_quarantined_in_both_books_until_forgotten() -> None:
    async with serving(release_timeout=0.2) as daemon:
        async with Broker.connect(daemon.address) as one, Broker.connect(daemon.address) as two:
            stuck = Plugin()
            stuck.gate = anyio.Event()
            async with one.cache("w", stuck) as c1, two.cache("w", Plugin()) as c2:
                async with c1.acquire("a", load=value(1), size=60):
                    pass
                # b needs a's bytes; a's release hangs in its process, and times out:
                # it still runs, so b waits for it (within its own timeout), in vain;
                # those bytes come back through a late return, or forget().
                with pytest.raises(cachebroker.AcquireTimeout, match="still running"):
                    await c2.acquire("b", load=value(2), size=60, timeout=0.5)
                await until(
                    lambda: [e["state"] for e in daemon.listing()["entries"]] == ["quarantined"]
                )
                # The process's own release timeout quarantines it there too (its
                # watchdog started a moment after the daemon's).
                await until(lambda: one.stats_nowait().quarantined_keys == (("w", "a"),))
                assert used(daemon) == 60  # nobody knows whether a's memory came back
                assert await one.forget("w", "a") == 1
                await until(lambda: used(daemon) == 0)
                async with c2.acquire("b", load=value(2), size=60, timeout=5) as lease:
                    assert lease.value == 2
                stuck.gate.set()
                daemon.runner.core.check()


async def test_a_cache_closed_with_leases_outstanding_keeps_their_bytes_charged_everywhere() -> (
    None
):
    async with serving(release_timeout=0.1) as daemon:
        async with Broker.connect(daemon.address) as broker:
            block = broker.cache("w", Plugin())
            cache = await block.__aenter__()
            lease = await cache.acquire("a", load=value(1), size=30)
            with pytest.raises(cachebroker.LeasesOutstanding):
                await block.__aexit__(None, None, None)
            await until(
                lambda: [e["state"] for e in daemon.listing()["entries"]] == ["quarantined"]
            )
            assert used(daemon) == 30
            assert lease.value == 1
            await lease.release()
            assert await broker.forget("w", "a") == 1
            await until(lambda: used(daemon) == 0)


async def test_a_peer_that_breaks_the_protocol_loses_only_its_own_connection() -> None:
    async with serving() as daemon:
        async with Broker.connect(daemon.address) as broker:
            async with broker.cache("w", Plugin()) as cache:
                held = await cache.acquire("a", load=value(1), size=10)
                for garbage in (
                    wire.encode({"op": "hello", "version": wire.VERSION})
                    + wire.encode({"op": "acquire", "id": 1, "cache": "nope", "key": "k"}),
                    wire.encode({"op": "hello", "version": wire.VERSION})
                    + wire.encode({"op": "report", "id": "x", "state": "held"}),
                    wire.encode({"op": "hello", "version": 99}),
                    b"\xff\xff\xff\xff",
                    (5).to_bytes(4, "big") + b"[1,2]",
                ):
                    async with await anyio.connect_unix(daemon.address) as stream:
                        await stream.send(garbage)
                        with anyio.fail_after(5):
                            with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):
                                while await stream.receive():
                                    pass  # the daemon answers, then closes this connection
                async with cache.acquire("b", load=value(2), size=10) as lease:
                    assert lease.value == 2
                assert held.value == 1
                await held.release()
                await until(lambda: len(daemon.connections) == 1)


async def test_a_task_waiting_on_its_own_leases_gets_deadlock_error_as_in_process() -> None:
    async with serving() as daemon:
        async with Broker.connect(daemon.address) as broker:
            async with broker.cache("w", Plugin()) as cache:
                async with cache.acquire("a", load=value(1), size=60):
                    with pytest.raises(cachebroker.DeadlockError, match=r"w:'a'") as caught:
                        await cache.acquire("b", load=value(2), size=60)
                    assert "@" not in str(caught.value)
                    # Another task's lease is no deadlock: that request waits for it.
                    outcome: list[BaseException] = []

                    async def other() -> None:
                        try:
                            await cache.acquire("c", load=value(3), size=60, timeout=0.1)
                        except AcquireTimeout as exc:
                            outcome.append(exc)

                    async with anyio.create_task_group() as tg:
                        tg.start_soon(other)
                    assert [type(exc) for exc in outcome] == [AcquireTimeout]
                await until(lambda: used(daemon) == 60)
                daemon.runner.core.check()


async def test_ps_shows_pinned_entries_and_stats_follow_the_daemons_budget() -> None:
    async with serving() as daemon:
        async with Broker.connect(daemon.address) as broker:
            async with broker.cache("w", Plugin()) as cache:
                async with cache.acquire("a", load=value(1), size=10, pin=True):
                    pass
                await until(lambda: [e["pinned"] for e in daemon.listing()["entries"]] == [True])
                assert [e["leases"] for e in daemon.listing()["entries"]] == [
                    0
                ]  # pinned, not leased
                daemon.runner.core.set_capacity("m", 80)
                daemon.runner.apply()
                assert (await broker.stats()).budget == {"m": 80}


async def test_a_release_the_daemon_asked_for_is_answered_by_its_outcome_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with serving() as daemon:
        received: list[str] = []
        original = Connection.report

        def report(connection: Connection, message: dict[str, Any]) -> None:
            received.append(message["state"])
            original(connection, message)

        monkeypatch.setattr(Connection, "report", report)
        async with Broker.connect(daemon.address) as one, Broker.connect(daemon.address) as two:
            async with one.cache("w", Plugin()) as c1, two.cache("w", Plugin()) as c2:
                async with c1.acquire("a", load=value(1), size=60):
                    pass
                await until(lambda: received[-1:] == ["idle"])
                async with c2.acquire("b", load=value(2), size=60):
                    pass
                await until(lambda: used(daemon) == 60 and "gone" in received)
                # a went idle, then gone: no "releasing" between, since the daemon asked.
                assert "releasing" not in received


async def test_a_probed_space_in_the_daemon_follows_the_device_for_every_process() -> None:
    # The device: 100 bytes, of which what the processes' entries hold and what
    # "another program" takes are not free.
    other = [0]
    books: list[Any] = []  # (the daemon's, once it exists)

    def read() -> tuple[int, int]:
        held = books[0].spaces["gpu"].used if books else 0
        return 100, 100 - held - other[0]

    async with serving(budget={"gpu": Probe(read)}, memory_wait=None) as daemon:
        books.append(daemon.runner.core)
        async with Broker.connect(daemon.address) as one, Broker.connect(daemon.address) as two:
            first = Plugin()
            async with one.cache("w", first) as c1, two.cache("w", Plugin()) as c2:
                async with c1.acquire("a", load=value(1), size={"gpu": 60}):
                    pass
                other[0] = 30  # another program takes 30: a (idle) no longer fits beside b
                async with c2.acquire("b", load=value(2), size={"gpu": 40}) as lease:
                    assert lease.value == 2
                    assert first.released == ["a"]
                assert daemon.runner.core.spaces["gpu"].capacity == 70
                with pytest.raises(RequestTooLarge):
                    await c1.acquire("c", load=value(3), size={"gpu": 101})
                daemon.runner.core.check()
