"""Ray Serve model multiplexing with byte budgets: ``@multiplexed`` (the ``ray`` extra).

``@cachebroker.ray.multiplexed`` replaces ``@serve.multiplexed``: models are
budgeted in bytes per memory space by the replica's broker (or the
machine's, with ``cachebroker serve``), a request holds its model with
``async with`` so that it is never released under it, loads of one model
are shared and loads of different models run at once, and the model ids the
replica reports to Ray's router are the ones it really holds.
``BrokerRouter`` routes by them and by free bytes. See docs/ray.md.

Importing this module does not import Ray; ``BrokerRouter`` (a subclass of
Ray's ``RequestRouter``) does, on first use.
"""

from typing import TYPE_CHECKING, Any

from .. import _exports
from ._multiplex import ModelLease as ModelLease
from ._multiplex import Models as Models
from ._multiplex import Multiplexed as Multiplexed
from ._multiplex import multiplexed as multiplexed
from ._replica import hosted as hosted
from ._replica import routing_stats as routing_stats
from ._replica import shutdown as shutdown

if TYPE_CHECKING:
    from ._router import BrokerRouter as BrokerRouter

__all__ = [
    "BrokerRouter",
    "ModelLease",
    "Models",
    "Multiplexed",
    "hosted",
    "multiplexed",
    "routing_stats",
    "shutdown",
]

_exports.claim(__name__, globals(), [name for name in __all__ if name != "BrokerRouter"])


def __getattr__(name: str) -> Any:
    if name == "BrokerRouter":
        from ._router import BrokerRouter

        _exports.claim(__name__, {name: BrokerRouter}, [name])
        globals()[name] = BrokerRouter
        return BrokerRouter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
