"""Fixtures of the tests of connected brokers: socket paths and real processes."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import socket_path
from tests.remote.processes import Procs


@pytest.fixture
def address() -> Iterator[str]:
    """A Unix socket path in a fresh directory under ``/tmp`` (socket paths are short)."""
    with socket_path() as path:
        yield path


@pytest.fixture
def procs() -> Iterator[Procs]:
    """The subprocesses of one test, killed when it ends (their output shown if it failed)."""
    directory = Path(tempfile.mkdtemp(prefix="cb-", dir="/tmp"))
    found = Procs(directory)
    try:
        yield found
    finally:
        found.close()
        for proc in found.procs:  # (shown by pytest when the test failed)
            print(f"--- {proc.name} (status {proc.popen.returncode}):\n{proc.stderr()[-2000:]}")
        shutil.rmtree(directory, ignore_errors=True)
