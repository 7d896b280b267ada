"""The built-in demo runs, really evicts, and never holds more than its budget."""

from __future__ import annotations

import io

import pytest

from cachebroker.__main__ import main
from cachebroker._demo import run_demo


@pytest.mark.anyio
async def test_demo_evicts_and_stays_within_budget() -> None:
    out = io.StringIO()
    peak = await run_demo(budget="96MiB", sessions=16, seed=3, out=out)
    text = out.getvalue()
    assert peak <= 96 * 2**20
    assert "release.requested" in text
    assert "freed" in text
    assert "final stats:" in text


def test_cli_rejects_bad_budget(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--budget", "much"])
    assert exit_info.value.code == 2
    assert "--budget 'much' is not a byte quantity" in capsys.readouterr().err
