"""The documentation site builds with Sphinx, warnings as errors (as ``nox -s docs``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_docs_site_builds_without_warnings(tmp_path: Path) -> None:
    flags = ["-W", "--keep-going", "-q", "-E", "-b", "html"]
    result = subprocess.run(
        [sys.executable, "-m", "sphinx", *flags, str(DOCS), str(tmp_path / "html")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    reference = (tmp_path / "html" / "reference.html").read_text()
    assert "add_listener" in reference and "offline_bound" in reference
    assert (tmp_path / "html" / "_images" / "simulator.png").exists()
