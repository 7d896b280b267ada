"""Several real processes, one shared broker (``cachebroker serve``, ``Broker.connect``).

The clients are subprocesses running ``tests/remote/process_client.py`` (each on one
of the three backends in turn), reporting what they do as JSON lines. The
daemon runs as ``cachebroker serve`` in a subprocess where a test is about
processes (kill -9, stopping it, the CLI), and in the test's own event loop
(``serving``) where a test checks its books. Every wait is bounded by
``anyio.fail_after``; every subprocess is killed when its test ends.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import stat
import sys
from collections import Counter
from collections.abc import (
    Awaitable,
    Callable,
    Hashable,
    Mapping,
    MutableMapping,
)
from typing import Any

import anyio
import anyio.abc
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

from cachebroker import Broker, BrokerClosed, format_bytes
from cachebroker import _log_events as ev
from cachebroker._core import Reason
from cachebroker._remote import _client
from cachebroker._remote import _protocol as wire
from cachebroker._remote._admission import LinkAdmission
from cachebroker._remote._daemon import Daemon
from tests.helpers import loader, wait_until
from tests.remote.processes import (
    ENV,
    Line,
    Procs,
    check_books,
    frame,
    one_backend,
    serving,
)

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(
        not sys.platform.startswith("linux"), reason="Unix sockets with SO_PEERCRED, /proc"
    ),
]


def by_pid(daemon: Daemon) -> dict[int, Counter[str]]:
    """The bytes the daemon's books charge to each process, per space."""
    charged: dict[int, Counter[str]] = {}
    for entry in daemon.listing()["entries"]:
        charged.setdefault(entry["pid"], Counter()).update(entry["charge"])
    return charged


# ------------------------------------------------------------------ several processes

RANDOM_BUDGET = {"a": 100, "b": 60}


def replay_loads(lines: list[Line], budget: Mapping[str, int]) -> Counter[str]:
    """Order every process's load and free lines by time; check the bytes loaded at once.

    A loader starts only after the daemon granted its bytes, and a process
    logs ``freed`` (or ``unload``) before it tells the daemon, so at every
    point of this one timeline the bytes loaded and not yet freed must fit.
    Returns what is still loaded at the end.
    """
    loaded: Counter[str] = Counter()
    for line in sorted(lines, key=lambda line: line["t"]):
        sign = 1 if line["event"] == "load" else -1
        for space, amount in line["bytes"].items():
            loaded[space] += sign * amount
            assert 0 <= loaded[space] <= budget[space], (line, dict(loaded))
    return loaded


async def test_random_acquires_of_three_processes_share_one_budget(procs: Procs) -> None:
    """Invariant: the daemon's books add up and stay within budget at every sample; the
    bytes loaded across the processes never exceed it; when the processes are idle the
    books charge each exactly what it holds, and nothing once they closed."""
    with anyio.fail_after(60):
        async with serving(procs.socket, RANDOM_BUDGET) as daemon:
            samples = 0
            stop = anyio.Event()

            async def sample() -> None:
                nonlocal samples
                while not stop.is_set():
                    check_books(daemon)
                    samples += 1
                    await anyio.sleep(0.002)

            async with anyio.create_task_group() as tg:
                tg.start_soon(sample)
                clients = [
                    procs.client(
                        f"random{seed}",
                        {"mode": "random", "seed": seed, "ops": 150, "workers": 3, "keys": 8},
                    )
                    for seed in range(3)
                ]
                done = [await client.wait_for("done") for client in clients]
                stop.set()
            for line in done:
                outcomes = line["outcomes"]
                assert set(outcomes) <= {"held", "timeout", "cancelled", "failed"}, outcomes
                assert sum(outcomes.values()) == 150
            assert samples > 10

            # Idle, every one: the books charge each process what it holds.
            procs.signal("report")
            holding = {c.pid: await c.wait_for("holding") for c in clients}
            check_books(daemon)
            charged = by_pid(daemon)
            for pid, line in holding.items():
                assert line["leased"] == 0
                assert charged.get(pid, Counter()) == Counter(line["used"]), (pid, line)
            totals = daemon.totals()["used"]
            assert totals == {
                s: sum(line["used"].get(s, 0) for line in holding.values()) for s in totals
            }
            assert all(
                e["state"] == "ready" and e["leases"] == 0 for e in daemon.listing()["entries"]
            )

            procs.signal("close")
            for client in clients:
                assert await client.exit() == 0, client.stderr()
            await wait_until(lambda: not daemon.connections)
            lines = [
                line
                for client in clients
                for line in client.lines()
                if line["event"] in ("load", "unload", "freed")
            ]
            assert not +replay_loads(lines, RANDOM_BUDGET)  # every load was freed
            check_books(daemon)
            assert daemon.totals()["used"] == dict.fromkeys(RANDOM_BUDGET, 0)
            assert not list(daemon.runner.core.entries())
            assert not daemon.connections and not daemon.owners


