"""A broker connected to a shared one (``Broker.connect``), daemon and clients in one event loop.

Each test runs a daemon (``cachebroker serve``'s ``Daemon``) and one or more
connected brokers in the test's own loop, on every backend, so that the
daemon's books can be read between steps. Then the attacks: races,
cancellation, hostile peers; the books must add up (``Core.check``), never
hold more than the budget once settled, and be empty once every client has
gone. Real processes are in ``test_processes.py``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import shutil
import tempfile
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

import cachebroker
from cachebroker import (
    AcquireTimeout,
    Broker,
    BrokerClosed,
    InvalidArgument,
    RequestTooLarge,
)
from cachebroker._core import FAIR_REQUESTS, Reason
from cachebroker._remote import _protocol as wire
from cachebroker._remote._admission import LinkAdmission
from cachebroker._remote._connection import Connection
from cachebroker._remote._daemon import Daemon
from cachebroker.probes import Probe
from tests.helpers import steps_until
from tests.remote.support import Plugin, link_of, serving, states, stoppable, until, used, value

pytestmark = pytest.mark.anyio


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

                def hold(id: int, reason: Reason = Reason.CAPACITY) -> None:
                    if not asked:
                        asked.append(id)
                        arrived.set()
                    else:
                        give_up(id, reason)

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


# == attacks ===================================================================
#
# Races, cancellation, hostile peers. The daemon's books are read between
# steps: they must add up (``Core.check``), never hold more than the budget once
# settled, and be empty once every client has gone.


def settled(daemon: Daemon) -> None:
    """The daemon's books add up, and hold no more than the budget."""
    core = daemon.runner.core
    core.check()
    for space in core.spaces.values():
        assert space.used <= space.limit, (space.name, space.used, space.limit)


def mirror_states(daemon: Daemon) -> list[str]:
    """What the daemon last heard of each entry, from every process."""
    return [m.state for c in daemon.connections.values() for m in c.mirrors.values()]


async def empty(daemon: Daemon) -> None:
    """Every client has gone: nothing is left in the daemon's books."""
    await until(lambda: not daemon.connections)
    await until(lambda: all(s.used == 0 for s in daemon.runner.core.spaces.values()))
    assert not list(daemon.runner.core.entries())
    daemon.runner.core.check()


async def test_a_value_measured_above_the_whole_budget_is_refused_and_released_as_in_process() -> (
    None
):
    async with serving() as daemon:
        with anyio.fail_after(10):
            async with Broker.connect(daemon.address) as broker:
                plugin = Plugin()
                async with broker.cache("w", plugin) as cache:
                    with pytest.raises(cachebroker.RequestTooLarge) as caught:
                        await cache.acquire("x", load=value(b"x" * 1000), size=len)
                    assert caught.value.entry == "w:'x'" and "@" not in str(caught.value)
                    await until(lambda: plugin.released == ["x"])
                    assert (await broker.stats()).used == {"m": 0}
                    await until(lambda: used(daemon) == 0 and not daemon.listing()["entries"])
                    settled(daemon)
                    # Declared above the budget: refused before it loads, here too.
                    with pytest.raises(cachebroker.RequestTooLarge, match=r"w:'y'"):
                        await cache.acquire("y", load=value(1), size=1000)
            await empty(daemon)


async def test_a_value_measured_above_the_budget_keeps_its_bytes_charged_until_released() -> None:
    async with serving() as daemon:
        with anyio.fail_after(10):
            async with Broker.connect(daemon.address) as one, Broker.connect(daemon.address) as two:
                slow = Plugin()
                slow.gate = anyio.Event()
                async with one.cache("w", slow) as c1, two.cache("w", Plugin()) as c2:
                    with pytest.raises(cachebroker.RequestTooLarge):
                        await c1.acquire("x", load=value(b"x" * 1000), size=len)
                    # Measured there, and said so: its memory is still taken until
                    # its releaser returns, and nobody else is granted meanwhile.
                    await until(lambda: used(daemon) == 1000)
                    with pytest.raises(cachebroker.AcquireTimeout):
                        await c2.acquire("y", load=value(2), size=50, timeout=0.2)
                    assert used(daemon) == 1000
                    daemon.runner.core.check()
                    slow.gate.set()
                    async with c2.acquire("y", load=value(2), size=50, timeout=5) as lease:
                        assert lease.value == 2
                    settled(daemon)
            await empty(daemon)


