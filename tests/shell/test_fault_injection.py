"""Fault injection against the real async broker, on asyncio, uvloop and trio.

A Hypothesis state machine drives a live ``Broker`` through a blocking portal.
Loaders succeed, fail, are slow, hang, run in worker threads (some blocked
until told to return, some never returning before the broker closes), raise a
``CancelledError`` the broker did not cause, or acquire their own key
(directly, through a helper coroutine, or from their worker thread).
Releasers succeed, raise, hang past the release timeout, acknowledge late or
raise a foreign ``CancelledError``. Sizes are declared, measured after the
load, or unknown until measured. One space is bound to a probe whose reads
fail while told to and whose device other processes fill. Lease holders ask
for a second key; leases are dropped without being ended; short-lived caches
close while their worker threads still run; process-level exceptions
(``KeyboardInterrupt``, ``SystemExit``, ...) end brokers of their own; leases
end, waiters are cancelled, keys invalidated, the clock advanced and idle
entries swept, quarantined entries written off (or not).

``Core.check()`` runs after every step of the core (each call the shell makes
into it), not only between rules.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import itertools
import logging
import os
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Hashable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, ClassVar

import anyio
import anyio.from_thread
import anyio.lowlevel
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

from cachebroker import (
    AcquireTimeout,
    Broker,
    BrokerClosed,
    Cache,
    DeadlockError,
    LoadFailed,
    OutOfSpace,
    RequestTooLarge,
)
from cachebroker._core import State, check_after_every_step
from cachebroker.probes import Probe
from tests.brokers import open_broker

BUDGET = 100
DEVICE_TOTAL = 80
RELEASE_TIMEOUT = 0.05
#: How long a loader's own (nested) acquire may wait: a thread cannot be
#: cancelled, so a loader blocked in it must not wait forever.
INNER_TIMEOUT = 0.25
KEYS = st.sampled_from(["a", "b", "c", "d", "e"])
#: Keys that only lease holders ask for as their second lease (always loadable).
SECOND_KEYS = st.sampled_from(["x", "y"])
SIZES = st.integers(0, 60)
LOAD_MODES = st.sampled_from(
    [
        *["ok"] * 4,
        "fail",
        "slow",
        "hang",
        "thread",
        "blocked",
        "cancel",
        "self",
        "self_helper",
        "self_thread",
    ]
)
RELEASE_MODES = st.sampled_from(["ok", "ok", "ok", "raise", "hang", "late", "cancel"])
SIZE_MODES = st.sampled_from(["declared", "declared", "measure", "unknown"])
SPACES = st.sampled_from(["default", "default", "dev"])
REQUESTS = st.fixed_dictionaries(
    {
        "key": KEYS,
        "size": SIZES,
        "weight": SIZES,
        "space": SPACES,
        "load_mode": LOAD_MODES,
        "release_mode": RELEASE_MODES,
        "size_mode": SIZE_MODES,
        "timeout": st.sampled_from([None, None, None, 0.02]),
        "then": st.none() | st.none() | st.tuples(SECOND_KEYS, SIZES),
    }
)
#: How many blocked worker threads an example may have at once (anyio lends 40).
MAX_BLOCKED = 8


class LoadFault(Exception):
    """What an injected failing loader raises."""


class ReleaseFault(Exception):
    """What an injected failing releaser raises."""


class Meltdown(BaseException):
    """A process-level exception of the application's own."""


PROCESS_LEVEL = [KeyboardInterrupt, SystemExit, GeneratorExit, Meltdown]
#: Where the plugin's code raises one: an async loader, a plain one (in its
#: worker thread), the size callable, the releaser.
FATAL_PLACES = ["loader", "thread", "measure", "release"]

QUIET = logging.getLogger("cachebroker.tests.fault_injection")
QUIET.setLevel(logging.CRITICAL + 1)  # the listener counts what matters
QUIET.propagate = False


