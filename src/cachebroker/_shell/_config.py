"""The shell's arguments: their types, their checks, and ``Broker.from_env``'s parsing.

Pure functions of their arguments (and of the environment mapping given):
nothing here needs a running event loop.
"""

from __future__ import annotations

import inspect
import math
import numbers
import os
from collections.abc import Awaitable, Callable, Hashable, Iterable, Mapping
from typing import Any, Protocol, SupportsIndex, TypeVar, cast, runtime_checkable

from .._errors import InvalidArgument, OutOfSpace
from .._policies import make_policy
from .._sizes import budget_pairs, check_budget_mapping, parse_bytes, parse_size, space_pairs
from .._units import DEFAULT_SPACE
from ..probes import NvidiaGPU, Probe, SystemMemory

__all__ = [
    "BudgetValue",
    "Listener",
    "Quantity",
    "ReleaseFunction",
    "Releaser",
    "SizeSpec",
    "alias_groups",
    "budget_value",
    "env_arguments",
    "is_async_callable",
    "non_negative_seconds",
    "oom_error_types",
    "positive_seconds",
    "remembered_sizes",
    "resolve_releaser",
    "split_probes",
]

T = TypeVar("T")


@runtime_checkable
class Releaser(Protocol):
    """What a plugin implements so the broker can ask it to free a value.

    ``release`` runs in the plugin's own task group (its ``broker.cache(...)``
    block). Returning is the "freed" acknowledgement: the broker then counts
    the value's bytes as free and may hand them to another plugin. Raising, or
    not returning within the broker's ``release_timeout``, means the release
    failed: the entry is quarantined and its bytes stay charged.
    """

    # A releaser may also offer ``async def move(self, key, value, to) -> value``
    # (not part of the protocol, which every releaser must satisfy): with
    # ``Broker(tiers=...)``, the broker asks it to move an idle value to the
    # space below (a demotion, instead of a release) and back (a promotion, for
    # an acquire); it returns the value in its new form. See docs/memory.md.

    async def release(self, key: Any, value: Any) -> None:
        """Free ``value``, the value loaded for ``key``.

        Return only once the memory is really free (for a GPU, once the
        framework's allocator gave it back). Cancellation: the broker cancels
        a release only when the plugin's cache block is torn down past
        ``release_timeout`` (for a value that a plain loader's thread returned
        after the block was left: when the broker is); the entry is then
        quarantined.
        """


ReleaseFunction = Callable[[Any, Any], Awaitable[None]]
#: A releaser's optional ``move(key, value, to)``: the value, moved to space ``to``.
MoveFunction = Callable[[Any, Any, str], Awaitable[Any]]
#: ``listener(event, fields)``: see ``Broker.add_listener``.
Listener = Callable[[str, Mapping[str, Any]], None]
#: Bytes: an ``int`` (numpy integers too), a whole ``float``, or ``"3GiB"``.
Quantity = SupportsIndex | float | str
SizeSpec = Quantity | Mapping[str, Quantity] | Callable[[Any], Any] | None
BudgetValue = int | str | Probe | Callable[[], tuple[int, int]]


def is_async_callable(func: object) -> bool:
    if inspect.iscoroutinefunction(func):
        return True
    call = getattr(type(func), "__call__", None)  # noqa: B004 - instances with async __call__
    return call is not None and inspect.iscoroutinefunction(call) and not inspect.isroutine(func)


def resolve_releaser(releaser: object) -> ReleaseFunction:
    method = getattr(releaser, "release", None)
    if method is not None and is_async_callable(method):
        return cast(ReleaseFunction, method)
    if is_async_callable(releaser):
        return cast(ReleaseFunction, releaser)
    raise TypeError(
        "releaser must be an object with an 'async def release(self, key, value)' method "
        f"or an async function (key, value) -> None, got {releaser!r}"
    )


def resolve_mover(releaser: object) -> MoveFunction | None:
    """The releaser's ``async def move(self, key, value, to)``, if it offers one."""
    method = getattr(releaser, "move", None)
    if method is None:
        return None
    if not is_async_callable(method):
        raise TypeError(
            "a releaser's move must be 'async def move(self, key, value, to)' returning the "
            f"value moved to space 'to', got {method!r}"
        )
    return cast(MoveFunction, method)


