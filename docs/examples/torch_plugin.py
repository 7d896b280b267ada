"""PyTorch: a plugin that loads real ``torch.nn`` modules and gives their memory back.

Each model reserves an estimate before it loads (``size=``, from its
configuration, as a model card's parameter count would give it, or from its
checkpoint with ``cachebroker.sizes.weights_bytes``) and is then measured by
its parameters' and buffers' bytes on the device it was loaded to
(``measure=cachebroker.sizes.torch_bytes``), which corrects the books. Its
release drops the module and, on CUDA, returns the cached blocks with
``torch.cuda.empty_cache()``; the blocking parts of both run in a worker
thread, off the event loop. Runs on CPU (and on a GPU when one is present):

    pip install -e . torch    # in a checkout of cachebroker
    python docs/examples/torch_plugin.py

Why dropping the last reference is not enough: PyTorch's CUDA caching
allocator keeps freed blocks reserved for the process, so ``nvidia-smi`` (and
any other process, and a probe such as ``cachebroker.probes.NvidiaGPU``) still
sees the memory as used until ``empty_cache()`` hands it back to the driver.
MLX's Metal allocator does the same on Apple silicon (``mx.clear_cache()``).
A release that only deletes the module has freed nothing anyone else can use.
"""

from __future__ import annotations

import functools
import gc

import anyio
import torch
from torch import nn

import cachebroker
from cachebroker.sizes import torch_bytes

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SPACE = "cuda:0" if DEVICE == "cuda" else "ram"


def model_bytes(module: nn.Module) -> int:
    """What a module weighs in SPACE: its parameters and buffers there."""
    return torch_bytes(module).get(SPACE, 0)


def estimate(width: int) -> int:
    """What the model will weigh, known before loading: two float32 ``width x width`` layers."""
    return 2 * (width * width + width) * 4


def build(name: str, width: int) -> nn.Module:
    """Stands in for ``from_pretrained``: a small MLP of ``width`` units, on DEVICE."""
    torch.manual_seed(hash(name) % 2**31)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
    return model.to(DEVICE).eval()


class TorchPlugin:
    """A Releaser for torch modules."""

    def __init__(self) -> None:
        self.live: dict[str, nn.Module] = {}

    async def load(self, name: str, width: int) -> nn.Module:
        # Building and moving weights blocks: keep it off the event loop.
        model = await anyio.to_thread.run_sync(build, name, width)
        self.live[name] = model
        return model

    async def release(self, name: str, model: nn.Module) -> None:
        del self.live[name]
        del model  # the broker drops its reference once this returns
        # gc.collect() and empty_cache() block for up to a second: not on the loop.
        await anyio.to_thread.run_sync(free_cached_memory)


def free_cached_memory() -> None:
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # give the cached blocks back to the driver


async def main() -> TorchPlugin:
    plugin = TorchPlugin()
    widths = {"small": 256, "medium": 512, "large": 768}
    # 0.5, 2.1 and 4.7 MB of weights: "large" fits beside "small", not beside "medium".
    budget = 6 * 2**20
    async with cachebroker.Broker(budget={SPACE: budget}) as broker:
        async with broker.cache("torch", plugin) as cache:

            async def infer(name: str) -> None:
                width = widths[name]
                async with cache.acquire(
                    name,
                    load=functools.partial(plugin.load, name, width),
                    size={SPACE: estimate(width)},  # reserved before the load runs
                    measure=torch_bytes,  # then corrected: {SPACE: parameters + buffers}
                ) as lease:
                    with torch.no_grad():
                        out = lease.value(torch.ones(1, width, device=DEVICE))
                    assert out.shape == (1, width)
                    # What is really loaded never exceeds the budget, even under concurrency.
                    assert sum(model_bytes(m) for m in plugin.live.values()) <= budget

            for name in ["small", "medium", "large", "small", "large", "medium"]:
                await infer(name)
            async with anyio.create_task_group() as tg:  # 12 concurrent requests
                for name in ["small", "medium", "large"] * 4:
                    tg.start_soon(infer, name)
            stats = await broker.stats()
            while stats.releasing:  # releases asked for by the last requests end first
                await anyio.sleep(0.01)
                stats = await broker.stats()
            assert stats.used[SPACE] <= budget, stats.used
            assert sum(model_bytes(m) for m in plugin.live.values()) == stats.used[SPACE]
            assert stats.evictions >= 3
        # Measured sizes outlive the broker: the next one can reserve them.
        assert broker.export_sizes()["torch"]["large"] == {SPACE: estimate(768)}
    assert not plugin.live, "closing the cache released every module"
    return plugin


if __name__ == "__main__":
    anyio.run(main)
    print(f"torch {torch.__version__} on {DEVICE}: modules loaded, evicted and released")
