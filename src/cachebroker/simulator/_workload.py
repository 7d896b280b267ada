"""The built-in workload of ``cachebroker simulate``: a real arrival trace, real model sizes.

Arrival times and request sizes come from the "code" sample of the Azure LLM
inference trace 2023 (Azure/AzurePublicDataset, CC-BY 4.0; Patel et al.,
"Splitwise: Efficient generative LLM inference using phase splitting",
ISCA 2024), shipped derived in ``data/azure_llm_2023_code.csv`` (see the
README beside it). The trace names no models, so each request is assigned
one from ``CATALOGUE`` by a Zipf(1) popularity over a seeded shuffle of it,
and holds its lease for as long as its tokens take to process (prompt
tokens at ``PREFILL_TOKENS_PER_S``, generated ones at
``DECODE_TOKENS_PER_S``). With a memory tier (host RAM below the GPU),
moving a model back up takes ``PROMOTE_OVERHEAD_S`` plus its bytes at
``HOST_TO_DEVICE_BYTES_PER_S`` (0.11 s for MiniLM, 3.6 s for Llama 3 70B at
4 bits, against 0.4 and 90 s from storage), and moving it down as long.

The trace is one hour of a cluster-wide service, 2.4 requests/s; one node
serving a dozen models that take up to 90 s to load would spend its life
waiting for loads at that rate. So the built-in workload takes the first
2,000 requests with their arrival gaps stretched ``TIME_SCALE`` times (one
request every ~25 s on average, bursts kept): requests still sometimes wait
for space at the small budgets, but what the figures compare is mostly the
policies' choices.
"""

from __future__ import annotations

import csv
import random
from importlib import resources

from .._errors import InvalidArgument
from .._units import DEFAULT_SPACE
from ._request import Request

__all__ = ["BUDGETS", "CATALOGUE", "builtin_workload"]

GB = 10**9
GiB = 2**30

#: (name, bytes, load seconds). Sizes are the published checkpoint file sizes
#: on the Hugging Face Hub (sentence-transformers/all-MiniLM-L6-v2,
#: openai/whisper-base, BAAI/bge-large-en-v1.5, openai/clip-vit-large-patch14,
#: runwayml/stable-diffusion-v1-5 fp16, openai/whisper-large-v3,
#: TheBloke/Mistral-7B-Instruct-v0.2-GGUF Q4_K_M,
#: QuantFactory/Meta-Llama-3-8B-Instruct-GGUF Q4_K_M,
#: stabilityai/stable-diffusion-xl-base-1.0 fp16, microsoft/Phi-3-medium Q4_K_M,
#: meta-llama/Meta-Llama-3-8B-Instruct bf16, Meta-Llama-3-70B-Instruct Q4_K_M).
#: Load times assume ~1.5 GB/s from local NVMe plus initialisation.
CATALOGUE: tuple[tuple[str, int, float], ...] = (
    ("all-MiniLM-L6-v2", int(0.09 * GB), 0.4),
    ("whisper-base", int(0.15 * GB), 0.8),
    ("bge-large-en-v1.5", int(1.34 * GB), 2.5),
    ("clip-vit-large-patch14", int(1.71 * GB), 3.0),
    ("stable-diffusion-v1-5", int(2.13 * GB), 4.0),
    ("whisper-large-v3", int(3.09 * GB), 5.5),
    ("mistral-7b-instruct-q4_k_m", int(4.37 * GB), 7.0),
    ("llama-3-8b-instruct-q4_k_m", int(4.92 * GB), 8.0),
    ("stable-diffusion-xl-base-1.0", int(6.94 * GB), 12.0),
    ("phi-3-medium-q4_k_m", int(7.96 * GB), 13.0),
    ("llama-3-8b-instruct-fp16", int(16.06 * GB), 25.0),
    ("llama-3-70b-instruct-q4_k_m", int(42.52 * GB), 90.0),
)

#: The budgets swept by default: the largest model always fits, the whole
#: catalogue (85 GiB) never does.
BUDGETS: tuple[int, ...] = (48 * GiB, 56 * GiB, 64 * GiB, 72 * GiB, 80 * GiB)

#: Host-to-device copy rate of a promotion from RAM (PCIe 4.0 x16 from pinned
#: memory: ~12 GB/s of its 25 GB/s in practice), and what it costs besides.
HOST_TO_DEVICE_BYTES_PER_S = 12 * GB
PROMOTE_OVERHEAD_S = 0.1
PREFILL_TOKENS_PER_S = 5000.0
DECODE_TOKENS_PER_S = 40.0
REQUESTS = 2000
TIME_SCALE = 60.0
#: Requests in the shipped trace file.
TRACE_REQUESTS = 8818


def builtin_workload(
    seed: int = 1, *, requests: int = REQUESTS, time_scale: float = TIME_SCALE
) -> list[Request]:
    """The built-in workload (see the module docstring).

    Args:
        seed: Chooses the shuffle of the catalogue and each request's model.
        requests: How many of the trace's requests to take, from the first
            (at most 8,818).
        time_scale: Stretch the arrival times this many times.
    """
    if not 1 <= requests <= TRACE_REQUESTS:
        raise InvalidArgument(
            f"requests must be between 1 and {TRACE_REQUESTS} (the trace's length), "
            f"got {requests!r}"
        )
    if not time_scale > 0 or time_scale == float("inf"):
        raise InvalidArgument(f"time_scale must be a positive number, got {time_scale!r}")

    rng = random.Random(seed)
    models = list(CATALOGUE)
    rng.shuffle(models)
    weights = [1 / rank for rank in range(1, len(models) + 1)]
    source = resources.files("cachebroker.simulator").joinpath("data/azure_llm_2023_code.csv")
    picked: list[Request] = []
    for row in csv.DictReader(source.read_text(encoding="utf-8").splitlines()):
        if len(picked) >= requests:
            break
        name, size, load_seconds = rng.choices(models, weights)[0]
        hold = (
            int(row["context_tokens"]) / PREFILL_TOKENS_PER_S
            + int(row["generated_tokens"]) / DECODE_TOKENS_PER_S
        )
        picked.append(
            Request(
                time=float(row["seconds"]) * time_scale,
                key=name,
                size={DEFAULT_SPACE: size},
                load_seconds=load_seconds,
                hold_seconds=round(hold, 3),
                line=len(picked) + 2,
                promote_seconds=round(PROMOTE_OVERHEAD_S + size / HOST_TO_DEVICE_BYTES_PER_S, 3),
            )
        )
    return picked
