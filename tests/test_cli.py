"""The ``cachebroker`` command as a process: exit statuses and where messages go."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import cachebroker

# The child imports the package under test, wherever this process found it.
SOURCE = str(Path(cachebroker.__file__).resolve().parent.parent)


def child_env() -> dict[str, str]:
    """This environment, with the package under test first on the child's path."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([SOURCE, os.environ.get("PYTHONPATH", "")])}


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = child_env()
    return subprocess.run(
        [sys.executable, "-m", "cachebroker", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )


def test_no_command_prints_the_usage_to_stderr_and_exits_2() -> None:
    result = run_cli()
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith("usage: cachebroker")
    assert "name a command: demo, serve, ps, simulate" in result.stderr


def test_help_exits_0_and_lists_the_commands() -> None:
    result = run_cli("--help")
    assert result.returncode == 0
    assert "demo" in result.stdout and "simulate" in result.stdout


def test_version_names_the_package_and_its_version() -> None:
    result = run_cli("--version")
    assert result.returncode == 0
    assert result.stdout == f"cachebroker {cachebroker.__version__}\n"


def test_a_reader_gone_before_the_output_ends_the_command_quietly() -> None:
    """``cachebroker demo | head -1``: no traceback, the status of a tool SIGPIPE stopped."""
    env = child_env()
    reader, writer = os.pipe()
    os.close(reader)  # (gone before the first write: every write finds the pipe closed)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "cachebroker", "demo"],
            stdout=writer,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            timeout=60,
            check=False,
        )
    finally:
        os.close(writer)
    assert result.returncode == 141, result.stderr
    assert "Traceback" not in result.stderr, result.stderr


def test_serve_with_its_stderr_closed_serves_all_the_same(tmp_path: Path) -> None:
    """Nobody reads the daemon's stderr (its reader gone before the banner): it serves,
    answers ``ps`` and stops cleanly on SIGTERM."""
    env = child_env()
    socket = str(tmp_path / "s.sock")
    reader, writer = os.pipe()
    os.close(reader)
    try:
        daemon = subprocess.Popen(
            [sys.executable, "-m", "cachebroker", "serve", "--budget", "1MiB", "--socket", socket],
            stdout=subprocess.DEVNULL,
            stderr=writer,
            env=env,
        )
    finally:
        os.close(writer)
    try:
        listing = None
        for _ in range(600):  # (at most a minute, by tenths)
            assert daemon.poll() is None, f"the daemon exited with status {daemon.returncode}"
            if os.path.exists(socket):
                listing = run_cli("ps", "--socket", socket)
                if listing.returncode == 0:
                    break
            time.sleep(0.1)
        assert listing is not None and listing.returncode == 0, listing
        assert listing.stdout.startswith("broker pid "), listing.stdout
    finally:
        daemon.terminate()
        status = daemon.wait(timeout=60)
    assert status == 0
