"""``Lease``: a hold on a loaded value, and the hit path (``docs/architecture.md``).

``Lease.__await__`` is the whole of a hit, in one frame; ``Lease.release`` is
one step on the books. Both talk to the cache's ``Actor``.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Awaitable, Callable, Generator, Hashable
from threading import get_ident
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, cast

from .. import _log_events as ev
from .._core import Entry, Owner, State
from .._errors import LeaseReleased
from ._backend import wrong_thread
from ._config import SizeSpec

if TYPE_CHECKING:
    from ._actor import Actor

__all__ = ["Lease"]


class _Source(Protocol):
    """What a lease reads of the cache that made it (``Cache``, which imports this)."""

    name: str
    _actor: Actor
    _entries: dict[Hashable, Entry]
    _owner: Owner

    async def _acquire_slow(self, lease: Lease[Any], entered: bool) -> tuple[Entry, object]: ...


T_co = TypeVar("T_co", covariant=True)

_READY = State.READY


_AENTER_DOC = """Acquire the lease (as ``await``), for ``async with cache.acquire(...) as lease``.

Cancellation: as for ``await``; the block is not entered.
"""


def _coroutine_twin(func: Callable[..., Any], name: str, doc: str) -> Callable[..., Any]:
    """A copy of the generator function ``func`` whose generators are awaitable themselves.

    ``__aenter__`` is ``__await__``'s twin: ``async with`` awaits the
    generator it returns as it is, so the block costs no ``__aenter__``
    frame nor ``__await__`` lookup (``__await__`` itself must return a plain
    iterator). The twin's ``_entered`` defaults to ``True``: a lease entered
    is ended by its block, in the acquiring task (see ``Lease.__await__``).
    """
    twin = types.FunctionType(func.__code__, func.__globals__, name, (True,), func.__closure__)
    twin.__qualname__ = func.__qualname__.rpartition(".")[0] + "." + name
    twin.__doc__ = doc
    return types.coroutine(twin)


class Lease(Generic[T_co]):
    """A hold on a loaded value: while any lease is held the value is never asked to release.

    ``cache.acquire(...)`` returns the lease before it is granted; awaiting it
    (``lease = await cache.acquire(...)``) or entering it (``async with
    cache.acquire(...) as lease``) acquires it, once. Leaving the ``async
    with`` block, or ``await lease.release()``, ends it.

    Attributes:
        key: The key the value was acquired under.
    """

    __slots__ = ("_cache", "_entry", "_load", "_size", "_task", "_timeout", "key")

    # The hit path builds one lease per call: the options most calls leave at
    # their defaults are read from the class (``_Tuned`` carries them).
    _cost: float | None = None
    _measure: Callable[[Any], Any] | None = None
    #: ``(concurrency, priority)`` given to the acquire (``_Tuned``).
    _limits: tuple[int | None, int | None] | None = None
    #: The spaces the acquire may be placed in (``spaces=``; ``_Tuned``).
    _places: tuple[str, ...] | None = None
    #: ``(idle_ttl, pin)`` for the entry once acquired, if either was given (``_Tuned``).
    _options: tuple[float | None, bool] | None = None

    # No __init__: ``Cache.acquire`` fills the fields in (``Lease()`` costs less than a call
    # to __init__, and the hit path builds one lease per call).
    if TYPE_CHECKING:
        _cache: _Source
        key: Hashable
        _load: Callable[[], Any]
        _size: SizeSpec
        _timeout: float | None
        _entry: Entry | None
        #: The holder task once granted; else _PENDING, _ACQUIRING or _RELEASED.
        _task: object

    def __await__(self, _entered: bool = False) -> Generator[Any, Any, Lease[T_co]]:
        """Acquire: ``lease = await cache.acquire(...)`` (see ``Cache.acquire``).

        Cancellation withdraws the request; nothing is held afterwards and the
        lease may be awaited again.

        ``_entered`` (``True`` in ``__aenter__``, its twin): the lease is
        bound to the acquiring task, which ends it by leaving its block; an
        awaited one may be handed to another task and released there, so the
        books never count it as one only its acquirer could free
        (``Core.request``'s ``bound``). The hit path binds nothing: a lease
        of an unlimited entry holds no slot a wait could be refused for.
        """
        # The hit path, written out in one frame: a ready entry is leased in
        # this step, without building a coroutine (docs/architecture.md).
        if self._task is not _PENDING:
            raise RuntimeError(
                f"this lease on {self._cache.name}:{self.key!r} was already awaited or entered; "
                "a lease is acquired once: call cache.acquire() again for another"
            )
        self._task = _ACQUIRING
        cache = self._cache
        actor = cache._actor
        try:
            if get_ident() != actor.thread:
                raise wrong_thread(f"asked for {cache.name}:{self.key!r}")
            checkpoint = actor.checkpoint
            if checkpoint is not None:  # trio: every acquire is a cancellation point
                yield from checkpoint().__await__()
            try:
                entry = cache._entries.get(self.key)
            except TypeError:
                entry = None  # _acquire_slow raises InvalidKey
            if (
                entry is not None
                and entry.state is _READY
                and entry.slots is None
                and not cache._owner.closing
            ):
                current_task = actor.current_task  # (an attribute: a method lookup costs more)
                task = current_task()
                actor.core.hit(entry, task)
                if actor.trace:
                    actor.log.debug(ev.HIT, cache=cache.name, key=self.key)
            else:
                slow = cache._acquire_slow(self, _entered)
                entry, task = yield from slow.__await__()
        except BaseException:
            self._task = _PENDING  # nothing was acquired: it may be awaited again
            raise
        self._entry = entry
        self._task = task
        return self

    if TYPE_CHECKING:

        async def __aenter__(self) -> Lease[T_co]:
            """Acquire the lease (as ``await``), for ``async with cache.acquire(...) as lease``."""
            ...

    else:
        __aenter__ = _coroutine_twin(__await__, "__aenter__", _AENTER_DOC)

    if TYPE_CHECKING:  # (what ``async with`` and ``AsyncExitStack`` expect)

        async def __aexit__(
            self,
            exc_type: type[BaseException] | None,
            exc: BaseException | None,
            tb: TracebackType | None,
        ) -> None:
            """End the lease (``release()``); never a cancellation point, never raises."""

    else:

        def __aexit__(self, exc_type, exc, tb):
            """End the lease (``release()``); never a cancellation point, never raises."""
            return self.release()

    @property
    def value(self) -> T_co:
        """The loaded value.

        Raises:
            LeaseReleased: the lease was released.
            RuntimeError: the lease was not acquired (awaited or entered) yet.
        """
        entry = self._entry
        if entry is None:
            if self._task is _RELEASED:
                raise LeaseReleased(
                    f"the lease on {self._cache.name}:{self.key!r} was released; acquire it again"
                )
            raise RuntimeError(
                f"the lease on {self._cache.name}:{self.key!r} is not acquired yet: "
                "await cache.acquire(...) or use it with 'async with'"
            )
        return cast(T_co, entry.value)

    @property
    def released(self) -> bool:
        """Whether the lease was acquired and then released."""
        return self._task is _RELEASED

    def release(self) -> Awaitable[None]:
        """End the lease: ``await lease.release()``. Idempotent; never raises.

        The lease ends when ``release()`` is called, in one synchronous step,
        so cancellation cannot leave it half-ended; the awaitable it returns
        is already complete (it is not a cancellation point). When this was
        the last lease the value becomes idle (kept while space allows) or, if
        it was invalidated or retention is off, it is released. On a lease
        not acquired yet it does nothing.
        """
        entry = self._entry
        if entry is None:
            return _DONE
        self._entry = None
        task = self._task
        self._task = _RELEASED
        actor = self._cache._actor
        if get_ident() != actor.thread:  # Ended from another thread: end it on the loop.
            actor.end_lease_soon(entry, task)
            return _DONE
        core = actor.core
        # When the entry went idle only matters to an idle TTL: skip the clock otherwise.
        timed = entry.ttl is not None or actor.idle_ttl is not None
        core.lease_end(entry, task, actor.clock() if timed else 0.0)
        if core.effects:
            actor.apply()
        if timed and not entry.leases:
            actor.note_idle(entry)
        return _DONE

    def __del__(self) -> None:
        # A lease garbage-collected while held (its task died, or it was
        # dropped): end it, or its bytes would stay pinned for good.
        entry = self._entry
        if entry is not None:
            self._cache._actor.lease_dropped(entry, self._task, self.key)

    def __repr__(self) -> str:
        if self._entry is not None:
            state = "held"
        else:
            state = "released" if self._task is _RELEASED else "not acquired"
        return f"<Lease {self.key!r} {state}>"


class _Tuned(Lease[T_co]):
    """A ``Lease`` whose acquire was given ``cost``, ``measure``, ``idle_ttl``, ``pin``,
    ``concurrency`` or ``priority``."""

    __slots__ = ("_cost", "_limits", "_measure", "_options", "_places")

    def __await__(self, _entered: bool = False) -> Generator[Any, Any, Lease[T_co]]:
        if self._limits is not None:
            # The books apply them before granting: to an entry loaded already
            # now (a hit of a limited entry then takes the slow path), to a new
            # one as the request creates it.
            actor = self._cache._actor
            try:
                entry = self._cache._entries.get(self.key)
            except TypeError:
                entry = None  # the acquire raises InvalidKey
            if entry is not None and entry.state is _READY and get_ident() == actor.thread:
                slots, priority = self._limits
                actor.core.limit(entry, slots=slots, priority=priority)
                actor.apply()
        lease = yield from Lease.__await__(self, _entered)
        if self._options is not None and self._entry is not None:
            idle_ttl, pin = self._options
            self._cache._actor.core.configure(self._entry, idle_ttl=idle_ttl, pin=pin or None)
        return lease

    if not TYPE_CHECKING:
        __aenter__ = _coroutine_twin(__await__, "__aenter__", _AENTER_DOC)


class _Marker:
    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return self._name


_PENDING = _Marker("<not acquired>")
_ACQUIRING = _Marker("<acquiring>")
_RELEASED = _Marker("<released>")


# ---------------------------------------------------------------------- helpers


@types.coroutine
def _complete() -> Generator[Any, Any, None]:
    return
    yield  # a generator: ``types.coroutine`` makes it awaitable


def _completed() -> Awaitable[None]:
    """An awaitable that is already complete (what ``Lease.release`` returns).

    A finished generator-based coroutine: ``await`` takes it as it is (no
    ``__await__`` call, no iterator built) and resumes it, which for a
    finished generator returns ``None`` at once, in C. It can be awaited any
    number of times, from any thread, since nothing in it changes.
    """
    done = _complete()
    with contextlib.suppress(StopIteration):
        done.send(None)
    return cast(Awaitable[None], done)


_DONE = _completed()
