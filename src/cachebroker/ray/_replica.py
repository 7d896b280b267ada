"""One broker per replica: started on first use, shared by its ``@multiplexed`` loaders.

A Ray Serve replica is a process running an asyncio event loop for the
deployment's code. The first request that needs a model starts a ``Replica``
for that loop: a background task that enters the broker (the machine's
shared one when ``CACHEBROKER_ADDRESS`` is set, else one of the replica's
own), opens each loader's cache in its task group, tells Ray's router which
model ids the replica holds, and exports the broker's metrics through Ray.

Everything Ray-specific goes through a ``Surface``: ``RaySurface`` in a
replica, a fake in tests. ``hosted()`` runs a replica inside the caller's
task group instead of a background task, on any backend (tests, or an
application that uses the loaders outside Ray).
"""

from __future__ import annotations

import asyncio
import importlib
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Any, Final, Protocol

import anyio
import anyio.abc

from .. import _log_events as ev
from .. import _series
from .._errors import BrokerClosed, InvalidArgument
from .._shell import Broker, Cache
from .._shell._backend import exit_task_group, running_backend
from .._stats import Stats

__all__ = [
    "INFO_LABELS",
    "MetricSink",
    "RaySurface",
    "Replica",
    "Surface",
    "current",
    "hosted",
    "shutdown",
]


class Loader(Protocol):
    """What the replica reads of a loader of models (``Models``, which imports this)."""

    name: str

    async def _release(self, model_id: str, model: Any) -> None: ...
    def _on_event(self, event: str, fields: Mapping[str, Any]) -> None: ...
    def model_ids(self) -> list[str]: ...
    def _ready_charges(self) -> list[Mapping[str, int]]: ...
    def _sizes(self) -> dict[str, dict[str, int]]: ...
    def _waiting_ids(self) -> list[str]: ...
    def _reported(self) -> list[str]: ...


#: Seconds between two reports of model ids to Ray (Ray's own multiplexer pushes every 0.1 s).
REPORT_EVERY: Final = 0.1
#: Seconds after which the model ids are reported again even if unchanged
#: (a restarted Serve controller learns them again).
REPORT_REFRESH: Final = 30.0
#: Seconds after a report that failed before it is tried again, even if unchanged.
REPORT_RETRY: Final = 1.0
#: Seconds between two exports of the broker's gauges and counters.
METRICS_EVERY: Final = 5.0
#: The key of cachebroker's entry in a replica's routing stats.
ROUTING_KEY: Final = "cachebroker"
#: The labels of the ``requests_info`` gauge, as the Gateway API Inference
#: Extension's endpoint picker and llm-d read them from vLLM's ``lora_requests_info``.
INFO_LABELS: Final = ("running_lora_adapters", "waiting_lora_adapters", "max_lora")


class Metric(Protocol):
    """One of Ray's metrics (``ray.serve.metrics``): what the exporter calls."""

    def set(self, value: float, tags: dict[str, str] | None = None) -> None: ...
    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None: ...
    def observe(self, value: float, tags: dict[str, str] | None = None) -> None: ...


class MetricSink(Protocol):
    """Makes metrics: ``make(kind, name, doc, tag_keys, boundaries)``."""

    def __call__(
        self,
        kind: str,
        name: str,
        doc: str,
        tag_keys: tuple[str, ...],
        boundaries: tuple[float, ...] | None,
    ) -> Metric: ...


class Surface(Protocol):
    """What a replica needs from Ray Serve."""

    def model_id(self) -> str:
        """The multiplexed model id of the request being served."""
        ...

    def report(self, model_ids: list[str]) -> None:
        """Tell Ray's router which model ids this replica holds or is loading."""
        ...

    def metrics(self) -> MetricSink | None:
        """Where to export metrics, or ``None`` for nowhere."""
        ...


