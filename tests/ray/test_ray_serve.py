"""cachebroker.ray on a real local Ray cluster: 2 replicas, 5 models that do not all fit.

Ray starts in a few seconds here (``ray.init(num_cpus=2)``, Serve on
127.0.0.1). Run alone with ``nox -s ray`` or
``pytest tests/ray/test_ray_serve.py``; skipped where Ray Serve is not installed
(``pip install -e '.[test,ray]'``).
"""

from __future__ import annotations

import importlib
import os
import pickle
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from . import ray_app  # noqa: E402

pytestmark = [
    pytest.mark.ray,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
]

SIZES = {"m0": 4_000, "m1": 3_000, "m2": 3_000, "m3": 2_000, "m4": 2_000}  # 14 kB in all
BUDGET = 6_000  # per replica: 12 kB for 2 replicas, so the 5 models never all fit
ROUTING_ROUNDS = 150  # of 20 requests each (a round takes 0.2-0.5 s): the router's time to hear


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def cluster() -> Iterator[int]:
    """A local Ray cluster with Serve on 127.0.0.1; yields the metrics export port."""
    metrics_port = free_port()
    ray.cloudpickle.register_pickle_by_value(ray_app)
    # The replicas inherit this environment: no shared broker, no budget from it.
    saved = {
        name: os.environ.pop(name, None) for name in ("CACHEBROKER_ADDRESS", "CACHEBROKER_BUDGET")
    }
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        _metrics_export_port=metrics_port,
        _system_config={"metrics_report_interval_ms": 1000},
    )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
        yield metrics_port
    finally:
        serve.shutdown()
        ray.shutdown()
        ray.cloudpickle.unregister_pickle_by_value(ray_app)
        os.environ.update({name: value for name, value in saved.items() if value is not None})


def deploy(name: str, cls: type, **options: Any) -> Any:
    options.setdefault("ray_actor_options", {"num_cpus": 0})
    app = serve.deployment(num_replicas=2, max_ongoing_requests=32, **options)(cls).bind()
    return serve.run(app, name=name, route_prefix=None)


def call(handle: Any, model_id: str, hold: float = 0.0) -> dict[str, Any]:
    result: dict[str, Any] = (
        handle.options(multiplexed_model_id=model_id).remote(hold).result(timeout_s=60)
    )
    return result


def trace(n: int, seed: int = 1) -> list[str]:
    """Model ids with skewed popularity (m0 most asked for)."""
    rng = random.Random(seed)
    return rng.choices(list(SIZES), weights=[8, 5, 3, 2, 1], k=n)


def test_concurrent_requests_never_lose_their_model_and_replicas_stay_in_budget(
    cluster: int,
) -> None:
    handle = deploy("budget", ray_app.brokered(SIZES, BUDGET, load_seconds=0.02))
    model_ids = trace(240)
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda m: call(handle, m, hold=0.01), model_ids))
    assert len(results) == len(model_ids)
    assert not any(r["saw_released"] for r in results), "a request's model was released under it"
    last: dict[int, dict[str, Any]] = {}
    for result in results:
        assert sum(result["held"].values()) <= BUDGET, result
        last[result["pid"]] = result
    assert len(last) == 2, "both replicas served"
    for books in last.values():
        assert books["violations"] == 0
        assert books["peak"] <= BUDGET
    loads = sum(sum(b["loads"].values()) for b in last.values())
    assert loads > len(SIZES), "the models did not all fit: some were loaded again"
    serve.delete("budget")


