"""``Runner.submit`` and ``Slot.watch``: a request stepped with no task waiting for it
(how the daemon relays a process's acquire), and a block asked at once (``Elsewhere``).

Run on an in-process broker's runner (``Broker._relay``): the grant and the
release are asked in the very step that decides them, and the watcher hears
the ticket's outcome once the step's effects are applied.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import anyio
import pytest
from anyio.lowlevel import checkpoint

from cachebroker import Broker
from cachebroker._core import Request, State, Ticket

pytestmark = pytest.mark.anyio


class Told:
    """An ``Elsewhere`` that records what it is told, in order."""

    def __init__(self) -> None:
        self.said: list[tuple[str, Hashable]] = []

    def granted(self, key: Hashable, space: str | None) -> None:
        self.said.append(("granted", key))

    def releasing(self, key: Hashable) -> None:
        self.said.append(("releasing", key))


async def _release(key: Hashable, value: Any) -> None:
    await checkpoint()


async def _settle(ticket: Ticket) -> None:
    """Let the broker's tasks run until ``ticket`` is settled (bounded by steps)."""
    for _ in range(100):
        if ticket.outcome is not None:
            return
        await anyio.wait_all_tasks_blocked()
        await checkpoint()
    raise AssertionError(f"{ticket.entry!r} never settled")


async def test_a_submitted_request_is_asked_in_its_step_and_heard_by_its_watcher() -> None:
    async with Broker(budget=100) as broker:
        relay = broker._relay
        told = Told()
        block = await relay.open_block("p", _release, elsewhere=told)
        gate = anyio.Event()

        async def load() -> str:
            await gate.wait()
            return "A"

        a = relay.submit(block.owner, Request("a", {"default": 60}, load=load), task="ha")
        # Granted in this very step: the block is told before any task ran.
        assert told.said == [("granted", "a")]
        assert a.outcome is None and a.entry.state is State.LOADING
        heard: list[tuple[object, State]] = []
        a.entry.shell.watch(lambda: heard.append((a.outcome, a.entry.state)))
        gate.set()
        await _settle(a)
        # Once, after the step's effects: the entry is ready, leased to the holder given.
        assert heard == [(True, State.READY)]
        assert a.entry.leases == 1 and a.task == "ha"

        core = relay.core
        core.lease_end(a.entry, "ha", relay.clock())
        relay.apply()
        b = relay.submit(block.owner, Request("b", {"default": 60}, load=load), task="hb")
        # a's bytes are needed: its release is asked in the step that decided it.
        assert told.said == [("granted", "a"), ("releasing", "a")]
        assert b.outcome is None and b.entry.state is State.WAITING
        await _settle(b)
        assert b.outcome is True and told.said[-1] == ("granted", "b")
        core.lease_end(b.entry, "hb", relay.clock())
        relay.apply()
        await relay.close_block(block, None, None, None)
        core.check()


async def test_a_withdrawn_request_is_never_heard_of_again() -> None:
    """A waiting ticket withdrawn (``Core.leave``, as the daemon does on a process's
    ``cancel``) settles nothing: its watcher is not called, even once the space it
    waited for is free, and the books hold nothing of it."""
    async with Broker(budget=100) as broker:
        relay = broker._relay
        block = await relay.open_block("p", _release, elsewhere=Told())
        calls: list[object] = []

        async def load() -> str:
            await checkpoint()
            return "X"

        held = relay.submit(block.owner, Request("x", {"default": 80}, load=load), task="hx")
        await _settle(held)
        waiting = relay.submit(block.owner, Request("y", {"default": 80}, load=load), task="hy")
        assert waiting.outcome is None
        waiting.entry.shell.watch(lambda: calls.append(waiting.outcome))
        relay.core.leave(waiting)  # withdrawn: its entry leaves the queue
        relay.apply()
        assert waiting.entry.state is State.GONE
        relay.core.lease_end(held.entry, "hx", relay.clock())
        relay.apply()
        await anyio.wait_all_tasks_blocked()
        assert calls == []  # (withdrawn: no outcome, and never a grant)
        await relay.close_block(block, None, None, None)
        relay.core.check()


async def test_what_a_step_leaves_for_its_end_runs_once_after_its_watchers() -> None:
    """``Runner.at_step_end``: called once the outermost ``apply`` is over, after
    the watchers its effects woke; not within a nested ``apply``; refused outside."""
    async with Broker(budget=100) as broker:
        relay = broker._relay
        said: list[str] = []

        class Nested(Told):
            def granted(self, key: Hashable, space: str | None) -> None:
                said.append(f"granted {key}")
                assert relay.at_step_end(lambda: said.append(f"end {key}"))
                relay.apply()  # (nested: the end is the outermost apply's)
                said.append("nested apply over")

        assert not relay.at_step_end(lambda: said.append("never"))
        block = await relay.open_block("p", _release, elsewhere=Nested())
        a = relay.submit(block.owner, Request("a", {"default": 60}, load=_value), task="ha")
        assert said == ["granted a", "nested apply over", "end a"]
        a.entry.shell.watch(lambda: said.append("watched a"))
        a.entry.shell.watch(lambda: relay.at_step_end(lambda: said.append("after watchers")))
        await _settle(a)
        assert said[3:] == ["watched a", "after watchers"]
        relay.core.lease_end(a.entry, "ha", relay.clock())
        relay.apply()
        await relay.close_block(block, None, None, None)
        relay.core.check()


async def _value() -> str:
    return "v"