# ------------------------------------------------------------------ shared books of real bytes

SHARED_BUDGET = 1000


@one_backend
async def test_processes_under_cancellation_failures_and_sigkill_never_hold_more_than_the_budget(
    procs: Procs,
) -> None:
    """Invariant: the bytes that all processes' loaders hold at once (each process's own
    books in shared memory, summed at every allocation over the processes still running)
    never exceed the shared budget, under cancelled acquires, failing loads, failing
    releases and a process killed mid-run; the daemon's books are empty at the end."""
    from multiprocessing import shared_memory

    from tests.remote.process_client import SharedBooks

    clients = 3
    memory = shared_memory.SharedMemory(create=True, size=8 * SharedBooks.SLOT * clients)
    buffer = memory.buf
    assert buffer is not None
    try:
        buffer[:] = bytes(len(buffer))
        with anyio.fail_after(120):
            await procs.daemon(str(SHARED_BUDGET))
            runs = [
                procs.client(
                    f"shared{slot}",
                    {
                        "mode": "shared",
                        "memory": memory.name,
                        "slot": slot,
                        "seed": slot,
                        "tasks": 30,
                        "ops": 12,
                        "keys": 12,
                        "sizes": [50, 100, 150],
                        "timeout": 30,
                        "release_failures": 1,
                        "load_failures": 0.05,
                        "cancel": 0.05,
                    },
                )
                for slot in range(clients)
            ]
            for run in runs:
                await run.wait_for("started")
            await anyio.sleep(0.3)  # (mid-run: its loads, leases and releases in flight)
            runs[0].kill(signal.SIGKILL)
            for run in runs[1:]:
                done = await run.wait_for("done")
                assert set(done["outcomes"]) <= {"held", "cancelled", "Failing"}, done
                assert await run.exit() == 0, run.stderr()
            cells = buffer.cast("q")
            peaks = [cells[slot * SharedBooks.SLOT + 2] for slot in range(clients)]
            cells.release()
            assert 0 < max(peaks) <= SHARED_BUDGET, peaks
            while (await procs.listing())["entries"]:
                await anyio.sleep(0.01)
    finally:
        del buffer
        memory.close()
        memory.unlink()


# ------------------------------------------------------------------ real memory

BUFFER = 150 * 10**6
MEMORY_BUDGET = 4 * BUFFER
#: The clients' own allocations besides the buffers (JSON lines, the books, the
#: allocator's arenas): a few MB per process, bounded generously.
NOISE = 30 * 10**6


@one_backend
async def test_real_buffers_of_three_processes_stay_within_the_shared_budget(
    procs: Procs,
) -> None:
    """The clients' resident memory grows by at most the budget, plus one buffer
    (the three ``/proc`` reads of a sample are not one instant: a buffer freed
    just after one read and loaded just before the next shows twice), plus noise."""
    with anyio.fail_after(60):
        await procs.daemon(str(MEMORY_BUDGET))
        clients = [
            procs.client(
                f"memory{i}",
                {
                    "mode": "memory",
                    "size": BUFFER,
                    "rounds": 2,
                    "keys": [f"p{i}k{k}" for k in range(3)],
                },
            )
            for i in range(3)
        ]
        for client in clients:
            await client.wait_for("ready")
        base = {client: client.rss() or 0 for client in clients}
        procs.signal("go")
        peak = 0
        while not all(client.events("done") for client in clients):
            growth = [(c.rss() or base[c]) - base[c] for c in clients]  # (exited: nothing)
            peak = max(peak, sum(growth))
            assert peak <= MEMORY_BUDGET + BUFFER + NOISE, growth
            await anyio.sleep(0.002)
        for client in clients:
            assert await client.exit() == 0, client.stderr()
        loads = [line for client in clients for line in client.events("loaded")]
        assert len(loads) == 18 and {line["first"] for line in loads} == {1}
        assert peak >= 2 * BUFFER  # the samples did see the buffers


# ------------------------------------------------------------------ a daemon restarted


