"""cachebroker.ray without Ray: the loaders, the replica's broker, what it reports and exports.

``hosted()`` runs a replica in the test's task group on every backend, with a
fake Ray surface that records the model ids reported to the router and the
metrics exported. Then the attacks on it: races, cancellations, failing
plugins and surfaces, odd ids. The real Ray Serve runs are in
``tests/ray/test_ray_serve.py``.
"""

from __future__ import annotations

import asyncio
import gc
import math
import pickle
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any, ClassVar

import anyio
import anyio.abc
import anyio.lowlevel
import pytest

import cachebroker
from cachebroker import AcquireTimeout, InvalidArgument
from cachebroker.ray import Multiplexed, _replica, hosted, multiplexed, shutdown
from tests.remote.support import serving

pytestmark = pytest.mark.anyio

#: Ray Serve replicas run asyncio: what only a replica started in the
#: background does is tested there (with and without uvloop).
ASYNCIO_ONLY = pytest.mark.parametrize(
    "anyio_backend",
    [("asyncio", {}), ("asyncio", {"use_uvloop": True})],
    ids=["asyncio", "uvloop"],
)


class FakeMetric:
    def __init__(self, kind: str, name: str, tag_keys: tuple[str, ...]) -> None:
        self.kind, self.name, self.tag_keys = kind, name, tag_keys
        self.values: dict[tuple[tuple[str, str], ...], float] = {}
        self.observed: list[float] = []

    def _key(self, tags: dict[str, str] | None) -> tuple[tuple[str, str], ...]:
        tags = tags or {}
        assert set(tags) == set(self.tag_keys), (self.name, tags)
        return tuple(sorted(tags.items()))

    def set(self, value: float, tags: dict[str, str] | None = None) -> None:
        self.values[self._key(tags)] = value

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        key = self._key(tags)
        assert value > 0
        self.values[key] = self.values.get(key, 0.0) + value

    def observe(self, value: float, tags: dict[str, str] | None = None) -> None:
        self.observed.append(value)


class FakeSurface:
    """Ray as a replica sees it: the request's model id, the router, the metrics."""

    def __init__(self, request_model_id: str = "", *, fail_reports: int = 0) -> None:
        self.request_model_id = request_model_id
        self.reports: list[list[str]] = []
        self.metrics_made: dict[str, FakeMetric] = {}
        self._fail_reports = fail_reports
        self._reported = anyio.Event()

    def model_id(self) -> str:
        return self.request_model_id

    def report(self, model_ids: list[str]) -> None:
        self._reported.set()
        self._reported = anyio.Event()
        if self._fail_reports:
            self._fail_reports -= 1
            raise ConnectionError("controller unreachable")
        self.reports.append(list(model_ids))

    async def reported(self, model_ids: list[str]) -> None:
        """Wait until the last report is ``model_ids``."""
        with anyio.fail_after(10):
            while not self.reports or self.reports[-1] != model_ids:
                await self._reported.wait()

    def metrics(self) -> Any:
        def make(
            kind: str,
            name: str,
            doc: str,
            tag_keys: tuple[str, ...],
            boundaries: tuple[float, ...] | None,
        ) -> FakeMetric:
            assert doc
            metric = self.metrics_made[name] = FakeMetric(kind, name, tag_keys)
            return metric

        return make


