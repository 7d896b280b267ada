"""The side of a broker connected to the machine's shared one: ``LinkAdmission`` (its
``Remote``) and ``connected_runner``, the runner ``Broker.connect`` builds on it.

The link itself (``_client.Link``) carries the messages; this side is what the
runner sees of it: the daemon's books and settings once welcomed, each load
and promotion waiting for the daemon's grant, the questions asked of it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Any

import anyio

from .._core import Entry, State
from .._shell._config import oom_error_types, remembered_sizes
from .._shell._requests import need_words
from .._shell._runner import Runner
from .._shell._seam import FailedThere, Freed, Refused, Terms
from .._shell._steps import Spawn, Steps
from . import _protocol as wire
from ._client import Link, Reconnect, _opening
from ._client_books import client_books

__all__ = ["LinkAdmission", "connected_runner"]


def connected_runner(
    address: str,
    *,
    logger: object,
    oom_errors: tuple[type[BaseException], ...] = (),
    oom_retries: int = 8,
    reconnect: Reconnect | None = None,
    sizes: Mapping[str, Mapping[Any, Any]] | None = None,
    clock: Callable[[], float] | None = None,
    blocking_warning: float | None = 0.1,
) -> Runner:
    """The runner of a broker connected to a shared one (``Broker.connect``).

    An ordinary runner whose other side is the link (``LinkAdmission``): its
    books and settings are the daemon's, from its ``welcome`` on.
    """
    return Runner(
        client_books({}, None),
        budget={},
        probes={},
        idle_ttl=None,
        release_timeout=30.0,
        blocking_warning=blocking_warning,
        lease_warning=60.0,
        memory_wait=None,
        probe_interval=None,
        oom_errors=oom_errors or oom_error_types(()),
        oom_retries=oom_retries,
        alias_threshold=3,
        clock=clock,
        logger=logger,
        remote=LinkAdmission(address, reconnect, sizes),
    )


class LinkAdmission:
    """The side of a broker connected to a shared one (``Remote``): admission waits for the daemon.

    It connects before the runner starts (the daemon's welcome gives the
    books their budget and the settings), serves the link in the broker's
    task group, tells the daemon of each cache and each load these books
    grant, and has each load wait for the daemon's grant (``Link.admit``).
    """

    __slots__ = ("_runner", "address", "link", "opened", "reconnect", "shared_used", "sizes")

    admits_elsewhere = True

    def __init__(
        self,
        address: str,
        reconnect: Reconnect | None = None,
        sizes: Mapping[str, Mapping[Any, Any]] | None = None,
    ) -> None:
        self.address = address
        #: Measured sizes to start from (``Broker.connect(sizes=)``), checked against the
        #: daemon's spaces once it says them.
        self.sizes = sizes
        self.link: Link | None = None
        self.reconnect = Reconnect() if reconnect is None else reconnect
        #: The caches open here, in the order they were opened (``Link.register``), and
        #: whether each one's releaser moves values.
        self.opened: dict[str, bool] = {}
        self._runner: Steps | None = None
        #: The daemon's last news of the shared books: bytes used per space.
        self.shared_used: Mapping[str, int] | None = None

    async def start(self, runner: Steps) -> Terms | None:
        link = Link(self.address, runner, self.opened, self.reconnect)
        welcome = await link.open()
        try:
            budget = wire.charge(welcome, "budget") or {}
            idle_ttl = welcome.get("idle_ttl")
            release_timeout = welcome.get("release_timeout")
            limit = wire.charge(welcome, "limit")
            core = client_books(budget, idle_ttl, limit, seam=link.seam)
            for keep, other in wire.decode_aliases(welcome, core.spaces):
                core.merge_spaces(keep, other)  # (as the daemon's books know them)
            for cache_name, key, charge in remembered_sizes(self.sizes, budget):
                core.remember(cache_name, key, charge)
        except BaseException:
            await anyio.aclose_forcefully(link.stream)  # type: ignore[arg-type]
            raise
        self.link = link
        self._runner = runner
        return Terms(core, dict(budget), idle_ttl, release_timeout)

    def started(self, spawn: Spawn) -> None:
        assert self.link is not None
        spawn(self.link.run, name=f"cachebroker link {self.address}")

    async def stop(self) -> None:
        if self.link is not None:
            await self.link.finish()

    def cache_opened(self, name: str, moves: bool) -> None:
        # (The books here have no tiers: the shared broker's decide, and ask
        # this process to move: ``Link.move``.)
        assert self.link is not None
        self.opened[name] = moves
        self.link.post(_opening(name, moves))

    def cache_closed(self, name: str) -> None:
        assert self.link is not None
        self.opened.pop(name, None)
        self.link.post({"op": "close", "cache": name})

    def load_started(self, entry: Entry) -> None:
        assert self.link is not None
        self.link.request(entry)

    def admitting(self) -> Collection[Entry]:
        return () if self.link is None else self.link.awaiting

    async def admit(self, entry: Entry) -> BaseException | None:
        assert self.link is not None
        return await self.link.admit(entry)

    async def admit_move(self, entry: Entry) -> BaseException | None:
        assert self.link is not None
        return await self.link.promote(entry)

    def learns_aliases(self, entry: Entry, freed: Collection[str]) -> bool:
        link = self.link
        id = None if link is None else link.ids.get(entry)
        if link is None or id is None:
            return False
        if link.error is None and link.online:
            link.post(
                {
                    "op": "evidence",
                    "id": id,
                    "freed": sorted(freed),
                    "loaded": sorted(entry.charge),
                }
            )
        return True  # (the daemon's books learn it, and tell every process)

    async def free_for_retry(self, entry: Entry) -> Freed | None:
        return None if self.link is None else await self.link.free(entry)

    def ask_why(self, entry: Entry) -> Callable[[str], Awaitable[str]] | None:
        link = self.link
        if link is None or not link.online or link.told.get(entry, "") is not None:
            return None
        answer = link.ask_why(entry)

        async def because(what: str) -> str:
            text = await answer()
            return what if not text else f"{what}: {text}"

        return because

    def waiting_for(self, entry: Entry) -> tuple[str | None, str] | None:
        link = self.link
        if link is None:
            return None
        promoting = entry in link.awaiting and entry.state is State.MOVING
        if promoting or (entry in link.told and link.told[entry] is None):
            if not link.online:
                return "space", f"the broker at {self.address} to come back (reconnecting)"
            # (as in-process: the space it needs, then the daemon's own words: ``ask_why``)
            need = need_words(entry) if not entry.unknown else ""
            space = f"space ({need})" if need else "space"
            if promoting:
                return "space", (
                    f"{space} to move it back up from the lower tier, from the broker at "
                    f"{self.address}"
                )
            return "space", f"{space} from the broker at {self.address}"
        return None

    async def shared_totals(self) -> Mapping[str, int] | None:
        if self.link is None or self._runner is None:
            return None
        totals = await self.link.fetch_totals()
        if totals is None:
            self.shared_used = None
            return None
        used = self.shared_used = wire.charge(totals, "used")
        budget = wire.charge(totals, "budget") or {}
        limit = wire.charge(totals, "limit") or {}
        for name, space in self._runner.core.spaces.items():  # probed spaces move
            space.budget = budget.get(name, space.budget)
            space.limit = limit.get(name, space.limit)
        return used

    def release_outcome(self, exc: BaseException) -> Refused | FailedThere | None:
        return None  # (its releases run here)

    def holder_names(self, entry: Entry) -> list[str] | None:
        return None  # (its holders are its own tasks)
