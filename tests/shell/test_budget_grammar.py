"""One grammar for budgets and byte quantities, whichever door they come in by.

``Broker(budget=...)``, ``CACHEBROKER_BUDGET`` and ``cachebroker serve --budget``
read a budget with one function; every byte quantity a user writes (a budget,
``size=``, what ``measure`` returns, ``Broker(sizes=...)``, the simulator's
budgets and traces) goes through ``parse_bytes``, which refuses a fractional
number of bytes instead of rounding it (``"0.5B"`` as 0 would turn retention off).
"""

from __future__ import annotations

import re
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cachebroker import Broker, InvalidArgument, parse_bytes
from cachebroker.__main__ import main
from cachebroker._remote import _serve
from cachebroker._remote._daemon import Daemon
from cachebroker._units import UNITS
from cachebroker.probes import Probe, SystemMemory
from tests.brokers import open_broker
from tests.helpers import Recorder, loader

pytestmark = pytest.mark.anyio

FRACTIONS = ["0.5B", "1.3B", "1.0000001KiB", "0.1GiB", ".5"]


def served_budget(monkeypatch: pytest.MonkeyPatch, budget: str) -> dict[str, int]:
    """The budget ``cachebroker serve --budget BUDGET`` starts its daemon with."""
    seen: dict[str, int] = {}

    async def serve(daemon: Daemon) -> None:
        seen.update({name: space.budget for name, space in daemon.runner.core.spaces.items()})

    monkeypatch.setattr(_serve, "_serve", serve)
    assert main(["serve", "--budget", budget, "--socket", "/nonexistent/cb.sock"]) == 0
    return seen


def broker_budget(budget: Any) -> dict[str, int]:
    return dict(Broker(budget=budget)._runner.budget)


