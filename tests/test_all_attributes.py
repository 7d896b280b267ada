"""Keep ``cachebroker.__all__`` honest: every name exists and is documented."""

from __future__ import annotations

import cachebroker


def test_all_names_exist_and_have_docstrings() -> None:
    for name in cachebroker.__all__:
        obj = getattr(cachebroker, name)
        assert obj.__doc__, f"{name} has no docstring"


def test_public_objects_claim_the_public_module() -> None:
    exported = {name for name in dir(cachebroker) if not name.startswith("_")}
    assert set(cachebroker.__all__) <= exported
    # Nothing public leaks in besides the exported names and submodules.
    modules = {name for name in exported if type(getattr(cachebroker, name)).__name__ == "module"}
    assert exported - modules == set(cachebroker.__all__)


PUBLIC_MODULES = [
    "cachebroker",
    "cachebroker.simulator",
    "cachebroker.metrics",
    "cachebroker.probes",
]


def _public_callables() -> list[tuple[str, object]]:
    import importlib
    import inspect

    found: list[tuple[str, object]] = []
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isclass(obj):
                found.append((f"{module_name}.{name}", obj))
                for attr, member in vars(obj).items():
                    if attr.startswith("_") and attr not in ("__aenter__", "__aexit__"):
                        continue
                    target = member.fget if isinstance(member, property) else member
                    if isinstance(target, staticmethod | classmethod):
                        target = target.__func__
                    if callable(target):
                        found.append((f"{module_name}.{name}.{attr}", target))
            elif callable(obj):
                found.append((f"{module_name}.{name}", obj))
    return found


def test_public_classes_and_functions_report_their_public_module() -> None:
    """``__module__`` is where users import them from: reprs, tracebacks and pickles say so."""
    import importlib
    import inspect
    import typing

    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isclass(obj) or inspect.isfunction(obj):
                assert obj.__module__ == module_name, f"{module_name}.{name}: {obj.__module__}"
                assert getattr(importlib.import_module(obj.__module__), obj.__qualname__) is obj
                if inspect.isclass(obj):  # moved classes' annotations still resolve
                    typing.get_type_hints(obj)


def test_every_public_name_has_a_docstring_and_async_ones_say_what_cancellation_does() -> None:
    import inspect

    for where, obj in _public_callables():
        doc = inspect.getdoc(obj)
        assert doc, f"{where} has no docstring"
        if inspect.iscoroutinefunction(obj):
            assert "ancel" in doc, f"{where} does not say what cancellation does"
