"""``BrokerRouter``: a Ray Serve request router that routes by the brokers' models and bytes.

Imported from ``cachebroker.ray`` on first use (it subclasses Ray's
``RequestRouter``, so it needs Ray). Configure a deployment with
``request_router_config=RequestRouterConfig(request_router_class=BrokerRouter)``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping
from typing import Any

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from ._replica import ROUTING_KEY
from ._routing import Candidate, books_for, rank

__all__ = ["BrokerRouter"]

#: Seconds a model id stays routed to the replica it was last sent to, before
#: that replica's own report says it holds it (or no longer does).
SENT_FOR = 10.0
#: Seconds a request waits for busy replicas that hold its model before it may
#: go to another one (and load the model there): Serve's own multiplexed
#: matching timeout.
HOLDER_WAIT = 1.0
#: How many model sizes the router remembers (the most recently reported):
#: a model no replica holds is placed by its size, if the router still knows it.
SIZES_KEPT = 10_000


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

    Between two polls the routers keep an account (``_routing.Ledger``): a
    model sent to a replica keeps going there, and its size counts as taken
    from that replica's free bytes, until the replica's own stats show it. So
    a burst of requests for models no replica holds yet spreads by bytes,
    and loads each model once. Serve builds a router per handle (a handle
    passed by value, to a task or another deployment, gets its own): the
    account is the deployment's, shared with the sizes and budgets learnt by
    all its routers in the process (``_routing.books_for``). Routers in other
    processes learn of a load from the replica's model ids, which it reports
    to Serve's controller (at most 0.1 s after the request arrives) and the
    controller passes on. A request whose model's holders are all busy
    waits for them up to ``holder_wait_s`` (1 s, counted from its first
    routing attempt) before it may go to another replica and load the model
    there. A model the router has never seen held counts, in its account, as
    the mean size of the models it knows.

    Stats that are not ``cachebroker.ray.routing_stats()``'s shape (a
    deployment's own ``record_routing_stats`` returning something else)
    count as no stats.

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
        self._books = books_for(self._deployment_id, expire=SENT_FOR, sizes_kept=SIZES_KEPT)

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
        if pending_request is None or not model_id:
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        context = pending_request.routing_context
        started = context.multiplexed_start_matching_time
        if started is None:  # its first routing attempt: the wait for holders starts
            started = context.multiplexed_start_matching_time = time.time()
        with self._books.lock:  # (the deployment's other routers may run on other threads)
            return self._rank(model_id, candidate_replicas, started)

    def _rank(
        self, model_id: str, candidate_replicas: list[RunningReplica], started: float
    ) -> list[list[RunningReplica]]:
        """``choose_replicas`` for a request of ``model_id``, under the books' lock."""
        books = self._books
        now = time.monotonic()
        candidates = [self._candidate(replica, now) for replica in candidate_replicas]
        holders = books.ledger.holders(model_id, now)
        ranks = rank(
            model_id,
            candidates,
            size=books.sizes.get(model_id),
            holders=[r for r in candidate_replicas if r.replica_id in holders],
        )
        held = bool(ranks) and any(
            model_id in r.multiplexed_model_ids or r.replica_id in holders for r in ranks[0]
        )
        if held:
            if time.time() - started < self._holder_wait:
                return ranks[:1]  # busy holders: wait for them (with backoff) rather than load
            return ranks
        if ranks and not any(model_id in r.multiplexed_model_ids for r in ranks[0]):
            # A load: book it where it goes first, so that the next request
            # (routed before this one lands) sees it there.
            books.book(ranks[0][0].replica_id, model_id, now, routed=False)
        return ranks

    def _candidate(self, replica: RunningReplica, now: float) -> Candidate[RunningReplica]:
        books = self._books
        free, budget, sizes = _read_stats(replica.routing_stats)
        for model_id, size in sizes.items():
            books.remember(model_id, size)
        books.see_budget(budget)
        replica_id = replica.replica_id
        books.ledger.settle(replica_id, replica.multiplexed_model_ids, sizes, now)
        return Candidate(
            replica,
            replica.multiplexed_model_ids,
            books.ledger.free(replica_id, free, books.budget),
            books.ledger.count(replica_id),
        )

    def on_request_routed(
        self,
        pending_request: PendingRequest,
        replica_id: ReplicaID,
        result: Any,
    ) -> None:
        model_id = pending_request.metadata.multiplexed_model_id
        replica = self.curr_replicas.get(replica_id)
        if model_id and (replica is None or model_id not in replica.multiplexed_model_ids):
            with self._books.lock:  # where it went
                self._books.book(replica_id, model_id, time.monotonic(), routed=True)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        with self._books.lock:
            self._books.ledger.forget(replica_id)


def _read_stats(
    raw: object,
) -> tuple[dict[str, int] | None, dict[str, int], dict[str, dict[str, int]]]:
    """A replica's free bytes, budget and held models' sizes, from its routing stats.

    Serve hands the router whatever the deployment's ``record_routing_stats``
    returned: what is not ``routing_stats()``'s shape counts as not reported
    (free bytes: ``None``), rather than failing the routing of every request.
    """
    stats = raw.get(ROUTING_KEY) if isinstance(raw, Mapping) else None
    if not isinstance(stats, Mapping):
        return None, {}, {}
    sizes: dict[str, dict[str, int]] = {}
    reported = stats.get("sizes")
    if isinstance(reported, Mapping):
        for model_id, size in reported.items():
            checked = _bytes_per_space(size)
            if isinstance(model_id, str) and checked is not None:
                sizes[model_id] = checked
    return _bytes_per_space(stats.get("free")), _bytes_per_space(stats.get("budget")) or {}, sizes


def _bytes_per_space(value: object) -> dict[str, int] | None:
    """``value`` if it maps space names to byte counts (ints >= 0), else ``None``."""
    if not isinstance(value, Mapping):
        return None
    checked: dict[str, int] = {}
    for space, n in value.items():
        if not isinstance(space, str) or isinstance(n, bool) or not isinstance(n, int) or n < 0:
            return None
        checked[space] = n
    return checked
