"""The built-in demo: two plugins sharing a small RAM budget through one broker.

Each plugin loads real buffers (tens of MiB of ``bytearray``) and frees them
when the broker asks; sessions arrive in random order, a few at a time. The
broker's events are printed as they happen, then the final stats and the
peak of memory the plugins really held.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable, MutableMapping
from typing import Any, TextIO

import anyio
import structlog

from ._errors import BrokerError
from ._shell import Broker, Cache
from ._sizes import parse_bytes
from ._units import format_bytes

MiB = 2**20

#: (plugin, model, size) — the catalogue the sessions draw from.
CATALOGUE: tuple[tuple[str, str, int], ...] = (
    ("speech", "tiny", 8 * MiB),
    ("speech", "base", 24 * MiB),
    ("speech", "large", 48 * MiB),
    ("llm", "small", 16 * MiB),
    ("llm", "medium", 40 * MiB),
    ("llm", "large", 64 * MiB),
)


class BufferPlugin:
    """A plugin whose "models" are real buffers; it frees them when asked."""

    def __init__(self, name: str, out: TextIO, held: dict[tuple[str, str], int]) -> None:
        self.name = name
        self.out = out
        self.held = held
        self.peak = 0

    def loader(self, key: str, size: int, threaded: bool) -> Callable[[], Any]:
        def make() -> bytearray:
            buffer = bytearray(size)
            buffer[::4096] = b"\x01" * len(buffer[::4096])  # touch every page: really resident
            return buffer

        if threaded:

            def load_sync() -> bytearray:
                return make()

            return load_sync

        async def load_async() -> bytearray:
            await anyio.sleep(0.01)
            return make()

        return load_async

    def loaded(self, key: str, size: int) -> None:
        self.held[(self.name, key)] = size
        self.peak = max(self.peak, sum(self.held.values()))

    async def release(self, key: str, value: bytearray) -> None:
        await anyio.sleep(0.005)  # a real plugin would sync its device here
        del value[:]
        del self.held[(self.name, key)]
        print(f"    {self.name}: freed {key} ({self.name}'s ack)", file=self.out)


def _render(out: TextIO) -> Callable[[Any, str, MutableMapping[str, Any]], str]:
    def render(_: Any, __: str, event: MutableMapping[str, Any]) -> str:
        name = str(event.pop("event")).removeprefix("cachebroker.")
        where = f"{event.pop('cache', '')}:{event.pop('key', '')}"
        sizes = event.pop("bytes", None)
        weight = ", ".join(f"{s}={format_bytes(n)}" for s, n in (sizes or {}).items())
        extra = " ".join(f"{k}={v}" for k, v in event.items() if k not in ("level", "late"))
        return f"  {name:<18} {where:<14} {weight:<22} {extra}".rstrip()

    return render


async def run_demo(
    *, budget: str = "96MiB", sessions: int = 24, seed: int = 7, out: TextIO = sys.stdout
) -> int:
    """Run the demo and return the peak bytes the plugins held at once.

    Raises:
        BrokerError: a session's request failed (the first such error), e.g.
            ``RequestTooLarge`` for a model larger than the whole budget.
    """
    limit = parse_bytes(budget, what="budget")
    rng = random.Random(seed)
    logger = structlog.wrap_logger(
        structlog.PrintLogger(out),
        processors=[structlog.processors.add_log_level, _render(out)],
        wrapper_class=structlog.make_filtering_bound_logger(20),
    )
    held: dict[tuple[str, str], int] = {}
    plugins = {name: BufferPlugin(name, out, held) for name in ("speech", "llm")}
    print(f"cachebroker demo: {sessions} sessions, RAM budget {format_bytes(limit)}", file=out)
    async with Broker(budget=limit, release_timeout=5, logger=logger) as broker:
        async with broker.cache("speech", plugins["speech"]) as speech:
            async with broker.cache("llm", plugins["llm"]) as llm:
                caches: dict[str, Cache] = {"speech": speech, "llm": llm}
                order = [rng.choice(CATALOGUE) for _ in range(sessions)]
                slots = anyio.Semaphore(3)

                failed: list[BrokerError] = []

                async def session(number: int, plugin: str, key: str, size: int) -> None:
                    async with slots:
                        print(f"session {number:>2}: {plugin} wants {key}", file=out)
                        owner = plugins[plugin]
                        load = owner.loader(key, size, threaded=plugin == "speech")
                        try:
                            async with caches[plugin].acquire(key, load=load, size=size) as lease:
                                if (plugin, key) not in held:
                                    owner.loaded(key, size)
                                assert len(lease.value) == size
                                await anyio.sleep(rng.uniform(0.005, 0.03))
                        except BrokerError as exc:  # e.g. a model larger than the budget
                            failed.append(exc)
                            tg.cancel_scope.cancel()

                async with anyio.create_task_group() as tg:
                    for number, (plugin, key, size) in enumerate(order, 1):
                        tg.start_soon(session, number, plugin, key, size)
                        await anyio.sleep(0.004)
                if failed:
                    # The first error alone, as itself: not the sessions' exception group.
                    raise failed[0]
        stats = await broker.stats()
    peak = max(p.peak for p in plugins.values())  # ``held`` is shared: each peak is global
    print("\nfinal stats:", file=out)
    print(
        f"  hits={stats.hits} misses={stats.misses} loads={stats.loads} "
        f"evictions={stats.evictions} load_seconds={stats.load_seconds:.3f} "
        f"hit_ratio={stats.hit_ratio:.0%}",
        file=out,
    )
    print(
        f"  used now={format_bytes(stats.used['default'])} "
        f"releases={ {k: v for k, v in stats.releases.items() if v} }",
        file=out,
    )
    print(
        f"  peak memory the plugins really held: {format_bytes(peak)} "
        f"(budget {format_bytes(limit)})",
        file=out,
    )
    return peak


def add_parser(commands: Any, name: str, help: str) -> None:
    """Add the ``demo`` command to ``commands`` (argparse sub-parsers)."""
    parser = commands.add_parser(name, help=help)
    parser.add_argument("--budget", default="96MiB", help="RAM budget (default: 96MiB)")
    parser.add_argument("--sessions", type=int, default=24, help="number of sessions (default: 24)")
    parser.add_argument("--seed", type=int, default=7, help="random seed for the session order")
    parser.add_argument(
        "--backend", choices=["asyncio", "trio"], default="asyncio", help="event loop to run on"
    )


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run ``cachebroker demo`` with parsed ``args``; return the exit status."""
    if args.sessions < 1:
        parser.error("--sessions must be at least 1")
    try:
        parse_bytes(args.budget, what="--budget")
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    try:
        anyio.run(
            lambda: run_demo(budget=args.budget, sessions=args.sessions, seed=args.seed),
            backend=args.backend,
        )
    except BrokerError as exc:
        print(f"cachebroker demo: error: {exc}", file=sys.stderr)
        return 1
    return 0
