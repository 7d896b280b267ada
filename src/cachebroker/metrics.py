"""Prometheus metrics for a broker (needs ``prometheus-client``, the ``metrics`` extra).

``BrokerMetrics`` is a prometheus-client collector. It reads the broker's
books at each scrape and records load, release and wait-for-space durations
as they happen, through ``Broker.add_listener``::

    from prometheus_client import REGISTRY
    from cachebroker.metrics import BrokerMetrics

    async with cachebroker.Broker(budget="24GiB") as broker:
        REGISTRY.register(BrokerMetrics(broker))   # or instrument(broker)
        ...

Scrapes may come from any thread (prometheus-client's HTTP server runs its
own): the snapshot is then taken on the broker's event loop, so it is always
consistent. See docs/metrics.md for every series.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import math
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import REGISTRY, Collector, CollectorRegistry

from . import _log_events as ev
from ._errors import BrokerClosed
from ._shell import Broker
from ._shell._backend import call_soon_threadsafe as _call_soon_threadsafe
from ._shell._backend import running_backend as _running_backend
from ._shell._broker import check_running as _check_running
from ._stats import Stats

__all__ = ["LOAD_BUCKETS", "RELEASE_BUCKETS", "BrokerMetrics", "instrument"]

#: Upper bounds (seconds) of the load and wait-for-space histograms: models
#: take from milliseconds to minutes to load.
LOAD_BUCKETS: tuple[float, ...] = (0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
#: Upper bounds (seconds) of the release histogram.
RELEASE_BUCKETS: tuple[float, ...] = (0.001, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30)

#: How long a scrape from another thread waits for the event loop.
_SCRAPE_TIMEOUT = 5.0

T = TypeVar("T")


class _Histogram:
    """Bucket counts and a sum, updated on the event loop."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        if not bounds or list(bounds) != sorted(set(bounds)) or bounds[0] < 0:
            raise ValueError(f"buckets must be increasing non-negative seconds, got {bounds!r}")
        self.bounds = tuple(float(b) for b in bounds)
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