async def test_a_cache_closed_and_opened_again_and_again_keeps_its_connection() -> None:
    async with serving(release_timeout=0.05) as daemon:
        with anyio.fail_after(10):
            async with Broker.connect(daemon.address) as broker:
                kept = []
                for round in range(12):
                    block = broker.cache("w", Plugin())
                    cache = await block.__aenter__()
                    if round in (1, 2):  # closed with a lease held: quarantined, its name kept
                        kept.append(await cache.acquire("x", load=value(round), size=5))
                        with pytest.raises(cachebroker.LeasesOutstanding):
                            await block.__aexit__(None, None, None)
                    else:
                        await block.__aexit__(None, None, None)
                async with broker.cache("w", Plugin()) as cache:
                    async with cache.acquire("x", load=value("last"), size=10) as lease:
                        assert lease.value == "last"
                    (connection,) = daemon.connections.values()
                    # The names of caches closed for good are not kept for the connection's life.
                    await until(lambda: len(connection.opened) == 1 + len(kept))
                    assert len(daemon.names) == len(connection.opened)  # each its own name
                    await until(lambda: used(daemon) == 10 + 5 * len(kept))
                    settled(daemon)
                for lease in kept:
                    await lease.release()
                assert await broker.forget("w", "x") == len(kept)
                await until(lambda: used(daemon) == 0)
                settled(daemon)
            await empty(daemon)


@pytest.mark.parametrize("case", ["one-task", "overlapping", "beside-a-pinned-entry"])
async def test_a_request_waiting_for_another_process_s_busy_entry_is_not_starved(
    case: str,
) -> None:
    # Process one leases x again and again, with no await between one lease's end
    # and the next hit (or with leases that overlap): the daemon never sees x
    # idle. In-process, the waiter gets x's bytes at its first lease end (or,
    # with overlapping leases, once FAIR_REQUESTS requests were served); here
    # too, not once the loop is over. A pinned entry, leased or not, is never
    # what the waiter waits for.
    # (Bounds in rounds of the busy loop, not in time: a few round trips between
    # the processes and the daemon take a few rounds, more on a loaded machine.)
    overlapping = case == "overlapping"
    limit = 4 * FAIR_REQUESTS if overlapping else FAIR_REQUESTS
    size = 50 if case == "beside-a-pinned-entry" else 60
    async with serving() as daemon:
        async with Broker.connect(daemon.address) as one, Broker.connect(daemon.address) as two:
            async with one.cache("w", Plugin()) as c1, two.cache("w", Plugin()) as c2:
                pinned = None
                if case == "beside-a-pinned-entry":
                    pinned = await c1.acquire("p", load=value("P"), size=50, pin=True)
                async with c1.acquire("x", load=value("X"), size=size):
                    pass
                pins = 0 if pinned is None else 1  # (pinned in the daemon, not leased)
                await until(
                    lambda: (
                        [
                            sum(e[what] for e in daemon.listing()["entries"])
                            for what in ("leases", "pinned")
                        ]
                        == [0, pins]
                    )
                )
                got: list[str] = []
                rounds = [0]

                async def busy(pause: float) -> None:
                    while not got and rounds[0] < limit:
                        rounds[0] += 1
                        async with c1.acquire("x", load=value("X"), size=size, timeout=5):
                            await anyio.sleep(pause)

                async def other() -> None:
                    async with c2.acquire("z", load=value("Z"), size=size) as lease:
                        got.append(lease.value)

                try:
                    with anyio.fail_after(10):
                        async with anyio.create_task_group() as tg:
                            tg.start_soon(busy, 0.001)
                            if overlapping:
                                await anyio.sleep(0.0005)
                                tg.start_soon(busy, 0.0015)
                            await anyio.sleep(0.01)
                            tg.start_soon(other)
                    assert got == ["Z"]
                    assert rounds[0] < limit  # served while x was still in use
                    settled(daemon)
                finally:
                    if pinned is not None:
                        assert pinned.value == "P"
                        await pinned.release()
        await empty(daemon)


