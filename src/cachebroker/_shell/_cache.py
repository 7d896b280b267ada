"""``Cache``, a plugin's view of the broker, and the block that opens and closes it.

A ``Cache`` checks its arguments and builds leases (``Lease``); what it asks
of the broker goes through its ``Actor`` (``_actor``): the hit path's books,
the slow path's ``request``, the block's ``open_block`` and ``close_block``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from threading import get_ident
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar, overload

import anyio

from .._core import Entry, Request
from .._errors import BrokerClosed, InvalidArgument, InvalidKey
from .._sizes import parse_bytes, parse_size
from ._backend import wrong_thread
from ._config import (
    MoveFunction,
    ReleaseFunction,
    SizeSpec,
    eviction_priority,
    lease_slots,
    non_negative_seconds,
    positive_seconds,
)
from ._lease import _PENDING, Lease, _Tuned

if TYPE_CHECKING:
    from ._actor import Actor, Block

__all__ = ["Cache"]

T = TypeVar("T")

#: Sizes checked once and remembered per cache (hashable, immutable).
_PLAIN = frozenset({int, str})


class _CacheBlock:
    """The async context manager returned by ``Broker.cache``."""

    __slots__ = ("_actor", "_block", "_defaults", "_mover", "_name", "_releaser")

    def __init__(
        self,
        actor: Actor,
        name: str,
        releaser: ReleaseFunction,
        defaults: tuple[int | None, int, float | None] = (None, 0, None),
        mover: MoveFunction | None = None,
    ) -> None:
        self._actor = actor
        self._name = name
        self._releaser = releaser
        self._mover = mover
        #: (concurrency, priority, idle_ttl) of the cache's entries by default.
        self._defaults = defaults
        self._block: Block | None = None

    async def __aenter__(self) -> Cache:
        actor = self._actor
        actor.check_running()
        slots, priority, ttl = self._defaults
        block = self._block = await actor.open_block(
            self._name, self._releaser, slots=slots, priority=priority, ttl=ttl, move=self._mover
        )
        return Cache(actor, block)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._block is not None
        return await self._actor.close_block(self._block, exc_type, exc, tb)


class Cache:
    """A plugin's view of the broker, yielded by ``broker.cache(name, releaser)``.

    Keys are this cache's own: another cache's ``"base"`` is a different entry.
    Loads and releases of this cache's entries run in its block's task group.

    Leaving the block closes the cache: new acquires fail with
    ``BrokerClosed``, requests still waiting fail with ``BrokerClosed``, loads
    in flight are cancelled (the worker thread of a plain loader, which cannot
    be stopped, is not waited for: what it makes is released through the
    releaser once it returns), idle entries are released through the releaser
    and awaited. Leased entries are released when their last lease ends; the
    exit waits for that up to ``release_timeout``. Leases still held then are
    never freed under their holders: the exit raises ``LeasesOutstanding``
    naming them, and their bytes stay charged (quarantined) since nobody is
    left to release them.
    """

    __slots__ = ("_actor", "_block", "_entries", "_owner", "_sizes_seen", "name")

    def __init__(self, actor: Actor, block: Block) -> None:
        self._actor = actor
        self._block = block
        self._owner = owner = block.owner
        self._entries = owner.entries
        #: Plain sizes (ints, strings) already checked, so a hit checks them cheaply.
        self._sizes_seen: dict[object, None] = {}
        self.name = owner.name

    def __repr__(self) -> str:
        return f"<Cache {self.name!r} entries={len(self._owner.live)}>"

    @overload
    def acquire(
        self,
        key: Hashable,
        *,
        load: Callable[[], Awaitable[T]],
        size: SizeSpec = None,
        measure: Callable[[T], Any] | None = None,
        timeout: float | None = None,
        cost: float | None = None,
        idle_ttl: float | None = None,
        pin: bool = False,
        concurrency: int | None = None,
        priority: int | None = None,
        spaces: None = None,
    ) -> Lease[T]: ...

    @overload
    def acquire(
        self,
        key: Hashable,
        *,
        load: Callable[[], T],
        size: SizeSpec = None,
        measure: Callable[[T], Any] | None = None,
        timeout: float | None = None,
        cost: float | None = None,
        idle_ttl: float | None = None,
        pin: bool = False,
        concurrency: int | None = None,
        priority: int | None = None,
        spaces: None = None,
    ) -> Lease[T]: ...

    @overload
    def acquire(
        self,
        key: Hashable,
        *,
        load: Callable[[str], Awaitable[T]],
        size: SizeSpec = None,
        measure: Callable[[T], Any] | None = None,
        timeout: float | None = None,
        cost: float | None = None,
        idle_ttl: float | None = None,
        pin: bool = False,
        concurrency: int | None = None,
        priority: int | None = None,
        spaces: Sequence[str],
    ) -> Lease[T]: ...

    @overload
    def acquire(
        self,
        key: Hashable,
        *,
        load: Callable[[str], T],
        size: SizeSpec = None,
        measure: Callable[[T], Any] | None = None,
        timeout: float | None = None,
        cost: float | None = None,
        idle_ttl: float | None = None,
        pin: bool = False,
        concurrency: int | None = None,
        priority: int | None = None,
        spaces: Sequence[str],
    ) -> Lease[T]: ...

    def acquire(
        self,
        key: Hashable,
        *,
        load: Callable[..., Any],
        size: SizeSpec = None,
        measure: Callable[[Any], Any] | None = None,
        timeout: float | None = None,
        cost: float | None = None,
        idle_ttl: float | None = None,
        pin: bool = False,
        concurrency: int | None = None,
        priority: int | None = None,
        spaces: Sequence[str] | None = None,
    ) -> Lease[Any]:
        """Lease the value of ``key``, loading it first if needed.

        Use as ``lease = await cache.acquire(...)`` (then ``await
        lease.release()``) or ``async with cache.acquire(...) as lease``.

        Args:
            key: Any hashable; keys are per cache.
            load: Called with no argument to make the value on a miss; an async
                callable runs in this cache's task group, a plain one in a
                worker thread (an awaitable it returns, as from
                ``lambda: load_model(name)``, is then awaited in the task
                group). Concurrent acquires of one key share one load.
            size: What admission reserves before ``load`` runs: bytes or
                ``"3GiB"`` in the default space, or a mapping of space to
                either. A callable here means ``measure=`` with no declared
                size.
            measure: Called with the loaded value, returns its real size (as
                for ``size``); the books are corrected to it (evicting more if
                it is larger) and it is remembered for the key, across
                evictions (``Broker.export_sizes``). Without ``size``, a load
                reserves the key's remembered size; a key never measured is a
                load of unknown size: such loads run one at a time, each
                reserving the largest size its cache has measured in each
                space, so together they never overshoot the budget by more
                than one load's error, which its measurement corrects.
            timeout: Seconds to wait for space and for the load; ``None`` waits
                as long as it takes. On expiry ``AcquireTimeout`` is raised.
            cost: What reloading the value costs, in seconds, for cost-aware
                policies; by default the measured load time.
            idle_ttl: This entry's idle TTL in seconds, overriding the broker's
                (like Ollama's per-request keep_alive; the latest acquire's
                setting wins). 0 releases it as soon as its last lease ends;
                ``math.inf`` keeps it until evicted for space.
            pin: Keep the entry resident regardless of policy and idle time
                while this cache is open (until ``unpin(key)``). It is still
                released by ``invalidate``, ``clear`` and closing the cache.
            concurrency: At most this many leases on the entry at once (1: a
                per-model mutex, for a backend that must not be called twice
                at once); more acquirers wait for a lease slot, first come
                first served, without loading or evicting anything. ``None``:
                the cache's default (``broker.cache(..., concurrency=)``,
                unlimited unless set). The latest acquire's setting wins.
            priority: The entry's eviction priority: idle entries of lower
                priority are evicted before any of higher priority, whatever
                the policy's ranking, and a request never evicts entries of a
                higher priority than its own (it waits instead). ``None``: the
                cache's default (0 unless set). The latest acquire's setting wins.
            spaces: Places the value may be loaded in, such as ``["cuda:0",
                "cuda:1"]``; ``size`` is then its size in whichever is chosen
                (bytes or ``"16GiB"``), and ``load`` is called with the chosen
                space's name. The broker chooses when it grants the load: the
                first place where it fits without evicting, else the first
                where releases already under way make room, else the one whose
                eviction costs the least reload time by the policy's choice of
                victims; first come first served still holds in each space.
                A value moved down a tier (``Broker(tiers=...)``) is placed
                again the same way when an acquire moves it back up.

        Raises:
            RequestTooLarge: the size exceeds a space's whole budget.
            DeadlockError: room could only be made by evicting leases this task
                holds, or the lease slots it waits for are all this task's own.
            AcquireTimeout: ``timeout`` expired (``waiting_for`` says for what:
                ``"space"``, ``"load"``, ``"release"`` or ``"lease"``).
            BrokerClosed: the cache or the broker is closed.

        Cancellation: cancelling the caller while it waits withdraws its request;
        the shared load goes on for the other requesters and is cancelled (its
        reservation returned) when the last one leaves. On trio a cache hit is a
        cancellation point, and every 32nd one a schedule point too; on
        asyncio a hit completes without suspending.
        """
        # Arguments are checked on every call, hits included: code that works
        # with a warm cache must not fail after an eviction.
        if not callable(load):
            raise TypeError(
                f"acquiring {self.name}:{key!r}: load must be a callable taking "
                + ("the chosen space's name" if spaces is not None else "no argument")
                + f", got {load!r}"
            )
        if spaces is not None:  # (the size is the one in whichever space is chosen)
            spaces = self._check_places(key, spaces, size)
        elif size is not None and (size.__class__ not in _PLAIN or size not in self._sizes_seen):
            self._check_size(key, size)
        if timeout is not None:
            timeout = positive_seconds(timeout, "timeout", inf_is_none=True)
        lease: Lease[Any]
        if (
            cost is None
            and idle_ttl is None
            and pin is False
            and measure is None
            and concurrency is None
            and priority is None
            and spaces is None
        ):
            lease = Lease()  # The hit path's usual call.
        else:
            if cost is not None:
                cost = non_negative_seconds(cost, "cost")
            if idle_ttl is not None:
                idle_ttl = non_negative_seconds(idle_ttl, "idle_ttl", allow_inf=True)
            if not isinstance(pin, bool):
                raise TypeError(f"pin must be True or False, got {pin!r}")
            if measure is not None and not callable(measure):
                raise TypeError(
                    f"measure must be a callable taking the loaded value, got {measure!r}"
                )
            if measure is not None and callable(size):
                raise TypeError(
                    "give the measurement once: either size=callable or measure=callable, not both"
                )
            if concurrency is not None:
                concurrency = lease_slots(concurrency)
            if priority is not None:
                priority = eviction_priority(priority)
            tuned: _Tuned[Any] = _Tuned()
            tuned._cost = cost
            tuned._measure = measure
            tuned._limits = (
                None if concurrency is None and priority is None else (concurrency, priority)
            )
            #: ``(idle_ttl, pin)`` for the entry once acquired, if either was given.
            tuned._options = None if idle_ttl is None and not pin else (idle_ttl, pin)
            tuned._places = spaces
            lease = tuned
        # ``Lease`` has no __init__ (a call to one costs a tenth of a hit): its
        # fields are filled in here.
        lease._cache = self
        lease.key = key
        lease._load = load
        lease._size = size
        lease._timeout = timeout
        lease._entry = None
        lease._task = _PENDING
        return lease

    async def prefetch(
        self,
        key: Hashable,
        *,
        load: Callable[..., Any],
        size: SizeSpec = None,
        measure: Callable[[Any], Any] | None = None,
        timeout: float | None = None,
        cost: float | None = None,
        idle_ttl: float | None = None,
        pin: bool = False,
        priority: int | None = None,
        spaces: Sequence[str] | None = None,
    ) -> None:
        """Load ``key`` into the cache without holding a lease; return once it is loaded.

        The arguments are ``acquire``'s, checked the same way (a prefetch
        holds no lease, so it takes no ``concurrency``; its ``priority`` is the
        entry's, as for an acquire). A key already
        loaded is not loaded again (``idle_ttl`` and ``pin``, if given, apply
        to it at once, and an idle one's idle time starts over); one loading
        is joined, as an acquire joins it. Once loaded, the value is an
        ordinary idle entry: the policy may evict it for the very next request.

        A prefetch is no request: it counts neither a hit nor a miss in
        ``stats()`` and the policy is not told of it (a prediction of demand
        is not demand). Its load counts as any load (``Stats.loads``,
        ``EntryInfo.loads``).

        Raises:
            what ``acquire`` raises: the loader's own exception (or
            ``LoadFailed``), ``AcquireTimeout`` once ``timeout`` expired
            (waiting for space or for the load), ``RequestTooLarge``,
            ``OutOfSpace``, ``DeadlockError``, ``BrokerClosed``,
            ``WrongEventLoop``.

        Cancellation: as for a cancelled acquire: the request is withdrawn,
        and the load goes on for the other requesters (it is cancelled when
        the last one leaves). Cancelled once the load ended, the value stays
        loaded, idle.

        .. versionadded:: 0.1.0
        """
        # The checks and errors of acquire's, on a lease that is never awaited.
        check: Any = self.acquire  # (one call for the overloads with and without spaces)
        check(
            key,
            load=load,
            size=size,
            measure=measure,
            timeout=timeout,
            cost=cost,
            idle_ttl=idle_ttl,
            pin=pin,
            priority=priority,
            spaces=spaces,
        )
        places = None if spaces is None else self._check_places(key, spaces, size)
        if timeout is not None:
            timeout = positive_seconds(timeout, "timeout", inf_is_none=True)
        if cost is not None:
            cost = non_negative_seconds(cost, "cost")
        if idle_ttl is not None:
            idle_ttl = non_negative_seconds(idle_ttl, "idle_ttl", allow_inf=True)
        actor = self._actor
        if get_ident() != actor.thread:
            raise wrong_thread(f"asked to prefetch {self.name}:{key!r}")
        actor.refresh_trace()
        self._find(key)  # an unhashable key is an InvalidKey
        if self._block.closed or not actor.running:
            raise BrokerClosed(
                f"cache {self.name!r} is closed: cannot prefetch {self.name}:{key!r}"
            )
        if callable(size):
            measure, size = size, None
        request = Request(
            key,
            self._need(key, size, measure, places, "prefetching"),
            load=load,
            measure=measure,
            cost=cost,
            timeout=timeout,
            idle_ttl=idle_ttl,
            pin=pin,
            priority=priority,
            places=places,
        )
        await actor.prefetch(self._owner, request)

    async def invalidate(self, key: Hashable) -> bool:
        """Drop ``key``'s value so the next acquire loads afresh.

        An idle value is released at once and its acknowledgement awaited; a
        leased one is released when its last lease ends. Returns whether there
        was a value to drop. Cancellation stops the wait for the
        acknowledgement; the value is dropped either way.
        """
        actor = self._actor
        if self._block.closed:
            raise BrokerClosed(
                f"cache {self.name!r} is closed: cannot invalidate {self.name}:{key!r}"
            )
        actor.check_running()
        entry = self._find(key)
        dropped = actor.core.invalidate(self._owner, key)
        actor.apply()
        if dropped and entry is not None:  # (await_releases skips one still leased)
            await actor.await_releases([entry])
        else:
            await anyio.lowlevel.checkpoint()
        return dropped

    async def unpin(self, key: Hashable) -> bool:
        """Let the policy and the idle TTL govern ``key`` again (see ``acquire(pin=True)``).

        Returns whether it was pinned. Cancellation: the entry is unpinned in
        one step before the call's only checkpoint.
        """
        actor = self._actor
        if self._block.closed:
            raise BrokerClosed(f"cache {self.name!r} is closed: cannot unpin {self.name}:{key!r}")
        actor.check_running()
        self._find(key)
        unpinned = actor.core.unpin(self._owner, key, actor.clock())
        actor.apply()
        entry = self._entries.get(key)
        if entry is not None and entry.idle_seq:
            actor.note_idle(entry)
        await anyio.lowlevel.checkpoint()
        return unpinned

    def _check_places(self, key: Hashable, spaces: object, size: object) -> tuple[str, ...]:
        """Check ``acquire(spaces=...)``: names of the budget's spaces, and a plain size."""
        what = f"acquiring {self.name}:{key!r}"
        if isinstance(spaces, str) or not isinstance(spaces, Sequence):
            raise TypeError(
                f"{what}: spaces must be a list of space names, such as "
                f"['cuda:0', 'cuda:1'], got {spaces!r}"
            )
        budget = self._actor.budget
        places = tuple(spaces)
        if not places:
            raise InvalidArgument(f"{what}: spaces must name at least one space")
        for name in places:
            if not isinstance(name, str):
                raise TypeError(f"{what}: spaces must be names (str), got {name!r}")
            if name not in budget:
                raise InvalidArgument(
                    f"{what}: spaces names {name!r}, which is not in the budget "
                    f"({', '.join(map(repr, budget))})"
                )
        if len(set(places)) != len(places):
            raise InvalidArgument(f"{what}: spaces names a space twice: {list(places)!r}")
        if size is None or callable(size) or isinstance(size, Mapping):
            raise InvalidArgument(
                f"{what}: with spaces=, size must be the value's size in whichever space "
                f"is chosen, as bytes or a string like '16GiB', got {size!r}"
            )
        parse_bytes(size)
        return places

    def _check_size(self, key: Hashable, size: object) -> None:
        """Check a size given to ``acquire`` (raising as ``parse_size``); remember plain ones."""
        if callable(size):
            return
        try:
            parse_size(size, self._actor.budget)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"acquiring {self.name}:{key!r}: {exc}") from None
        if size.__class__ in _PLAIN and len(self._sizes_seen) < 1024:
            self._sizes_seen[size] = None

    def _need(
        self,
        key: Hashable,
        size: SizeSpec,
        measure: Callable[[Any], Any] | None,
        places: tuple[str, ...] | None,
        doing: str,
    ) -> dict[str, int] | None:
        """What a miss reserves (``None``: measured after the load), from checked arguments.

        With ``places``, ``size`` is the size in the first of them (the scheduler
        chooses among them). ``doing`` names the call in an error.
        """
        if places is not None:
            return {places[0]: parse_bytes(size)}
        if size is None and measure is not None:
            return None
        try:
            return parse_size(size, self._actor.budget)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{doing} {self.name}:{key!r}: {exc}") from None

    def _find(self, key: Hashable) -> Entry | None:
        try:
            return self._entries.get(key)
        except TypeError:
            raise InvalidKey(
                f"keys of cache {self.name!r} must be hashable, got {type(key).__name__} {key!r}"
            ) from None

    async def _acquire_slow(self, lease: Lease[Any], entered: bool) -> tuple[Entry, object]:
        """Acquire ``lease.key`` when it is not ready (a miss, a join), or with limits: the
        entry and its holder. ``entered``: by ``async with`` (``Lease.__await__``).

        The request is built here, once, from what ``acquire`` checked; the
        actor, the runner, the books and the wire take it whole.
        """
        actor = self._actor
        key = lease.key
        actor.refresh_trace()  # see Runner.__init__
        self._find(key)  # an unhashable key is an InvalidKey
        if self._block.closed or not actor.running:
            raise BrokerClosed(f"cache {self.name!r} is closed: cannot acquire {self.name}:{key!r}")
        size, measure, places = lease._size, lease._measure, lease._places
        if callable(size):
            measure, size = size, None
        slots, priority = (None, None) if lease._limits is None else lease._limits
        idle_ttl, pin = (None, False) if lease._options is None else lease._options
        request = Request(
            key,
            self._need(key, size, measure, places, "acquiring"),
            load=lease._load,
            measure=measure,
            cost=lease._cost,
            timeout=lease._timeout,
            idle_ttl=idle_ttl,
            pin=pin,
            slots=slots,
            priority=priority,
            places=places,
        )
        return await actor.request(self._owner, request, bound=entered)
