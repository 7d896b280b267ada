"""``cachebroker ps``: what the shared broker holds, by process."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import anyio

from .._units import format_bytes
from . import _protocol as wire
from ._sockets import connect

__all__ = ["add_parser", "fetch", "render", "run"]


def add_parser(commands: Any, name: str, help: str) -> None:
    """Add the ``ps`` command to ``commands`` (argparse sub-parsers)."""
    parser = commands.add_parser(name, help=help)
    parser.add_argument(
        "--socket",
        default=None,
        help=f"the broker's socket (default: $CACHEBROKER_ADDRESS, else {wire.default_address()})",
    )
    parser.add_argument("--json", action="store_true", help="print the listing as JSON")


async def fetch(address: str) -> dict[str, Any]:
    """The daemon's listing: ``daemon`` (pid, address, used, budget), ``processes``, ``entries``."""
    with anyio.fail_after(10):
        async with await connect(address) as stream:
            reader, welcome = await wire.greet(stream, observer=True)
            if welcome["op"] != "welcome":
                raise wire.ProtocolError(str(welcome.get("message", welcome)))
            await wire.send(stream, {"op": "ps"})
            while True:
                reply = await wire.receive(reader)
                if reply["op"] == "ps":
                    return reply


def render(listing: dict[str, Any]) -> str:
    """The listing as a table."""
    daemon = listing["daemon"]
    lines = [
        f"broker pid {daemon['pid']} at {daemon['address']}; "
        f"{len(listing['processes'])} process(es) connected",
    ]
    for name, budget in daemon["budget"].items():
        used = daemon["used"].get(name, 0)
        lines.append(f"  {name}: {format_bytes(used)} used of {format_bytes(budget)}")
    rows = [
        (
            "PID",
            "CACHE",
            "KEY",
            "SPACE",
            "BYTES",
            "STATE",
            "LEASES",
            "IDLE",
            "WAITING",
            "PRIORITY",
            "LOADS",
            "WHERE",
        )
    ]
    for entry in sorted(listing["entries"], key=lambda e: (e["pid"], e["cache"], e["key"])):
        charge = entry["charge"] or {"-": 0}
        idle = entry["idle_seconds"]
        for i, (space, amount) in enumerate(sorted(charge.items())):
            first = i == 0
            rows.append(
                (
                    str(entry["pid"]) if first else "",
                    entry["cache"] if first else "",
                    entry["key"] if first else "",
                    space,
                    format_bytes(amount),
                    (entry["state"] + (" pinned" if entry.get("pinned") else "")) if first else "",
                    str(entry["leases"]) if first else "",
                    ("-" if idle is None else f"{idle:.1f}s") if first else "",
                    # (not listed by a daemon of an earlier release: "-")
                    _count(entry.get("waiting")) if first else "",
                    _count(entry.get("priority")) if first else "",
                    _count(entry.get("loads")) if first else "",
                    _where(entry) if first else "",
                )
            )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines.append("")
    lines.extend(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )
    if len(rows) == 1:
        lines.append("(nothing loaded)")
    return "\n".join(lines)


def _where(entry: dict[str, Any]) -> str:
    """Tiers and placement in a word: ``home gpu`` (demoted), ``to ram`` (a move under
    way), ``of cuda:0|cuda:1`` (placed among those); ``-`` for none."""
    words = []
    if entry.get("moving_to"):
        words.append("to " + "+".join(sorted(entry["moving_to"])))
    elif entry.get("home"):
        words.append("home " + "+".join(sorted(entry["home"])))
    if entry.get("places"):
        words.append("of " + "|".join(entry["places"]))
    return " ".join(words) or "-"


def _count(value: object) -> str:
    return "-" if value is None else str(value)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run ``cachebroker ps``; return the exit status."""
    address = wire.resolve_address(args.socket)
    try:
        listing = anyio.run(fetch, address)
    except (OSError, TimeoutError, anyio.EndOfStream, anyio.IncompleteRead) as exc:
        print(
            f"cachebroker ps: no broker answers at {address} ({exc}); "
            "start one with 'cachebroker serve'",
            file=sys.stderr,
        )
        return 1
    except wire.ProtocolError as exc:
        print(f"cachebroker ps: the broker at {address} refused: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(listing, indent=2, sort_keys=True))
    else:
        print(render(listing))
    return 0