# ------------------------------------------------------------------ hostile peers

_HUGE = {"m": 10**30}


def _acquire(id: int, need: int, **fields: Any) -> dict[str, Any]:
    return {"op": "acquire", "id": id, "cache": "h", "key": f"k{id}", "need": {"m": need}, **fields}


#: Valid-looking messages a peer has no business sending, and whether the daemon
#: closes its connection for them. ``"grant"`` waits for the daemon's grant.
HOSTILE: dict[str, tuple[bool, list[Any]]] = {
    "a report before the grant": (
        True,
        [_acquire(1, 99), {"op": "report", "id": 1, "state": "held", "charge": {"m": 50}}],
    ),
    "a charge above the whole budget, held": (
        True,
        [_acquire(1, 10), "grant", {"op": "report", "id": 1, "state": "held", "charge": _HUGE}],
    ),
    "a charge in a space the daemon has not": (
        True,
        [_acquire(1, 10), "grant", {"op": "report", "id": 1, "state": "idle", "charge": {"z": 5}}],
    ),
    "a priority that is no int": (
        True,
        [_acquire(1, 10), "grant", {"op": "report", "id": 1, "state": "idle", "priority": "9"}],
    ),
    "a priority of true": (
        True,
        [_acquire(1, 10), "grant", {"op": "report", "id": 1, "state": "idle", "priority": True}],
    ),
    "priorities changed, with the state as told and at once": (
        False,
        [
            _acquire(1, 10),
            "grant",
            {"op": "report", "id": 1, "state": "held", "charge": {"m": 10}, "priority": 3},
            {"op": "report", "id": 1, "state": "held", "priority": -(10**20)},
            {"op": "report", "id": 1, "state": "idle", "priority": 10**20},
            {"op": "report", "id": 1, "state": "gone", "priority": 0},
        ],
    ),
    "an id acquired twice": (True, [_acquire(1, 10), _acquire(1, 10)]),
    "a need above the whole budget": (False, [_acquire(1, 10**40)]),
    "holding its own id, and ids it never had": (False, [_acquire(1, 10, holding=[1, 7, -3])]),
    "reports of ids it never acquired": (
        False,
        [{"op": "report", "id": 1, "state": "gone"}, {"op": "cancel", "id": 1}],
    ),
    "held again after quarantined, releasing and gone": (
        False,
        [
            _acquire(1, 10),
            "grant",
            {"op": "report", "id": 1, "state": "held", "charge": {"m": 10}},
            {"op": "report", "id": 1, "state": "quarantined"},
            {"op": "report", "id": 1, "state": "held"},
            {"op": "report", "id": 1, "state": "idle"},
            _acquire(2, 10),
            "grant",
            {"op": "report", "id": 2, "state": "held", "charge": {"m": 10}},
            {"op": "report", "id": 2, "state": "releasing"},
            {"op": "report", "id": 2, "state": "held"},
            {"op": "report", "id": 2, "state": "gone"},
            {"op": "report", "id": 2, "state": "held"},
            {"op": "cancel", "id": 1},
        ],
    ),
    "a cache closed with requests and leases, then opened again": (
        False,
        [
            _acquire(1, 10),
            "grant",
            {"op": "report", "id": 1, "state": "held", "charge": {"m": 10}},
            _acquire(2, 90),
            {"op": "close", "cache": "h"},
            {"op": "open", "cache": "h"},
            _acquire(3, 10),
        ],
    ),
}