def test_repeat_requests_go_to_the_replica_that_holds_the_model(cluster: int) -> None:
    # Each replica has room for one of m3 and m4 (2 kB each). A request that
    # reaches the replica without its model evicts the other model there and
    # loads its own, so a round of requests with no load is one where every
    # request went to the replica holding its model. Until Serve's controller
    # has told this process's router what each replica holds, requests go to
    # either replica; the rounds are counted, not timed.
    handle = deploy("routing", ray_app.brokered(SIZES, SIZES["m3"], load_seconds=0.02))
    loads: dict[int, int] = {}  # replica pid -> its loads so far
    for _ in range(ROUTING_ROUNDS):
        # (Pairs, not alternation: Serve spreads requests it cannot match to a
        # model by queue length, which alone would alternate them.)
        served = [(m, call(handle, m)) for m in ["m3", "m3", "m4", "m4"] * 5]
        quiet = True
        for _model_id, result in served:
            total = sum(result["loads"].values())
            quiet = quiet and loads.get(result["pid"]) == total
            loads[result["pid"]] = total
        if quiet:
            break
    else:
        pytest.fail(f"every one of {ROUTING_ROUNDS} rounds loaded a model again: {loads}")
    replicas = {m: {result["pid"] for n, result in served if n == m} for m in ("m3", "m4")}
    assert len(replicas["m3"]) == len(replicas["m4"]) == 1, replicas
    assert replicas["m3"] != replicas["m4"], replicas
    for model_id, result in served:
        assert result["reported"] == [model_id], (model_id, result)
    serve.delete("routing")


def test_broker_router_sends_a_new_model_where_it_fits_without_eviction(cluster: int) -> None:
    from cachebroker.ray import BrokerRouter

    config: Any = importlib.import_module("ray.serve.config")

    handle = deploy(
        "router",
        ray_app.brokered(SIZES, BUDGET, load_seconds=0.0),
        request_router_config=config.RequestRouterConfig(
            request_router_class=BrokerRouter, request_routing_stats_period_s=0.5
        ),
    )

    def settle() -> None:
        # A replica reports its models at once and Serve polls its free bytes
        # every 0.5 s; both reach this process's router through Serve's
        # controller (long poll).
        time.sleep(2.0)

    first = call(handle, "m0")["pid"]  # 4 kB: 2 kB left there
    settle()
    second = call(handle, "m3")["pid"]  # 2 kB: fits on both; goes where more is free
    assert second != first
    settle()
    third = call(handle, "m1")  # 3 kB: fits only beside m3 (4 kB free), not beside m0
    assert third["pid"] == second, third
    settle()
    for model_id, pid in [("m0", first), ("m3", second), ("m1", second)] * 3:
        result = call(handle, model_id)
        assert result["pid"] == pid, (model_id, result)
        assert result["loads"] == dict.fromkeys(result["held"], 1), "a model was loaded twice"
    serve.delete("router")


def test_a_first_burst_through_several_handles_loads_each_model_once(cluster: int) -> None:
    from cachebroker.ray import BrokerRouter

    config: Any = importlib.import_module("ray.serve.config")
    handle = deploy(
        "burst",
        ray_app.brokered(SIZES, BUDGET, load_seconds=0.2),
        request_router_config=config.RequestRouterConfig(request_router_class=BrokerRouter),
    )
    # A handle passed by value (to a task, to another deployment) routes on a
    # router of its own: four of them here, in this process.
    handles = [pickle.loads(pickle.dumps(handle)) for _ in range(4)]
    for each in handles:
        each.options()  # (builds its router, which asks Serve's controller for the replicas)
    deadline = time.monotonic() + 30
    while not all(each.running_replicas_populated() for each in handles):
        assert time.monotonic() < deadline, "the routers did not learn the replicas"
        time.sleep(0.05)
    models = ["m1", "m2", "m3", "m4"]  # 10 kB: they fit in the two replicas, once each
    responses = [
        each.options(multiplexed_model_id=model_id).remote(0.05)
        for i, each in enumerate(handles)
        for model_id in (models if i % 2 else models[::-1])
    ]
    results = [response.result(timeout_s=60) for response in responses]
    loads: dict[tuple[int, str], int] = {}
    for result in results:
        for model_id, n in result["loads"].items():
            loads[result["pid"], model_id] = max(n, loads.get((result["pid"], model_id), 0))
    assert sum(loads.values()) == len(models), loads
    assert not any(r["saw_released"] for r in results)
    serve.delete("burst")


