"""``cachebroker serve``: one broker for every process of this user on the machine."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import anyio
import structlog

from .._errors import BrokerError
from .._shell._config import _parse_env_tiers, _parse_env_ttl, budget_value
from .._units import format_bytes
from ._daemon import GRACE, HELLO_TIMEOUT, MAX_PENDING, Daemon, DaemonBroker
from ._protocol import default_address

T = TypeVar("T")

__all__ = ["add_parser", "run"]

_LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40}


def add_parser(commands: Any, name: str, help: str) -> None:
    """Add the ``serve`` command to ``commands`` (argparse sub-parsers)."""
    parser = commands.add_parser(
        name,
        help=help,
        description=(
            "Serve one broker to every process of this user that connects "
            "(Broker.connect(), or CACHEBROKER_ADDRESS with Broker.from_env()). "
            "Linux and macOS; stop it with Ctrl-C or SIGTERM."
        ),
    )
    parser.add_argument(
        "--budget",
        default=os.environ.get("CACHEBROKER_BUDGET"),
        help="bytes per space: '24GiB', 'cuda:0=70GiB,ram=64GiB', or probed: "
        "'ram=system-4GiB,cuda:0=nvidia:0-1GiB' (default: $CACHEBROKER_BUDGET)",
    )
    parser.add_argument(
        "--socket",
        default=None,
        help=f"socket path (default: $CACHEBROKER_ADDRESS, else {default_address()})",
    )
    parser.add_argument("--policy", default="lru", help="eviction policy (default: lru)")
    parser.add_argument(
        "--tiers",
        default=os.environ.get("CACHEBROKER_TIERS"),
        help="each space's lower tier, 'cuda:0=ram' or 'cuda:0=ram,ram=disk': an idle value "
        "is moved down instead of released, by processes whose releaser has a move() "
        "(default: $CACHEBROKER_TIERS)",
    )
    parser.add_argument(
        "--idle-ttl",
        default=None,
        help="seconds an entry may sit unleased before its process is asked to release it",
    )
    parser.add_argument(
        "--release-timeout",
        default="30",
        help="seconds a process has to release an entry before it is quarantined (default: 30)",
    )
    parser.add_argument(
        "--grace",
        default=f"{GRACE:g}",
        help="after a restart, seconds to wait at most for the processes of the daemon before "
        f"to register what they hold, before granting anything (default: {GRACE:g})",
    )
    parser.add_argument(
        "--max-pending",
        default=str(MAX_PENDING),
        help="connections that may await their hello at once; one more closes the oldest "
        f"(default: {MAX_PENDING})",
    )
    parser.add_argument(
        "--hello-timeout",
        default=f"{HELLO_TIMEOUT:g}",
        help=f"seconds a new connection has to say hello (default: {HELLO_TIMEOUT:g})",
    )
    parser.add_argument(
        "--log-level", choices=sorted(_LEVELS), default="info", help="events shown on stderr"
    )


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run ``cachebroker serve`` until interrupted; return the exit status."""
    if args.budget is None:
        parser.error("give --budget (or set CACHEBROKER_BUDGET), e.g. --budget 'cuda:0=20GiB'")
    try:
        # The grammar of Broker(budget=...) and CACHEBROKER_BUDGET, probed spaces included.
        budget = budget_value(args.budget, what="--budget")
        idle_ttl = None
        if args.idle_ttl is not None:
            idle_ttl = _option("--idle-ttl", args.idle_ttl, _parse_env_ttl)
        tiers = _parse_env_tiers(args.tiers) if args.tiers and args.tiers.strip() else None
        release_timeout = _option(
            "--release-timeout", args.release_timeout, partial(_parse_env_ttl, zero="waits forever")
        )
        grace = _seconds(args.grace, "--grace", zero=True)
        max_pending = _count(args.max_pending, "--max-pending")
        hello_timeout = _seconds(args.hello_timeout, "--hello-timeout")
    except (ImportError, TypeError, ValueError) as exc:
        parser.error(str(exc))
    address = args.socket or os.environ.get("CACHEBROKER_ADDRESS") or default_address()
    logger = structlog.wrap_logger(
        structlog.PrintLogger(sys.stderr),
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.dev.ConsoleRenderer(colors=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[args.log_level]),
    )
    try:
        broker = DaemonBroker(
            budget,
            policy=args.policy,
            tiers=tiers,
            idle_ttl=idle_ttl,
            release_timeout=release_timeout,
            logger=logger,
        )
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    daemon = Daemon(
        broker, address, grace=grace, max_pending=max_pending, hello_timeout=hello_timeout
    )
    try:
        anyio.run(_serve, daemon)
    except KeyboardInterrupt:
        pass
    except BaseException as exc:
        error = _broker_error(exc)
        if error is None:
            raise
        print(f"cachebroker serve: error: {error}", file=sys.stderr)
        return 1
    return 0


def _option(what: str, raw: str, parse: Callable[[str], T]) -> T:
    """``parse(raw)``, its error naming the option it came from."""
    try:
        return parse(raw)
    except ValueError as exc:
        raise ValueError(f"{what} {raw!r}: {exc}") from None


def _count(raw: str, what: str) -> int:
    try:
        count = int(raw)
    except ValueError:
        raise ValueError(f"{what} must be a whole number, got {raw!r}") from None
    if count < 1:
        raise ValueError(f"{what} must be at least 1, got {raw!r}")
    return count


def _seconds(raw: str, what: str, *, zero: bool = False) -> float:
    """``raw`` as a finite number of seconds (above 0, or from 0 with ``zero``)."""
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"{what} must be a number of seconds, got {raw!r}") from None
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not zero):
        kind = "non-negative" if zero else "positive"
        raise ValueError(f"{what} must be a {kind} number of seconds, got {raw!r}")
    return seconds


def _broker_error(exc: BaseException) -> BrokerError | None:
    """The ``BrokerError`` that stopped the daemon, out of the task groups that wrap it."""
    if isinstance(exc, BrokerError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _broker_error(inner)
            if found is not None:
                return found
    return None


async def _serve(daemon: Daemon) -> None:
    async with anyio.create_task_group() as tg:
        await tg.start(daemon.run)
        budget = ", ".join(
            f"{name}={format_bytes(space.budget)}"
            for name, space in daemon.runner.core.spaces.items()
        )
        pid = os.getpid()
        with contextlib.suppress(OSError):  # (no stderr to say it on: it serves all the same)
            print(
                f"cachebroker serve: listening on {daemon.address} (pid {pid}, budget {budget})",
                file=sys.stderr,
                flush=True,
            )
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                break
        tg.cancel_scope.cancel()
