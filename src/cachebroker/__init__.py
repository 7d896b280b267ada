"""cachebroker: one asyncio-native broker for the memory budgets of every plugin.

``await cache.acquire(key, load=..., size=...)`` returns a lease on a loaded
value, loading it once and sharing it; when space runs short the broker asks
the owning plugin to release idle values, awaits its acknowledgement, and only
then hands the space to the requester.
"""

from . import _exports
from ._errors import AcquireTimeout as AcquireTimeout
from ._errors import BrokerClosed as BrokerClosed
from ._errors import BrokerError as BrokerError
from ._errors import DeadlockError as DeadlockError
from ._errors import InvalidArgument as InvalidArgument
from ._errors import InvalidKey as InvalidKey
from ._errors import LeaseReleased as LeaseReleased
from ._errors import LeasesOutstanding as LeasesOutstanding
from ._errors import LoadFailed as LoadFailed
from ._errors import OutOfSpace as OutOfSpace
from ._errors import ReleaseFailed as ReleaseFailed
from ._errors import RequestTooLarge as RequestTooLarge
from ._errors import WrongEventLoop as WrongEventLoop
from ._policies import FIFO as FIFO
from ._policies import GDSF as GDSF
from ._policies import LRU as LRU
from ._policies import CostAware as CostAware
from ._policies import Policy as Policy
from ._policies import PolicyBase as PolicyBase
from ._policies import PolicyEntry as PolicyEntry
from ._shell import Broker as Broker
from ._shell import Cache as Cache
from ._shell import Lease as Lease
from ._shell import Releaser as Releaser
from ._sizes import parse_bytes as parse_bytes
from ._stats import EntryInfo as EntryInfo
from ._stats import EvictionReport as EvictionReport
from ._stats import Stats as Stats
from ._units import format_bytes as format_bytes

try:
    from ._version import __version__ as __version__
except ImportError:  # pragma: no cover - running from a source tree without a build
    __version__ = "0.0.0"

__all__ = (
    "FIFO",
    "GDSF",
    "LRU",
    "CostAware",
    "PolicyBase",
    "PolicyEntry",
    "AcquireTimeout",
    "Broker",
    "BrokerClosed",
    "BrokerError",
    "Cache",
    "DeadlockError",
    "EntryInfo",
    "EvictionReport",
    "InvalidArgument",
    "InvalidKey",
    "Lease",
    "LeaseReleased",
    "LeasesOutstanding",
    "LoadFailed",
    "OutOfSpace",
    "Policy",
    "ReleaseFailed",
    "Releaser",
    "RequestTooLarge",
    "Stats",
    "WrongEventLoop",
    "format_bytes",
    "parse_bytes",
)

# Public names claim this module (tracebacks, reprs and pickles name
# ``cachebroker.X``), whichever private module defines them.
_exports.claim(__name__, globals(), __all__)