class RaySurface:
    """The Ray Serve surface of a replica (imports Ray when built).

    Ray is reached through ``importlib`` and typed ``Any``: the module type-checks
    and imports the same with or without Ray installed.
    """

    def __init__(self) -> None:
        try:
            self._serve: Any = importlib.import_module("ray.serve")
        except ImportError:  # pragma: no cover - depends on the environment
            raise ImportError(
                "cachebroker.ray needs Ray Serve: pip install 'cachebroker[ray]'"
            ) from None
        try:
            self._replica_id: Any = self._serve.get_replica_context().replica_id
        except Exception:  # outside a replica (a plain script): nothing to report to
            self._replica_id = None

    def model_id(self) -> str:
        return str(self._serve.get_multiplexed_model_id())

    def report(self, model_ids: list[str]) -> None:
        # What @serve.multiplexed's own wrapper calls to keep the router's
        # model-id routing true (ray.serve.multiplex._ModelMultiplexWrapper).
        # (Routing stats cannot ride along: Serve's health checks overwrite
        # them with what the deployment's record_routing_stats last returned.)
        if self._replica_id is None:
            return
        common: Any = importlib.import_module("ray.serve._private.common")
        context: Any = importlib.import_module("ray.serve.context")
        context._get_global_client().record_request_routing_info(
            common.RequestRoutingInfo(replica_id=self._replica_id, multiplexed_model_ids=model_ids)
        )

    def metrics(self) -> MetricSink | None:
        if self._replica_id is None:
            return None
        metrics: Any = importlib.import_module("ray.serve.metrics")

        def make(
            kind: str,
            name: str,
            doc: str,
            tag_keys: tuple[str, ...],
            boundaries: tuple[float, ...] | None,
        ) -> Metric:
            made: Metric
            if kind == "gauge":
                made = metrics.Gauge(name, description=doc, tag_keys=tag_keys)
            elif kind == "counter":
                made = metrics.Counter(name, description=doc, tag_keys=tag_keys)
            else:
                made = metrics.Histogram(
                    name,
                    description=doc,
                    boundaries=[b for b in boundaries or () if b > 0],
                    tag_keys=tag_keys,
                )
            return made

        return make


def _loop_key() -> int:
    """Identifies the running event loop (asyncio's loop, trio's run)."""
    if running_backend() == "trio":
        import trio

        return id(trio.lowlevel.current_trio_token())
    return id(asyncio.get_running_loop())


#: The replica of each event loop in this process.
_REPLICAS: dict[int, Replica] = {}
#: How a replica started on first use reaches Ray (tests replace it).
_SURFACE: Callable[[], Surface] = RaySurface


def current(
    options: Mapping[str, Any],
    owner: str,
    *,
    start: tuple[Mapping[str, Any], str] | None = None,
) -> Replica:
    """The replica of the running loop, started in the background on first use.

    ``options`` are the broker settings of the loader asking (``owner``);
    a replica has one broker, so a second loader's different settings are an
    ``InvalidArgument``. ``start``: the settings (and the loader giving them)
    to start the replica with, if not ``options``: another loader's of the
    same deployment, when this one gives none.
    """
    key = _loop_key()
    replica = _REPLICAS.get(key)
    if replica is not None and replica.closed:
        raise BrokerClosed(f"{owner}: this replica's broker is closed")
    if replica is None:
        if running_backend() != "asyncio":
            raise BrokerClosed(
                f"{owner} runs in a Ray Serve replica (asyncio); elsewhere run it inside "
                "'async with cachebroker.ray.hosted(...)'"
            )
        start_options, start_owner = start if start is not None else (options, owner)
        replica = _REPLICAS[key] = Replica(_SURFACE(), start_options, start_owner, key)
        replica.spawn_detached()
    else:
        replica.check_options(options, owner)
    return replica


async def shutdown() -> None:
    """Release every model of this replica through its releaser and stop its broker.

    For a deployment's ``async def __del__``; a replica that never served a
    model has nothing to do. Idempotent. Cancellation: stops the wait; the
    closing goes on.
    """
    replica = _REPLICAS.get(_loop_key())
    if replica is not None:
        await replica.close()


