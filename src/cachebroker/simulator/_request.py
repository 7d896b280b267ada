"""The trace record: one request, as the replay, the offline optimum and the CSV reader see it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs

from .._errors import InvalidArgument

__all__ = ["Request", "check_fits", "where"]


@attrs.frozen(kw_only=True)
class Request:
    """One request of a trace.

    Attributes:
        time: When it arrives, in seconds (requests are replayed in this order).
        key: What it asks for; keys are per ``cache``.
        size: Bytes per space, e.g. ``{"default": 4 * 2**30}``.
        load_seconds: What a miss costs: the time to load the value.
        hold_seconds: How long the lease is held once granted.
        cache: The owner (plugin) of the key.
        line: Where the request came from (a trace's line number), for messages.
    """

    time: float
    key: str
    size: Mapping[str, int]
    load_seconds: float
    hold_seconds: float = 0.0
    cache: str = "default"
    line: int = 0


def check_fits(requests: Iterable[Request], budget: Mapping[str, int]) -> None:
    """Raise ``InvalidArgument`` for the first request no budget could ever hold."""
    for request in requests:
        for space, amount in request.size.items():
            if space not in budget:
                raise InvalidArgument(
                    f"{where(request)}requests space {space!r}, which the budget does not "
                    f"have (it has {sorted(budget)})"
                )
            if amount > budget[space]:
                raise InvalidArgument(
                    f"{where(request)}{request.cache}:{request.key} needs {amount} bytes of "
                    f"{space!r}, more than its whole budget of {budget[space]} bytes"
                )


def where(request: Request) -> str:
    """Where ``request`` came from, as a message prefix (``""`` when unknown)."""
    return f"line {request.line}: " if request.line else ""
