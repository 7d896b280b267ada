"""Where a request for a model should go: the ranking behind ``BrokerRouter``, without Ray.

A replica that holds the model (or was just sent it) comes first: no load
at all. Otherwise the one replica where the model fits in the free bytes
with the most to spare (in the model's own spaces): a load without an
eviction, on the replica with the most room left for others. A replica the
router knows nothing about yet counts as all free (it has served no model);
among those, the one sent fewer models wins. Then the others, fewest bytes
to evict first (for a model of unknown size: most free bytes first). Ties
keep a random order, so that equal replicas share the load.

The free bytes are the router's estimate: what the replica last reported,
less what the routers have sent it since (``Ledger``). Every router of one
deployment in a process shares one ``Books`` (``books_for``): Serve builds a
router per handle (each handle passed by value, to a task or another
deployment, gets its own), and routers that each book only what they sent
would load a burst's models on several replicas.
"""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Collection, Hashable, Mapping, Sequence
from typing import Generic, TypeVar

import attrs

from .._shared import shared

__all__ = ["Books", "Candidate", "Ledger", "books_for", "rank"]

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
        if c.free is None:  # nothing known: it has served no model
            return (True, math.inf, -c.sent)
        if not size:  # how big the model is is not known yet: the most free bytes
            return (False, sum(c.free.values()), -c.sent)
        short = sum(max(0, n - c.free.get(space, 0)) for space, n in size.items())
        if short:  # the fewest bytes to evict, in the model's own spaces
            return (False, -short, -c.sent)
        return (True, sum(c.free.get(space, 0) - n for space, n in size.items()), -c.sent)

    others.sort(key=key, reverse=True)
    ranks = [first, [c.replica for c in others[:1]], [c.replica for c in others[1:]]]
    return [r for r in ranks if r]


@attrs.define
class _Sent:
    size: Mapping[str, int]
    when: float
    routed: bool = False  # the request went there (not only chosen for it)
    shown: bool = False  # the replica's model ids include it


class Ledger:
    """What a router sent where, until the replicas' own reports show it.

    ``sent(replica, model, size, now)`` books a model sent to a replica that
    did not report it. Until the replica's model ids include it, the replica
    counts as its holder (``holders``); until its stats list the model (they
    are polled, so they come later), its size counts as taken from the
    replica's free bytes (``free``). Stats that list the model before its
    model ids show it are older than the booking (the replica released it
    since): they count its bytes, and the entry stays for ``holders`` until
    the model ids show it. An entry leaves after ``expire`` seconds in any case.

    A booking only chosen for a request moves when the model is booked on
    another replica (the request went there instead); one ``routed`` there
    (the request did go there) stays: the replica loads the model.
    """

    def __init__(self, expire: float = 10.0) -> None:
        self.expire = expire
        self._sent: dict[Hashable, dict[str, _Sent]] = {}

    def sent(
        self,
        replica: Hashable,
        model_id: str,
        size: Mapping[str, int],
        now: float,
        *,
        routed: bool = False,
    ) -> None:
        for other, models in list(self._sent.items()):
            entry = models.get(model_id)
            if entry is not None and (other == replica or not entry.routed):
                del models[model_id]  # (chosen there but gone elsewhere, or booked anew)
            # Expired entries of replicas no longer settled (gone, or never
            # asked about) leave too; each replica's are in booking order.
            while models and now - next(iter(models.values())).when >= self.expire:
                del models[next(iter(models))]
            if not models:
                del self._sent[other]
        self._sent.setdefault(replica, {})[model_id] = _Sent(dict(size), now, routed)

    def holders(self, model_id: str, now: float) -> list[Hashable]:
        found = []
        for replica, models in self._sent.items():
            entry = models.get(model_id)
            if entry is not None and not entry.shown and now - entry.when < self.expire:
                found.append(replica)
        return found

    def count(self, replica: Hashable) -> int:
        return len(self._sent.get(replica, ()))

    def settle(
        self,
        replica: Hashable,
        model_ids: Collection[str],
        stats_sizes: Collection[str],
        now: float,
    ) -> None:
        """Take in what ``replica`` reported: its model ids, the models its stats list."""
        models = self._sent.get(replica)
        if not models:
            return
        for model_id, entry in list(models.items()):
            if now - entry.when >= self.expire:
                del models[model_id]
                continue
            if model_id in model_ids:
                entry.shown = True
            if model_id in stats_sizes:
                if entry.shown:
                    del models[model_id]
                else:
                    # Stats older than the booking (the replica held the model,
                    # released it, and is sent it again): they count its bytes
                    # already, but the replica is its holder still.
                    entry.size = {}

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
        for entry in self._sent.get(replica, {}).values():
            for space, n in entry.size.items():
                if space in free:
                    free[space] = max(0, free[space] - n)
        return free

    def forget(self, replica: Hashable) -> None:
        self._sent.pop(replica, None)


