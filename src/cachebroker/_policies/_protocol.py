"""What a policy sees of an entry (``PolicyEntry``) and what the core asks of a policy (``Policy``).

Policies are typed against ``PolicyEntry`` alone, never against the core's
entry class: the core hands them its entries, which satisfy the protocol, and
checks every victim it gets back before acting on it.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Protocol, runtime_checkable


class PolicyEntry(Protocol):
    """What a policy may read on an entry; all of it is read-only to the policy.

    Entries are hashable and compare by identity, so a policy may key its own
    tables by them.
    """

    @property
    def key(self) -> Hashable:
        """The entry's key, unique within its cache."""

    @property
    def cache(self) -> str:
        """The name of the cache that owns the entry."""

    @property
    def charge(self) -> Mapping[str, int]:
        """Bytes the entry holds per space (space name -> bytes)."""

    @property
    def cost(self) -> float:
        """Reload cost in seconds: declared with ``acquire(cost=...)``, else the measured
        load time; known from ``admit`` on."""

    @property
    def requests(self) -> int:
        """Requests (acquires) for the entry since it was created."""

    @property
    def last_request(self) -> int:
        """The core's request clock (one tick per acquire) at the latest request."""

    @property
    def idle(self) -> bool:
        """Whether the entry is an eviction candidate now (loaded, no lease, not releasing)."""

    @property
    def idle_seq(self) -> int:
        """Grows each time the entry becomes idle (0 while it is not idle)."""


@runtime_checkable
class Policy(Protocol):
    """What the core tells a policy, and what it asks of it.

    Every method is called synchronously from the core and must not block or
    raise. Subclass ``PolicyBase`` to get no-op defaults for the hooks you do
    not need (the core then skips calling them).

    ``victims`` is a question, not a decision: the core may ask it for
    shortfalls it then does not evict for (to weigh the places of a request,
    or whether a value is worth its room a tier down), so it must change
    nothing the policy ranks by. What should move with an eviction belongs
    in the optional hook ``evicted(victims, shortfall)`` (see ``PolicyBase``):
    it is not part of this protocol, so a policy without it still is one,
    and the core calls it only on policies that define it.
    """

    def touch(self, entry: PolicyEntry) -> None:
        """A request for ``entry``: a hit, a join of its load, or the miss that created it."""

    def admit(self, entry: PolicyEntry) -> None:
        """``entry`` was loaded: it is resident from now on and ``entry.cost`` is known."""

    def idle(self, entry: PolicyEntry) -> None:
        """``entry`` became an eviction candidate (resident, no lease)."""

    def busy(self, entry: PolicyEntry) -> None:
        """``entry`` stopped being a candidate: leased again, or being released."""

    def remove(self, entry: PolicyEntry) -> None:
        """``entry`` left the books (possibly without ever being admitted)."""

    def victims(self, shortfall: Mapping[str, int]) -> list[PolicyEntry]:
        """Return idle entries whose release covers ``shortfall`` (space -> bytes).

        A query: it must leave the policy as it found it (see the class docstring).
        """
        ...


class PolicyBase:
    """No-op hooks to build a policy on; only ``victims`` must be written."""

    def touch(self, entry: PolicyEntry) -> None:
        """A request for ``entry`` (no-op)."""

    def admit(self, entry: PolicyEntry) -> None:
        """``entry`` was loaded (no-op)."""

    def idle(self, entry: PolicyEntry) -> None:
        """``entry`` became a candidate (no-op)."""

    def busy(self, entry: PolicyEntry) -> None:
        """``entry`` stopped being a candidate (no-op)."""

    def remove(self, entry: PolicyEntry) -> None:
        """``entry`` left the books (no-op)."""

    def evicted(self, victims: Sequence[PolicyEntry], shortfall: Mapping[str, int]) -> None:
        """The core evicts ``victims``, which ``victims(shortfall)`` chose (no-op).

        Called once per eviction the core acts on, before the victims are
        released (``busy``, later ``remove``) or moved down a tier; never for
        a choice the core only weighed. The place for what should follow an
        eviction, such as GDSF's clock. Optional: the core calls it only on
        policies that define it.
        """

    def victims(self, shortfall: Mapping[str, int]) -> list[PolicyEntry]:
        """Return idle entries whose release covers ``shortfall`` (space -> bytes).

        Subclasses must write it; may return too few (the core then waits).
        It must change nothing the policy ranks by: the core may ask without
        evicting (``evicted`` tells it when it does).
        """
        raise NotImplementedError(f"{type(self).__name__} must define victims()")
