"""Command line: ``cachebroker simulate`` and ``cachebroker demo`` (also via ``python -m``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import anyio


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="cachebroker", description="An asyncio-native cache broker for models in memory."
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = commands.add_parser(
        "demo", help="two plugins sharing a small RAM budget, with real buffers"
    )
    demo.add_argument("--budget", default="96MiB", help="RAM budget (default: 96MiB)")
    demo.add_argument("--sessions", type=int, default=24, help="number of sessions (default: 24)")
    demo.add_argument("--seed", type=int, default=7, help="random seed for the session order")
    demo.add_argument(
        "--backend", choices=["asyncio", "trio"], default="asyncio", help="event loop to run on"
    )
    from ._simulate_cli import add_parser

    add_parser(commands)
    args = parser.parse_args(argv)
    if args.command is None:  # usage on stderr, exit status 2, naming the commands
        parser.error(f"name a command: {', '.join(commands.choices)} (see cachebroker --help)")
    if args.command == "simulate":
        from ._simulate_cli import run

        return run(args, commands.choices["simulate"])
    from ._demo import run_demo
    from ._errors import BrokerError
    from ._sizes import parse_bytes

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


if __name__ == "__main__":
    sys.exit(main())
