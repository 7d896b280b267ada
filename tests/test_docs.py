"""Every ```python block in the README and docs/ runs as written and passes ``mypy --strict``.

A ```python block is a complete program. A fragment (an ``await`` at top level,
a name defined elsewhere, ``...`` for a body) is fenced as ```py instead, and
is neither run nor type-checked.
"""

from __future__ import annotations

import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

import cachebroker

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
# mypy checks the package this process imports, wherever that is.
SOURCE = Path(cachebroker.__file__).resolve().parent.parent


def _blocks() -> list[tuple[str, int, str]]:
    """(page, line of the block's first line of code, code) for every ```python block."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in BLOCK.finditer(text):
            line = text.count("\n", 0, match.start(1)) + 1
            found.append((str(page.relative_to(ROOT)), line, match.group(1)))
    return found


def _examples() -> list[tuple[str, str]]:
    counts: dict[str, int] = {}
    found = []
    for page, _, code in _blocks():
        counts[page] = counts.get(page, 0) + 1
        found.append((f"{page}#{counts[page]}", code))
    return found


@pytest.mark.parametrize(("where", "code"), _examples(), ids=[w for w, _ in _examples()])
def test_documented_example_runs(where: str, code: str, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(code)
    runpy.run_path(str(script), run_name="__main__")


def test_documented_examples_pass_mypy_strict(tmp_path: Path) -> None:
    # One mypy run over all of them, with the project's configuration: a cold
    # run costs seconds, one per example would cost minutes.
    files: dict[str, tuple[str, int]] = {}
    for index, (page, line, code) in enumerate(_blocks()):
        name = f"example_{index}.py"
        (tmp_path / name).write_text(code)
        files[name] = (page, line)
    command = [
        sys.executable,
        "-m",
        "mypy",
        "--strict",
        "--config-file",
        str(ROOT / "pyproject.toml"),
    ]
    command += ["--cache-dir", str(tmp_path / ".mypy_cache"), *files]
    env = {**os.environ, "MYPYPATH": str(SOURCE)}
    result = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, check=False
    )

    def where(match: re.Match[str]) -> str:  # example_3.py:8 -> docs/policies.md:95
        page, line = files[match[1]]
        return f"{page}:{line + int(match[2]) - 1}"

    report = re.sub(r"(example_\d+\.py):(\d+)", where, result.stdout + result.stderr)
    assert result.returncode == 0, report


def test_docs_link_to_existing_pages() -> None:
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#]+\.md)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"


def test_every_release_reason_is_listed_with_what_triggers_it() -> None:
    """docs/events.md has one row per ``Reason``, each saying what triggers it."""
    from cachebroker._core import Reason

    text = (ROOT / "docs" / "events.md").read_text()
    section = text.split("## Release reasons", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `([a-z_]+)` \| (.+) \|$", section, re.M))
    assert sorted(rows) == sorted(reason.value for reason in Reason)
    assert all(len(trigger) > 20 for trigger in rows.values()), rows
