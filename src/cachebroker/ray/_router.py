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
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from ._replica import ROUTING_KEY
from ._routing import Candidate, Ledger, rank

__all__ = ["BrokerRouter"]

#: Seconds a model id stays routed to the replica it was last sent to, before
#: that replica's own report says it holds it (or no longer does).
SENT_FOR = 10.0
#: Seconds a request waits for busy replicas that hold its model before it may
#: go to another one (and load the model there): Serve's own multiplexed
#: matching timeout.
HOLDER_WAIT = 1.0


class BrokerRouter(RequestRouter):
    """Routes a request to a replica that holds its model, else where it fits without eviction.

    Replicas of ``@cachebroker.ray.multiplexed`` deployments report the model
    ids they hold at once, and their free bytes per space (with their budget
    and the sizes of the models they hold) when Serve polls their
    ``record_routing_stats`` (which returns ``cachebroker.ray.routing_stats()``).
    This router ranks the replicas by them (see ``_routing.rank``): holders
    first, then the one replica where the model fits with the most bytes to
    spare, then the others by free bytes. Requests without a model id go to
    the shorter queue of two random replicas, as Serve's default router does.

    Between two polls the router keeps its own account (``_routing.Ledger``):
    a model sent to a replica keeps going there, and its size counts as
    taken from that replica's free bytes, until the replica's own stats show
    it. So a burst of requests for models no replica holds yet spreads by
    bytes, and loads each model once. A request whose model's holders are all
    busy waits for them up to ``holder_wait_s`` (1 s) before it may go to
    another replica and load the model there.

    Each request goes to the replica chosen for it (Serve's default router
    hands a chosen replica to the oldest waiting request instead, which
    would put a model where another one was placed).
    """

    def initialize_state(self, holder_wait_s: float = HOLDER_WAIT, **kwargs: Any) -> None:
        """``holder_wait_s``: how long a request waits for a busy replica that holds its model.

        Given as ``RequestRouterConfig(request_router_kwargs={"holder_wait_s": 5.0})``.
        """
        if kwargs:
            raise TypeError(f"BrokerRouter got unknown arguments: {', '.join(sorted(kwargs))}")
        if (
            isinstance(holder_wait_s, bool)
            or not isinstance(holder_wait_s, (int, float))
            or not holder_wait_s >= 0
        ):
            raise ValueError(f"holder_wait_s must be seconds >= 0, got {holder_wait_s!r}")
        self._holder_wait = float(holder_wait_s)
        self._ledger = Ledger(expire=SENT_FOR)
        self._sizes: dict[str, dict[str, int]] = {}
        self._budget: dict[str, int] = {}

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """Ranks of replicas for ``pending_request`` (see the class); books a load where it goes.

        Cancellation: nothing to undo (it does not await).
        """
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        model_id = pending_request.metadata.multiplexed_model_id if pending_request else ""
        if not model_id:
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        now = time.monotonic()
        candidates = [self._candidate(replica, now) for replica in candidate_replicas]
        holders = self._ledger.holders(model_id, now)
        ranks = rank(
            model_id,
            candidates,
            size=self._sizes.get(model_id),
            holders=[r for r in candidate_replicas if r.replica_id in holders],
        )
        held = bool(ranks) and any(
            model_id in r.multiplexed_model_ids or r.replica_id in holders for r in ranks[0]
        )
        if held and pending_request is not None:
            if time.time() - pending_request.created_at < self._holder_wait:
                return ranks[:1]  # busy holders: wait for them (with backoff) rather than load
            return ranks
        if ranks and not any(model_id in r.multiplexed_model_ids for r in ranks[0]):
            # A load: book it where it goes first, so that the next request
            # (routed before this one lands) sees it there.
            self._book(ranks[0][0].replica_id, model_id, now)
        return ranks

    def _candidate(self, replica: RunningReplica, now: float) -> Candidate[RunningReplica]:
        stats = (replica.routing_stats or {}).get(ROUTING_KEY) or {}
        sizes = stats.get("sizes") or {}
        self._sizes.update(sizes)
        for space, n in (stats.get("budget") or {}).items():
            self._budget[space] = max(n, self._budget.get(space, 0))
        replica_id = replica.replica_id
        self._ledger.settle(replica_id, replica.multiplexed_model_ids, sizes, now)
        return Candidate(
            replica,
            replica.multiplexed_model_ids,
            self._ledger.free(replica_id, stats.get("free"), self._budget),
            self._ledger.count(replica_id),
        )

    def _book(self, replica_id: ReplicaID, model_id: str, now: float) -> None:
        self._ledger.sent(replica_id, model_id, self._sizes.get(model_id, {}), now)

    def on_request_routed(
        self,
        pending_request: PendingRequest,
        replica_id: ReplicaID,
        result: Any,
    ) -> None:
        model_id = pending_request.metadata.multiplexed_model_id
        replica = self.curr_replicas.get(replica_id)
        if model_id and (replica is None or model_id not in replica.multiplexed_model_ids):
            self._book(replica_id, model_id, time.monotonic())  # where it really went

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._ledger.forget(replica_id)
