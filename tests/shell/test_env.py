"""Broker.from_env(): CACHEBROKER_* variables, and clear errors for bad values."""

from __future__ import annotations

import pytest

from cachebroker import Broker, InvalidArgument

pytestmark = pytest.mark.anyio


async def test_single_budget_and_ttl_from_env() -> None:
    broker = Broker.from_env({"CACHEBROKER_BUDGET": "24GiB", "CACHEBROKER_IDLE_TTL": "300"})
    async with broker:
        stats = await broker.stats()
    assert stats.budget == {"default": 24 * 2**30}
    assert broker._runner.idle_ttl == 300


async def test_space_budgets_from_env() -> None:
    broker = Broker.from_env({"CACHEBROKER_BUDGET": "ram=16GiB, cuda:0=24GiB"})
    async with broker:
        stats = await broker.stats()
    assert stats.budget == {"ram": 16 * 2**30, "cuda:0": 24 * 2**30}


def test_idle_ttl_zero_turns_idle_eviction_off() -> None:
    broker = Broker.from_env({"CACHEBROKER_BUDGET": "1GiB", "CACHEBROKER_IDLE_TTL": "0"})
    assert broker._runner.idle_ttl is None


def test_keyword_arguments_override_environment() -> None:
    broker = Broker.from_env({"CACHEBROKER_BUDGET": "garbage"}, budget="1GiB")
    assert broker._runner.budget == {"default": 2**30}


def test_policy_from_env() -> None:
    env = {"CACHEBROKER_BUDGET": "1GiB", "CACHEBROKER_POLICY": "LRU"}
    assert Broker.from_env(env)._core.policy.__class__.__name__ == "LRU"


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({}, "CACHEBROKER_BUDGET is not set"),
        ({"CACHEBROKER_BUDGET": "lots"}, "CACHEBROKER_BUDGET='lots' is invalid"),
        ({"CACHEBROKER_BUDGET": "ram=1GiB,gpu"}, r"CACHEBROKER_BUDGET='ram=1GiB,gpu' is invalid"),
        ({"CACHEBROKER_BUDGET": "ram=1GiB,ram=2GiB"}, "given twice"),
        ({"CACHEBROKER_BUDGET": "ram=-1"}, "CACHEBROKER_BUDGET='ram=-1' is invalid"),
        (
            {"CACHEBROKER_BUDGET": "1GiB", "CACHEBROKER_IDLE_TTL": "soon"},
            "CACHEBROKER_IDLE_TTL='soon' is invalid",
        ),
        (
            {"CACHEBROKER_BUDGET": "1GiB", "CACHEBROKER_IDLE_TTL": "-3"},
            "CACHEBROKER_IDLE_TTL='-3' is invalid",
        ),
        (
            {"CACHEBROKER_BUDGET": "1GiB", "CACHEBROKER_POLICY": "random"},
            "CACHEBROKER_POLICY='random' is invalid: unknown policy",
        ),
    ],
)
def test_bad_environment_values_name_variable_and_value(env: dict[str, str], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        Broker.from_env(env)


def test_from_env_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHEBROKER_BUDGET", "2MiB")
    assert Broker.from_env()._runner.budget == {"default": 2 * 2**20}


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"idle_ttl": 0}, ValueError, "idle_ttl must be a positive"),
        ({"idle_ttl": 0.0}, ValueError, r"give idle_ttl=0 to broker\.cache\(\.\.\.\) or acquire"),
        ({"idle_ttl": "5"}, TypeError, "idle_ttl must be a number"),
        ({"release_timeout": -1}, ValueError, "release_timeout must be a positive"),
        ({"policy": "mru"}, ValueError, "unknown policy 'mru'"),
        ({"policy": 3}, TypeError, "policy must be"),
        ({"clock": 5}, TypeError, "clock must be a callable"),
    ],
)
def test_bad_constructor_arguments_are_clear(
    kwargs: dict[str, object], error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        Broker(budget=100, **kwargs)  # type: ignore[arg-type]
