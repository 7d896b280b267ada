"""BrokerRouter's ranking and ledger, without Ray: holders, then where the model fits.

Then the attacks on the ranking, the ledger and the router itself, built
without a cluster on fake replicas.
"""

from __future__ import annotations

import gc
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

import pytest

from cachebroker.ray._routing import Candidate, Ledger, books_for, rank

if TYPE_CHECKING:
    from ray.serve.request_router import PendingRequest, ReplicaID, RunningReplica

    from cachebroker.ray._router import BrokerRouter


def candidates(**free: dict[str, int]) -> list[Candidate[str]]:
    return [Candidate(name, (), spaces) for name, spaces in free.items()]


def test_holders_come_first_all_of_them() -> None:
    cands = [
        Candidate("a", ["m"], {"gpu": 0}),
        Candidate("b", [], {"gpu": 100}),
        Candidate("c", ["m", "n"], {"gpu": 5}),
    ]
    ranks = rank("m", cands, size={"gpu": 10}, rng=random.Random(1))
    assert sorted(ranks[0]) == ["a", "c"]
    assert ranks[1:] == [["b"]]


def test_where_it_fits_beats_more_free_bytes_where_it_does_not() -> None:
    cands = candidates(a={"gpu": 12, "ram": 0}, b={"gpu": 50, "ram": 50}, c={"gpu": 30, "ram": 10})
    # 10 bytes in each space: b and c fit (b with more to spare), a has no ram left
    assert rank("m", cands, size={"gpu": 10, "ram": 10}) == [["b"], ["c", "a"]]
    # 40 in gpu: only b fits; then c (more free bytes than a)
    assert rank("m", cands, size={"gpu": 40, "ram": 10}) == [["b"], ["c", "a"]]
    # 60: nowhere; the fewest bytes to evict first
    assert rank("m", cands, size={"gpu": 60}) == [["b"], ["c", "a"]]


def test_where_nothing_fits_the_fewest_bytes_to_evict_in_the_models_spaces_win() -> None:
    # b has far more free bytes in all, but in RAM, which the model does not use
    cands = candidates(a={"gpu": 8, "ram": 0}, b={"gpu": 2, "ram": 1000})
    assert rank("m", cands, size={"gpu": 10}) == [["a"], ["b"]]
    # where it fits, the room left in its own spaces decides too
    cands = candidates(a={"gpu": 30, "ram": 0}, b={"gpu": 12, "ram": 1000})
    assert rank("m", cands, size={"gpu": 10}) == [["a"], ["b"]]


def test_a_fitting_replica_beats_one_with_more_free_bytes_that_does_not_fit() -> None:
    cands = candidates(a={"gpu": 11, "ram": 11}, b={"gpu": 100, "ram": 5})
    assert rank("m", cands, size={"gpu": 10, "ram": 10}) == [["a"], ["b"]]


def test_without_a_known_size_the_most_free_bytes_win() -> None:
    cands = candidates(a={"gpu": 5}, b={"gpu": 50}, c={"gpu": 20}, d={"gpu": 1})
    assert rank("m", cands, size=None, rng=random.Random(3)) == [["b"], ["c", "a", "d"]]


def test_a_replica_nothing_is_known_about_counts_as_all_free_fewest_sent_first() -> None:
    cands = [
        Candidate("a", (), {"gpu": 50}),
        Candidate("fresh", (), None, sent=2),
        Candidate("fresher", (), None, sent=1),
    ]
    assert rank("m", cands, size={"gpu": 10}) == [["fresher"], ["fresh", "a"]]


def test_the_replica_just_sent_the_model_counts_as_a_holder() -> None:
    cands = candidates(a={"gpu": 50}, b={"gpu": 0})
    assert rank("m", cands, size={"gpu": 10}, holders=["b"]) == [["b"], ["a"]]


