"""Lease holders waiting on each other's leases: the request that closes the cycle is refused.

Tested where it is decided, on the books with no event loop (``_core._cycles``):
a cycle of two or three tasks, in one space or across spaces, relayed from
other processes (``held=``); sets that could still progress are not refused,
and a Hypothesis property checks that against the scheduler itself: whatever
it refuses, the books, with every other lease ended and every release
acknowledged, would never have granted.
"""

from __future__ import annotations

import copy
from typing import Any
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachebroker import DeadlockError
from cachebroker._core import Request, State, Ticket, _cycles
from tests.harness import Harness


def holding(h: Harness, key: str, size: int, task: Any, space: str = "m") -> Ticket:
    """A lease of ``task`` on ``key`` (loaded)."""
    ticket = h.core.request(h.owner, Request(key, {space: size}), task)
    h.drain()
    h.finish(ticket.entry)
    assert ticket.outcome is True
    return ticket


def asks(h: Harness, key: str, size: int, task: Any, space: str = "m", **kw: Any) -> Ticket:
    ticket = h.core.request(h.owner, Request(key, {space: size}), task, **kw)
    h.drain()
    return ticket


def test_the_second_of_two_lease_holders_waiting_on_each_other_is_refused() -> None:
    """t1 holds a and waits for room b fills; t2 holds b and asks for room a fills: t2's
    request is refused at once, naming the cycle, and t1 waits on."""
    h = Harness({"m": 100})
    a = holding(h, "a", 60, "t1")
    b = holding(h, "b", 40, "t2")
    x = asks(h, "x", 40, "t1")
    assert x.entry.state is State.WAITING
    with pytest.raises(DeadlockError, match="would wait for ever") as caught:
        asks(h, "y", 60, "t2")
    assert "task 't1' holds p:'a' and waits for p:'x'" in str(caught.value)
    assert set(caught.value.leases) == {("p", "a"), ("p", "b")}
    assert "y" not in h.owner.entries and x.entry.state is State.WAITING
    h.end(b)  # the refused task ends its lease: the other goes on
    (released,) = h.releasing
    h.ack(released)
    assert x.entry.state is State.LOADING
    h.end(a)


def test_a_cycle_of_three_tasks_across_two_spaces_is_refused_when_it_closes() -> None:
    """t1 holds a (gpu) and waits for gpu room b holds; t2 holds b (gpu) and d (ram) and
    waits for ram room t3's c holds; t3 holds c and asks for ram room only d could make."""
    h = Harness({"gpu": 100, "ram": 100})
    holding(h, "a", 50, "t1", "gpu")
    holding(h, "b", 50, "t2", "gpu")
    holding(h, "d", 50, "t2", "ram")
    holding(h, "c", 50, "t3", "ram")
    assert asks(h, "x", 50, "t1", "gpu").entry.state is State.WAITING  # needs b
    assert asks(h, "y", 50, "t2", "ram").entry.state is State.WAITING  # needs c
    # t3's request needs d (t2's), and t2 waits for c (t3's) and t1 for b (t2's).
    with pytest.raises(DeadlockError, match="task 't2' holds p:'b', p:'d'"):
        asks(h, "z", 50, "t3", "ram")


def test_a_holder_waiting_for_a_lease_of_a_task_that_waits_for_nothing_is_not_refused() -> None:
    h = Harness({"m": 100})
    holding(h, "a", 60, "t1")
    holding(h, "b", 40, "t2")  # t2 waits for nothing: its lease ends some day
    assert asks(h, "x", 40, "t1").entry.state is State.WAITING


def test_a_set_that_one_member_can_leave_is_not_refused() -> None:
    """t1 waits for b's room; t2 (holding b) asks for room an idle entry and the free bytes
    make: t2 can be served, then end b, then t1 can: no cycle, and t2 is granted."""
    h = Harness({"m": 100})
    holding(h, "a", 40, "t1")
    holding(h, "b", 20, "t2")
    idle = holding(h, "i", 20, "t3")
    h.end(idle)
    x = asks(h, "x", 60, "t1")
    assert x.entry.state is State.WAITING
    y = asks(h, "y", 40, "t2")  # 20 free and 20 idle
    for entry in list(h.releasing):
        h.ack(entry)
    assert y.entry.state is State.LOADING


def test_bytes_a_waiter_may_never_evict_are_not_counted_as_a_cycle() -> None:
    """t1's request needs room a pinned entry holds: it waits aside, whatever the leases;
    t2 waiting on t1's lease is refused only if t1 could never end it either."""
    h = Harness({"m": 100})
    holding(h, "a", 30, "t1")
    pinned = holding(h, "p", 40, "t3")
    h.core.configure(pinned.entry, pin=True)
    h.end(pinned)
    holding(h, "b", 30, "t2")
    assert asks(h, "x", 50, "t1").entry.state is State.WAITING  # needs b's 30 and the pin's
    # t2 needs 40: a's 30 and x's ... a's room is t1's, which waits on the pin and b.
    with pytest.raises(DeadlockError):
        asks(h, "y", 40, "t2")


