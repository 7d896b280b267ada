"""The arithmetic of tiers and merged spaces: pure functions of entries and charges.

What a move of an entry frees and takes (``freed``, ``reserved``, ``destination``),
whether a value is home (``left_home``, ``stayed``), the places a demoted value
keeps (``unparked``, ``part``), what a grant takes beside a charge (``beyond``),
a charge under canonical names (``canonical``), the names an owner knows its
spaces by (``owner_space``), and whether tiers go round in a circle
(``circle``). The decisions that use them are in ``_moves``, ``_scheduler``
and ``_aliases``; the state changes in ``_transitions``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from ._model import Entry

if TYPE_CHECKING:
    from ._state import Books

__all__ = [
    "beyond",
    "canonical",
    "destination",
    "freed",
    "left_home",
    "owner_space",
    "parked_cost",
    "part",
    "reserved",
    "stayed",
    "unparked",
]


def canonical(canon: Mapping[str, str], charge: dict[str, int]) -> dict[str, int]:
    """``charge`` under canonical space names (the amounts of merged spaces added up)."""
    merged: dict[str, int] = {}
    for name, amount in charge.items():
        name = canon.get(name, name)
        merged[name] = merged.get(name, 0) + amount
    return merged


def reserved(entry: Entry) -> dict[str, int]:
    """The bytes a move of ``entry`` takes in each space beyond its charge."""
    target = entry.target or {}
    charge = entry.charge
    return {n: a - charge.get(n, 0) for n, a in target.items() if a > charge.get(n, 0)}


def freed(entry: Entry) -> dict[str, int]:
    """The bytes a move of ``entry`` gives back in each space of its charge."""
    target = entry.target or {}
    return {n: a - target.get(n, 0) for n, a in entry.charge.items() if a > target.get(n, 0)}


def destination(entry: Entry) -> str:
    """The space a move of ``entry`` goes to: where it takes the most bytes."""
    gains = reserved(entry)
    if not gains:  # (a move within one space: measured sizes made them equal)
        return next(iter(entry.target or entry.charge))
    return max(gains, key=gains.__getitem__)


def owner_space(books: Books, entry: Entry, space: str) -> str:
    """``space`` (a books' name) by the name ``entry``'s owner knows it by.

    A merge keeps one name for two spaces in the books, but each owner named
    its space itself: a value goes back up to the name its request gave
    (``Entry.asked``), and down to the name the tiers as given put below
    that. The books' name is left for a space the owner never named.
    """
    canon = books.canon
    if not canon:  # (nothing merged: every name is the one given)
        return space
    for name in entry.asked:
        if canon.get(name, name) == space:
            return name
    given = books.tiers.given
    for name in entry.asked:
        below = given.get(name)
        for _ in given:  # (a chain: it ends within this many steps)
            if below is None:
                break
            if canon.get(below, below) == space:
                return below
            below = given.get(below)
    return space


def parked_cost(entry: Entry) -> float:
    """What dropping ``entry`` from a lower tier costs: a cold load instead of a promotion."""
    return max(entry.reload - (entry.promote_cost or 0.0), 0.0)


def left_home(home: Mapping[str, int], charge: Mapping[str, int]) -> bool:
    """Whether a value charged ``charge`` is out of ``home``: one of the spaces it was
    loaded in holds none of it. Otherwise it is home (a tier merged into one memory
    with the space above it, or a move measured where it started): no promotion."""
    return any(name not in charge for name in home)


def stayed(going: Mapping[str, int], target: Mapping[str, int], charge: Mapping[str, int]) -> bool:
    """Whether a demotion that was to free ``going`` is still charged there (``charge``,
    as measured, holds more than ``target`` in one of them): it made no room."""
    return any(charge.get(name, 0) > target.get(name, 0) for name in going)


def unparked(entry: Entry, places: tuple[str, ...]) -> tuple[str, ...]:
    """``places`` but the spaces a demoted ``entry`` is parked in: a promotion there would
    be no move, and would ask for its bytes again beside themselves."""
    return tuple(name for name in places if name not in entry.charge)


def part(entry: Entry) -> None:
    """Keep a demoted entry's places (``acquire(spaces=...)``) off the spaces it is parked
    in (none left: ``None``, its home's)."""
    if entry.places is not None:
        entry.places = unparked(entry, entry.places) or None


def beyond(need: dict[str, int], charge: Mapping[str, int]) -> dict[str, int]:
    """What a grant of ``need`` takes beside ``charge``, what its entry holds already: a
    promotion keeps the part of its charge that stays where it is (its other spaces)."""
    if not charge:  # (a load: charged nothing until granted)
        return need
    return {name: n - charge.get(name, 0) for name, n in need.items() if n > charge.get(name, 0)}
