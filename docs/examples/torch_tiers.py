"""PyTorch with tiers: keep models in RAM between uses instead of loading them again.

A GPU holds few models; host memory holds many more, and moving a model
from RAM to the GPU takes a fraction of loading it from disk. With
``Broker(tiers={"cuda:0": "ram"})`` and a releaser that offers ``move``, a
model the policy evicts from the GPU is moved to RAM (a demotion) when RAM
has room for it (or holds models the policy values less), and an acquire of
it moves it back (a promotion) before the lease is granted. ``move`` runs
``module.to(device)`` in a worker thread (it blocks while the weights are
copied) and, leaving CUDA, gives the freed blocks back to the driver
(``torch.cuda.empty_cache()``): the broker counts the GPU's bytes free as
soon as ``move`` returns. ``release`` frees the weights, from either tier.
Sizes are measured with ``cachebroker.sizes.torch_bytes``, which names the
devices as the spaces: ``"cuda:0"`` and ``"ram"``.

On a GPU:

    pip install -e . torch    # a CUDA build of torch, in a checkout of cachebroker
    python docs/examples/torch_tiers.py

Without CUDA the same code runs with the CPU standing in for the GPU: the
upper tier is a space named ``"gpu"`` whose device is ``cpu``. The moves, the
books and the policy run exactly as on a GPU and the weights survive every
round trip, but both tiers are the same memory, so ``module.to("cpu")`` copies
nothing, and ``torch_bytes`` (which sees ``"ram"`` for both) cannot tell the
tiers apart: the stand-in charges what it measures to the tier the plugin
put the module in. (The ``meta`` device would not do as a stand-in: a module
moved there loses its weights, and ``torch_bytes`` counts nothing on it.)
"""

from __future__ import annotations

import functools
import weakref

import anyio
import anyio.to_thread
import torch
from torch import nn

import cachebroker
from cachebroker.sizes import torch_bytes

CUDA = torch.cuda.is_available()
#: The upper tier's space, and each space's torch device.
TOP = "cuda:0" if CUDA else "gpu"
DEVICES = {TOP: "cuda:0" if CUDA else "cpu", "ram": "cpu"}
MiB = 2**20


def build(name: str, width: int) -> nn.Module:
    """Stands in for ``from_pretrained``: a small MLP of ``width`` units, on the GPU."""
    torch.manual_seed(sum(map(ord, name)))
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
    return model.to(DEVICES[TOP]).eval()


def estimate(width: int) -> int:
    """What the model will weigh, known before loading: two float32 ``width x width`` layers."""
    return 2 * (width * width + width) * 4


def to_device(module: nn.Module, device: str) -> nn.Module:
    """Move ``module``'s weights to ``device`` (it blocks: run it in a worker thread).

    Leaving CUDA, the caching allocator keeps the freed blocks for this
    process; ``empty_cache()`` gives them back, so that other processes (and a
    probe such as ``cachebroker.probes.NvidiaGPU``) see them free.
    """
    leaving_cuda = next(module.parameters()).device.type == "cuda"
    module.to(device)
    if leaving_cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return module


class TieredTorch:
    """A Releaser for torch modules that can move them between tiers."""

    def __init__(self) -> None:
        #: The tier each live module is in, as the plugin put it there.
        self.tier: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
        #: What it did, in order: ("load" | "move" | "release", key, space).
        self.log: list[tuple[str, str, str]] = []

    async def load(self, name: str, width: int) -> nn.Module:
        model = await anyio.to_thread.run_sync(build, name, width)
        self.tier[model] = TOP
        self.log.append(("load", name, TOP))
        return model

    async def move(self, name: str, model: nn.Module, to: str) -> nn.Module:
        """Demote to ``"ram"``, or promote to the GPU: the same module, on ``to``'s device."""
        await anyio.to_thread.run_sync(to_device, model, DEVICES[to])
        self.tier[model] = to
        self.log.append(("move", name, to))
        return model

    async def release(self, name: str, model: nn.Module) -> None:
        self.log.append(("release", name, self.tier.pop(model)))
        # The broker holds ``model`` until this returns, so dropping a reference
        # frees nothing yet: move the weights to the meta device (shapes, no
        # data), which frees them (and empties CUDA's cache) before it does.
        await anyio.to_thread.run_sync(to_device, model, "meta")

    def measure(self, model: nn.Module) -> dict[str, int]:
        """``measure=``: the module's bytes per space (``torch_bytes``)."""
        weighed = torch_bytes(model)
        if CUDA:
            return weighed  # {"cuda:0": ...} or {"ram": ...}: torch's devices are the spaces
        # The stand-in: both tiers are the CPU ("ram" to torch_bytes).
        return {self.tier[model]: sum(weighed.values())}


WIDTHS = {"small": 256, "medium": 512, "large": 768}  # 0.5, 2.1 and 4.7 MiB of weights
#: What loading a model costs, in seconds (``cost=``). The broker demotes a model
#: only while promoting it back is quicker than loading it again; these stand-in
#: models build in milliseconds, as fast as a move, so they declare what a real
#: checkpoint's load takes (a real model needs no ``cost=``: its load is measured).
LOAD_SECONDS = 5.0


async def main(budget: dict[str, int] | None = None) -> TieredTorch:
    plugin = TieredTorch()
    # The GPU fits "large" beside "small" only; RAM fits all three.
    budget = budget or {TOP: 6 * MiB, "ram": 8 * MiB}
    async with cachebroker.Broker(budget, tiers={TOP: "ram"}) as broker:
        async with broker.cache("torch", plugin) as cache:

            async def infer(name: str) -> torch.Tensor:
                width = WIDTHS[name]
                async with cache.acquire(
                    name,
                    load=functools.partial(plugin.load, name, width),
                    size={TOP: estimate(width)},  # reserved before the load runs
                    measure=plugin.measure,  # then corrected, after the load and every move
                    cost=LOAD_SECONDS,
                ) as lease:
                    model = lease.value
                    assert next(model.parameters()).device.type == DEVICES[TOP].split(":")[0]
                    with torch.no_grad():
                        out: torch.Tensor = model(torch.ones(1, width, device=DEVICES[TOP]))
                    return out.cpu()

            first = {name: await infer(name) for name in ["small", "medium", "large"]}
            for name in ["small", "medium", "large", "medium"]:
                again = await infer(name)  # promoted, not loaded: the same weights
                assert torch.equal(again, first[name]), name
            async with anyio.create_task_group() as tg:  # 9 concurrent requests
                for name in list(WIDTHS) * 3:
                    tg.start_soon(infer, name)
            entries = await broker.entries()
            stats = await broker.stats()
            assert stats.used[TOP] <= budget[TOP] and stats.used["ram"] <= budget["ram"]
            loads = [key for action, key, _ in plugin.log if action == "load"]
            assert sorted(loads) == sorted(WIDTHS), loads  # each loaded once, then moved
            for entry in entries:
                print(f"  {entry.key:>6}: {entry.state:<7} {dict(entry.charge)}")
    assert all(action != "release" or key in WIDTHS for action, key, _ in plugin.log)
    return plugin


if __name__ == "__main__":
    print(f"torch {torch.__version__}; tiers {TOP} ({DEVICES[TOP]}) -> ram (cpu)")
    done = anyio.run(main)
    moves = [(key, to) for action, key, to in done.log if action == "move"]
    down = sum(to == "ram" for _, to in moves)
    print(f"{len(moves)} moves: {down} down to ram, {len(moves) - down} up to {TOP}")
    print("log:", ", ".join(f"{action} {key}->{space}" for action, key, space in done.log))
