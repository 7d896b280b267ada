"""The cost of one eviction decision, as resident entries and the candidate pool grow.

Drives each policy directly (no broker, no event loop), with N resident idle
entries of mixed sizes (1-100 units) and reload costs (0.5-90 s) under Zipf(1)
requests: each round requests an entry (a hit), then asks for victims
covering a shortfall of 1-200 units, evicts them and admits as many new
entries, so that N stays the same. Reported: microseconds per decision
(``victims`` plus the removals and admissions it causes), median of rounds,
at N = 100, 10,000 and 100,000, for ``cost`` with its victim pool
(``candidates``) at 24 (the default), 96 and 384, and for lru and gdsf. The
ratio to N = 100 is the O(log n) bar (the same bar as ``scaling.py``, which
goes through the broker).

    python benchmarks/victim_search.py [--rounds 5] [--decisions 2000] [--json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Mapping

from cachebroker import GDSF, LRU, CostAware, PolicyBase

SIZES = (100, 10_000, 100_000)
CANDIDATES = (24, 96, 384)


class Entry:
    """An entry as a policy sees it."""

    __slots__ = ("cache", "charge", "cost", "idle_seq", "key", "last_request", "requests")

    def __init__(self, key: int, size: int, cost: float) -> None:
        self.key = key
        self.cache = "c"
        self.charge = {"default": size}
        self.cost = cost
        self.requests = 0
        self.last_request = 0
        self.idle_seq = 1

    @property
    def idle(self) -> bool:
        return True


def decision_us(make: Callable[[], PolicyBase], entries: int, decisions: int, seed: int) -> float:
    rng = random.Random(seed)
    policy = make()
    clock = itertools.count(1)
    fresh = itertools.count()
    resident: list[Entry] = []

    def admit() -> Entry:
        entry = Entry(next(fresh), rng.randint(1, 100), rng.choice((0.5, 2.0, 8.0, 25.0, 90.0)))
        entry.requests = 1
        entry.last_request = next(clock)
        policy.touch(entry)
        policy.admit(entry)
        policy.idle(entry)
        return entry

    for _ in range(entries):
        resident.append(admit())
    position = {entry.key: i for i, entry in enumerate(resident)}
    weights = list(itertools.accumulate(1 / (rank + 1) for rank in range(entries)))
    shortfalls: list[Mapping[str, int]] = [
        {"default": rng.randint(1, 200)} for _ in range(decisions)
    ]
    hits = rng.choices(range(entries), cum_weights=weights, k=decisions)
    started = time.perf_counter()
    for shortfall, hit in zip(shortfalls, hits, strict=True):
        entry = resident[hit]
        entry.requests += 1
        entry.last_request = next(clock)
        policy.busy(entry)
        policy.touch(entry)
        policy.idle(entry)
        victims = policy.victims(shortfall)
        evicted = getattr(policy, "evicted", None)
        if evicted is not None:
            evicted(victims, shortfall)
        for victim in victims:
            policy.busy(victim)
            policy.remove(victim)
            # Its place goes to a new entry (and its popularity rank with it).
            replacement = admit()
            resident[position[victim.key]] = replacement
            position[replacement.key] = position.pop(victim.key)
    return (time.perf_counter() - started) / decisions * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--decisions", type=int, default=2000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    makers: dict[str, Callable[[], PolicyBase]] = {
        **{
            f"cost candidates={n}": (lambda n=n: CostAware(candidates=n))  # type: ignore[misc]
            for n in CANDIDATES
        },
        "lru": LRU,
        "gdsf": GDSF,
    }
    figures: dict[str, dict[int, float]] = {name: {} for name in makers}
    for entries in SIZES:
        samples: dict[str, list[float]] = {name: [] for name in makers}
        for round_ in range(args.rounds):
            for name, make in makers.items():  # interleaved, so drift hits all alike
                samples[name].append(decision_us(make, entries, args.decisions, round_))
        for name in makers:
            figures[name][entries] = statistics.median(samples[name])
    if args.json:
        json.dump(figures, sys.stdout, indent=2)
        print()
        return 0
    print(f"µs per eviction decision, median of {args.rounds} rounds of {args.decisions:,}")
    print(f"{'policy':<22}" + "".join(f"{f'N={n:,}':>12}" for n in SIZES) + f"{'ratio':>9}")
    for name, by_size in figures.items():
        ratio = by_size[SIZES[-2]] / by_size[SIZES[0]]
        cells = "".join(f"{by_size[n]:>12.1f}" for n in SIZES)
        print(f"{name:<22}{cells}{ratio:>8.2f}x  (10,000 / 100)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
