"""Faults at the seams of one ``Request``: reentrant loaders, cancellation, dying processes.

A request goes from ``Cache`` through the actor, the runner, the requests, the
books and (for a connected broker) over the wire to the daemon's books and
back. These tests attack the places where it crosses from one layer to the
next, in-process and through a connected broker alike (``kind``):

* a loader that calls back into the broker (acquires other keys of the same
  and of another cache, prefetches, invalidates) while space is short, or
  that waits for room only its own load holds: no hang, no over-commit, a
  ``DeadlockError`` where waiting could never end;
* an acquire cancelled at each successive checkpoint of a miss that must
  evict first: after each, the books add up and nothing leaks;
* a real client process killed (SIGKILL) while it holds a lease or waits for
  a grant: the daemon takes its bytes back and serves another process.

Every wait is bounded by ``anyio.fail_after`` as a safety net only.
"""

from __future__ import annotations

import signal
import sys
from collections import Counter
from collections.abc import Hashable
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from cachebroker import Broker, DeadlockError
from tests.brokers import daemon_of, open_broker
from tests.helpers import steps_until, wait_until
from tests.remote.processes import Procs, check_books, serving

pytestmark = pytest.mark.anyio

BUDGET = 100


class Books:
    """Releaser and loaders that keep their own account of what is loaded."""

    def __init__(self) -> None:
        self.loaded: Counter[Hashable] = Counter()
        self.peak = 0
        self.released: list[Hashable] = []

    async def release(self, key: Hashable, value: Any) -> None:
        await anyio.lowlevel.checkpoint()
        self.loaded[value[0]] -= value[1]
        self.released.append(key)

    def loader(self, key: Hashable, size: int, steps: int = 2) -> Any:
        async def load() -> tuple[Hashable, int]:
            self.loaded[key] += size
            self.peak = max(self.peak, sum(self.loaded.values()))
            try:
                for _ in range(steps):
                    await anyio.lowlevel.checkpoint()
            except BaseException:
                self.loaded[key] -= size
                raise
            return (key, size)

        return load


def check(broker: Broker) -> None:
    """The broker's books add up and stay within budget (the daemon's too, if connected)."""
    stats = broker.stats_nowait()
    assert all(used <= BUDGET for used in stats.used.values()), stats.used
    daemon = daemon_of(broker)
    if daemon is None:
        broker._runner.core.check()
    else:
        check_books(daemon)


async def quiet(broker: Broker) -> Any:
    """Wait until nothing loads, releases, waits or is leased, here and at the daemon
    (a release it decided for a request cancelled meanwhile may still be on its way
    here); the stats then."""
    daemon = daemon_of(broker)
    brokers = [broker] if daemon is None else [broker, daemon.broker]

    def idle() -> bool:
        for s in (b.stats_nowait() for b in brokers):
            if s.loading or s.releasing or s.waiting or s.leased or s.waiting_for_lease:
                return False
        return True

    await wait_until(idle)
    stats = await broker.stats()
    check(broker)
    return stats


def daemon_used(broker: Broker) -> int | None:
    daemon = daemon_of(broker)
    return None if daemon is None else daemon.totals()["used"].get("default", 0)


async def daemon_agrees(broker: Broker, used: int) -> None:
    """The daemon's books (if connected) come to charge ``used``; fails if they never do."""
    daemon = daemon_of(broker)
    if daemon is None:
        return
    try:
        await wait_until(lambda: daemon_used(broker) == used)
    except TimeoutError:
        raise AssertionError(
            f"the daemon charges {daemon_used(broker)}, the process {used}: "
            f"{daemon.listing()['entries']}"
        ) from None
    check_books(daemon)


# ------------------------------------------------------------------ 1. reentrant loaders


