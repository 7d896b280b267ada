"""The known-shares reference of ``benchmarks/policies.py``: ``cost`` told each key's share.

It prices what learning the shares costs ``cost``, so it must rank by the
shares it is given and never by what it sees requested: it overrides the two
places ``CostAware`` reads its estimates, and these tests fail if ``CostAware``
comes to read them anywhere else.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from cachebroker import CostAware
from cachebroker.simulator import Request

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


def benchmark() -> ModuleType:
    """``benchmarks/policies.py`` as a module (it imports ``_families`` beside it)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location(
            "policies_benchmark", BENCHMARKS / "policies.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module


class Item:
    """An entry as a policy sees it: 10 bytes of ``m``, reloaded in a second."""

    def __init__(self, key: str, tick: int) -> None:
        self.key = key
        self.cache = "c"
        self.charge = {"m": 10}
        self.cost = 1.0
        self.requests = 1
        self.last_request = tick
        self.idle_seq = tick

    @property
    def idle(self) -> bool:
        return True


def after_many_requests_of_cold(policy: Any) -> list[str]:
    """hot is requested once, then cold 300 times; the victim of a 10-byte shortfall."""
    hot, cold = Item("hot", 1), Item("cold", 2)
    for item in (hot, cold):
        policy.touch(item)
        policy.admit(item)
        policy.idle(item)
    for tick in range(3, 303):
        cold.last_request = tick
        cold.requests += 1
        policy.touch(cold)
    return [str(entry.key) for entry in policy.victims({"m": 10})]


@pytest.mark.parametrize("candidates", [1, 24])
def test_known_shares_rank_by_the_shares_given_not_by_the_requests_seen(candidates: int) -> None:
    """Both entries are candidates (24: valued by ``_log_value``), or only the
    lowest-ranked one is (1: ranked by ``_rank``)."""
    known = benchmark().KnownShares({("c", "hot"): 0.9, ("c", "cold"): 0.1})
    known.candidates = candidates
    assert after_many_requests_of_cold(known) == ["cold"]
    learning = CostAware(candidates=candidates)
    assert after_many_requests_of_cold(learning) == ["hot"]  # what learning would say


def test_shares_are_each_cache_and_keys_fraction_of_the_requests() -> None:
    requests = [
        Request(time=float(i), key=key, size={"m": 1}, load_seconds=1.0, cache=cache)
        for i, (cache, key) in enumerate([("a", "x"), ("a", "x"), ("b", "x"), ("a", "y")])
    ]
    assert benchmark().shares(requests) == {("a", "x"): 0.5, ("b", "x"): 0.25, ("a", "y"): 0.25}