def test_equal_replicas_share_the_load() -> None:
    cands = candidates(a={"gpu": 10}, b={"gpu": 10}, c={"gpu": 10})
    first = {rank("m", cands, size=None, rng=random.Random(seed))[0][0] for seed in range(30)}
    assert first == {"a", "b", "c"}


def test_no_candidates_no_ranks() -> None:
    assert rank("m", [], size=None) == []
    assert rank("m", [], size={"gpu": 1}, holders=["r"]) == []


def test_a_model_measured_at_nothing_fits_anywhere_with_stats() -> None:
    cands = candidates(a={"gpu": 1}, b={"gpu": 0})
    assert rank("m", cands, size={"gpu": 0}) == [["a"], ["b"]]


def test_the_ledger_takes_what_was_sent_from_the_free_bytes_until_reported() -> None:
    ledger = Ledger(expire=10.0)
    ledger.sent("r1", "m", {"gpu": 30}, now=0.0)
    ledger.sent("r1", "n", {}, now=0.0)  # size unknown: counted, not subtracted
    assert ledger.free("r1", {"gpu": 100}, None) == {"gpu": 70}
    assert ledger.count("r1") == 2 and ledger.holders("m", now=1.0) == ["r1"]
    ledger.settle("r1", model_ids={"m"}, stats_sizes=(), now=0.5)  # its model ids show m
    assert ledger.holders("m", now=0.5) == []  # the model ids say where m is from now on
    assert ledger.free("r1", {"gpu": 100}, None) == {"gpu": 70}  # its stats do not show it yet
    ledger.settle("r1", model_ids={"m"}, stats_sizes={"m"}, now=1.0)  # its stats show m now
    assert ledger.free("r1", {"gpu": 70}, None) == {"gpu": 70}
    assert ledger.holders("n", now=9.0) == ["r1"] and ledger.holders("n", now=10.0) == []
    ledger.settle("r1", model_ids=(), stats_sizes=(), now=10.0)
    assert ledger.count("r1") == 0


def test_the_ledger_estimates_a_replica_without_stats_from_the_budget() -> None:
    ledger = Ledger()
    assert ledger.free("r", None, None) is None
    assert ledger.free("r", {}, {"gpu": 100}) == {"gpu": 100}
    ledger.sent("r", "m", {"gpu": 120}, now=0.0)
    assert ledger.free("r", {}, {"gpu": 100}) == {"gpu": 0}


def test_a_model_sent_elsewhere_moves_in_the_ledger() -> None:
    ledger = Ledger()
    ledger.sent("r1", "m", {"gpu": 10}, now=0.0)
    ledger.sent("r2", "m", {"gpu": 10}, now=0.0)  # r1 refused it; r2 took it
    assert ledger.holders("m", now=0.0) == ["r2"]
    assert ledger.free("r1", {"gpu": 50}, None) == {"gpu": 50}
    ledger.forget("r2")
    assert ledger.holders("m", now=0.0) == []


def test_the_routers_of_a_deployment_share_its_books_while_one_holds_them() -> None:
    books = books_for(("app", "d"), expire=10.0, sizes_kept=5)
    assert books_for(("app", "d"), expire=1.0, sizes_kept=1) is books  # the first one's
    assert books.ledger.expire == 10.0 and books.sizes_kept == 5
    assert books_for(("app", "other"), expire=10.0, sizes_kept=5) is not books
    books.book("r", "m", now=0.0, routed=True)
    del books
    gc.collect()
    again = books_for(("app", "d"), expire=10.0, sizes_kept=5)  # no router held them: new
    assert again.ledger.holders("m", now=0.0) == []


def test_a_model_never_seen_is_booked_at_the_mean_of_the_sizes_known() -> None:
    books = books_for(("app", "mean"), expire=10.0, sizes_kept=2)
    books.remember("a", {"gpu": 10})
    books.remember("b", {"gpu": 30, "ram": 4})
    books.remember("c", {"gpu": 50})  # a is forgotten: b and c remain
    assert books.sizes == {"b": {"gpu": 30, "ram": 4}, "c": {"gpu": 50}}
    books.book("r", "new", now=0.0, routed=False)
    assert books.ledger.free("r", {"gpu": 100, "ram": 10}, None) == {"gpu": 60, "ram": 6}


