"""Parsing budgets and sizes: every malformed value is a clear error."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cachebroker import InvalidArgument, format_bytes, parse_bytes
from cachebroker._sizes import parse_budget, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("1024", 1024),
        ("512MiB", 512 * 2**20),
        ("24GiB", 24 * 2**30),
        ("1.5GiB", 3 * 2**29),
        ("2 TiB", 2 * 2**40),
        ("16GB", 16 * 10**9),
        ("3kib", 3072),
        ("7B", 7),
        (" 8 MiB ", 8 * 2**20),
    ],
)
def test_quantities_parse_to_bytes(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ("", InvalidArgument, "not a byte quantity"),
        ("GiB", InvalidArgument, "not a byte quantity"),
        ("12 parsecs", InvalidArgument, "not a byte quantity"),
        ("-5MiB", InvalidArgument, "must not be negative"),
        (-1, InvalidArgument, "must not be negative"),
        (float("nan"), InvalidArgument, "whole, non-negative"),
        (2.5, InvalidArgument, "whole, non-negative"),
        (None, TypeError, "must be an int or a string"),
        ([1], TypeError, "must be an int or a string"),
        (False, TypeError, "number of bytes"),
    ],
)
def test_malformed_quantities_are_rejected(value: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        parse_bytes(value)


@given(st.integers(min_value=0, max_value=2**50))
def test_int_quantities_round_trip(amount: int) -> None:
    """Property: an int is its own byte count, and its string form parses back to it."""
    assert parse_bytes(amount) == amount
    assert parse_bytes(str(amount)) == amount


def test_budget_single_quantity_is_default_space() -> None:
    assert parse_budget("16GiB") == {"default": 16 * 2**30}


def test_budget_mapping_names_spaces() -> None:
    assert parse_budget({"ram": "1KiB", "cuda:0": 5}) == {"ram": 1024, "cuda:0": 5}


@pytest.mark.parametrize(
    ("budget", "error", "match"),
    [
        ({}, InvalidArgument, "at least one space"),
        ({"": 5}, TypeError, "non-empty strings"),
        ({1: 5}, TypeError, "non-empty strings"),
        ({"ram": "lots"}, InvalidArgument, "budget of space 'ram'"),
        ("12 apples", InvalidArgument, "budget '12 apples' is not a byte quantity"),
    ],
)
def test_malformed_budgets_are_rejected(budget: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        parse_budget(budget)


def test_plain_size_goes_to_default_or_only_space() -> None:
    assert parse_size(10, {"default": 100}) == {"default": 10}
    assert parse_size("1KiB", {"ram": 100}) == {"ram": 1024}
    assert parse_size(None, {"ram": 100}) == {}
    assert parse_size({"ram": 0}, {"ram": 100}) == {}


def test_plain_size_with_several_spaces_and_no_default_is_ambiguous() -> None:
    with pytest.raises(InvalidArgument, match="give the size as a mapping"):
        parse_size(10, {"ram": 100, "gpu": 100})


def test_size_in_unknown_space_names_known_spaces() -> None:
    with pytest.raises(InvalidArgument, match=r"unknown space 'gpu'.*\['ram'\]"):
        parse_size({"gpu": 1}, {"ram": 100})


def test_format_bytes_is_readable() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 2**30) == "3.0 GiB"
    assert format_bytes(5 * 2**40) == "5.0 TiB"