@pytest.fixture(autouse=True)
def quick_reports(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(_replica, "REPORT_EVERY", 0.0)
    monkeypatch.delenv("CACHEBROKER_ADDRESS", raising=False)
    monkeypatch.delenv("CACHEBROKER_BUDGET", raising=False)
    yield
    assert not _replica._REPLICAS, "a test left a replica registered"


class Model:
    def __init__(self, model_id: str, size: int) -> None:
        self.model_id = model_id
        self.size = size
        self.released = False
        self.leases = 0


class Deployment:
    """A deployment as a user writes it: a loader, a releaser, request handlers."""

    SIZES: ClassVar[dict[str, int]] = {"a": 4, "b": 4, "c": 4, "big": 9, "huge": 11}

    def __init__(self) -> None:
        self.loads: list[str] = []
        self.freed: list[str] = []
        self.gates: dict[str, anyio.Event] = {}
        self.started: defaultdict[str, anyio.Event] = defaultdict(anyio.Event)

    @multiplexed(size=lambda model_id: Deployment.SIZES[model_id])
    async def get_model(self, model_id: str) -> Model:
        self.loads.append(model_id)
        self.started[model_id].set()
        gate = self.gates.get(model_id)
        if gate is not None:
            await gate.wait()
        return Model(model_id, self.SIZES[model_id])

    @get_model.releaser
    async def free_model(self, model_id: str, model: Model) -> None:
        assert model.leases == 0, f"{model_id} released while in use"
        model.released = True
        self.freed.append(model_id)

    async def handle(self, model_id: str | None = None, hold: anyio.Event | None = None) -> str:
        async with self.get_model(model_id) as model:
            assert not model.released
            model.leases += 1
            try:
                if hold is not None:
                    await hold.wait()
                assert not model.released
                return model.model_id
            finally:
                model.leases -= 1


# ------------------------------------------------------------ leases and budget


async def test_a_request_gets_its_model_loaded_once_and_shared() -> None:
    d = Deployment()
    d.gates["a"] = gate = anyio.Event()
    async with hosted(FakeSurface(), budget=10):
        results: list[str] = []

        async def request() -> None:
            results.append(await d.handle("a"))

        async with anyio.create_task_group() as tg:
            for _ in range(5):
                tg.start_soon(request)
            await d.started["a"].wait()
            gate.set()
        assert results == ["a"] * 5
        assert d.loads == ["a"]
        assert d.get_model.model_ids() == ["a"]


async def test_loads_of_different_models_run_at_once() -> None:
    d = Deployment()
    d.gates["a"] = gate_a = anyio.Event()
    d.gates["b"] = gate_b = anyio.Event()
    async with hosted(FakeSurface(), budget=10), anyio.create_task_group() as tg:
        tg.start_soon(d.handle, "a")
        tg.start_soon(d.handle, "b")
        # Both loaders started before either returned: no replica-wide load lock.
        await d.started["a"].wait()
        await d.started["b"].wait()
        gate_a.set()
        gate_b.set()


async def test_the_budget_is_bytes_and_the_owner_releases_the_least_recent() -> None:
    d = Deployment()
    async with hosted(FakeSurface(), budget=10) as replica:
        for model_id in ["a", "b", "a", "c"]:
            await d.handle(model_id)
        assert d.freed == ["b"]  # a was used after b
        assert d.get_model.model_ids() == ["a", "c"]
        stats = await d.get_model.stats()
        assert stats.used == {"default": 8}
        assert replica.model_ids() == ["a", "c"]
        await d.handle("big")  # 9 bytes: both others go
        assert sorted(d.freed) == ["a", "b", "c"]


async def test_a_model_in_use_is_never_released_the_request_waits_or_times_out() -> None:
    d = Deployment()
    hold_a, hold_b = anyio.Event(), anyio.Event()
    async with hosted(FakeSurface(), budget=10), anyio.create_task_group() as tg:
        tg.start_soon(d.handle, "a", hold_a)
        tg.start_soon(d.handle, "b", hold_b)
        with anyio.fail_after(10):
            while sorted(d.get_model.model_ids()) != ["a", "b"]:
                await anyio.lowlevel.checkpoint()
        with pytest.raises(AcquireTimeout) as caught:
            async with d.get_model("c", timeout=0.05):
                pass
        assert "c" in str(caught.value)
        assert d.freed == []
        got: list[str] = []

        async def third() -> None:
            got.append(await d.handle("c"))

        tg.start_soon(third)
        await anyio.sleep(0.01)
        assert got == [] and d.freed == []
        hold_a.set()  # a's lease ends: now it may go, and c loads
        with anyio.fail_after(10):
            while got != ["c"]:
                await anyio.sleep(0.001)
        assert d.freed == ["a"]
        hold_b.set()


async def test_a_model_larger_than_the_budget_is_refused_by_name() -> None:
    d = Deployment()
    async with hosted(FakeSurface(), budget=10):
        with pytest.raises(cachebroker.RequestTooLarge, match="huge"):
            await d.handle("huge")
        assert d.loads == []


async def test_await_gives_a_lease_to_release() -> None:
    d = Deployment()
    async with hosted(FakeSurface(), budget=10):
        lease = await d.get_model("a")
        assert lease.value.model_id == "a"
        await lease.release()
        lease = await d.get_model("a")
        assert d.loads == ["a"]
        await lease.release()


async def test_a_model_lease_is_entered_once() -> None:
    d = Deployment()
    async with hosted(FakeSurface(), budget=10):
        lease = d.get_model("a")
        async with lease:
            with pytest.raises(RuntimeError, match="once"):
                async with lease:
                    pass


# ------------------------------------------------------------ model ids


async def test_the_request_model_id_comes_from_ray_when_not_given() -> None:
    d = Deployment()
    async with hosted(FakeSurface("b"), budget=10):
        assert await d.handle() == "b"


async def test_a_request_without_a_model_id_is_an_error_naming_the_loader() -> None:
    d = Deployment()
    async with hosted(FakeSurface(""), budget=10):
        with pytest.raises(
            InvalidArgument, match=r"Deployment\.get_model.*no multiplexed model id"
        ):
            await d.handle()
        with pytest.raises(InvalidArgument, match="empty"):
            await d.handle("")
        with pytest.raises(TypeError, match="string"):
            await d.handle(3)  # type: ignore[arg-type]
        assert d.loads == []


async def test_the_router_is_told_what_the_replica_holds_loading_included() -> None:
    d = Deployment()
    surface = FakeSurface()
    d.gates["a"] = gate = anyio.Event()
    async with hosted(surface, budget=10), anyio.create_task_group() as tg:
        tg.start_soon(d.handle, "a")
        await surface.reported(["a"])  # told while loading, as Ray's own multiplexer does
        assert d.get_model.model_ids() == []
        gate.set()
        with anyio.fail_after(10):
            while d.get_model.model_ids() != ["a"]:
                await anyio.lowlevel.checkpoint()
        await d.handle("b")
        await surface.reported(["a", "b"])
        await d.handle("c")  # a goes (least recent): the router stops sending a here
        await surface.reported(["b", "c"])
        assert d.freed == ["a"]


async def test_a_failed_load_is_not_reported() -> None:
    surface = FakeSurface()

    class Failing:
        @multiplexed(size=1)
        async def get_model(self, model_id: str) -> str:
            raise OSError(f"no such model {model_id}")

    f = Failing()
    async with hosted(surface, budget=10):
        with pytest.raises(OSError, match="no such model x"):
            async with f.get_model("x"):
                pass
        await surface.reported([])
        assert f.get_model.model_ids() == []


async def test_a_report_that_fails_is_logged_and_tried_again(
    events: list[dict[str, Any]],
) -> None:
    d = Deployment()
    surface = FakeSurface(fail_reports=1)
    async with hosted(surface, budget=10):
        await d.handle("a")
        await d.handle("b")
        await surface.reported(["a", "b"])
    failed = [e for e in events if e["event"] == "cachebroker.ray.report_failed"]
    assert failed and "controller unreachable" in failed[0]["error"]


async def test_idle_models_leave_the_report_when_they_expire() -> None:
    surface = FakeSurface()

    class Quick:
        @multiplexed(size=1, idle_ttl=0)
        async def get_model(self, model_id: str) -> str:
            return model_id

    q = Quick()
    async with hosted(surface, budget=10):
        async with q.get_model("a"):
            await surface.reported(["a"])
        await surface.reported([])


# ------------------------------------------------------------ loaders and releasers


async def test_a_plain_loader_runs_in_a_worker_thread_and_a_plain_releaser_works() -> None:
    loop_thread = threading.get_ident()
    threads: list[int] = []
    freed: list[str] = []

    class Blocking:
        @multiplexed(size=6)
        def get_model(self, model_id: str) -> str:
            threads.append(threading.get_ident())
            return model_id.upper()

        @get_model.releaser
        def free(self, model_id: str, model: str) -> None:
            freed.append(model)

    b = Blocking()
    async with hosted(FakeSurface(), budget=10):
        async with b.get_model("a") as model:
            assert model == "A"
        async with b.get_model("b"):
            pass
    assert threads and loop_thread not in threads
    assert freed == ["A", "B"]


async def test_a_function_loader_is_one_per_process() -> None:
    FUNCTION_LOADS.clear()
    async with hosted(FakeSurface(), budget=10):
        async with load_function_model("a") as model:
            assert model == "model a"
        assert load_function_model.__wrapped__ is _load_function_model  # type: ignore[attr-defined]
        async with load_function_model("a"):
            pass
    assert FUNCTION_LOADS == ["a"]


FUNCTION_LOADS: list[str] = []


async def _load_function_model(model_id: str) -> str:
    FUNCTION_LOADS.append(model_id)
    return f"model {model_id}"


load_function_model = multiplexed(size=1)(_load_function_model)


async def test_two_loaders_of_one_replica_share_its_budget() -> None:
    class Two:
        @multiplexed(size=6)
        async def llm(self, model_id: str) -> str:
            return model_id

        @multiplexed(size=6)
        async def embedder(self, model_id: str) -> str:
            return model_id

    t = Two()
    surface = FakeSurface()
    async with hosted(surface, budget=10) as replica:
        async with t.llm("x"):
            pass
        async with t.embedder("y"):  # 12 > 10: the llm's model goes
            pass
        assert t.llm.model_ids() == [] and t.embedder.model_ids() == ["y"]
        await surface.reported(["y"])
        assert replica.model_ids() == ["y"]


async def test_two_loaders_asking_for_different_budgets_is_an_error() -> None:
    class Conflict:
        @multiplexed(size=1, budget=10)
        async def first(self, model_id: str) -> str:
            return model_id

        @multiplexed(size=1, budget=20)
        async def second(self, model_id: str) -> str:
            return model_id

    c = Conflict()
    async with hosted(FakeSurface(), budget=10):
        async with c.first("x"):
            pass
        with pytest.raises(InvalidArgument, match=r"one replica has one broker.*second"):
            async with c.second("x"):
                pass


async def test_two_instances_in_one_process_get_their_own_caches() -> None:
    one, two = Deployment(), Deployment()
    async with hosted(FakeSurface(), budget=10):
        await one.handle("a")
        await two.handle("a")
        assert one.loads == ["a"] and two.loads == ["a"]
        assert one.get_model.name != two.get_model.name


async def test_a_releaser_that_raises_quarantines_and_the_model_is_not_reported() -> None:
    surface = FakeSurface()

    class Broken:
        @multiplexed(size=6)
        async def get_model(self, model_id: str) -> str:
            return model_id

        @get_model.releaser
        async def free(self, model_id: str, model: str) -> None:
            raise RuntimeError("driver error")

    b = Broken()
    async with hosted(surface, budget=10):
        async with b.get_model("a"):
            pass
        with pytest.raises(cachebroker.OutOfSpace):
            async with b.get_model("b", timeout=1):
                pass
        await surface.reported([])
        stats = await b.get_model.stats()
        assert stats.quarantined == 1


async def test_shutdown_releases_every_model_through_its_releaser() -> None:
    d = Deployment()
    async with hosted(FakeSurface(), budget=10):
        await d.handle("a")
        await d.handle("b")
        await shutdown()
        assert sorted(d.freed) == ["a", "b"]
        with pytest.raises(cachebroker.BrokerClosed):
            await d.handle("a")
        await shutdown()  # idempotent


# ------------------------------------------------------------ metrics


async def test_the_broker_and_the_models_are_exported_as_ray_metrics() -> None:
    d = Deployment()
    surface = FakeSurface()
    async with hosted(surface, budget=10) as replica:
        exporter = replica._exporter
        assert exporter is not None
        await d.handle("a")
        d.gates["b"] = gate = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(d.handle, "b")
            await d.started["b"].wait()
            exporter.export()
            info = surface.metrics_made["cachebroker_requests_info"]
            latest = max(info.values, key=lambda k: info.values[k])
            assert dict(latest) == {
                "running_lora_adapters": "a",
                "waiting_lora_adapters": "b",
                "max_lora": "1",  # b's 4 bytes are reserved: 2 free, no room for another
            }
            gate.set()
        exporter.export()
        made = surface.metrics_made
        assert made["cachebroker_loads"].values == {(): 2.0}
        assert made["cachebroker_misses"].values == {(): 2.0}
        assert made["cachebroker_used_bytes"].values == {(("space", "default"),): 8.0}
        assert made["cachebroker_budget_bytes"].values == {(("space", "default"),): 10.0}
        assert made["cachebroker_resident_models"].values == {(): 2.0}
        assert len(made["cachebroker_load_seconds"].observed) == 2
        latest = max(info.values, key=lambda k: info.values[k])
        assert dict(latest)["running_lora_adapters"] == "a,b"
        superseded = [v for k, v in info.values.items() if k != latest]
        assert superseded and all(v == 0.0 for v in superseded)
        await d.handle("c")
        exporter.export()
        assert made["cachebroker_evictions"].values == {(("reason", "capacity"),): 1.0}
        assert made["cachebroker_loads"].values == {(): 3.0}  # counted once each


def test_room_for_is_the_held_models_mean_size_into_the_free_bytes() -> None:
    room_for = _replica.room_for
    assert room_for([], {"m": 10}) == 1
    assert room_for([], {"m": 0}) == 0
    assert room_for([{"m": 2}, {"m": 4}], {"m": 14}) == 4
    assert room_for([{"m": 2, "r": 5}], {"m": 18, "r": 1}) == 0
    assert room_for([{"m": 0}], {"m": 20}) == 1


# ------------------------------------------------------------ the replica's broker


async def test_the_machine_shared_broker_is_used_when_its_address_is_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    d = Deployment()
    async with serving(budget={"m": 10}) as daemon:
        monkeypatch.setenv("CACHEBROKER_ADDRESS", str(daemon.address))
        async with hosted(FakeSurface(), budget=1000) as replica:  # the daemon's budget rules
            await d.handle("a")
            await d.handle("b")
            await d.handle("c")
            assert d.freed == ["a"]
            stats = await d.get_model.stats()
            assert stats.broker_used == {"m": 8}
            assert replica.model_ids() == ["b", "c"]


async def test_a_budget_callable_is_called_in_the_replica() -> None:
    calls: list[int] = []

    def budget() -> int:
        calls.append(1)
        return 10

    d = Deployment()
    async with hosted(FakeSurface(), budget=budget):
        await d.handle("a")
        assert (await d.get_model.stats()).budget == {"default": 10}
    assert calls == [1]


async def test_no_budget_anywhere_is_an_error_that_says_where_to_give_one() -> None:
    with pytest.raises(InvalidArgument, match="CACHEBROKER_BUDGET"):
        async with hosted(FakeSurface()):
            pass


async def test_the_budget_may_come_from_the_replica_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CACHEBROKER_BUDGET", "10")
    d = Deployment()
    async with hosted(FakeSurface()):
        await d.handle("a")
        assert (await d.get_model.stats()).budget == {"default": 10}


async def test_a_replica_starts_on_first_use_in_the_background(
    anyio_backend: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    surface = FakeSurface()
    monkeypatch.setattr(_replica, "_SURFACE", lambda: surface)
    monkeypatch.setenv("CACHEBROKER_BUDGET", "10")
    d = Deployment()
    if anyio_backend[0] == "trio":
        with pytest.raises(cachebroker.BrokerClosed, match="hosted"):
            await d.handle("a")
        return
    try:
        assert await d.handle("a") == "a"
        await surface.reported(["a"])
    finally:
        await shutdown()
    assert d.freed == ["a"]


@ASYNCIO_ONLY
async def test_a_replica_whose_broker_did_not_start_tries_again_next_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_replica, "_SURFACE", FakeSurface)
    d = Deployment()
    with pytest.raises(cachebroker.BrokerClosed, match=r"did not start.*CACHEBROKER_BUDGET"):
        await d.handle("a")
    monkeypatch.setenv("CACHEBROKER_BUDGET", "10")
    try:
        assert await d.handle("a") == "a"
    finally:
        await shutdown()


# ------------------------------------------------------------ decoration


def test_bad_arguments_fail_at_decoration() -> None:
    async def load(self: object, model_id: str) -> str:
        return model_id

    with pytest.raises(TypeError, match="unknown arguments budgett"):
        multiplexed(budgett=10)(load)
    with pytest.raises(InvalidArgument, match="budget"):
        multiplexed(budget="ten")(load)
    with pytest.raises(InvalidArgument, match="timeout"):
        multiplexed(timeout=-1)(load)
    with pytest.raises(InvalidArgument, match="idle_ttl"):
        multiplexed(idle_ttl=-1)(load)
    with pytest.raises(InvalidArgument, match="cost"):
        multiplexed(cost=-1)(load)
    with pytest.raises(InvalidArgument, match="size"):
        multiplexed(size="four gigs")(load)
    with pytest.raises(InvalidArgument, match=r"size\['gpu'\]"):
        multiplexed(size={"gpu": -1})(load)
    with pytest.raises(InvalidArgument, match="space"):
        multiplexed(size={"": 1})(load)
    with pytest.raises(TypeError, match="size"):
        multiplexed(size=True)(load)
    with pytest.raises(TypeError, match="measure"):
        multiplexed(measure=3)(load)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="model id"):
        multiplexed(lambda: None)
    loader = multiplexed(load)
    with pytest.raises(TypeError, match="releaser"):
        loader.releaser(lambda: None)
    assert isinstance(loader, Multiplexed)
    assert loader._serve_multiplexed_function is True


