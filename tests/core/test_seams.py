"""The books and the runner are extended through their seams, never by subclassing them.

Books shared with another process plug into ``Core`` through ``Seam``
(``_core/_seam.py``), and the runner's other side through ``Remote``
(``_shell/_seam.py``); a subclass outside their package that overrides a
step would make every ``self._x()`` there ambiguous again.
"""

from __future__ import annotations

import ast
from pathlib import Path

import cachebroker

SOURCE = Path(cachebroker.__file__).resolve().parent

#: Each class a package keeps to itself, and the package that may subclass it.
SEALED = {"Core": "_core", "Books": "_core", "Runner": "_shell"}


def subclasses_outside(sealed: dict[str, str]) -> list[str]:
    found = []
    for path in sorted(SOURCE.rglob("*.py")):
        package = path.relative_to(SOURCE).parts[0]
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            for base in node.bases:
                name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", None)
                if name in sealed and package != sealed[name]:
                    found.append(f"{path.relative_to(SOURCE)}: {node.name}({name})")
    return found


def test_no_class_outside_its_package_subclasses_the_books_or_the_runner() -> None:
    assert subclasses_outside(SEALED) == []


def test_the_check_finds_a_subclass() -> None:
    """The walk sees a subclass where there is one (it would pass vacuously otherwise)."""
    found = subclasses_outside({"Broker": "_shell"})
    assert "_remote/_daemon_books.py: DaemonBroker(Broker)" in found