class Books:
    """What the routers of one deployment know: the ledger, model sizes, the largest budgets.

    Shared by every ``BrokerRouter`` of the deployment in the process
    (``books_for``), so that a model one router sent to a replica counts as
    held there for the others too. Routers may run on different event loops
    (Serve's router thread, a replica's own loop): each reads and books under
    ``lock``. ``sizes_kept``: how many model sizes it remembers (the most
    recently reported).
    """

    def __init__(self, *, expire: float, sizes_kept: int) -> None:
        self.lock = threading.Lock()
        self.ledger = Ledger(expire=expire)
        self.sizes_kept = sizes_kept
        self.sizes: dict[str, dict[str, int]] = {}  # oldest report first
        self.size_totals: dict[str, int] = {}  # over self.sizes, per space
        self.size_counts: dict[str, int] = {}
        self.budget: dict[str, int] = {}

    def remember(self, model_id: str, size: dict[str, int]) -> None:
        """Keep ``size`` as ``model_id``'s, the most recent of ``sizes_kept``."""
        self._count_size(self.sizes.pop(model_id, None), -1)
        self.sizes[model_id] = size
        self._count_size(size, 1)
        if len(self.sizes) > self.sizes_kept:
            self._count_size(self.sizes.pop(next(iter(self.sizes))), -1)

    def _count_size(self, size: Mapping[str, int] | None, sign: int) -> None:
        for space, n in (size or {}).items():
            self.size_totals[space] = self.size_totals.get(space, 0) + sign * n
            self.size_counts[space] = self.size_counts.get(space, 0) + sign

    def see_budget(self, budget: Mapping[str, int]) -> None:
        """A replica reported ``budget``: a replica without stats counts as the largest."""
        for space, n in budget.items():
            self.budget[space] = max(n, self.budget.get(space, 0))

    def book(self, replica: Hashable, model_id: str, now: float, *, routed: bool) -> None:
        """``model_id`` goes to ``replica``: its known size, else the mean of those known."""
        size = self.sizes.get(model_id)
        if size is None:  # never seen held: the mean of the sizes known, in their spaces
            size = {
                space: total // count
                for space, total in self.size_totals.items()
                if (count := self.size_counts[space])
            }
        self.ledger.sent(replica, model_id, size, now, routed=routed)


def books_for(deployment: Hashable, *, expire: float, sizes_kept: int) -> Books:
    """The ``Books`` every router of ``deployment`` in this process shares (made by the first).

    Kept by ``cachebroker._shared``, not here: Serve ships the router, and
    this module with it, by value, so that each unpickled copy has globals
    of its own. The books live while a router holds them, as Serve's own
    shared long-poll client keeps a deployment's routers (weakly).
    """
    return shared(
        ("cachebroker.ray.BrokerRouter", deployment),
        lambda: Books(expire=expire, sizes_kept=sizes_kept),
    )