@one_backend
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["term", "kill"])
async def test_a_restarted_daemon_charges_what_a_process_holds_before_it_grants_to_another(
    procs: Procs, signum: int
) -> None:
    """A daemon stopped (SIGTERM) or killed while a process holds a lease, loads a value
    and releases another: the process reconnects and registers all three with the new
    daemon, which grants another process nothing of that room (its gate holds every
    grant until the process registered), and hands the room on once it is freed."""
    with anyio.fail_after(60):
        daemon = await procs.daemon("100")
        first = procs.steps(
            "first",
            # (slow to come back: another process asks the new daemon before it is)
            {"do": "connect", "reconnect_delay": 2.5},
            {"do": "acquire", "key": "held", "size": 40},
            {"do": "acquire", "key": "going", "size": 20, "hold": False},
            {"do": "invalidate", "key": "going"},
            {
                "do": "acquire",
                "key": "coming",
                "size": 30,
                "load": "signal:loaded",
                "background": True,
            },
            {"do": "wait", "signal": "restarted"},
            {"do": "value", "label": "held"},
            {"do": "wait", "signal": "end"},
            {"do": "close"},
            releaser="signal:released",
        )
        await first.wait_for("loading", label="coming")
        await first.wait_for("releasing", key="'going'")

        def states(listing: Any) -> list[tuple[str, str, int]]:
            return sorted(
                (e["key"], e["state"], sum(e["charge"].values())) for e in listing["entries"]
            )

        held = [("'coming'", "loading", 30), ("'going'", "releasing", 20), ("'held'", "ready", 40)]
        while states(await procs.listing()) != held:
            await anyio.sleep(0.01)
        daemon.kill(signum)
        await daemon.exit()
        await procs.daemon("100", name="daemon2")
        # At once, before the first process is back: the new daemon must not grant it
        # any of the 90 bytes the first holds (it waits for the first to register).
        second = procs.steps(
            "second",
            {"do": "connect"},
            {"do": "acquire", "key": "x", "size": 20, "timeout": 6, "hold": False},
            {"do": "wait", "signal": "freed"},
            {"do": "acquire", "key": "y", "size": 30, "timeout": 20, "hold": False},
            {"do": "close"},
        )
        while states(await procs.listing()) != held:  # registered again, as they stand
            await anyio.sleep(0.01)
        procs.signal("restarted")
        assert (await first.wait_for("value"))["value"] == f"held@{first.pid}"
        refused = await second.wait_for("error", key="x")
        assert refused["type"] == "AcquireTimeout", refused  # 90 of 100 are the first's
        procs.signal("loaded")
        procs.signal("released")
        await first.wait_for("released", key="'going'")
        procs.signal("freed")
        assert (await second.wait_for("acquired", key="y"))["value"] == f"y@{second.pid}"
        assert await second.exit() == 0, second.stderr()
        procs.signal("end")
        assert await first.exit() == 0, first.stderr()
        while (await procs.listing())["entries"]:
            await anyio.sleep(0.01)


# ------------------------------------------------------------------ kill -9 a client


@pytest.mark.parametrize("moment", ["loading", "releasing", "holding"])
async def test_a_killed_process_gives_its_bytes_back(procs: Procs, moment: str) -> None:
    """A process killed while loading, releasing or holding a lease takes its entries
    out of the daemon's books at once: another process's waiting request is granted."""
    with anyio.fail_after(30):
        async with serving(procs.socket, 100) as daemon:
            said: list[tuple[str, Mapping[str, Any]]] = []
            daemon.broker.add_listener(lambda event, fields: said.append((event, fields)))
            first = {"do": "acquire", "key": "a", "size": 60}
            victim = procs.steps(
                "victim",
                {"do": "connect"},
                {**first, "load": "forever"} if moment == "loading" else first,
                {"do": "release", "label": "a"}
                if moment == "releasing"
                else {"do": "value", "label": "a"},
                {"do": "wait", "signal": "never"},
                releaser="forever",
            )
            await victim.wait_for("loading")
            if moment != "loading":
                await victim.wait_for("value" if moment == "holding" else "let go")
            other = procs.steps(
                "other",
                {"do": "connect"},
                {"do": "acquire", "key": "b", "size": 60, "timeout": 30},
                {"do": "stats"},
                {"do": "wait", "signal": "finish"},
            )
            if moment == "releasing":
                await victim.wait_for("releasing")
            await wait_until(
                lambda: any(
                    e["pid"] == other.pid and e["state"] == "waiting"
                    for e in daemon.listing()["entries"]
                )
            )
            assert by_pid(daemon)[victim.pid] == {"default": 60}
            victim.kill()
            acquired = await other.wait_for("acquired", key="b")
            assert acquired["value"] == f"b@{other.pid}"
            await victim.exit()
            check_books(daemon)
            assert victim.pid not in by_pid(daemon)
            assert by_pid(daemon)[other.pid] == {"default": 60}
            assert (await other.wait_for("stats"))["broker_used"] == {"default": 60}
            procs.signal("finish")
            assert await other.exit() == 0, other.stderr()
            await wait_until(lambda: not daemon.connections)
            check_books(daemon)
            assert daemon.totals()["used"] == {"default": 0}
        # What the daemon said of the victim's bytes: its own words, not a load's
        # (no load of "(connections ended)" started, nor failed at warning level).
        theirs = [(e, f) for e, f in said if f.get("pid") == victim.pid]
        assert not [f for _, f in said if "(connections ended)" in str(f.get("cache"))], said
        kept = [f for e, f in theirs if e == ev.PEER_KEPT]
        returned = [f for e, f in theirs if e == ev.PEER_RETURNED]
        assert len(kept) == len(returned) == 1, theirs
        assert kept[0]["bytes"] == returned[0]["bytes"] == {"default": 60}
        assert returned[0]["why"] == "ended"


