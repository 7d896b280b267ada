"""A Ray Serve deployment for tests/ray/test_ray_serve.py and benchmarks/ray_serve.py.

Shipped to the replicas by value (``ray.cloudpickle.register_pickle_by_value``),
so the replicas need not import the tests. Each response carries what the
replica saw: whether its model was released under it, and the replica's
books as the test measures them (bytes held by models loaded and not yet
freed, their peak, loads per model).
"""

from __future__ import annotations

import asyncio
import importlib
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from cachebroker.ray import multiplexed, routing_stats

Loader = Callable[[Any, str], Awaitable[Any]]


class FakeModel:
    """A model: its bytes are held from its load until its releaser ran."""

    def __init__(self, model_id: str, size: int) -> None:
        self.model_id = model_id
        self.payload = bytearray(size)
        self.users = 0
        self.released = False


class Books:
    """What a replica of either deployment measures, and the answer to each request."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.held: dict[str, int] = {}  # models loaded and not freed: their bytes
        self.peak = 0
        self.loads: dict[str, int] = {}
        self.load_seconds = 0.0
        self.violations = 0  # models freed while a request used them
        self.evicted_in_use: dict[int, int] = {}  # their bytes, until that request ends

    def loaded(self, model_id: str, size: int, started: float) -> None:
        self.held[model_id] = size
        self.peak = max(self.peak, sum(self.held.values()) + sum(self.evicted_in_use.values()))
        self.loads[model_id] = self.loads.get(model_id, 0) + 1
        self.load_seconds += time.perf_counter() - started

    async def use(self, model: FakeModel, hold: float) -> bool:
        """Use ``model`` for ``hold`` seconds, as a request does: was it released meanwhile?"""
        model.users += 1
        try:
            await asyncio.sleep(hold)
            return model.released
        finally:
            model.users -= 1
            if model.released and not model.users:
                self.evicted_in_use.pop(id(model), None)

    def answer(self, saw_released: bool, reported: list[str]) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "saw_released": saw_released,
            "held": dict(self.held),
            "peak": self.peak,
            "loads": dict(self.loads),
            "load_seconds": self.load_seconds,
            "violations": self.violations,
            "reported": reported,
        }


def brokered(
    sizes: Mapping[str, int],
    budget: int,
    load_seconds: float | Mapping[str, float],
    journal: str | None = None,
) -> type:
    """A deployment class whose models cachebroker budgets (``budget`` bytes per replica).

    ``journal``: a file each replica appends ``monotonic-time pid bytes-held``
    to whenever what it holds changes (after a load, before its release is
    acknowledged), so that a test can add up what replicas held at each instant.
    """
    sizes = dict(sizes)

    class Brokered(Books):
        @multiplexed(budget=budget, size=lambda model_id: sizes[model_id])
        async def get_model(self, model_id: str) -> FakeModel:
            started = time.perf_counter()
            await asyncio.sleep(
                load_seconds if isinstance(load_seconds, float) else load_seconds[model_id]
            )
            model = FakeModel(model_id, sizes[model_id])
            self.loaded(model_id, sizes[model_id], started)
            self.record()
            return model

        @get_model.releaser
        async def free_model(self, model_id: str, model: FakeModel) -> None:
            if model.users:
                self.violations += 1
            model.released = True
            model.payload = bytearray()
            del self.held[model_id]
            self.record()

        def record(self) -> None:
            if journal is not None:
                line = f"{time.monotonic()} {self.pid} {sum(self.held.values())}\n"
                with open(journal, "a") as file:  # (appends of a line are atomic)
                    file.write(line)

        async def __call__(self, hold: float) -> dict[str, Any]:
            async with self.get_model() as model:
                saw_released = await self.use(model, hold)
            return self.answer(saw_released, self.get_model.model_ids())

        async def record_routing_stats(self) -> dict[str, Any]:
            return routing_stats()

    return Brokered


def counted(sizes: Mapping[str, int], max_models: int, load_seconds: Mapping[str, float]) -> type:
    """The same deployment on ``@serve.multiplexed(max_num_models_per_replica=...)``."""
    serve: Any = importlib.import_module("ray.serve")  # (typed Any, with or without Ray)
    by_count: Callable[[Loader], Loader] = serve.multiplexed(max_num_models_per_replica=max_models)

    sizes = dict(sizes)

    class Counted(Books):
        @by_count
        async def get_model(self, model_id: str) -> Any:
            started = time.perf_counter()
            await asyncio.sleep(load_seconds[model_id])
            books = self

            class Model(FakeModel):
                def __del__(self) -> None:  # what Ray's multiplexer calls to unload
                    if self.released:
                        return
                    self.released = True
                    books.held.pop(self.model_id, None)
                    if self.users:  # unloaded under a request: its bytes stay until it ends
                        books.violations += 1
                        books.evicted_in_use[id(self)] = len(self.payload)

            model = Model(model_id, sizes[model_id])
            self.loaded(model_id, sizes[model_id], started)
            return model

        async def __call__(self, hold: float) -> dict[str, Any]:
            model = await self.get_model(serve.get_multiplexed_model_id())
            return self.answer(await self.use(model, hold), [])

    return Counted
