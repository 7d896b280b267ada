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

import concurrent.futures
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

from . import _series
from ._errors import BrokerClosed
from ._series import LOAD_BUCKETS, RELEASE_BUCKETS
from ._shell import Broker
from ._shell._backend import call_soon_threadsafe as _call_soon_threadsafe
from ._shell._backend import running_backend as _running_backend
from ._shell._broker import check_running as _check_running
from ._stats import Stats

__all__ = ["LOAD_BUCKETS", "RELEASE_BUCKETS", "BrokerMetrics", "instrument"]

#: How long a scrape from another thread waits for the event loop.
_SCRAPE_TIMEOUT = 5.0

T = TypeVar("T")
_Snapshot = list[tuple[_series.HistogramSeries, tuple[list[tuple[str, int]], float]]]


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
        self._broker = broker
        self._namespace = _series.check_namespace(namespace)
        bounds = {"load": load_buckets, "release": release_buckets}
        self._histograms = [
            (series, _series.Histogram(bounds[series.buckets])) for series in _series.HISTOGRAMS
        ]
        self._thread = threading.get_ident()
        self._call_soon = _loop_caller()
        broker.add_listener(self._on_event)

    def close(self) -> None:
        """Stop listening to the broker's events."""
        self._broker.remove_listener(self._on_event)

    def _on_event(self, event: str, fields: Mapping[str, Any]) -> None:
        for series, histogram in self._histograms:
            value = series.observe(event, fields)
            if value is not None:
                histogram.observe(value)

    def _snapshot(self) -> tuple[Stats, _Snapshot]:
        return self._broker.stats_nowait(), [
            (series, histogram.snapshot()) for series, histogram in self._histograms
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
        for series in _series.SERIES:
            family: Metric
            name = f"{ns}_{series.name}"
            value = series.read(stats)
            kind = GaugeMetricFamily if series.kind == "gauge" else CounterMetricFamily
            if series.label is None:
                assert not isinstance(value, Mapping)
                family = kind(name, series.doc, value=value)
            else:
                assert isinstance(value, Mapping)
                family = kind(name, series.doc, labels=[series.label])
                for label, number in value.items():
                    family.add_metric([label], number)
            yield family
        for histogram, (buckets, total) in histograms:
            yield HistogramMetricFamily(
                f"{ns}_{histogram.name}", histogram.doc, buckets=buckets, sum_value=total
            )


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
