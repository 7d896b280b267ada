"""The covering rule every built-in policy ends with: take entries in order until covered."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from ._protocol import PolicyEntry


def cover(candidates: Iterator[PolicyEntry], shortfall: Mapping[str, int]) -> list[PolicyEntry]:
    """Take candidates in the order given until every short space is covered.

    Skips candidates that are not idle and those that weigh nothing in any
    space that is still short.
    """
    remaining = {space: need for space, need in shortfall.items() if need > 0}
    chosen: list[PolicyEntry] = []
    seen: set[PolicyEntry] = set()
    for entry in candidates:
        if not remaining:
            break
        if entry in seen or not entry.idle or remaining.keys().isdisjoint(entry.charge):
            continue
        seen.add(entry)
        chosen.append(entry)
        for space, amount in entry.charge.items():
            if space in remaining:
                remaining[space] -= amount
                if remaining[space] <= 0:
                    del remaining[space]
    return chosen
