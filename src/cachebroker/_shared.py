"""Objects shared process-wide by key, while something holds them: ``shared(key, make)``.

``BrokerRouter``'s routers of one deployment share their books through it.
It lives outside ``cachebroker.ray`` because Ray Serve ships a custom
router by value: it has cloudpickle pickle the router class's module
(``cachebroker.ray``, where the class says it is from) and every module
below it by value, so each process that unpickles the router has copies of
their globals, not the module's. This module is pickled by name: one
registry per process, whichever copy asks.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable
from typing import TypeVar

__all__ = ["shared"]

T = TypeVar("T")

_objects: weakref.WeakValueDictionary[Hashable, object] = weakref.WeakValueDictionary()
_lock = threading.Lock()


def shared(key: Hashable, make: Callable[[], T]) -> T:
    """The object kept for ``key``, or ``make()``'s, kept for it while anything holds it.

    ``make()``'s result must support weak references (any plain class's
    instances do). Thread-safe: callers may run on different event loops.
    """
    with _lock:
        found = _objects.get(key)
        if found is None:
            found = make()
            _objects[key] = found
        return found  # type: ignore[return-value]  # (what make() made for this key)
