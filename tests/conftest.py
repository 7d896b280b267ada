"""Shared fixtures: every async test runs on asyncio, asyncio+uvloop and trio."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, MutableMapping
from typing import Any

import pytest
import structlog
import structlog.testing
from hypothesis import HealthCheck, settings

# Hypothesis profiles, chosen with HYPOTHESIS_PROFILE (tests/test_hypothesis_profiles.py).
# "ci", the default, is deterministic: each test draws its examples from a seed
# derived from the test itself, so every run covers the same cases and a
# change of coverage is a change of code, never of luck. It reads and writes
# no example database (.hypothesis/): what a run finds does not steer the next.
# "nightly" explores: random, many more examples, failures saved to the
# database and printed as a @reproduce_failure blob. "dev" is a quick random run.
settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "nightly",
    max_examples=1000,
    deadline=None,
    derandomize=False,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=30, deadline=None)
# "mutants": the mutation run's (nox -s mutants), a few deterministic examples per
# property, so that a surviving mutant costs seconds; the example tests do the killing.
settings.register_profile(
    "mutants",
    max_examples=10,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

BACKENDS = [
    pytest.param(("asyncio", {}), id="asyncio"),
    pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    pytest.param(("trio", {}), id="trio"),
]
# CACHEBROKER_TEST_BACKENDS=trio (or a comma list) narrows the run, e.g. for nox.
_chosen = os.environ.get("CACHEBROKER_TEST_BACKENDS")
if _chosen:
    BACKENDS = [p for p in BACKENDS if p.id in _chosen.split(",")]


@pytest.fixture(params=BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    backend: tuple[str, dict[str, Any]] = request.param
    if backend[1].get("use_uvloop"):
        pytest.importorskip("uvloop")
    return backend


@pytest.fixture(params=["local", "connected"])
def kind(request: pytest.FixtureRequest) -> str:
    """The kind of broker ``open_broker`` (tests/brokers.py) opens: in-process or connected."""
    kind: str = request.param
    return kind


@pytest.fixture
def events() -> Iterator[list[MutableMapping[str, Any]]]:
    """Capture every structlog event the broker emits, debug ones included."""
    previous = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    try:
        with structlog.testing.capture_logs() as logs:
            yield logs
    finally:
        structlog.configure(**previous)