def test_co_located_replicas_share_the_machines_budget_through_cachebroker_serve(
    cluster: int, tmp_path: Path
) -> None:
    address = str(tmp_path / "broker.sock")
    daemon = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cachebroker",
            "serve",
            "--budget",
            str(BUDGET),
            "--socket",
            address,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(address):
            assert daemon.poll() is None and time.monotonic() < deadline, "the daemon did not start"
            time.sleep(0.05)
        # Each replica's own budget would hold 6 kB: together, 12 kB. Through
        # the daemon they hold 6 kB between them.
        journal = tmp_path / "held.log"
        handle = deploy(
            "shared",
            ray_app.brokered(SIZES, BUDGET, load_seconds=0.01, journal=str(journal)),
            ray_actor_options={
                "num_cpus": 0,
                "runtime_env": {"env_vars": {"CACHEBROKER_ADDRESS": address}},
            },
        )
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda m: call(handle, m, hold=0.01), trace(160, seed=3)))
        assert not any(r["saw_released"] for r in results)
        assert len({r["pid"] for r in results}) == 2, "both replicas served"
        # What both replicas held at each instant (their journals, merged in time).
        held: dict[str, int] = {}
        most = 0
        lines = sorted(journal.read_text().split("\n")[:-1], key=lambda ln: float(ln.split()[0]))
        for line in lines:
            _, pid, size = line.split()
            held[pid] = int(size)
            most = max(most, sum(held.values()))
        assert len(held) == 2
        assert most <= BUDGET, most
        assert most > max(SIZES.values()), "the replicas held models at once"
        serve.delete("shared")
    finally:
        daemon.terminate()
        daemon.wait(timeout=30)


def test_a_replica_killed_mid_run_is_replaced_without_losing_requests_beyond_its_own(
    cluster: int,
) -> None:
    handle = deploy("killed", ray_app.brokered(SIZES, BUDGET, load_seconds=0.02))
    pids = {call(handle, m)["pid"] for m in SIZES}
    victim = call(handle, "m0")["pid"]
    failures: list[BaseException] = []
    done: list[dict[str, Any]] = []

    def request(i: int, model_id: str) -> None:
        if i == 40:
            os.kill(victim, signal.SIGKILL)
        try:
            done.append(call(handle, model_id, hold=0.02))
        except Exception as exc:
            failures.append(exc)

    model_ids = trace(200, seed=2)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(request, range(len(model_ids)), model_ids))
    # Only requests in flight on the killed replica may fail (at most the pool's 8).
    assert len(failures) <= 8, failures
    for exc in failures:
        assert isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError))
    assert len(done) + len(failures) == len(model_ids)
    # The replacement serves, and the books of the survivor are intact.
    deadline = time.monotonic() + 60
    replacement: set[int] = set()
    while time.monotonic() < deadline and not replacement:
        replacement = {call(handle, m)["pid"] for m in SIZES} - pids
    assert replacement, "the killed replica was not replaced"
    assert not any(r["saw_released"] for r in done)
    serve.delete("killed")


def test_the_replica_exports_its_models_and_the_broker_through_ray_metrics(
    cluster: int,
) -> None:
    handle = deploy("metrics", ray_app.brokered(SIZES, BUDGET, load_seconds=0.0))
    for model_id in ("m3", "m4"):
        call(handle, model_id)
    deadline = time.monotonic() + 60
    lines: list[str] = []
    while time.monotonic() < deadline:
        url = f"http://127.0.0.1:{cluster}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        lines = [
            line
            for line in text.splitlines()
            if 'application="metrics"' in line and not line.startswith("#")
        ]
        names = {line.split("{")[0] for line in lines}
        if {"ray_cachebroker_requests_info", "ray_cachebroker_loads_total"} <= names:
            break
        time.sleep(0.5)
    info = [line for line in lines if line.startswith("ray_cachebroker_requests_info{")]
    assert info, lines
    running = {
        adapters
        for line in info
        if not line.endswith(" 0.0")
        for adapters in line.split('running_lora_adapters="')[1].split('"')[0].split(",")
    }
    assert {"m3", "m4"} <= running, info
    assert any(line.startswith("ray_cachebroker_used_bytes{") for line in lines)
    assert any('max_lora="' in line for line in info)
    serve.delete("metrics")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
