"""docs/examples/ray_deployment.py runs as the docs show it (a local Ray cluster of its own)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")

pytestmark = [
    pytest.mark.ray,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
]

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "ray_deployment.py"


def test_the_ray_recipe_serves_every_model_it_is_asked_for() -> None:
    spec = importlib.util.spec_from_file_location("ray_deployment", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    ray.cloudpickle.register_pickle_by_value(module)
    try:
        spec.loader.exec_module(module)
        answers = module.main()
    finally:
        ray.cloudpickle.unregister_pickle_by_value(module)
        del sys.modules[spec.name]
    assert answers == [f"{m}: hi" for m in ["small", "large", "small", "medium", "large"]]