async def test_a_hostile_peer_loses_its_connection_and_never_the_daemons_books() -> None:
    async with serving(release_timeout=0.2) as daemon:
        async with Broker.connect(daemon.address) as good:
            async with good.cache("w", Plugin()) as cache:
                held = await cache.acquire("a", load=value(1), size=5)
                await until(lambda: used(daemon) == 5)
                for name, (closed, messages) in HOSTILE.items():
                    stream = await anyio.connect_unix(daemon.address)
                    reader = BufferedByteReceiveStream(stream)
                    await wire.send(stream, {"op": "hello", "version": wire.VERSION, "pid": 1})
                    await wire.send(stream, {"op": "open", "cache": "h"})
                    assert (await wire.receive(reader))["op"] == "welcome"
                    ended = False
                    for message in messages:
                        try:
                            if message == "grant":
                                with anyio.fail_after(5):
                                    while (await wire.receive(reader))["op"] != "grant":
                                        pass
                            else:
                                await wire.send(stream, message)
                                await until(lambda: True)  # (a turn for the daemon)
                        except (anyio.EndOfStream, anyio.IncompleteRead, OSError):
                            ended = True
                            break
                        settled(daemon)
                    if not ended:
                        await anyio.sleep(0.05)
                    assert (len(daemon.connections) == 1) is closed, name
                    settled(daemon)
                    # The well-behaved process goes on, whatever the other one did.
                    async with cache.acquire("b", load=value(2), size=5, timeout=5) as lease:
                        assert lease.value == 2, name
                    await stream.aclose()
                    await until(lambda: len(daemon.connections) == 1)
                    await until(lambda: used(daemon) in (5, 10))  # a, and b (idle) if kept
                    settled(daemon)
                await held.release()
        await empty(daemon)


async def test_a_release_timed_out_here_but_refused_there_is_asked_again_when_idle() -> None:
    # The process's loop was busy past the daemon's release timeout: the daemon
    # quarantined x; then the process answered "held" (it had leased x). Its
    # bytes must not stay written off while the process keeps x as an ordinary
    # entry, which forget() there cannot touch.
    async with serving(release_timeout=0.2) as daemon:
        async with Broker.connect(daemon.address) as one, Broker.connect(daemon.address) as two:
            first = Plugin()
            async with one.cache("w", first) as c1, two.cache("w", Plugin()) as c2:
                async with c1.acquire("x", load=value("X"), size=60):
                    pass
                await until(lambda: [e["leases"] for e in daemon.listing()["entries"]] == [0])
                link = link_of(one)
                assert link is not None
                asked: list[int] = []

                def hold_back(id: int, reason: Reason = Reason.CAPACITY) -> None:
                    asked.append(id)

                link.give_up = hold_back  # type: ignore[method-assign]
                # Past the daemon's release timeout, x's release may still be answered:
                # a request for its room waits for it, within its own timeout.
                with pytest.raises(cachebroker.AcquireTimeout):
                    await c2.acquire("z", load=value("Z"), size=60, timeout=0.5)
                await until(lambda: states(daemon) == ["quarantined"])  # (z withdrawn)
                lease = await c1.acquire("x", load=value("other"), size=60)  # (a hit)
                await until(lambda: mirror_states(daemon) == ["held"])
                del link.give_up
                link.give_up(asked[0])  # the request, read at last: x is in use
                assert lease.value == "X"
                assert await one.forget("w", "x") == 0  # nothing quarantined there
                await lease.release()
                await until(lambda: first.released == ["x"] and used(daemon) == 0)
                async with c2.acquire("z", load=value("Z"), size=60, timeout=5) as got:
                    assert got.value == "Z"
                settled(daemon)
        await empty(daemon)


async def test_a_deadlock_across_caches_names_the_leases_as_in_process() -> None:
    async def attempt(broker: Broker) -> cachebroker.DeadlockError:
        async with broker.cache("v", Plugin()) as v, broker.cache("w", Plugin()) as w:
            async with v.acquire("a", load=value(1), size=60):
                with pytest.raises(cachebroker.DeadlockError) as caught:
                    await w.acquire(("b", 2), load=value(2), size=60)
        return caught.value

    async with Broker({"m": 100}) as broker:
        expected = await attempt(broker)
    async with serving() as daemon:
        async with Broker.connect(daemon.address) as broker:
            error = await attempt(broker)
        await empty(daemon)
    assert str(error) == str(expected)
    assert error.leases == expected.leases == (("v", "a"),)


