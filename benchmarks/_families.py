"""Development traces for policy quality, in three families (shared by the benchmarks).

Every trace has 2,000 requests, whose order is what the sequential model
sees; their models are drawn by a Zipf popularity over a seeded shuffle of a
catalogue, and the hold and arrival times come from the Azure LLM inference
trace the built-in workload uses (``builtin_workload``), so that the same
traces replay in timed mode too.

* ``base``: the built-in 12-model catalogue (0.09-42.5 GB), Zipf exponents
  0.6, 0.8, 1.0 and 1.2, stationary.
* ``moving``: the same catalogue, Zipf 0.8-1.2, with the popularity ranking
  moving: rotated by 3 models every 300 requests, or a random pair of ranks
  swapped every 40 requests.
* ``large``: catalogues of 20 to 40 models drawn from ``LARGE_CATALOGUE``
  (the base 12 and 28 more, 0.1-141 GB), Zipf 0.6-1.2, four of them
  stationary, one with a rotating ranking and one with ranks swapped.

The base and moving traces are measured at 48, 64 and 80 GiB (the largest
model is 42.5 GB, the catalogue 85 GB); the large ones at 30%, 45% and 60%
of the bytes of all their models, and never less than their largest.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence

import attrs

from cachebroker.simulator import CATALOGUE, Request, builtin_workload

GB = 10**9

#: (name, bytes, load seconds): published checkpoint sizes; load seconds
#: about 0.4 s plus 1.7 s/GB, as the base catalogue's.
_MORE = (
    ("resnet-50", 0.10),
    ("distilbert-base-uncased", 0.27),
    ("bert-base-uncased", 0.44),
    ("whisper-small", 0.48),
    ("multilingual-e5-large", 1.12),
    ("whisper-medium", 1.53),
    ("bart-large-cnn", 1.63),
    ("t5-large", 2.95),
    ("stable-diffusion-2-1", 5.21),
    ("bark", 5.35),
    ("stable-diffusion-xl-refiner-1.0", 6.08),
    ("phi-3-mini-4k-instruct", 7.64),
    ("llama-3.1-8b-instruct-q8_0", 8.54),
    ("deepseek-coder-v2-lite-q4_k_m", 10.36),
    ("flux.1-schnell-fp8", 11.9),
    ("llava-v1.6-mistral-7b", 15.13),
    ("qwen2.5-7b-instruct", 15.23),
    ("gemma-2-27b-it-q4_k_m", 16.65),
    ("gemma-2-9b-it", 18.48),
    ("codellama-34b-instruct-q4_k_m", 20.22),
    ("yi-34b-chat-q4_k_m", 20.66),
    ("c4ai-command-r-v01-q4_k_m", 21.53),
    ("mistral-nemo-instruct-2407", 24.5),
    ("mixtral-8x7b-instruct-q4_k_m", 26.44),
    ("qwen2-72b-instruct-q4_k_m", 47.42),
    ("mixtral-8x22b-instruct-q4_k_m", 85.59),
    ("deepseek-v2-lite-chat", 31.4),
    ("llama-3-70b-instruct-fp16", 141.1),
)

LARGE_CATALOGUE: tuple[tuple[str, int, float], ...] = CATALOGUE + tuple(
    (name, int(gb * GB), round(0.4 + 1.7 * gb, 1)) for name, gb in _MORE
)

REQUESTS = 2000
SHARES = (0.30, 0.45, 0.60)
BASE_BUDGETS = (48 * 2**30, 64 * 2**30, 80 * 2**30)


@attrs.frozen
class Trace:
    """One development trace and the budgets it is measured at."""

    family: str
    name: str
    requests: list[Request]
    budgets: tuple[int, ...]


def _zipf(models: Sequence[tuple[str, int, float]], exponent: float) -> list[float]:
    return [1 / (rank + 1) ** exponent for rank in range(len(models))]


def _stationary(
    rng: random.Random, models: list[tuple[str, int, float]], exponent: float
) -> Iterator[tuple[str, int, float]]:
    weights = _zipf(models, exponent)
    while True:
        yield from rng.choices(models, weights, k=100)


def _rotating(
    rng: random.Random,
    models: list[tuple[str, int, float]],
    exponent: float,
    period: int = 300,
    shift: int = 3,
) -> Iterator[tuple[str, int, float]]:
    weights = _zipf(models, exponent)
    n = 0
    while True:
        if n and n % period == 0:
            models = models[shift:] + models[:shift]
        yield rng.choices(models, weights)[0]
        n += 1


def _swapping(
    rng: random.Random, models: list[tuple[str, int, float]], exponent: float, period: int = 40
) -> Iterator[tuple[str, int, float]]:
    weights = _zipf(models, exponent)
    models = list(models)
    n = 0
    while True:
        if n and n % period == 0:
            i, j = rng.sample(range(len(models)), 2)
            models[i], models[j] = models[j], models[i]
        yield rng.choices(models, weights)[0]
        n += 1


Picker = Callable[
    [random.Random, list[tuple[str, int, float]], float], Iterator[tuple[str, int, float]]
]


def _trace(
    family: str,
    name: str,
    seed: int,
    catalogue: Sequence[tuple[str, int, float]],
    exponent: float,
    pick: Picker,
) -> Trace:
    rng = random.Random(seed)
    models = list(catalogue)
    rng.shuffle(models)
    picks = pick(rng, models, exponent)
    timing = builtin_workload(seed, requests=REQUESTS)
    requests = []
    for row, (key, size, seconds) in zip(timing, picks, strict=False):  # picks never end
        requests.append(
            attrs.evolve(
                row,
                key=key,
                size={"default": size},
                load_seconds=seconds,
                promote_seconds=round(0.1 + size / (12 * GB), 3),
            )
        )
    if catalogue is CATALOGUE:
        budgets: tuple[int, ...] = BASE_BUDGETS
    else:
        total = sum(size for _, size, _ in catalogue)
        largest = max(size for _, size, _ in catalogue)
        budgets = tuple(max(int(total * share), largest) for share in SHARES)
    return Trace(family, name, requests, budgets)


def traces(families: Sequence[str] = ("base", "moving", "large")) -> list[Trace]:
    """The development traces of ``families``, in a fixed order."""
    made: list[Trace] = []
    if "base" in families:
        for i, s in enumerate((0.6, 0.8, 1.0, 1.2)):
            made.append(_trace("base", f"zipf {s:g}", 100 + i, CATALOGUE, s, _stationary))
    if "moving" in families:
        for i, s in enumerate((0.8, 1.2)):
            made.append(_trace("moving", f"rotate {s:g}", 200 + i, CATALOGUE, s, _rotating))
            made.append(_trace("moving", f"swap {s:g}", 210 + i, CATALOGUE, s, _swapping))
    if "large" in families:
        plan = (
            (20, 1.0, _stationary),
            (26, 0.8, _stationary),
            (32, 1.2, _stationary),
            (40, 0.6, _stationary),
            (24, 1.0, _rotating),
            (34, 0.9, _swapping),
        )
        for i, (n, s, pick) in enumerate(plan):
            rng = random.Random(300 + i)
            extra = rng.sample(LARGE_CATALOGUE[len(CATALOGUE) :], n - len(CATALOGUE))
            kind = {"_stationary": "zipf", "_rotating": "rotate", "_swapping": "swap"}[
                pick.__name__
            ]
            made.append(
                _trace(
                    "large", f"{n} models {kind} {s:g}", 300 + i, CATALOGUE + tuple(extra), s, pick
                )
            )
    return made
