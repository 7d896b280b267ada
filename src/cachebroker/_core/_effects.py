"""The work a step of the books leaves for the shell: one frozen class per kind.

A step appends effects to ``Core.effects`` in the order the work must be
done; an interpreter (the shell's ``Runner.apply``, the simulator's replay,
the tests' harness) takes the list and performs each effect with::

    match effect:
        case StartLoad(entry): ...
        ...
        case _:
            assert_never(effect)

so that mypy rejects an interpreter that does not handle every kind of
``Effect``.

Effects are made on every miss, release and settle, so they are plain
slotted classes whose ``__init__`` sets the slots through their descriptors:
about 140 ns for one field and 185 for two, where ``attrs.frozen(slots=True)``
(which sets them through ``object.__setattr__``) takes about 205 and 265
(timeit, CPython 3.11; an ``(enum, subject)`` tuple took about 30).
They are frozen all the same: ``__setattr__`` and ``__delattr__`` refuse at
run time, and ``dataclass_transform(frozen_default=True)`` tells type
checkers that the fields are read-only. Equality, hashing and ``repr`` go by
the fields named in ``__match_args__``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, TypeAlias, dataclass_transform

if TYPE_CHECKING:
    from ._model import Entry, Owner, Reason

__all__ = [
    "CancelLoad",
    "Effect",
    "OwnerEmpty",
    "Quarantined",
    "Settled",
    "StartLoad",
    "StartMove",
    "StartRelease",
]


@dataclass_transform(frozen_default=True)
class _Effect:
    """Frozen; compared, hashed and shown by the fields named in ``__match_args__``."""

    __slots__ = ()
    __match_args__: ClassVar[tuple[str, ...]] = ()

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen: cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen: cannot delete {name!r}")

    def _fields(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self.__match_args__)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Effect) or type(other) is not type(self):
            return NotImplemented
        return self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash((type(self), *self._fields()))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(map(repr, self._fields()))})"

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), self._fields()


class _OfEntry(_Effect):
    """An effect about one entry."""

    __slots__ = ("entry",)
    entry: Entry

    def __init__(self, entry: Entry) -> None:
        _set_entry(self, entry)


_set_entry: Callable[[_OfEntry, Entry], None] = _OfEntry.__dict__["entry"].__set__


class StartLoad(_OfEntry):
    """Run ``entry``'s load: its bytes are reserved and it is ``loading``.

    Report the outcome with ``load_done``, ``load_failed`` or (its cache
    closing, the load not stoppable) ``load_abandoned``.
    """

    __slots__ = ()
    __match_args__ = ("entry",)


class CancelLoad(_OfEntry):
    """Cancel ``entry``'s load: its last requester left, or its cache is closing.

    The load still reports how it ended: ``load_failed(..., cancelled=True)``,
    or, for one that cannot be stopped (a worker thread), ``load_done`` or
    ``load_abandoned``.
    """

    __slots__ = ()
    __match_args__ = ("entry",)


class StartRelease(_OfEntry):
    """Ask ``entry``'s owner to release its value, for ``reason``; it is ``releasing``.

    Report the outcome with ``release_done`` or ``release_failed``.
    """

    __slots__ = ("reason",)
    __match_args__ = ("entry", "reason")
    reason: Reason

    def __init__(self, entry: Entry, reason: Reason) -> None:
        _set_entry(self, entry)
        _set_reason(self, reason)


_set_reason: Callable[[StartRelease, Reason], None] = StartRelease.__dict__["reason"].__set__


class StartMove(_OfEntry):
    """Ask ``entry``'s owner to move its value to space ``to`` (``Core.tiers``), by the
    name the owner knows it by (``_tiers.owner_space``: merged spaces keep one name
    in the books, but each owner is told its own).

    A demotion (down a tier) or a promotion (back up); both its charge and
    ``entry.target`` are on the books until it ends. Report the outcome with
    ``move_done`` or ``move_failed``.
    """

    __slots__ = ("to",)
    __match_args__ = ("entry", "to")
    to: str

    def __init__(self, entry: Entry, to: str) -> None:
        _set_entry(self, entry)
        _set_to(self, to)


_set_to: Callable[[StartMove, str], None] = StartMove.__dict__["to"].__set__


class Settled(_OfEntry):
    """Wake the requesters of ``entry`` whose tickets now have an outcome.

    Usually all of them (the load ended, or the entry was refused or dropped);
    when ``entry.joiners`` is not empty, only some were refused and the rest
    wait on.
    """

    __slots__ = ()
    __match_args__ = ("entry",)


class Quarantined(_OfEntry):
    """``entry``'s release failed (or nobody is left to release it): its bytes stay
    charged until ``forget``; ``entry.error`` says why."""

    __slots__ = ()
    __match_args__ = ("entry",)


class OwnerEmpty(_Effect):
    """Nothing of the closing ``owner`` is left on the books: its close may end."""

    __slots__ = ("owner",)
    __match_args__ = ("owner",)
    owner: Owner

    def __init__(self, owner: Owner) -> None:
        _set_owner(self, owner)


_set_owner: Callable[[OwnerEmpty, Owner], None] = OwnerEmpty.__dict__["owner"].__set__


#: Every kind of work a step may leave for the shell.
Effect: TypeAlias = (
    StartLoad | CancelLoad | StartRelease | StartMove | Settled | Quarantined | OwnerEmpty
)