# ------------------------------------------------------------------ the daemon stops


@one_backend
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["term", "kill"])
async def test_a_stopped_daemon_fails_requests_and_leaves_leases_working(
    procs: Procs, signum: int
) -> None:
    """Without ``reconnect``: when the daemon stops, requests that need it raise
    ``BrokerClosed`` naming its socket (the one waiting, and the next), a lease held
    keeps its value, the broker closes without hanging, and ``Broker.connect`` works
    again once a daemon is back."""
    with anyio.fail_after(40):
        daemon = await procs.daemon("100")
        client = procs.steps(
            "client",
            {"do": "connect", "reconnect": False},
            {"do": "acquire", "key": "a", "size": 60},
            {"do": "acquire", "key": "b", "size": 60, "timeout": 30, "background": True},
            {"do": "wait", "signal": "stopped"},
            {"do": "value", "label": "a"},
            {"do": "acquire", "key": "c", "size": 10},
            {"do": "close"},
            {"do": "wait", "signal": "restarted"},
            {"do": "connect"},
            {"do": "acquire", "key": "d", "size": 10, "hold": False},
        )
        await client.wait_for("acquired", key="a")
        await client.wait_for("acquiring", key="b")
        while not any(e["state"] == "waiting" for e in (await procs.listing())["entries"]):
            await anyio.sleep(0.01)

        daemon.kill(signum)
        status = await daemon.exit()
        assert status == (0 if signum == signal.SIGTERM else -signal.SIGKILL), daemon.stderr()
        # A daemon stopped cleanly removes its socket; a killed one leaves it behind.
        assert os.path.exists(procs.socket) is (signum == signal.SIGKILL)  # noqa: ASYNC240
        waiting = await client.wait_for("error", key="b")
        procs.signal("stopped")
        assert (await client.wait_for("value"))["value"] == f"a@{client.pid}"
        after = await client.wait_for("error", key="c")
        for error in (waiting, after):
            assert error["type"] == "BrokerClosed" and procs.socket in error["message"], error
        await client.wait_for("closed")

        await procs.daemon("100", name="daemon2")  # (over the stale socket, after kill -9)
        procs.signal("restarted")
        assert (await client.wait_for("acquired", key="d"))["value"] == f"d@{client.pid}"
        assert await client.exit() == 0, client.stderr()


# ------------------------------------------------------------------ a release never acknowledged


@one_backend
async def test_a_release_never_acknowledged_is_quarantined_until_its_process_dies(
    procs: Procs,
) -> None:
    """With ``--release-timeout 1``, an entry whose process never finishes releasing it
    is quarantined in the daemon (``ps`` says so) and its bytes stay charged: a request
    that needs them waits for them within its own timeout (the release still runs, and
    may yet return), saying so; killing the stuck process frees them."""
    with anyio.fail_after(40):
        await procs.daemon("100", "--release-timeout", "1")
        stuck = procs.steps(
            "stuck",
            {"do": "connect"},
            {"do": "acquire", "key": "a", "size": 60, "hold": False},
            {"do": "wait", "signal": "never"},
            releaser="forever",
        )
        await stuck.wait_for("acquired", key="a")
        other = procs.steps(
            "other",
            {"do": "connect"},
            {"do": "acquire", "key": "b", "size": 60, "timeout": 3},
            {"do": "wait", "signal": "retry"},
            {"do": "acquire", "key": "c", "size": 60, "timeout": 10},
        )
        await stuck.wait_for("releasing")
        # Quarantined, its release still running: the request waits for it, in vain.
        refused = await other.wait_for("error", key="b")
        assert refused["type"] == "AcquireTimeout", refused
        assert "still running" in refused["message"] and "'a'" in refused["message"], refused
        listing = await procs.listing()
        assert listing["daemon"]["used"] == {"default": 60}
        [entry] = listing["entries"]
        assert (entry["pid"], entry["key"], entry["state"]) == (stuck.pid, "'a'", "quarantined")
        assert "quarantined" in (await procs.ps())[1]

        stuck.kill()
        await stuck.exit()
        procs.signal("retry")
        assert (await other.wait_for("acquired", key="c"))["value"] == f"c@{other.pid}"
        assert await other.exit() == 0, other.stderr()


# ------------------------------------------------------------------ cachebroker ps


