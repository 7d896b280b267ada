"""Ray Serve multiplexing: ``@serve.multiplexed`` with a count cap against ``cachebroker.ray``.

One Ray Serve deployment, two replicas, the same request trace for both: the
simulator's built-in workload (12 checkpoints from 90 MB to 42.5 GB with
their load times, Zipf-like popularity), scaled down so that it runs in a
minute: bytes by ``--bytes-scale`` (GB become kB) and seconds by
``--time-scale``. The models are fake (a bytearray of the scaled size; a load
sleeps the scaled load time); a request holds its model for the scaled hold
time. The requests go out in trace order from ``--concurrency`` threads.

- ``cachebroker``: ``@cachebroker.ray.multiplexed(budget=B, size=...)``, B per
  replica = ``--budget`` (the simulator's smallest built-in budget, 48 GiB,
  by default; scaled as the sizes are); requests hold their model with
  ``async with``.
- ``+BrokerRouter``: the same, with ``cachebroker.ray.BrokerRouter`` as the
  deployment's request router (model holders first, then free bytes).
- ``serve N=...``: ``@serve.multiplexed(max_num_models_per_replica=N)``, twice:
  N = B / the mean model size (the count that "fits" on average; the cap is
  in models, so the bytes it holds depend on which models), and N = the
  most models that always fit (the largest ones' sum within B).

Figures, per variant: reloads (loads of a model its replica had loaded
before) and their seconds (scaled back to the trace's time), requests that
saw their model unloaded while they used it, peak bytes per replica next to
B (for ``serve.multiplexed``: models loaded plus those unloaded while still
in use, whose memory lives on until their request ends), wall time.

    python benchmarks/ray_serve.py [--requests 400] [--budget 48GiB]
        [--time-scale 0.005] [--bytes-scale 1e-6] [--concurrency 8] [--repeats 3] [--json]

Needs ``pip install -e '.[ray,sim]'``; starts a local Ray cluster
(``num_cpus=2``) with Serve on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests/ray/ray_app.py: the deployments, shared with the tests


from cachebroker import format_bytes, parse_bytes  # noqa: E402
from cachebroker.simulator import builtin_workload  # noqa: E402
from tests.ray import ray_app  # noqa: E402

ray: Any = importlib.import_module("ray")
serve: Any = importlib.import_module("ray.serve")


def run(
    name: str, cls: type, trace: list[tuple[str, float]], concurrency: int, router: Any = None
) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if router is not None:
        config = importlib.import_module("ray.serve.config")
        options["request_router_config"] = config.RequestRouterConfig(
            request_router_class=router, request_routing_stats_period_s=0.1
        )
    app = serve.deployment(
        num_replicas=2, max_ongoing_requests=64, ray_actor_options={"num_cpus": 0}, **options
    )(cls).bind()
    handle = serve.run(app, name=name, route_prefix=None)

    def call(request: tuple[str, float]) -> dict[str, Any]:
        model_id, hold = request
        result: dict[str, Any] = (
            handle.options(multiplexed_model_id=model_id).remote(hold).result(timeout_s=300)
        )
        return result

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(call, trace))
    wall = time.perf_counter() - started
    serve.delete(name)
    replicas: dict[int, dict[str, Any]] = {}
    for result in results:  # each replica's books as of its last answer
        books = replicas.get(result["pid"])
        if books is None or sum(result["loads"].values()) >= sum(books["loads"].values()):
            replicas[result["pid"]] = result
    return {
        "results": results,
        "replicas": list(replicas.values()),
        "peak": max(max(r["peak"] for r in results), 0),
        "wall": wall,
        "saw_released": sum(r["saw_released"] for r in results),
    }


def summarize(
    outcome: dict[str, Any], load_seconds: dict[str, float], time_scale: float
) -> dict[str, Any]:
    loads = reloads = 0
    reload_seconds = 0.0
    for books in outcome["replicas"]:
        for model_id, count in books["loads"].items():
            loads += count
            reloads += count - 1
            reload_seconds += (count - 1) * load_seconds[model_id] / time_scale
    return {
        "loads": loads,
        "reloads": reloads,
        "reload_seconds": round(reload_seconds, 1),
        "saw_released": outcome["saw_released"],
        "peak_bytes": max(books["peak"] for books in outcome["replicas"]),
        "wall_seconds": round(outcome["wall"], 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument(
        "--budget", default="48GiB", help="per replica, in the trace's bytes (before scaling)"
    )
    parser.add_argument("--time-scale", type=float, default=0.005)
    parser.add_argument("--bytes-scale", type=float, default=1e-6)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="runs per variant (medians)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    workload = builtin_workload(args.seed, requests=args.requests)
    sizes: dict[str, int] = {}
    load_seconds: dict[str, float] = {}
    for request in workload:
        sizes[request.key] = max(1, round(sum(request.size.values()) * args.bytes_scale))
        load_seconds[request.key] = request.load_seconds * args.time_scale
    trace = [(r.key, r.hold_seconds * args.time_scale) for r in workload]
    budget = max(1, round(parse_bytes(args.budget) * args.bytes_scale))
    mean_cap = max(1, round(budget / statistics.mean(sizes.values())))
    largest = sorted(sizes.values(), reverse=True)
    safe_cap = max(1, max(n for n in range(len(largest) + 1) if sum(largest[:n]) <= budget))
    from cachebroker.ray import BrokerRouter

    brokered = ray_app.brokered(sizes, budget, load_seconds)
    variants: dict[str, tuple[type, Any]] = {
        "cachebroker": (brokered, None),
        "+BrokerRouter": (brokered, BrokerRouter),
        f"serve N={mean_cap}": (ray_app.counted(sizes, mean_cap, load_seconds), None),
        f"serve N={safe_cap}": (ray_app.counted(sizes, safe_cap, load_seconds), None),
    }

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(ray_app)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": 0})
        for repeat in range(args.repeats):  # interleaved: drift hits every variant alike
            for i, (name, (cls, router)) in enumerate(variants.items()):
                outcome = run(f"v{i}r{repeat}", cls, trace, args.concurrency, router)
                runs[name].append(summarize(outcome, load_seconds, args.time_scale))
    finally:
        serve.shutdown()
        ray.shutdown()
    report = {
        "requests": len(trace),
        "models": len(sizes),
        "budget_per_replica": budget,
        "count_caps": {"mean": mean_cap, "safe": safe_cap},
        "repeats": args.repeats,
        "variants": {
            name: {key: statistics.median(r[key] for r in rs) for key in rs[0]} | {"runs": rs}
            for name, rs in runs.items()
        },
    }
    if args.json:  # one line, the last (Ray's own messages may come before it)
        print(json.dumps(report))
        return 0
    print(
        f"{len(trace)} requests over {len(sizes)} models, 2 replicas; budget "
        f"{format_bytes(budget)} per replica. serve.multiplexed with N={mean_cap} models "
        f"per replica (the budget over the mean model size) and N={safe_cap} (the most "
        f"that always fit: the largest models' sum). Medians of {args.repeats} runs "
        "(range in brackets)."
    )
    rows = [
        ("reloads", "reloads"),
        ("reload seconds (trace time)", "reload_seconds"),
        ("requests whose model was unloaded under them", "saw_released"),
        ("peak bytes in a replica / budget", "peak_bytes"),
        ("wall seconds", "wall_seconds"),
    ]
    width = max(len(label) for label, _ in rows)
    names = list(report["variants"])
    print(f"{'':{width}}" + "".join(f"  {name:>22}" for name in names))
    for label, key in rows:
        cells = []
        for name in names:
            values = [r[key] for r in runs[name]]
            median = statistics.median(values)
            if key == "peak_bytes":
                text = f"{median / budget:.2f}x"
            else:
                text = f"{median:g}" + (
                    f" [{min(values):g}-{max(values):g}]" if len(set(values)) > 1 else ""
                )
            cells.append(f"  {text:>22}")
        print(f"{label:{width}}" + "".join(cells))
    ours = report["variants"]["+BrokerRouter"]
    for name in names[2:]:
        theirs = report["variants"][name]
        ratio = (
            f"{ours['reload_seconds'] / theirs['reload_seconds']:.2f}x"
            if theirs["reload_seconds"]
            else "n/a (none)"
        )
        print(
            f"cachebroker+BrokerRouter vs {name}: reload seconds {ratio}, peak bytes "
            f"{ours['peak_bytes'] / budget:.2f}x vs {theirs['peak_bytes'] / budget:.2f}x the budget"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
