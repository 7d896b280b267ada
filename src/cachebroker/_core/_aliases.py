"""Spaces that turn out to be one memory: evidence, merging, and canonical names.

Two spaces may be views of one device (the shell learns it when a load fits
only after freeing in another space). Once merged, a space name maps to the
name it was merged into (``Core.canon``), every charge is kept under that
canonical name, and ``Core.spaces`` maps both names to the one ``Space``.

Functions of the books, like the scheduler's (see ``_scheduler`` for why);
``Core.note_alias_evidence``, ``Core.merge_spaces`` and ``Core.aliases`` are
the steps and view that call them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

from .._errors import InvalidArgument
from . import _transitions
from ._model import Entry, State
from ._scheduler import schedule
from ._spaces import circle, merged
from ._state import Books
from ._tiers import freed, left_home, part, reserved

__all__ = [
    "Learned",
    "Refused",
    "aliases",
    "merge_spaces",
    "merged_circle",
    "note_alias_evidence",
]


class Refused(NamedTuple):
    """Two spaces not merged: as one memory, the tiers would go round ``circle``."""

    spaces: tuple[str, str]
    circle: tuple[str, ...]


class Learned(NamedTuple):
    """What evidence of aliasing did: the pairs merged (kept, merged into it) and refused."""

    merged: list[tuple[str, str]]
    refused: list[Refused]


def note_alias_evidence(
    books: Books,
    freed: Iterable[str],
    loaded: Iterable[str],
    threshold: int,
    merge: Callable[[str, str], None],
) -> Learned:
    """A load in ``loaded`` spaces fit only after freeing in ``freed`` spaces.

    Each such observation is evidence that the two are one memory; at
    ``threshold`` observations the spaces are merged, unless that would make
    the tiers a circle (``merged_circle``): the pair is refused then, and its
    count starts again. ``merge`` merges a pair (``Core.merge_spaces``: the step,
    which a test build checks the books after). Returns the pairs merged and
    refused by this call.
    """
    canon = books.canon
    learned = Learned([], [])
    for a in sorted({canon.get(n, n) for n in freed}):
        for b in sorted({canon.get(n, n) for n in loaded}):
            a, b = canon.get(a, a), canon.get(b, b)
            if a == b:
                continue
            pair = frozenset((a, b))
            books.canon.evidence[pair] = books.canon.evidence.get(pair, 0) + 1
            if books.canon.evidence[pair] < threshold:
                continue
            del books.canon.evidence[pair]
            found = merged_circle(books, b, a)
            if found is not None:
                learned.refused.append(Refused((b, a), found))
                continue
            merge(b, a)
            learned.merged.append((b, a))
    return learned


def merged_circle(books: Books, keep: str, other: str) -> tuple[str, ...] | None:
    """The circle the tiers would go round with ``keep`` and ``other`` one memory, if any.

    Merging renames ``other`` to ``keep`` in the tiers and drops a tier
    between the two; spaces at both ends of a longer chain
    (``g0 -> ram -> disk``, ``g0`` and ``disk`` one memory) would close it.
    """
    canon = books.canon
    keep, other = canon.get(keep, keep), canon.get(other, other)
    return None if keep == other else circle(merged(books.tiers, keep, other))


def merge_spaces(books: Books, keep: str, other: str) -> None:
    """Treat spaces ``keep`` and ``other`` as one memory from now on.

    The merged space's capacity is the larger of the two budgets; its books
    are the sum of both; every entry charged in ``other`` is charged in
    ``keep`` instead, and the policy is told so as if those entries were
    admitted again (in the order they were last requested). If the merged
    books exceed the capacity, idle entries are evicted at once.

    Raises:
        InvalidArgument: as one memory, the two would make the tiers a
            circle (``merged_circle``); nothing is merged.
    """
    found = merged_circle(books, keep, other)
    if found is not None:
        raise InvalidArgument(
            f"spaces {keep!r} and {other!r} cannot be one memory: the tiers would go "
            f"round in a circle: {' -> '.join(found)}"
        )
    _transitions.settle(books)
    canon = books.canon
    keep, other = canon.get(keep, keep), canon.get(other, other)
    if keep == other:
        return
    kept, gone = books.spaces[keep], books.spaces[other]
    entries = sorted(books.entries(), key=lambda e: e.last_request)
    touched = [
        e
        for e in entries
        if other in e.charge
        or other in e.need
        or (e.target is not None and other in e.target)
        or (e.home is not None and other in e.home)
        or (e.places is not None and other in e.places)
    ]
    idle = sorted((e for e in touched if e.idle_seq), key=lambda e: e.idle_seq)
    for entry in idle:
        if books.on_busy is not None:
            books.on_busy(entry)
    admitted = [
        e
        for e in touched
        if e.state in (State.READY, State.RELEASING, State.MOVING, State.DEMOTED)
        and e not in books.orphans
    ]
    if books.on_remove is not None:
        for entry in admitted:
            books.on_remove(entry)
    # A move's books are differences between its charge and its target: take
    # them off before the names change, and put them back after.
    moving = [e for e in touched if e.state is State.MOVING]
    _move_books(books, moving, -1)
    for entry in touched:
        _rename_entry(books, entry, other, keep)
    for entry in entries:  # (the places an acquire asked for: not on the books)
        if entry.asked_places is not None and other in entry.asked_places:
            entry.asked_places = _rename(entry.asked_places, other, keep)
    kept.absorb(gone)
    canon.merge(keep, other)
    books.spaces[other] = kept
    books.tiers.merge(keep, other)  # (a tier between the two is one memory now: no move)
    if other in books.overdrawn:
        books.overdrawn.discard(other)
    if kept.used > kept.capacity:
        books.overdrawn.add(keep)
    _move_books(books, moving, +1)
    _at_home(books, touched)
    if books.on_admit is not None:
        for entry in admitted:
            books.on_admit(entry)
    for entry in idle:
        books.policy.idle(entry)
    _no_move(books, [e for e in moving if e in books.demoting])
    schedule(books)


def _rename_entry(books: Books, entry: Entry, other: str, keep: str) -> None:
    """Charge ``entry`` (its need, charge, target, home and places) in ``keep`` for
    ``other``."""
    same = entry.charge is entry.need
    entry.need = _move(entry.need, other, keep)
    _transitions.set_charge(books, entry, entry.need if same else _move(entry.charge, other, keep))
    if entry.target is not None:
        entry.target = _move(entry.target, other, keep)
    if entry.home is not None:
        entry.home = _move(entry.home, other, keep)
    if entry.places is not None:
        entry.places = _rename(entry.places, other, keep)


def _at_home(books: Books, touched: list[Entry]) -> None:
    """Demoted entries whose tier merged into their home: ready there, no move back.

    Their home and their charge are one space now; a promotion would ask for
    their bytes again beside themselves, and wait for ever. The others keep
    their places off the space they are parked in (``_tiers.part``).
    """
    for entry in touched:
        if entry.state is State.DEMOTED:
            assert entry.home is not None
            if left_home(entry.home, entry.charge):
                part(entry)
            else:
                _transitions.come_home(books, entry)


def _no_move(books: Books, demoting: list[Entry]) -> None:
    """Demotions still waiting for room whose lower tier is their own space now: no
    move. Each stays where it is, idle (or, its promotion queued, demoted)."""
    for entry in demoting:
        if freed(entry):
            continue
        _transitions.cancel_demotion(books, entry)
        if entry.state is State.DEMOTED and not left_home(entry.home or {}, entry.charge):
            _transitions.come_home(books, entry)
        _transitions.rest(books, entry, entry.idle_since)


def _move_books(books: Books, moving: list[Entry], sign: int) -> None:
    """Add (``sign`` 1) or take off (-1) what moving entries count in ``releasing`` and ``used``."""
    for entry in moving:
        for name, amount in freed(entry).items():
            books.spaces[name].releasing += sign * amount
        if entry not in books.demoting:
            for name, amount in reserved(entry).items():
                books.spaces[name].used += sign * amount


def _move(charge: dict[str, int], other: str, keep: str) -> dict[str, int]:
    if other not in charge:
        return charge
    moved = dict(charge)
    moved[keep] = moved.get(keep, 0) + moved.pop(other)
    return moved


def _rename(places: tuple[str, ...], other: str, keep: str) -> tuple[str, ...]:
    """``places`` with ``other`` called ``keep`` (once, where it first appears)."""
    return tuple(dict.fromkeys(keep if name == other else name for name in places))


def aliases(canon: Mapping[str, str]) -> list[tuple[str, ...]]:
    """The groups of space names known to be one memory (each group sorted)."""
    groups: dict[str, list[str]] = {}
    for name, target in canon.items():
        groups.setdefault(target, [target]).append(name)
    return sorted(tuple(sorted(group)) for group in groups.values())