async def test_timeout_per_request_is_checked() -> None:
    d = Deployment()
    with pytest.raises(InvalidArgument, match="timeout"):
        d.get_model("a", timeout=-1)
    assert d.get_model("a", timeout=math.inf) is not None


def test_a_loader_pickles_without_what_its_process_made() -> None:
    # Ray ships deployments with cloudpickle; a module-level loader pickles by value here.
    class Slotted:
        __slots__ = ("__weakref__",)

    load_function_model.__get__(Slotted())  # a process-local Models, which must not travel
    with pytest.raises(TypeError, match="neither a __dict__ nor weak references"):
        load_function_model.__get__(object())
    shipped = pickle.loads(pickle.dumps(load_function_model))
    assert isinstance(shipped, Multiplexed)
    assert shipped.name == "_load_function_model"
    assert shipped._bound is None and shipped._standalone is None


async def test_a_size_callable_that_raises_says_whose_it_was() -> None:
    class Sized:
        @multiplexed(size=lambda model_id: {"a": 1}[model_id])
        async def get_model(self, model_id: str) -> str:
            return model_id

    s = Sized()
    async with hosted(FakeSurface(), budget=10):
        with pytest.raises(KeyError) as caught:
            async with s.get_model("zz"):
                pass
        assert "Sized.get_model's size callable for model 'zz'" in caught.value.__notes__[0]
        async with s.get_model("a") as model:  # nothing was left half-done
            assert model == "a"


async def test_routing_stats_give_free_bytes_and_the_sizes_of_models_held_or_loading() -> None:
    d = Deployment()
    d.gates["b"] = gate = anyio.Event()
    async with hosted(FakeSurface(), budget=10) as replica:
        assert replica.routing_stats() == {
            "cachebroker": {"free": {"default": 10}, "budget": {"default": 10}, "sizes": {}}
        }
        await d.handle("a")
        async with anyio.create_task_group() as tg:
            tg.start_soon(d.handle, "b")
            await d.started["b"].wait()
            # b's bytes are reserved while it loads: the router knows its size already
            assert replica.routing_stats() == {
                "cachebroker": {
                    "free": {"default": 2},
                    "budget": {"default": 10},
                    "sizes": {"a": {"default": 4}, "b": {"default": 4}},
                }
            }
            gate.set()
    assert _replica.routing_stats()["cachebroker"]["sizes"] == {}  # no replica here now


# == attacks ===================================================================
#
# Races, cancellations, failing plugins and surfaces, odd ids: on every backend
# (``hosted()``), or asyncio alone where a replica starts on first use as in Ray
# Serve. Each test either kept a bug from coming back or pins a property that an
# attack could have broken.


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
