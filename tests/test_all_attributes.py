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
