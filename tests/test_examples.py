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
    evicted = re.search(r'^cachebroker_evictions_total\{reason="capacity"\} (\S+)$', metrics, re.M)
    assert evicted is not None and float(evicted.group(1)) >= 2
    assert "cachebroker_space_wait_seconds_count" in metrics
    assert service.speech.loaded == set() and service.text.loaded == set()  # closed: released


async def test_thread_plugin_calls_its_library_from_one_thread() -> None:
    recipe = load_example("thread_plugin")
    library = await recipe.main()
    assert library.calls >= 8  # loads and frees, every one on the library's thread
    assert not library.handles