class Device:
    """A probed device: ``(total, free)`` bytes, where loaded values really take memory."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.allocated = 0
        self.external = 0  # other processes' memory
        self.failing = False
        self.reads = 0
        self.failed_reads = 0
        self._lock = threading.Lock()  # threaded loaders allocate too

    def read(self) -> tuple[int, int]:
        self.reads += 1
        if self.failing:
            self.failed_reads += 1
            raise OSError("NVML_ERROR_UNKNOWN: an unexpected error")
        return self.total, max(0, self.total - self.allocated - self.external)

    def allocate(self, amount: int) -> None:
        with self._lock:
            self.allocated += amount


class Value:
    """A loaded value that knows who holds it and how its release will behave."""

    def __init__(
        self, key: str, release_mode: str, weight: int, space: str, device: Device
    ) -> None:
        self.key = key
        self.release_mode = release_mode
        self.weight = weight
        self.space = space
        self.device = device
        self.holders = 0
        if space == "dev":
            device.allocate(weight)

    def free(self) -> None:
        if self.space == "dev":
            self.device.allocate(-self.weight)
            self.space = "freed"


class Stuck:
    """A plain loader's worker thread, blocked until ``finish()``.

    It gives up after ``GUARD`` seconds, so that a broker waiting for it (the
    defect under test) cannot hang the run. ``never``: it is let go only
    after its broker closed.
    """

    GUARD = 20.0

    def __init__(self, never: bool, fails: bool) -> None:
        self.never = never
        self.fails = fails
        self.started = threading.Event()
        self.gate = threading.Event()
        self.returned = threading.Event()
        self.cache = "p"

    def wait(self) -> None:
        self.started.set()
        try:
            self.gate.wait(self.GUARD)
            if self.fails:
                raise LoadFault("thread")
        finally:
            self.returned.set()

    def finish(self) -> None:
        self.gate.set()


class Request:
    """One task's request and what became of it (``outcome``, ``second``)."""

    def __init__(
        self,
        cache: Cache,
        key: str,
        size: int,
        *,
        space: str = "default",
        weight: int | None = None,
        load_mode: str = "ok",
        release_mode: str = "ok",
        size_mode: str = "declared",
        timeout: float | None = None,
        then: tuple[str, int] | None = None,
        stuck: Stuck | None = None,
    ) -> None:
        self.cache = cache
        self.key = key
        self.size = size
        self.space = space
        self.weight = size if weight is None else weight
        self.load_mode = load_mode
        self.release_mode = release_mode
        self.size_mode = size_mode
        self.timeout = timeout
        self.then = then
        self.stuck = stuck
        self.scope = anyio.CancelScope()
        self.hold = anyio.Event()
        self.holding = False
        self.finished = False
        self.checked = False
        self.outcome: object = None
        #: The second lease's acquire: pending since when (loop time), and its outcome.
        self.second_since: float | None = None
        self.second: object = None


def caused_by(error: BaseException | None, kind: type[BaseException]) -> BaseException | None:
    """The first exception of ``kind`` in ``error``'s chain of causes."""
    seen = 0
    while error is not None and seen < 20:
        if isinstance(error, kind):
            return error
        error = error.__cause__ or error.__context__
        seen += 1
    return None


def undocumented(outcome: object, request: Request, *, second: bool = False) -> str | None:
    """Why ``outcome`` is not a documented outcome of ``request``, or ``None`` when it is."""
    if outcome in ("served", "cancelled"):
        return None
    if not isinstance(outcome, BaseException):
        return f"no outcome ({outcome!r})"
    if isinstance(outcome, RequestTooLarge):
        return "no size here exceeds a whole budget"
    if isinstance(outcome, OutOfSpace):
        # Quarantined bytes refuse what only forget() could serve (the message
        # says so); a loader's own nested request may meet that and give up.
        found = caused_by(outcome, OutOfSpace)
        while found is not None and "forget" not in str(found):
            found = caused_by(found.__cause__ or found.__context__, OutOfSpace)
        return None if found is not None else "OutOfSpace without a word about forget()"
    if isinstance(outcome, DeadlockError):
        if "from inside the loader" in str(outcome):
            return None  # a loader that asked for its own key (its requesters share the error)
        if second and "leased by the requesting task itself" in str(outcome):
            return None  # only the holder's own lease (or forget()) could make room
        return "DeadlockError for a request that waits on nobody"
    if isinstance(outcome, AcquireTimeout):
        if request.timeout is not None or f"within {INNER_TIMEOUT:g}s" in str(outcome):
            return None
        return "AcquireTimeout without a timeout"
    if isinstance(outcome, LoadFault):
        return None if outcome.args[0] in (request.key, "thread") else "another key's load error"
    if isinstance(outcome, LoadFailed):
        if isinstance(outcome.__cause__, asyncio.CancelledError):
            return None  # a loader's own CancelledError, not the broker's
        return f"LoadFailed caused by {outcome.__cause__!r}"
    if isinstance(outcome, BrokerClosed):
        return None if request.cache.name != "p" else "BrokerClosed while the cache is open"
    return f"undocumented {type(outcome).__name__}: {outcome!r}"


