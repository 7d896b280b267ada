"""Where a request for a model should go: the ranking behind ``BrokerRouter``, without Ray.

A replica that holds the model (or was just sent a request for it) comes
first: no load at all. Then the replicas where the model fits in the free
bytes, most free first: a load without an eviction. Then the others, most
free bytes first: the fewest evictions. A replica whose stats have not
arrived yet ranks last. Ties keep a random order, so that equal replicas
share the load.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping, Sequence
from typing import Generic, TypeVar

import attrs

__all__ = ["Candidate", "rank"]

R = TypeVar("R")


@attrs.frozen
class Candidate(Generic[R]):
    """A replica as the router sees it: the model ids it reported, its free bytes."""

    replica: R
    models: Collection[str]
    free: Mapping[str, int]


def rank(
    model_id: str,
    candidates: Sequence[Candidate[R]],
    *,
    size: Mapping[str, int] | None,
    sent_to: R | None = None,
    rng: random.Random | None = None,
) -> list[list[R]]:
    """Ranks of replicas for a request of ``model_id`` (``size``: its bytes, if known).

    Each rank is tried in turn (Ray probes its replicas' queues and takes the
    shortest that accepts); the second rank has at most two replicas, the
    power-of-two choice among the best.
    """
    order = list(candidates)
    (rng or random).shuffle(order)
    holders = [c.replica for c in order if model_id in c.models or c.replica is sent_to]
    others = [c for c in order if model_id not in c.models and c.replica is not sent_to]

    def fits(c: Candidate[R]) -> bool:
        return bool(size) and all(c.free.get(space, 0) >= n for space, n in (size or {}).items())

    others.sort(key=lambda c: (bool(c.free), fits(c), sum(c.free.values())), reverse=True)
    ranks = [holders, [c.replica for c in others[:2]], [c.replica for c in others[2:]]]
    return [r for r in ranks if r]
