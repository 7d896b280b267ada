"""What depends on the event loop library running the broker (asyncio or trio).

Backend detection, and the primitives the broker binds when it starts: the
current-task getter, the loop's clock, a thread-safe "call this soon on the
loop", trio's hit checkpoint; how events name a task; how the broker reads
what leaves its task groups (``exit_task_group``) and what the plugin's code
raised (``classify``), which differ between asyncio and trio.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import math
from collections.abc import Awaitable, Callable, Iterator
from types import TracebackType
from typing import Any, cast

import anyio
import anyio.abc

from .._errors import BrokerClosed, WrongEventLoop

__all__ = [
    "TRIO_SCHEDULE_EVERY",
    "Fault",
    "call_soon_threadsafe",
    "classify",
    "current_task_getter",
    "exit_task_group",
    "loop_clock",
    "running_backend",
    "task_name",
    "trio_hit_checkpoint",
    "unstarted_clock",
    "unstarted_task",
    "wrong_thread",
]


def running_backend() -> str:
    """The event loop library running this task: "asyncio" or "trio"."""
    try:
        import sniffio
    except ImportError:  # trio depends on sniffio: without it, only asyncio can run
        return "asyncio"
    return sniffio.current_async_library()


def current_task_getter(backend: str) -> Callable[[], object]:
    if backend == "trio":
        import trio

        return trio.lowlevel.current_task
    import asyncio.tasks

    try:
        import _asyncio
    except ImportError:  # pragma: no cover - CPython always has it
        return asyncio.current_task
    c_current = getattr(_asyncio, "current_task", None)
    if c_current is not None and c_current is asyncio.current_task:
        return cast(Callable[[], object], c_current)
    # Python 3.11's asyncio.current_task() is written in Python and costs ~0.4 us,
    # and even get_running_loop() ~0.2 us: a broker lives on one loop, so read
    # that loop's entry in the current-task table directly (~0.05 us).
    table = getattr(asyncio.tasks, "_current_tasks", None)
    if not isinstance(table, dict):
        return asyncio.current_task
    loop = asyncio.get_running_loop()
    return functools.partial(table.get, loop)


def call_soon_threadsafe(backend: str) -> Callable[..., object]:
    """A function that has the running loop call ``func(*args)`` soon, from any thread."""
    if backend == "trio":
        import trio

        return trio.lowlevel.current_trio_token().run_sync_soon
    return asyncio.get_running_loop().call_soon_threadsafe


def loop_clock(backend: str) -> Callable[[], float]:
    if backend == "trio":
        import trio

        return trio.current_time
    return asyncio.get_running_loop().time


#: On trio, one hit in this many is a full checkpoint (a schedule point too).
TRIO_SCHEDULE_EVERY = 32


def trio_hit_checkpoint() -> Callable[[], Awaitable[None]]:
    """What a hit awaits on trio: a cancellation point, and a schedule point every so often.

    trio's rule is that every async operation of a library is a checkpoint.
    A full one on every hit would double the hit's cost, so a hit is always
    a cancellation point and, every ``TRIO_SCHEDULE_EVERY`` hits, a schedule
    point too: a loop of hits cannot starve the other tasks (as trio's own
    fast paths do it).
    """
    import itertools

    import trio

    if_cancelled = trio.lowlevel.checkpoint_if_cancelled
    full = trio.lowlevel.checkpoint
    count = itertools.count(1)
    mask = TRIO_SCHEDULE_EVERY - 1

    def checkpoint() -> Awaitable[None]:
        return if_cancelled() if next(count) & mask else full()

    return checkpoint


def unstarted_clock() -> float:
    raise BrokerClosed("the broker is not running; use it inside 'async with Broker(...)'")


def unstarted_task() -> object:
    raise BrokerClosed("the broker is not running; use it inside 'async with Broker(...)'")


def wrong_thread(what: str) -> WrongEventLoop:
    """The error for a broker used from a thread other than its event loop's."""
    return WrongEventLoop(
        f"this broker runs on the event loop of another thread and was {what} from "
        "this one: its books are not thread-safe; call into it on its own loop, e.g. "
        "with anyio.from_thread.run() or asyncio.run_coroutine_threadsafe()"
    )