def env_budget(text: str) -> dict[str, int]:
    return dict(Broker.from_env({"CACHEBROKER_BUDGET": text})._runner.budget)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("24GiB", {"default": 24 << 30}),
        ("ram=32MiB,cuda:0=1GiB", {"ram": 32 << 20, "cuda:0": 1 << 30}),
        (" m = 1GiB , n=2KiB ", {"m": 1 << 30, "n": 2048}),
        ("1.5KiB", {"default": 1536}),
    ],
)
def test_every_door_reads_a_budget_the_same(
    text: str, expected: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert broker_budget(text) == expected
    assert env_budget(text) == expected
    assert served_budget(monkeypatch, text) == expected


def test_a_probed_space_is_read_the_same_at_every_door(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ram=system-4GiB`` follows the machine's memory in Broker(budget=) as in serve."""
    pytest.importorskip("psutil")
    for budget in ("ram=system-4GiB,x=1KiB", {"ram": "system-4GiB", "x": "1KiB"}):
        broker = Broker(budget=budget)
        (probe,) = broker._runner.probes.probes.values()
        assert isinstance(probe, SystemMemory) and probe.headroom == 4 << 30
        assert list(broker._runner.probes.probes) == ["ram"]
    from_env = Broker.from_env({"CACHEBROKER_BUDGET": "ram=system-4GiB,x=1KiB"})
    assert list(from_env._runner.probes.probes) == ["ram"]
    served = served_budget(monkeypatch, "ram=system-4GiB,x=1KiB")
    assert served["x"] == 1024 and served["ram"] > 0  # the probe's first reading


def test_probes_and_callables_in_a_mapping_stay_probes() -> None:
    from cachebroker._shell._config import budget_value

    def read() -> tuple[int, int]:
        return 100, 50

    probe = Probe(read, name="mine")
    value = budget_value({"a": probe, "b": read, "c": 7})
    assert isinstance(value, dict)
    assert value["a"] is probe and value["c"] == 7
    b = value["b"]
    assert isinstance(b, Probe) and b.name == "b" and b.read() == (100, 50)
    assert budget_value(value) == value  # what from_env passes on is read again unchanged


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("ram", "'ram' is not a byte quantity"),
        ("m=", "expected SPACE=AMOUNT pairs"),
        ("m=1GiB,", "expected SPACE=AMOUNT pairs"),
        ("m=1GiB,m=2GiB", "space 'm' is given twice"),
        ("m=nvidia:x", "expected nvidia:INDEX"),
        ("m=lots", "space 'm' 'lots' is not a byte quantity"),
        ("m=system-lots", "the headroom 'lots' is not a byte quantity"),
        ("m=0.5B", "not a whole number of bytes"),
        ("m=-5GiB", "space 'm' must not be negative, got '-5GiB'"),
    ],
)
def test_every_door_names_itself_and_what_is_wrong(
    text: str, match: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(InvalidArgument, match=match):
        Broker(budget=text)
    with pytest.raises(InvalidArgument, match=f"CACHEBROKER_BUDGET={text!r} is invalid: .*{match}"):
        Broker.from_env({"CACHEBROKER_BUDGET": text})
    with pytest.raises(SystemExit) as exit:
        main(["serve", "--budget", text, "--socket", "/nonexistent/cb.sock"])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert "error: --budget" in err
    assert re.search(match, err), err


@pytest.mark.parametrize("text", FRACTIONS)
def test_a_fractional_number_of_bytes_is_an_error(text: str) -> None:
    with pytest.raises(InvalidArgument, match=rf"size {text!r} is not a whole number of bytes"):
        parse_bytes(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1.5KiB", 1536), ("0.5KiB", 512), ("2.25MiB", 9 << 18), ("1.5GB", 15 * 10**8)],
)
def test_a_fraction_of_a_unit_that_is_whole_bytes_is_exact(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


def test_a_fractional_budget_is_refused_not_read_as_zero() -> None:
    """Rounded down, ``"0.5B"`` was a budget of 0: retention off, without a word."""
    with pytest.raises(InvalidArgument, match=r"budget '0.5B' is not a whole number of bytes"):
        Broker(budget="0.5B")
    with pytest.raises(InvalidArgument, match=r"between 0 and 1"):
        Broker(budget={"ram": "0.5B"})


async def test_a_fractional_size_or_measure_is_refused(kind: str) -> None:
    async with open_broker(kind, budget="1KiB") as broker, broker.cache("c", Recorder()) as cache:
        with pytest.raises(InvalidArgument, match=r"c:'a'.*'1.3B' is not a whole number"):
            await cache.acquire("a", load=loader(1), size="1.3B")
        with pytest.raises(InvalidArgument, match=r"not a whole number of bytes"):
            await cache.prefetch("a", load=loader(1), size={"default": "0.5B"})
        with pytest.raises(InvalidArgument, match=r"'0.5B' is not a whole number of bytes"):
            await cache.acquire("b", load=loader(2), measure=lambda value: "0.5B")
        assert (await broker.stats()).used == {"default": 0}


def test_fractional_remembered_sizes_are_refused() -> None:
    with pytest.raises(InvalidArgument, match=r"sizes\['c'\]\['k'\]: .*not a whole number"):
        Broker(budget="1KiB", sizes={"c": {"k": "0.5B"}})


def test_the_simulators_budgets_and_traces_refuse_fractional_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for budget in ("0.5B", "ram=1.3B,gpu=1KiB"):
        with pytest.raises(SystemExit):
            main(["simulate", "--budget", budget, "--no-bound", "--no-online"])
        assert "not a whole number of bytes" in capsys.readouterr().err
    trace = tmp_path / "trace.csv"
    trace.write_text("time,key,size,load_seconds\n0,a,1.5B,1\n")
    with pytest.raises(SystemExit):
        main(["simulate", "--trace", str(trace), "--budget", "10", "--no-bound", "--no-online"])
    assert "not a whole number of bytes" in capsys.readouterr().err


def test_the_simulator_reads_a_budget_of_several_spaces_as_the_broker_does() -> None:
    from cachebroker.simulator import Request, resolve_budgets

    requests = [
        Request(time=0.0, key="a", size={"ram": 1}, load_seconds=1.0),
        Request(time=1.0, key="b", size={"gpu": 1}, load_seconds=1.0),
    ]
    expected = [{"ram": 1024, "gpu": 2048}]
    assert resolve_budgets(["ram=1KiB,gpu=2KiB"], requests) == expected
    assert resolve_budgets([{"ram": "1KiB", "gpu": "2KiB"}], requests) == expected


SPACE_NAMES = st.from_regex(r"[a-z][a-z0-9:_.]{0,8}", fullmatch=True)


@given(st.dictionaries(SPACE_NAMES, st.integers(0, 2**50), min_size=1, max_size=4))
def test_a_budget_written_as_text_is_its_mapping_at_every_door(spaces: dict[str, int]) -> None:
    """Property: ``"a=N,b=M"`` is the budget ``{"a": N, "b": M}``, by Broker and from_env alike."""
    text = ", ".join(f"{name}={amount}" for name, amount in spaces.items())
    assert broker_budget(text) == spaces == env_budget(text) == broker_budget(spaces)


@given(
    st.integers(0, 10**9),
    st.from_regex(r"[0-9]{1,7}", fullmatch=True),
    st.sampled_from(["", "B", "KiB", "MiB", "GiB", "KB", "MB", "GB"]),
)
def test_a_quantity_is_its_exact_bytes_or_refused(whole: int, digits: str, unit: str) -> None:
    """Property: a quantity is read exactly; one that is not whole bytes is an error."""
    text = f"{whole}.{digits}{unit}"
    exact = Fraction(f"{whole}.{digits}") * UNITS[unit.lower()]
    if exact.denominator == 1:
        assert parse_bytes(text) == exact
    else:
        with pytest.raises(InvalidArgument, match="is not a whole number of bytes"):
            parse_bytes(text)
