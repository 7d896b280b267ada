"""``BrokerRouter``: a Ray Serve request router that routes by the brokers' models and bytes.

Imported from ``cachebroker.ray`` on first use (it subclasses Ray's
``RequestRouter``, so it needs Ray). Configure a deployment with
``request_router_config=RequestRouterConfig(request_router_class=BrokerRouter)``.
"""

from __future__ import annotations

import random
import time
from typing import Any

from ray.serve.request_router import (
    FIFOMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from ._replica import ROUTING_KEY
from ._routing import Candidate, rank

__all__ = ["BrokerRouter"]

#: Seconds a model id stays routed to the replica it was last sent to, before
#: that replica's own report says it holds it (or no longer does).
SENT_FOR = 10.0


class BrokerRouter(FIFOMixin, MultiplexMixin, RequestRouter):
    """Routes a request to a replica that holds its model, else where it fits without eviction.

    Replicas of ``@cachebroker.ray.multiplexed`` deployments push their model
    ids and their free bytes per space (with the sizes of the models they
    hold) to Serve's controller whenever they change; this router ranks the
    replicas by them (see ``_routing.rank``): holders first, then the replica
    with the most free bytes where the model fits, then the others by free
    bytes. Requests without a model id go to the shorter queue of two random
    replicas, as Serve's default router does. A model just sent to a replica
    keeps going there until that replica's report catches up, so a burst of
    requests for a model that no replica holds yet loads it once.
    """

    def initialize_state(self, **kwargs: Any) -> None:
        self._sent: dict[str, tuple[ReplicaID, float]] = {}
        self._sizes: dict[str, dict[str, int]] = {}

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        model_id = pending_request.metadata.multiplexed_model_id if pending_request else ""
        if not model_id:
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        candidates = []
        for replica in candidate_replicas:
            stats = (replica.routing_stats or {}).get(ROUTING_KEY) or {}
            self._sizes.update(stats.get("sizes") or {})
            candidates.append(
                Candidate(replica, replica.multiplexed_model_ids, stats.get("free") or {})
            )
        sent_to = None
        sent = self._sent.get(model_id)
        if sent is not None:
            if time.monotonic() - sent[1] < SENT_FOR:
                sent_to = next((r for r in candidate_replicas if r.replica_id == sent[0]), None)
            else:
                del self._sent[model_id]
        return rank(model_id, candidates, size=self._sizes.get(model_id), sent_to=sent_to)

    def on_request_routed(
        self,
        pending_request: PendingRequest,
        replica_id: ReplicaID,
        result: Any,
    ) -> None:
        model_id = pending_request.metadata.multiplexed_model_id
        if model_id:
            self._sent[model_id] = (replica_id, time.monotonic())
