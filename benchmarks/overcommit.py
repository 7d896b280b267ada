"""Several processes, one budget: the real bytes held at once, under cancellation and failures.

Starts ``cachebroker serve --budget BUDGET`` and ``--processes`` client
processes of ``--tasks`` tasks each, all on ``Broker.connect``. Sizes are
honest: ``size=`` is what the loader allocates, and the releaser frees it.
Each process keeps its allocated-and-not-yet-freed bytes in its own slot of
shared memory and, at every allocation, sums the slots of the processes
still running; the peak of that sum must never exceed the budget. A share
of the acquires runs under ``anyio.move_on_after(0.003)``, some loads and a
few releases fail on purpose, and ``--kill`` SIGKILLs one process mid-run.

    python benchmarks/overcommit.py                      # 3 x 100 tasks, 30 s
    python benchmarks/overcommit.py --seconds 120 --kill

Prints the peak against the budget, the operations per second and what the
acquires came to. The short version of this run is a test
(``tests/remote/test_processes.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from multiprocessing import resource_tracker, shared_memory
from typing import Any

SLOT = 3  # pid, bytes held, peak seen


def running(pid: int) -> bool:
    """Whether ``pid`` runs (Linux: not gone, not a zombie: a zombie holds no memory)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            return file.read().rpartition(b")")[2].split()[:1] != [b"Z"]
    except OSError:
        return False


def client(config: dict[str, Any]) -> None:
    import anyio

    import cachebroker

    memory = shared_memory.SharedMemory(name=config["memory"])
    resource_tracker.unregister(memory._name, "shared_memory")  # type: ignore[attr-defined]
    assert memory.buf is not None
    cells = memory.buf.cast("q")
    slot = config["slot"]
    cells[slot * SLOT] = os.getpid()
    slots = len(cells) // SLOT
    rng = random.Random(config["seed"])
    deadline = time.monotonic() + config["seconds"]
    outcomes: Counter[str] = Counter()
    failures = [config["release_failures"]]

    def allocate(size: int) -> None:
        cells[slot * SLOT + 1] += size
        total = sum(
            cells[i * SLOT + 1] for i in range(slots) if i == slot or running(cells[i * SLOT])
        )
        cells[slot * SLOT + 2] = max(cells[slot * SLOT + 2], total)

    def free(size: int) -> None:
        cells[slot * SLOT + 1] -= size

    async def release(key: Any, value: int) -> None:
        await anyio.sleep(rng.random() * 0.002)
        if failures[0] and rng.random() < 0.02:
            failures[0] -= 1
            raise RuntimeError("this release fails on purpose: its bytes stay held")
        free(value)

    def loader(size: int) -> Any:
        async def load() -> int:
            allocate(size)
            try:
                await anyio.sleep(rng.random() * 0.003)
                if rng.random() < config["load_failures"]:
                    raise ValueError("this load fails on purpose")
            except BaseException:
                free(size)
                raise
            return size

        return load

    async def task(cache: Any) -> None:
        while time.monotonic() < deadline:
            key = rng.randrange(config["keys"])
            size = config["sizes"][key % len(config["sizes"])]
            lease = cache.acquire(key, load=loader(size), size=size, timeout=30)
            try:
                if rng.random() < config["cancel"]:
                    with anyio.move_on_after(0.003) as scope:
                        async with lease:
                            await anyio.sleep(rng.random() * 0.003)
                    outcomes["cancelled" if scope.cancelled_caught else "held"] += 1
                else:
                    async with lease:
                        await anyio.sleep(rng.random() * 0.003)
                    outcomes["held"] += 1
            except Exception as exc:
                outcomes[type(exc).__name__] += 1

    async def main() -> None:
        async with cachebroker.Broker.connect(config["address"]) as broker:
            async with broker.cache("bench", release) as cache:
                print(json.dumps({"started": os.getpid()}), flush=True)
                async with anyio.create_task_group() as tg:
                    for _ in range(config["tasks"]):
                        tg.start_soon(task, cache)
        print(json.dumps({"outcomes": dict(outcomes)}), flush=True)

    anyio.run(main, backend=config["backend"])
    cells.release()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=int, default=1000)
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--tasks", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--cancel", type=float, default=0.05)
    parser.add_argument("--load-failures", type=float, default=0.02)
    parser.add_argument("--release-failures", type=int, default=1, help="per process")
    parser.add_argument("--kill", action="store_true", help="SIGKILL one process mid-run")
    parser.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    args = parser.parse_args()
    directory = tempfile.mkdtemp(prefix="cb-", dir="/tmp")
    address = os.path.join(directory, "s.sock")
    memory = shared_memory.SharedMemory(create=True, size=8 * SLOT * args.processes)
    assert memory.buf is not None
    memory.buf[:] = bytes(len(memory.buf))
    daemon = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cachebroker",
            "serve",
            "--budget",
            str(args.budget),
            "--socket",
            address,
            "--log-level",
            "error",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert daemon.stderr is not None
        while "listening on" not in daemon.stderr.readline():
            pass
        started = time.monotonic()
        clients = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--client",
                    json.dumps(
                        {
                            "memory": memory.name,
                            "slot": slot,
                            "seed": slot,
                            "address": address,
                            "tasks": args.tasks,
                            "seconds": args.seconds,
                            "keys": 20,
                            "sizes": [50, 100, 150, 200, 250],
                            "cancel": args.cancel,
                            "load_failures": args.load_failures,
                            "release_failures": args.release_failures,
                            "backend": args.backend,
                        }
                    ),
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
            for slot in range(args.processes)
        ]
        if args.kill:
            time.sleep(args.seconds / 2)
            clients[0].send_signal(signal.SIGKILL)
        outcomes: Counter[str] = Counter()
        for proc in clients:
            out, _ = proc.communicate()
            for line in out.splitlines():
                outcomes.update(json.loads(line).get("outcomes", {}))
        seconds = time.monotonic() - started
        cells = memory.buf.cast("q")
        peaks = [cells[slot * SLOT + 2] for slot in range(args.processes)]
        cells.release()
        operations = sum(outcomes.values())
        print(
            f"{args.processes} processes x {args.tasks} tasks, {args.backend}, "
            f"{seconds:.1f} s, budget {args.budget} B"
        )
        print(f"peak held at once: {max(peaks)} B ({max(peaks) / args.budget:.3f}x the budget)")
        print(f"operations: {operations} ({operations / seconds:,.0f}/s): {dict(outcomes)}")
        print("over-commit: " + ("NONE" if max(peaks) <= args.budget else "YES"))
    finally:
        daemon.terminate()
        daemon.wait()
        memory.close()
        memory.unlink()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--client"]:
        client(json.loads(sys.argv[2]))
    else:
        main()
