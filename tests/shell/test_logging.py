"""Logging: silent and cheap until the application asks (docs/configuration.md, Logging).

``conftest.py`` configures structlog for the whole run, which hides the default
path (no structlog configuration: the stdlib logger ``"cachebroker"``). Tests
of that path run in a fresh interpreter, or with structlog's defaults restored
for the test (``structlog_unconfigured``).
"""

from __future__ import annotations

import io
import logging
import os
import re
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator, Mapping, MutableMapping
from pathlib import Path
from typing import Any

import pytest
import structlog

import cachebroker
from cachebroker import Broker
from tests.brokers import open_broker

SRC = str(Path(cachebroker.__file__).resolve().parents[1])

# A plain run: a miss, hits, and a release that fails (a warning-level event).
RUN = """
import anyio, cachebroker

async def release(key, value):
    if key == "bad":
        raise RuntimeError("boom")

async def main():
    async with cachebroker.Broker(budget="1MiB") as broker:
        async with broker.cache("p", release) as cache:
            for _ in range(3):
                async with cache.acquire("k", load=lambda: b"x", size=1):
                    pass
            {tail}

anyio.run(main)
"""


def run_fresh(prelude: str = "", tail: str = "pass") -> subprocess.CompletedProcess[str]:
    """Run ``RUN`` in a fresh interpreter that imports this cachebroker; nothing configured."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [SRC, env.get("PYTHONPATH")]))
    script = textwrap.dedent(prelude) + RUN.format(tail=tail)
    return subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    )


async def release(key: Any, value: Any) -> None:
    pass


async def load() -> bytes:
    return b"x"


async def hit_twice(broker: Broker, key: str = "k") -> None:
    """Open cache ``p`` on ``broker`` and acquire ``key`` twice: a miss, then a hit."""
    async with broker.cache("p", release) as cache:
        for _ in range(2):
            async with cache.acquire(key, load=load, size=1):
                pass


@pytest.fixture
def structlog_unconfigured() -> Iterator[None]:
    """structlog as an application that never configured it leaves it (for this test)."""
    previous = structlog.get_config()
    structlog.reset_defaults()
    assert not structlog.is_configured()
    try:
        yield
    finally:
        structlog.configure(**previous)


@pytest.fixture
def cachebroker_level() -> Iterator[logging.Logger]:
    """The stdlib logger "cachebroker", its level restored after the test."""
    logger = logging.getLogger("cachebroker")
    level = logger.level
    try:
        yield logger
    finally:
        logger.setLevel(level)


def test_unconfigured_run_prints_nothing() -> None:
    result = run_fresh()
    assert (result.stdout, result.stderr) == ("", "")


def test_unconfigured_warnings_reach_logging_last_resort() -> None:
    """With no handler at all, logging's last resort shows warnings and errors on stderr."""
    tail = 'async with cache.acquire("bad", load=lambda: b"x", size=1): pass'
    result = run_fresh(tail=tail + '\n            await cache.invalidate("bad")')
    assert result.stdout == ""
    assert "cachebroker.release.failed cache='p' key='bad'" in result.stderr
    assert "cachebroker.hit" not in result.stderr


def test_stdlib_debug_level_shows_events_through_stdlib_handlers() -> None:
    prelude = "import logging\nlogging.basicConfig(level=logging.DEBUG)\n"
    result = run_fresh(prelude)
    assert result.stdout == ""
    lines = [
        line for line in result.stderr.splitlines() if line.startswith(("DEBUG:cache", "INFO"))
    ]
    assert [line.split()[0] for line in lines] == [
        "DEBUG:cachebroker:cachebroker.miss",
        "DEBUG:cachebroker:cachebroker.grant",
        "INFO:cachebroker:cachebroker.load.start",
        "INFO:cachebroker:cachebroker.load.done",
        "DEBUG:cachebroker:cachebroker.hit",
        "DEBUG:cachebroker:cachebroker.hit",
        "INFO:cachebroker:cachebroker.release.requested",
        "INFO:cachebroker:cachebroker.release.freed",
    ]
    assert "DEBUG:cachebroker:cachebroker.hit cache='p' key='k'" in lines


def test_stdlib_warning_level_hides_debug_and_info() -> None:
    prelude = "import logging\nlogging.basicConfig(level=logging.WARNING)\n"
    result = run_fresh(prelude)
    assert (result.stdout, result.stderr) == ("", "")


