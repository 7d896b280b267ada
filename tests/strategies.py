"""Hypothesis strategies shared by the property-based tests."""

from __future__ import annotations

from hypothesis import strategies as st

SPACES = {"ram": 100, "gpu": 60}
KEYS = st.sampled_from(["a", "b", "c", "d", "e", "f", "g"])
TASKS = st.sampled_from([1, 2, 3])


@st.composite
def charges(draw: st.DrawFn) -> dict[str, int]:
    """An entry's size: in one space or both, sometimes zero, at most a space's budget."""
    spaces = draw(st.sampled_from([("ram",), ("gpu",), ("ram", "gpu")]))
    return {space: draw(st.integers(0, SPACES[space])) for space in spaces}
