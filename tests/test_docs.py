"""Every ```python block in the README and docs/ runs as written."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _examples() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        for number, match in enumerate(BLOCK.finditer(page.read_text()), 1):
            found.append((f"{page.relative_to(ROOT)}#{number}", match.group(1)))
    return found


@pytest.mark.parametrize(("where", "code"), _examples(), ids=[w for w, _ in _examples()])
def test_documented_example_runs(where: str, code: str, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(code)
    runpy.run_path(str(script), run_name="__main__")


def test_docs_link_to_existing_pages() -> None:
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#]+\.md)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"
