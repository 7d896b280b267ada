"""The torch tiers recipe (docs/examples/torch_tiers.py): real modules moved between tiers.

Skipped without torch. On a machine without CUDA the recipe's upper tier is
the CPU standing in for the GPU (see the recipe), so the devices checked here
are the same on both tiers there; on a GPU they are ``cuda:0`` and ``cpu``.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import pytest

from cachebroker import Broker

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.anyio

RECIPE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "torch_tiers.py"


def load_recipe() -> ModuleType:
    spec = importlib.util.spec_from_file_location("example_torch_tiers", RECIPE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


recipe = load_recipe()
TOP: str = recipe.TOP
WIDTH = 512  # 2.1 MiB of float32 weights
SIZE: int = recipe.estimate(WIDTH)


def device_of(model: Any) -> Any:
    return next(model.parameters()).device


def on(space: str) -> Any:
    return torch.device(recipe.DEVICES[space])


async def test_the_recipe_loads_each_model_once_and_moves_it_between_tiers() -> None:
    plugin = await recipe.main()
    actions = [(action, key) for action, key, _ in plugin.log]
    assert sorted(key for action, key in actions if action == "load") == sorted(recipe.WIDTHS)
    moves = [to for action, _, to in plugin.log if action == "move"]
    assert moves.count("ram") >= 3 and moves.count(TOP) >= 3, plugin.log
    assert sorted(key for action, key in actions if action == "release") == sorted(recipe.WIDTHS)


async def test_a_demoted_module_is_on_the_lower_device_and_comes_back_with_its_weights() -> None:
    plugin = recipe.TieredTorch()
    budget = {TOP: 3 * 2**20, "ram": 8 * 2**20}  # one 2.1 MiB model at a time on the GPU
    async with Broker(budget, tiers={TOP: "ram"}) as broker:
        async with broker.cache("torch", plugin) as cache:

            def acquire(name: str) -> Any:
                return cache.acquire(
                    name,
                    load=functools.partial(plugin.load, name, WIDTH),
                    size={TOP: SIZE},
                    measure=plugin.measure,
                    cost=recipe.LOAD_SECONDS,
                )

            probe = torch.ones(1, WIDTH)
            async with acquire("a") as lease:
                a = lease.value
                assert device_of(a) == on(TOP)
                with torch.no_grad():
                    before = a(probe.to(on(TOP))).cpu()
            async with acquire("b") as lease:
                b = lease.value
                # "a" went down to make room for "b": on RAM's device, charged there.
                assert device_of(a) == on("ram") and plugin.tier[a] == "ram"
                assert device_of(b) == on(TOP)
                charges = {e.key: (e.state, dict(e.charge)) for e in await broker.entries()}
                assert charges == {"a": ("demoted", {"ram": SIZE}), "b": ("ready", {TOP: SIZE})}
            async with acquire("a") as lease:
                assert lease.value is a and device_of(a) == on(TOP)  # promoted, not reloaded
                with torch.no_grad():
                    after = a(probe.to(on(TOP))).cpu()
                assert torch.equal(before, after)
                assert device_of(b) == on("ram")
                charges = {e.key: (e.state, dict(e.charge)) for e in await broker.entries()}
                assert charges == {"a": ("ready", {TOP: SIZE}), "b": ("demoted", {"ram": SIZE})}
            stats = await broker.stats()
            assert dict(stats.used) == {TOP: SIZE, "ram": SIZE}
            assert sum(recipe.torch_bytes(a).values()) == SIZE
    assert plugin.log[:5] == [
        ("load", "a", TOP),
        ("move", "a", "ram"),  # (b's room, before its load)
        ("load", "b", TOP),
        ("move", "b", "ram"),
        ("move", "a", TOP),
    ]
    assert sorted(plugin.log[5:]) == [("release", "a", TOP), ("release", "b", "ram")]
    # Released: the weights are gone (to the meta device), from either tier.
    assert device_of(a).type == "meta" and device_of(b).type == "meta"
    assert recipe.torch_bytes(a) == {} and recipe.torch_bytes(b) == {}


async def test_concurrent_requests_get_their_own_weights_after_any_number_of_moves() -> None:
    plugin = recipe.TieredTorch()
    names = ["a", "b", "c", "d"]
    budget = {TOP: 5 * 2**20, "ram": 5 * 2**20}  # two on the GPU, two in RAM
    outputs: dict[str, list[Any]] = {name: [] for name in names}
    async with Broker(budget, tiers={TOP: "ram"}) as broker:
        async with broker.cache("torch", plugin) as cache:

            async def infer(name: str) -> None:
                async with cache.acquire(
                    name,
                    load=functools.partial(plugin.load, name, WIDTH),
                    size={TOP: SIZE},
                    measure=plugin.measure,
                    cost=recipe.LOAD_SECONDS,
                ) as lease:
                    assert device_of(lease.value) == on(TOP)
                    with torch.no_grad():
                        out = lease.value(torch.ones(1, WIDTH, device=on(TOP)))
                    outputs[name].append(out.cpu())

            async with anyio.create_task_group() as tg:
                for name in names * 4:
                    tg.start_soon(infer, name)
            entries = await broker.entries()
            assert sorted(e.state for e in entries) == ["demoted", "demoted", "ready", "ready"]
            stats = await broker.stats()
            assert dict(stats.used) == {TOP: 2 * SIZE, "ram": 2 * SIZE}
    for name, results in outputs.items():
        assert len(results) == 4 and all(torch.equal(r, results[0]) for r in results), name
    loads = [key for action, key, _ in plugin.log if action == "load"]
    assert sorted(loads) == names  # never dropped: each loaded once
