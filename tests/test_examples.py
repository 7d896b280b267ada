"""The recipes under docs/examples run, on every backend (the torch one: ``nox -s torch``)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import anyio
import httpx
import pytest

EXAMPLES = Path(__file__).parent.parent / "docs" / "examples"

pytestmark = pytest.mark.anyio


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


async def test_asgi_service_serves_concurrent_models_under_a_tight_budget() -> None:
    service = load_example("asgi_service")
    app = service.app
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            results: dict[str, httpx.Response] = {}

            async def call(path: str, body: str) -> None:
                results[path + body] = await client.post(path, content=body)

            # Four models of 24-32 MiB against a 64 MiB budget, all at once, twice.
            async with anyio.create_task_group() as tg:
                for round_ in "12":
                    for path in (
                        "/transcribe/whisper-base",
                        "/transcribe/whisper-large",
                        "/generate/llama",
                        "/generate/mistral",
                    ):
                        tg.start_soon(call, path, f"hello {round_}")
            assert len(results) == 8
            for key, response in results.items():
                assert response.status_code == 200, (key, response.text)
                assert response.json()["output"].endswith(key[-7:][::-1])
            metrics = (await client.get("/metrics")).text
            entries = (await client.get("/debug/entries")).json()
    evicted = re.search(r'^cachebroker_evictions_total\{reason="capacity"\} (\S+)$', metrics, re.M)
    assert evicted is not None and float(evicted.group(1)) >= 2
    assert "cachebroker_space_wait_seconds_count" in metrics
    assert service.speech.loaded == set() and service.text.loaded == set()  # closed: released
    # What the last requests left loaded: idle, within the budget, each loaded once or more.
    assert entries and all(e["state"] == "ready" and e["leases"] == 0 for e in entries)
    assert sum(sum(e["bytes"].values()) for e in entries) <= 64 * service.MiB
    assert {e["cache"] for e in entries} <= {"speech", "text"}
    assert all(e["loads"] >= 1 and e["idle_seconds"] >= 0 for e in entries)
    assert [(e["cache"], e["key"]) for e in entries] == sorted(
        (e["cache"], e["key"]) for e in entries
    )


async def test_asgi_service_answers_broker_errors_with_http_statuses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    service = load_example("asgi_service")
    app, MiB = service.app, service.MiB
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            # A model above the whole 64 MiB budget: 413, naming it.
            monkeypatch.setattr(service.text, "size", 128 * MiB)
            too_large = await client.post("/generate/giant", content="hi")
            assert too_large.status_code == 413, too_large.text
            assert too_large.json()["error"] == "RequestTooLarge"
            assert "text:'giant' needs 128.0 MiB" in too_large.json()["detail"]
            monkeypatch.setattr(service.text, "size", 32 * MiB)

            # Out of memory with nothing left to free: 503, no promise of when.
            async def out_of_memory(name: str) -> object:
                raise MemoryError

            monkeypatch.setattr(service.speech, "load", out_of_memory)
            full = await client.post("/transcribe/whisper-base", content="hi")
            assert (full.status_code, full.json()["error"]) == (503, "OutOfSpace"), full.text
            assert "retry-after" not in full.headers
            monkeypatch.undo()

            # Other requests hold the memory: a timeout, 503 with Retry-After.
            held, done = anyio.Event(), anyio.Event()
            speech_cache, text_cache = app.state.speech, app.state.text

            async def hold() -> None:
                load = service.speech.load
                async with speech_cache.acquire("a", load=lambda: load("a"), size=24 * MiB):
                    async with text_cache.acquire("b", load=lambda: load("b"), size=32 * MiB):
                        held.set()
                        await done.wait()

            monkeypatch.setattr(service, "ACQUIRE_TIMEOUT", 0.05)
            async with anyio.create_task_group() as tg:
                tg.start_soon(hold)
                await held.wait()
                busy = await client.post("/generate/llama", content="hi")
                done.set()
            assert (busy.status_code, busy.json()["error"]) == (503, "AcquireTimeout"), busy.text
            assert busy.headers["retry-after"] == str(service.RETRY_AFTER)
            assert "text:'llama'" in busy.json()["detail"]

            # The service's own bug (a handler holding what it waits for): 500, no details.
            async with text_cache.acquire("c", load=lambda: service.text.load("c"), size=48 * MiB):
                stuck = await client.post("/generate/llama", content="hi")  # in this task
            assert (stuck.status_code, stuck.json()) == (500, {"error": "internal error"})


async def test_thread_plugin_calls_its_library_from_one_thread() -> None:
    recipe = load_example("thread_plugin")
    library = await recipe.main()
    assert library.calls >= 8  # loads and frees, every one on the library's thread
    assert not library.handles
