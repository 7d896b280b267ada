"""Where a request for a model should go: the ranking behind ``BrokerRouter``, without Ray.

A replica that holds the model (or was just sent it) comes first: no load
at all. Otherwise the one replica where the model fits in the free bytes
with the most to spare: a load without an eviction. A replica the router
knows nothing about yet counts as all free (it has served no model); among
those, the one sent fewer models wins. Then the others, most free bytes
first: the fewest evictions. Ties keep a random order, so that equal
replicas share the load.

The free bytes are the router's estimate: what the replica last reported,
less what the router has sent it since (``Ledger``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Collection, Hashable, Mapping, Sequence
from typing import Generic, TypeVar

import attrs

__all__ = ["Candidate", "Ledger", "rank"]

R = TypeVar("R")


@attrs.frozen
class Candidate(Generic[R]):
    """A replica as the router sees it.

    ``models``: the model ids it reported. ``free``: its estimated free bytes
    per space, ``None`` when nothing is known (no stats, no budget known).
    ``sent``: how many models the router sent it that it has not reported yet.
    """

    replica: R
    models: Collection[str]
    free: Mapping[str, int] | None
    sent: int = 0


def rank(
    model_id: str,
    candidates: Sequence[Candidate[R]],
    *,
    size: Mapping[str, int] | None,
    holders: Collection[R] = (),
    rng: random.Random | None = None,
) -> list[list[R]]:
    """Ranks of replicas for a request of ``model_id`` (``size``: its bytes, if known).

    Each rank is tried in turn (Ray probes its replicas' queues and takes the
    shortest that accepts). ``holders``: replicas just sent the model.
    """
    order = list(candidates)
    (rng or random).shuffle(order)
    first = [c.replica for c in order if model_id in c.models or c.replica in holders]
    others = [c for c in order if model_id not in c.models and c.replica not in holders]

    def key(c: Candidate[R]) -> tuple[bool, float, int]:
        if c.free is None:
            return (True, math.inf, -c.sent)
        fits = all(c.free.get(space, 0) >= n for space, n in (size or {}).items())
        return (fits and bool(size), sum(c.free.values()), -c.sent)

    others.sort(key=key, reverse=True)
    ranks = [first, [c.replica for c in others[:1]], [c.replica for c in others[1:]]]
    return [r for r in ranks if r]


class Ledger:
    """What a router sent where, until the replicas' own reports show it.

    ``sent(replica, model, size, now)`` books a model sent to a replica that
    did not report it; ``free(...)`` is the replica's reported free bytes
    less the sizes sent since and not yet in its report; an entry leaves when
    the replica's stats list the model, or after ``expire`` seconds.
    """

    def __init__(self, expire: float = 10.0) -> None:
        self.expire = expire
        self._sent: dict[Hashable, dict[str, tuple[Mapping[str, int], float]]] = {}

    def sent(self, replica: Hashable, model_id: str, size: Mapping[str, int], now: float) -> None:
        for other in self._sent.values():  # one replica at a time holds a model just sent
            other.pop(model_id, None)
        self._sent.setdefault(replica, {})[model_id] = (dict(size), now)

    def holders(self, model_id: str, now: float) -> list[Hashable]:
        return [
            replica
            for replica, models in self._sent.items()
            if model_id in models and now - models[model_id][1] < self.expire
        ]

    def count(self, replica: Hashable) -> int:
        return len(self._sent.get(replica, ()))

    def settle(self, replica: Hashable, reported: Collection[str], now: float) -> None:
        """Forget what ``replica``'s stats now show (``reported``), and what expired."""
        models = self._sent.get(replica)
        if not models:
            return
        for model_id in [
            m for m, (_, t) in models.items() if m in reported or now - t >= self.expire
        ]:
            del models[model_id]

    def free(
        self,
        replica: Hashable,
        reported: Mapping[str, int] | None,
        budget: Mapping[str, int] | None,
    ) -> dict[str, int] | None:
        """``reported`` (or, for a replica without stats, ``budget``) less what was sent since."""
        base = reported if reported else budget
        if not base:
            return None
        free = dict(base)
        for size, _ in self._sent.get(replica, {}).values():
            for space, n in size.items():
                if space in free:
                    free[space] = max(0, free[space] - n)
        return free

    def forget(self, replica: Hashable) -> None:
        self._sent.pop(replica, None)
