"""Hardware probes: let a space's budget follow a real device's free memory.

Give a probe instead of a number in the budget::

    from cachebroker.probes import NvidiaGPU, SystemMemory

    Broker(budget={"ram": SystemMemory(headroom="4GiB"), "cuda:0": NvidiaGPU(0, headroom="1GiB")})

The space's capacity is then the device's free memory plus what this broker
already holds there, minus the headroom (and never above the device's total
minus the headroom), re-read before each miss and on the broker's timer. So
other processes on the machine are respected: when they take memory, the
broker evicts idle entries to stay within what is really there. After a
release on a probed space, the broker waits (bounded) until the device shows
the memory back.

``SystemMemory`` needs ``psutil`` (the ``psutil`` extra), ``NvidiaGPU``
needs ``nvidia-ml-py`` (the ``nvidia`` extra);
importing cachebroker needs neither. Any callable returning ``(total, free)``
bytes works too: ``Probe(my_reader, headroom="1GiB")``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._errors import InvalidArgument
from ._sizes import parse_bytes
from ._units import format_bytes

__all__ = ["NvidiaGPU", "Probe", "SystemMemory"]


class Probe:
    """A device's memory, read by a callable returning ``(total, free)`` bytes.

    Args:
        read: Returns the device's total and free bytes, quickly and without
            blocking for long (it is called on the event loop).
        headroom: Bytes (or ``"2GiB"``) to leave free for everything else.
        name: How logs and errors name the device.
    """

    def __init__(
        self,
        read: Callable[[], tuple[int, int]],
        *,
        headroom: int | str = 0,
        name: str | None = None,
    ) -> None:
        if not callable(read):
            raise TypeError(f"a probe needs a callable returning (total, free), got {read!r}")
        self._read = read
        self.headroom = parse_bytes(headroom, what="headroom")
        self.name = name or getattr(read, "__name__", "probe")

    def read(self) -> tuple[int, int]:
        """Return ``(total, free)`` bytes, checked."""
        reading = self._read()
        try:
            total, free = (int(x) for x in reading)
        except (TypeError, ValueError):
            raise InvalidArgument(
                f"probe {self.name} must return (total, free) bytes, got {reading!r}"
            ) from None
        if total < 0 or free < 0:
            raise InvalidArgument(f"probe {self.name} returned negative bytes: {reading!r}")
        return total, free

    def capacity(self, held: int) -> int:
        """What a broker holding ``held`` bytes here may use in all."""
        total, free = self.read()
        return max(0, min(total - self.headroom, free + held - self.headroom))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name}, headroom={format_bytes(self.headroom)})"


class SystemMemory(Probe):
    """System RAM as psutil sees it: ``available`` counts as free."""

    def __init__(self, *, headroom: int | str = 0) -> None:
        try:
            import psutil
        except ImportError:  # pragma: no cover - depends on the environment
            raise ImportError(
                "SystemMemory needs psutil: pip install psutil (cachebroker's 'psutil' extra)"
            ) from None

        def read() -> tuple[int, int]:
            memory = psutil.virtual_memory()
            return memory.total, memory.available

        super().__init__(read, headroom=headroom, name="system memory")


class NvidiaGPU(Probe):
    """One NVIDIA GPU's memory, through NVML (``nvidia-ml-py``)."""

    def __init__(self, index: int = 0, *, headroom: int | str = 0) -> None:
        try:
            import pynvml
        except ImportError:  # pragma: no cover - depends on the environment
            raise ImportError(
                "NvidiaGPU needs nvidia-ml-py: "
                "pip install nvidia-ml-py (cachebroker's 'nvidia' extra)"
            ) from None
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise InvalidArgument(f"GPU index must be a non-negative int, got {index!r}")
        nvml: Any = pynvml
        try:
            nvml.nvmlInit()
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
        except nvml.NVMLError as exc:
            raise InvalidArgument(f"NVML cannot open GPU {index}: {exc}") from exc

        def read() -> tuple[int, int]:
            info = nvml.nvmlDeviceGetMemoryInfo(handle)
            return int(info.total), int(info.free)

        super().__init__(read, headroom=headroom, name=f"cuda:{index}")