def test_a_request_relayed_with_the_leases_its_task_holds_there_closes_a_cycle() -> None:
    """On the daemon's books a request names its task's leases (``held``): the relay's
    tasks differ per request, so the cycle is found through them."""
    h = Harness({"m": 100})
    a = holding(h, "a", 60, "conn-1")
    b = holding(h, "b", 40, "conn-2")
    x = asks(h, "x", 40, "req-1", held=(a.entry,))
    assert x.entry.state is State.WAITING
    with pytest.raises(DeadlockError, match="would wait for ever"):
        asks(h, "y", 60, "req-2", held=(b.entry,))


# ---------------------------------------------------------------- no false positives

SIZES = st.integers(min_value=1, max_value=6).map(lambda n: n * 10)


@settings(max_examples=150, deadline=None)
@given(
    leases=st.lists(st.tuples(st.integers(0, 3), SIZES), min_size=1, max_size=6),
    asks_=st.lists(st.tuples(st.integers(0, 3), SIZES), min_size=1, max_size=5),
    idle=st.lists(SIZES, max_size=2),
)
def test_what_is_refused_as_a_cycle_would_never_have_been_granted(
    leases: list[tuple[int, int]], asks_: list[tuple[int, int]], idle: list[int]
) -> None:
    """Tasks take leases, some entries go idle, then tasks ask for more. Whenever a request
    is refused as closing a cycle, the same books with the check switched off, every
    lease of the other tasks ended and every release acknowledged, grant none of the
    refused set's requests: the refusal was never a false positive."""
    h = Harness({"m": 100})
    for n, (task, size) in enumerate(leases):
        try:
            ticket = h.core.request(h.owner, Request(f"l{n}", {"m": size}), f"t{task}")
        except DeadlockError:  # (its own leases fill the space)
            continue
        h.drain()
        if ticket.entry.state is not State.LOADING:
            h.leave(ticket)
            continue
        h.finish(ticket.entry)
    for n, size in enumerate(idle):
        ticket = h.core.request(h.owner, Request(f"i{n}", {"m": size}), "idler")
        h.drain()
        if ticket.entry.state is State.LOADING:
            h.finish(ticket.entry)
            h.end(ticket)
        else:
            h.leave(ticket)
    waiting: dict[str, Ticket] = {}
    for n, (task, size) in enumerate(asks_):
        name = f"t{task}"
        if name in waiting:
            continue  # (a task waits for one request at a time)
        before = copy.deepcopy(h)
        try:
            ticket = h.core.request(h.owner, Request(f"a{n}", {"m": size}), name)
        except DeadlockError as exc:
            if "would wait for ever" in str(exc):
                assert_never_granted(before, f"a{n}", size, name, waiting)
            continue
        h.drain()
        if ticket.entry.state is State.WAITING:
            waiting[name] = ticket


def assert_never_granted(
    h: Harness, key: str, size: int, task: str, waiting: dict[str, Ticket]
) -> None:
    """On a copy of the books from before the refused request: ask it without the check,
    then let everything else progress as far as it can (every lease of a task that
    waits for nothing ends, every release is acknowledged, every load finishes, and a
    waiter that is granted takes its lease and then ends all its task's leases); the
    refused request is never granted."""
    with mock.patch.object(_cycles, "check_cycle_of_holders"):  # (switched off)
        refused = h.core.request(h.owner, Request(key, {"m": size}), task)
    h.drain()
    waiters = {name: ticket.entry.key for name, ticket in waiting.items()}
    waiters[task] = key
    for _ in range(100):
        before = (len(h.core.busy), len(h.releasing), len(h.loading), len(waiters))
        for entry in list(h.loading):
            h.finish(entry)
        for name, wanted in list(waiters.items()):
            found = h.owner.entries.get(wanted)
            if found is not None and found.state is State.READY and name in found.holders:
                del waiters[name]  # granted: it goes on, and ends its leases
        for entry in list(h.core.busy):
            for holder in list(entry.holders):
                if holder not in waiters:
                    h.core.lease_end(entry, holder, h.now)
        h.drain()
        for entry in list(h.releasing):
            h.ack(entry)
        if before == (len(h.core.busy), len(h.releasing), len(h.loading), len(waiters)):
            break
    assert task in waiters and refused.entry.state is State.WAITING, (task, waiters)