async def test_a_loader_reentering_the_broker_under_pressure_neither_hangs_nor_overcommits(
    kind: str,
) -> None:
    """A loader, while space is short, acquires another key of its cache and one of
    another cache (each needing an eviction), prefetches, and invalidates: all of it
    completes, and no sample of the books ever exceeds the budget."""
    books = Books()
    with anyio.fail_after(20):
        async with (
            open_broker(kind, BUDGET) as broker,
            broker.cache("c1", books.release) as c1,
            broker.cache("c2", books.release) as c2,
        ):
            for cache, key in ((c1, "old1"), (c2, "old2"), (c1, "old3")):
                await (await cache.acquire(key, load=books.loader(key, 30), size=30)).release()
            assert (await broker.stats()).used == {"default": 90}
            stop = anyio.Event()
            samples = 0

            async def sample() -> None:
                nonlocal samples
                while not stop.is_set():
                    check(broker)
                    samples += 1
                    await anyio.lowlevel.checkpoint()

            async def load_outer() -> tuple[str, int]:
                books.loaded["outer"] += 20
                async with c1.acquire("inner", load=books.loader("inner", 30), size=30) as i:
                    assert i.value == ("inner", 30)
                    async with c2.acquire("x", load=books.loader("x", 20), size=20) as x:
                        assert x.value == ("x", 20)
                        await c1.prefetch("pre", load=books.loader("pre", 10), size=10)
                        await c2.invalidate("old2")
                        await c1.invalidate("inner")  # leased: dropped when it ends
                return ("outer", 20)

            async with anyio.create_task_group() as tg:
                tg.start_soon(sample)
                async with c1.acquire("outer", load=load_outer, size=20) as outer:
                    assert outer.value == ("outer", 20)
                    check(broker)
                stop.set()
            assert samples > 0
            stats = await quiet(broker)
            assert sum(stats.used.values()) <= BUDGET
            assert books.peak <= BUDGET, books.peak
            assert "inner" not in [e.key for e in await broker.entries()]
            # The books charge exactly what the loaders hold.
            live = {e.key: e for e in await broker.entries()}
            assert stats.used["default"] == sum(books.loaded[k] for k in live), (
                stats.used,
                dict(books.loaded),
                list(live),
            )
            await daemon_agrees(broker, stats.used["default"])
            await broker.clear()
            stats = await quiet(broker)
            assert stats.used == {"default": 0}
            await daemon_agrees(broker, 0)


async def test_a_loader_waiting_for_room_only_its_own_load_holds_gets_a_deadlock_error(
    kind: str,
) -> None:
    """The load of ``big`` (60 of 100) acquires ``other`` (60): only ``big``'s own bytes,
    which cannot go while it loads, could make room. The inner acquire must not wait
    forever: a ``DeadlockError`` (or the outer load failing with it); nothing leaks."""
    books = Books()
    with anyio.fail_after(4):
        async with open_broker(kind, BUDGET) as broker, broker.cache("c", books.release) as c:

            async def load_big() -> str:
                async with c.acquire("other", load=books.loader("other", 60), size=60):
                    return "never"

            with pytest.raises(DeadlockError):
                await c.acquire("big", load=load_big, size=60)
            stats = await quiet(broker)
            assert stats.used == {"default": 0}
            await daemon_agrees(broker, 0)
            async with c.acquire("big", load=books.loader("big", 60), size=60) as lease:
                assert lease.value == ("big", 60)


async def test_two_loaders_acquiring_each_other_get_a_deadlock_error(kind: str) -> None:
    """``a``'s loader acquires ``b`` (another cache), whose loader acquires ``a``: a cycle
    through two caches; a ``DeadlockError``, not a hang; the books are empty after."""
    books = Books()
    with anyio.fail_after(15):
        async with (
            open_broker(kind, BUDGET) as broker,
            broker.cache("ca", books.release) as ca,
            broker.cache("cb", books.release) as cb,
        ):

            async def load_a() -> str:
                async with cb.acquire("b", load=load_b, size=10):
                    return "a"

            async def load_b() -> str:
                async with ca.acquire("a", load=load_a, size=10):
                    return "b"

            with pytest.raises(DeadlockError):
                await ca.acquire("a", load=load_a, size=10)
            stats = await quiet(broker)
            assert stats.used == {"default": 0}
            await daemon_agrees(broker, 0)
            async with ca.acquire("a", load=books.loader("a", 10), size=10) as lease:
                assert lease.value == ("a", 10)


# ------------------------------------------------------------------ 2. cancellation