def routing_stats() -> dict[str, Any]:
    """This replica's routing stats, for its deployment's ``record_routing_stats``.

    ``BrokerRouter`` routes by them (free bytes per space, the sizes of the
    models held). Ray Serve polls a deployment's routing stats from its
    ``record_routing_stats`` method, every ``request_routing_stats_period_s``
    of its ``RequestRouterConfig``; define it as ``async def`` (it must run on
    the replica's event loop)::

        async def record_routing_stats(self) -> dict:
            return cachebroker.ray.routing_stats()

    Before the replica served a model the stats are empty.

    Raises:
        RuntimeError: called outside an event loop (a plain ``def`` method,
            which Serve may run in a worker thread).
    """
    try:
        key = _loop_key()
    except RuntimeError:
        raise RuntimeError(
            "cachebroker.ray.routing_stats() reads the replica's broker on its event loop: "
            "call it from 'async def record_routing_stats(self)'"
        ) from None
    replica = _REPLICAS.get(key)
    if replica is None or replica.closed:
        return {ROUTING_KEY: {"free": {}, "budget": {}, "sizes": {}}}
    return replica.routing_stats()


def hosted(surface: Surface | None = None, **options: Any) -> AbstractAsyncContextManager[Replica]:
    """Run this loop's replica in the caller's task group, on any backend.

    For tests of a deployment's loaders, or an application that uses them
    outside Ray: ``async with cachebroker.ray.hosted(budget="8GiB"):``.
    ``options`` are ``@multiplexed``'s broker settings: the loaders' own must
    match them or be absent. ``surface`` stands in for Ray (default: none;
    model ids must then be given). Leaving the block releases every model
    through its releaser and stops the broker.
    """
    return _Hosting(surface if surface is not None else _Nowhere(), options)


class _Hosting:
    def __init__(self, surface: Surface, options: Mapping[str, Any]) -> None:
        self._surface = surface
        self._options = options
        self._key: int | None = None
        self._replica: Replica | None = None
        self._tg: anyio.abc.TaskGroup | None = None

    async def __aenter__(self) -> Replica:
        key = _loop_key()
        if key in _REPLICAS and not _REPLICAS[key].closed:
            raise RuntimeError("this event loop already runs a cachebroker.ray replica")
        self._key = key
        replica = self._replica = _REPLICAS[key] = Replica(
            self._surface, self._options, "hosted()", key
        )
        tg = self._tg = anyio.create_task_group()
        await tg.__aenter__()
        try:
            await tg.start(replica.run)
        except BaseException as exc:
            try:
                if not await exit_task_group(tg, type(exc), exc, exc.__traceback__):
                    raise
            finally:
                self._forget()
        return replica

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        assert self._replica is not None and self._tg is not None
        try:
            self._replica.stop()  # (its task is in the group, which waits for it)
            return await exit_task_group(self._tg, exc_type, exc, tb)
        finally:
            self._forget()

    def _forget(self) -> None:
        if self._key is not None and _REPLICAS.get(self._key) is self._replica:
            del _REPLICAS[self._key]


class _Nowhere:
    """A surface outside Ray: model ids must be given, nothing is reported."""

    def model_id(self) -> str:
        raise InvalidArgument("no model id given, and this is not a Ray Serve request")

    def report(self, model_ids: list[str]) -> None:
        pass

    def metrics(self) -> MetricSink | None:
        return None


