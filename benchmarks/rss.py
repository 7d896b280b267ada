"""A ``ram`` budget counts the values' bytes, not the process's RSS: how far apart they get.

Many tasks acquire and release values of mixed sizes (64 KiB to 4 MiB, each
filled) through a broker with a small ``ram`` budget; plain loaders run in
worker threads, as model loaders usually do. The books never go above the
budget, but the allocator keeps freed memory: glibc's malloc gives each thread
an arena and raises its mmap threshold as large blocks are freed, so freed
buffers stay in the process as fragmented heap. The script runs the same
workload in a fresh process per allocator setting and prints the peak and
final RSS above the process's RSS before the broker started:

- glibc as it comes;
- ``MALLOC_ARENA_MAX=2`` (fewer arenas);
- ``malloc_trim(0)`` called by the releaser after it frees a value (ctypes);
- both;
- jemalloc through ``LD_PRELOAD``, when ``libjemalloc.so.2`` is installed
  (``apt-get install libjemalloc2``).

Run: ``python benchmarks/rss.py [--budget 32MiB] [--tasks 200] [--seconds 10]``.
Needs psutil. A benchmark prints numbers; it asserts nothing.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import functools
import itertools
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import psutil

import cachebroker
from cachebroker import format_bytes, parse_bytes

JEMALLOC = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"
SIZES = [64 << 10, 256 << 10, 640 << 10, 1 << 20, (3 << 20) // 2, 2 << 20, 3 << 20, 4 << 20]


class Model:
    """Stands in for a model: its checkpoint read whole, then copied into tensors.

    The read buffer is dropped once the tensors are made (a transient peak
    of twice the size, as a loader that reads a file and then builds its
    arrays has), and the tensors (4 to 16, of uneven sizes) carry a little
    metadata: what a real loader leaves in the heap between large blocks.
    """

    def __init__(self, size: int, seed: int) -> None:
        rng = random.Random(seed)
        raw = bytearray(b"\x01") * size  # the checkpoint, as read
        cuts = sorted(rng.randrange(1, size) for _ in range(rng.randint(3, 15)))
        bounds = [0, *cuts, size]
        self.tensors: list[bytearray] | None = [
            raw[start:end] for start, end in itertools.pairwise(bounds)
        ]
        self.meta: dict[str, str] | None = {f"layer.{i}": "f16" * 8 for i in range(len(bounds))}
        del raw


class Releaser:
    def __init__(self, trim: bool) -> None:
        self.trim = None
        if trim:
            libc = ctypes.CDLL(ctypes.util.find_library("c"))
            self.trim = libc.malloc_trim

    async def release(self, key: str, model: Model) -> None:
        model.tensors = model.meta = None  # the bytes go back to the allocator here
        if self.trim is not None:
            self.trim(0)  # ... and from the allocator to the system here


async def workload(args: argparse.Namespace) -> dict[str, Any]:
    process = psutil.Process()
    rng = random.Random(1)
    keys = [(f"m{i}", rng.choice(SIZES)) for i in range(args.keys)]
    weights = [1 / (rank + 1) for rank in range(len(keys))]  # Zipf(1)
    baseline = process.memory_info().rss
    peak = [baseline]
    ops = [0]
    stop = time.monotonic() + args.seconds
    budget = parse_bytes(args.budget)

    async def sample() -> None:
        while True:
            peak[0] = max(peak[0], process.memory_info().rss)
            await anyio.sleep(0.02)

    async with cachebroker.Broker(budget={"ram": budget}, release_timeout=None) as broker:
        used_peak = [0]
        async with broker.cache("models", Releaser(args.trim)) as cache:

            async def client(seed: int) -> None:
                local = random.Random(seed)
                while time.monotonic() < stop:
                    key, size = local.choices(keys, weights)[0]
                    seed = local.randrange(1 << 30)
                    async with cache.acquire(
                        key,
                        load=functools.partial(Model, size, seed),
                        size={"ram": size},
                        timeout=60,
                    ) as lease:
                        assert lease.value.tensors is not None
                        used_peak[0] = max(used_peak[0], broker.stats_nowait().used["ram"])
                        await anyio.sleep(local.random() * 0.004)
                    ops[0] += 1

            async with anyio.create_task_group() as tg:
                tg.start_soon(sample)
                async with anyio.create_task_group() as clients:
                    for seed in range(args.tasks):
                        clients.start_soon(client, seed)
                tg.cancel_scope.cancel()
            stats = await broker.stats()
    end = process.memory_info().rss
    return {
        "budget": budget,
        "books_peak": used_peak[0],
        "rss_peak_above": peak[0] - baseline,
        "rss_end_above": end - baseline,
        "ops": ops[0],
        "loads": stats.loads,
    }


MODES: list[tuple[str, dict[str, str], list[str]]] = [
    ("glibc", {}, []),
    ("MALLOC_ARENA_MAX=2", {"MALLOC_ARENA_MAX": "2"}, []),
    ("malloc_trim(0) after each release", {}, ["--trim"]),
    ("MALLOC_ARENA_MAX=2 + malloc_trim(0)", {"MALLOC_ARENA_MAX": "2"}, ["--trim"]),
    ("jemalloc (LD_PRELOAD)", {"LD_PRELOAD": JEMALLOC}, []),
    (
        "jemalloc, dirty_decay_ms:0",
        {"LD_PRELOAD": JEMALLOC, "MALLOC_CONF": "dirty_decay_ms:0,muzzy_decay_ms:0"},
        [],
    ),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", default="32MiB")
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--keys", type=int, default=40)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--trim", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(anyio.run(workload, args)))
        return
    common = [
        "--budget",
        args.budget,
        "--tasks",
        str(args.tasks),
        "--keys",
        str(args.keys),
        "--seconds",
        str(args.seconds),
    ]
    print(
        f"ram budget {args.budget}, {args.tasks} tasks, {args.keys} keys of 64 KiB-4 MiB, "
        f"{args.seconds:g} s each; RSS above the process's RSS before the broker started"
    )
    print(f"{'allocator':38} {'books peak':>11} {'RSS peak':>10} {'RSS end':>10} {'ops':>8}")
    for name, env, extra in MODES:
        if "LD_PRELOAD" in env and not Path(env["LD_PRELOAD"]).exists():
            print(f"{name:38} (not installed: apt-get install libjemalloc2)")
            continue
        result = subprocess.run(
            [sys.executable, __file__, "--child", *common, *extra],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            check=True,
        )
        row = json.loads(result.stdout.splitlines()[-1])
        print(
            f"{name:38} {format_bytes(row['books_peak']):>11} "
            f"{format_bytes(row['rss_peak_above']):>10} {format_bytes(row['rss_end_above']):>10} "
            f"{row['ops']:>8,}"
        )


if __name__ == "__main__":
    main()