# == attacks ===================================================================
#
# ``rank`` and ``Ledger`` need no Ray. ``BrokerRouter`` (a Ray Serve
# ``RequestRouter``) is built without a cluster: its replicas are fakes with a
# ``replica_id``, the model ids they report and their routing stats, its
# requests Serve's own ``PendingRequest``, its clock a fake one. Each test
# either kept a bug from coming back or pins a property an attack could have
# broken.


# ---------------------------------------------------------------- rank


def test_every_replica_is_ranked_once_holders_first_whatever_it_knows() -> None:
    rng = random.Random(7)
    spaces = ["gpu", "ram"]
    for _ in range(500):
        names = [f"r{i}" for i in range(rng.randint(0, 6))]
        cands = []
        for name in names:
            free: dict[str, int] | None = None
            if rng.random() < 0.7:
                free = {s: rng.randint(0, 100) for s in spaces if rng.random() < 0.8}
            models = ["m"] if rng.random() < 0.2 else []
            cands.append(Candidate(name, models, free, sent=rng.randint(0, 3)))
        size = rng.choice([None, {}, {"gpu": rng.randint(0, 150)}, {"gpu": 10, "ram": 200}])
        holders = [n for n in names if rng.random() < 0.2]
        ranks = rank("m", cands, size=size, holders=holders, rng=rng)
        assert sorted(r for ranked in ranks for r in ranked) == sorted(names)
        assert all(ranks) and len(ranks) <= 3
        held = {c.replica for c in cands if "m" in c.models} | set(holders)
        if held:
            assert set(ranks[0]) == held
        elif names:
            assert len(ranks[0]) == 1  # one replica to load it: the ledger books it there


# ---------------------------------------------------------------- Ledger


def test_stats_older_than_a_booking_do_not_settle_it() -> None:
    # The replica held m, released it (its model ids dropped m at once), and
    # is sent m again before its polled stats, which still list m, are new.
    ledger = Ledger(expire=10.0)
    ledger.sent("a", "m", {"gpu": 10}, now=0.0)
    ledger.settle("a", model_ids=(), stats_sizes={"m"}, now=0.5)
    assert ledger.holders("m", now=0.5) == ["a"]  # it still goes where it was sent
    assert ledger.free("a", {"gpu": 50}, None) == {"gpu": 50}  # those stats count m already
    ledger.settle("a", model_ids={"m"}, stats_sizes={"m"}, now=1.0)
    assert ledger.count("a") == 0  # shown by both: the replica's own reports say it all


def test_a_model_routed_to_a_replica_stays_booked_there_when_it_is_loaded_elsewhere_too() -> None:
    ledger = Ledger()
    ledger.sent("a", "m", {"gpu": 30}, now=0.0, routed=True)  # a request went to a
    ledger.sent("b", "m", {"gpu": 30}, now=1.0)  # another one, its holders busy, is sent to b
    assert sorted(map(str, ledger.holders("m", now=1.0))) == ["a", "b"]
    assert ledger.free("a", {"gpu": 100}, None) == {"gpu": 70}  # a is loading m all the same
    # A booking only chosen moves when its request goes elsewhere (the existing rule).
    ledger.sent("c", "n", {"gpu": 5}, now=1.0)
    ledger.sent("d", "n", {"gpu": 5}, now=1.0, routed=True)
    assert ledger.holders("n", now=1.0) == ["d"]
    assert ledger.free("c", {"gpu": 100}, None) == {"gpu": 100}


