"""The exception hierarchy: every error the broker raises derives from BrokerError.

Errors about bad arguments also derive from the matching built-in
(``ValueError``/``TypeError``) so callers can catch them either way.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, TypeVar

from ._units import format_bytes

__all__ = [
    "BrokerClosed",
    "BrokerError",
    "DeadlockError",
    "InvalidArgument",
    "InvalidKey",
    "LeaseReleased",
    "LeasesOutstanding",
    "LoadFailed",
    "OutOfSpace",
    "ReleaseFailed",
    "RequestTooLarge",
    "AcquireTimeout",
    "WrongEventLoop",
]


class BrokerError(Exception):
    """Base class of every error raised by cachebroker."""

    def __reduce__(self) -> tuple[Any, ...]:
        # Subclasses' __init__ take other arguments than ``args`` (the message),
        # which is what pickle and copy would call them with: rebuild the
        # exception without __init__, then restore its attributes.
        return _rebuild, (type(self), self.args), self.__dict__ or None


class InvalidArgument(BrokerError, ValueError):
    """An argument had the right type but a value the broker cannot use."""


class InvalidKey(BrokerError, TypeError):
    """A cache key was not hashable."""


class OutOfSpace(BrokerError):
    """Not enough memory for a load.

    Loaders may raise it themselves to say that the device is full.
    """


class RequestTooLarge(OutOfSpace, InvalidArgument):
    """A size exceeds the whole budget of a space: no eviction could ever fit it."""

    def __init__(self, space: str, size: int, budget: int, *, entry: str | None = None) -> None:
        about = f"{entry} needs " if entry else "size "
        super().__init__(
            f"{about}{format_bytes(size)} in space {space!r}, which exceeds the space's "
            f"whole budget of {format_bytes(budget)}"
        )
        self.space = space
        self.size = size
        self.budget = budget
        #: The entry it was about, as ``cache:key`` (``None`` when there was none).
        self.entry = entry


class DeadlockError(BrokerError, RuntimeError):
    """A request could only be met by evicting entries leased by the requesting task."""

    def __init__(self, message: str, leases: Sequence[tuple[str, Hashable]]) -> None:
        super().__init__(message)
        self.leases = tuple(leases)


class AcquireTimeout(BrokerError, TimeoutError):
    """``acquire(timeout=...)`` ran out of time waiting for space or for a load.

    Attributes:
        entry: The entry it was about, as ``cache:key`` (``None`` when unknown).
        waiting_for: What the request still waited for: ``"space"`` (admission:
            other entries had to be released first; worth retrying later),
            ``"load"`` (the entry's load, shared with other requesters),
            ``"release"`` (the key's previous value was being released), or
            ``"lease"`` (a lease slot of the loaded entry: ``concurrency=``);
            ``None`` when unknown.
    """

    def __init__(
        self, message: str, *, entry: str | None = None, waiting_for: str | None = None
    ) -> None:
        super().__init__(message)
        self.entry = entry
        self.waiting_for = waiting_for


class BrokerClosed(BrokerError, RuntimeError):
    """The broker or the cache was closed while, or before, the operation ran."""


class LoadFailed(BrokerError):
    """A load failed with something that is not an ordinary error of its own.

    Requesters get it, chained (``__cause__``) to what the loader or the size
    callable raised, when that was a ``CancelledError`` not meant for the
    broker (a library's cancelled inner future or internal timeout) or a
    process-level ``BaseException`` (``KeyboardInterrupt``, ``SystemExit``,
    ...), which the broker then lets propagate. A cancellation is never raised
    into the requesters of a load.
    """


class ReleaseFailed(BrokerError):
    """A releaser raised or did not acknowledge within the release timeout."""


class LeasesOutstanding(BrokerError, RuntimeError):
    """A cache block was left while some of its entries were still leased."""

    def __init__(self, cache: str, keys: Sequence[Hashable], waited: float) -> None:
        shown = ", ".join(f"{cache}:{key!r}" for key in list(keys)[:10])
        more = f" and {len(keys) - 10} more" if len(keys) > 10 else ""
        super().__init__(
            f"cache {cache!r} was closed with {len(keys)} entr"
            f"{'y' if len(keys) == 1 else 'ies'} still leased after waiting "
            f"{waited:g}s: {shown}{more}; their values were not released"
        )
        self.cache = cache
        self.keys = tuple(keys)


class WrongEventLoop(BrokerError, RuntimeError):
    """The broker was used from a thread other than the one whose event loop runs it."""


class LeaseReleased(BrokerError, RuntimeError):
    """The value of a lease was used after the lease was released."""


_E = TypeVar("_E", bound=BrokerError)


def _rebuild(cls: type[_E], args: tuple[Any, ...]) -> _E:
    """Unpickle (or copy) a ``BrokerError``: its ``args`` as they were, no ``__init__``."""
    error = cls.__new__(cls, *args)
    error.args = args  # OSError's __new__ (AcquireTimeout's) leaves them to __init__
    return error
