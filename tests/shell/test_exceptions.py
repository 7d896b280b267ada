"""What comes out of the broker's blocks: exceptions as themselves, never wrapped in groups.

The broker and each cache block run a task group of their own; it is an
implementation detail. A body's single exception, and a single failure of the
broker's own tasks, come out as themselves; a group only when several really
independent failures happened at once (docs/failure-semantics.md, "Exceptions").
"""

from __future__ import annotations

import contextlib
import pickle
import subprocess
import sys
import traceback
from typing import Any

import anyio
import anyio.lowlevel
import pytest

import cachebroker
import cachebroker.simulator
from cachebroker import (
    AcquireTimeout,
    Broker,
    BrokerClosed,
    LeasesOutstanding,
    LoadFailed,
    RequestTooLarge,
)
from cachebroker.simulator import TraceError
from tests.brokers import open_broker
from tests.helpers import Recorder, loader, wait_until


class Meltdown(BaseException):
    """A process-level exception of the application's own."""


# ------------------------------------------------------- a body's own exception


@pytest.mark.anyio
async def test_key_error_in_a_broker_body_is_caught_by_except_key_error(kind: str) -> None:
    error = KeyError("mine")
    caught: BaseException | None = None
    try:
        async with open_broker(kind, budget=100):
            raise error
    except KeyError as exc:
        caught = exc
    assert caught is error  # itself: no group, no copy
    assert error.__context__ is None and error.__cause__ is None  # chained to nothing


@pytest.mark.anyio
async def test_key_error_in_a_cache_body_is_caught_by_except_key_error_outside_the_broker(
    kind: str,
) -> None:
    error = KeyError("mine")
    caught: BaseException | None = None
    try:
        async with open_broker(kind, budget=100) as broker, broker.cache("p", Recorder()) as cache:
            async with cache.acquire("k", load=loader("v"), size=10):
                pass
            raise error
    except KeyError as exc:
        caught = exc
    assert caught is error and error.__context__ is None


@pytest.mark.anyio
async def test_request_too_large_in_a_cache_body_is_caught_by_its_class(kind: str) -> None:
    caught: RequestTooLarge | None = None
    try:
        async with (
            open_broker(kind, budget="1GiB") as broker,
            broker.cache("whisper", Recorder()) as cache,
        ):
            await cache.acquire("large", load=loader("v"), size="2GiB")
    except RequestTooLarge as exc:
        caught = exc
    assert caught is not None and caught.entry == "whisper:'large'"


@pytest.mark.anyio
async def test_leases_outstanding_from_a_cache_exit_is_caught_by_its_class(kind: str) -> None:
    holder: Any = None
    caught: LeasesOutstanding | None = None
    try:
        async with open_broker(kind, budget=100, release_timeout=0.01) as broker:
            async with broker.cache("p", Recorder()) as cache:
                holder = await cache.acquire("a", load=loader("v"), size=40)
    except LeasesOutstanding as exc:
        caught = exc
    assert caught is not None and (caught.cache, caught.keys) == ("p", ("a",))
    assert "still leased after waiting" in str(caught) and "p:'a'" in str(caught)
    assert holder.value == "v"  # never freed under its holder
    await holder.release()


@pytest.mark.anyio
@pytest.mark.parametrize("where", ["broker", "cache"])
async def test_keyboard_interrupt_in_a_body_comes_out_bare(kind: str, where: str) -> None:
    interrupt = KeyboardInterrupt()

    async def interrupted() -> None:
        async with open_broker(kind, budget=100) as broker:
            if where == "broker":
                raise interrupt
            async with broker.cache("p", Recorder()):
                raise interrupt

    with pytest.raises(KeyboardInterrupt) as info:
        await interrupted()
    assert info.value is interrupt


@pytest.mark.anyio
async def test_a_bodys_own_exception_group_comes_out_as_itself(kind: str) -> None:
    group = ExceptionGroup("the application's", [KeyError("a"), ValueError("b")])

    async def body() -> None:
        async with open_broker(kind, budget=100) as broker, broker.cache("p", Recorder()):
            raise group

    with pytest.raises(ExceptionGroup) as info:
        await body()
    assert info.value is group  # not wrapped, not a copy


