"""The trace record: one request, as the replay, the offline optimum and the CSV reader see it."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Final

import attrs

from .._errors import InvalidArgument
from .._sizes import tier_map

__all__ = ["PROMOTE_FRACTION", "Request", "check_fits", "check_tiers", "where"]

#: A request that gives no ``promote_seconds`` takes this share of its
#: ``load_seconds``: reading a value back from host memory (~12-25 GB/s over
#: PCIe) instead of storage (~1.5 GB/s) and skipping most of its initialisation.
PROMOTE_FRACTION: Final = 0.1


def _promote_default(request: Request) -> float:
    return request.load_seconds * PROMOTE_FRACTION


def _demote_default(request: Request) -> float:
    return request.promote_seconds


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
        promote_seconds: With memory tiers: what a miss costs when the value
            waits in the lower tier, the time to move it back up. Default:
            ``PROMOTE_FRACTION`` (a tenth) of ``load_seconds``.
        demote_seconds: With memory tiers: the time moving the value down
            takes (it is charged in both tiers meanwhile; no reload time).
            Default: ``promote_seconds``.
    """

    time: float
    key: str
    size: Mapping[str, int]
    load_seconds: float
    hold_seconds: float = 0.0
    cache: str = "default"
    line: int = 0
    promote_seconds: float = attrs.field(default=attrs.Factory(_promote_default, takes_self=True))
    demote_seconds: float = attrs.field(default=attrs.Factory(_demote_default, takes_self=True))


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


def check_tiers(
    tiers: Mapping[str, str] | None, budget: Mapping[str, int], requests: Iterable[Request]
) -> dict[str, str]:
    """``tiers`` as a dict, checked: spaces of the budget, one level, and tier costs of requests.

    One level: a lower tier has no tier below it (a promotion's cost is one
    number per request). Each request's ``promote_seconds`` and
    ``demote_seconds`` must be non-negative and finite.

    Raises:
        InvalidArgument: a space outside the budget, a space below itself or a
            tier below a tier, or a request with a bad tier cost (naming it).
        TypeError: ``tiers`` is not a mapping of space names.
    """
    if not tiers:
        return {}
    result = tier_map(tiers, budget)
    for upper, lower in result.items():
        if lower in result:
            raise InvalidArgument(
                f"tiers puts {lower!r} below {upper!r} and {result[lower]!r} below {lower!r}: "
                "the simulator models one level of tiers"
            )
    for request in requests:
        for column in ("promote_seconds", "demote_seconds"):
            value = getattr(request, column)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InvalidArgument(
                    f"{where(request)}{request.cache}:{request.key}: {column} must be a "
                    f"number of seconds, got {value!r}"
                )
            if not (math.isfinite(value) and value >= 0):
                raise InvalidArgument(
                    f"{where(request)}{request.cache}:{request.key}: {column} must be a "
                    f"non-negative number of seconds, got {value!r}"
                )
    return result


def where(request: Request) -> str:
    """Where ``request`` came from, as a message prefix (``""`` when unknown)."""
    return f"line {request.line}: " if request.line else ""