async def test_a_daemon_gone_mid_grant_mid_load_and_mid_release_then_served_again() -> None:
    directory = tempfile.mkdtemp(prefix="cb-", dir="/tmp")
    address = os.path.join(directory, "s.sock")
    try:
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                daemon, scope = await stoppable(tg, address)
                slow = Plugin()
                slow.gate = anyio.Event()
                loading = anyio.Event()
                finish = anyio.Event()

                async def load() -> str:
                    loading.set()
                    await finish.wait()
                    return "L"

                async with (
                    Broker.connect(address, reconnect=False) as one,
                    Broker.connect(address, reconnect=False) as two,
                ):
                    async with one.cache("w", slow) as c1, two.cache("w", Plugin()) as c2:
                        async with c1.acquire("idle", load=value("I"), size=40):
                            pass
                        held = await c2.acquire("held", load=value("H"), size=30)
                        outcomes: dict[str, Any] = {}

                        async def ask(cache: Any, key: str, size: int, **kw: Any) -> None:
                            try:
                                async with cache.acquire(key, size=size, **kw) as lease:
                                    outcomes[key] = lease.value
                            except cachebroker.BrokerError as exc:
                                outcomes[key] = exc

                        async with anyio.create_task_group() as inner:
                            inner.start_soon(functools.partial(ask, c2, "loading", 20, load=load))
                            await loading.wait()  # granted: 90 of 100 taken
                            # evicts "idle", whose releaser hangs: a release in flight
                            inner.start_soon(
                                functools.partial(ask, c2, "evicting", 40, load=value(1))
                            )
                            await until(lambda: states(daemon).count("releasing") == 1)
                            inner.start_soon(
                                functools.partial(ask, c1, "waiting", 90, load=value(2))
                            )
                            await until(lambda: len(daemon.runner.core.queue) == 2)
                            scope.cancel()  # the daemon goes
                            await until(lambda: len(outcomes) == 2)
                            finish.set()
                            slow.gate.set()
                        assert isinstance(outcomes["evicting"], cachebroker.BrokerClosed)
                        assert isinstance(outcomes["waiting"], cachebroker.BrokerClosed)
                        assert outcomes["loading"] == "L"  # loaded here, granted before
                        assert held.value == "H"
                        await held.release()
                        await until(lambda: slow.released == ["idle"])
            assert not os.path.exists(address)  # noqa: ASYNC240
            # A new daemon at the same address serves new connections.
            async with serving(budget={"m": 100}) as again:
                async with Broker.connect(again.address) as broker:
                    async with broker.cache("w", Plugin()) as cache:
                        async with cache.acquire("x", load=value("X"), size=100) as lease:
                            assert lease.value == "X"
                await empty(again)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


class _Unfreeing(Plugin):
    """A releaser that always raises: its entries are quarantined."""

    async def release(self, key: Any, value: Any) -> None:
        raise RuntimeError("cannot free")


async def test_a_value_the_daemon_cannot_fit_beside_quarantined_bytes_stays_on_its_books() -> None:
    # Measured after its load (its size unknown before), x fits the budget but not
    # beside the bytes of a failed release: the daemon refuses it, though the
    # process has already handed it out. Its bytes must stay on the daemon's
    # books while the process holds it, and follow it out.
    async with serving() as daemon:
        async with Broker.connect(daemon.address) as one, Broker.connect(daemon.address) as two:
            first = Plugin()
            async with one.cache("w", first) as c1, two.cache("q", _Unfreeing()) as c2:
                async with c2.acquire("q", load=value("Q"), size=80):
                    pass
                assert await c2.invalidate("q")
                await until(lambda: states(daemon) == ["quarantined"])
                async with c1.acquire("x", load=value(b"x" * 30), size=len) as lease:
                    assert lease.value == b"x" * 30
                    await until(lambda: used(daemon) == 110)
                    daemon.runner.core.check()
                await until(lambda: first.released == ["x"])
                await until(lambda: used(daemon) == 80)
                daemon.runner.core.check()
                assert await two.forget("q", "q") == 1
                await until(lambda: used(daemon) == 0)
                settled(daemon)
        await empty(daemon)


