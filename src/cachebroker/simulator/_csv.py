"""Reading request traces from CSV files (see docs/simulator.md for the format).

A trace has a header line and one request per row. Every bad row is an error
that names its line and column; nothing is skipped except empty lines.
"""

from __future__ import annotations

import csv
import io
import math
import os
from collections.abc import Iterable
from typing import TextIO

from .._errors import InvalidArgument
from .._sizes import parse_bytes
from .._units import DEFAULT_SPACE
from ._request import Request

__all__ = ["COLUMNS", "TraceError", "parse_trace", "read_trace"]

#: The columns a trace may have, in the order the docs list them.
COLUMNS = (
    "time",
    "key",
    "size",
    "load_seconds",
    "hold_seconds",
    "space",
    "cache",
    "promote_seconds",
    "demote_seconds",
)
REQUIRED = ("time", "key", "size", "load_seconds")


class TraceError(InvalidArgument):
    """A trace file could not be read: the message names the line and column.

    Attributes:
        line: The line number (1 is the header), or ``None``.
        column: The column's name, or ``None``.
    """

    def __init__(
        self, message: str, *, source: str, line: int | None = None, column: str | None = None
    ) -> None:
        where = source
        if line is not None:
            where += f", line {line}"
        if column is not None:
            where += f", column {column!r}"
        super().__init__(f"{where}: {message}")
        self.line = line
        self.column = column


def read_trace(path: str | os.PathLike[str]) -> list[Request]:
    """Read the trace at ``path``.

    Raises:
        TraceError: the file is not a valid trace (the message says where).
        OSError: the file cannot be opened.
    """
    with open(path, newline="", encoding="utf-8-sig") as file:  # (a BOM is not a column)
        return parse_trace(file, source=os.fspath(path))


def parse_trace(text: str | TextIO | Iterable[str], *, source: str = "trace") -> list[Request]:
    """Parse a trace from its text, a text file or an iterable of lines."""
    lines = io.StringIO(text) if isinstance(text, str) else text
    reader = csv.reader(lines)
    try:
        header = next(reader)
    except StopIteration:
        raise TraceError(
            f"the trace is empty; expected a header naming the columns {', '.join(REQUIRED)}",
            source=source,
        ) from None
    except csv.Error as exc:
        raise TraceError(str(exc), source=source, line=reader.line_num) from None
    columns = _columns(header, source)
    requests: list[Request] = []
    seen: dict[tuple[str, str], Request] = {}
    previous = -math.inf
    while True:
        try:
            row = next(reader)
        except StopIteration:
            break
        except csv.Error as exc:
            raise TraceError(str(exc), source=source, line=reader.line_num) from None
        line = reader.line_num
        if not row or (len(row) == 1 and not row[0].strip()):
            continue  # an empty line holds no request
        if len(row) != len(columns):
            raise TraceError(
                f"expected {len(columns)} fields ({', '.join(columns)}), got {len(row)}",
                source=source,
                line=line,
            )
        fields = dict(zip(columns, (value.strip() for value in row), strict=True))
        request = _request(fields, line, source)
        if request.time < previous:
            raise TraceError(
                f"time {request.time:g} is earlier than the previous row's {previous:g}; "
                "rows must be in time order",
                source=source,
                line=line,
                column="time",
            )
        previous = request.time
        first = seen.setdefault((request.cache, request.key), request)
        if first.size != request.size:
            column = "space" if first.size.keys() != request.size.keys() else "size"
            raise TraceError(
                f"{request.cache}:{request.key} was {dict(first.size)} on line {first.line}; "
                "a key must have the same size and space on every row",
                source=source,
                line=line,
                column=column,
            )
        requests.append(request)
    return requests


def _columns(header: list[str], source: str) -> list[str]:
    columns = [name.strip() for name in header]
    for name in columns:
        if name not in COLUMNS:
            raise TraceError(
                f"unknown column {name!r}; a trace has the columns {', '.join(COLUMNS)}",
                source=source,
                line=1,
            )
        if columns.count(name) > 1:
            raise TraceError(f"column {name!r} appears twice", source=source, line=1)
    missing = [name for name in REQUIRED if name not in columns]
    if missing:
        raise TraceError(
            f"the header lacks the column(s) {', '.join(missing)} "
            f"(required: {', '.join(REQUIRED)})",
            source=source,
            line=1,
        )
    return columns


def _request(fields: dict[str, str], line: int, source: str) -> Request:
    def seconds(column: str, default: float | None = None) -> float:
        text = fields.get(column, "")
        if not text and default is not None:
            return default
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or (value < 0 and column != "time"):
            what = "a number of seconds" if column == "time" else "a non-negative number of seconds"
            raise TraceError(
                f"expected {what}, got {text!r}", source=source, line=line, column=column
            )
        return value

    def name(column: str, default: str | None = None) -> str:
        text = fields.get(column, "")
        if not text:
            if default is not None:
                return default
            raise TraceError("must not be empty", source=source, line=line, column=column)
        return text

    try:
        size = parse_bytes(name("size"), what="size")
    except (TypeError, ValueError) as exc:
        raise TraceError(str(exc), source=source, line=line, column="size") from None
    # Tier costs left out (or empty) take the Request's defaults.
    tier_costs = {
        column: seconds(column)
        for column in ("promote_seconds", "demote_seconds")
        if fields.get(column, "")
    }
    return Request(
        time=seconds("time"),
        key=name("key"),
        size={name("space", DEFAULT_SPACE): size},
        load_seconds=seconds("load_seconds"),
        hold_seconds=seconds("hold_seconds", 0.0),
        cache=name("cache", "default"),
        line=line,
        **tier_costs,
    )
