"""Byte units: their names, the grammar of a quantity, and how the broker writes one.

A leaf module: the errors render sizes with ``format_bytes``, and
``_sizes`` reads user input with the grammar defined here.
"""

from __future__ import annotations

import re

__all__ = ["DEFAULT_SPACE", "QUANTITY", "UNITS", "format_bytes"]

DEFAULT_SPACE = "default"

UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
QUANTITY = re.compile(r"^\s*(?P<num>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[A-Za-z]*)\s*$")


def format_bytes(amount: int) -> str:
    """Format a byte count with the largest binary unit that keeps it readable."""
    value = float(amount)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{amount} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
