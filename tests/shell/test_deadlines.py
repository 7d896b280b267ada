"""The broker's timers (``_shell._deadlines``): every release's and move's watchdog, one task.

Each test bounds its wait with ``fail_after`` and asserts on order and outcome
only: which callbacks ran, in which order, and what the heap still holds.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
import pytest

from cachebroker._shell._deadlines import Deadlines

pytestmark = pytest.mark.anyio


def last(fired: list[str], name: str, done: anyio.Event) -> Callable[[], None]:
    def fire() -> None:
        fired.append(name)
        done.set()

    return fire


@asynccontextmanager
async def running() -> AsyncIterator[Deadlines]:
    deadlines = Deadlines()
    async with anyio.create_task_group() as tg:
        tg.start_soon(deadlines.run)
        await anyio.lowlevel.checkpoint()
        yield deadlines
        tg.cancel_scope.cancel()


async def test_deadlines_fire_in_the_order_of_their_times_not_of_their_making() -> None:
    fired: list[str] = []
    done = anyio.Event()
    async with running() as deadlines:
        deadlines.after(0.03, last(fired, "c", done))
        deadlines.after(0.01, lambda: fired.append("a"))
        deadlines.after(0.02, lambda: fired.append("b"))
        with anyio.fail_after(5):
            await done.wait()
        assert len(deadlines) == 0
    assert fired == ["a", "b", "c"]


async def test_a_cancelled_deadline_never_fires_and_leaves_the_heap_when_it_comes_up() -> None:
    fired: list[str] = []
    done = anyio.Event()
    async with running() as deadlines:
        cancelled = [deadlines.after(0.001 * i, lambda: fired.append("never")) for i in range(5)]
        deadlines.after(0.02, last(fired, "kept", done))
        for deadline in cancelled:
            deadline.cancel()
        with anyio.fail_after(5):
            await done.wait()
        assert len(deadlines) == 0
        # One made after others were cancelled takes their places at the head at once.
        for deadline in [deadlines.after(60, lambda: None) for _ in range(3)]:
            deadline.cancel()
        deadlines.after(60, lambda: None)
        assert len(deadlines) == 1
    assert fired == ["kept"]


async def test_a_deadline_before_the_one_the_task_sleeps_for_wakes_it() -> None:
    fired: list[str] = []
    done = anyio.Event()
    async with running() as deadlines:
        deadlines.after(3600, lambda: fired.append("late"))
        await anyio.wait_all_tasks_blocked()  # (the task sleeps for the hour)
        deadlines.after(0.01, last(fired, "soon", done))
        with anyio.fail_after(5):
            await done.wait()
        assert len(deadlines) == 1
    assert fired == ["soon"]


async def test_a_callback_may_set_the_next_deadline_and_a_fired_one_cancels_as_nothing() -> None:
    fired: list[int] = []
    done = anyio.Event()
    async with running() as deadlines:

        def again(n: int) -> None:
            fired.append(n)
            if n < 3:
                deadlines.after(0.001, lambda: again(n + 1))
            else:
                done.set()

        first = deadlines.after(0.001, lambda: again(1))
        with anyio.fail_after(5):
            await done.wait()
        first.cancel()  # (fired already: nothing happens)
    assert fired == [1, 2, 3]
