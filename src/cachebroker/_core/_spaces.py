"""How the spaces relate, each relation an owner with its own ``check``.

``Canon``: the spaces learned (or given) to be one memory. It maps each
merged-away name to the name it was merged into, in one step (never a
chain), and keeps the canonical names in budget order (``names``) and the
evidence toward merges still to come (``evidence``).

``Tiers``: each space's lower tier, by canonical names, where idle values
may be moved instead of released; and the tiers as given (``given``), by
the names an owner is told. A tier map is a chain: a circle would send a
value round to where it was, and an eviction that makes room below would
recurse for ever (``circle``).

Both are dicts, read as ``canon.get(name, name)`` and ``tiers.get(name)``
on every path that names a space; they change only by their ``merge``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

__all__ = ["Canon", "Tiers", "circle", "merged"]


def circle(tiers: Mapping[str, str]) -> tuple[str, ...] | None:
    """A circle that ``tiers`` go round in (``("a", "b", "a")``), or ``None``: a chain.

    A tier map must be a chain: a value evicted down a circle would come back
    to where it was, and an eviction that makes room below would recurse for
    ever. ``Broker(tiers=...)`` refuses one given directly, and a merge of two
    spaces (``_aliases``) refuses to make one.
    """
    for start in tiers:
        seen = [start]
        below = tiers.get(start)
        while below is not None:
            if below in seen:
                return (*seen[seen.index(below) :], below)
            seen.append(below)
            below = tiers.get(below)
    return None


def merged(tiers: Mapping[str, str], keep: str, other: str) -> dict[str, str]:
    """``tiers`` (by canonical names) once ``other`` is merged into ``keep``: a tier
    between the two is one memory, no move; the others follow the merge."""
    renamed = ((keep if u == other else u, keep if v == other else v) for u, v in tiers.items())
    return {upper: lower for upper, lower in renamed if upper != lower}


class Canon(dict[str, str]):
    """Merged-away space name -> the canonical name it is one memory with."""

    __slots__ = ("evidence", "names")

    def __init__(self, names: Iterable[str]) -> None:
        super().__init__()
        #: The canonical names, in budget order: one per memory.
        self.names = list(names)
        #: Per pair of canonical names, how often a load's OOM was cured by
        #: freeing the other (``_aliases.note_alias_evidence``).
        self.evidence: dict[frozenset[str], int] = {}

    def merge(self, keep: str, other: str) -> None:
        """``other`` (canonical) is one memory with ``keep`` (canonical) from now on."""
        for name, target in self.items():
            if target == other:
                self[name] = keep
        self[other] = keep
        self.names.remove(other)
        for pair in [pair for pair in self.evidence if other in pair]:
            del self.evidence[pair]  # (counted toward a merge that happened, or a new name)

    def check(self, spaces: Iterable[str]) -> None:
        """Assert that every name maps to its canonical one in one step."""
        spaces = list(spaces)
        for name, target in self.items():
            assert name in spaces and target in self.names, (name, target)
            assert name not in self.names, name
        assert self.names == [name for name in spaces if name not in self], self.names
        for pair, count in self.evidence.items():
            assert len(pair) == 2 and pair <= set(self.names) and count > 0, (pair, count)


class Tiers(dict[str, str]):
    """A canonical space -> the canonical space below it."""

    __slots__ = ("given",)

    def __init__(self, tiers: Mapping[str, str]) -> None:
        super().__init__(tiers)
        #: The tiers as given, by the names given: the names an owner is told
        #: its values move down to (``_tiers.owner_space``).
        self.given = dict(tiers)

    def merge(self, keep: str, other: str) -> None:
        """``other`` is one memory with ``keep`` from now on (``merged``)."""
        tiers = merged(self, keep, other)
        self.clear()
        self.update(tiers)

    def check(self, canon: Canon) -> None:
        """Assert that the tiers are a chain of canonical spaces."""
        for upper, lower in self.items():
            assert upper in canon.names and lower in canon.names, (upper, lower)
            assert upper != lower, upper
        assert circle(self) is None, circle(self)
