"""The broker's metric series, named once for every exporter.

``cachebroker.metrics`` (prometheus-client) and ``cachebroker.ray`` (Ray's
metrics) export the same series: the gauges and counters read from a
``Stats`` snapshot at each scrape, and the histograms fed from the events
that carry a duration. This module says what each series is; the exporters
say how their library spells it.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, Literal

import attrs

from . import _log_events as ev
from ._stats import Stats

__all__ = [
    "HISTOGRAMS",
    "LOAD_BUCKETS",
    "RELEASE_BUCKETS",
    "SERIES",
    "Histogram",
    "HistogramSeries",
    "Series",
]

#: Upper bounds (seconds) of the load and wait-for-space histograms: models
#: take from milliseconds to minutes to load.
LOAD_BUCKETS: tuple[float, ...] = (0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
#: Upper bounds (seconds) of the release histogram.
RELEASE_BUCKETS: tuple[float, ...] = (0.001, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30)


@attrs.frozen
class Series:
    """A gauge or counter read from ``Stats``.

    ``read`` returns one value, or a mapping of ``label`` value to value.
    Counter names carry no ``_total``: exporters add it as their library does.
    """

    name: str
    kind: Literal["gauge", "counter"]
    doc: str
    read: Callable[[Stats], float | Mapping[str, float]]
    label: str | None = None


@attrs.frozen
class HistogramSeries:
    """A duration histogram: ``observe(event, fields)`` gives the value to record, or ``None``."""

    name: str
    doc: str
    buckets: Literal["load", "release"]
    observe: Callable[[str, Mapping[str, Any]], float | None]


def _entries_by_state(stats: Stats) -> Mapping[str, float]:
    return {
        "loading": stats.loading,
        "ready": stats.ready,
        "leased": stats.leased,
        "moving": stats.moving,
        "demoted": stats.demoted,
        "releasing": stats.releasing,
        "quarantined": stats.quarantined,
    }


SERIES: Final[tuple[Series, ...]] = (
    Series("used_bytes", "gauge", "Bytes charged per memory space.", lambda s: s.used, "space"),
    Series("budget_bytes", "gauge", "Budget per memory space.", lambda s: s.budget, "space"),
    Series(
        "entries",
        "gauge",
        "Entries by state (leased entries are also ready).",
        _entries_by_state,
        "state",
    ),
    Series("waiting_requests", "gauge", "Requests queued for space.", lambda s: s.waiting),
    Series(
        "waiting_lease_requests",
        "gauge",
        "Requests waiting for a lease slot of a loaded entry (concurrency).",
        lambda s: s.waiting_for_lease,
    ),
    Series("hits", "counter", "Acquires served without a load of their own.", lambda s: s.hits),
    Series("misses", "counter", "Acquires that started a load.", lambda s: s.misses),
    Series("loads", "counter", "Loads that finished.", lambda s: s.loads),
    Series("load_failures", "counter", "Loads that raised.", lambda s: s.load_failures),
    Series(
        "oom_retries", "counter", "Loads retried after freeing memory.", lambda s: s.oom_retries
    ),
    Series(
        "releases_failed",
        "counter",
        "Releases that raised or timed out.",
        lambda s: s.releases_failed,
    ),
    Series(
        "releases_timed_out",
        "counter",
        "Releases not acknowledged within release_timeout.",
        lambda s: s.releases_timed_out,
    ),
    Series(
        "releases_blocking",
        "counter",
        "Releases that blocked the event loop longer than blocking_warning in one step.",
        lambda s: s.releases_blocking,
    ),
    Series(
        "evictions",
        "counter",
        "Releases the broker started, by reason.",
        lambda s: s.releases,
        "reason",
    ),
    Series(
        "moves",
        "counter",
        "Moves between tiers that finished, by direction (down: instead of a release).",
        lambda s: {"down": s.demotions, "up": s.promotions},
        "direction",
    ),
    Series(
        "moves_failed",
        "counter",
        "Moves between tiers that raised or timed out.",
        lambda s: s.moves_failed,
    ),
)


def _load_seconds(event: str, fields: Mapping[str, Any]) -> float | None:
    return float(fields["seconds"]) if event == ev.LOAD_DONE else None


def _space_wait(event: str, fields: Mapping[str, Any]) -> float | None:
    return float(fields["waited"]) if event == ev.GRANT else None


def _promote_seconds(event: str, fields: Mapping[str, Any]) -> float | None:
    return float(fields["seconds"]) if event == ev.MOVE_DONE and fields.get("up") else None


def _release_seconds(event: str, fields: Mapping[str, Any]) -> float | None:
    if event in (ev.RELEASE_FREED, ev.RELEASE_FAILED) and not fields.get("late"):
        return float(fields["seconds"])
    return None


HISTOGRAMS: Final[tuple[HistogramSeries, ...]] = (
    HistogramSeries(
        "load_seconds", "Time loaders took, for successful loads.", "load", _load_seconds
    ),
    HistogramSeries(
        "promote_seconds",
        "Time owners took to move a value back up a tier for an acquire.",
        "load",
        _promote_seconds,
    ),
    HistogramSeries(
        "space_wait_seconds",
        "Time a load waited for space before it started.",
        "load",
        _space_wait,
    ),
    HistogramSeries(
        "release_seconds",
        "Time from asking an owner to release until it acknowledged or failed.",
        "release",
        _release_seconds,
    ),
)


class Histogram:
    """Bucket counts and a sum, updated on the event loop."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = check_buckets(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def snapshot(self) -> tuple[list[tuple[str, int]], float]:
        cumulative = 0
        buckets = []
        for bound, count in zip((*self.bounds, math.inf), self.counts, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == math.inf else repr(bound), cumulative))
        return buckets, self.total


def check_buckets(bounds: Sequence[float]) -> tuple[float, ...]:
    """``bounds`` as floats, or ``ValueError`` unless they increase from 0 or more."""
    if not bounds or list(bounds) != sorted(set(bounds)) or bounds[0] < 0:
        raise ValueError(f"buckets must be increasing non-negative seconds, got {bounds!r}")
    return tuple(float(b) for b in bounds)


def check_namespace(namespace: str) -> str:
    """``namespace``, or ``ValueError`` unless it is letters, digits and '_'."""
    if not isinstance(namespace, str) or not namespace.replace("_", "").isalnum():
        raise ValueError(f"namespace must be letters, digits and '_', got {namespace!r}")
    return namespace
