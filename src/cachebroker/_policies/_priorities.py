"""Eviction priorities over any policy: one policy per priority, lowest evicted first.

The books switch to ``Priorities`` when entries of different priorities first
coexist (until then every hook goes straight to the one policy, as before).
Each priority gets its own policy, made like the broker's (the same
built-in, or a copy of the user's instance as it was given), which ranks
that priority's entries as it would rank all of them. A shortfall is
covered from the lowest priority up: the lowest priority's policy chooses
among its own entries; when they cannot cover the shortfall they all go,
and the next priority covers the rest. So an entry is never evicted while
an idle entry of lower priority is charged in a short space, whatever the
policies' rankings; within a priority, the policy's ranking holds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, cast

from ._cover import cover
from ._protocol import Policy, PolicyBase, PolicyEntry

__all__ = ["Priorities"]


class Prioritized(PolicyEntry, Protocol):
    """An entry with its eviction priority (the books' entries)."""

    @property
    def priority(self) -> int:
        """Lower priorities are evicted first."""


class Priorities(PolicyBase):
    """Route each entry to its priority's policy; cover shortfalls lowest priority first.

    An entry stays with the policy of the priority it was first seen with
    until ``move`` re-homes it (the books call it when a request changes
    an entry's priority).
    """

    def __init__(self, make: Callable[[], Policy], first: Policy, priority: int) -> None:
        self._make = make
        self.policies: dict[int, Policy] = {priority: first}
        #: The priority whose policy each entry's hooks go to.
        self._home: dict[PolicyEntry, int] = {}
        #: Idle entries of each priority, in the order they became idle.
        self._idle: dict[int, dict[PolicyEntry, None]] = {priority: {}}

    def ensure(self, priority: int) -> None:
        """Make the policy of ``priority`` now (making one may raise)."""
        if priority not in self.policies:
            self.policies[priority] = self._make()
            self._idle[priority] = {}

    def _policy(self, entry: PolicyEntry) -> Policy:
        priority = self._home.get(entry, _priority(entry))
        policy = self.policies.get(priority)
        if policy is None:
            policy = self.policies[priority] = self._make()
            self._idle[priority] = {}
        return policy

    def adopt(self, entry: PolicyEntry, priority: int, *, idle: bool) -> None:
        """Record that ``entry``'s hooks went to the policy of ``priority`` so far."""
        self._home[entry] = priority
        if idle:
            self._idle[priority][entry] = None

    def touch(self, entry: PolicyEntry) -> None:
        self._policy(entry).touch(entry)

    def admit(self, entry: PolicyEntry) -> None:
        policy = self._policy(entry)
        self._home.setdefault(entry, _priority(entry))
        policy.admit(entry)

    def idle(self, entry: PolicyEntry) -> None:
        self._policy(entry).idle(entry)
        self._idle[self._home.setdefault(entry, _priority(entry))][entry] = None

    def busy(self, entry: PolicyEntry) -> None:
        self._policy(entry).busy(entry)
        self._idle[self._home.get(entry, _priority(entry))].pop(entry, None)

    def remove(self, entry: PolicyEntry) -> None:
        self._policy(entry).remove(entry)
        self._idle[self._home.pop(entry, _priority(entry))].pop(entry, None)

    def move(self, entry: Prioritized, *, admitted: bool, idle: bool) -> None:
        """Re-home ``entry`` under the policy of its (changed) priority."""
        old = self._home.get(entry)
        if old is None or old == entry.priority:
            return  # never admitted: its hooks follow its priority already
        self.policies[old].remove(entry)
        self._idle[old].pop(entry, None)
        del self._home[entry]
        policy = self._policy(entry)
        policy.touch(entry)
        if admitted:
            self._home[entry] = entry.priority
            policy.admit(entry)
        if idle:
            policy.idle(entry)
            self._idle[entry.priority][entry] = None

    def victims(self, shortfall: Mapping[str, int], up_to: int | None = None) -> list[PolicyEntry]:
        """Cover ``shortfall`` from the lowest priority up (none above ``up_to``).

        Returns ``[]`` when the idle entries of those priorities cannot cover it.
        """
        remaining = {space: need for space, need in shortfall.items() if need > 0}
        chosen: list[PolicyEntry] = []
        for priority in sorted(p for p in self.policies if up_to is None or p <= up_to):
            idle = [e for e in self._idle[priority] if not remaining.keys().isdisjoint(e.charge)]
            if not idle:
                continue
            picked = self.policies[priority].victims(remaining)
            if not _covers(picked, remaining):
                # Its policy cannot cover the rest from this priority: all of it
                # goes, in the order it became idle, and the next one covers on.
                picked = cover(iter(idle), remaining) if _covers(idle, remaining) else idle
            chosen.extend(picked)
            for entry in picked:
                for space, amount in entry.charge.items():
                    if space in remaining:
                        remaining[space] -= amount
                        if remaining[space] <= 0:
                            del remaining[space]
            if not remaining:
                return chosen
        return []

    def evicted(self, victims: Sequence[PolicyEntry], shortfall: Mapping[str, int]) -> None:
        """Tell each priority's policy (if it listens) which of its entries are evicted,
        for the part of ``shortfall`` it was asked to cover: what the lower ones left."""
        mine: dict[int, list[PolicyEntry]] = {}
        for entry in victims:
            mine.setdefault(self._home.get(entry, _priority(entry)), []).append(entry)
        remaining = {space: need for space, need in shortfall.items() if need > 0}
        for priority in sorted(mine):
            evicted = mine[priority]
            hook = getattr(self.policies.get(priority), "evicted", None)
            if hook is not None:
                hook(evicted, dict(remaining))
            for entry in evicted:
                for space, amount in entry.charge.items():
                    if space in remaining:
                        remaining[space] -= amount
                        if remaining[space] <= 0:
                            del remaining[space]


def _priority(entry: PolicyEntry) -> int:
    """The priority of one of the books' entries (``Priorities`` serves the books only)."""
    return cast(Prioritized, entry).priority


def _covers(entries: list[PolicyEntry], shortfall: Mapping[str, int]) -> bool:
    freed = dict.fromkeys(shortfall, 0)
    for entry in entries:
        for space, amount in entry.charge.items():
            if space in freed:
                freed[space] += amount
    return all(freed[space] >= need for space, need in shortfall.items())