@one_backend
async def test_ps_lists_each_process_entries(procs: Procs) -> None:
    """``cachebroker ps`` shows, for each entry: pid, cache, key, space, bytes, state,
    leases, idle time, requests waiting at the daemon, priority and the process's loads
    of the key; ``--json`` the same as data; with no daemon it exits 1 naming the socket."""
    with anyio.fail_after(30):
        await procs.daemon("ram=1MB,cuda:0=2MB")
        models = procs.steps(
            "models",
            {"do": "connect", "cache": "models"},
            {"do": "acquire", "key": ["model", 7], "size": {"ram": 1000, "cuda:0": 250_000}},
            {"do": "wait", "signal": "finish"},
        )
        tokens = procs.steps(
            "tokens",
            {"do": "connect", "cache": "tokens"},
            {"do": "acquire", "key": "vocab", "size": {"ram": 5000}, "hold": False},
            {"do": "wait", "signal": "finish"},
        )
        await models.wait_for("acquired")
        await tokens.wait_for("acquired")

        status, table, _ = await procs.ps()
        assert status == 0
        header = (
            r"^PID +CACHE +KEY +SPACE +BYTES +STATE +LEASES +IDLE +WAITING +PRIORITY +LOADS +WHERE$"
        )
        assert re.search(header, table, re.M), table
        # One row per entry and space, the entry's columns on its first row only.
        model_rows = (
            rf"^{models.pid} +models +\('model', 7\) +cuda:0 +{format_bytes(250_000)} +ready"
            rf" +1 +- +0 +0 +1 +-\n +ram +{format_bytes(1000)}$"
        )
        assert re.search(model_rows, table, re.M), table
        vocab_row = (
            rf"^{tokens.pid} +tokens +'vocab' +ram +{format_bytes(5000)} +ready +0 +[0-9.]+s"
            r" +0 +0 +1 +-$"
        )
        assert re.search(vocab_row, table, re.M), table
        assert f"ram: {format_bytes(6000)} used of {format_bytes(10**6)}" in table

        listing = await procs.listing()
        assert listing["processes"] == sorted([models.pid, tokens.pid])
        assert listing["daemon"]["used"] == {"ram": 6000, "cuda:0": 250_000}
        entries = {(e["pid"], e["cache"], e["key"]): e for e in listing["entries"]}
        assert entries.keys() == {
            (models.pid, "models", "('model', 7)"),
            (tokens.pid, "tokens", "'vocab'"),
        }
        model = entries[models.pid, "models", "('model', 7)"]
        assert (model["charge"], model["state"], model["leases"]) == (
            {"ram": 1000, "cuda:0": 250_000},
            "ready",
            1,
        )
        vocab = entries[tokens.pid, "tokens", "'vocab'"]
        assert (vocab["charge"], vocab["leases"]) == ({"ram": 5000}, 0)
        assert (vocab["waiting"], vocab["priority"], vocab["loads"]) == (0, 0, 1)
        assert vocab["idle_seconds"] >= 0

        procs.signal("finish")
        for client in (models, tokens):
            assert await client.exit() == 0, client.stderr()

    missing = "/nonexistent/cachebroker.sock"
    done = await anyio.run_process(
        [sys.executable, "-m", "cachebroker", "ps", "--socket", missing], env=ENV, check=False
    )
    assert done.returncode == 1
    assert missing in done.stderr.decode()


# ------------------------------------------------------------------ malformed messages


#: What a peer might send that is not a message: (hello first?, bytes, the error logged).
MALFORMED = [
    (False, b"GET / HTTP/1.1\r\nHost: cachebroker\r\n\r\n", "over the limit"),
    (False, frame(b"\xff\xfe{not json"), "not JSON"),
    (True, b"\xff\xff\xff\xff", "over the limit"),
    (True, frame(b"[1, 2, 3]"), "must be an object"),
    (True, frame(b'{"id": 1}'), "with an 'op'"),
    (True, wire.encode({"op": "bogus"}), "unknown op 'bogus'"),
    (True, wire.encode({"op": "acquire", "id": "one", "cache": "c"}), "'id' is 'one'"),
    (True, wire.encode({"op": "free", "id": None}), "'free' message: 'id' is None"),
]


async def exchange(address: str, payload: bytes, *, hello: bool) -> list[dict[str, Any]]:
    """Send ``payload`` (once welcomed); the messages received until the daemon hung up."""
    received = []
    async with await anyio.connect_unix(address) as stream:
        reader = BufferedByteReceiveStream(stream)
        if hello:
            await wire.send(stream, {"op": "hello", "version": wire.VERSION, "pid": os.getpid()})
            assert (await wire.receive(reader))["op"] == "welcome"
        await stream.send(payload)
        with contextlib.suppress(
            anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError
        ):
            while True:
                received.append(await wire.receive(reader))
    return received


