"""What the runner's parts share: their view of the runner (``Steps``), and an entry's ``Slot``.

The runner (``_runner``) is split along its effects: loads (``_loads``),
releases and moves (``_releases``), the idle sweeper and the probes
(``_sweeper``), the slow path of requests (``_requests``). None of them sees
the runner itself: each is given ``Steps``, the few things every step needs
(the books, the clock, the settings a connected broker learns on connecting,
the effects and the events), and the other parts or objects it uses by name.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import anyio

from .._core import Core, Entry, Reason
from .._errors import BrokerError, InvalidArgument, LoadFailed
from .._sizes import parse_bytes, parse_size
from ._backend import Fault, classify
from ._config import is_async_callable

__all__ = ["LOADING", "Slot", "Spawn", "Steps", "measure", "since"]

#: The entries whose loader the current task (or thread) runs: a request made
#: from inside a loader must not wait for a load that waits for that loader.
LOADING: contextvars.ContextVar[tuple[Entry, ...]] = contextvars.ContextVar(
    "cachebroker_loading", default=()
)

#: Start ``func(*args)`` in a task group (the broker's own, or a cache block's).
Spawn = Callable[..., None]


class Steps(Protocol):
    """What a part of the runner uses of it: the books, the clock, the settings, effects, events.

    Properties, not values copied once: a connected broker's books and
    settings are the daemon's, set when it connects (``Remote.start``).
    """

    @property
    def core(self) -> Core:
        """The books, stepped from the loop's thread only."""

    @property
    def clock(self) -> Callable[[], float]:
        """The broker's clock, in seconds."""

    @property
    def current_task(self) -> Callable[[], object]:
        """The current task's getter (bound to the loop when the broker starts)."""

    @property
    def budget(self) -> Mapping[str, int]:
        """The budget per space, which measured sizes are read against."""

    @property
    def idle_ttl(self) -> float | None:
        """The default idle TTL."""

    @property
    def release_timeout(self) -> float | None:
        """Seconds a release (or a move) may run before its entry is quarantined."""

    @property
    def log(self) -> Any:
        """Where the events go, once the broker started (``emit`` also tells the listeners)."""

    @property
    def running(self) -> bool:
        """Whether the broker runs (between its start and its close)."""

    def apply(self) -> None:
        """Perform the effects the core's last steps queued (never awaits)."""

    def at_step_end(self, callback: Callable[[], None]) -> bool:
        """Call ``callback`` once the effects being applied now are; false if none are."""

    def emit(self, level: str, event: str, **fields: Any) -> None:
        """Log ``event`` at ``level`` and hand it to the listeners."""


class Slot:
    """What the shell keeps on an entry: how to load it and how to wake its waiters."""

    __slots__ = (
        "abandoned",
        "cancelled",
        "done",
        "from_release",
        "is_async",
        "load",
        "measure",
        "moving_to",
        "placed",
        "queued_at",
        "release_reason",
        "release_started",
        "released",
        "scope",
        "thread_wait",
        "timed_out",
        "watchers",
    )

    def __init__(
        self,
        load: Callable[..., Any],
        measure: Callable[[Any], Any] | None,
        now: float,
        *,
        placed: bool = False,
    ) -> None:
        self.load = load
        self.is_async = is_async_callable(load)
        #: The acquire gave places (``spaces=``): the loader takes the chosen
        #: one's name (the acquire's own, ``Core.owner_space``), and a plain
        #: measured size is charged there.
        self.placed = placed
        self.measure = measure
        self.done = anyio.Event()
        #: Called once after the step that next settles a requester (``watch``).
        self.watchers: list[Callable[[], None]] = []
        self.released: anyio.Event | None = None
        self.scope: anyio.CancelScope | None = None
        self.cancelled = False
        #: Its request came from a release or a move: it may not wait for space.
        self.from_release = False
        #: The wait for a worker thread (``Loads._load_in_thread``), and whether
        #: the closing cache gave the load up.
        self.thread_wait: anyio.CancelScope | None = None
        self.abandoned = False
        #: When the request that created the entry asked for space, when its
        #: release was requested, and whether that release timed out.
        self.queued_at = now
        #: The space a move of the entry goes to while it runs (tiers).
        self.moving_to: str | None = None
        self.release_started = now
        #: Why its release was asked (a shared broker tells the owning process).
        self.release_reason: Reason | None = None
        self.timed_out = False

    def watch(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the step that next settles a requester of the entry
        (granted, refused, or its load failed) has been applied: a waiter with no task."""
        self.watchers.append(callback)


def since(clock: Callable[[], float], start: float) -> float:
    """Seconds from ``start`` to now, rounded for the events."""
    return round(max(0.0, clock() - start), 6)


def measure(
    entry: Entry,
    slot: Slot,
    value: Any,
    budget: Mapping[str, int],
    where: str | None = None,
) -> tuple[dict[str, int] | None, BaseException | None, BaseException | None]:
    """The measured size, else the error for the requesters, and what must propagate.

    ``where``: the space a plain amount is charged in (the space a placed
    load was given, or the one a move went to), instead of the default one.
    """
    if slot.measure is None:
        return None, None, None
    try:
        measured = slot.measure(value)
        if where is not None and not isinstance(measured, Mapping):
            return {where: parse_bytes(measured)}, None, None
        return parse_size(measured, budget), None, None
    except BaseException as exc:
        what = f"the size callable for {entry.owner.name}:{entry.key!r}"
        error: BrokerError
        if isinstance(exc, Exception):
            error = InvalidArgument(f"{what} failed on the loaded value: {exc}")
        else:
            error = LoadFailed(f"{what} raised {exc!r}")
        error.__cause__ = exc
        return None, error, exc if classify(exc) is Fault.FATAL else None