async def test_an_acquire_cancelled_at_each_checkpoint_of_a_miss_leaks_nothing(
    kind: str,
) -> None:
    """A miss of ``k`` (60 of 100) must first evict the idle ``old`` (60), then load.
    It is cancelled after N scheduler steps of a sibling, N = 0, 1, 2, ... until it
    completes: after each, the books add up, charge only what is loaded, and a later
    acquire of ``k`` works; cleared, they are empty."""
    books = Books()
    limit = 3000
    with anyio.fail_after(120):
        async with open_broker(kind, BUDGET) as broker, broker.cache("c", books.release) as c:
            completed = False
            n = 0
            cancelled_rounds = 0
            while not completed:
                assert n < limit, "the acquire never completed uncancelled"
                await (await c.acquire("old", load=books.loader("old", 60), size=60)).release()
                await quiet(broker)
                got: list[Any] = []
                scope = anyio.CancelScope()

                async def acquire(scope: anyio.CancelScope = scope, got: list[Any] = got) -> None:
                    with scope:
                        lease = await c.acquire("k", load=books.loader("k", 60, 3), size=60)
                        got.append(lease)

                async with anyio.create_task_group() as tg:
                    tg.start_soon(acquire)
                    for _ in range(n):
                        await anyio.lowlevel.checkpoint()
                    scope.cancel()
                if got:
                    [lease] = got
                    completed = not scope.cancelled_caught
                    assert lease.value == ("k", 60)
                    await lease.release()
                else:
                    assert scope.cancelled_caught
                    cancelled_rounds += 1
                stats = await quiet(broker)
                live = {e.key for e in await broker.entries()}
                assert stats.used["default"] == sum(books.loaded[k] for k in live), (
                    n,
                    stats.used,
                    dict(books.loaded),
                    live,
                )
                assert all(books.loaded[k] == 0 for k in books.loaded if k not in live), (
                    n,
                    dict(books.loaded),
                    live,
                )
                await daemon_agrees(broker, stats.used["default"])
                async with c.acquire("k", load=books.loader("k", 60), size=60) as again:
                    assert again.value == ("k", 60)
                await broker.clear()
                stats = await quiet(broker)
                assert stats.used == {"default": 0}, (n, stats.used)
                await daemon_agrees(broker, 0)
                assert sum(books.loaded.values()) == 0, (n, dict(books.loaded))
                n += 1
            assert cancelled_rounds > 0


async def test_an_acquire_cancelled_while_joining_another_load_leaks_nothing(
    kind: str,
) -> None:
    """A second acquire of ``k`` joins the first's load (six steps long); it is cancelled
    after N steps, N = 0, 1, ... until it completes: the first one's lease is unaffected,
    and the books are empty after."""
    books = Books()
    with anyio.fail_after(120):
        async with open_broker(kind, BUDGET) as broker, broker.cache("c", books.release) as c:
            load_k = books.loader("k", 50, 6)
            n = 0
            while True:
                assert n < 3000
                first: list[Any] = []
                second: list[Any] = []
                scope = anyio.CancelScope()
                async with anyio.create_task_group() as tg:

                    async def one(first: list[Any] = first) -> None:
                        first.append(await c.acquire("k", load=load_k, size=50))

                    async def two(
                        scope: anyio.CancelScope = scope, out: list[Any] = second
                    ) -> None:
                        with scope:
                            out.append(await c.acquire("k", load=load_k, size=50))

                    tg.start_soon(one)
                    await steps_until(lambda: broker.stats_nowait().loading == 1)
                    tg.start_soon(two)
                    for _ in range(n):
                        await anyio.lowlevel.checkpoint()
                    scope.cancel()
                [lease] = first
                assert lease.value == ("k", 50)
                for extra in second:
                    assert extra.value == ("k", 50)
                    await extra.release()
                await lease.release()
                stats = await quiet(broker)
                assert stats.used == {"default": 50}, (n, stats.used)
                await daemon_agrees(broker, 50)
                await broker.clear()
                stats = await quiet(broker)
                assert stats.used == {"default": 0}, (n, stats.used)
                await daemon_agrees(broker, 0)
                assert sum(books.loaded.values()) == 0, (n, dict(books.loaded))
                if second and not scope.cancelled_caught:
                    break
                n += 1


async def cancelled_after(n: int, operation: Any) -> tuple[list[Any], bool]:
    """Run ``operation()`` in a task cancelled after ``n`` steps of a sibling: what it
    returned (nothing if cancelled first) and whether the cancellation was caught."""
    got: list[Any] = []
    scope = anyio.CancelScope()

    async def run() -> None:
        with scope:
            got.append(await operation())

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        for _ in range(n):
            await anyio.lowlevel.checkpoint()
        scope.cancel()
    return got, scope.cancelled_caught


