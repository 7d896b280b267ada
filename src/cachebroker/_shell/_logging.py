"""Where the broker's events go: the application's structlog, else the stdlib logger "cachebroker".

A library stays silent and cheap until the application asks. When the
application configured structlog, or passed a structlog logger, events go
through it as they are. Otherwise they go to a standard library logger
(``logging.getLogger("cachebroker")`` unless one is given), so the levels and
handlers of ``logging`` decide what shows: nothing below ``WARNING`` by
default. The choice is made when a broker starts (``async with``); the
logger's level may change at any time (see ``debug_check`` for hits).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import structlog

__all__ = ["NAME", "Guarded", "StdlibEvents", "check_logger", "debug_check", "open_events"]

#: The stdlib logger (and the structlog logger name) the broker logs to by default.
NAME = "cachebroker"

StdlibLogger = logging.Logger | logging.LoggerAdapter  # type: ignore[type-arg]


class StdlibEvents:
    """The broker's events sent to a standard library logger.

    It has the methods the broker calls on a structlog logger (``debug``,
    ``info``, ``warning``, ``error``, ``bind``). An event is dropped before
    anything is built unless the logger is enabled for its level; one that
    is kept becomes a record whose message reads ``event key=value ...``
    (rendered only if a handler formats it) and which carries the event name
    as ``record.event`` and its fields as ``record.fields``.
    """

    __slots__ = ("_logger", "is_enabled_for")

    def __init__(self, logger: StdlibLogger) -> None:
        self._logger = logger
        self.is_enabled_for: Callable[[int], bool] = logger.isEnabledFor

    def bind(self) -> StdlibEvents:
        """Return this logger (there is no context to bind: the fields say it all)."""
        return self

    def debug(self, event: str, **fields: Any) -> None:
        """Log ``event`` at ``DEBUG``."""
        self._log(logging.DEBUG, event, fields)

    def info(self, event: str, **fields: Any) -> None:
        """Log ``event`` at ``INFO``."""
        self._log(logging.INFO, event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        """Log ``event`` at ``WARNING``."""
        self._log(logging.WARNING, event, fields)

    def error(self, event: str, **fields: Any) -> None:
        """Log ``event`` at ``ERROR``."""
        self._log(logging.ERROR, event, fields)

    def _log(self, level: int, event: str, fields: dict[str, Any]) -> None:
        logger = self._logger
        if logger.isEnabledFor(level):
            logger.log(level, "%s", _Line(event, fields), extra={"event": event, "fields": fields})

    def __repr__(self) -> str:
        return f"<StdlibEvents {self._logger!r}>"


class _Line:
    """An event rendered as ``event key=value ...`` when a handler formats it, not before."""

    __slots__ = ("event", "fields")

    def __init__(self, event: str, fields: Mapping[str, Any]) -> None:
        self.event = event
        self.fields = fields

    def __str__(self) -> str:
        pairs = " ".join(f"{name}={value!r}" for name, value in self.fields.items())
        return f"{self.event} {pairs}" if pairs else self.event

    __repr__ = __str__


def check_logger(logger: object) -> object:
    """Return ``logger`` if the broker can log through it, else raise ``TypeError``."""
    if logger is None or isinstance(logger, StdlibLogger):
        return logger
    if callable(getattr(logger, "bind", None)):
        return logger
    raise TypeError(
        "logger must be a structlog logger (with .bind(), e.g. structlog.get_logger()), "
        "a logging.Logger or a logging.LoggerAdapter, or None for the default "
        f"(structlog if it is configured, else logging.getLogger({NAME!r})); got {logger!r}"
    )


def open_events(logger: object) -> Guarded:
    """The logger a starting broker logs through, given its ``logger=`` argument."""
    if logger is None:
        if structlog.is_configured():
            return Guarded(structlog.get_logger(NAME).bind())
        return Guarded(StdlibEvents(logging.getLogger(NAME)))
    if isinstance(logger, StdlibLogger):
        return Guarded(StdlibEvents(logger))
    return Guarded(logger.bind())  # type: ignore[attr-defined]


class Guarded:
    """The application's logger, kept from failing the broker.

    An event is logged from inside the broker's steps: a logger that raises
    there (a closed pipe under a ``PrintLogger``, a failing processor or
    filter) would stop the step half-done and leave reservations behind.
    What the logger raises is dropped with its event instead; the first
    failure says so in one ``RuntimeWarning`` (lost in turn if the warning
    cannot be shown either), and ``failures`` counts them.
    """

    __slots__ = ("_log", "failures", "is_enabled_for")

    def __init__(self, log: Any) -> None:
        self._log = log
        self.failures = 0
        check = debug_check(log)
        self.is_enabled_for: Callable[[int], bool] = (
            check if check is _always else self._guard_check(check)
        )

    def _guard_check(self, check: Callable[[int], bool]) -> Callable[[int], bool]:
        def is_enabled_for(level: int) -> bool:
            try:
                return check(level)
            except Exception as exc:
                self._failed(exc)
                return False

        return is_enabled_for

    def debug(self, event: str, **fields: Any) -> None:
        """Log ``event`` at ``DEBUG``."""
        self._call("debug", event, fields)

    def info(self, event: str, **fields: Any) -> None:
        """Log ``event`` at ``INFO``."""
        self._call("info", event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        """Log ``event`` at ``WARNING``."""
        self._call("warning", event, fields)

    def error(self, event: str, **fields: Any) -> None:
        """Log ``event`` at ``ERROR``."""
        self._call("error", event, fields)

    def _call(self, level: str, event: str, fields: dict[str, Any]) -> None:
        try:
            getattr(self._log, level)(event, **fields)
        except Exception as exc:
            self._failed(exc)

    def _failed(self, exc: Exception) -> None:
        self.failures += 1
        if self.failures > 1:
            return
        # (Lost in turn where warnings are errors, or there is no stderr to show it on.)
        with contextlib.suppress(Exception):
            warnings.warn(
                f"cachebroker: its logger ({type(self._log).__name__}) raised {exc!r}; "
                "the broker goes on and drops the events it cannot log",
                RuntimeWarning,
                stacklevel=2,
            )

    def __repr__(self) -> str:
        return f"<Guarded {self._log!r}>"


def debug_check(log: Any) -> Callable[[int], bool]:
    """How the broker asks ``log`` whether debug events are wanted: call it with ``DEBUG``.

    The hit path does not ask on every hit: the broker keeps the answer and
    asks again at every other step (``Runner.__init__`` says when), so a
    hit whose event would be dropped builds nothing. A logger that cannot
    tell (no ``is_enabled_for`` nor ``isEnabledFor``) gets every event.
    """
    check = getattr(log, "is_enabled_for", None)  # structlog's loggers, StdlibEvents
    if check is None:
        check = getattr(log, "isEnabledFor", None)
    if check is None:
        return _always
    try:
        check(logging.DEBUG)
    except Exception:  # a custom logger with another signature: keep every event
        return _always
    return check  # type: ignore[no-any-return]


def _always(level: int) -> bool:
    return True
