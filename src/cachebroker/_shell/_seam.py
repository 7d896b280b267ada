"""The runner's one seam to another broker: ``Remote``, and ``Local``, the in-process default.

A broker in one process answers to nobody: its books grant, its releases
end here, its holders are its tasks (``Local``). A broker connected to the
machine's shared one (``_remote._admission.LinkAdmission``) runs on the
daemon's books and settings, and each load it grants waits for the daemon's
grant; the daemon's own broker (``_remote._daemon.DaemonReleases``) releases
entries in other processes, which may refuse, fail, or overrun there, and
its holders are those processes. Both plug into an ordinary ``Runner``
through this protocol: what the runner announces (a cache opened or closed,
a load started) and what it asks (may this load run, why does this request
wait, how did that release end, who holds this entry).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Hashable, Iterable, Mapping
from types import TracebackType
from typing import Any, Protocol

import anyio.lowlevel
import attrs

from .._core import Core, Entry, Owner, Request, Ticket
from .._errors import ReleaseFailed
from ._actor import Block, Elsewhere
from ._config import MoveFunction, ReleaseFunction
from ._steps import Spawn, Steps

__all__ = ["LOCAL", "FailedThere", "Freed", "Local", "Refused", "Relay", "Remote", "Terms"]


@attrs.frozen
class Terms:
    """What a broker runs on when another one's books decide: set when it connects."""

    core: Core
    budget: dict[str, int]
    idle_ttl: float | None
    release_timeout: float | None


@attrs.frozen
class Refused:
    """A release asked elsewhere was refused: the entry was leased again there.

    The books give the entry back its lease (``Core.release_refused``) held by
    ``holder``, then call ``then`` (what the entry's report says next).
    """

    holder: object
    then: Callable[[], None]


@attrs.frozen
class Freed:
    """What another broker's books freed for a load that ran out of memory (``free_for_retry``).

    ``victims``: each freed entry as ``(cache, key)``, the cache named as the
    owning process's is in the shared books (``name@pid``) when it is another
    process's; ``spaces``: the spaces their bytes were in. No victims: nothing
    is left to free.
    """

    victims: tuple[tuple[str, Hashable], ...]
    spaces: frozenset[str]


@attrs.frozen
class FailedThere:
    """A release done elsewhere failed there (``overdue``: it still runs past its timeout)."""

    error: ReleaseFailed
    overdue: bool = False


class Remote(Protocol):
    """The runner's other side: the broker whose books this one answers to, or that it serves."""

    @property
    def admits_elsewhere(self) -> bool:
        """Whether a load these books granted waits for another broker's grant (``admit``)."""

    @property
    def shared_used(self) -> Mapping[str, int] | None:
        """The shared books' last known bytes used per space (``shared_totals``)."""

    async def start(self, runner: Steps) -> Terms | None:
        """Before the runner starts: connect; the books and settings to run on (``None``: its own).

        ``runner`` is how the remote side steps the books once it runs.
        """

    def started(self, spawn: Spawn) -> None:
        """The runner runs: start what serves the other side, in its task group (``spawn``)."""

    async def stop(self) -> None:
        """Every cache is closed: say what is left and disconnect (also when the start failed)."""

    def cache_opened(self, name: str, moves: bool) -> None:
        """Cache ``name`` was opened (``moves``: its releaser can move values, for tiers)."""

    def cache_closed(self, name: str) -> None:
        """Cache ``name`` was closed."""

    def load_started(self, entry: Entry) -> None:
        """These books granted ``entry``'s load, whose task is about to start."""

    def admitting(self) -> Collection[Entry]:
        """The entries whose load waits in ``admit`` for another broker's grant."""

    async def admit(self, entry: Entry) -> BaseException | None:
        """What a granted load awaits before it runs; the error that refused it, if any."""

    async def admit_move(self, entry: Entry) -> BaseException | None:
        """What a move these books started awaits before it runs; the error that refused it.

        A promotion waits for the other broker's room (it may place it
        elsewhere: ``Core.place``); a move that broker asked for runs at once.
        """

    async def free_for_retry(self, entry: Entry) -> Freed | None:
        """``entry``'s load ran out of memory: free the next victims on the shared books.

        Returns once their releases ended (whoever owns them); ``None``: these
        books free (``Core.free_for_retry``), as in one process.
        """

    def learns_aliases(self, entry: Entry, freed: Collection[str]) -> bool:
        """``entry``'s load fit only after freeing in ``freed``: whether the other broker's
        books take the evidence of one memory (``False``: these books do)."""

    def ask_why(self, entry: Entry) -> Callable[[str], Awaitable[str]] | None:
        """For a request that timed out waiting for another broker's grant: ask it why.

        Called before the request is withdrawn; returns what completes the
        words of ``waiting_for`` with that broker's answer, or ``None``.
        """

    def waiting_for(self, entry: Entry) -> tuple[str | None, str] | None:
        """What ``entry``'s request waits for when it waits on the other side, else ``None``."""

    async def shared_totals(self) -> Mapping[str, int] | None:
        """Ask the shared books' bytes used per space now (``Stats.broker_used``)."""

    def release_outcome(self, exc: BaseException) -> Refused | FailedThere | None:
        """How a release done elsewhere ended, when ``exc`` says so; ``None``: it failed here."""

    def holder_names(self, entry: Entry) -> list[str] | None:
        """How ``lease.held`` names ``entry``'s holders; ``None``: by their tasks' names."""