@pytest.mark.parametrize("what", ["reentrant", "prefetch"])
async def test_a_reentrant_load_or_prefetch_cancelled_at_each_step_leaks_nothing(
    kind: str, what: str
) -> None:
    """``outer``'s loader acquires ``inner`` (each 40 of 100, with ``old`` idle at 40: the
    inner one must evict), or a prefetch of ``k`` (60) must evict ``old``; cancelled after
    N steps, N = 0, 1, ... until it completes. After each the books charge exactly what
    the loaders hold, the daemon agrees, and cleared they are empty."""
    books = Books()
    with anyio.fail_after(120):
        async with (
            open_broker(kind, BUDGET) as broker,
            broker.cache("c", books.release) as c,
            broker.cache("d", books.release) as d,
        ):

            async def load_outer() -> tuple[str, int]:
                books.loaded["outer"] += 40
                try:
                    async with d.acquire("inner", load=books.loader("inner", 40, 3), size=40):
                        await anyio.lowlevel.checkpoint()
                except BaseException:
                    books.loaded["outer"] -= 40
                    raise
                return ("outer", 40)

            async def operation() -> Any:
                if what == "prefetch":
                    await c.prefetch("k", load=books.loader("k", 60, 3), size=60)
                    return None
                return await c.acquire("outer", load=load_outer, size=40)

            old = 40 if what == "reentrant" else 60
            n = 0
            while True:
                assert n < 3000, "the operation never completed uncancelled"
                await (await c.acquire("old", load=books.loader("old", old), size=old)).release()
                await quiet(broker)
                got, caught = await cancelled_after(n, operation)
                for lease in got:
                    if lease is not None:
                        assert lease.value == ("outer", 40)
                        await lease.release()
                stats = await quiet(broker)
                live = {e.key for e in await broker.entries()}
                assert stats.used["default"] == sum(books.loaded[k] for k in live), (
                    n,
                    stats.used,
                    dict(books.loaded),
                    live,
                )
                await daemon_agrees(broker, stats.used["default"])
                await broker.clear()
                stats = await quiet(broker)
                assert stats.used == {"default": 0}, (n, stats.used)
                await daemon_agrees(broker, 0)
                assert sum(books.loaded.values()) == 0, (n, dict(books.loaded))
                if got and not caught:
                    break
                n += 1


# ------------------------------------------------------------------ 3. a process dies


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SO_PEERCRED, /proc")
@pytest.mark.parametrize("anyio_backend", [pytest.param(("asyncio", {}), id="asyncio")])
@pytest.mark.parametrize("moment", ["holding", "waiting", "joined"])
async def test_a_process_killed_mid_request_gives_its_bytes_back(procs: Procs, moment: str) -> None:
    """Process A holds 60 of 100. Process V, about to be killed, either holds a lease
    (``holding``: 40), waits for a grant that needs A's bytes (``waiting``: 60), or waits
    for a grant while holding 40 (``joined``: holds ``h`` 40, waits for ``w`` 60). Process
    O waits for 60. A lets go, V is killed with SIGKILL: O is served, the daemon's books
    add up and, once all exit, charge nothing."""
    with anyio.fail_after(60):
        async with serving(procs.socket, BUDGET) as daemon:
            holder = procs.steps(
                "holder",
                {"do": "connect"},
                {"do": "acquire", "key": "a", "size": 60},
                {"do": "wait", "signal": "let-a-go"},
                {"do": "release", "label": "a"},
                {"do": "wait", "signal": "finish"},
            )
            await holder.wait_for("acquired", key="a")
            v_steps: list[dict[str, Any]] = [{"do": "connect"}]
            if moment in ("holding", "joined"):
                v_steps.append({"do": "acquire", "key": "h", "size": 40})
            if moment in ("waiting", "joined"):
                v_steps.append({"do": "acquire", "key": "w", "size": 60, "background": True})
            v_steps.append({"do": "wait", "signal": "never"})
            victim = procs.steps("victim", *v_steps)
            if moment != "waiting":
                await victim.wait_for("acquired", key="h")

            def waiting(pid: int) -> bool:
                return any(
                    e["pid"] == pid and e["state"] == "waiting" for e in daemon.listing()["entries"]
                )

            if moment != "holding":
                await victim.wait_for("acquiring", key="w")
                await wait_until(lambda: waiting(victim.pid), limit=20)
            other = procs.steps(
                "other",
                {"do": "connect"},
                {"do": "acquire", "key": "o", "size": 60, "timeout": 30},
                {"do": "stats"},
                {"do": "wait", "signal": "finish"},
            )
            await wait_until(lambda: waiting(other.pid), limit=20)
            check_books(daemon)
            victim.kill(signal.SIGKILL)
            await victim.exit()
            procs.signal("let-a-go")
            await holder.wait_for("let go", label="a")
            acquired = await other.wait_for("acquired", key="o")
            assert acquired["value"] == f"o@{other.pid}"
            check_books(daemon)
            await wait_until(
                lambda: victim.pid not in {e["pid"] for e in daemon.listing()["entries"]}
            )
            charged = Counter[int]()
            for entry in daemon.listing()["entries"]:
                if entry["state"] != "ready" or entry["leases"]:
                    charged[entry["pid"]] += sum(entry["charge"].values())
            assert charged == {other.pid: 60}, charged
            assert daemon.totals()["used"]["default"] <= BUDGET
            procs.signal("finish")
            assert await other.exit() == 0, other.stderr()
            assert await holder.exit() == 0, holder.stderr()
            await wait_until(lambda: not daemon.connections, limit=20)
            check_books(daemon)
            # V's bytes stay booked until the daemon sees V ended (``Daemon.keep``): its
            # socket closes as it exits, a poll later it is gone. Bounded, not timed.
            await wait_until(lambda: daemon.totals()["used"] == {"default": 0}, limit=20)
            check_books(daemon)


