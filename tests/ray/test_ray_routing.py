"""BrokerRouter's ranking and ledger, without Ray: holders, then where the model fits."""

from __future__ import annotations

import gc
import random

from cachebroker.ray._routing import Candidate, Ledger, books_for, rank


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
