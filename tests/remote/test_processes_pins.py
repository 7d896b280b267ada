"""A real process's pinned entry, as ``cachebroker ps`` shows it: pinned, with no lease."""

from __future__ import annotations

import sys

import anyio
import pytest

from tests.remote.processes import Procs, one_backend

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(
        not sys.platform.startswith("linux"), reason="Unix sockets with SO_PEERCRED, /proc"
    ),
]


@one_backend
async def test_ps_shows_a_processs_pin_as_a_pin_not_a_lease(procs: Procs) -> None:
    with anyio.fail_after(60):
        await procs.daemon("m=100")
        client = procs.steps(
            "pinner",
            {"do": "connect", "cache": "whisper"},
            {"do": "acquire", "key": "a", "size": 60, "pin": True, "hold": False},
            {"do": "wait", "signal": "done"},
        )
        await client.wait_for("acquired", key="a")
        while True:
            entries = (await procs.listing())["entries"]
            if [(e["pinned"], e["leases"]) for e in entries] == [(True, 0)]:
                break
            await anyio.sleep(0.01)
        status, out, _ = await procs.ps()
        assert status == 0
        (row,) = [line.split() for line in out.splitlines() if line.startswith(str(client.pid))]
        at = row.index("pinned")
        assert (row[at - 1], row[at + 1]) == ("ready", "0"), row  # STATE ready pinned, LEASES 0
        procs.signal("done")
        assert await client.exit() == 0
