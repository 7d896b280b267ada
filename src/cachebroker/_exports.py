"""Public names report the public module they are imported from, not the private one defining them.

Tracebacks, ``repr`` and pickles then say ``cachebroker.RequestTooLarge``,
where users import it from and where pickle finds it again, instead of
``cachebroker._errors.RequestTooLarge`` (trio fixes up its names the same way).
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Iterable, Mapping


def claim(module: str, namespace: Mapping[str, object], names: Iterable[str]) -> None:
    """Set ``__module__`` to ``module`` on the classes and functions ``names`` of ``namespace``.

    Only those defined in a private module (``cachebroker._x``,
    ``cachebroker.simulator._y``) are changed.
    """
    for name in names:
        obj = namespace[name]
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        if any(part.startswith("_") for part in obj.__module__.split(".")):
            if inspect.isclass(obj):
                _resolve_annotations(obj)
            obj.__module__ = module


def _resolve_annotations(cls: type) -> None:
    """Evaluate ``cls``'s own string annotations in the module that wrote them.

    ``typing.get_type_hints`` (and attrs' ``resolve_types``, cattrs, ...)
    looks their names up in ``sys.modules[cls.__module__]``, which is about
    to be the public module, where ``Mapping`` or ``Callable`` are unknown.
    """
    own = inspect.get_annotations(cls)
    if not own:
        return
    hints = typing.get_type_hints(cls, include_extras=True)
    cls.__annotations__ = {name: hints[name] for name in own}