class Replica:
    """The broker of one replica, the caches of its loaders, and what it tells Ray."""

    def __init__(self, surface: Surface, options: Mapping[str, Any], owner: str, key: int) -> None:
        self.surface = surface
        self.options = dict(options)
        self.owner = owner
        self.closed = False
        self._key = key
        self._broker: Broker | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._started = anyio.Event()
        self._start_error: BaseException | None = None
        self._closing = anyio.Event()
        self._stopped = anyio.Event()
        self._changed = anyio.Event()
        self._models: list[Loader] = []
        self._caches: dict[Loader, Cache] = {}
        self._opening: dict[Loader, anyio.Event] = {}
        self._task: asyncio.Task[None] | None = None
        self._exporter: _Exporter | None = None

    # ------------------------------------------------------------ life cycle

    def check_options(self, options: Mapping[str, Any], owner: str) -> None:
        if options and dict(options) != self.options:
            raise InvalidArgument(
                f"one replica has one broker: {owner} asks for broker settings "
                f"{_describe(options)} but {self.owner} started it with "
                f"{_describe(self.options)}; give the settings to one loader only"
            )

    def spawn_detached(self) -> None:
        """Run the replica as a background asyncio task (in a Ray Serve replica)."""
        self._task = asyncio.get_running_loop().create_task(
            self._run_detached(), name="cachebroker.ray replica"
        )

    async def _run_detached(self) -> None:
        try:
            await self.run()
        except BaseException as exc:
            # A start error goes to the requests waiting for the broker (and
            # the next request starts it again); so does a failure that
            # stopped it (a loader's process-level exception, already logged
            # as its load's failure). The process's own ends go on up.
            if self._start_error is None:
                self._start_error = exc
            self._started.set()
            if isinstance(exc, (KeyboardInterrupt, SystemExit, asyncio.CancelledError)):
                raise
        finally:
            self.closed = True
            if _REPLICAS.get(self._key) is self:
                del _REPLICAS[self._key]

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Enter the broker, then serve until ``close()``."""
        try:
            try:
                broker = make_broker(self.options, os.environ)
                await broker.__aenter__()
            except BaseException as exc:
                self._start_error = exc
                self._started.set()
                self.closed = True
                raise
            try:
                self._broker = broker
                # The caches' tasks, then the reporting loops inside: closing
                # stops the loops and lets each cache close (releasing its
                # models) before the broker stops. A failure of a cache (a
                # loader's process-level exception) leaves as itself, not
                # wrapped in the task group's exception group.
                tg = self._tg = anyio.create_task_group()
                await tg.__aenter__()
                try:
                    async with anyio.create_task_group() as loops:
                        exporter = self._make_exporter()
                        if exporter is not None:
                            self._exporter = exporter
                            broker.add_listener(exporter.on_event)
                            loops.start_soon(self._export_loop, exporter)
                        loops.start_soon(self._report_loop)
                        self._started.set()
                        task_status.started()
                        await self._closing.wait()
                        loops.cancel_scope.cancel()
                except BaseException as exc:
                    if not await exit_task_group(tg, type(exc), exc, exc.__traceback__):
                        raise
                else:
                    await exit_task_group(tg, None, None, None)
            except BaseException as exc:
                await broker.__aexit__(type(exc), exc, exc.__traceback__)
                raise
            else:
                await broker.__aexit__(None, None, None)
        finally:
            self.closed = True
            self._stopped.set()

    def _make_exporter(self) -> _Exporter | None:
        """The metrics, if the surface has somewhere to export them and they could be made."""
        try:
            sink = self.surface.metrics()
            return None if sink is None else _Exporter(self, sink)
        except Exception as exc:  # a replica without metrics still serves
            self._emit("warning", ev.RAY_REPORT_FAILED, to="metrics", error=repr(exc))
            return None

    def stop(self) -> None:
        """Begin closing: every cache closes (releasing its models), then the broker."""
        self.closed = True
        self._closing.set()

    async def close(self) -> None:
        """Close every cache (releasing its models), then the broker; await the end."""
        self.stop()
        if self._task is not None or self._started.is_set():
            await self._stopped.wait()

    async def broker(self) -> Broker:
        """The running broker, once started (raising what stopped it from starting)."""
        await self._started.wait()
        if self._start_error is not None:
            raise BrokerClosed(
                f"the replica's broker did not start: {self._start_error!r}"
            ) from self._start_error
        if self._broker is None or self.closed:
            raise BrokerClosed("the replica's broker is closed")
        return self._broker

    async def cache(self, models: Loader) -> Cache:
        """Open the cache of ``models`` (once) in the replica's task group."""
        await self.broker()
        while (cache := self._caches.get(models)) is None:
            opening = self._opening.get(models)
            if opening is None:
                break
            await opening.wait()  # another request is opening it; then look again
        else:
            return cache
        self._opening[models] = opening = anyio.Event()
        try:
            # (the loaders open or opening: two first requests may open at once)
            taken = {other.name for other in [*self._models, *self._opening] if other is not models}
            base, n = models.name, 1
            while models.name in taken:  # two instances of one deployment in one process
                n += 1
                models.name = f"{base}#{n}"
            assert self._tg is not None
            opened: Cache = await self._tg.start(self._run_cache, models)
            return opened
        finally:
            del self._opening[models]
            opening.set()

    async def _run_cache(self, models: Loader, *, task_status: anyio.abc.TaskStatus[Cache]) -> None:
        broker = self._broker
        assert broker is not None
        broker.add_listener(models._on_event)
        try:
            async with broker.cache(models.name, models._release) as cache:
                self._models.append(models)
                self._caches[models] = cache
                task_status.started(cache)
                await self._closing.wait()
        finally:
            broker.remove_listener(models._on_event)
            self._caches.pop(models, None)

    # ------------------------------------------------------------ telling Ray

    def changed(self) -> None:
        """A loader's model ids (or the free bytes) changed: report them soon."""
        self._changed.set()
        if self._exporter is not None:
            try:
                self._exporter.models_changed()
            except Exception as exc:  # a metrics failure fails no request
                self._emit("warning", ev.RAY_REPORT_FAILED, to="metrics", error=repr(exc))

    def model_ids(self) -> list[str]:
        """Model ids held, loading or asked for, over every loader, in first-seen order."""
        ids: dict[str, None] = {}
        for models in self._models:
            ids.update(dict.fromkeys(models._reported()))
        return list(ids)

    def routing_stats(self) -> dict[str, Any]:
        """What ``BrokerRouter`` routes by: free bytes and budget per space, models' sizes.

        ``sizes`` has the models held and those loading (their reserved bytes,
        which ``free`` already leaves out).
        """
        sizes: dict[str, dict[str, int]] = {}
        for models in self._models:
            sizes.update(models._sizes())
        free: dict[str, int] = {}
        budget: dict[str, int] = {}
        if self._broker is not None and not self.closed:
            stats = self._broker.stats_nowait()
            budget = dict(stats.budget)
            free = free_bytes(stats)
        return {ROUTING_KEY: {"free": free, "budget": budget, "sizes": sizes}}

    async def _report_loop(self) -> None:
        last: list[str] | None = None
        wait = REPORT_REFRESH
        while True:
            with anyio.move_on_after(wait) as waited:
                await self._changed.wait()
            self._changed = anyio.Event()
            ids = self.model_ids()
            if ids != last or waited.cancelled_caught:
                try:
                    self.surface.report(ids)
                except Exception as exc:
                    self._emit("warning", ev.RAY_REPORT_FAILED, to="router", error=repr(exc))
                    # Not told: tell it again soon, changed or not.
                    last, wait = None, REPORT_RETRY
                else:
                    last, wait = ids, REPORT_REFRESH
            await anyio.sleep(REPORT_EVERY)

    async def _export_loop(self, exporter: _Exporter) -> None:
        while True:
            try:
                exporter.export()
            except Exception as exc:  # nor does it stop the replica
                self._emit("warning", ev.RAY_REPORT_FAILED, to="metrics", error=repr(exc))
            await anyio.sleep(METRICS_EVERY)

    def _emit(self, level: str, event: str, **fields: Any) -> None:
        if self._broker is not None:
            self._broker._emit(level, event, **fields)

    def loaders(self) -> list[Loader]:
        return list(self._models)


