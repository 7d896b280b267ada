"""Eviction priorities: lower priorities go first, whatever the policy; never above the requester.

The books are driven directly for the rules (every built-in policy, and a
user's), then the shell on every backend for the public arguments.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Mapping
from typing import Any

import anyio
import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

from cachebroker import (
    AcquireTimeout,
    Broker,
    InvalidArgument,
    PolicyBase,
    PolicyEntry,
)
from cachebroker._core import Reason, State
from cachebroker._policies import make_policy
from tests.harness import Harness

POLICIES = ["lru", "fifo", "gdsf", "cost"]


def ask(h: Harness, key: str, size: int, priority: int, task: object = "t") -> Any:
    ticket = h.core.request(h.owner, key, {"m": size}, task, priority=priority)
    h.drain()
    return ticket


def load_idle(h: Harness, key: str, size: int, priority: int) -> None:
    ticket = ask(h, key, size, priority)
    assert ticket.outcome is True
    h.end(ticket)


@pytest.mark.parametrize("policy", POLICIES)
def test_the_lower_priority_goes_first_whatever_the_ranking(policy: str) -> None:
    h = Harness({"m": 30}, policy=make_policy(policy), instant=True)
    load_idle(h, "old-but-dear", 10, priority=5)  # least recent, loaded first
    load_idle(h, "middle", 10, priority=0)
    load_idle(h, "recent", 10, priority=0)
    for _ in range(3):  # popular, too
        h.end(ask(h, "old-but-dear", 10, 5))
    load_idle(h, "new", 10, priority=5)
    evicted = [key for key, reason in h.released if reason is Reason.CAPACITY]
    assert len(evicted) == 1 and evicted[0] in ("middle", "recent")
    h.core.check()


@pytest.mark.parametrize("policy", POLICIES)
def test_a_request_never_evicts_above_its_own_priority(policy: str) -> None:
    h = Harness({"m": 20}, policy=make_policy(policy), instant=True)
    load_idle(h, "high", 10, priority=2)
    load_idle(h, "low", 10, priority=0)
    # Priority 1 may evict "low" but not "high".
    h.end(ask(h, "mid", 10, priority=1))
    assert [key for key, _ in h.released] == ["low"]
    # A priority-0 request finds only higher priorities idle: it waits.
    waiting = ask(h, "lower", 20, priority=0)
    assert waiting.outcome is None and [key for key, _ in h.released] == ["low"]
    h.core.check()
    # The priority-2 request may evict both.
    h.leave(waiting)
    h.end(ask(h, "top", 20, priority=2))
    assert sorted(str(key) for key, _ in h.released) == ["high", "low", "mid"]
    h.core.check()


def test_pinned_entries_stay_whatever_their_priority() -> None:
    h = Harness({"m": 20}, instant=True)
    pinned = ask(h, "pinned", 10, priority=-5)
    h.core.configure(pinned.entry, pin=True)
    h.end(pinned)
    load_idle(h, "other", 10, priority=3)
    h.end(ask(h, "new", 10, priority=3))
    assert [key for key, _ in h.released] == ["other"]


def test_a_changed_priority_moves_the_entry() -> None:
    h = Harness({"m": 20}, instant=True)
    load_idle(h, "a", 10, priority=0)
    load_idle(h, "b", 10, priority=1)
    h.end(ask(h, "a", 10, priority=4))  # the latest request's priority wins
    h.end(ask(h, "c", 10, priority=4))
    assert [key for key, _ in h.released] == ["b"]
    h.core.check()


@st.composite
def steps(draw: st.DrawFn) -> list[tuple[str, int, int]]:
    return draw(
        st.lists(
            st.tuples(st.sampled_from("abcdefg"), st.integers(1, 12), st.integers(0, 2)),
            min_size=1,
            max_size=40,
        )
    )


@settings(deadline=None, max_examples=60)
@given(policy=st.sampled_from(POLICIES), requests=steps())
def test_no_victim_while_an_idle_entry_of_lower_priority_stays(
    policy: str, requests: list[tuple[str, int, int]]
) -> None:
    """Every built-in policy: evictions take lower priorities first, none above the requester."""
    h = Harness({"m": 30}, policy=make_policy(policy), instant=True)
    sizes: dict[str, int] = {}
    for key, size, priority in requests:
        size = sizes.setdefault(key, size)
        idle_before = {
            e.key: e.priority
            for e in h.owner.live
            if e.state is State.READY and not e.leases and not e.pinned
        }
        before = len(h.released)
        ticket = ask(h, key, size, priority)
        victims = [k for k, reason in h.released[before:] if reason is Reason.CAPACITY]
        note(f"{key} size {size} priority {priority}: victims {victims}")
        for victim in victims:
            assert idle_before[victim] <= priority
            for other, other_priority in idle_before.items():
                if other not in victims:
                    assert other_priority >= idle_before[victim], (victim, other)
        h.core.check()
        if ticket.outcome is True:
            h.end(ticket)
        elif ticket.outcome is None:
            h.leave(ticket)
        h.core.check()


class Biggest(PolicyBase):
    """A user's policy: the biggest idle entries first."""

    def __init__(self) -> None:
        self.idle_entries: dict[PolicyEntry, None] = {}

    def idle(self, entry: PolicyEntry) -> None:
        self.idle_entries[entry] = None

    def busy(self, entry: PolicyEntry) -> None:
        self.idle_entries.pop(entry, None)

    def remove(self, entry: PolicyEntry) -> None:
        self.idle_entries.pop(entry, None)

    def victims(self, shortfall: Mapping[str, int]) -> list[PolicyEntry]:
        chosen: list[PolicyEntry] = []
        need = sum(shortfall.values())
        for entry in sorted(self.idle_entries, key=lambda e: -sum(e.charge.values())):
            if need <= 0:
                break
            chosen.append(entry)
            need -= sum(entry.charge.values())
        return chosen if need <= 0 else []


