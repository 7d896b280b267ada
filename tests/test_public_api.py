"""The public surface, walked module by module: what ``__all__`` promises holds.

For each public module (``cachebroker`` and its public submodules):

* every name in ``__all__`` exists, once, and is documented (docs/api.md or
  docs/reference.md);
* every exported class and function reports the public module as its
  ``__module__`` (tracebacks, reprs and pickles name ``cachebroker.X``, never
  ``cachebroker._errors.X``), has a docstring, and pickles by that path;
* instances of the exported data classes pickle without naming a private module;
* nothing else looks public. The rule: a name without a leading underscore
  that is not in ``__all__`` is fine if it is a module, or imported (PEP 8 and
  mypy's ``no_implicit_reexport`` make imports implementation details) from
  outside cachebroker or as a name some public module exports. A name the
  module defines itself, or imports from a private module of cachebroker
  without it being public anywhere, must be in ``__all__`` or start with an
  underscore. ``TypeVar``s are exempt.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import pickle
import pickletools
import pkgutil
import re
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import cachebroker

PUBLIC_MODULES = (
    "cachebroker",
    "cachebroker.simulator",
    "cachebroker.metrics",
    "cachebroker.probes",
    "cachebroker.sizes",
    "cachebroker.ray",
)
DOCS = Path(__file__).resolve().parent.parent / "docs"


def module(name: str) -> types.ModuleType:
    return importlib.import_module(name)


def exports() -> Iterator[tuple[str, str]]:
    for module_name in PUBLIC_MODULES:
        for name in module(module_name).__all__:
            yield module_name, name


def params(pairs: Iterator[tuple[str, str]]) -> list[Any]:
    """One pytest param per ``(module, name)``, named ``module.name``."""
    return [pytest.param(m, n, id=f"{m}.{n}") for m, n in pairs]


def is_class_or_function(obj: object) -> bool:
    return inspect.isclass(obj) or inspect.isfunction(obj)


# ------------------------------------------------------------------ __all__


def test_the_public_modules_are_all_walked() -> None:
    """Every module without an underscore in its path is walked here (a new one is added)."""
    found = {"cachebroker"}
    for info in pkgutil.walk_packages(cachebroker.__path__, "cachebroker."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            found.add(info.name)
    assert found == set(PUBLIC_MODULES)


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_all_lists_existing_names_once(module_name: str) -> None:
    names = module(module_name).__all__
    assert isinstance(names, tuple | list)
    assert all(isinstance(name, str) for name in names)
    assert len(set(names)) == len(names), "a name is listed twice"
    missing = [name for name in names if not hasattr(module(module_name), name)]
    assert missing == []


# ------------------------------------------------------------- documented


def documented_names() -> set[str]:
    """Identifiers in docs/api.md's code spans and docs/reference.md's autodoc directives."""
    api = (DOCS / "api.md").read_text()
    text = " ".join(re.findall(r"`([^`]+)`", api))
    reference = (DOCS / "reference.md").read_text()
    text += " " + " ".join(
        line for line in reference.splitlines() if line.lstrip().startswith((".. ", ":members:"))
    )
    names = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text))
    # ``.. automodule:: M`` with a bare ``:members:`` documents all of M's __all__.
    for match in re.finditer(r"\.\. automodule:: (\S+)\n\s+:members:\s*\n", reference):
        names.update(module(match.group(1)).__all__)
    return names


@pytest.mark.parametrize(("module_name", "name"), params(exports()))
def test_every_exported_name_is_documented(module_name: str, name: str) -> None:
    assert name in documented_names(), f"{module_name}.{name} is in neither api.md nor reference.md"


# ---------------------------------------------- __module__, pickles, reprs


def classes_and_functions() -> Iterator[tuple[str, str]]:
    """The exports that name a module (constants do not)."""
    for module_name, name in exports():
        if is_class_or_function(getattr(module(module_name), name)):
            yield module_name, name


@pytest.mark.parametrize(("module_name", "name"), params(classes_and_functions()))
def test_exported_classes_and_functions_live_at_their_public_path(
    module_name: str, name: str
) -> None:
    obj = getattr(module(module_name), name)
    assert obj.__module__ == module_name
    assert getattr(module(obj.__module__), obj.__qualname__) is obj
    assert inspect.getdoc(obj), f"{module_name}.{name} has no docstring"
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        assert pickle.loads(pickle.dumps(obj, protocol)) is obj
    assert pickled_modules(obj) == {module_name}
    if inspect.isclass(obj):
        assert repr(obj) == f"<class '{module_name}.{obj.__qualname__}'>"
        typing.get_type_hints(obj)  # annotations still resolve from the public module


def pickled_modules(obj: object) -> set[str]:
    """The modules a protocol-2 pickle of ``obj`` imports from (its GLOBAL opcodes)."""
    found = set()
    for opcode, arg, _ in pickletools.genops(pickle.dumps(obj, protocol=2)):
        if opcode.name == "GLOBAL":
            found.add(str(arg).partition(" ")[0])
    return found


def is_private(module_name: str) -> bool:
    return any(part.startswith("_") for part in module_name.split("."))


def sample(kind: str) -> Any:
    """An instance of the exported data class or policy ``kind``."""
    from cachebroker.simulator import Request, replay, simulate

    requests = [
        Request(time=0.0, key="a", size={"default": 60}, load_seconds=1.0),
        Request(time=1.0, key="b", size={"default": 60}, load_seconds=2.0),
        Request(time=2.0, key="a", size={"default": 60}, load_seconds=1.0),
    ]
    if kind == "Request":
        return requests[0]
    if kind == "ReplayResult":
        return replay(requests, {"default": 100}, "lru")
    if kind == "Comparison":
        (comparison,) = simulate(
            requests, budgets=[{"default": 100}], policies=["lru"], bound=False
        )
        return comparison
    if kind == "Stats":
        return cachebroker.Broker(budget=100).stats_nowait()
    if kind == "EvictionReport":
        return cachebroker.EvictionReport(entries=1, bytes=60, failed=0)
    if kind == "EntryInfo":
        return cachebroker.EntryInfo(
            cache="p",
            key=("model", 7),
            state="ready",
            charge={"default": 60},
            leases=0,
            waiting=0,
            pinned=False,
            priority=0,
            idle_seconds=1.5,
            loads=2,
            load_seconds=0.25,
        )
    return getattr(cachebroker, kind)()


SAMPLES = ["Request", "ReplayResult", "Comparison", "Stats", "EvictionReport", "EntryInfo"]
POLICIES = ["LRU", "FIFO", "GDSF", "CostAware"]


@pytest.mark.parametrize("kind", SAMPLES + POLICIES)
def test_instances_pickle_without_naming_a_private_module(kind: str) -> None:
    instance = sample(kind)
    private = {name for name in pickled_modules(instance) if is_private(name)}
    assert private == set()
    again = pickle.loads(pickle.dumps(instance))
    assert type(again) is type(instance)
    if kind not in POLICIES:  # policies compare by identity
        assert again == instance


def test_generic_aliases_name_the_public_module() -> None:
    assert repr(cachebroker.Lease[int]) == "cachebroker.Lease[int]"


def test_public_methods_have_docstrings_and_async_ones_say_what_cancellation_does() -> None:
    for module_name, name in exports():
        obj = getattr(module(module_name), name)
        if not inspect.isclass(obj):
            continue
        for attr, member in vars(obj).items():
            if attr.startswith("_") and attr not in ("__aenter__", "__aexit__"):
                continue
            target = member.fget if isinstance(member, property) else member
            if isinstance(target, staticmethod | classmethod):
                target = target.__func__
            if not callable(target):
                continue
            where = f"{module_name}.{name}.{attr}"
            doc = inspect.getdoc(target)
            assert doc, f"{where} has no docstring"
            if inspect.iscoroutinefunction(target):
                assert "ancel" in doc, f"{where} does not say what cancellation does"


# ------------------------------------------------------- nothing else public


def public_objects() -> set[int]:
    return {id(getattr(module(m), n)) for m, n in exports()}


def top_level_bindings(module_name: str) -> Iterator[tuple[str, str | None]]:
    """``(name, source)`` for each top-level binding: ``source`` is the absolute
    module a ``from ... import`` took it from, ``""`` for ``import x``, ``None``
    for a definition. ``if TYPE_CHECKING:`` blocks bind nothing at run time."""
    mod = module(module_name)
    tree = ast.parse(inspect.getsource(mod))
    package = mod.__name__ if hasattr(mod, "__path__") else mod.__name__.rpartition(".")[0]

    def walk(body: list[ast.stmt]) -> Iterator[tuple[str, str | None]]:
        for node in body:
            if isinstance(node, ast.If):
                if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                    yield from walk(node.body)
                yield from walk(node.orelse)
            elif isinstance(node, ast.Try):
                for block in (node.body, *(h.body for h in node.handlers), node.orelse):
                    yield from walk(block)
            elif isinstance(node, ast.ImportFrom):
                source = importlib.util.resolve_name(
                    "." * node.level + (node.module or ""), package
                )
                for alias in node.names:
                    yield alias.asname or alias.name, source
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    yield alias.asname or alias.name.partition(".")[0], ""
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                yield node.name, None
            elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    for leaf in ast.walk(target):
                        if isinstance(leaf, ast.Name):
                            yield leaf.id, None

    yield from walk(tree.body)


def unlisted(module_name: str) -> set[str]:
    """The names of ``module_name`` that look public but are not in ``__all__``."""
    mod = module(module_name)
    exported = set(mod.__all__)
    public = public_objects()
    sources = dict(top_level_bindings(module_name))
    found = set()
    for name in dir(mod):
        if name.startswith("_") or name in exported:
            continue
        obj = getattr(mod, name)
        if isinstance(obj, types.ModuleType | typing.TypeVar) or name == "annotations":
            continue  # submodules and imported modules; TypeVars; the __future__ import
        source = sources.get(name)
        if source is not None and (
            not (source == "cachebroker" or source.startswith("cachebroker.")) or id(obj) in public
        ):
            continue  # imported from elsewhere, or a public object under a second name
        found.add(name)
    return found


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_nothing_else_looks_public(module_name: str) -> None:
    assert unlisted(module_name) == set(), "underscore them or add them to __all__"