async def test_a_malformed_message_closes_only_its_connection(
    procs: Procs, events: list[MutableMapping[str, Any]]
) -> None:
    """A peer that sends something not of the protocol (garbage, a huge length, JSON
    that is no message, an unknown op, a bad field) is logged and cut off; a process
    and a connection that were there meanwhile go on, the process's entries untouched."""
    with anyio.fail_after(20):
        async with serving(procs.socket, 100) as daemon:
            client = procs.steps(
                "client",
                {"do": "connect"},
                {"do": "acquire", "key": "a", "size": 30},
                {"do": "wait", "signal": "go on"},
                {"do": "acquire", "key": "b", "size": 20},
                {"do": "stats"},
                {"do": "wait", "signal": "finish"},
            )
            await client.wait_for("acquired", key="a")
            async with await anyio.connect_unix(procs.socket) as bystander:
                reader = BufferedByteReceiveStream(bystander)
                await wire.send(bystander, {"op": "hello", "version": wire.VERSION})
                assert (await wire.receive(reader))["op"] == "welcome"

                for count, (hello, payload, why) in enumerate(MALFORMED, 1):
                    assert await exchange(procs.socket, payload, hello=hello) == []
                    logged = [e for e in events if e["event"] == "cachebroker.peer.failed"]
                    assert len(logged) == count, logged
                    failed = logged[-1]
                    assert failed["pid"] == os.getpid() and failed["address"] == procs.socket
                    assert why in failed["error"], (payload, failed)
                    assert by_pid(daemon) == {client.pid: {"default": 30}}

                await wire.send(bystander, {"op": "totals"})
                assert (await wire.receive(reader))["used"] == {"default": 30}
            procs.signal("go on")
            assert (await client.wait_for("stats"))["broker_used"] == {"default": 50}
            check_books(daemon)
            procs.signal("finish")
            assert await client.exit() == 0, client.stderr()


# ------------------------------------------------------------------ another user


async def test_a_process_of_another_user_is_refused(
    procs: Procs, events: list[MutableMapping[str, Any]], anyio_backend: tuple[str, Any]
) -> None:
    """The socket is the user's own (mode 0600), and the daemon serves no other user:
    a peer of another uid is refused with ``BrokerClosed`` saying so, every time, and
    the daemon serves on."""
    with anyio.fail_after(20):
        # Every peer is "another user" to a daemon that believes it serves uid + 1.
        async with serving(procs.socket, 100, uid=os.getuid() + 1) as daemon:
            assert stat.S_IMODE(os.stat(procs.socket).st_mode) == 0o600
            for _ in range(2):
                with pytest.raises(BrokerClosed, match="refused") as refused:
                    async with Broker.connect(procs.socket):
                        pass
                assert procs.socket in str(refused.value)
            backend = "uvloop" if anyio_backend[1].get("use_uvloop") else anyio_backend[0]
            client = procs.steps("client", *[{"do": "connect"}] * 10, backend=backend)
            assert await client.exit() == 0, client.stderr()
            errors = client.events("error", op="connect")
            assert len(errors) == 10
            for error in errors:
                assert error["type"] == "BrokerClosed" and "refused" in error["message"], error

            logged = [e for e in events if e["event"] == "cachebroker.peer.refused"]
            assert [e["pid"] for e in logged] == [os.getpid()] * 2 + [client.pid] * 10
            assert {e["uid"] for e in logged} == {os.getuid()}
            assert not daemon.connections


# ------------------------------------------------------------------ in one event loop
# Daemon and clients in the test's loop, where a check needs a moment that processes
# cannot be stopped at.


def releaser(freed: list[Hashable]) -> Callable[[Hashable, Any], Awaitable[None]]:
    """A releaser that records each key it frees."""

    async def release(key: Hashable, value: Any) -> None:
        freed.append(key)

    return release


