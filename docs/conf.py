"""Sphinx configuration: the Markdown pages under docs/ (MyST), the API from docstrings."""

from __future__ import annotations

import importlib.metadata

project = "cachebroker"
author = "The cachebroker developers"
copyright = "the cachebroker developers"
release = importlib.metadata.version("cachebroker")
version = ".".join(release.split(".")[:2])

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "examples/README.md"]

myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = "cachebroker"