def non_negative_seconds(value: object, what: str, *, allow_inf: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a number of seconds, got {value!r}")
    if math.isnan(value) or value < 0 or (math.isinf(value) and not allow_inf):
        raise InvalidArgument(f"{what} must be a non-negative number of seconds, got {value!r}")
    return float(value)


def lease_slots(value: object, what: str = "concurrency") -> int:
    """``value`` as a number of lease slots on one entry: an int of at least 1."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{what} must be a whole number of leases (1 for one at a time), got {value!r}"
        )
    if value < 1:
        raise InvalidArgument(f"{what} must be at least 1 lease at a time, got {value!r}")
    return int(value)


def eviction_priority(value: object, what: str = "priority") -> int:
    """``value`` as an eviction priority: any int (lower is evicted first)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} must be an int (lower is evicted first), got {value!r}")
    return int(value)


def positive_seconds(value: object, what: str, *, inf_is_none: bool = False) -> float | None:
    """``value`` as positive seconds; ``None`` (and ``math.inf`` where allowed) for "no limit"."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a number of seconds or None, got {value!r}")
    seconds = float(value)
    if seconds == math.inf and inf_is_none:
        return None
    if not math.isfinite(seconds) or seconds <= 0:
        raise InvalidArgument(f"{what} must be a positive number of seconds or None, got {value!r}")
    return seconds


def budget_value(budget: object, *, what: str = "budget") -> int | dict[str, int | Probe]:
    """``budget`` read and checked: bytes, or each space's bytes or probe.

    The one reader behind every door a budget comes in by: ``Broker(budget=...)``,
    ``CACHEBROKER_BUDGET`` and ``cachebroker serve --budget`` (``what`` names the
    door in errors). Text follows ``budget_pairs``'s grammar (``"24GiB"``,
    ``"ram=16GiB,cuda:0=24GiB"``); each amount, in text or in a mapping, is
    bytes (``int`` or ``"16GiB"``), a ``Probe`` or a callable returning
    ``(total, free)``, or a probe written as text: ``"system"`` (the machine's
    available memory) or ``"nvidia:INDEX"`` (an NVIDIA GPU's free memory),
    each with an optional headroom, ``"system-4GiB"``. Amounts given alone
    (not in a mapping) are the ``"default"`` space's.
    """
    if isinstance(budget, str):
        budget = budget_pairs(budget, what=what)
    if isinstance(budget, Mapping):
        check_budget_mapping(budget, what=what)
        return {
            name: _space_amount(amount, space=name, what=f"{what} of space {name!r}")
            for name, amount in budget.items()
        }
    amount = _space_amount(budget, space=DEFAULT_SPACE, what=what)
    return amount if isinstance(amount, int) else {DEFAULT_SPACE: amount}


def _space_amount(amount: object, *, space: str, what: str) -> int | Probe:
    if isinstance(amount, Probe):
        return amount
    if isinstance(amount, str):
        probe = _probe_text(amount.strip(), what=what)
        if probe is not None:
            return probe
    elif callable(amount):
        return Probe(amount, name=space)
    return parse_bytes(amount, what=what)


def _probe_text(text: str, *, what: str) -> Probe | None:
    """``"system-4GiB"`` or ``"nvidia:0-1GiB"`` as a probe; ``None`` for anything else."""
    device, _, headroom = text.partition("-")
    device = device.strip()
    room = headroom.strip() or 0
    if device == "system":
        return SystemMemory(headroom=_headroom(room, what))
    if device == "nvidia" or device.startswith("nvidia:"):
        index = device.partition(":")[2].strip() or "0"
        if not index.isdigit():
            raise InvalidArgument(f"{what}: expected nvidia:INDEX, got {device!r}")
        return NvidiaGPU(int(index), headroom=_headroom(room, what))
    return None


def _headroom(room: str | int, what: str) -> int:
    return parse_bytes(room, what=f"{what}: the headroom")


def split_probes(budget: int | Mapping[str, int | Probe]) -> tuple[Any, dict[str, Probe]]:
    """Separate probed spaces from fixed ones (``budget_value``'s result); probed ones
    start at 0 bytes, until their first reading."""
    if not isinstance(budget, Mapping):
        return budget, {}
    fixed: dict[str, int] = {}
    probes: dict[str, Probe] = {}
    for name, amount in budget.items():
        if isinstance(amount, Probe):
            probes[name] = amount
            fixed[name] = 0
        else:
            fixed[name] = amount
    return fixed, probes


def remembered_sizes(
    sizes: Mapping[str, Mapping[Any, Any]] | None, spaces: Mapping[str, int]
) -> list[tuple[str, Hashable, dict[str, int]]]:
    """Check ``Broker(sizes=...)``: ``{cache: {key: size}}`` as ``export_sizes()`` returns it."""
    if sizes is None:
        return []
    if not isinstance(sizes, Mapping):
        raise TypeError(f"sizes must be a mapping {{cache: {{key: size}}}}, got {sizes!r}")
    remembered = []
    for cache_name, keys in sizes.items():
        if not isinstance(cache_name, str) or not isinstance(keys, Mapping):
            raise TypeError(
                "sizes must map each cache name (a string) to a mapping {key: size}, "
                f"got {cache_name!r}: {keys!r}"
            )
        for key, size in keys.items():
            try:
                charge = parse_size(size, spaces)
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"sizes[{cache_name!r}][{key!r}]: {exc}") from None
            remembered.append((cache_name, key, charge))
    return remembered


def alias_groups(groups: Iterable[Iterable[str]], spaces: Mapping[str, int]) -> list[list[str]]:
    result = []
    for group in groups:
        if isinstance(group, str):
            raise TypeError(f"aliases must be groups of space names, got the string {group!r}")
        names = list(group)
        for name in names:
            if name not in spaces:
                raise InvalidArgument(
                    f"alias names unknown space {name!r}; the budget has spaces {sorted(spaces)}"
                )
        if len(names) < 2:
            raise InvalidArgument(f"an alias group needs at least two spaces, got {names!r}")
        result.append(names)
    return result


def oom_error_types(
    extra: type[BaseException] | tuple[type[BaseException], ...],
) -> tuple[type[BaseException], ...]:
    given = extra if isinstance(extra, tuple) else (extra,)
    for kind in given:
        if not (isinstance(kind, type) and issubclass(kind, Exception)):
            raise TypeError(f"oom_errors must be exception classes, got {kind!r}")
    return (MemoryError, OutOfSpace, *given)


def oom_retry_bound(retries: object) -> int:
    """``oom_retries``, checked: how many times one load may be retried after freeing."""
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise InvalidArgument(f"oom_retries must be a non-negative int, got {retries!r}")
    return retries


def env_arguments(
    environ: Mapping[str, str] | None, overrides: Mapping[str, Any]
) -> dict[str, Any]:
    """``Broker``'s keyword arguments from ``CACHEBROKER_*`` variables, ``overrides`` winning.

    See ``Broker.from_env``.
    """
    env = os.environ if environ is None else environ
    kwargs: dict[str, Any] = {}
    raw = env.get("CACHEBROKER_BUDGET")
    if "budget" not in overrides:
        if raw is None or not raw.strip():
            raise InvalidArgument(
                "CACHEBROKER_BUDGET is not set; set it to e.g. '24GiB' or 'ram=16GiB,cuda:0=24GiB'"
            )
        kwargs["budget"] = _env_value("CACHEBROKER_BUDGET", raw, budget_value)
    raw = env.get("CACHEBROKER_IDLE_TTL")
    if raw is not None and raw.strip():
        kwargs["idle_ttl"] = _env_value("CACHEBROKER_IDLE_TTL", raw, _parse_env_ttl)
    raw = env.get("CACHEBROKER_POLICY")
    if raw is not None and raw.strip():
        kwargs["policy"] = _env_value("CACHEBROKER_POLICY", raw, _parse_env_policy)
    raw = env.get("CACHEBROKER_TIERS")
    if raw is not None and raw.strip():
        kwargs["tiers"] = _env_value("CACHEBROKER_TIERS", raw, _parse_env_tiers)
    kwargs.update(overrides)
    return kwargs


def _env_value(name: str, raw: str, parse: Callable[[str], T]) -> T:
    try:
        return parse(raw)
    except (ValueError, TypeError) as exc:
        raise InvalidArgument(f"{name}={raw!r} is invalid: {exc}") from exc


def _parse_env_tiers(raw: str) -> dict[str, str]:
    """``"cuda:0=ram,cuda:1=ram"``: each space and the space below it."""
    return space_pairs(
        raw,
        what="tiers",
        form="space=lower space",
        example="cuda:0=ram",
        twice="is given two lower tiers",
    )


def _parse_env_ttl(raw: str, zero: str = "turns idle eviction off") -> float | None:
    """``raw`` as seconds, ``0`` as ``None`` (what ``zero`` says it does)."""
    try:
        seconds = float(raw)
    except ValueError:
        raise InvalidArgument(f"expected a number of seconds (0 {zero})") from None
    if not math.isfinite(seconds) or seconds < 0:
        raise InvalidArgument(f"expected a non-negative number of seconds (0 {zero})")
    return seconds or None


def _parse_env_policy(raw: str) -> str:
    make_policy(raw.strip())
    return raw.strip()