def test_a_replica_booked_twice_with_one_model_counts_it_once() -> None:
    ledger = Ledger()
    ledger.sent("a", "m", {"gpu": 30}, now=0.0)  # chosen for a request
    ledger.sent("a", "m", {"gpu": 30}, now=0.1, routed=True)  # and the request went there
    ledger.sent("a", "m", {"gpu": 30}, now=0.2, routed=True)  # and a second one
    assert ledger.count("a") == 1
    assert ledger.free("a", {"gpu": 100}, None) == {"gpu": 70}
    assert ledger.holders("m", now=0.2) == ["a"]


def test_the_ledger_forgets_what_it_sent_to_replicas_it_no_longer_hears_from() -> None:
    # A replica scaled down (not dead: no on_replica_actor_died) is never a
    # candidate again, so never settled: its entries must still go.
    ledger = Ledger(expire=10.0)
    for i in range(1000):
        ledger.sent("gone", f"m{i}", {"gpu": 1}, now=i * 0.001)
    assert ledger.count("gone") == 1000
    ledger.sent("here", "x", {}, now=11.0)
    assert ledger.count("gone") == 0
    assert ledger.holders("m999", now=11.0) == []


def test_many_distinct_models_do_not_grow_the_ledger_past_what_expires() -> None:
    ledger = Ledger(expire=10.0)
    for i in range(20_000):
        now = i * 0.01  # 100 new models a second, 200 s
        replica = f"r{i % 3}"
        ledger.sent(replica, f"m{i}", {"gpu": 1}, now=now)
        if i % 7 == 0:
            ledger.settle(replica, model_ids=(), stats_sizes=(), now=now)
    assert sum(ledger.count(f"r{i}") for i in range(3)) <= 1100  # 10 s of them, and a few


def test_the_ledger_forgets_a_replica_and_only_it() -> None:
    ledger = Ledger()
    ledger.sent("a", "m", {"gpu": 1}, now=0.0, routed=True)
    ledger.sent("b", "m", {"gpu": 1}, now=0.0, routed=True)
    ledger.forget("a")
    ledger.forget("never-seen")
    assert ledger.holders("m", now=0.0) == ["b"] and ledger.count("a") == 0


# ---------------------------------------------------------------- BrokerRouter, faked

ASYNCIO = pytest.mark.parametrize("anyio_backend", [("asyncio", {})], ids=["asyncio"])


class FakeClock:
    """Stands in for the ``time`` module in ``cachebroker.ray._router``."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def router_globals(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The global namespaces BrokerRouter's methods read ``time`` and ``SIZES_KEPT`` from.

    Serve ships a custom router by value (cloudpickle), and unpickling it in
    this process gives the class's methods namespaces of their own: after a
    Ray test here, patching the module is not enough.
    """
    module: ModuleType = pytest.importorskip("cachebroker.ray._router")  # (needs Ray Serve)
    spaces = {id(module.__dict__): module.__dict__}
    for member in vars(module.BrokerRouter).values():
        namespace = getattr(member, "__globals__", None)
        if namespace is not None:
            spaces[id(namespace)] = namespace
    return list(spaces.values())


