"""Real processes for the tests of ``cachebroker serve``: clients, daemons, ``cachebroker ps``.

``Procs`` holds the subprocesses of one test in a short private directory
(socket paths are short): ``cachebroker serve`` (``daemon``), clients running
``process_client.py`` (``client``, ``steps``) and ``cachebroker ps``. Each
writes its stdout and stderr to files the test reads. ``serving`` runs a
daemon in the test's own event loop instead, whose books the test can read.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import anyio
import pytest

from cachebroker._remote._daemon import Daemon, DaemonBroker

SRC = str(Path(__file__).resolve().parents[2] / "src")
CLIENT = str(Path(__file__).with_name("process_client.py"))
ENV = {**os.environ, "PYTHONPATH": SRC}

#: The clients' event loops, in turn.
CLIENT_BACKENDS = ("asyncio", "uvloop", "trio")

#: A test whose daemon is a subprocess needs its own loop only to wait: one backend does.
one_backend = pytest.mark.parametrize(
    "anyio_backend", [pytest.param(("asyncio", {}), id="asyncio")]
)

Line = dict[str, Any]


class Proc:
    """A subprocess whose stdout and stderr go to files the test reads."""

    def __init__(self, name: str, argv: list[str], directory: Path) -> None:
        self.name = name
        self.out = directory / f"{name}.out"
        self.err = directory / f"{name}.err"
        with self.out.open("wb") as out, self.err.open("wb") as err:
            self.popen = subprocess.Popen(argv, stdout=out, stderr=err, env=ENV)
        self.pid = self.popen.pid

    def lines(self) -> list[Line]:
        """The JSON lines it printed so far (a line being written is left for later)."""
        text = self.out.read_text()
        return [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]

    def events(self, event: str, **fields: Any) -> list[Line]:
        return [
            line
            for line in self.lines()
            if line["event"] == event and all(line.get(k) == v for k, v in fields.items())
        ]

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    async def wait_for(self, event: str, **fields: Any) -> Line:
        """Its first line with ``event`` (and ``fields``); fails if it exits first."""
        while True:
            exited = self.popen.poll() is not None
            found = self.events(event, **fields)
            if found:
                return found[0]
            if exited:
                raise AssertionError(
                    f"{self.name} exited ({self.popen.returncode}) before {event} {fields}:\n"
                    f"{self.out.read_text()}\n{self.stderr()[-3000:]}"
                )
            await anyio.sleep(0.005)

    async def wait_in_stderr(self, text: str) -> None:
        while text not in self.stderr():
            if self.popen.poll() is not None:
                raise AssertionError(f"{self.name} exited before {text!r}:\n{self.stderr()}")
            await anyio.sleep(0.005)

    async def exit(self) -> int:
        """Wait for it to exit; its status."""
        while (status := self.popen.poll()) is None:
            await anyio.sleep(0.005)
        return status

    def kill(self, signum: int = signal.SIGKILL) -> None:
        self.popen.send_signal(signum)

    def rss(self) -> int | None:
        """Its resident memory in bytes (``VmRSS``); ``None`` once it exited."""
        with contextlib.suppress(FileNotFoundError), open(f"/proc/{self.pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return None  # (a zombie has no VmRSS)


class Procs:
    """The subprocesses of one test, in a short private directory (socket paths are short)."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.signals = directory / "signals"
        self.signals.mkdir()
        self.socket = str(directory / "cb.sock")
        self.procs: list[Proc] = []
        self._backends = iter(CLIENT_BACKENDS * 100)

    def spawn(self, name: str, argv: list[str]) -> Proc:
        if any(proc.name == name for proc in self.procs):
            name = f"{name}.{len(self.procs)}"  # (its own output files)
        proc = Proc(name, argv, self.dir)
        self.procs.append(proc)
        return proc

    async def daemon(self, budget: str, *options: str, name: str = "daemon") -> Proc:
        """``cachebroker serve`` on ``self.socket``, once it listens."""
        argv = [sys.executable, "-m", "cachebroker", "serve", "--socket", self.socket]
        proc = self.spawn(name, [*argv, "--budget", budget, *options])
        await proc.wait_in_stderr("cachebroker serve: listening on")
        return proc

    def client(self, name: str, config: Mapping[str, Any], backend: str | None = None) -> Proc:
        """A ``process_client.py`` run of ``config``, on the next backend in turn."""
        backend = backend or next(self._backends)
        argv = [sys.executable, CLIENT, backend, self.socket, str(self.signals), json.dumps(config)]
        return self.spawn(f"{name}-{backend}", argv)

    def steps(
        self, name: str, *steps: Mapping[str, Any], backend: str | None = None, **config: Any
    ) -> Proc:
        return self.client(name, {"mode": "steps", "steps": steps, **config}, backend)

    def signal(self, name: str) -> None:
        """Create the file a client's ``wait`` step waits for."""
        (self.signals / name).touch()

    async def ps(self, *args: str) -> tuple[int, str, str]:
        """``cachebroker ps --socket SOCKET ARGS``: its status, stdout and stderr."""
        argv = [sys.executable, "-m", "cachebroker", "ps", "--socket", self.socket, *args]
        done = await anyio.run_process(argv, env=ENV, check=False)
        return done.returncode, done.stdout.decode(), done.stderr.decode()

    async def listing(self) -> Any:
        """``cachebroker ps --json``, parsed."""
        status, out, err = await self.ps("--json")
        assert status == 0, err
        return json.loads(out)

    def close(self) -> None:
        for proc in self.procs:
            if proc.popen.poll() is None:
                proc.popen.kill()
            proc.popen.wait(timeout=30)


@contextlib.asynccontextmanager
async def serving(address: str, budget: Any, **options: Any) -> AsyncIterator[Daemon]:
    """A daemon in this test's event loop, whose books the test can read.

    Its release timeout, which its clients adopt, is short: a test that fails
    with a lease held closes its caches in seconds (a cache waits that long for
    its leases) instead of the default 30.
    """
    options.setdefault("release_timeout", 3)
    uid = options.pop("uid", None)
    daemon = Daemon(DaemonBroker(budget, **options), address, uid=uid)
    async with anyio.create_task_group() as tg:
        await tg.start(daemon.run)
        yield daemon
        tg.cancel_scope.cancel()


def check_books(daemon: Daemon) -> None:
    """The daemon's books add up, and no space holds more than its budget."""
    core = daemon.runner.core
    core.check()
    for space in core.spaces.values():
        assert space.used <= space.budget, (space.name, space.used, space.budget)


def frame(body: bytes) -> bytes:
    return len(body).to_bytes(4, "big") + body
