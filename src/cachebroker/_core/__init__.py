"""The sans-I/O bookkeeping: entries, spaces, waiters, grants and evictions.

Nothing here awaits, sleeps or reads a clock. Every method is one synchronous
step that updates the books and queues the work that must happen next
(start this load, ask this owner to release, wake these waiters) in
``Core.effects``; the async shell (``_shell``'s ``Runner.apply``) drains and
performs it and reports the outcome back (``load_done``, ``release_done``,
...). Because the
steps are deterministic, property-based tests and the simulator drive this
class directly.

Modules, in reading order:

* ``_model``: the data: ``Space``, ``Owner``, ``Entry``, ``Ticket``, the
  ``State`` of an entry and the ``Reason`` of a release, and the constants;
* ``_waiting`` and ``_spaces``: the owners of the books' lines of waiters
  (``Queue``, ``Gate``) and of how spaces relate (``Canon``, ``Tiers``), each
  with its own ``check``; ``_state``: ``Books``, all the books' state;
* ``_transitions``: every change of an entry's state, one function each;
* ``_effects``: the work a step leaves for the shell (``StartLoad``,
  ``CancelLoad``, ``StartRelease``, ``StartMove``, ``Settled``, ``Quarantined``,
  ``OwnerEmpty``; ``Effect`` is any of them);
* ``_books``: ``Core``: the steps the shell takes (``request``, ``hit``,
  ``lease_end``, ``load_done``, ``release_done``, ...) and the primitives
  they share with the modules below (grant, start a release, doom, ...);
* ``_scheduler``: who gets space next: per-space FIFO grants, eviction,
  fairness for long waiters, refusal of requests that can never be granted;
* ``_reach``: what room a waiter could ever reach (the bytes it may never
  evict: pins, higher priorities, stranded quarantine, its own leases), the
  quarantined entries whose release runs past its timeout (``Overdue``), and
  why a waiter has no room, in words (``why_no_room``);
* ``_aliases``: spaces learned to be one memory, and merging them;
* ``_invariants``: ``Core.check()`` (the invariants below), ``STEPS`` and
  the test build that checks the books after each of them.

Nothing in this package imports anything asynchronous (no anyio, structlog
or event loop, nothing of the shell or the simulator): only ``_errors``,
``_units`` and ``_policies`` from the rest of the library.

Invariants kept after every step:

* per space, ``used`` is the sum of the charges of every entry that is
  ``loading``, ``ready``, ``releasing`` or ``quarantined``; ``used`` never
  exceeds the budget except transiently after a load measured larger than it
  declared, which is corrected by evicting at once;
* ``releasing`` is the part of ``used`` whose release is in flight;
  ``idle_bytes`` the part held by entries the policy may pick as victims
  (an entry whose last lease just ended becomes one lazily, in lease-end
  order, before anything reads these books: ``_transitions.settle``);
* a leased entry is never handed to the policy, so it is never a victim;
* an entry queued for space has at least one requester waiting on it;
* waiters are granted in arrival order within each space: a request never
  overtakes an earlier one that shares a space with it, unless no eviction
  could let that one in (it waits aside: ``_reach``);
* per space, ``pinned`` and ``ranked`` are the bytes of ready, undoomed
  entries, pinned and by priority; ``overdue`` is the part of
  ``quarantined`` whose release still runs;
* a demoted entry is never charged in every space of its home (it would be
  home: no move back), its places never include a space it is parked in,
  and a demotion waiting for room frees bytes somewhere: no entry asks for
  its own bytes again beside themselves.
"""

from ._books import Core
from ._effects import (
    CancelLoad,
    Effect,
    OwnerEmpty,
    Quarantined,
    Settled,
    StartLoad,
    StartMove,
    StartRelease,
)
from ._invariants import STEPS, check_after_every_step
from ._model import (
    FAIR_REQUESTS,
    REMEMBERED_SIZES,
    UNBOUNDED,
    Entry,
    Owner,
    Reason,
    Request,
    Space,
    State,
    Ticket,
)

__all__ = [
    # the books and their data
    "Core",
    "Entry",
    "Owner",
    "Reason",
    "Request",
    "Space",
    "State",
    "Ticket",
    "FAIR_REQUESTS",
    "REMEMBERED_SIZES",
    "UNBOUNDED",
    # the effects a step leaves for the shell
    "Effect",
    "StartLoad",
    "CancelLoad",
    "StartRelease",
    "StartMove",
    "Settled",
    "Quarantined",
    "OwnerEmpty",
    # the test build
    "STEPS",
    "check_after_every_step",
]