@pytest.fixture
def clock(router_globals: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    for namespace in router_globals:
        monkeypatch.setitem(namespace, "time", fake)
    return fake


@dataclass
class FakeReplica:
    """What BrokerRouter and Serve's RequestRouter read of a ``RunningReplica``."""

    replica_id: ReplicaID
    multiplexed_model_ids: set[str] = field(default_factory=set)
    routing_stats: Any = field(default_factory=dict)
    max_ongoing_requests: int = 8

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0


def replica(
    name: str,
    models: Sequence[str] = (),
    free: dict[str, int] | None = None,
    sizes: dict[str, dict[str, int]] | None = None,
    *,
    stats: Any = None,
) -> FakeReplica:
    from ray.serve._private.common import DeploymentID
    from ray.serve.request_router import ReplicaID

    if stats is None and free is not None:
        stats = {"cachebroker": {"free": free, "budget": {"gpu": 100}, "sizes": sizes or {}}}
    replica_id = ReplicaID(unique_id=name, deployment_id=DeploymentID(name="d", app_name="app"))
    return FakeReplica(replica_id, set(models), stats if stats is not None else {})


def make_router(
    *replicas: FakeReplica, deployment: str = "", cls: type | None = None, **kwargs: Any
) -> BrokerRouter:
    """A router of its own deployment (sharing no books), or of ``deployment``'s.

    ``cls``: the router class (default ``BrokerRouter``; a copy shipped by value, say).
    """
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from cachebroker.ray._router import BrokerRouter

    router: BrokerRouter = (cls or BrokerRouter)(
        deployment_id=DeploymentID(name=deployment or f"d{next(_ids)}", app_name="app"),
        handle_source=DeploymentHandleSource.UNKNOWN,
    )
    router.initialize_state(**kwargs)
    router.update_replicas(running(replicas))
    return router


def running(replicas: Sequence[FakeReplica]) -> list[RunningReplica]:
    return cast("list[RunningReplica]", list(replicas))


_ids = iter(range(10**9))


def request(model_id: str, created_at: float = 1_000.0) -> PendingRequest:
    from ray.serve._private.common import RequestMetadata
    from ray.serve.request_router import PendingRequest

    n = next(_ids)
    metadata = RequestMetadata(
        request_id=f"r{n}", internal_request_id=f"i{n}", multiplexed_model_id=model_id
    )
    return PendingRequest(args=[], kwargs={}, metadata=metadata, created_at=created_at)


def names(ranks: list[list[RunningReplica]]) -> list[list[str]]:
    return [[r.replica_id.unique_id for r in ranked] for ranked in ranks]


async def route(
    router: BrokerRouter, replicas: Sequence[FakeReplica], pending: PendingRequest, to: str = ""
) -> list[list[str]]:
    """One routing attempt, then the request lands on ``to`` (default: the first ranked)."""
    ranks = await router.choose_replicas(running(replicas), pending)
    chosen = next(r for ranked in ranks for r in ranked if not to or r.replica_id.unique_id == to)
    router.on_request_routed(pending, chosen.replica_id, None)
    return names(ranks)


BAD_STATS: list[Any] = [
    None,
    ["cachebroker"],
    "cachebroker",
    {"cachebroker": "free"},
    {"cachebroker": None},
    {"cachebroker": {}},
    {"cachebroker": {"free": [100]}},
    {"cachebroker": {"free": {"gpu": "lots"}}},
    {"cachebroker": {"free": {"gpu": None}, "budget": {"gpu": None}}},
    {"cachebroker": {"free": {"gpu": 50}, "budget": {"gpu": "100"}}},
    {"cachebroker": {"free": {"gpu": 50}, "sizes": {"m": 5}}},
    {"cachebroker": {"free": {"gpu": 50}, "sizes": ["m"]}},
    {"cachebroker": {"free": {"gpu": 50}, "sizes": {"m": {"gpu": "5"}}}},
    {"cachebroker": {"free": {"gpu": math.nan}}},
    {"cachebroker": {"free": {"gpu": -5}}},
    {"cachebroker": {"free": {"gpu": True}}},
    {"cachebroker": {"free": {3: 5}}},
    {"mine": 1},
]


@ASYNCIO
@pytest.mark.anyio
@pytest.mark.parametrize("stats", BAD_STATS, ids=[repr(s)[:40] for s in BAD_STATS])
async def test_routing_stats_of_another_shape_count_as_none_and_fail_no_request(
    clock: FakeClock, stats: Any
) -> None:
    # Serve hands the router whatever record_routing_stats returned (a
    # deployment's own, a merge gone wrong, another cachebroker version's).
    odd = replica("odd", stats=stats)
    good = replica("good", ["k"], free={"gpu": 60}, sizes={"k": {"gpu": 40}})
    router = make_router(odd, good)
    for model_id in ["m", "new", "other"]:
        ranks = await route(router, [odd, good], request(model_id))
        assert sorted(r for ranked in ranks for r in ranked) == ["good", "odd"]
    assert await route(router, [odd, good], request("k")) == [["good"]]  # its holder


@ASYNCIO
@pytest.mark.anyio
async def test_a_replica_whose_stats_cannot_be_read_counts_as_one_that_reported_none(
    clock: FakeClock,
) -> None:
    odd = replica("odd", stats={"cachebroker": {"free": {"gpu": "lots"}}})
    good = replica("good", ["k"], free={"gpu": 60}, sizes={"k": {"gpu": 40}})
    router = make_router(odd, good)
    # As free as the budget the router knows (good's): the first place to load.
    assert names(await router.choose_replicas(running([odd, good]), request("m"))) == [
        ["odd"],
        ["good"],
    ]


@ASYNCIO
@pytest.mark.anyio
async def test_a_request_queued_long_before_routing_still_waits_for_busy_holders(
    clock: FakeClock,
) -> None:
    a = replica("a", ["m"], free={"gpu": 0})
    b = replica("b", free={"gpu": 100})
    router = make_router(a, b)
    pending = request("m", created_at=970.0)  # queued behind a burst for 30 s
    assert names(await router.choose_replicas(running([a, b]), pending)) == [["a"]]
    clock.now = 1000.5
    assert names(await router.choose_replicas(running([a, b]), pending)) == [["a"]]
    clock.now = 1001.0  # holder_wait_s since its first routing attempt: anywhere now
    assert names(await router.choose_replicas(running([a, b]), pending)) == [["a"], ["b"]]


@ASYNCIO
@pytest.mark.anyio
async def test_without_a_holder_wait_a_request_may_go_anywhere_at_once(clock: FakeClock) -> None:
    a = replica("a", ["m"], free={"gpu": 0})
    b = replica("b", free={"gpu": 100})
    router = make_router(a, b, holder_wait_s=0)
    assert names(await router.choose_replicas(running([a, b]), request("m"))) == [["a"], ["b"]]


@ASYNCIO
@pytest.mark.anyio
async def test_a_model_sent_again_keeps_going_there_while_the_stats_still_list_its_last_load(
    clock: FakeClock,
) -> None:
    # a held m and released it: its model ids say so, its polled stats do not yet.
    a = replica("a", free={"gpu": 60}, sizes={"m": {"gpu": 10}})
    b = replica("b", free={"gpu": 50})
    router = make_router(a, b)
    assert (await route(router, [a, b], request("m")))[0] == ["a"]  # the most room to spare
    # A second request, before a's model ids show m again: a is its holder.
    assert names(await router.choose_replicas(running([a, b]), request("m"))) == [["a"]]


@ASYNCIO
@pytest.mark.anyio
async def test_a_replica_a_request_went_to_stays_a_holder_when_the_next_goes_elsewhere(
    clock: FakeClock,
) -> None:
    # m's size is known from c, which held it; a and b have room for it.
    a = replica("a", free={"gpu": 100})
    b = replica("b", free={"gpu": 100})
    c = replica("c", free={"gpu": 0}, sizes={"m": {"gpu": 30}})
    router = make_router(a, b, c, holder_wait_s=0)
    first = (await route(router, [a, b, c], request("m")))[0][0]
    other = "b" if first == "a" else "a"
    ranks = await route(router, [a, b, c], request("m"), to=other)  # its holder busy
    assert ranks[0] == [first]
    # Both are loading m: both are its holders until their model ids say so.
    ranks = names(await router.choose_replicas(running([a, b, c]), request("m")))
    assert sorted(ranks[0]) == ["a", "b"] and ranks[1:] == [["c"]]


@ASYNCIO
@pytest.mark.anyio
async def test_a_burst_of_models_never_seen_spreads_by_their_estimated_bytes(
    clock: FakeClock,
) -> None:
    # The router knows k's size (30); n1..n4 no replica ever held.
    a = replica("a", ["k"], free={"gpu": 100}, sizes={"k": {"gpu": 30}})
    b = replica("b", free={"gpu": 90})
    router = make_router(a, b)
    went = [(await route(router, [a, b], request(f"n{i}")))[0][0] for i in range(1, 5)]
    # Each counts as 30 bytes where it went: 100 vs 90, 70 vs 90, 70 vs 60, 40 vs 60.
    assert went == ["a", "b", "a", "b"]


@ASYNCIO
@pytest.mark.anyio
async def test_the_router_remembers_a_bounded_number_of_model_sizes(
    clock: FakeClock, router_globals: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    for namespace in router_globals:
        monkeypatch.setitem(namespace, "SIZES_KEPT", 50)
    a = replica("a", free={"gpu": 100})
    router = make_router(a)
    for batch in range(40):  # 400 distinct models held over time, 10 at a time
        held = {f"m{batch}-{i}": {"gpu": 1 + i} for i in range(10)}
        a.routing_stats = {"cachebroker": {"free": {"gpu": 50}, "budget": {}, "sizes": held}}
        await router.choose_replicas(running([a]), request("x"))
    assert len(router._books.sizes) == 50
    assert router._books.size_totals == {"gpu": sum(s["gpu"] for s in router._books.sizes.values())}
    assert router._books.size_counts == {"gpu": 50}
    assert "m39-9" in router._books.sizes and "m0-0" not in router._books.sizes


@ASYNCIO
@pytest.mark.anyio
async def test_a_dead_replica_is_forgotten_as_a_holder_and_a_candidate(clock: FakeClock) -> None:
    a = replica("a", free={"gpu": 100})
    b = replica("b", free={"gpu": 10})
    router = make_router(a, b)
    assert (await route(router, [a, b], request("m")))[0] == ["a"]
    router.on_replica_actor_died(a.replica_id)
    assert list(router.curr_replicas) == [b.replica_id]
    ranks = names(await router.choose_replicas(running([b]), request("m")))
    assert ranks == [["b"]]  # not a holder's wait: a new load, booked on b
    assert router._books.ledger.holders("m", clock.now) == [b.replica_id]


@ASYNCIO
@pytest.mark.anyio
async def test_requests_without_a_model_id_go_to_two_random_replicas_and_book_nothing(
    clock: FakeClock,
) -> None:
    replicas = [replica(n, free={"gpu": 100}) for n in "abc"]
    router = make_router(*replicas)
    for pending in [request(""), None]:
        for _ in range(10):
            ranks = names(await router.choose_replicas(running(replicas), pending))
            assert len(ranks) == 1 and len(set(ranks[0])) == 2
    anonymous = request("")
    router.on_request_routed(anonymous, replicas[0].replica_id, None)
    assert all(router._books.ledger.count(r.replica_id) == 0 for r in replicas)


@ASYNCIO
@pytest.mark.anyio
@pytest.mark.parametrize("wait", [-1, -0.5, math.nan, True, "1", None, [1]])
async def test_holder_wait_must_be_seconds(clock: FakeClock, wait: Any) -> None:
    with pytest.raises(ValueError, match="holder_wait_s"):
        make_router(holder_wait_s=wait)


@ASYNCIO
@pytest.mark.anyio
async def test_unknown_router_arguments_are_refused_by_name(clock: FakeClock) -> None:
    with pytest.raises(TypeError, match="holder_wait, max_lora"):
        make_router(holder_wait=1, max_lora=2)
    for wait in [0, 2, 0.25, math.inf]:
        assert make_router(holder_wait_s=wait)._holder_wait == wait


# ---------------------------------------------------------------- several routers, one deployment
#
# Serve builds a router per handle: each handle passed by value (to a task,
# to another deployment) routes on its own. A burst sent through several of
# them must load each model once, as through one.


async def burst(
    routers: Sequence[BrokerRouter], replicas: Sequence[FakeReplica], models: Sequence[str]
) -> list[tuple[str, str]]:
    """Two first requests per model, each through the next router: (model id, replica) each."""
    went = []
    pending = [request(m) for m in models] * 2
    for i, one in enumerate(pending):
        ranks = await route(routers[i % len(routers)], replicas, one)
        went.append((one.metadata.multiplexed_model_id, ranks[0][0]))
    return went


@ASYNCIO
@pytest.mark.anyio
async def test_the_routers_of_one_deployment_share_their_bookings_and_spread_a_burst_by_bytes(
    clock: FakeClock,
) -> None:
    # a held k (30 bytes), so every router counts a model never seen as 30.
    a = replica("a", ["k"], free={"gpu": 100}, sizes={"k": {"gpu": 30}})
    b = replica("b", free={"gpu": 90})
    routers = [make_router(a, b, deployment="burst") for _ in range(8)]
    went = await burst(routers, [a, b], ["n1", "n2", "n3", "n4"])
    # As through one router: 100 vs 90, 70 vs 90, 70 vs 60, 40 vs 60; then to the holders.
    assert [replica for _, replica in went] == ["a", "b", "a", "b"] * 2
    ledger = routers[0]._books.ledger
    for model_id in ["n1", "n2", "n3", "n4"]:
        assert len(ledger.holders(model_id, clock.now)) == 1, model_id
    # Another deployment's routers share nothing with these.
    assert make_router(a, b)._books is not routers[0]._books


@ASYNCIO
@pytest.mark.anyio
async def test_a_first_burst_through_several_routers_loads_each_model_once(
    clock: FakeClock,
) -> None:
    # Replicas that have reported nothing yet: ties, broken at random.
    for n in range(20):
        replicas = [replica("a"), replica("b")]
        routers = [make_router(*replicas, deployment=f"fresh{n}") for _ in range(8)]
        went = await burst(routers, replicas, ["m1", "m2", "m3", "m4"])
        where = {model_id: {r for m, r in went if m == model_id} for model_id, _ in went}
        assert all(len(places) == 1 for places in where.values()), where  # loaded once each
        per_replica = [r for places in where.values() for r in places]
        assert sorted(per_replica) == ["a", "a", "b", "b"], where  # two models each


@ASYNCIO
@pytest.mark.anyio
async def test_router_classes_shipped_by_value_share_their_deployments_books(
    clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Serve has cloudpickle pickle the module the router class says it is
    # from (cachebroker.ray), and every module below it, by value: each
    # process that unpickles it has copies of their globals.
    import importlib
    import weakref

    from ray import cloudpickle

    from cachebroker.ray import BrokerRouter, _router

    module = importlib.import_module(BrokerRouter.__module__)  # (as Serve finds it)
    assert module.__name__ == "cachebroker.ray"
    cloudpickle.register_pickle_by_value(module)  # type: ignore[no-untyped-call]
    try:
        shipped = cloudpickle.dumps(BrokerRouter)  # type: ignore[no-untyped-call]
    finally:
        cloudpickle.unregister_pickle_by_value(module)  # type: ignore[no-untyped-call]
    # Unpickled as in a process that did not pickle it (cloudpickle would
    # otherwise hand back the class it pickled).
    tracked: Any = weakref.WeakValueDictionary()
    monkeypatch.setattr(cloudpickle.cloudpickle, "_DYNAMIC_CLASS_TRACKER_BY_ID", tracked)
    copy = cloudpickle.loads(shipped)
    assert copy is not BrokerRouter
    assert copy.choose_replicas.__globals__ is not vars(_router)
    monkeypatch.setitem(copy.choose_replicas.__globals__, "time", clock)
    a = replica("a", free={"gpu": 100})
    b = replica("b", free={"gpu": 100})
    first = make_router(a, b, deployment="shipped", cls=copy)
    second = make_router(a, b, deployment="shipped")
    went = (await route(first, [a, b], request("m")))[0][0]
    assert names(await second.choose_replicas(running([a, b]), request("m"))) == [[went]]