def task_name(task: object) -> str:
    """How events name a holder task (asyncio's or trio's)."""
    get_name = getattr(task, "get_name", None)
    if callable(get_name):
        return str(get_name())
    return str(getattr(task, "name", task))


class Fault(enum.Enum):
    """What the plugin's code (a loader, a size callable, a releaser) raised, for the books."""

    #: The broker's own cancellation of the task: the load is cancelled, the release failed.
    CANCELLED = "cancelled"
    #: An ordinary failure: an ``Exception``, or a ``CancelledError`` the broker did not cause.
    FAILED = "failed"
    #: A process-level event (``KeyboardInterrupt``, ``SystemExit``, any other
    #: ``BaseException``): booked as a failure, then propagated.
    FATAL = "fatal"


def classify(exc: BaseException) -> Fault:
    """Classify ``exc``, in the ``except`` clause of the task that ran the plugin's code.

    A ``CancelledError`` is the broker's own only when that task really is in
    a cancelled scope; one raised by a library (a cancelled inner future, an
    internal timeout on asyncio), or asyncio's on trio, is an ordinary failure.
    """
    if isinstance(exc, anyio.get_cancelled_exc_class()):
        cancelled = anyio.current_effective_deadline() == -math.inf
        return Fault.CANCELLED if cancelled else Fault.FAILED
    if isinstance(exc, Exception | asyncio.CancelledError):
        return Fault.FAILED
    return Fault.FATAL


async def exit_task_group(
    tg: anyio.abc.TaskGroup,
    exc_type: type[BaseException] | None,
    exc: BaseException | None,
    tb: TracebackType | None,
) -> bool:
    """Exit a block's own task group so that what happened comes out as itself.

    The broker's and each cache's task group are an implementation detail;
    anyio wraps whatever leaves one in an exception group. What leaves the
    block instead is chosen by ``_outcome``: the body's own exception
    (``exc``; the caller returns ``False`` and it propagates untouched, its
    traceback, ``__cause__`` and ``__context__`` as the body set them), a
    single failure of the group's own tasks, raised as itself, or the group,
    for several independent failures at once.
    """
    try:
        return bool(await tg.__aexit__(exc_type, exc, tb))
    except BaseExceptionGroup as group:
        outcome = _outcome(group, exc)
        if outcome is group:
            raise
    if outcome is exc or outcome is None:
        return False
    context = outcome.__context__
    try:
        raise outcome
    finally:
        # Raised here, it would be chained to the body's exception (usually the
        # cancellation that this very failure caused): keep the chain it had.
        outcome.__context__ = context
        del outcome, context


def _outcome(group: BaseExceptionGroup[Any], body: BaseException | None) -> BaseException | None:
    """What leaves a block instead of ``group``, the exception group of its task group.

    ``body`` (the block's own exception, or ``None``) when that is all that
    happened; else the one failure of the group's tasks (a process-level
    exception of a loader, a size callable or a releaser); else ``group``
    itself. Not failures: cancellations (the task group's own doing, or an
    outer scope's, which cancels again at the next checkpoint), and on asyncio
    a ``KeyboardInterrupt`` or ``SystemExit`` of a task, which left through
    the event loop already (asyncio re-raises them from the loop); raised
    again from the main task, it would stop the runner's cleanup, leaving
    worker threads that hold the process at exit.
    """
    ignored: tuple[type[BaseException], ...] = (anyio.get_cancelled_exc_class(),)
    if running_backend() == "asyncio":
        ignored += (KeyboardInterrupt, SystemExit)
    failures = [error for error in group.exceptions if not isinstance(error, ignored)]
    if body is not None and not isinstance(body, anyio.get_cancelled_exc_class()):
        return body if all(_same(error, body) for error in failures) else group
    if not failures:
        return body
    return failures[0] if len(failures) == 1 else group


def _same(error: BaseException, body: BaseException) -> bool:
    """Whether ``error`` is ``body``, or (trio copies groups it passes on) a copy of its group."""
    if error is body:
        return True
    if not isinstance(error, BaseExceptionGroup) or not isinstance(body, BaseExceptionGroup):
        return False
    return {id(leaf) for leaf in _leaves(error)} == {id(leaf) for leaf in _leaves(body)}


def _leaves(error: BaseException) -> Iterator[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            yield from _leaves(inner)
    else:
        yield error
