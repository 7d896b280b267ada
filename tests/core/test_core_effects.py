"""The effects a step of the books leaves for the shell, and their interpreters.

Each interpreter ends its ``match`` in ``assert_never``, so mypy (strict, part
of the checks) rejects one that misses a kind of ``Effect``. The harness's is
also run here on every kind; the shell's and the replay's are checked to keep
that ``assert_never`` and to name every kind.
"""

from __future__ import annotations

import copy
import inspect
import re
from collections.abc import Callable
from typing import Any, get_args

import pytest

from cachebroker._core import (
    CancelLoad,
    Effect,
    Entry,
    OwnerEmpty,
    Quarantined,
    Reason,
    Settled,
    StartLoad,
    StartMove,
    StartRelease,
)
from cachebroker._core._effects import _Effect
from cachebroker._shell._runner import Runner
from cachebroker.simulator._replay import _Replay
from tests.harness import Harness

KINDS: tuple[type[Any], ...] = get_args(Effect)


def _leaves(cls: type[Any]) -> set[type[Any]]:
    subclasses = cls.__subclasses__()
    return {cls} if not subclasses else set().union(*map(_leaves, subclasses))


def _make(kind: type[Any], h: Harness, key: str = "k", reason: Reason = Reason.CAPACITY) -> Any:
    """An effect of ``kind`` about the harness's owner (or a fresh entry of it)."""
    values = {
        "entry": Entry(h.owner, key, {"m": 1}),
        "reason": reason,
        "owner": h.owner,
        "to": "m",
    }
    return kind(*(values[name] for name in kind.__match_args__))


def test_the_effect_union_names_every_kind() -> None:
    assert set(KINDS) == _leaves(_Effect)


@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.__name__)
def test_an_effect_is_frozen_and_slotted(kind: type[Any]) -> None:
    h = Harness({"m": 10})
    effect = _make(kind, h)
    fields = {name: getattr(effect, name) for name in kind.__match_args__}
    for name in kind.__match_args__:
        with pytest.raises(AttributeError, match="frozen"):
            setattr(effect, name, None)
        with pytest.raises(AttributeError, match="frozen"):
            delattr(effect, name)
    with pytest.raises(AttributeError, match="frozen"):
        effect.other = 1
    assert {name: getattr(effect, name) for name in kind.__match_args__} == fields
    assert not hasattr(effect, "__dict__")


def test_effects_are_equal_by_kind_and_fields() -> None:
    h = Harness({"m": 10})
    entry, other = Entry(h.owner, "a", {}), Entry(h.owner, "b", {})
    assert StartLoad(entry) == StartLoad(entry)
    assert hash(StartLoad(entry)) == hash(StartLoad(entry))
    assert StartLoad(entry) != StartLoad(other)
    assert StartLoad(entry) != CancelLoad(entry)  # same field, another kind
    assert Settled(entry) != Quarantined(entry)
    assert StartRelease(entry, Reason.IDLE) == StartRelease(entry, Reason.IDLE)
    assert StartRelease(entry, Reason.IDLE) != StartRelease(entry, Reason.CLEAR)
    assert OwnerEmpty(h.owner) == OwnerEmpty(h.owner)
    assert StartLoad(entry) != (StartLoad, entry)
    assert len({StartLoad(entry), StartLoad(entry), CancelLoad(entry)}) == 2
    assert repr(StartRelease(entry, Reason.IDLE)) == f"StartRelease({entry!r}, {Reason.IDLE!r})"
    for kind in KINDS:
        effect = _make(kind, h)
        assert copy.copy(effect) == effect


def test_match_binds_the_fields_of_the_kind_it_names() -> None:
    h = Harness({"m": 10})
    entry = Entry(h.owner, "a", {})
    effects: list[Effect] = [
        StartRelease(entry, Reason.INVALIDATE),
        CancelLoad(entry),
        OwnerEmpty(h.owner),
    ]
    seen: list[object] = []
    for effect in effects:
        match effect:
            case StartLoad(_):
                seen.append("load")
            case StartRelease(released, reason):
                seen.append((released, reason))
            case CancelLoad(entry=cancelled):
                seen.append(("cancel", cancelled))
            case OwnerEmpty(owner):
                seen.append(owner)
            case _:
                seen.append("other")
    assert seen == [(entry, Reason.INVALIDATE), ("cancel", entry), h.owner]


#: Where the harness records each kind (a new kind must be added here, and to
#: ``Harness.perform``, or the test below fails).
RECORDED = {
    StartLoad: "loading",
    CancelLoad: "cancelled",
    StartRelease: "releasing",
    StartMove: "moving",
    Settled: "settled",
    Quarantined: "quarantined",
    OwnerEmpty: "emptied",
}


@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.__name__)
def test_the_harness_performs_every_kind_of_effect(kind: type[Any]) -> None:
    h = Harness({"m": 10})
    effect = _make(kind, h)
    h.perform(effect)  # an unhandled kind fails assert_never
    subject = effect.owner if kind is OwnerEmpty else effect.entry
    recorded = getattr(h, RECORDED[kind])
    if kind is StartMove:  # (recorded with the space it goes to)
        assert recorded == [(subject, effect.to)]
        recorded = [subject]
    assert recorded == [subject]
    if kind is StartRelease:
        assert h.released == [("k", Reason.CAPACITY)]


def test_the_harness_sees_a_failed_release_quarantined_and_a_closed_owner_empty() -> None:
    h = Harness({"m": 10}, instant=True)
    ticket = h.acquire("a", 4)
    h.end(ticket)
    h.core.close_owner(h.owner, RuntimeError("closed"))
    assert h.core.effects == [StartRelease(ticket.entry, Reason.CLOSE)]
    h.instant = False
    h.drain()
    h.refuse(ticket.entry)
    assert h.quarantined == [ticket.entry]
    assert h.emptied == [h.owner]
    h.core.check()


@pytest.mark.parametrize(
    "interpreter",
    [Runner.apply, _Replay.perform],
    ids=["Runner.apply", "simulator.replay"],  # (replay's shell performs the effects)
)
def test_the_shell_and_the_replay_match_every_kind_and_end_in_assert_never(
    interpreter: Callable[..., object],
) -> None:
    # mypy proves the match exhaustive only while it ends in assert_never.
    source = inspect.getsource(interpreter)
    assert re.search(r"case _:\s+assert_never\(effect\)", source)
    for kind in KINDS:
        assert re.search(rf"case [^\n]*\b{kind.__name__}\(", source), kind.__name__
