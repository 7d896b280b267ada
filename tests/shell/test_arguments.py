"""Quantities and configuration: every kind of number a user passes is taken or refused clearly."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cachebroker import Broker, InvalidArgument, parse_bytes
from tests.helpers import Recorder, loader

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    "value", [np.int64(1024), np.int32(1024), np.uint16(1024), np.float64(1024.0), np.float32(1024)]
)
def test_numpy_numbers_are_byte_quantities(value: object) -> None:
    assert parse_bytes(value) == 1024


def test_quantity_too_large_for_a_float_is_exact_not_an_overflow() -> None:
    huge = "9" * 400 + "GiB"
    assert parse_bytes(huge) == int("9" * 400) * 2**30
    broker = Broker.from_env({"CACHEBROKER_BUDGET": f"ram={huge}"})
    assert broker.stats_nowait().budget == {"ram": int("9" * 400) * 2**30}


def test_unknown_policy_is_an_invalid_argument() -> None:
    with pytest.raises(InvalidArgument, match="unknown policy 'lfu'"):
        Broker(budget=100, policy="lfu")


def test_infinite_idle_ttl_and_release_timeout_mean_none() -> None:
    broker = Broker(budget=100, idle_ttl=math.inf, release_timeout=math.inf)
    assert (broker._runner.idle_ttl, broker._runner.release_timeout) == (None, None)


@pytest.mark.parametrize("value", [math.nan, -math.inf, 0, -1])
def test_bad_seconds_are_refused(value: float) -> None:
    with pytest.raises(InvalidArgument):
        Broker(budget=100, idle_ttl=value)


async def test_infinite_timeout_waits_as_long_as_it_takes() -> None:
    async with Broker(budget=100) as broker, broker.cache("p", Recorder()) as cache:
        async with cache.acquire("a", load=loader(1), size=10, timeout=math.inf) as lease:
            assert lease.value == 1
        async with cache.acquire("b", load=loader(2), size=np.int64(10)) as lease:
            assert (await broker.stats()).used == {"default": 20}


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"load": 42}, TypeError),
        ({"size": -1}, InvalidArgument),
        ({"size": "lots"}, InvalidArgument),
        ({"size": {"gpu": 10}}, InvalidArgument),
        ({"size": object()}, TypeError),
        ({"timeout": -1}, InvalidArgument),
        ({"timeout": "soon"}, TypeError),
    ],
)
async def test_arguments_are_checked_on_a_hit_too(
    kwargs: dict[str, object], error: type[Exception]
) -> None:
    """Code that works with a warm cache must not start failing after an eviction."""
    async with Broker(budget=100) as broker, broker.cache("p", Recorder()) as cache:
        await (await cache.acquire("a", load=loader(1), size=10)).release()
        arguments: dict[str, object] = {"load": loader(2), "size": 10, **kwargs}
        with pytest.raises(error):
            cache.acquire("a", **arguments)  # type: ignore[call-overload]
        assert (await broker.stats()).hits == 0