async def test_a_value_refused_beside_quarantined_bytes_is_released_there_as_rejected() -> None:
    """Measured after its load, x does not fit beside a failed release's bytes: the
    daemon's ``load_done`` fails its requester and starts its release (``rejected``)
    in one step. The ``release`` it posts in that step (``Elsewhere.releasing``) comes
    before the watcher that sets the mirror's entry (``_refused``): it must still say
    why, so that the process counts the release as rejected."""

    async with serving() as daemon:
        async with Broker.connect(daemon.address) as one, Broker.connect(daemon.address) as two:
            first = Plugin()
            async with one.cache("w", first) as c1, two.cache("q", _Unfreeing()) as c2:
                async with c2.acquire("q", load=value("Q"), size=80):
                    pass
                assert await c2.invalidate("q")
                await until(lambda: bool(daemon.runner.core.quarantined))
                async with c1.acquire("x", load=value(b"x" * 30), size=len) as lease:
                    assert lease.value == b"x" * 30
                await until(lambda: first.released == ["x"])
                stats = await one.stats()
                assert stats.releases.get("rejected") == 1, stats.releases
                assert await two.forget("q", "q") == 1
                await until(lambda: used(daemon) == 0)
                daemon.runner.core.check()


async def test_concurrent_stats_each_get_the_daemons_totals_without_waiting_out_a_timeout() -> None:
    async with serving() as daemon:
        async with Broker.connect(daemon.address) as broker:
            async with broker.cache("w", Plugin()) as cache:
                async with cache.acquire("a", load=value(1), size=30):
                    results: list[Any] = []

                    async def stats() -> None:
                        results.append((await broker.stats()).broker_used)

                    # (a bound well under the 5 s a reply nobody wakes for would take)
                    with anyio.fail_after(2):
                        async with anyio.create_task_group() as tg:
                            for _ in range(3):
                                tg.start_soon(stats)
                    assert results == [{"m": 30}] * 3
        await empty(daemon)