class BrokerMetrics(Collector):
    """A prometheus-client collector for one broker. See docs/metrics.md.

    Create it on the broker's event loop (inside ``async with Broker(...)``)
    and register it with a registry. ``close()`` stops the duration
    histograms (the broker's own counters are still read at each scrape).

    Args:
        broker: A running broker.
        namespace: Prefix of every series name.
        load_buckets: Upper bounds, in seconds, of the load and wait-for-space
            histograms.
        release_buckets: Upper bounds, in seconds, of the release histogram.

    Raises:
        BrokerClosed: the broker is not running.
    """

    def __init__(
        self,
        broker: Broker,
        *,
        namespace: str = "cachebroker",
        load_buckets: Sequence[float] = LOAD_BUCKETS,
        release_buckets: Sequence[float] = RELEASE_BUCKETS,
    ) -> None:
        if not isinstance(broker, Broker):
            raise TypeError(f"broker must be a cachebroker.Broker, got {broker!r}")
        _check_running(broker)
        if not namespace.replace("_", "").isalnum():
            raise ValueError(f"namespace must be letters, digits and '_', got {namespace!r}")
        self._broker = broker
        self._namespace = namespace
        self._loads = _Histogram(load_buckets)
        self._waits = _Histogram(load_buckets)
        self._releases = _Histogram(release_buckets)
        self._thread = threading.get_ident()
        self._call_soon = _loop_caller()
        broker.add_listener(self._on_event)

    def close(self) -> None:
        """Stop listening to the broker's events."""
        self._broker.remove_listener(self._on_event)

    def _on_event(self, event: str, fields: Mapping[str, Any]) -> None:
        if event == ev.LOAD_DONE:
            self._loads.observe(fields["seconds"])
        elif event == ev.GRANT:
            self._waits.observe(fields["waited"])
        elif event in (ev.RELEASE_FREED, ev.RELEASE_FAILED) and not fields.get("late"):
            self._releases.observe(fields["seconds"])

    def _snapshot(self) -> tuple[Stats, list[tuple[str, str, _Histogram, tuple[Any, float]]]]:
        histograms = [
            ("load_seconds", "Time loaders took, for successful loads.", self._loads),
            ("space_wait_seconds", "Time a load waited for space before it started.", self._waits),
            (
                "release_seconds",
                "Time from asking an owner to release until it acknowledged or failed.",
                self._releases,
            ),
        ]
        return self._broker.stats_nowait(), [
            (name, doc, histogram, histogram.snapshot()) for name, doc, histogram in histograms
        ]

    def _on_loop(self, func: Callable[[], T]) -> T:
        """Run ``func`` on the broker's event loop and return its result."""
        if threading.get_ident() == self._thread:
            return func()
        done: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            try:
                done.set_result(func())
            except BaseException as exc:  # pragma: no cover - stats_nowait does not raise
                done.set_exception(exc)

        self._call_soon(run)
        return done.result(timeout=_SCRAPE_TIMEOUT)

    def collect(self) -> Iterator[Metric]:
        """The series, from one consistent snapshot (see docs/metrics.md)."""
        stats, histograms = self._on_loop(self._snapshot)
        ns = self._namespace

        def gauge(name: str, doc: str, label: str, values: Mapping[str, float]) -> Metric:
            family = GaugeMetricFamily(f"{ns}_{name}", doc, labels=[label])
            for value_label, value in values.items():
                family.add_metric([value_label], value)
            return family

        yield gauge("used_bytes", "Bytes charged per memory space.", "space", stats.used)
        yield gauge("budget_bytes", "Budget per memory space.", "space", stats.budget)
        yield gauge(
            "entries",
            "Entries by state (leased entries are also ready).",
            "state",
            {
                "loading": stats.loading,
                "ready": stats.ready,
                "leased": stats.leased,
                "releasing": stats.releasing,
                "quarantined": stats.quarantined,
            },
        )
        yield GaugeMetricFamily(
            f"{ns}_waiting_requests", "Requests queued for space.", value=stats.waiting
        )
        counters = [
            ("hits", "Acquires served without a load of their own.", stats.hits),
            ("misses", "Acquires that started a load.", stats.misses),
            ("loads", "Loads that finished.", stats.loads),
            ("load_failures", "Loads that raised.", stats.load_failures),
            ("oom_retries", "Loads retried after freeing memory.", stats.oom_retries),
            ("releases_failed", "Releases that raised or timed out.", stats.releases_failed),
            (
                "releases_timed_out",
                "Releases not acknowledged within release_timeout.",
                stats.releases_timed_out,
            ),
            (
                "releases_blocking",
                "Releases that blocked the event loop longer than blocking_warning in one step.",
                stats.releases_blocking,
            ),
        ]
        for name, doc, value in counters:
            yield CounterMetricFamily(f"{ns}_{name}", doc, value=value)
        evictions = CounterMetricFamily(
            f"{ns}_evictions", "Releases the broker started, by reason.", labels=["reason"]
        )
        for reason, count in stats.releases.items():
            evictions.add_metric([reason], count)
        yield evictions
        for name, doc, _, (buckets, total) in histograms:
            yield HistogramMetricFamily(f"{ns}_{name}", doc, buckets=buckets, sum_value=total)


def instrument(
    broker: Broker, registry: CollectorRegistry | None = None, **options: Any
) -> BrokerMetrics:
    """Create ``BrokerMetrics(broker, **options)`` and register it (default: global registry)."""
    metrics = BrokerMetrics(broker, **options)
    (REGISTRY if registry is None else registry).register(metrics)
    return metrics


def _loop_caller() -> Callable[[Callable[[], None]], None]:
    """A thread-safe "run this soon on the current event loop"."""
    try:
        backend = _running_backend()
    except Exception as exc:
        raise BrokerClosed("create BrokerMetrics on the broker's event loop") from exc
    call_soon = _call_soon_threadsafe(backend)

    def call(func: Callable[[], None]) -> None:
        call_soon(func)

    return call
