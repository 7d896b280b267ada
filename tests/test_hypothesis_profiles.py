"""The Hypothesis profiles of tests/conftest.py: CI is deterministic, nightly explores."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
from hypothesis import settings


def test_ci_profile_draws_the_same_examples_every_run_and_keeps_no_database() -> None:
    ci = settings.get_profile("ci")
    assert ci.derandomize
    assert ci.database is None


@pytest.mark.skipif(
    os.environ.get("HYPOTHESIS_PROFILE", "ci") != "ci", reason="another profile was chosen"
)
def test_ci_is_the_profile_loaded_by_default() -> None:
    loaded = settings()  # what a test's @settings(...) starts from
    assert loaded.derandomize
    assert loaded.database is None
    assert loaded.max_examples == settings.get_profile("ci").max_examples


def test_nightly_profile_is_random_and_larger() -> None:
    nightly, ci = settings.get_profile("nightly"), settings.get_profile("ci")
    assert not nightly.derandomize
    assert nightly.max_examples > ci.max_examples


def test_no_test_overrides_the_determinism_of_the_profile() -> None:
    """Per-test ``settings(...)`` inherit ``derandomize`` and ``database``; nothing seeds."""
    here = Path(__file__).parent
    overrides = []
    for path in sorted(here.rglob("*.py")):
        if path.name == "conftest.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            called = node.func.attr if isinstance(node.func, ast.Attribute) else None
            if isinstance(node.func, ast.Name):
                called = node.func.id
            keywords = {keyword.arg for keyword in node.keywords}
            if (called == "settings" and keywords & {"derandomize", "database"}) or (
                called == "seed"
            ):
                overrides.append(f"{path.relative_to(here)}:{node.lineno}")
    assert overrides == []
