"""cachebroker.ray under attack: races, cancellations, failing plugins and surfaces, odd ids.

The fake Ray surface and the ``Deployment`` of tests/test_ray.py, on every
backend (``hosted()``), or asyncio alone where a replica starts on first use
as in Ray Serve. Each test either kept a bug from coming back or pins a
property that an attack could have broken.
"""

from __future__ import annotations

import asyncio
import gc
import threading
from collections.abc import Callable, MutableMapping
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import pytest

import cachebroker
from cachebroker import InvalidArgument
from cachebroker.ray import _replica, hosted, multiplexed, shutdown

from .test_ray import ASYNCIO_ONLY, Deployment, FakeMetric, FakeSurface
from .test_ray import quick_reports as quick_reports  # the autouse fixture, here too

pytestmark = pytest.mark.anyio


async def until(predicate: Callable[[], bool]) -> None:
    """Wait until ``predicate()`` holds (a hang fails the test)."""
    with anyio.fail_after(5):
        while not predicate():
            await anyio.sleep(0.001)


@pytest.fixture
def detached(monkeypatch: pytest.MonkeyPatch) -> FakeSurface:
    """A replica started on first use (as in Ray Serve), reporting to a fake surface."""
    surface = FakeSurface()
    monkeypatch.setattr(_replica, "_SURFACE", lambda: surface)
    return surface


class Meltdown(BaseException):
    """A process-level exception of the application's own."""


# ------------------------------------------------------------ races to open


