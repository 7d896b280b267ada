"""The idle sweeper (expiry, probe re-reads, the held-lease check) and the memory probes.

``Probes`` reads each probed space's device: its capacity for the books
before every miss and on the sweeper's timer, and the free bytes before and
after a release, whose bytes must show on the device before they are handed
out again. ``Sweeper`` is the broker's periodic task: it expires idle
entries (``Core.sweep``), re-reads the probes, and has ``HeldLeases`` look
for leases held while requests wait.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Protocol

import anyio

from .. import _log_events as ev
from .._core import Entry
from ..probes import Probe
from . import _logging
from ._steps import Steps

__all__ = ["HeldCheck", "Probes", "Sweeper"]


class HeldCheck(Protocol):
    """What the sweeper runs for leases held too long (``_releases.HeldLeases``)."""

    #: Seconds a lease may be held while requests wait for its space (``None``: no check).
    limit: float | None

    def check(self) -> None:
        """Report the leases held ``limit`` seconds by now."""


class Probes:
    """The probed spaces' devices: capacities for the books, and the wait for freed memory."""

    __slots__ = ("_logger", "_ok", "_steps", "bound", "memory_wait", "probes")

    def __init__(
        self, steps: Steps, probes: dict[str, Probe], memory_wait: float | None, logger: object
    ) -> None:
        self._steps = steps
        self.probes = probes
        self.memory_wait = memory_wait
        self._logger = logger
        #: Whether the broker's events are bound (``emit``): set once it started.
        self.bound = False
        #: Probed spaces that have had a good reading.
        self._ok: set[str] = set()

    def refresh(self) -> None:
        """Re-read every probed space's device and set its capacity.

        A space whose read fails keeps the capacity its last good reading gave;
        with no good reading yet, it is taken as full (what is used now).
        """
        core = self._steps.core
        for name, probe in self.probes.items():
            reading = self.read(name)
            held = core.spaces[name].used
            if reading is not None:
                total, free = reading
                capacity = max(0, min(total - probe.headroom, free + held - probe.headroom))
                core.set_capacity(name, capacity, limit=total - probe.headroom)
            elif name not in self._ok:
                core.set_capacity(name, held)
        if self._steps.running:
            self._steps.apply()

    def read(self, name: str) -> tuple[int, int] | None:
        """Read space ``name``'s probe: ``(total, free)`` bytes, or ``None`` if the read failed.

        A failed read (a transient NVML or psutil error) is logged, never
        raised: the caller keeps what it knew, or stops waiting, and the probe
        is read again next time.
        """
        probe = self.probes[name]
        try:
            reading = probe.read()
        except Exception as exc:
            fields = {"space": name, "probe": probe.name, "error": repr(exc)}
            if not self.bound:  # from __init__: the broker has not bound its logger yet
                _logging.open_events(self._logger).warning(ev.PROBE_FAILED, **fields)
            else:
                self._steps.emit("warning", ev.PROBE_FAILED, **fields)
            return None
        self._ok.add(name)
        return reading

    def free_before(self, entry: Entry) -> dict[str, int]:
        """Free bytes of ``entry``'s probed spaces before its release, to wait for them after.

        A space whose probe cannot be read now is not waited for.
        """
        if not self.memory_wait:
            return {}
        before: dict[str, int] = {}
        for name in entry.charge:
            if name in self.probes:
                reading = self.read(name)
                if reading is not None:
                    before[name] = reading[1]
        return before

    async def wait_for_memory(
        self, entry: Entry, before: dict[str, int], amounts: Mapping[str, int] | None = None
    ) -> None:
        """After a release (or a move: ``amounts``, the bytes it frees) on probed spaces,
        wait (bounded) for the device to show it."""
        freeing = entry.charge if amounts is None else amounts
        wanted = {name: free + int(0.75 * freeing.get(name, 0)) for name, free in before.items()}
        with anyio.move_on_after(self.memory_wait or 0):
            while True:
                short: dict[str, int] = {}
                for name, need in wanted.items():
                    reading = self.read(name)
                    if reading is None:
                        return  # the device cannot be read: do not wait for it
                    if reading[1] < need:
                        short[name] = need
                if not short:
                    return
                await anyio.sleep(0.02)
        self._steps.emit(
            "warning",
            ev.MEMORY_SLOW,
            cache=entry.owner.name,
            key=entry.key,
            spaces=sorted(short),
            waited=self.memory_wait,
        )


class Sweeper:
    """The broker's timer: idle expiry, probe re-reads, the check of leases held too long."""

    __slots__ = ("_at", "_held", "_interval", "_probes", "_steps", "_wake")

    def __init__(
        self, steps: Steps, probes: Probes, held: HeldCheck, probe_interval: float | None
    ) -> None:
        self._steps = steps
        self._probes = probes
        self._held = held
        self._interval = probe_interval
        #: When the sweeper runs next (``None``: no entry expires), and what wakes it.
        self._at: float | None = None
        self._wake: anyio.Event | None = None

    def prepare(self) -> None:
        """The broker starts: from now on ``note_idle`` and ``waiting`` wake the sweeper."""
        self._wake = anyio.Event()

    def note_idle(self, entry: Entry) -> None:
        """Wake the sweeper if ``entry`` expires before its current deadline."""
        ttl = self._steps.idle_ttl if entry.ttl is None else entry.ttl
        if ttl is None or ttl == math.inf or self._wake is None:
            return
        if self._at is None or entry.idle_since + ttl < self._at:
            self._wake.set()

    def waiting(self) -> None:
        """A request started waiting for space: check on the leases it waits for from now on."""
        if self._held.limit is not None and self._wake is not None:
            self._wake.set()

    async def run(self) -> None:
        """Sweep whenever an entry expires, a probe is due, or the held leases are."""
        steps = self._steps
        core = steps.core
        probed = self._probes.probes
        lease_warning = self._held.limit
        while True:
            deadline = core.next_expiry()
            self._at = deadline
            wake = self._wake = anyio.Event()
            delay = math.inf if deadline is None else max(0.0, deadline - steps.clock())
            if probed:
                delay = min(delay, self._interval or math.inf)
            if core.queue and lease_warning is not None:
                delay = min(delay, lease_warning / 4)
            with anyio.move_on_after(delay):
                await wake.wait()
            if probed:
                self._probes.refresh()
            core.sweep(steps.clock())
            steps.apply()
            self._held.check()