def make_broker(options: Mapping[str, Any], environ: Mapping[str, str]) -> Broker:
    """The replica's broker: the machine's shared one when ``CACHEBROKER_ADDRESS`` is set."""
    settings = dict(options)
    address = environ.get("CACHEBROKER_ADDRESS", "").strip()
    if address:
        # The shared broker's settings are its own (cachebroker serve); the
        # deployment's budget applies where no daemon runs.
        return Broker.connect(
            address,
            logger=settings.get("logger"),
            oom_errors=settings.get("oom_errors", ()),
        )
    budget = settings.pop("budget", None)
    if callable(budget):
        budget = budget()
    if budget is None:
        if not environ.get("CACHEBROKER_BUDGET", "").strip():
            raise InvalidArgument(
                "no budget: give @multiplexed(budget=...), or set CACHEBROKER_BUDGET "
                "(this replica's own budget) or CACHEBROKER_ADDRESS (the machine's shared "
                "broker, 'cachebroker serve') in the replica's environment"
            )
        return Broker.from_env(environ, **settings)
    return Broker.from_env(environ, budget=budget, **settings)


def _describe(options: Mapping[str, Any]) -> str:
    return "{" + ", ".join(f"{k}={v!r}" for k, v in sorted(options.items())) + "}"


class _Exporter:
    """The broker's series and the replica's model ids, as Ray metrics."""

    def __init__(self, replica: Replica, sink: MetricSink) -> None:
        self._replica = replica
        ns = "cachebroker"
        self._series = [
            (
                series,
                sink(
                    series.kind,
                    f"{ns}_{series.name}",
                    series.doc,
                    (series.label,) if series.label else (),
                    None,
                ),
            )
            for series in _series.SERIES
        ]
        bounds = {"load": _series.LOAD_BUCKETS, "release": _series.RELEASE_BUCKETS}
        self._histograms = [
            (
                series,
                sink("histogram", f"{ns}_{series.name}", series.doc, (), bounds[series.buckets]),
            )
            for series in _series.HISTOGRAMS
        ]
        self._counted: dict[tuple[str, str], float] = {}
        self._resident = sink(
            "gauge",
            f"{ns}_resident_models",
            "Models loaded and ready in this replica.",
            (),
            None,
        )
        self._info = sink(
            "gauge",
            f"{ns}_requests_info",
            "Models this replica holds (running_lora_adapters) and is loading or was asked "
            "for (waiting_lora_adapters), and how many it could hold (max_lora); the value "
            "is the time of the reading, as vLLM's lora_requests_info.",
            INFO_LABELS,
            None,
        )
        self._info_tags: dict[str, str] | None = None

    def on_event(self, event: str, fields: Mapping[str, Any]) -> None:
        for series, metric in self._histograms:
            value = series.observe(event, fields)
            if value is not None:
                metric.observe(value)

    def export(self) -> None:
        broker = self._replica._broker
        if broker is None:
            return
        stats = broker.stats_nowait()
        for series, metric in self._series:
            value = series.read(stats)
            values = value if isinstance(value, Mapping) else {"": value}
            for label, number in values.items():
                tags = {series.label: label} if series.label else None
                if series.kind == "gauge":
                    metric.set(float(number), tags)
                    continue
                before = self._counted.get((series.name, label), 0.0)
                if number > before:
                    metric.inc(float(number) - before, tags)
                    self._counted[series.name, label] = float(number)
        self.models_changed()

    def models_changed(self) -> None:
        broker = self._replica._broker
        if broker is None:
            return
        running: list[str] = []
        waiting: list[str] = []
        charges: list[Mapping[str, int]] = []
        for models in self._replica.loaders():
            running.extend(models.model_ids())
            waiting.extend(models._waiting_ids())
            charges.extend(models._ready_charges())
        tags = {
            "running_lora_adapters": _comma_list(running),
            "waiting_lora_adapters": _comma_list(waiting),
            "max_lora": str(len(running) + room_for(charges, free_bytes(broker.stats_nowait()))),
        }
        self._resident.set(float(len(running)))
        if self._info_tags is not None and self._info_tags != tags:
            self._info.set(0.0, self._info_tags)  # superseded: the latest reading wins
        self._info.set(time.time(), tags)
        self._info_tags = tags