@pytest.mark.anyio
async def test_stdlib_logger_given_receives_the_events(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    logger = logging.getLogger("app.models")
    caplog.set_level(logging.DEBUG, logger="app.models")
    async with open_broker(kind, budget="1MiB", logger=logger) as broker:
        await hit_twice(broker)
    records = [r for r in caplog.records if r.name == "app.models"]
    events = [(r.levelno, getattr(r, "event", None)) for r in records]
    assert events[:5] == [
        (logging.DEBUG, "cachebroker.miss"),
        (logging.DEBUG, "cachebroker.grant"),
        (logging.INFO, "cachebroker.load.start"),
        (logging.INFO, "cachebroker.load.done"),
        (logging.DEBUG, "cachebroker.hit"),
    ]
    hit = records[4]
    assert hit.getMessage() == "cachebroker.hit cache='p' key='k'"
    assert getattr(hit, "fields", None) == {"cache": "p", "key": "k"}
    assert not [r for r in caplog.records if r.name == "cachebroker"]


@pytest.mark.anyio
async def test_stdlib_logger_adapter_given_receives_the_events(
    kind: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    adapter = logging.LoggerAdapter(logging.getLogger("app.adapted"), {"plugin": "p"})
    caplog.set_level(logging.INFO, logger="app.adapted")
    async with open_broker(kind, budget="1MiB", logger=adapter) as broker:
        await hit_twice(broker)
    messages = [r.getMessage().split()[0] for r in caplog.records if r.name == "app.adapted"]
    assert messages[:2] == ["cachebroker.load.start", "cachebroker.load.done"]
    assert "cachebroker.hit" not in messages


@pytest.mark.anyio
async def test_configured_structlog_is_honoured(
    kind: str, events: list[MutableMapping[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    async with open_broker(kind, budget="1MiB") as broker:
        await hit_twice(broker)
    # (the process's: a daemon in this loop logs its peers and its books, "p@pid", too)
    names = [
        event["event"]
        for event in events
        if "@" not in str(event.get("cache", ""))
        and not event["event"].startswith("cachebroker.peer")
    ]
    assert names[:5] == [
        "cachebroker.miss",
        "cachebroker.grant",
        "cachebroker.load.start",
        "cachebroker.load.done",
        "cachebroker.hit",
    ]
    assert not [r for r in caplog.records if r.name == "cachebroker"]


@pytest.mark.anyio
async def test_configured_structlog_through_stdlib_follows_its_level(
    kind: str,
    cachebroker_level: logging.Logger,
) -> None:
    """structlog rendering through stdlib: the stdlib level, changed at runtime, applies."""
    seen: list[str] = []

    def record(logger: Any, method: str, event: Mapping[str, Any]) -> str:
        seen.append(event["event"])
        raise structlog.DropEvent

    previous = structlog.get_config()
    structlog.configure(
        processors=[structlog.stdlib.filter_by_level, record],
        wrapper_class=structlog.stdlib.BoundLogger,
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=False,
    )
    try:
        cachebroker_level.setLevel(logging.INFO)
        async with open_broker(kind, budget="1MiB") as broker:
            await hit_twice(broker)
            assert "cachebroker.hit" not in seen
            cachebroker_level.setLevel(logging.DEBUG)
            await hit_twice(broker, "other")
    finally:
        structlog.configure(**previous)
    assert seen.count("cachebroker.hit") == 1
    assert "cachebroker.load.done" in seen


@pytest.mark.parametrize("logger", [object(), "cachebroker", print, logging])
def test_bad_logger_is_a_type_error_at_construction(logger: object) -> None:
    with pytest.raises(TypeError, match=r"structlog logger .*logging\.Logger"):
        Broker(budget="1MiB", logger=logger)


@pytest.mark.anyio
@pytest.mark.usefixtures("structlog_unconfigured")
async def test_raising_stdlib_level_at_runtime_shows_hit_events(
    kind: str, caplog: pytest.LogCaptureFixture, cachebroker_level: logging.Logger
) -> None:
    """The hit path re-reads the level at the next step that is not a hit (here a miss)."""

    def events() -> list[str]:
        return [getattr(r, "event", "") for r in caplog.records if r.name == "cachebroker"]

    async with open_broker(kind, budget="1MiB") as broker:
        async with broker.cache("p", release) as cache:
            for _ in range(2):
                async with cache.acquire("k", load=load, size=1):
                    pass
            assert not events()
            cachebroker_level.setLevel(logging.DEBUG)
            async with cache.acquire("other", load=load, size=1):
                pass
            async with cache.acquire("k", load=load, size=1):
                pass
            assert events().count("cachebroker.hit") == 1
            cachebroker_level.setLevel(logging.WARNING)
            async with cache.acquire("third", load=load, size=1):
                pass
            async with cache.acquire("k", load=load, size=1):
                pass
            assert events().count("cachebroker.hit") == 1


@pytest.mark.anyio
@pytest.mark.usefixtures("structlog_unconfigured")
async def test_listeners_get_events_whatever_the_level(
    kind: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    seen: list[str] = []
    async with open_broker(kind, budget="1MiB") as broker:
        broker.add_listener(lambda event, fields: seen.append(event))
        await hit_twice(broker)
    assert not [r for r in caplog.records if r.name == "cachebroker"]
    assert seen[:3] == ["cachebroker.grant", "cachebroker.load.start", "cachebroker.load.done"]


@pytest.mark.anyio
async def test_a_logger_that_raises_loses_its_events_not_the_books(kind: str) -> None:
    """A closed pipe under the application's logger: every acquire is served, the books
    stay exact, and one ``RuntimeWarning`` says the events are being dropped."""

    def closed_pipe(logger: Any, method: str, event: Mapping[str, Any]) -> str:
        raise BrokenPipeError(32, "Broken pipe")

    logger = structlog.wrap_logger(
        structlog.PrintLogger(io.StringIO()),
        processors=[closed_pipe],
        wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        async with open_broker(kind, budget=2, logger=logger) as broker:
            async with broker.cache("p", release) as cache:
                for key in "abc":  # (c evicts a: a release, and its events, in the step)
                    async with cache.acquire(key, load=load, size=1) as lease:
                        assert lease.value == b"x"
                stats = await broker.stats()
                assert stats.used == {"default": 2}, stats
                assert stats.releasing == 0, stats
                entries = await broker.entries()
                assert sorted((e.key, e.state) for e in entries) == [("b", "ready"), ("c", "ready")]
    said = [str(w.message) for w in caught]
    assert len(said) == 1, said
    assert caught[0].category is RuntimeWarning
    assert re.search(r"logger \(BoundLoggerFilteringAtDebug\) raised BrokenPipeError", said[0])
