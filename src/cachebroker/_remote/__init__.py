"""One broker for every process on a machine: ``cachebroker serve`` and ``Broker.connect()``.

* ``_protocol``: the wire: length-prefixed JSON frames over a Unix socket,
  the message set (``docs/processes.md``), the default address, errors;
* ``_daemon``: the shared broker: a ``Broker`` whose owners are the caches
  of connected processes (``Daemon``), and ``serve``;
* ``_client``: a ``Broker`` in a client process whose books admit nothing
  before the daemon granted the bytes (``connect``);
* ``_serve`` and ``_ps``: the ``cachebroker serve`` and ``cachebroker ps``
  commands.

Values never cross the socket: each process keeps its own, and its own
books (leases, loads, releases). The daemon's books hold one entry per
entry a process loaded, and decide who gets space and which entries are
asked to go.
"""