@pytest.mark.anyio
async def test_cancellation_of_the_block_is_not_turned_into_an_error(kind: str) -> None:
    with anyio.move_on_after(0.01) as scope:
        async with open_broker(kind, budget=100) as broker, broker.cache("p", Recorder()):
            await anyio.sleep_forever()
    assert scope.cancelled_caught


# ----------------------------------------------- failures of the broker's tasks


def run_fresh(anyio_backend: tuple[str, dict[str, Any]], main: Any) -> None:
    """Run ``main`` in a fresh event loop: on asyncio a ``KeyboardInterrupt`` stops the loop."""
    backend, options = anyio_backend
    anyio.run(main, backend=backend, backend_options=options)


@pytest.mark.parametrize("kind", [KeyboardInterrupt, Meltdown])
def test_a_loaders_process_level_exception_alone_comes_out_bare(
    anyio_backend: tuple[str, dict[str, Any]], kind: type[BaseException]
) -> None:
    async def load() -> str:
        await anyio.lowlevel.checkpoint()
        raise kind()

    async def main() -> None:
        with anyio.fail_after(5):
            async with Broker(budget=100) as broker, broker.cache("p", Recorder()) as cache:
                with contextlib.suppress(LoadFailed):  # what the requester gets
                    await cache.acquire("k", load=load, size=10)
                await anyio.sleep_forever()  # until the broker's own task fails

    with pytest.raises(kind):
        run_fresh(anyio_backend, main)


def test_independent_failures_at_once_come_out_as_a_group(
    anyio_backend: tuple[str, dict[str, Any]],
) -> None:
    """The body's error and a loader's process-level exception: both are kept."""

    async def load() -> str:
        with anyio.CancelScope(shield=True):
            await anyio.sleep(0.05)  # it fails while the body's error propagates
        raise Meltdown

    async def main() -> None:
        with anyio.fail_after(5):
            async with Broker(budget=100) as broker, broker.cache("p", Recorder()) as cache:
                with pytest.raises(AcquireTimeout):  # the load goes on, shielded
                    await cache.acquire("k", load=load, size=10, timeout=0.01)
                raise KeyError("mine")

    with pytest.raises(BaseExceptionGroup) as info:
        run_fresh(anyio_backend, main)
    assert info.group_contains(KeyError, depth=1) and info.group_contains(Meltdown, depth=1)


# ---------------------------------------- errors name the entry as cache:key


@pytest.mark.anyio
async def test_acquire_timeout_names_the_entry_and_what_it_waited_for(kind: str) -> None:
    async with open_broker(kind, budget=100) as broker, broker.cache("p", Recorder()) as cache:
        held, done = anyio.Event(), anyio.Event()

        async def holder() -> None:
            async with cache.acquire("a", load=loader(1), size=80):
                held.set()
                await done.wait()

        async with anyio.create_task_group() as tg:
            tg.start_soon(holder)
            await held.wait()
            with pytest.raises(AcquireTimeout) as info:
                await cache.acquire("b", load=loader(2), size=50, timeout=0.01)
            done.set()
        assert (info.value.entry, info.value.waiting_for) == ("p:'b'", "space")
        assert "p:'b' did not complete within 0.01s: it was waiting for space (50 B" in str(
            info.value
        )

        async def slow() -> str:
            await anyio.sleep_forever()
            raise AssertionError

        with pytest.raises(AcquireTimeout) as info:
            await cache.acquire("c", load=slow, size=10, timeout=0.01)
        assert (info.value.entry, info.value.waiting_for) == ("p:'c'", "load")
        assert "waiting for its load to finish" in str(info.value)