def _comma_list(model_ids: Iterable[str]) -> str:
    """Model ids joined with commas, as their readers split them: an id with a comma is left out.

    Written, ``"a,b"`` would read as two models ``a`` and ``b`` that this
    replica may not hold; left out, the reader only misses one it does hold.
    """
    return ",".join(model_id for model_id in model_ids if "," not in model_id)


def free_bytes(stats: Stats) -> dict[str, int]:
    """Bytes free per space of the budget: the machine's, for a broker connected to a shared one."""
    used = stats.broker_used if stats.broker_used is not None else stats.used
    return {space: max(0, cap - used.get(space, 0)) for space, cap in stats.budget.items()}


def room_for(charges: Iterable[Mapping[str, int]], free: Mapping[str, int]) -> int:
    """How many more models of the held ones' mean size fit in the free bytes (an estimate).

    With nothing held: 1 if any space has free bytes, else 0.
    """
    totals: dict[str, int] = {}
    counts: dict[str, int] = {}
    for charge in charges:
        for space, size in charge.items():
            if size > 0:
                totals[space] = totals.get(space, 0) + size
                counts[space] = counts.get(space, 0) + 1
    if not totals:
        return 1 if any(free.values()) else 0
    room = math.inf
    for space, total in totals.items():
        mean = total / counts[space]
        room = min(room, free.get(space, 0) // mean)
    return int(room)
