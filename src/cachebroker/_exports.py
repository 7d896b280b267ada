"""Public names report the public module they are imported from, not the private one defining them.

Tracebacks, ``repr`` and pickles then say ``cachebroker.RequestTooLarge``,
where users import it from and where pickle finds it again, instead of
``cachebroker._errors.RequestTooLarge`` (trio fixes up its names the same way).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping


def claim(module: str, namespace: Mapping[str, object], names: Iterable[str]) -> None:
    """Set ``__module__`` to ``module`` on the classes and functions ``names`` of ``namespace``.

    Only those defined in a private module (``cachebroker._x``) are changed.
    """
    for name in names:
        obj = namespace[name]
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        if obj.__module__.startswith("cachebroker._"):
            obj.__module__ = module
