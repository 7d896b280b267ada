"""Stable event names, the broker's log catalogue.

Every event is logged by the async shell through one logger named
``"cachebroker"`` (the standard library's, or structlog's when the application
configured it; see ``_logging``); fields always include ``cache`` and ``key``
where an entry is concerned. The names are part of the public contract: dashboards and
alerts may match on them.
"""

from __future__ import annotations

from typing import Final

HIT: Final = "cachebroker.hit"
MISS: Final = "cachebroker.miss"
WAIT: Final = "cachebroker.wait"
WAIT_LEASE: Final = "cachebroker.wait.lease"
GRANT: Final = "cachebroker.grant"
LOAD_START: Final = "cachebroker.load.start"
LOAD_DONE: Final = "cachebroker.load.done"
LOAD_FAILED: Final = "cachebroker.load.failed"
LOAD_CANCELLED: Final = "cachebroker.load.cancelled"
LOAD_RETRY: Final = "cachebroker.load.retry"
RELEASE_REQUESTED: Final = "cachebroker.release.requested"
MOVE_START: Final = "cachebroker.move.start"
MOVE_DONE: Final = "cachebroker.move.done"
MOVE_FAILED: Final = "cachebroker.move.failed"
MOVE_STAYED: Final = "cachebroker.move.stayed"
MOVE_REFUSED: Final = "cachebroker.move.refused"
RELEASE_FREED: Final = "cachebroker.release.freed"
RELEASE_FAILED: Final = "cachebroker.release.failed"
QUARANTINE_FORGOTTEN: Final = "cachebroker.quarantine.forgotten"
ALIAS_LEARNED: Final = "cachebroker.alias.learned"
ALIAS_REFUSED: Final = "cachebroker.alias.refused"
MEMORY_SLOW: Final = "cachebroker.release.memory_slow"
RELEASE_BLOCKING: Final = "cachebroker.release.blocking"
LEASE_HELD: Final = "cachebroker.lease.held"
CLOSE_WAITING: Final = "cachebroker.close.waiting"
LISTENER_FAILED: Final = "cachebroker.listener.failed"
PROBE_FAILED: Final = "cachebroker.probe.failed"
RELEASE_REFUSED: Final = "cachebroker.release.refused"
PEER_CONNECTED: Final = "cachebroker.peer.connected"
PEER_GONE: Final = "cachebroker.peer.gone"
PEER_KEPT: Final = "cachebroker.peer.kept"
PEER_RETURNED: Final = "cachebroker.peer.returned"
PEER_REFUSED: Final = "cachebroker.peer.refused"
PEER_FAILED: Final = "cachebroker.peer.failed"
ACCEPT_FAILED: Final = "cachebroker.accept.failed"
BROKER_LOST: Final = "cachebroker.broker.lost"
PEER_RECONNECTING: Final = "cachebroker.peer.reconnecting"
PEER_RECONNECTED: Final = "cachebroker.peer.reconnected"
DAEMON_WAITING: Final = "cachebroker.daemon.waiting"
DAEMON_READY: Final = "cachebroker.daemon.ready"
PEERS_UNSAVED: Final = "cachebroker.daemon.peers_unsaved"
RAY_REPORT_FAILED: Final = "cachebroker.ray.report_failed"

ALL: Final = (
    HIT,
    MISS,
    WAIT,
    GRANT,
    LOAD_START,
    LOAD_DONE,
    LOAD_FAILED,
    LOAD_CANCELLED,
    LOAD_RETRY,
    RELEASE_REQUESTED,
    MOVE_START,
    MOVE_DONE,
    MOVE_FAILED,
    MOVE_STAYED,
    MOVE_REFUSED,
    RELEASE_FREED,
    RELEASE_FAILED,
    QUARANTINE_FORGOTTEN,
    ALIAS_LEARNED,
    ALIAS_REFUSED,
    MEMORY_SLOW,
    RELEASE_BLOCKING,
    LEASE_HELD,
    CLOSE_WAITING,
    LISTENER_FAILED,
    PROBE_FAILED,
    RELEASE_REFUSED,
    PEER_CONNECTED,
    PEER_GONE,
    PEER_KEPT,
    PEER_RETURNED,
    PEER_REFUSED,
    PEER_FAILED,
    ACCEPT_FAILED,
    BROKER_LOST,
    PEER_RECONNECTING,
    PEER_RECONNECTED,
    DAEMON_WAITING,
    DAEMON_READY,
    PEERS_UNSAVED,
    RAY_REPORT_FAILED,
)
