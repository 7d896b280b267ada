"""An ASGI inference service: one broker in the app's lifespan, two model plugins.

Run it with any ASGI server, e.g. ``uvicorn asgi_service:app``; the test suite
drives it in-process with httpx. The "models" are buffers standing in for
real weights: speech models of 24 MiB and text models of 32 MiB under a 64 MiB
budget, so concurrent requests for different models must take turns, and
``/metrics`` shows the evictions; ``/debug/entries`` lists what is loaded
(``broker.entries()``; keep it on an internal port). The broker's errors
become HTTP statuses (``broker_error``): 413 for a model that can never fit,
503 with ``Retry-After`` for a request that timed out waiting, 503 when
memory ran out, 500 for a deadlock (a bug in the service).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import cachebroker
from cachebroker.metrics import instrument

MiB = 2**20
#: Seconds a request waits for its model (space, then the load) before a 503.
ACQUIRE_TIMEOUT = 30.0
#: Seconds a client is told to wait before retrying after that 503.
RETRY_AFTER = 5


class Model:
    """Stands in for loaded weights: a buffer that ``unload`` gives back."""

    def __init__(self, name: str, size: int) -> None:
        self.name = name
        self.weights: bytearray | None = bytearray(size)

    def unload(self) -> None:
        self.weights = None

    def run(self, text: str) -> str:
        assert self.weights is not None, f"{self.name} was used after it was released"
        return f"{self.name}: {text[::-1]}"


class ModelPlugin:
    """A plugin owning one family of models (a cachebroker Releaser)."""

    def __init__(self, family: str, size: int) -> None:
        self.family = family
        self.size = size
        self.loaded: set[str] = set()

    async def load(self, name: str) -> Model:
        await anyio.sleep(0.01)  # reading weights from disk
        self.loaded.add(name)
        return Model(f"{self.family}/{name}", self.size)

    async def release(self, name: str, model: Model) -> None:
        model.unload()  # runs in this plugin's task group, when the broker asks
        self.loaded.discard(name)


speech = ModelPlugin("speech", 24 * MiB)
text = ModelPlugin("text", 32 * MiB)


async def infer(request: Request, cache: cachebroker.Cache, plugin: ModelPlugin) -> JSONResponse:
    name = request.path_params["model"]
    body = (await request.body()).decode()
    load = lambda: plugin.load(name)  # noqa: E731 - the loader takes no argument
    async with cache.acquire(name, load=load, size=plugin.size, timeout=ACQUIRE_TIMEOUT) as lease:
        await anyio.sleep(0.005)  # inference holds the lease
        return JSONResponse({"output": lease.value.run(body)})


async def transcribe(request: Request) -> JSONResponse:
    return await infer(request, request.app.state.speech, speech)


async def generate(request: Request) -> JSONResponse:
    return await infer(request, request.app.state.text, text)


async def broker_error(request: Request, exc: Exception) -> JSONResponse:
    """Answer a request that failed in the broker with the HTTP status that says why."""
    headers: dict[str, str] = {}
    if isinstance(exc, cachebroker.RequestTooLarge):
        status = 413  # the model exceeds the whole budget: no retry will ever fit it
    elif isinstance(exc, cachebroker.AcquireTimeout):
        status = 503  # busy: other requests hold the memory (or the load was slow)
        headers["Retry-After"] = str(RETRY_AFTER)
    elif isinstance(exc, cachebroker.OutOfSpace):
        # Nothing left to free: the device is full from outside, or quarantined
        # entries hold the memory. 503, not 507: 507 (Insufficient Storage) is
        # WebDAV's, and clients and load balancers know 503 as "this instance
        # cannot serve now"; no Retry-After, since nobody knows when it will.
        status = 503
    else:  # DeadlockError and the rest: a bug in this service, not the client's doing
        return JSONResponse({"error": "internal error"}, status_code=500)
    body = {"error": type(exc).__name__, "detail": str(exc)}
    return JSONResponse(body, status_code=status, headers=headers)


async def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.registry), media_type=CONTENT_TYPE_LATEST)


async def debug_entries(request: Request) -> JSONResponse:
    """What is loaded, entry by entry (one snapshot of the books), for operators."""
    broker: cachebroker.Broker = request.app.state.broker
    return JSONResponse(
        [
            {
                "cache": entry.cache,
                "key": entry.key,  # (this service's keys are strings)
                "state": entry.state,
                "bytes": dict(entry.charge),
                "leases": entry.leases,
                "waiting": entry.waiting,
                "pinned": entry.pinned,
                "idle_seconds": entry.idle_seconds,
                "loads": entry.loads,
                "load_seconds": entry.load_seconds,
            }
            for entry in await broker.entries()
        ]
    )


@asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    async with cachebroker.Broker(budget="64MiB", idle_ttl=300) as broker:
        async with broker.cache("speech", speech) as speech_cache:
            async with broker.cache("text", text) as text_cache:
                app.state.registry = CollectorRegistry()
                instrument(broker, app.state.registry)
                app.state.broker = broker
                app.state.speech, app.state.text = speech_cache, text_cache
                yield


app = Starlette(
    routes=[
        Route("/transcribe/{model}", transcribe, methods=["POST"]),
        Route("/generate/{model}", generate, methods=["POST"]),
        Route("/metrics", metrics),
        Route("/debug/entries", debug_entries),
    ],
    lifespan=lifespan,
    exception_handlers={cachebroker.BrokerError: broker_error},
)
