"""The one object ``Cache`` and ``Lease`` talk to: the ``Actor`` interface, and ``Block``.

``Cache`` and ``Lease`` are the plugin's views; what runs the broker (the
books, the effects, the clock, the loop's thread) is behind this interface.
In this process it is the ``Runner`` (``_runner``), which the ``Broker`` owns;
another shell, or a transport to a broker in another process, provides the
same interface and the views work unchanged.

The hit path reads the books directly (``core``, with ``current_task``,
``checkpoint``, ``trace`` and ``log``) and ends a lease in one step
(``core.lease_end``, then ``apply``, ``note_idle``): that is why those are
attributes and not a method per operation. Everything that may wait goes
through a coroutine method (``request``, ``prefetch``, ``await_releases``,
``open_block``, ``close_block``).
"""

from __future__ import annotations

import contextvars
from collections.abc import Awaitable, Callable, Hashable, Mapping
from types import TracebackType
from typing import Any, Protocol, cast

import anyio
import anyio.abc

from .._core import Core, Entry, Owner, Request
from .._stats import EvictionReport
from ._config import MoveFunction, ReleaseFunction

__all__ = ["Actor", "Block", "Elsewhere"]


class Elsewhere(Protocol):
    """A block whose values live in another process, asked by message: the daemon's
    side of a connected process's cache (``_remote._connection``).

    The broker tells it in the very step that grants a load or starts a
    release, so that its message leaves in that turn of the loop rather than
    once the load's or release's task first runs; that task then only waits
    for the process's answer (the block's loader, its releaser).
    """

    def granted(self, key: Hashable, space: str | None) -> None:
        """The load of ``key`` has its bytes; ``space``: where, when its request placed it."""

    def releasing(self, key: Hashable) -> None:
        """The release of ``key`` starts (its releaser awaits the outcome)."""


class Block:
    """One open ``broker.cache(...)`` block, as the broker runs it.

    Its task group runs the cache's loads and releases, in the context (the
    contextvars) of the task that opened the block, whichever task's request
    set them off.
    """

    __slots__ = (
        "closed",
        "context",
        "elsewhere",
        "empty",
        "move",
        "name",
        "owner",
        "quiet",
        "release",
        "shut_wait",
        "tg",
    )

    def __init__(
        self,
        owner: Owner,
        release: ReleaseFunction,
        tg: anyio.abc.TaskGroup,
        move: MoveFunction | None = None,
        elsewhere: Elsewhere | None = None,
        *,
        quiet: bool = False,
    ) -> None:
        self.owner = owner
        self.name = owner.name
        #: The broker's own bookkeeping, no application's cache (the bytes a daemon
        #: keeps for a lost connection): its loads are not announced as loads; what
        #: holds them says what they are.
        self.quiet = quiet
        self.release = release
        #: The releaser's ``move(key, value, to)``, if it offers one (tiers).
        self.move = move
        #: Told of its grants and releases at once, for values in another process.
        self.elsewhere = elsewhere
        self.tg = tg
        #: Set once the block was left: no new request, nobody left to release.
        self.closed = False
        #: Set when the cache has no live entry left (the ``OwnerEmpty`` effect).
        self.empty = anyio.Event()
        #: How long the exit waited for leases and releases (``LeasesOutstanding``).
        self.shut_wait = 0.0
        self.context = contextvars.copy_context()

    def spawn(
        self, func: Callable[..., Awaitable[Any]], *args: Any, name: str | None = None
    ) -> None:
        """Start ``func(*args)`` in the block's task group and context."""
        start_soon = cast(Callable[..., None], self.tg.start_soon)
        self.context.run(start_soon, func, *args, name=name)


class Actor(Protocol):
    """What ``Cache`` and ``Lease`` need of the broker they belong to."""

    # Read-only for the views (``trace`` is refreshed by ``refresh_trace``).

    @property
    def core(self) -> Core:
        """The books: read and stepped from the loop's thread only, never across an await."""

    @property
    def thread(self) -> int:
        """The thread running the broker's loop: from any other, calls raise ``WrongEventLoop``."""

    @property
    def current_task(self) -> Callable[[], object]:
        """The current task's getter: a lease's holder."""

    @property
    def checkpoint(self) -> Callable[[], Awaitable[None]] | None:
        """What every hit awaits first (trio: a cancellation point), or ``None``."""

    @property
    def clock(self) -> Callable[[], float]:
        """The broker's clock, in seconds."""

    @property
    def trace(self) -> bool:
        """Whether hits log their debug event (to ``log``)."""

    @property
    def log(self) -> Any:
        """Where the events go (``_logging.Guarded`` around a structlog logger or a
        ``_logging.StdlibEvents``)."""

    @property
    def idle_ttl(self) -> float | None:
        """The default idle TTL: whether the time a lease ends matters."""

    @property
    def budget(self) -> Mapping[str, int]:
        """The budget per space, which sizes are checked against."""

    @property
    def running(self) -> bool:
        """Whether the broker runs (between its start and its close)."""

    def apply(self) -> None:
        """Perform the effects the core's last steps queued (never awaits)."""

    def check_running(self) -> None:
        """Raise ``BrokerClosed`` unless the broker runs, ``WrongEventLoop`` off its thread."""

    def refresh_trace(self) -> None:
        """Ask the log again whether debug events are wanted (``trace``)."""

    def note_idle(self, entry: Entry) -> None:
        """``entry``'s last lease ended: it may expire before the idle timer's next run."""

    def end_lease_soon(self, entry: Entry, task: object) -> None:
        """End ``task``'s lease on ``entry`` on the loop, soon; callable from any thread."""

    def lease_dropped(self, entry: Entry, task: object, key: Hashable) -> None:
        """A held lease was garbage-collected: end it soon, and warn (any thread)."""

    async def request(
        self, owner: Owner, request: Request, *, bound: bool = True
    ) -> tuple[Entry, object]:
        """Acquire ``request.key`` when it is not ready, or limited (a miss, a join, a slot
        wait): the entry and its holder. With ``request.places`` (``acquire(spaces=...)``)
        its ``load`` takes the chosen space's name. ``bound``: as for ``Core.request``."""

    async def prefetch(self, owner: Owner, request: Request) -> None:
        """Have ``request.key`` loaded, holding no lease once it is (``Cache.prefetch``)."""

    async def await_releases(self, entries: list[Entry]) -> EvictionReport:
        """Wait for the releases of ``entries`` to be acknowledged (or to fail)."""

    async def open_block(
        self,
        name: str,
        release: ReleaseFunction,
        *,
        slots: int | None = None,
        priority: int = 0,
        ttl: float | None = None,
        move: MoveFunction | None = None,
    ) -> Block:
        """Open cache ``name``, its entries released through ``release``, with their defaults.

        ``move``: the releaser's, which moves values between tiers.
        """

    async def close_block(
        self,
        block: Block,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        """Close ``block`` (see ``Cache``); raise ``LeasesOutstanding`` for leases still held."""