class BrokerMachine(RuleBasedStateMachine):
    """Invariants, checked after every step and at the end:

    * the books are exact after every step of the core (``Core.check``): no
      over-commit, ``used`` equals the charges of the entries holding memory;
    * no value is asked to release while a lease on it is held;
    * every request is served, cancelled, or fails with a documented error;
    * the broker keeps running: no fault of a loader, releaser or probe
      cancels anything but its own load or release;
    * a probe whose reads fail is logged each time and keeps its space at the
      capacity of its last good reading;
    * loads of unknown size run one at a time;
    * a dropped lease warns, naming ``cache:key``, and is ended;
    * a cache whose worker thread still runs closes without waiting for it;
    * once every task has finished, no waiter, lease or reservation is left,
      everything finishes within a bound (the teardown is under
      ``fail_after``), and threads that never returned are quarantined when
      the broker closes.
    """

    backend: ClassVar[tuple[str, dict[str, Any]]] = ("asyncio", {})

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.violations: list[str] = []
        self.requests: list[Request] = []
        self.stuck: list[Stuck] = []
        self.device = Device(DEVICE_TOTAL)
        self.probe_failures_logged = 0
        self.frozen_capacity: int | None = None
        self.unknown_running = 0
        #: (cache, key) pairs measured so far: later loads of them reserve that size.
        self.measured: set[tuple[str, Hashable]] = set()
        self.unknown_lock = threading.Lock()
        self.short_caches = itertools.count()
        self._portal_cm: AbstractContextManager[anyio.from_thread.BlockingPortal] = (
            anyio.from_thread.start_blocking_portal(*self.backend)
        )
        self.portal = self._portal_cm.__enter__()
        self.stop = self.portal.call(anyio.Event)
        self.host, _ = self.portal.start_task(self._host)

    # ------------------------------------------------------------ the world

    async def _host(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        self.broker = Broker(
            budget={"default": BUDGET, "dev": Probe(self.device.read, name="flaky")},
            idle_ttl=30,
            release_timeout=RELEASE_TIMEOUT,
            clock=lambda: self.now,
            logger=QUIET,
            memory_wait=0.03,
            probe_interval=0.01,
        )
        self.broker.add_listener(self._listen)
        check_after_every_step(self.broker._core, self.violations)
        async with self.broker, self.broker.cache("p", self._release) as cache:
            self.cache: Cache = cache
            async with anyio.create_task_group() as tg:
                self.tg = tg
                task_status.started()
                await self.stop.wait()

    def _listen(self, event: str, fields: Mapping[str, Any]) -> None:
        if event == "cachebroker.probe.failed":
            self.probe_failures_logged += 1

    async def _release(self, key: str, value: Value) -> None:
        if value.holders:
            self.violations.append(f"{key} asked to release while leased")
        if value.release_mode == "raise":
            raise ReleaseFault(key)
        if value.release_mode == "cancel":
            await anyio.lowlevel.checkpoint()
            raise asyncio.CancelledError()  # a library's own, not the broker's
        if value.release_mode == "hang":
            await anyio.sleep_forever()
        if value.release_mode == "late":
            await anyio.sleep(RELEASE_TIMEOUT * 1.5)
        value.free()

    def _size(self, request: Request) -> dict[str, Any]:
        declared = {request.space: request.size}
        measure = functools.partial(self._measure, request.cache.name)
        if request.size_mode == "measure":
            return {"size": declared, "measure": measure}
        if request.size_mode == "unknown":
            return {"size": measure}
        return {"size": declared}

    def _measure(self, cache: str, value: Value) -> dict[str, int]:
        self.measured.add((cache, value.key))
        return {value.space: value.weight}

    def _loader(self, request: Request, depth: int = 0) -> Callable[[], Any]:
        """The loader ``request`` injects (``depth``: how deep in a loader's own requests)."""
        mode = request.load_mode if depth < 3 else "ok"
        # Of unknown size only if never measured: the broker reserves a key's
        # remembered size (decided now, when the request is made).
        unknown = (
            request.size_mode == "unknown"
            and depth == 0
            and (request.cache.name, request.key) not in self.measured
        )

        def make() -> Value:
            return Value(
                request.key, request.release_mode, request.weight, request.space, self.device
            )

        async def inner() -> Value:
            # A loader's own request for its key: same loader, one level deeper.
            lease = request.cache.acquire(
                request.key,
                load=self._loader(request, depth + 1),
                timeout=INNER_TIMEOUT,
                **self._size(request),
            )
            async with lease:
                return make()  # its own value: two entries must not share one

        async def load() -> Value:
            self._unknown_starts(unknown)
            try:
                await anyio.lowlevel.checkpoint()
                if mode == "fail":
                    raise LoadFault(request.key)
                if mode == "cancel":
                    raise asyncio.CancelledError()  # a library's own, not the broker's
                if mode == "slow":
                    await anyio.sleep(0.005)
                if mode == "hang":
                    await anyio.sleep_forever()
                if mode == "self":
                    async with request.cache.acquire(
                        request.key,
                        load=self._loader(request, depth + 1),
                        timeout=INNER_TIMEOUT,
                        **self._size(request),
                    ):
                        pass
                if mode == "self_helper":
                    return await inner()
                return make()
            finally:
                self._unknown_ends(unknown)

        def load_in_thread() -> Value:
            self._unknown_starts(unknown)
            try:
                if mode == "blocked" and request.stuck is not None:
                    request.stuck.wait()
                if mode == "self_thread":
                    return anyio.from_thread.run(inner)
                return make()
            finally:
                self._unknown_ends(unknown)

        return load_in_thread if mode in ("thread", "blocked", "self_thread") else load

    def _unknown_starts(self, unknown: bool) -> None:
        if not unknown:
            return
        with self.unknown_lock:
            self.unknown_running += 1
            if self.unknown_running > 1:
                self.violations.append("two loads of unknown size ran at once")

    def _unknown_ends(self, unknown: bool) -> None:
        if unknown:
            with self.unknown_lock:
                self.unknown_running -= 1

    async def _request(self, request: Request) -> None:
        try:
            with request.scope:
                lease = request.cache.acquire(
                    request.key,
                    load=self._loader(request),
                    timeout=request.timeout,
                    **self._size(request),
                )
                async with lease:
                    value: Value = lease.value
                    value.holders += 1
                    request.holding = True
                    try:
                        if request.then is not None:
                            await self._second(request, *request.then)
                        await request.hold.wait()
                    finally:
                        value.holders -= 1
                        request.holding = False
            request.outcome = "cancelled" if request.scope.cancelled_caught else "served"
        except Exception as exc:  # judged by books_are_exact: only documented errors
            request.outcome = exc
        finally:
            request.finished = True

    async def _second(self, request: Request, key: str, size: int) -> None:
        """A lease holder asks for another key (never behind a waiter blocked on its lease)."""
        second = Request(request.cache, key, size, release_mode=request.release_mode)
        request.second_since = anyio.current_time()
        try:
            async with request.cache.acquire(key, load=self._loader(second), size=size) as lease:
                request.second_since = None
                request.second = "served"
                value: Value = lease.value
                value.holders += 1
                try:
                    await request.hold.wait()
                finally:
                    value.holders -= 1
        except Exception as exc:
            request.second = exc
        finally:
            request.second_since = None

    def _run(self, func: Any, *args: Any) -> Any:
        result = self.portal.call(func, *args)
        self.portal.call(self._let_tasks_run)
        return result

    @staticmethod
    async def _let_tasks_run() -> None:
        for _ in range(5):
            await anyio.lowlevel.checkpoint()

    def _spawn(self, request: Request) -> None:
        # Returns nothing on purpose: the portal would await a returned task handle.
        self.tg.start_soon(self._request, request)

    # ----------------------------------------------------------------- rules

    @rule(specs=st.lists(REQUESTS, min_size=1, max_size=3))
    def acquire(self, specs: list[dict[str, Any]]) -> None:
        """One to three tasks ask for keys (concurrently: they start in one step)."""
        for drawn in specs:
            spec = dict(drawn)  # (Hypothesis prints what it drew: leave that alone)
            if spec["load_mode"] == "blocked":
                if sum(not s.gate.is_set() for s in self.stuck) >= MAX_BLOCKED:
                    spec["load_mode"] = "thread"
                else:
                    spec["stuck"] = Stuck(never=False, fails=False)
                    self.stuck.append(spec["stuck"])
            if spec["size_mode"] == "declared":
                spec["weight"] = spec["size"]
            if spec["space"] != "default":
                spec["then"] = None
            request = self.portal.call(functools.partial(Request, self.cache, **spec))
            self.requests.append(request)
            self.portal.call(self._spawn, request)
        self.portal.call(self._let_tasks_run)

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

    @rule(
        key=KEYS,
        size=SIZES,
        release_mode=RELEASE_MODES,
        then=st.none() | st.tuples(KEYS, SIZES),
    )
    def drop_lease(
        self, key: str, size: int, release_mode: str, then: tuple[str, int] | None
    ) -> None:
        """A task lets its lease be garbage-collected: it warns and is ended on the loop.

        ``then``: the task asks for a key again at once. It holds nothing any
        more, so nothing may tell it that its own lease is in the way.
        """
        self._run(self._drop_lease, key, size, release_mode, then)

    async def _drop_lease(
        self, key: str, size: int, release_mode: str, then: tuple[str, int] | None
    ) -> None:
        request = Request(self.cache, key, size, release_mode=release_mode, timeout=0.05)
        try:
            lease = await self.cache.acquire(
                key, load=self._loader(request), size=size, timeout=0.05
            )
        except Exception as exc:  # AcquireTimeout, or a joined load's error
            reason = undocumented(exc, request)
            if reason is not None:
                self.violations.append(f"dropped lease on {key!r}: {reason}: {exc!r}")
            return
        entry, holder = lease._entry, lease._task
        assert entry is not None
        value: Value = lease.value
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            del lease
            gc.collect()
        dropped = [
            w
            for w in caught
            if issubclass(w.category, ResourceWarning) and f"p:{key!r}" in str(w.message)
        ]
        if len(dropped) != 1:
            self.violations.append(f"dropping a lease on {key!r} warned {caught!r}")
        if then is not None:
            again = Request(self.cache, then[0], then[1], release_mode=release_mode, timeout=0.05)
            try:
                async with self.cache.acquire(
                    again.key, load=self._loader(again), size=again.size, timeout=0.05
                ):
                    pass
            except Exception as exc:
                reason = undocumented(exc, again)
                if reason is not None:
                    self.violations.append(f"after dropping a lease: {reason}: {exc!r}")
        # Ended on the loop: by a callback (on trio, through its wake-up
        # socket), or by this task's next request.
        for _ in range(200):
            if holder not in entry.holders:
                break
            await anyio.sleep(0.005)
        else:
            self.violations.append(f"the dropped lease on {key!r} was not ended: {entry!r}")
        del value

    @precondition(lambda self: sum(not s.gate.is_set() for s in self.stuck) < MAX_BLOCKED)
    @rule(
        key=KEYS,
        size=st.integers(0, 40),
        release_mode=RELEASE_MODES,
        requester_leaves=st.booleans(),
        never=st.booleans(),
        fails=st.booleans(),
    )
    def close_a_cache_while_its_thread_runs(
        self,
        key: str,
        size: int,
        release_mode: str,
        requester_leaves: bool,
        never: bool,
        fails: bool,
    ) -> None:
        """A short-lived cache closes while its plain loader's worker thread is blocked.

        Its values are charged to the probed space, so that a thread that never
        returns holds no bytes a lease holder's second request needs.
        """
        stuck = Stuck(never=never, fails=fails)
        stuck.cache = f"t{next(self.short_caches)}"
        self.stuck.append(stuck)
        self._run(self._short_cache, stuck, key, size, release_mode, requester_leaves)

    async def _short_cache(
        self, stuck: Stuck, key: str, size: int, release_mode: str, requester_leaves: bool
    ) -> None:
        core = self.broker._core
        with anyio.fail_after(5):
            async with self.broker.cache(stuck.cache, self._release) as cache:
                request = Request(
                    cache,
                    key,
                    size,
                    space="dev",
                    load_mode="blocked",
                    release_mode=release_mode,
                    stuck=stuck,
                )
                self.requests.append(request)
                self._spawn(request)
                # Until its thread runs, unless it waits for space (or failed fast).
                while not stuck.started.is_set() and not request.finished:
                    entry = core.owners[cache.name].entries.get(key)
                    if entry is not None and entry.state is State.WAITING:
                        break
                    await anyio.sleep(0.001)
                if requester_leaves:
                    request.scope.cancel()
                    await self._let_tasks_run()
        running = stuck.started.is_set() and not stuck.returned.is_set()
        if running and not stuck.gate.is_set():
            orphans = [e for e in core.orphans if e.cache == stuck.cache]
            if [e.state for e in orphans] != [State.RELEASING]:
                self.violations.append(f"{stuck.cache}: abandoned load not releasing: {orphans}")

    @precondition(lambda self: any(not s.gate.is_set() for s in self.stuck))
    @rule(data=st.data())
    def let_a_thread_return(self, data: st.DataObject) -> None:
        stuck = data.draw(st.sampled_from([s for s in self.stuck if not s.gate.is_set()]))
        stuck.finish()
        if stuck.started.is_set():
            stuck.returned.wait(5)
        self._run(self._let_tasks_run)

    @rule(failing=st.booleans())
    def probe_reads_fail(self, failing: bool) -> None:
        self._run(self._probe_failing, failing)

    def _probe_failing(self, failing: bool) -> None:
        if failing and not self.device.failing:
            self.frozen_capacity = self.broker._core.spaces["dev"].capacity
        self.device.failing = failing

    @rule(external=st.sampled_from([0, 0, 20, 50]))
    def other_processes_take_device_memory(self, external: int) -> None:
        self._run(setattr, self.device, "external", external)

    @rule(kind=st.sampled_from(PROCESS_LEVEL), where=st.sampled_from(FATAL_PLACES))
    def process_level_exception_ends_its_broker(
        self, kind: type[BaseException], where: str
    ) -> None:
        """A loader, size callable or releaser raises ``KeyboardInterrupt`` & co.

        On asyncio the first two stop the event loop itself, so the scenario
        runs in an event loop and a broker of its own.
        """
        run_process_level_scenario(self.backend, kind, where)

    # ------------------------------------------------------------ invariants

    @invariant()
    def books_are_exact(self) -> None:
        self.portal.call(self.broker._core.check)
        assert not self.violations, self.violations
        assert not self.host.done(), self.host.exception()
        for request in self.requests:
            if request.finished and not request.checked:
                request.checked = True
                reason = undocumented(request.outcome, request)
                assert reason is None, (request.load_mode, reason, request.outcome)
                if request.then is not None and request.second is not None:
                    reason = undocumented(request.second, request, second=True)
                    assert reason is None, ("second lease", reason, request.second)

    @invariant()
    def failing_probe_keeps_its_last_good_reading(self) -> None:
        core = self.broker._core
        assert self.probe_failures_logged == self.device.failed_reads
        if self.device.failing:
            assert core.spaces["dev"].capacity == self.frozen_capacity

    def teardown(self) -> None:
        never = [s for s in self.stuck if s.never and not s.gate.is_set()]
        try:
            for stuck in self.stuck:
                if not stuck.never:
                    stuck.finish()
            self.portal.call(self._finish_everything, {s.cache for s in never})
            self.portal.call(self.broker._core.check)
            assert not self.violations, self.violations
            self.books_are_exact()
        except BaseException:
            # Whatever is stuck must not wedge the portal and hide this failure.
            for stuck in self.stuck:
                stuck.finish()
            self.portal.call(self.tg.cancel_scope.cancel)
            self.portal.call(self.stop.set)
            with contextlib.suppress(Exception):
                self.host.result(timeout=10)
            self._portal_cm.__exit__(*sys.exc_info())
            raise
        self.portal.call(self.stop.set)
        try:
            self.host.result(timeout=10)
        finally:
            self._portal_cm.__exit__(None, None, None)
            for stuck in self.stuck:
                stuck.finish()
                if stuck.started.is_set():
                    assert stuck.returned.wait(Stuck.GUARD + 5)
        core = self.broker._core
        core.check()
        assert not self.violations, self.violations
        assert all(
            space.used == sum(e.charge.get(n, 0) for e in core.quarantined)
            for n, space in core.spaces.items()
        )
        # Threads that never returned: the broker closed without them, nobody
        # is left to release what they make.
        for entry in core.quarantined:
            if any(s.cache == entry.cache and s.started.is_set() for s in never):
                assert "closed before the threaded load" in str(entry.error), entry.error

    async def _finish_everything(self, never: set[str]) -> None:
        try:
            await self._finish_within_a_bound(never)
        except TimeoutError:
            hung = [
                (r.cache.name, r.key, r.load_mode, "holding" if r.holding else "waiting", r.then)
                for r in self.requests
                if not r.finished
            ]
            entries = list(self.broker._core.entries())
            raise AssertionError(f"hung: {hung}; entries {entries}") from None

    async def _finish_within_a_bound(self, never: set[str]) -> None:
        core = self.broker._core
        with anyio.fail_after(5):
            for request in self.requests:
                request.hold.set()
            while True:
                for request in self.requests:
                    if not request.finished and not request.holding:
                        request.scope.cancel()
                if all(r.finished for r in self.requests):
                    break
                self._break_cycles_between_holders()
                await anyio.sleep(0.001)
            while any(
                e.state in (State.LOADING, State.RELEASING)
                and not (e in core.orphans and e.cache in never)
                for e in core.entries()
            ):
                await anyio.sleep(0.001)
        assert not core.queue, core.queue
        assert not any(entry.leases for entry in core.busy), core.busy
        assert self.broker.stats_nowait().waiting == 0

    def _break_cycles_between_holders(self) -> None:
        """Cancel one of two holders stuck on each other's lease (the application's deadlock).

        A holder stuck alone must be served or refused: the broker promises
        that a task never waits on itself.
        """
        now = anyio.current_time()
        stuck = [
            r
            for r in self.requests
            if not r.finished and r.second_since is not None and now - r.second_since > 0.2
        ]
        if len(stuck) >= 2:
            stuck[-1].scope.cancel()


class AsyncioBrokerMachine(BrokerMachine):
    backend = ("asyncio", {})


class UvloopBrokerMachine(BrokerMachine):
    backend = ("asyncio", {"use_uvloop": True})


class TrioBrokerMachine(BrokerMachine):
    backend = ("trio", {})


MACHINES = {
    "asyncio": AsyncioBrokerMachine,
    "uvloop": UvloopBrokerMachine,
    "trio": TrioBrokerMachine,
}


def _backend_ids() -> list[str]:
    chosen = os.environ.get("CACHEBROKER_TEST_BACKENDS")
    return [name for name in MACHINES if not chosen or name in chosen.split(",")]


@pytest.mark.parametrize("name", _backend_ids())
def test_broker_survives_injected_faults(name: str) -> None:
    if name == "uvloop":
        pytest.importorskip("uvloop")
    base = settings()
    run_state_machine_as_test(
        MACHINES[name],
        settings=settings(
            base,
            max_examples=max(10, base.max_examples // 3),
            stateful_step_count=30,
            deadline=None,
        ),
    )


# ------------------------------------------------------ process-level exceptions


def run_process_level_scenario(
    backend: tuple[str, dict[str, Any]], kind: type[BaseException], where: str
) -> None:
    """``kind`` raised by the plugin's code ends a broker: it propagates, the books are exact.

    Beside the fault, the broker holds an idle entry and a leased one, and
    another request waits for space (in a space of its own, so that it holds
    nothing up), so the books have something to get wrong.
    """
    broker = Broker(budget={"default": 100, "other": 50}, release_timeout=30, logger=QUIET)
    check_failures: list[str] = []
    check_after_every_step(broker._core, check_failures)
    got: list[BaseException] = []

    async def release(key: str, value: Any) -> None:
        await anyio.lowlevel.checkpoint()
        if key == "k" and where == "release":
            raise kind()

    async def fatal_load() -> str:
        await anyio.lowlevel.checkpoint()
        raise kind()

    def fatal_thread() -> str:
        raise kind()

    def fatal_measure(value: object) -> int:
        raise kind()

    async def ok() -> str:
        await anyio.lowlevel.checkpoint()
        return "v"

    async def holder(cache: Cache, held: anyio.Event) -> None:
        async with cache.acquire("held", load=ok, size={"other": 20}):
            held.set()
            await anyio.sleep_forever()

    async def waiter(cache: Cache) -> None:
        with contextlib.suppress(BrokerClosed):
            await cache.acquire("big", load=ok, size={"other": 40})  # waits for "held"

    async def main() -> None:
        with anyio.fail_after(5):
            async with broker, broker.cache("p", release) as cache:
                await (await cache.acquire("idle", load=ok, size=10)).release()
                async with anyio.create_task_group() as tg:
                    held = anyio.Event()
                    tg.start_soon(holder, cache, held)
                    await held.wait()
                    tg.start_soon(waiter, cache)
                    acquire: dict[str, Any] = {"load": ok, "size": 40}
                    if where == "loader":
                        acquire["load"] = fatal_load
                    elif where == "thread":
                        acquire["load"] = fatal_thread
                    elif where == "measure":
                        acquire["size"] = fatal_measure
                    with anyio.fail_after(5, shield=True):
                        try:
                            async with cache.acquire("k", **acquire):
                                pass
                            await cache.invalidate("k")  # the releaser's turn
                        except LoadFailed as exc:
                            got.append(exc)
                    tg.cancel_scope.cancel()

    name, options = backend
    started = time.monotonic()
    with pytest.raises((kind, BaseExceptionGroup)) as info:
        anyio.run(main, backend=name, backend_options=options)
    elapsed = time.monotonic() - started
    assert _contains(info.value, kind), info.value
    assert not check_failures, check_failures
    broker._core.check()
    stats = broker.stats_nowait()
    assert (stats.loading, stats.waiting) == (0, 0), stats
    if where in ("loader", "thread"):
        assert stats.load_failures == 1
        assert ("p", "k") not in stats.quarantined_keys
    else:
        assert ("p", "k") in stats.quarantined_keys  # nobody had time to release it
    loop_survives = name == "trio" or kind not in (KeyboardInterrupt, SystemExit)
    if loop_survives and where != "release":
        assert len(got) == 1 and isinstance(got[0].__cause__, kind), got
    assert elapsed < 15  # a generous bound against waiting release_timeout (30 s)


def _contains(error: BaseException, kind: type[BaseException]) -> bool:
    if isinstance(error, kind):
        return True
    if isinstance(error, BaseExceptionGroup):
        return any(_contains(inner, kind) for inner in error.exceptions)
    return False


# ------------------------------------ found by the machine: a holder waiting on itself


async def _released_with_failure(cache: Cache, key: str, size: int) -> None:
    """Load ``key`` and leave it idle (its release will fail)."""

    async def load() -> str:
        return key

    async with cache.acquire(key, load=load, size=size):
        pass


async def _fail_releases_of_q(key: str, value: Any) -> None:
    await anyio.lowlevel.checkpoint()
    if key == "q":
        raise ReleaseFault(key)


async def _ok() -> str:
    await anyio.lowlevel.checkpoint()
    return "v"


@pytest.mark.anyio
async def test_holder_whose_request_only_its_lease_or_forget_could_serve_is_refused(
    kind: str,
) -> None:
    """Own lease 40 + quarantined 50 of 100: a request for 20 can never be granted."""
    async with (
        open_broker(kind, budget=100) as broker,
        broker.cache("p", _fail_releases_of_q) as cache,
    ):
        await _released_with_failure(cache, "q", 50)
        await cache.invalidate("q")
        assert broker.stats_nowait().quarantined_keys == (("p", "q"),)
        async with cache.acquire("a", load=_ok, size=40):
            with anyio.fail_after(5), pytest.raises(DeadlockError, match="forget") as info:
                await cache.acquire("b", load=_ok, size=20)
            assert "leased by the requesting task itself" in str(info.value)
            assert info.value.leases == (("p", "a"),)
        broker._core.check()
        assert (await broker.stats()).waiting == 0


@pytest.mark.anyio
async def test_holder_left_waiting_by_a_failed_release_is_refused(kind: str) -> None:
    """The victim its request evicts fails to release: only its own lease is left to free."""
    async with (
        open_broker(kind, budget=100) as broker,
        broker.cache("p", _fail_releases_of_q) as cache,
    ):
        await _released_with_failure(cache, "q", 50)
        async with cache.acquire("a", load=_ok, size=40):
            with anyio.fail_after(5), pytest.raises(DeadlockError, match="forget"):
                await cache.acquire("b", load=_ok, size=20)  # evicts q, whose release fails
        broker._core.check()
        stats = await broker.stats()
        assert (stats.waiting, stats.quarantined_keys) == (0, (("p", "q"),))


@pytest.mark.anyio
async def test_other_requester_of_that_key_waits_on_and_is_served(kind: str) -> None:
    """Only the holder's own request is refused; another task's request for the key stays."""
    async with (
        open_broker(kind, budget=100) as broker,
        broker.cache("p", _fail_releases_of_q) as cache,
    ):
        await _released_with_failure(cache, "q", 50)
        served = anyio.Event()

        async def other() -> None:
            async with cache.acquire("b", load=_ok, size=20) as lease:
                assert lease.value == "v"
                served.set()

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                async with cache.acquire("a", load=_ok, size=40):
                    tg.start_soon(other)  # joins b after the holder, waits for the same bytes
                    with pytest.raises(DeadlockError):
                        await cache.acquire("b", load=_ok, size=20)
                    assert not served.is_set()
                # The holder let a go: b is granted to the other task.
        assert served.is_set()
        broker._core.check()


@pytest.mark.anyio
async def test_task_that_dropped_its_lease_is_not_told_it_still_holds_it(kind: str) -> None:
    """Found by the machine: ``drop_lease(key='a', size=41, then=('b', 60))``."""
    async with (
        open_broker(kind, budget=100) as broker,
        broker.cache("p", _fail_releases_of_q) as cache,
    ):
        lease = await cache.acquire("a", load=_ok, size=41)
        with pytest.warns(ResourceWarning, match="p:'a'"):
            del lease  # its last reference: collected at once
        # At once, before the loop ran the callback that ends the dropped lease.
        with anyio.fail_after(5):
            async with cache.acquire("b", load=_ok, size=60) as again:
                assert again.value == "v"
        broker._core.check()
        assert broker.stats_nowait().leased == 0


# ------------------------------------------------------------------ soak smoke


SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


@pytest.mark.parametrize("name", _backend_ids())
def test_soak_with_faults_and_no_forget_finishes_with_exact_books(name: str) -> None:
    """The soak's evidence mode, small: every request served or failed as documented."""
    if name == "uvloop":
        pytest.importorskip("uvloop")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(
        [
            *(sys.executable, str(SOAK), "--evidence", "--check"),
            *("--ops", "2000", "--tasks", "100", "--backend", name, "--hang-limit", "60"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "served" in result.stdout
