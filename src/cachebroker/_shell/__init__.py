"""The async shell: ``Broker``, ``Cache``, ``Lease`` around the sans-I/O core (``_core``).

- ``_broker``: ``Broker``, the facade: arguments, life cycle, ``cache()``, the
  operations (``evict_idle``, ``clear``, ``forget``), listeners, stats and
  ``entries()``.
- ``_cache``: ``Cache``, a plugin's view, and the block that opens it.
- ``_lease``: ``Lease``, the hit path (``docs/architecture.md``).
- ``_actor``: ``Actor``, the one interface ``Cache`` and ``Lease`` use to
  reach the broker (another shell or a transport provides the same), and
  ``Block``, one open cache as the broker runs it.
- ``_runner``: ``Runner``, the ``Actor`` of a broker in this process: the
  effect interpreter (``Runner.apply``), loads, releases, the idle sweeper.
- ``_backend``: what depends on the event loop library (asyncio or trio).
- ``_config``: argument types and checks, ``Broker.from_env``'s parsing.
- ``_logging``: where the events go (structlog, else the stdlib logger).

Dependencies run one way: ``_broker`` -> ``_runner`` -> ``_actor``;
``_broker`` -> ``_cache`` -> ``_lease``; ``_cache`` and ``_lease`` know the
runner only as an ``Actor``.
"""

from ._broker import Broker
from ._cache import Cache
from ._config import Releaser
from ._lease import Lease

__all__ = ["Broker", "Cache", "Lease", "Releaser"]