class Local:
    """The in-process side: no other broker to ask or to tell (``Remote``'s defaults)."""

    __slots__ = ()

    admits_elsewhere = False
    shared_used: Mapping[str, int] | None = None

    async def start(self, runner: Steps) -> Terms | None:
        return None

    def started(self, spawn: Spawn) -> None:
        pass

    async def stop(self) -> None:
        pass

    def cache_opened(self, name: str, moves: bool) -> None:
        pass

    def cache_closed(self, name: str) -> None:
        pass

    def load_started(self, entry: Entry) -> None:
        pass

    def admitting(self) -> Collection[Entry]:
        return ()

    async def admit(self, entry: Entry) -> BaseException | None:
        return None

    async def admit_move(self, entry: Entry) -> BaseException | None:
        return None

    async def free_for_retry(self, entry: Entry) -> Freed | None:
        return None  # the books free their own victims

    def learns_aliases(self, entry: Entry, freed: Collection[str]) -> bool:
        return False

    def ask_why(self, entry: Entry) -> Callable[[str], Awaitable[str]] | None:
        return None  # the books know why themselves

    def waiting_for(self, entry: Entry) -> tuple[str | None, str] | None:
        return None

    async def shared_totals(self) -> Mapping[str, int] | None:
        await anyio.lowlevel.checkpoint()
        return None

    def release_outcome(self, exc: BaseException) -> Refused | FailedThere | None:
        return None

    def holder_names(self, entry: Entry) -> list[str] | None:
        return None


#: The side of every in-process broker (``Local`` keeps no state).
LOCAL: Remote = Local()


class Relay(Protocol):
    """What a broker that serves other processes (the daemon) steps on their behalf.

    The ``Runner`` of its ``Broker`` (``Broker._relay``): each connected
    process's cache is one of its blocks, each entry the process loads one
    of its requests (relayed, ``urgent`` and ``held`` as the process saw
    them) or, after a restart, one it adopts.
    """

    @property
    def core(self) -> Core:
        """The books, stepped from the loop's thread only."""

    @property
    def clock(self) -> Callable[[], float]:
        """The broker's clock, in seconds."""

    @property
    def release_timeout(self) -> float | None:
        """Seconds a release may run before its entry is quarantined (told to the processes)."""

    @property
    def running(self) -> bool:
        """Whether the broker runs (between its start and its close)."""

    def apply(self) -> None:
        """Perform the effects the core's last steps queued (never awaits)."""

    def at_step_end(self, callback: Callable[[], None]) -> bool:
        """Call ``callback`` once the effects being applied now are; false if none are."""

    def emit(self, level: str, event: str, **fields: Any) -> None:
        """Log ``event`` at ``level`` and hand it to the listeners."""

    def note_idle(self, entry: Entry) -> None:
        """``entry``'s last lease ended: it may expire before the idle timer's next run."""

    def learn_aliases(
        self, freed: Iterable[str], loaded: Iterable[str], cache: str, key: Hashable
    ) -> list[tuple[str, str]]:
        """A process's load fit only after freeing in ``freed``: evidence of one memory,
        as in-process; the pairs of spaces it merged."""

    async def open_block(
        self,
        name: str,
        release: ReleaseFunction,
        *,
        move: MoveFunction | None = None,
        elsewhere: Elsewhere | None = None,
        quiet: bool = False,
    ) -> Block:
        """Open the cache ``name`` of a process (its entries released through ``release``,
        and moved between tiers through ``move``, when its releaser can); ``elsewhere``
        is told of its grants and releases in the step that decides them; ``quiet``:
        the daemon's own, whose loads are not announced (``Block.quiet``)."""

    async def close_block(
        self,
        block: Block,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        """Close ``block``; raise ``LeasesOutstanding`` for leases still held."""

    async def request(
        self,
        owner: Owner,
        request: Request,
        *,
        urgent: bool = False,
        held: tuple[Entry, ...] | None = None,
        loading: tuple[Entry, ...] | None = None,
        counted: bool = True,
        releasing: bool = False,
    ) -> tuple[Entry, object]:
        """A process's request (``wire.decode_request``): the entry and the lease's holder,
        once granted. ``loading``: the entries whose loads (there) make it; ``counted``:
        whether it is a request (not one made by a prefetch there, ``Core.prefetch``);
        ``releasing``: made by a release (or a move) there, it is refused rather than
        made to wait (``DeadlockError``), as in-process."""

    def submit(
        self,
        owner: Owner,
        request: Request,
        *,
        task: object,
        urgent: bool = False,
        held: tuple[Entry, ...] | None = None,
        loading: tuple[Entry, ...] | None = None,
        counted: bool = True,
        releasing: bool = False,
    ) -> Ticket:
        """As ``request``, in this step and with no wait: the ticket, settled or pending;
        ``task`` holds its lease, and ``entry.shell.watch`` hears its outcome."""

    def adopt(
        self,
        owner: Owner,
        key: Hashable,
        load: Callable[[], Any],
        measure: Callable[[Any], Any],
        charge: dict[str, int],
        *,
        priority: int | None = None,
    ) -> Ticket:
        """Take on an entry a process holds already (``Core.adopt``), in this step."""

    async def settle(self, ticket: Ticket) -> tuple[Entry, object]:
        """Wait for an adopted entry's load: the entry and the lease's holder."""
