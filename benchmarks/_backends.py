"""The event loops the benchmarks run on, by the name given on their command lines."""

from __future__ import annotations

from typing import Any

BACKENDS: dict[str, tuple[str, dict[str, Any]]] = {
    "asyncio": ("asyncio", {}),
    "uvloop": ("asyncio", {"use_uvloop": True}),
    "trio": ("trio", {}),
}