class _Flaky:
    """A releaser that sometimes raises, and sometimes takes a moment."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    async def release(self, key: Any, value: Any) -> None:
        if self.rng.random() < 0.15:
            raise RuntimeError("cannot free")
        await anyio.sleep(self.rng.choice([0, 0, 0.001]))


async def test_churn_and_cancellation_everywhere_leave_the_daemon_holding_what_processes_do() -> (
    None
):
    # Tasks of two processes acquire, measure, pin, invalidate, time out and are
    # cancelled at random points, loaders fail, releasers fail: the daemon's
    # books add up at every moment, and once all is quiet they hold what the
    # processes hold, nothing more.
    rng = random.Random(7)
    async with serving(release_timeout=0.5) as daemon:
        quiet = anyio.Event()

        async def watch() -> None:
            while not quiet.is_set():
                daemon.runner.core.check()
                await anyio.sleep(0.002)

        async with anyio.create_task_group() as watching:
            watching.start_soon(watch)
            async with Broker.connect(daemon.address) as one, Broker.connect(daemon.address) as two:
                async with (
                    one.cache("w", _Flaky(rng)) as c1,
                    two.cache("w", _Flaky(rng)) as c2,
                    one.cache("v", _Flaky(rng)) as c3,
                ):
                    caches = [c1, c2, c3]

                    async def load() -> bytes:
                        await anyio.sleep(rng.choice([0, 0.001, 0.003]))
                        if rng.random() < 0.05:
                            raise ValueError("no weights")
                        return b"x" * rng.choice([5, 10, 25, 40])

                    async def worker() -> None:
                        for _ in range(30):
                            cache, key = rng.choice(caches), rng.randrange(6)
                            if rng.random() < 0.1:
                                await cache.invalidate(key)
                                continue
                            size: Any = rng.choice([10, 20, 30, 45, 60, len])
                            options: dict[str, Any] = {
                                "pin": rng.random() < 0.1,
                                "idle_ttl": rng.choice([None, None, 0, 0.005]),
                                "timeout": rng.choice([None, 0.02, 0.2]),
                            }
                            if size is not len and rng.random() < 0.3:
                                options["measure"] = len
                            try:
                                with anyio.move_on_after(rng.choice([0.001, 0.01, 0.05, 0.2])):
                                    async with cache.acquire(key, load=load, size=size, **options):
                                        await anyio.sleep(rng.choice([0, 0.001, 0.005]))
                            except (cachebroker.BrokerError, ValueError):
                                pass

                    with anyio.fail_after(20):
                        async with anyio.create_task_group() as tg:
                            for _ in range(6):
                                tg.start_soon(worker)
                    for cache in caches:
                        for number in range(6):
                            await cache.unpin(number)
                    for broker in (one, two):
                        for name, key in (await broker.stats()).quarantined_keys:
                            await broker.forget(name, key)

                    async def agree() -> bool:
                        held = [(await b.stats()).used["m"] for b in (one, two)]
                        return used(daemon) == sum(held)

                    with anyio.fail_after(5):
                        while not await agree():
                            await anyio.sleep(0.01)
                    settled(daemon)
            quiet.set()
        await empty(daemon)


async def test_a_release_refused_then_idle_again_in_one_batch_is_asked_again() -> None:
    """The daemon asks for x's release; the process, which leased x meanwhile, refuses
    it, and its lease ends before the daemon reads the refusal: "held" and "idle" arrive
    in one batch. The daemon must ask again (the process will not release x unasked),
    not wait for a "gone" that never comes until its release timeout quarantines x."""
    async with serving(release_timeout=30) as daemon:
        stream = await anyio.connect_unix(daemon.address)
        reader = BufferedByteReceiveStream(stream)

        async def next_op(op: str) -> dict[str, Any]:
            with anyio.fail_after(5):
                while (message := await wire.receive(reader))["op"] != op:
                    pass
            return message

        await wire.send(
            stream,
            {"op": "hello", "version": wire.VERSION, "pid": 1},
            {"op": "open", "cache": "h"},
            _acquire(1, 60),
        )
        await next_op("grant")
        await wire.send(stream, {"op": "report", "id": 1, "state": "idle", "charge": {"m": 60}})
        async with Broker.connect(daemon.address) as other, other.cache("w", Plugin()) as cache:
            async with anyio.create_task_group() as tg:
                got: list[Any] = []

                async def want_room() -> None:
                    async with cache.acquire("y", load=value(2), size=50, timeout=10) as lease:
                        got.append(lease.value)

                tg.start_soon(want_room)
                assert (await next_op("release"))["id"] == 1
                # Refused (held when asked), and idle again, read in one step: the
                # daemon's release task sees only the last state, "idle".
                (peer,) = (c for c in daemon.connections.values() if "h" in c.caches)
                peer.report({"op": "report", "id": 1, "state": "held"})
                peer.report({"op": "report", "id": 1, "state": "idle"})
                assert (await next_op("release"))["id"] == 1  # asked again
                await wire.send(stream, {"op": "report", "id": 1, "state": "gone"})
            assert got == [2]
        await stream.aclose()
        await until(lambda: not daemon.connections)
        settled(daemon)


async def test_stats_of_a_closed_connected_broker_do_not_wait_for_the_daemon() -> None:
    """Once closed, a connected broker's ``stats()`` has no daemon to ask: it answers at
    once (within a few loop steps, not a wait for an answer that cannot come), with
    ``broker_used`` unknown, and its own counters as they were."""
    async with serving() as daemon:
        async with Broker.connect(daemon.address) as broker, broker.cache("c", Plugin()) as c:
            async with c.acquire("a", load=value("A"), size=10):
                pass
        got: list[Any] = []

        async def ask() -> None:
            got.append(await broker.stats())

        async with anyio.create_task_group() as tg:
            tg.start_soon(ask)
            assert await steps_until(lambda: bool(got), steps=50)
        assert got[0].broker_used is None
        assert (got[0].misses, got[0].loads) == (1, 1)
