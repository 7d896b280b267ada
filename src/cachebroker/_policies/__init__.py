"""Eviction policies: pure, synchronous rankers of idle entries.

A policy never decides *whether* to evict. The core tells it what happens to
entries (requested, loaded, idle, leased again, gone) and asks it for a set
of victims that covers a shortfall in some spaces. It must only return
entries that are idle (``entry.idle``), and may return too few: the core then
evicts nothing and waits. Asking is a pure query (the core also asks to
weigh choices it does not make); the optional hook ``evicted`` tells the
policy which victims the core does evict.

What a policy may read on an entry is ``PolicyEntry``: ``key``, ``cache``
(its cache's name), ``charge`` (space -> bytes), ``cost`` (reload seconds:
declared with ``acquire(cost=...)``, else the measured load time; known from
``admit`` on), ``requests`` (acquires since the entry was created),
``last_request`` (the core's request clock at the latest one), ``idle`` and
``idle_seq`` (increases each time the entry becomes idle). Policies are typed
against it alone: this package imports nothing of the core (nor anyio or
structlog), and the core checks every victim it gets back.

Modules: ``_protocol`` (``PolicyEntry``, ``Policy``, ``PolicyBase``),
``_cover`` (taking entries in order until a shortfall is covered),
``_recency`` (``LRU``, ``FIFO``), ``_ranked`` (``GDSF``, ``CostAware`` and
their ranking heaps and victim-set search); here, ``make_policy``.
"""

from __future__ import annotations

from collections.abc import Callable

from .._errors import InvalidArgument
from ._protocol import Policy, PolicyBase, PolicyEntry
from ._ranked import GDSF, CostAware
from ._recency import FIFO, LRU

__all__ = [
    "FIFO",
    "GDSF",
    "LRU",
    "CostAware",
    "Policy",
    "PolicyBase",
    "PolicyEntry",
    "make_policy",
]


_BUILTIN: dict[str, Callable[[], Policy]] = {
    "lru": LRU,
    "fifo": FIFO,
    "gdsf": GDSF,
    "cost": CostAware,
}


def make_policy(policy: str | Policy) -> Policy:
    """Return a policy instance for a built-in name or a user's instance."""
    if isinstance(policy, str):
        factory = _BUILTIN.get(policy.strip().lower())
        if factory is None:
            raise InvalidArgument(
                f"unknown policy {policy!r}; built-in policies are {sorted(_BUILTIN)}"
            )
        return factory()
    if isinstance(policy, Policy):
        return policy
    raise TypeError(
        "policy must be a built-in name such as 'lru' or an object with touch(), admit(), "
        f"idle(), busy(), remove() and victims() (see PolicyBase), got {type(policy).__name__}"
    )