def test_a_users_policy_is_copied_per_priority() -> None:
    policy = Biggest()
    h = Harness({"m": 30}, policy=policy, instant=True)
    load_idle(h, "big-high", 15, priority=1)
    load_idle(h, "small-low", 5, priority=0)
    load_idle(h, "mid-low", 10, priority=0)
    h.end(ask(h, "new", 10, priority=1))
    # The biggest first, but among priority 0 only.
    assert [key for key, _ in h.released] == ["mid-low"]
    # The user's own instance still ranks the priority it was given first.
    assert {e.key for e in policy.idle_entries} == {"big-high"}


class Locked(Biggest):
    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()  # cannot be deep-copied


def test_a_policy_that_cannot_be_copied_is_a_clear_error_at_the_second_priority() -> None:
    h = Harness({"m": 30}, policy=Locked(), instant=True)
    load_idle(h, "a", 10, priority=0)
    with pytest.raises(InvalidArgument, match="Locked cannot be copied"):
        ask(h, "b", 10, priority=1)


# -- the shell -------------------------------------------------------------------


async def release(key: Hashable, value: Any) -> None:
    pass


async def value() -> str:
    return "v"


@pytest.mark.anyio
async def test_cache_defaults_and_acquire_overrides() -> None:
    async with (
        Broker(budget=30) as broker,
        broker.cache("chat", release, priority=5) as chat,
        broker.cache("embed", release) as embed,
    ):
        await (await chat.acquire("llm", load=value, size=10)).release()
        await (await embed.acquire("e1", load=value, size=10)).release()
        await (await embed.acquire("e2", load=value, size=10, priority=9)).release()
        # Room for one more: e1 (priority 0) goes, not the chat model loaded before it.
        await (await chat.acquire("llm2", load=value, size=10)).release()
        assert set(chat._owner.entries) == {"llm", "llm2"}
        assert set(embed._owner.entries) == {"e2"}


@pytest.mark.anyio
async def test_a_request_that_only_higher_priorities_could_serve_times_out_saying_so() -> None:
    async with Broker(budget=20) as broker, broker.cache("m", release) as cache:
        await (await cache.acquire("dear", load=value, size=20, priority=3)).release()
        with pytest.raises(AcquireTimeout) as caught:
            await cache.acquire("cheap", load=value, size=10, priority=1, timeout=0.05)
        assert caught.value.waiting_for == "space"
        assert "higher priority than its 1" in str(caught.value)
        assert broker.stats_nowait().used == {"default": 20}  # never over-committed
        async with anyio.create_task_group():
            pass