async def test_two_lease_holders_waiting_on_each_other_get_a_deadlock_error(kind: str) -> None:
    """Task 1 holds ``a`` (60 of 100) and waits for room ``b`` fills; task 2 holds ``b``
    (40) and asks for room ``a`` fills: task 2 gets ``DeadlockError`` at once (naming
    the cycle), ends its lease, and task 1 is served; nothing leaks."""
    books = Books()
    with anyio.fail_after(10):
        async with (
            open_broker(kind, BUDGET) as broker,
            broker.cache("c", books.release) as c,
            anyio.create_task_group() as tg,
        ):
            first_waits = anyio.Event()
            b_held = anyio.Event()
            served: list[str] = []

            async def first() -> None:
                async with c.acquire("a", load=books.loader("a", 60), size=60):
                    await b_held.wait()
                    first_waits.set()
                    async with c.acquire("x", load=books.loader("x", 40), size=40) as x:
                        served.append(x.value[0])

            tg.start_soon(first)
            async with c.acquire("b", load=books.loader("b", 40), size=40):
                b_held.set()
                await first_waits.wait()
                await wait_until(lambda: broker.stats_nowait().waiting > 0)
                with pytest.raises(DeadlockError, match="would wait for ever") as caught:
                    await c.acquire("y", load=books.loader("y", 60), size=60)
            assert {key for _, key in caught.value.leases} == {"a", "b"}
        assert served == ["x"]
        stats = await quiet(broker)
        assert sum(stats.used.values()) == sum(books.loaded.values()) <= BUDGET


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SO_PEERCRED, /proc")
@pytest.mark.parametrize("anyio_backend", [pytest.param(("asyncio", {}), id="asyncio")])
async def test_two_processes_waiting_on_each_others_leases_get_a_deadlock_error(
    procs: Procs,
) -> None:
    """Process 1 holds ``a`` (60 of 100) and waits for room ``b`` fills; process 2 holds
    ``b`` (40) and asks for room ``a`` fills: the daemon refuses process 2's request at
    once with ``DeadlockError``; process 2 lets ``b`` go and process 1 is served."""
    with anyio.fail_after(60):
        async with serving(procs.socket, BUDGET) as daemon:
            first = procs.steps(
                "first",
                {"do": "connect"},
                {"do": "acquire", "key": "a", "size": 60},
                {"do": "wait", "signal": "b-held"},
                {"do": "acquire", "key": "x", "size": 40, "timeout": 30},
                {"do": "wait", "signal": "finish"},
            )
            await first.wait_for("acquired", key="a")
            second = procs.steps(
                "second",
                {"do": "connect"},
                {"do": "acquire", "key": "b", "size": 40},
                {"do": "wait", "signal": "x-waits"},
                {"do": "acquire", "key": "y", "size": 60, "timeout": 30},
                {"do": "release", "label": "b"},
                {"do": "wait", "signal": "finish"},
            )
            await second.wait_for("acquired", key="b")
            procs.signal("b-held")
            await first.wait_for("acquiring", key="x")
            await wait_until(
                lambda: any(e["state"] == "waiting" for e in daemon.listing()["entries"]),
                limit=20,
            )
            procs.signal("x-waits")
            refused = await second.wait_for("error", key="y")
            assert refused["type"] == "DeadlockError", refused
            assert "would wait for ever" in refused["message"], refused
            await second.wait_for("let go", label="b")
            await first.wait_for("acquired", key="x")
            check_books(daemon)
            procs.signal("finish")
