"""What the docs show of ``cachebroker simulate`` is what it prints, and it shows its progress.

README.md and docs/simulator.md quote rows of the table for the built-in
workload. Each quoted row is checked against the rows the program computes
for the budgets and policies the excerpt shows, through the same code that
prints the table, so that an excerpt cannot drift from the program (a
policy's change once left an 80 GiB ``cost`` row behind). Regenerate an
excerpt with ``cachebroker simulate --budget 48GiB,64GiB``.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest

from cachebroker import parse_bytes
from cachebroker.__main__ import main
from cachebroker.simulator import POLICIES, builtin_workload, simulate
from cachebroker.simulator._cli import _print_table

pytest.importorskip("scipy")
pytest.importorskip("numpy")

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = ("README.md", "docs/simulator.md")
SOURCE = "built-in workload (seed 1)"


def excerpts(text: str) -> list[list[str]]:
    """The code blocks of ``text`` that quote the table (they have its header line)."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)
    return [block.splitlines() for block in blocks if re.search(r"^budget +policy ", block, re.M)]


def quoted() -> dict[str, list[list[str]]]:
    return {name: excerpts((ROOT / name).read_text()) for name in DOCUMENTS}


def normal(line: str) -> str:
    """A row with its cells' alignment dropped: the widths depend on the rows printed."""
    return " ".join(line.split())


def row_key(line: str) -> tuple[int, str]:
    """(budget, policy) of a table row: ``48.0 GiB  lru ...`` or ``... online optimum ...``."""
    number, unit, *rest = line.split()
    policy = " ".join(rest[:2]) if rest[:2] == ["online", "optimum"] else rest[0]
    return parse_bytes(f"{number}{unit}"), policy


@pytest.fixture(scope="module")
def printed() -> list[str]:
    """The table ``cachebroker simulate`` prints for the budgets and policies quoted."""
    rows = [
        line
        for blocks in quoted().values()
        for block in blocks
        for line in block
        if re.match(r"^\d", line)
    ]
    budgets = sorted({row_key(line)[0] for line in rows})
    policies = [name for name in POLICIES if any(row_key(line)[1] == name for line in rows)]
    requests = builtin_workload(1)
    # (No time limit that a slow machine could reach: the optimum must be exact.)
    comparisons = simulate(requests, budgets, policies, bound_time_limit=3600)
    out = io.StringIO()
    _print_table(comparisons, SOURCE, len(requests), out)
    return out.getvalue().splitlines()


def test_the_docs_quote_the_table() -> None:
    for name, blocks in quoted().items():
        assert blocks, f"{name} quotes no table of cachebroker simulate"


@pytest.mark.parametrize("name", DOCUMENTS)
def test_every_quoted_row_is_what_simulate_prints(name: str, printed: list[str]) -> None:
    program = {normal(line) for line in printed}
    by_key = {row_key(line): line for line in printed if re.match(r"^\d", line)}
    for block in quoted()[name]:
        for line in block:
            if line.startswith(SOURCE):
                assert line == printed[0], f"{name}: the title"
            elif normal(line) not in program:
                shown = by_key.get(row_key(line)) if re.match(r"^\d", line) else None
                pytest.fail(
                    f"{name} quotes a row that cachebroker simulate does not print:\n"
                    f"  quoted:  {line}\n  printed: {shown}",
                    pytrace=False,
                )


# ---------------------------------------------------------------- progress


@pytest.fixture
def trace(tmp_path: Path) -> str:
    path = tmp_path / "trace.csv"
    rows = [f"{i * 10},{key},10,2" for i, key in enumerate("ABCABDABCE")]
    path.write_text("time,key,size,load_seconds\n" + "\n".join(rows) + "\n")
    return str(path)


def test_a_run_whose_stderr_is_no_terminal_prints_a_line_per_step(
    trace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Piped or logged, a half-minute run is not silent: a line as each step starts."""
    assert main(["simulate", "--trace", trace, "--budget", "20,30", "--json"]) == 0
    captured = capsys.readouterr()
    assert len(json.loads(captured.out)) == 2 * len(POLICIES)  # standard output: the results alone
    steps = 2 * (len(POLICIES) + 2)  # per budget: each policy, the optimum, the online optimum
    expected = [
        f"{policy} at {budget} B"
        for budget in (20, 30)
        for policy in (*POLICIES, "optimum", "online optimum")
    ]
    assert captured.err.splitlines() == [
        f"simulate: step {number}/{steps}: {what}" for number, what in enumerate(expected, 1)
    ]


def test_quiet_prints_no_progress(trace: str, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["simulate", "--trace", trace, "--budget", "20", "--policy", "lru", "--no-bound"]
    assert main([*args, "--quiet"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert "lru" in captured.out