@pytest.mark.anyio
async def test_requests_failed_by_a_closing_cache_name_their_entry(kind: str) -> None:
    got: list[BaseException] = []

    async def slow() -> str:
        await anyio.sleep_forever()
        raise AssertionError

    async with open_broker(kind, budget=100) as broker:
        async with anyio.create_task_group() as tg:
            async with broker.cache("p", Recorder()) as cache:

                async def request() -> None:
                    try:
                        await cache.acquire("b", load=slow, size=10)
                    except BrokerClosed as exc:
                        got.append(exc)

                tg.start_soon(request)
                await wait_until(lambda: broker.stats_nowait().loading == 1)
        with pytest.raises(BrokerClosed, match=r"cache 'p' is closed: cannot acquire p:'k'"):
            await cache.acquire("k", load=loader(1), size=10)
    assert str(got[0]) == "cache 'p' was closed while acquiring p:'b'"


@pytest.mark.anyio
async def test_argument_and_lease_errors_name_their_entry(kind: str) -> None:
    async with (
        open_broker(kind, budget={"ram": 100}) as broker,
        broker.cache("p", Recorder()) as cache,
    ):
        with pytest.raises(cachebroker.InvalidArgument, match=r"acquiring p:'k': unknown space"):
            await cache.acquire("k", load=loader(1), size={"gpu": 10})
        lease = await cache.acquire("k", load=loader(1), size={"ram": 60})
        with pytest.raises(cachebroker.DeadlockError, match=r"p:'b' needs 50 B .*itself: p:'k';"):
            await cache.acquire("b", load=loader(2), size={"ram": 50})
        await lease.release()
        with pytest.raises(cachebroker.LeaseReleased, match=r"the lease on p:'k' was released"):
            _ = lease.value


# ------------------------------------------------------------ the public names


def test_tracebacks_and_reprs_name_the_public_module() -> None:
    error = RequestTooLarge("ram", 2 * 2**30, 2**30, entry="whisper:'large'")
    assert repr(type(error)) == "<class 'cachebroker.RequestTooLarge'>"
    shown = traceback.format_exception(error)[-1]
    assert shown.startswith("cachebroker.RequestTooLarge: whisper:'large' needs 2.0 GiB"), shown


PUBLIC_ERRORS: list[BaseException] = [
    cachebroker.BrokerError("broken"),
    cachebroker.InvalidArgument("bad"),
    cachebroker.InvalidKey("unhashable"),
    cachebroker.OutOfSpace("full"),
    RequestTooLarge("ram", 2 * 2**30, 2**30, entry="whisper:'large'"),
    cachebroker.DeadlockError("stuck", [("p", "a")]),
    AcquireTimeout("late"),
    cachebroker.BrokerClosed("closed"),
    LoadFailed("failed"),
    cachebroker.ReleaseFailed("not freed"),
    LeasesOutstanding("p", ["a", "b"], 0.5),
    cachebroker.WrongEventLoop("elsewhere"),
    cachebroker.LeaseReleased("released"),
    TraceError("bad size", source="t.csv", line=2, column="size"),
]


def test_every_public_exception_class_is_listed_here() -> None:
    listed = {type(error) for error in PUBLIC_ERRORS}
    for module in (cachebroker, cachebroker.simulator):
        for name in module.__all__:
            obj = getattr(module, name)
            if isinstance(obj, type) and issubclass(obj, BaseException):
                assert obj in listed, name


@pytest.mark.parametrize("error", PUBLIC_ERRORS, ids=lambda error: type(error).__name__)
def test_public_exceptions_survive_a_pickle_round_trip(error: BaseException) -> None:
    error.add_note("a note")
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error)
    assert (str(again), again.args) == (str(error), error.args)
    assert vars(again) == vars(error)  # attributes (``entry``, ``keys``, ...) and notes


# ------------------------------------------------------------- the command line


def test_demo_with_a_budget_below_a_model_fails_with_a_short_error() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "cachebroker", "demo", "--budget", "40MiB"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr and "Exception Group" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "cachebroker demo: error:" in result.stderr
    assert "exceeds the space's whole budget" in result.stderr