async def test_a_release_asked_of_an_entry_leased_again_is_refused(
    procs: Procs, events: list[MutableMapping[str, Any]]
) -> None:
    """A process that leased its entry again before the daemon's release request arrived
    refuses it: the entry stays (leased), the request waits for other room, and the
    entry is released once the lease ends."""
    freed: list[Hashable] = []
    with anyio.fail_after(20):
        async with serving(procs.socket, 100) as daemon, anyio.create_task_group() as tg:
            async with (
                Broker.connect(procs.socket) as first,
                Broker.connect(procs.socket) as second,
            ):
                async with (
                    first.cache("a", releaser(freed)) as a,
                    second.cache("b", releaser(freed)) as b,
                ):
                    await (await a.acquire("x", load=loader("x"), size=60)).release()
                    # The release request reaches the first process late: after its new lease.
                    side = first._runner.remote
                    assert isinstance(side, LinkAdmission) and side.link is not None
                    link = side.link
                    asked: list[int] = []

                    def hold_back(id: int, reason: Reason = Reason.CAPACITY) -> None:
                        asked.append(id)

                    link.give_up = hold_back  # type: ignore[method-assign]

                    got: list[Any] = []

                    async def wanting() -> None:
                        async with b.acquire("y", load=loader("y"), size=60, timeout=15) as lease:
                            got.append(lease.value)

                    tg.start_soon(wanting)
                    await wait_until(lambda: asked)
                    lease = await a.acquire("x", load=loader("again"), size=60)
                    assert lease.value == "x"  # a hit: the entry is still loaded here
                    del link.give_up
                    link.give_up(asked[0])

                    await wait_until(
                        lambda: any(e["event"] == "cachebroker.release.refused" for e in events)
                    )
                    [refusal] = [e for e in events if e["event"] == "cachebroker.release.refused"]
                    assert (refusal["cache"], repr(refusal["key"])) == (f"a@{os.getpid()}", "'x'")
                    check_books(daemon)
                    [entry] = [e for e in daemon.listing()["entries"] if e["cache"] == "a"]
                    assert (entry["state"], entry["leases"]) == ("ready", 1)
                    assert not got and not freed

                    await lease.release()
                    await wait_until(lambda: got)
                    assert got == ["y"] and freed == ["x"]
                    check_books(daemon)


