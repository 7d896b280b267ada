"""Deadlines: every watchdog of a broker (a release's, a move's timeout) as one task's timers.

A release that must be acknowledged within ``release_timeout`` used to
start a watchdog task of its own, and wake it to cancel it when the release
ended: two task steps for every release, most of them for a timeout that
never fires. ``Deadlines`` keeps them in a heap instead, run by one task
of the broker's (``run``): a deadline is a callback at a time of the
loop's clock, called by that task once the time is past, unless its
``Deadline`` was cancelled first. A cancelled deadline costs nothing more
than its place in the heap until it comes up, when it is dropped unseen;
the task wakes for the earliest live deadline only, or when a new one
comes before it.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

import anyio

__all__ = ["Deadline", "Deadlines"]


class Deadline:
    """One timer of ``Deadlines``: ``callback`` at ``when``, unless cancelled first."""

    __slots__ = ("callback", "cancelled", "when")

    def __init__(self, when: float, callback: Callable[[], None]) -> None:
        self.when = when
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        """Never call it (once it has been called: nothing)."""
        self.cancelled = True


class Deadlines:
    """The timers of a broker, run by one task (``run``)."""

    __slots__ = ("_heap", "_order", "_sleeping_until", "_wake")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Deadline]] = []
        self._order = itertools.count()
        #: The time the task sleeps until (``None``: it does not sleep, or has no deadline).
        self._sleeping_until: float | None = None
        self._wake: anyio.Event | None = None

    def __len__(self) -> int:
        """How many deadlines wait, cancelled ones included until they come up."""
        return len(self._heap)

    def after(self, seconds: float, callback: Callable[[], None]) -> Deadline:
        """Call ``callback`` (from the task) ``seconds`` from now; cancel it with the handle."""
        deadline = Deadline(anyio.current_time() + seconds, callback)
        heap = self._heap
        while heap and heap[0][2].cancelled:  # (what came up cancelled meanwhile)
            heapq.heappop(heap)
        heapq.heappush(heap, (deadline.when, next(self._order), deadline))
        until = self._sleeping_until
        if self._wake is not None and (until is None or deadline.when < until):
            self._wake.set()  # (it sleeps for a later one, or for none)
        return deadline

    async def run(self) -> None:
        """Call each deadline's callback once its time is past, until cancelled."""
        heap = self._heap
        while True:
            now = anyio.current_time()
            while heap and (heap[0][2].cancelled or heap[0][0] <= now):
                _, _, deadline = heapq.heappop(heap)
                if not deadline.cancelled:
                    deadline.cancelled = True
                    deadline.callback()
            self._wake = wake = anyio.Event()
            self._sleeping_until = heap[0][0] if heap else None
            try:
                if heap:
                    with anyio.move_on_after(heap[0][0] - now):
                        await wake.wait()
                else:
                    await wake.wait()
            finally:
                self._wake = self._sleeping_until = None
