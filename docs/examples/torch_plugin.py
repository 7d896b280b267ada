"""PyTorch: a plugin that loads real ``torch.nn`` modules and gives their memory back.

Each model is sized by its parameters' and buffers' bytes, on the device it
was loaded to, and its release drops the module and, on CUDA, returns the
cached blocks with ``torch.cuda.empty_cache()``. Runs on CPU (and on a GPU
when one is present):

    pip install torch 'cachebroker'
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

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SPACE = "cuda:0" if DEVICE == "cuda" else "ram"


def model_bytes(module: nn.Module) -> int:
    """What a module weighs: its parameters and buffers."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


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
            for name in ["small", "medium", "large", "small", "large", "medium"]:
                width = widths[name]
                async with cache.acquire(
                    name,
                    load=functools.partial(plugin.load, name, width),
                    size=lambda model: {SPACE: model_bytes(model)},
                ) as lease:
                    with torch.no_grad():
                        out = lease.value(torch.ones(1, width, device=DEVICE))
                    assert out.shape == (1, width)
                stats = await broker.stats()
                assert stats.used[SPACE] <= budget, stats.used
                assert sum(model_bytes(m) for m in plugin.live.values()) == stats.used[SPACE]
            assert (await broker.stats()).evictions >= 3
    assert not plugin.live, "closing the cache released every module"
    return plugin


if __name__ == "__main__":
    anyio.run(main)
    print(f"torch {torch.__version__} on {DEVICE}: modules loaded, evicted and released")