async def test_a_connected_broker_cancelled_from_outside_closes_at_once(
    procs: Procs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelling the scope around ``Broker.connect()`` cancels its writer too: closing
    does not wait for it to send what is left (the daemon, seeing the connection end,
    drops the process's entries all the same)."""
    # Waiting for the writer would take this long, past the bound of the test.
    monkeypatch.setattr(_client, "FINISH_TIMEOUT", 20.0)
    freed: list[Hashable] = []
    with anyio.fail_after(10):
        async with serving(procs.socket, 100) as daemon:
            with anyio.CancelScope() as scope:
                async with Broker.connect(procs.socket) as broker:
                    async with broker.cache("c", releaser(freed)) as cache:
                        await (await cache.acquire("k", load=loader(1), size=10)).release()
                        scope.cancel()
                        await anyio.sleep_forever()
            assert scope.cancelled_caught and freed == ["k"]
            await wait_until(lambda: not daemon.connections)
            check_books(daemon)
            assert daemon.totals()["used"] == {"default": 0}


async def test_a_refused_peer_reads_why_even_when_its_hello_comes_late(
    procs: Procs, events: list[MutableMapping[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer of another user whose hello comes after the daemon decided to refuse it
    still reads the refusal (the daemon takes the hello first), not a reset connection."""
    connect_unix = anyio.connect_unix

    async def late(path: str) -> anyio.abc.SocketStream:
        stream = await connect_unix(path)
        await wait_until(lambda: any(e["event"] == "cachebroker.peer.refused" for e in events))
        await anyio.sleep(0.05)  # time for the daemon to close a connection it is done with
        return stream

    monkeypatch.setattr(anyio, "connect_unix", late)
    with anyio.fail_after(20):
        async with serving(procs.socket, 100, uid=os.getuid() + 1):
            with pytest.raises(BrokerClosed, match="refused this process: user"):
                async with Broker.connect(procs.socket):
                    pass


async def test_the_daemon_counts_a_process_own_releases_by_their_reason(
    procs: Procs, events: list[MutableMapping[str, Any]]
) -> None:
    """A release the process starts itself (invalidate, closing its cache) is booked by
    the daemon under that reason, not as an eviction for capacity, however quickly the
    release is over (reported as ``releasing`` then ``gone``, or ``gone`` at once)."""
    freed: list[Hashable] = []
    with anyio.fail_after(20):
        async with serving(procs.socket, 100) as daemon:
            async with Broker.connect(procs.socket) as broker:
                async with broker.cache("c", releaser(freed)) as cache:
                    for key in ("old", "kept"):
                        await (await cache.acquire(key, load=loader(key), size=10)).release()
                    assert await cache.invalidate("old")
                    await wait_until(lambda: daemon.totals()["used"] == {"default": 10})
                await wait_until(lambda: daemon.totals()["used"] == {"default": 0})
                stats = daemon.broker.stats_nowait()
                assert {r: n for r, n in stats.releases.items() if n} == {
                    "invalidate": 1,
                    "close": 1,
                }
                assert stats.evictions == 0
            requested = [e for e in events if e["event"] == "cachebroker.release.requested"]
            assert {repr(e["key"]): e["reason"] for e in requested if "@" in e["cache"]} == {
                "'old'": "invalidate",
                "'kept'": "close",
            }
            assert freed == ["old", "kept"]


async def test_out_of_memory_in_one_process_frees_idle_entries_of_another(procs: Procs) -> None:
    """Free and retry across processes: B's load runs out of device memory, which only
    A's idle entry ``a`` holds (the books have room: the device does not). The daemon
    picks ``a``, in its policy's order among every process's idle entries, A releases
    it (freeing the device), and B's retried load succeeds: B logs one retry naming
    ``a@A``, and A counts the release as one for a retry."""
    with anyio.fail_after(60):
        async with serving(procs.socket, 100) as daemon:
            owner = procs.steps(
                "owner",
                {"do": "connect"},
                {"do": "acquire", "key": "a", "size": 40, "hold": False},
                {"do": "wait", "signal": "report"},
                {"do": "stats"},
                {"do": "wait", "signal": "finish"},
                releaser="frees:room",
            )
            await owner.wait_for("acquired", key="a")
            await wait_until(lambda: daemon.totals()["used"] == {"default": 40}, limit=20)
            loader_proc = procs.steps(
                "loader",
                {"do": "connect"},
                {"do": "acquire", "key": "b", "size": 10, "load": "oom-until:room"},
                {"do": "stats"},
                {"do": "wait", "signal": "finish"},
            )
            await loader_proc.wait_for("out of memory", label="b")
            await owner.wait_for("released", key="'a'")
            acquired = await loader_proc.wait_for("acquired", key="b")
            assert acquired["value"] == f"b@{loader_proc.pid}"
            stats = await loader_proc.wait_for("stats")
            assert stats["oom_retries"] == 1, stats
            check_books(daemon)
            assert by_pid(daemon) == {loader_proc.pid: {"default": 10}}
            assert daemon.broker.stats_nowait().releases["retry"] == 1
            procs.signal("report")
            assert (await owner.wait_for("stats"))["releases"]["retry"] == 1
            procs.signal("finish")
            assert await loader_proc.exit() == 0, loader_proc.stderr()
            assert await owner.exit() == 0, owner.stderr()


async def test_a_process_s_idle_model_is_moved_down_for_another_and_brought_back(
    procs: Procs,
) -> None:
    """Tiers across real processes (``serve --tiers gpu=ram``): B's load needs the GPU
    that A's idle model fills. The daemon decides a demotion, A's own releaser moves
    the model to RAM (nothing is released), and B loads. When A asks for it again,
    the daemon makes room on the GPU (B's idle model, whose releaser cannot move, is
    released) and A moves it back up: no load."""
    with anyio.fail_after(60):
        budget = {"gpu": 100, "ram": 100}
        async with serving(procs.socket, budget, tiers={"gpu": "ram"}) as daemon:
            owner = procs.steps(
                "owner",
                {"do": "connect"},
                {"do": "acquire", "key": "a", "size": {"gpu": 60}, "hold": False},
                {"do": "wait", "signal": "demoted"},
                {"do": "entries"},
                {"do": "acquire", "key": "a", "size": {"gpu": 60}, "hold": False},
                {"do": "entries"},
                {"do": "wait", "signal": "finish"},
                releaser="moves",
            )
            await owner.wait_for("acquired", key="a")
            other = procs.steps(
                "other",
                {"do": "connect"},
                {"do": "acquire", "key": "b", "size": {"gpu": 60}, "hold": False},
                {"do": "wait", "signal": "finish"},
            )
            moved = await owner.wait_for("moved", key="'a'")
            assert moved["to"] == "ram"
            await other.wait_for("acquired", key="b")
            check_books(daemon)
            assert by_pid(daemon) == {owner.pid: {"ram": 60}, other.pid: {"gpu": 60}}
            procs.signal("demoted")
            entries = (await owner.wait_for("entries"))["entries"]
            assert entries["'a'"] == {
                "state": "demoted",
                "charge": {"ram": 60},
                "home": {"gpu": 60},
            }
            await owner.wait_for("moved", key="'a'", to="gpu")
            await wait_until(lambda: len(owner.events("acquired", key="a")) == 2, limit=20)
            acquired = owner.events("acquired", key="a")
            assert acquired[1]["value"] == f"a@{owner.pid}>ram>gpu"  # moved back, not loaded
            await other.wait_for("released", key="'b'")
            await wait_until(lambda: len(owner.events("entries")) == 2, limit=20)
            entries = owner.events("entries")[1]["entries"]
            assert entries["'a'"] == {"state": "ready", "charge": {"gpu": 60}, "home": None}
            await wait_until(lambda: by_pid(daemon) == {owner.pid: {"gpu": 60}}, limit=20)
            check_books(daemon)
            procs.signal("finish")
            assert await owner.exit() == 0, owner.stderr()
            assert await other.exit() == 0, other.stderr()
