"""NvidiaGPU on a real GPU: real CUDA allocations against a probed space.

Needs an NVIDIA GPU, ``torch`` with CUDA and ``nvidia-ml-py``. One plugin
loads "models" (CUDA tensors of 2-12 GiB) into a space bound to
``NvidiaGPU(0, headroom=...)``; between loads a second process-like tenant
grabs and frees memory behind the broker's back. After every load it checks,
through NVML, that the device's free memory stayed above the headroom, and it
also runs free-and-retry: loads declared with no size at all, relying on
``torch.cuda.OutOfMemoryError``.

    python benchmarks/gpu_probe.py [--headroom 4GiB] [--loads 24] [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from typing import Any

import anyio
import structlog

import cachebroker
from cachebroker.probes import NvidiaGPU

GiB = 2**30


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--headroom", default="4GiB")
    parser.add_argument("--loads", type=int, default=24)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    import torch  # only here: the benchmark needs a CUDA build

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure", file=sys.stderr)
        return 2
    result = anyio.run(run, args, torch)
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
    else:
        for name, value in result.items():
            print(f"{name:>28}: {value}")
    return 0 if result["headroom_violations"] == 0 else 1


async def run(args: argparse.Namespace, torch: Any) -> dict[str, Any]:
    gpu = NvidiaGPU(0, headroom=args.headroom)
    total, _ = gpu.read()
    rng = random.Random(1)
    lowest_free = total
    violations = 0
    tenant: list[Any] = []

    class Models:
        async def release(self, key: str, value: Any) -> None:
            del value
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # hand the blocks back to the device

    def loader(size: int) -> Any:
        def load() -> Any:
            return torch.empty(size, dtype=torch.uint8, device="cuda")

        return load

    broker = cachebroker.Broker(
        budget={"cuda:0": gpu},
        oom_errors=torch.cuda.OutOfMemoryError,
        memory_wait=5.0,
    )
    started = time.perf_counter()
    async with broker, broker.cache("models", Models()) as cache:
        for i in range(args.loads):
            size = rng.randint(2, 12) * GiB
            if i % 6 == 3:  # another tenant takes 6 GiB for a while
                tenant.append(torch.empty(6 * GiB, dtype=torch.uint8, device="cuda"))
            elif tenant and i % 6 == 5:
                tenant.clear()
                torch.cuda.empty_cache()
            declared = {"cuda:0": size} if i % 2 == 0 else None  # odd loads: free and retry
            async with cache.acquire(f"model-{i % 8}-{size}", load=loader(size), size=declared):
                _, free = gpu.read()
                lowest_free = min(lowest_free, free)
                if declared and free < gpu.headroom:  # unsized loads fill up to the OOM
                    violations += 1
        stats = await broker.stats()
    return {
        "device_total_gib": round(total / GiB, 1),
        "headroom_gib": round(gpu.headroom / GiB, 1),
        "loads": stats.loads,
        "evictions": stats.evictions,
        "oom_retries": stats.oom_retries,
        "lowest_free_gib": round(lowest_free / GiB, 2),
        "headroom_violations": violations,
        "seconds": round(time.perf_counter() - started, 1),
    }


if __name__ == "__main__":
    sys.exit(main())
