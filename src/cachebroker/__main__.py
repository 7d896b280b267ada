"""Command line dispatch: ``cachebroker COMMAND ...`` (also ``python -m cachebroker``).

Each command lives in its own module with an ``add_parser(commands, name, help)``
and a ``run(args, parser) -> int``; only the command being run is imported, so
``cachebroker demo`` never loads the simulator (nor ``scipy``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
from collections.abc import Sequence

#: Command name -> (module that implements it, one-line help).
COMMANDS = {
    "demo": ("cachebroker._demo", "two plugins sharing a small RAM budget, with real buffers"),
    "serve": (
        "cachebroker._remote._serve",
        "serve one broker to every process of this user on the machine",
    ),
    "ps": ("cachebroker._remote._ps", "list what the shared broker (cachebroker serve) holds"),
    "simulate": (
        "cachebroker.simulator._cli",
        "replay a workload under each policy and budget, beside the offline optimum",
    ),
}


#: The exit status of a command whose reader went away (``| head``): a shell's for a
#: tool that SIGPIPE stopped (128 + 13).
BROKEN_PIPE = 141


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except BaseException as exc:
        if not _broken_pipe(exc):
            raise
        # Quiet, as a pipe's writer is; and nothing is written to the closed pipe at exit
        # (where stdout is a file at all: it may be closed, or a stream with no descriptor).
        with contextlib.suppress(AttributeError, OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return BROKEN_PIPE


def _broken_pipe(exc: BaseException) -> bool:
    """Whether ``exc`` (or every exception of its group) is a write to a closed pipe."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_broken_pipe(inner) for inner in exc.exceptions)
    return isinstance(exc, BrokenPipeError)


def _main(argv: Sequence[str] | None) -> int:
    from cachebroker import __version__

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="cachebroker", description="An asyncio-native cache broker for models in memory."
    )
    parser.add_argument("--version", action="version", version=f"cachebroker {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    # The top-level parser has no options but --help and --version: the first other
    # word is the command.
    chosen = next((word for word in argv if not word.startswith("-")), None)
    for name, (module, help) in COMMANDS.items():
        if name == chosen:
            importlib.import_module(module).add_parser(commands, name, help)
        else:
            commands.add_parser(name, help=help)
    args = parser.parse_args(argv)
    if args.command is None:  # usage on stderr, exit status 2, naming the commands
        parser.error(f"name a command: {', '.join(commands.choices)} (see cachebroker --help)")
    command = importlib.import_module(COMMANDS[args.command][0])
    status: int = command.run(args, commands.choices[args.command])
    return status


if __name__ == "__main__":
    sys.exit(main())