async def test_two_instances_opening_at_once_get_their_own_caches() -> None:
    # Both first requests name their cache before either is open: one got
    # "a cache named 'Deployment.get_model' is already open".
    one, two = Deployment(), Deployment()
    async with hosted(FakeSurface(), budget=20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(one.handle, "a")
            tg.start_soon(two.handle, "a")
        assert one.loads == ["a"] and two.loads == ["a"]
        assert one.get_model.name != two.get_model.name


@ASYNCIO_ONLY
async def test_first_requests_racing_in_a_fresh_replica_start_one_broker(
    monkeypatch: pytest.MonkeyPatch,
    detached: FakeSurface,
) -> None:
    monkeypatch.setenv("CACHEBROKER_BUDGET", "20")
    one, two = Deployment(), Deployment()
    try:
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(one.handle, "a")
                tg.start_soon(two.handle, "b")
        assert one.loads == ["a"] and two.loads == ["b"]
        assert len(_replica._REPLICAS) == 1
        await detached.reported(["a", "b"])
    finally:
        await shutdown()


@ASYNCIO_ONLY
async def test_settings_given_to_one_loader_start_the_replica_whichever_is_asked_first(
    monkeypatch: pytest.MonkeyPatch,
    detached: FakeSurface,
) -> None:
    # "give the settings to one loader only", says the error: the other
    # loader's first request started the broker without them (here on the
    # environment's budget), and the llm's requests then all failed.
    monkeypatch.setenv("CACHEBROKER_BUDGET", "1000")

    class Two:
        @multiplexed(size=6, budget=10)
        async def llm(self, model_id: str) -> str:
            return model_id

        @multiplexed(size=6)
        async def embedder(self, model_id: str) -> str:
            return model_id

    t = Two()
    try:
        async with t.embedder("e"):
            pass
        async with t.llm("x"):  # 12 > 10: the embedder's model goes
            pass
        assert (await t.llm.stats()).budget == {"default": 10}
        assert t.embedder.model_ids() == [] and t.llm.model_ids() == ["x"]
    finally:
        await shutdown()


# ------------------------------------------------------------ what Ray is told


class FailOnceWhenHeld(FakeSurface):
    """The controller is unreachable once: for the first report that names ``target``."""

    def __init__(self, target: str) -> None:
        super().__init__()
        self.target: str | None = target

    def report(self, model_ids: list[str]) -> None:
        if self.target is not None and self.target in model_ids:
            self.target = None
            self._fail_reports = 1
        super().report(model_ids)


async def test_a_report_that_failed_is_sent_again_though_nothing_changed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The failed report was remembered as sent: the router did not hear of
    # "a" until the 30 s refresh.
    monkeypatch.setattr(_replica, "REPORT_RETRY", 0.01, raising=False)
    d = Deployment()
    surface = FailOnceWhenHeld("a")
    async with hosted(surface, budget=10):
        await d.handle("a")
        await until(lambda: surface.target is None)
        await surface.reported(["a"])


async def test_the_free_bytes_come_back_once_a_release_finishes() -> None:
    # The model leaves the report when its release starts, with its bytes
    # still charged until the releaser returns.
    gate = anyio.Event()

    class Slow:
        @multiplexed(size=6, idle_ttl=0)
        async def get_model(self, model_id: str) -> str:
            return model_id

        @get_model.releaser
        async def free(self, model_id: str, model: str) -> None:
            await gate.wait()

    s = Slow()
    surface = FakeSurface()
    async with hosted(surface, budget=10) as replica:
        async with s.get_model("a"):
            await surface.reported(["a"])
        await surface.reported([])
        assert replica.routing_stats()["cachebroker"]["free"] == {"default": 4}
        gate.set()
        await until(lambda: replica.routing_stats()["cachebroker"]["free"] == {"default": 10})


async def test_measured_sizes_are_what_the_router_is_told() -> None:
    class Measured:
        @multiplexed(size=4, measure=lambda model: 2)
        async def get_model(self, model_id: str) -> str:
            return model_id

    m = Measured()
    surface = FakeSurface()
    async with hosted(surface, budget=10) as replica:
        async with m.get_model("a"):
            pass
        assert replica.routing_stats() == {
            "cachebroker": {
                "free": {"default": 8},
                "budget": {"default": 10},
                "sizes": {"a": {"default": 2}},
            }
        }


async def test_a_late_abandoned_threaded_load_does_not_hide_the_newer_one() -> None:
    # A plain loader's thread cannot be stopped: its requester left, a newer
    # request loaded the model again, then the old thread returned. Its load
    # was released as superfluous, and its events (ready, then release
    # requested) took the newer, resident model out of the report.
    unblock, entered = threading.Event(), threading.Event()
    calls: list[str] = []
    freed: list[str] = []

    class Threaded:
        @multiplexed(size=1)
        def get_model(self, model_id: str) -> str:
            calls.append(model_id)
            n = len(calls)
            if n == 1:
                entered.set()
                unblock.wait(10)
            return f"{model_id}{n}"

        @get_model.releaser
        async def free(self, model_id: str, model: str) -> None:
            freed.append(model)

    t = Threaded()
    surface = FakeSurface()
    try:
        async with hosted(surface, budget=10) as replica:
            async with anyio.create_task_group() as tg:

                async def leaving() -> None:
                    async with t.get_model("a"):
                        pass

                tg.start_soon(leaving)
                await until(entered.is_set)
                tg.cancel_scope.cancel()
            async with t.get_model("a") as model:
                assert model == "a2"
            unblock.set()
            await until(lambda: freed == ["a1"])
            assert calls == ["a", "a"]
            assert (await t.get_model.stats()).used == {"default": 1}  # a2 is held
            assert t.get_model.model_ids() == ["a"]
            assert replica.model_ids() == ["a"]
            await surface.reported(["a"])
    finally:
        unblock.set()


async def test_a_request_cancelled_while_waiting_for_space_leaves_no_trace() -> None:
    d = Deployment()
    surface = FakeSurface()
    hold = anyio.Event()
    async with hosted(surface, budget=10) as replica, anyio.create_task_group() as tg:
        tg.start_soon(d.handle, "big", hold)
        await until(lambda: d.get_model.model_ids() == ["big"])
        with anyio.CancelScope() as scope:

            async def leave() -> None:
                await until(lambda: d.get_model._waiting_ids() == ["a"])
                await surface.reported(["big", "a"])  # asked for, waiting for space
                scope.cancel()

            tg.start_soon(leave)
            await d.handle("a")
        assert scope.cancelled_caught
        await surface.reported(["big"])
        assert d.get_model._waiting_ids() == [] and replica.model_ids() == ["big"]
        assert d.loads == ["big"]
        hold.set()


async def test_a_request_cancelled_while_its_model_loads_leaves_no_trace() -> None:
    d = Deployment()
    surface = FakeSurface()
    d.gates["a"] = anyio.Event()
    async with hosted(surface, budget=10) as replica:
        async with anyio.create_task_group() as tg:
            tg.start_soon(d.handle, "a")
            await d.started["a"].wait()
            await surface.reported(["a"])
            tg.cancel_scope.cancel()
        await surface.reported([])
        assert replica.model_ids() == [] and d.get_model._waiting_ids() == []
        stats = await d.get_model.stats()
        assert stats.used == {"default": 0} and stats.loading == 0


async def test_model_ids_are_reported_verbatim_and_a_comma_does_not_split_one(
    events: list[MutableMapping[str, Any]],
) -> None:
    # requests_info joins the ids with commas, as vLLM's lora_requests_info:
    # "a,b" read as two models this replica does not hold.
    class Verbatim:
        @multiplexed(size=1)
        async def get_model(self, model_id: str) -> str:
            return model_id

    ids = ["a,b", "ü🙂", "x" * 5000, " ", "c"]
    surface = FakeSurface()
    async with hosted(surface, budget=10) as replica:
        m = Verbatim()
        for model_id in ids:
            async with m.get_model(model_id):
                pass
        await surface.reported(ids)
        exporter = replica._exporter
        assert exporter is not None
        exporter.export()
        info = surface.metrics_made["cachebroker_requests_info"]
        newest = max(info.values, key=lambda key: info.values[key])
        latest = dict(newest)
        assert latest["running_lora_adapters"].split(",") == ids[1:]
        assert latest["max_lora"] == "10"  # the five held, and room for five more


# ------------------------------------------------------------ failing plugins and surfaces


class BrokenMetrics(FakeSurface):
    """Ray's metrics agent refuses every gauge reading."""

    def metrics(self) -> Any:
        make = super().metrics()

        def broken(*args: Any) -> FakeMetric:
            metric: FakeMetric = make(*args)

            def refuse(value: float, tags: dict[str, str] | None = None) -> None:
                raise ValueError("metrics agent down")

            metric.set = refuse  # type: ignore[method-assign]
            return metric

        return broken


async def test_a_failing_metric_sink_fails_no_request_and_stops_nothing(
    events: list[MutableMapping[str, Any]],
) -> None:
    # It failed the request that changed the model ids, dropped the
    # broker's listener that tracks them, and its export loop took the whole
    # replica down.
    d = Deployment()
    surface = BrokenMetrics()
    async with hosted(surface, budget=10) as replica:
        for model_id in ["a", "b", "c"]:
            assert await d.handle(model_id) == model_id
        assert d.get_model.model_ids() == ["b", "c"] and d.freed == ["a"]
        await surface.reported(["b", "c"])
        assert not replica.closed
    failed = [e for e in events if e["event"] == "cachebroker.ray.report_failed"]
    assert failed and all(e["to"] == "metrics" for e in failed)
    assert "metrics agent down" in failed[0]["error"]
    assert not [e for e in events if e["event"] == "cachebroker.listener.failed"]


async def test_a_loaders_process_level_exception_leaves_hosted_as_itself() -> None:
    # It came out in two exception groups (the replica's task group's, then hosted()'s).
    class Melting:
        @multiplexed(size=1)
        async def get_model(self, model_id: str) -> str:
            await anyio.lowlevel.checkpoint()
            raise Meltdown(model_id)

    m = Melting()

    async def serve() -> None:
        with anyio.fail_after(5):
            async with hosted(FakeSurface(), budget=10):
                with pytest.raises(cachebroker.LoadFailed, match=r"Melting\.get_model:'x'"):
                    async with m.get_model("x"):
                        pass
                await anyio.sleep_forever()  # until the replica's own task fails

    with pytest.raises(Meltdown, match="x"):
        await serve()


async def test_the_body_error_leaves_hosted_as_itself_and_the_loading_request_is_told() -> None:
    d = Deployment()
    d.gates["a"] = anyio.Event()
    errors: list[Exception] = []
    error = KeyError("body")

    async def request() -> None:
        try:
            await d.handle("a")
        except Exception as exc:
            errors.append(exc)

    async def serve(tg: anyio.abc.TaskGroup) -> None:
        async with hosted(FakeSurface(), budget=10):
            tg.start_soon(request)
            await d.started["a"].wait()
            raise error

    async with anyio.create_task_group() as tg:
        with pytest.raises(KeyError) as caught:
            await serve(tg)
    assert caught.value is error
    assert len(errors) == 1 and isinstance(errors[0], cachebroker.BrokerClosed)


async def test_a_budget_callable_that_raises_comes_out_as_itself() -> None:
    def budget() -> int:
        raise LookupError("no GPU 0")

    with pytest.raises(LookupError, match="no GPU 0"):
        async with hosted(FakeSurface(), budget=budget):
            pass


@ASYNCIO_ONLY
async def test_a_budget_callable_that_raises_in_a_fresh_replica_is_named_to_the_request(
    detached: FakeSurface,
) -> None:
    calls: list[int] = []

    def budget() -> int:
        calls.append(1)
        if len(calls) == 1:
            raise LookupError("no GPU 0")
        return 10

    class Probed:
        @multiplexed(size=1, budget=budget)
        async def get_model(self, model_id: str) -> str:
            return model_id

    p = Probed()
    with pytest.raises(cachebroker.BrokerClosed, match=r"did not start.*no GPU 0") as caught:
        async with p.get_model("a"):
            pass
    assert isinstance(caught.value.__cause__, LookupError)
    try:
        async with p.get_model("a") as model:  # the next request starts it again
            assert model == "a"
    finally:
        await shutdown()


async def test_a_loader_raising_a_cancelled_error_of_its_own_is_a_failure() -> None:
    class Cancelling:
        @multiplexed(size=1)
        async def get_model(self, model_id: str) -> str:
            raise asyncio.CancelledError("an inner future of the loader's own")

    c = Cancelling()
    surface = FakeSurface()
    async with hosted(surface, budget=10) as replica:
        with anyio.fail_after(5), pytest.raises(Exception, match=r"Cancelling\.get_model"):
            async with c.get_model("x"):
                pass
        await surface.reported([])
        assert replica.model_ids() == [] and (await c.get_model.stats()).used == {"default": 0}
        async with Deployment().get_model("a"):  # the replica serves on
            pass


async def test_a_loader_asking_for_its_own_model_is_a_deadlock_error_not_a_hang() -> None:
    class Recursive:
        @multiplexed(size=1)
        async def get_model(self, model_id: str) -> str:
            if model_id == "outer":
                async with self.get_model("inner") as inner:  # another model: fine
                    return f"outer+{inner}"
            if model_id == "x":
                async with self.get_model(model_id) as same:
                    return same
            return model_id

    r = Recursive()
    surface = FakeSurface()
    async with hosted(surface, budget=10):
        with anyio.fail_after(5):
            async with r.get_model("outer") as model:
                assert model == "outer+inner"
            with pytest.raises(cachebroker.DeadlockError, match=r"Recursive\.get_model:'x'"):
                async with r.get_model("x"):
                    pass
        await surface.reported(["inner", "outer"])


async def test_a_releaser_that_hangs_is_cut_off_and_its_model_is_not_reported() -> None:
    class Hanging:
        @multiplexed(size=6)
        async def get_model(self, model_id: str) -> str:
            return model_id

        @get_model.releaser
        async def free(self, model_id: str, model: str) -> None:
            await anyio.sleep_forever()

    h = Hanging()
    surface = FakeSurface()
    with anyio.fail_after(5):
        async with hosted(surface, budget=10, release_timeout=0.01):
            async with h.get_model("a"):
                pass
            # a's bytes stay charged; its release runs on, so b waits for them (in vain)
            with pytest.raises(cachebroker.AcquireTimeout, match="still running"):
                async with h.get_model("b", timeout=0.2):
                    pass
            await surface.reported([])
            assert (await h.get_model.stats()).quarantined == 1


async def test_a_measure_that_raises_names_the_model_and_leaves_nothing_held() -> None:
    def measure(model: str) -> int:
        raise RuntimeError("cannot size it")

    freed: list[str] = []

    class Unmeasurable:
        @multiplexed(size=1, measure=measure)
        async def get_model(self, model_id: str) -> str:
            return model_id

        @get_model.releaser
        async def free(self, model_id: str, model: str) -> None:
            freed.append(model)

    u = Unmeasurable()
    surface = FakeSurface()
    async with hosted(surface, budget=10) as replica:
        with pytest.raises(InvalidArgument, match=r"Unmeasurable\.get_model:'a'"):
            async with u.get_model("a"):
                pass
        await until(lambda: freed == ["a"])
        await surface.reported([])
        assert replica.model_ids() == [] and (await u.get_model.stats()).used == {"default": 0}


async def test_a_lease_dropped_by_a_dying_task_is_ended_and_its_model_can_go() -> None:
    d = Deployment()
    async with hosted(FakeSurface(), budget=10):

        async def dying() -> None:
            lease = await d.get_model("a")
            assert lease.value.model_id == "a"  # and the task ends without releasing

        with pytest.warns(ResourceWarning, match="garbage-collected while held"):  # noqa: PT031
            await dying()
            gc.collect()
        await d.handle("big")  # a goes for it: its lease was ended
        assert d.freed == ["a"] and d.get_model.model_ids() == ["big"]


# ------------------------------------------------------------ shutting down


async def test_shutdown_while_a_model_loads_tells_its_request_and_returns() -> None:
    d = Deployment()
    d.gates["a"] = anyio.Event()
    errors: list[Exception] = []

    async def request() -> None:
        try:
            await d.handle("a")
        except Exception as exc:
            errors.append(exc)

    async with hosted(FakeSurface(), budget=10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(request)
            await d.started["a"].wait()
            with anyio.fail_after(5):
                await shutdown()
        assert len(errors) == 1 and isinstance(errors[0], cachebroker.BrokerClosed)
        assert d.freed == []  # the load never finished: nothing to release


async def test_shutdown_waits_for_the_lease_then_releases_the_model() -> None:
    d = Deployment()
    hold = anyio.Event()
    async with hosted(FakeSurface(), budget=10, release_timeout=5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(d.handle, "a", hold)
            await until(lambda: d.get_model.model_ids() == ["a"])

            async def end_the_request() -> None:
                replica = d.get_model._replica
                await until(lambda: replica is not None and replica.closed)
                assert d.freed == []  # never under its lease
                hold.set()

            tg.start_soon(end_the_request)
            await shutdown()
        assert d.freed == ["a"]


# ------------------------------------------------------------ memory spaces


async def test_sizes_per_space_are_budgeted_and_reported_per_space() -> None:
    class Spaces:
        @multiplexed(size={"cuda:0": 4, "ram": 2})
        async def get_model(self, model_id: str) -> str:
            return model_id

    s = Spaces()
    surface = FakeSurface()
    async with hosted(surface, budget={"cuda:0": 10, "ram": 3}) as replica:
        async with s.get_model("a"):
            pass
        assert replica.routing_stats() == {
            "cachebroker": {
                "free": {"cuda:0": 6, "ram": 1},
                "budget": {"cuda:0": 10, "ram": 3},
                "sizes": {"a": {"cuda:0": 4, "ram": 2}},
            }
        }
        async with s.get_model("b"):  # the GPU has room, the RAM has not: a goes
            pass
        await surface.reported(["b"])


class NoMetricsAgent(FakeSurface):
    """Ray's metrics cannot be made at all (here: its histograms)."""

    def metrics(self) -> Any:
        make = super().metrics()

        def refusing(kind: str, *args: Any) -> FakeMetric:
            if kind == "histogram":
                raise ValueError("bad boundaries")
            made: FakeMetric = make(kind, *args)
            return made

        return refusing


async def test_metrics_that_cannot_be_made_leave_a_replica_that_serves(
    anyio_backend: tuple[str, dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    events: list[MutableMapping[str, Any]],
) -> None:
    # The replica's broker did not start ("ExceptionGroup(...)" in a Ray
    # replica, tried again and failing at every request).
    d = Deployment()
    surface = NoMetricsAgent()
    async with hosted(surface, budget=10):
        assert await d.handle("a") == "a"
        await surface.reported(["a"])
    if anyio_backend[0] == "asyncio":
        monkeypatch.setattr(_replica, "_SURFACE", NoMetricsAgent)
        monkeypatch.setenv("CACHEBROKER_BUDGET", "10")
        try:
            assert await d.handle("b") == "b"
        finally:
            await shutdown()
    failed = [e for e in events if e["event"] == "cachebroker.ray.report_failed"]
    assert failed and "bad boundaries" in failed[0]["error"] and failed[0]["to"] == "metrics"
