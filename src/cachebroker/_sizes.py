"""Reading byte quantities ("24GiB"), budgets and per-entry size specs from user input.

Everything user-supplied about bytes goes through here, so every malformed
value fails the same way: an ``InvalidArgument`` (a ``ValueError``) or a
``TypeError`` whose message names what was wrong.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from fractions import Fraction

from ._core._spaces import circle
from ._errors import InvalidArgument
from ._units import DEFAULT_SPACE, QUANTITY, UNITS

__all__ = ["budget_pairs", "parse_budget", "parse_bytes", "parse_size", "tier_map"]


def parse_bytes(value: object, *, what: str = "size") -> int:
    """Return ``value`` as a whole, non-negative number of bytes.

    Accepts an ``int`` or a string such as ``"512MiB"``, ``"1.5GiB"``, ``"24GB"``
    (decimal units are powers of 1000, binary ``KiB``/``MiB``/``GiB``/``TiB``
    powers of 1024) or ``"1024"``. A quantity that is not a whole number of
    bytes (``"0.5B"``, ``"1.3B"``) is an error, not rounded: rounded down,
    ``"0.5B"`` would be a budget of 0, which turns retention off.
    """
    if isinstance(value, bool):
        raise TypeError(f"{what} must be a number of bytes or a string like '24GiB', got {value!r}")
    if isinstance(value, numbers.Integral):  # int, and numpy's integers (``a.size * a.itemsize``)
        amount = int(value)
        if amount < 0:
            raise InvalidArgument(f"{what} must not be negative, got {value}")
        return amount
    if isinstance(value, numbers.Real):  # float, and numpy's floats
        number = float(value)
        if not math.isfinite(number) or number < 0 or not number.is_integer():
            raise InvalidArgument(
                f"{what} must be a whole, non-negative number of bytes, got {value!r}"
            )
        return int(number)
    if isinstance(value, str):
        match = QUANTITY.match(value)
        unit = match.group("unit").lower() if match else ""
        negated = QUANTITY.match(value.strip()[1:]) if value.strip().startswith("-") else None
        if negated is not None and negated.group("unit").lower() in UNITS:
            raise InvalidArgument(f"{what} must not be negative, got {value!r}")
        if match is None or unit not in UNITS:
            raise InvalidArgument(
                f"{what} {value!r} is not a byte quantity; expected a number with an "
                "optional unit such as '512MiB', '24GiB' or '1.5GB'"
            )
        # Exact for any number of digits (a float would overflow or round).
        exact = Fraction(match.group("num")) * UNITS[unit]
        if exact.denominator != 1:
            whole = math.floor(exact)
            raise InvalidArgument(
                f"{what} {value!r} is not a whole number of bytes ({float(exact):.10g} B, "
                f"between {whole} and {whole + 1}); give a whole number of bytes"
            )
        return int(exact)
    raise TypeError(
        f"{what} must be an int or a string like '24GiB', got {type(value).__name__} {value!r}"
    )


def budget_pairs(text: str, *, what: str = "budget") -> str | dict[str, str]:
    """Split a budget written as text into each space's amount, as written.

    The one grammar of a budget as text, whichever door it comes in by
    (``Broker(budget=...)``, ``CACHEBROKER_BUDGET``, ``cachebroker serve
    --budget``, the simulator's budgets): ``"24GiB"`` is one amount (returned
    alone), ``"ram=16GiB, cuda:0=24GiB"`` names each space's. What an amount
    may be is its reader's to say. ``what`` names the door in errors.
    """
    stripped = text.strip()
    if not stripped:
        raise InvalidArgument(f"{what} is empty; give e.g. '24GiB' or 'ram=16GiB,cuda:0=24GiB'")
    if "=" not in stripped:
        return stripped
    return space_pairs(text, what=what, form="SPACE=AMOUNT", example="ram=16GiB,cuda:0=24GiB")


def space_pairs(
    text: str, *, what: str, form: str, example: str, twice: str = "is given twice"
) -> dict[str, str]:
    """``"a=x, b=y"``: each space and what is written for it (budgets, tiers).

    ``form`` and ``example`` word the error for a malformed pair, ``twice``
    the one for a space given twice.
    """
    pairs: dict[str, str] = {}
    for part in text.strip().split(","):
        name, sep, value = (piece.strip() for piece in part.partition("="))
        if not sep or not name or not value:
            raise InvalidArgument(
                f"{what} {text!r}: expected {form} pairs separated by commas, "
                f"as in {example!r}, got {part.strip()!r}"
            )
        if name in pairs:
            raise InvalidArgument(f"{what} {text!r}: space {name!r} {twice}")
        pairs[name] = value
    return pairs


def parse_budget(budget: object, *, what: str = "budget") -> dict[str, int]:
    """Return the budget as a mapping of space name to bytes.

    A single quantity means one space named ``"default"``; a string naming
    spaces (``"ram=16GiB,cuda:0=24GiB"``) is read as ``budget_pairs`` reads it.
    """
    if isinstance(budget, str):
        budget = budget_pairs(budget, what=what)
    if isinstance(budget, Mapping):
        check_budget_mapping(budget, what=what)
        return {
            name: parse_bytes(amount, what=f"{what} of space {name!r}")
            for name, amount in budget.items()
        }
    return {DEFAULT_SPACE: parse_bytes(budget, what=what)}


def check_budget_mapping(budget: Mapping[object, object], *, what: str = "budget") -> None:
    """A budget mapping names at least one space, each by a non-empty string."""
    if not budget:
        raise InvalidArgument(f"{what} mapping must name at least one space")
    for name in budget:
        _check_space_name(name, what=what)


def parse_size(size: object, spaces: Mapping[str, int]) -> dict[str, int]:
    """Return a declared entry size as a mapping of space name to bytes.

    ``None`` declares nothing (an empty mapping). A plain quantity is charged
    to the ``"default"`` space, or to the only space when there is one.
    Unknown space names are rejected with the list of known ones.
    """
    if size is None:
        return {}
    if isinstance(size, Mapping):
        charge: dict[str, int] = {}
        for name, amount in size.items():
            _check_space_name(name, what="size")
            _check_known(name, spaces)
            amount = parse_bytes(amount, what=f"size in space {name!r}")
            if amount:
                charge[name] = amount
        return charge
    amount = parse_bytes(size)
    space = _single_space(spaces)
    return {space: amount} if amount else {}


def _single_space(spaces: Mapping[str, int]) -> str:
    if DEFAULT_SPACE in spaces:
        return DEFAULT_SPACE
    if len(spaces) == 1:
        return next(iter(spaces))
    raise InvalidArgument(
        "a plain size needs a 'default' space or a single-space budget; this broker "
        f"has spaces {sorted(spaces)}: give the size as a mapping, e.g. "
        f"{{{sorted(spaces)[0]!r}: '1GiB'}}"
    )


def _check_known(name: str, spaces: Mapping[str, int]) -> None:
    if name not in spaces:
        raise InvalidArgument(f"unknown space {name!r}; the budget has spaces {sorted(spaces)}")


def _check_space_name(name: object, *, what: str = "budget") -> None:
    if not isinstance(name, str) or not name:
        raise TypeError(f"{what} space names must be non-empty strings, got {name!r}")


def tier_map(tiers: object, budget: Mapping[str, int]) -> dict[str, str]:
    """``tiers`` as {space: the space below it}: names of the budget's spaces, no cycle.

    (``Broker(tiers=...)`` and the simulator's ``tiers=`` both read it here.)
    """
    if tiers is None:
        return {}
    if not isinstance(tiers, Mapping):
        raise TypeError(
            f'tiers must map a space to the space below it, e.g. {{"cuda:0": "ram"}}, got {tiers!r}'
        )
    result: dict[str, str] = {}
    for upper, lower in tiers.items():
        for name in (upper, lower):
            if not isinstance(name, str):
                raise TypeError(f"tiers names spaces by their names (str), got {name!r}")
            if name not in budget:
                raise InvalidArgument(
                    f"tiers names space {name!r}, which is not in the budget "
                    f"({', '.join(map(repr, budget))})"
                )
        if upper == lower:
            raise InvalidArgument(f"tiers puts space {upper!r} below itself")
        result[upper] = lower
    found = circle(result)
    if found is not None:
        raise InvalidArgument(f"tiers go round in a circle: {' -> '.join(found)}")
    return result
