"""Recipe: a Ray Serve deployment whose models cachebroker budgets in bytes.

Two replicas, three models of 2-5 MiB and 8 MiB per replica: each request
leases its model for its duration, the replicas report what they hold, and
``BrokerRouter`` sends a request to the replica that holds its model, else
where it fits without eviction. Runs on a local Ray cluster:

    pip install -e '.[ray]' && python docs/examples/ray_deployment.py
"""

from __future__ import annotations

import asyncio
from typing import Any

import ray
from ray import serve

import cachebroker.ray
from cachebroker.ray import BrokerRouter, multiplexed

SIZES = {"small": 2 * 2**20, "medium": 3 * 2**20, "large": 5 * 2**20}


class Model:
    def __init__(self, model_id: str) -> None:
        self.model_id = model_id
        self.weights = bytearray(SIZES[model_id])  # stands in for GPU memory

    async def __call__(self, text: str) -> str:
        return f"{self.model_id}: {text}"


class Models:
    @multiplexed(budget="8MiB", size=lambda model_id: SIZES[model_id])
    async def get_model(self, model_id: str) -> Model:
        await asyncio.sleep(0.1)  # reading the weights
        return Model(model_id)

    @get_model.releaser
    async def free_model(self, model_id: str, model: Model) -> None:
        model.weights = bytearray()  # torch: del the module, then torch.cuda.empty_cache()

    async def __call__(self, text: str) -> str:
        async with self.get_model() as model:  # the request's model, leased until it returns
            return await model(text)

    async def record_routing_stats(self) -> dict[str, Any]:
        return cachebroker.ray.routing_stats()  # free bytes per replica, for BrokerRouter


deployment = serve.deployment(
    num_replicas=2,
    ray_actor_options={"num_cpus": 0},
    request_router_config={
        "request_router_class": BrokerRouter,
        "request_routing_stats_period_s": 1.0,
    },
)(Models)


def main() -> list[str]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": 0})
        handle = serve.run(deployment.bind(), name="models", route_prefix=None)
        answers = []
        for model_id in ["small", "large", "small", "medium", "large"]:
            answer: str = handle.options(multiplexed_model_id=model_id).remote("hi").result()
            answers.append(answer)
        return answers
    finally:
        serve.shutdown()  # type: ignore[no-untyped-call]
        ray.shutdown()


if __name__ == "__main__":
    for answer in main():
        print(answer)
