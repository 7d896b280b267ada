"""Fault injection against the real async broker, on asyncio and trio.

A Hypothesis state machine drives a live ``Broker`` through a blocking portal:
requests with loaders that succeed, fail, are slow or hang; releasers that
succeed, raise, hang past the release timeout or acknowledge late; leases
ended, waiters cancelled, keys invalidated, the clock advanced and idle
entries swept, quarantined entries written off.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import anyio
import anyio.from_thread
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from cachebroker import Broker, BrokerError, Cache

BUDGET = 100
RELEASE_TIMEOUT = 0.05
KEYS = st.sampled_from(["a", "b", "c", "d", "e"])
LOAD_MODES = st.sampled_from(["ok", "ok", "ok", "fail", "slow", "hang"])
RELEASE_MODES = st.sampled_from(["ok", "ok", "ok", "raise", "hang", "late"])


class LoadFault(Exception):
    """What an injected failing loader raises."""


class ReleaseFault(Exception):
    """What an injected failing releaser raises."""


class Value:
    """A loaded value that knows who holds it and how its release will behave."""

    def __init__(self, key: str, release_mode: str) -> None:
        self.key = key
        self.release_mode = release_mode
        self.holders = 0


class Request:
    def __init__(self, key: str, size: int) -> None:
        self.key = key
        self.size = size
        self.scope = anyio.CancelScope()
        self.hold = anyio.Event()
        self.holding = False
        self.finished = False
        self.outcome: object = None


class BrokerMachine(RuleBasedStateMachine):
    """Invariants, checked after every step and at the end:

    * no over-commit in any space, and ``used`` equals the sum of the charges
      of the entries that hold memory (``Core.check``);
    * no value is asked to release while a lease on it is held;
    * once every task has finished, no waiter, lease or reservation is left;
    * every task finishes within a bound (the teardown is under ``fail_after``).
    """

    backend: ClassVar[tuple[str, dict[str, Any]]] = ("asyncio", {})

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.violations: list[str] = []
        self.requests: list[Request] = []
        self._portal_cm: AbstractContextManager[anyio.from_thread.BlockingPortal] = (
            anyio.from_thread.start_blocking_portal(*self.backend)
        )
        self.portal = self._portal_cm.__enter__()
        self.stop = self.portal.call(anyio.Event)
        self.host, _ = self.portal.start_task(self._host)

    # ------------------------------------------------------------ the world

    async def _host(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        self.broker = Broker(
            budget=BUDGET,
            idle_ttl=30,
            release_timeout=RELEASE_TIMEOUT,
            clock=lambda: self.now,
        )
        async with self.broker, self.broker.cache("p", self._release) as cache:
            self.cache: Cache = cache
            async with anyio.create_task_group() as tg:
                self.tg = tg
                task_status.started()
                await self.stop.wait()

    async def _release(self, key: str, value: Value) -> None:
        if value.holders:
            self.violations.append(f"{key} asked to release while leased")
        if value.release_mode == "raise":
            raise ReleaseFault(key)
        if value.release_mode == "hang":
            await anyio.sleep_forever()
        if value.release_mode == "late":
            await anyio.sleep(RELEASE_TIMEOUT * 1.5)

    async def _request(self, request: Request, load_mode: str, release_mode: str) -> None:
        async def load() -> Value:
            await anyio.lowlevel.checkpoint()
            if load_mode == "fail":
                raise LoadFault(request.key)
            if load_mode == "slow":
                await anyio.sleep(0.005)
            if load_mode == "hang":
                await anyio.sleep_forever()
            return Value(request.key, release_mode)

        try:
            with request.scope:
                async with self.cache.acquire(request.key, load=load, size=request.size) as lease:
                    value: Value = lease.value
                    value.holders += 1
                    request.holding = True
                    try:
                        await request.hold.wait()
                    finally:
                        value.holders -= 1
                        request.holding = False
                request.outcome = "released"
        except (LoadFault, BrokerError) as exc:
            request.outcome = exc
        finally:
            request.finished = True

    def _run(self, func: Any, *args: Any) -> Any:
        result = self.portal.call(func, *args)
        self.portal.call(self._let_tasks_run)
        return result

    @staticmethod
    async def _let_tasks_run() -> None:
        for _ in range(5):
            await anyio.lowlevel.checkpoint()

    # ----------------------------------------------------------------- rules

    @rule(
        key=KEYS,
        size=st.integers(0, 60),
        load_mode=LOAD_MODES,
        release_mode=RELEASE_MODES,
    )
    def acquire(self, key: str, size: int, load_mode: str, release_mode: str) -> None:
        request = self.portal.call(Request, key, size)
        self.requests.append(request)
        self._run(self._spawn, request, load_mode, release_mode)

    def _spawn(self, request: Request, load_mode: str, release_mode: str) -> None:
        # Returns nothing on purpose: the portal would await a returned task handle.
        self.tg.start_soon(self._request, request, load_mode, release_mode)

    # Rules choose among all requests, whatever their progress: what a task has
    # reached depends on timing, and Hypothesis must replay the same choices.
    # Ending a lease not yet held ends it as soon as it is; cancelling a
    # finished request does nothing.

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def end_lease(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(self.requests))
        self._run(request.hold.set)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(self.requests))
        self._run(request.scope.cancel)

    @rule(key=KEYS)
    def invalidate(self, key: str) -> None:
        self._run(self.cache.invalidate, key)

    @rule(dt=st.sampled_from([1.0, 20.0, 40.0]))
    def advance_clock_and_sweep(self, dt: float) -> None:
        self.now += dt
        self._run(self.broker.evict_idle)

    @rule()
    def let_timeouts_fire(self) -> None:
        self._run(anyio.sleep, RELEASE_TIMEOUT * 1.2)

    @rule(key=KEYS)
    def forget(self, key: str) -> None:
        self._run(self.broker.forget, "p", key)

    # ------------------------------------------------------------ invariants

    @invariant()
    def books_are_exact(self) -> None:
        self.portal.call(self.broker._core.check)
        assert not self.violations, self.violations

    def teardown(self) -> None:
        try:
            self.portal.call(self._finish_everything)
            self.portal.call(self.broker._core.check)
            assert not self.violations, self.violations
        finally:
            self.portal.call(self.stop.set)
            self.host.result(timeout=10)
            self._portal_cm.__exit__(None, None, None)
        core = self.broker._core
        assert all(
            space.used == sum(e.charge.get(n, 0) for e in core.quarantined)
            for n, space in core.spaces.items()
        )

    async def _finish_everything(self) -> None:
        with anyio.fail_after(5):
            for request in self.requests:
                request.hold.set()
            for request in self.requests:
                if not request.finished and not request.holding:
                    request.scope.cancel()
            while not all(r.finished for r in self.requests):
                await anyio.sleep(0.001)
            core = self.broker._core
            while any(e.state.value in ("loading", "releasing") for e in core.entries()):
                await anyio.sleep(0.001)
        core = self.broker._core
        assert not core.queue, core.queue
        assert not any(entry.leases for entry in core.busy), core.busy
        assert self.broker.stats_nowait().waiting == 0


class AsyncioBrokerMachine(BrokerMachine):
    backend = ("asyncio", {})


class TrioBrokerMachine(BrokerMachine):
    backend = ("trio", {})


MACHINES = {"asyncio": AsyncioBrokerMachine, "trio": TrioBrokerMachine}


def _machines() -> Iterator[Any]:
    import os

    chosen = os.environ.get("CACHEBROKER_TEST_BACKENDS")
    for name, machine in MACHINES.items():
        if chosen and name not in chosen.split(","):
            continue
        yield pytest.param(machine, id=name)


@pytest.mark.parametrize("machine", list(_machines()))
def test_broker_survives_injected_faults(machine: type[BrokerMachine]) -> None:
    base = settings()
    run_state_machine_as_test(
        machine,
        settings=settings(
            base,
            max_examples=max(10, base.max_examples // 3),
            stateful_step_count=30,
            deadline=None,
        ),
    )
