"""The offline optimum of a trace: the least total reload time any policy could pay.

The interval formulation. Between two consecutive requests of a key lies a
*gap*; a 0/1 variable says whether the key stays resident through it. Not
keeping it costs a reload at the gap's end (that request's
``load_seconds``); the first request of each key always loads. At each
request, in each space it uses, the requested value plus the values kept
through gaps spanning that request must fit the budget. (Rows at the
requests of other spaces are implied by these, and repeated identical rows
are dropped.)

This is the classic offline caching problem with sizes and costs: loads take
no time, leases end at once and requests are served in arrival order. It
ignores ``hold_seconds`` and idle TTLs, which only constrain a policy
further. In the timed replay a policy can still come in under it when
requests wait for space: a waiting request occupies no memory, lets later
hits go first and gathers later requests for its key, which the model has
no room for. When no request waits it is a true lower bound, even where loads
overlap later requests (a loading key holds its memory, as if kept, and the
requests joining its load are hits either way), and the optimum itself when
solved as a MILP.

Traces up to ``exact_limit`` requests (100,000 by default) are solved as a
MILP (HiGHS, through scipy): 20,000 requests of the built-in catalogue take
about 5-10 s. If the solver stops at its time limit, the result is a
bracket: its proven lower bound and the best solution it found, which a
policy that knew the future could achieve. Longer traces, or a MILP that
proved nothing in time, get the LP relaxation: a valid lower bound, looser
(45% under the optimum there), bracketed from above by a greedy feasible
schedule (``greedy_schedule``, after PFOO-U). ``Bound.method`` says which
one was computed.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

import attrs

from ._request import Request, check_fits

__all__ = ["Bound", "offline_bound"]

Method = Literal["exact", "milp-bound", "lp"]


@attrs.frozen(kw_only=True)
class Bound:
    """The least total reload time of a trace at one budget.

    Attributes:
        reload_seconds: The optimum (``method == "exact"``) or a lower bound on it.
        method: ``"exact"`` (the MILP solved to optimality), ``"milp-bound"``
            (the MILP stopped at its time limit: its proven bound) or ``"lp"``
            (the LP relaxation).
        solve_seconds: Wall-clock time spent building and solving.
        variables: Gaps between consecutive requests of a key (one variable each).
        rows: Capacity rows after dropping repeats.
        upper_seconds: The reload time of the best schedule found: the optimum
            itself when exact; otherwise the top of the bracket
            ``[reload_seconds, upper_seconds]`` the optimum lies in, from the
            solver's best solution or, failing one, a greedy feasible
            schedule (``None`` only when the trace is too long and has too
            many keys even for that).
    """

    reload_seconds: float
    method: Method
    solve_seconds: float
    variables: int
    rows: int
    upper_seconds: float | None = None

    @property
    def gap(self) -> float | None:
        """How wide the bracket is, relative to its top (0.0 when exact; ``None`` without one)."""
        if self.upper_seconds is None:
            return None
        if self.upper_seconds <= 0:
            return 0.0
        return max(0.0, self.upper_seconds - self.reload_seconds) / self.upper_seconds


@attrs.define
class _Model:
    """The MILP in sparse row form: maximise ``sum(gain * x)`` s.t. ``A x <= limit``."""

    base: float = 0.0  # loads no policy avoids: each key's first request
    gain: list[float] = attrs.Factory(list)  # per gap: the reload avoided by keeping it
    starts: list[int] = attrs.Factory(lambda: [0])
    columns: list[int] = attrs.Factory(list)
    values: list[float] = attrs.Factory(list)
    limits: list[float] = attrs.Factory(list)


def build_model(requests: Sequence[Request], budget: Mapping[str, int]) -> _Model:
    """The interval formulation of ``requests`` (see the module docstring)."""
    model = _Model()
    keys = [(request.cache, request.key) for request in requests]
    following: list[int | None] = [None] * len(requests)
    last: dict[tuple[str, str], int] = {}
    for index in range(len(requests) - 1, -1, -1):
        following[index] = last.get(keys[index])
        last[keys[index]] = index
    sizes: dict[tuple[str, str], Mapping[str, int]] = {}
    open_gaps: dict[tuple[str, str], tuple[int, Mapping[str, int]]] = {}
    previous_row: dict[str, tuple[Any, ...]] = {}
    for index, request in enumerate(requests):
        key = keys[index]
        size = sizes.setdefault(key, request.size)
        closing = open_gaps.pop(key, None)
        if closing is None:
            model.base += request.load_seconds
        for space, amount in size.items():
            if amount <= 0:
                continue
            span = [(gap, held[space]) for gap, held in open_gaps.values() if held.get(space)]
            signature = (amount, *span)
            if not span or previous_row.get(space) == signature:
                continue
            previous_row[space] = signature
            for gap, held_bytes in span:
                model.columns.append(gap)
                model.values.append(float(held_bytes))
            model.starts.append(len(model.columns))
            model.limits.append(float(budget[space] - amount))
        after = following[index]
        if after is not None:  # the gap to this key's next request
            open_gaps[key] = (len(model.gain), size)
            model.gain.append(requests[after].load_seconds)
    return model


def offline_bound(
    requests: Sequence[Request],
    budget: Mapping[str, int],
    *,
    exact_limit: int = 100_000,
    time_limit: float = 30.0,
) -> Bound:
    """Compute the offline optimum of ``requests`` at ``budget``, or a lower bound.

    Args:
        requests: The trace, in time order.
        budget: Bytes per space.
        exact_limit: Solve traces up to this many requests as a MILP; longer
            ones as the LP relaxation.
        time_limit: Seconds the MILP may take before the bracket of its best
            proven bound and best solution found is reported instead.

    Raises:
        ImportError: scipy is not installed (the ``sim`` extra).
        InvalidArgument: a request does not fit its space's whole budget.
    """
    try:
        import numpy as np
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import csr_array
    except ImportError as exc:  # pragma: no cover - exercised without the extra
        raise ImportError(
            "the offline optimum needs scipy: pip install scipy (cachebroker's 'sim' extra)"
        ) from exc
    check_fits(requests, budget)
    started = time.perf_counter()
    model = build_model(requests, budget)
    total_gain = math.fsum(model.gain)
    n = len(model.gain)
    rows = len(model.limits)

    def bound(kept: float, method: Method, best: float | None = None) -> Bound:
        """The Bound of ``kept`` seconds of reloads avoided (``best``: by the best solution)."""
        lower = max(0.0, model.base + total_gain - kept)
        upper = None if best is None else max(lower, model.base + total_gain - best)
        return Bound(
            reload_seconds=lower,
            method=method,
            solve_seconds=time.perf_counter() - started,
            variables=n,
            rows=rows,
            upper_seconds=upper,
        )

    if n == 0:
        return bound(0.0, "exact", 0.0)
    constraints = []
    if rows:
        matrix = csr_array(
            (np.asarray(model.values), np.asarray(model.columns), np.asarray(model.starts)),
            shape=(rows, n),
        )
        constraints.append(LinearConstraint(matrix, -np.inf, np.asarray(model.limits)))
    integral = len(requests) <= exact_limit
    with _quiet_stdout():
        result = milp(
            -np.asarray(model.gain),
            integrality=np.ones(n) if integral else np.zeros(n),
            bounds=Bounds(0, 1),
            constraints=constraints,
            options={"time_limit": time_limit},
        )
    if result.status == 0:
        if integral:
            return bound(-result.fun, "exact", -result.fun)
        return bound(-result.fun, "lp", greedy_schedule(requests, budget, result.x))
    dual = getattr(result, "mip_dual_bound", None)
    if integral and dual is not None and math.isfinite(dual):
        best = -result.fun if result.x is not None and math.isfinite(result.fun) else None
        if best is None:  # no solution found in time: a greedy one tops the bracket
            best = greedy_schedule(requests, budget)
        return bound(-dual, "milp-bound", best)
    # The MILP gave no proven bound in time: fall back to the LP relaxation,
    # with a feasible schedule above it.
    with _quiet_stdout():
        relaxed = milp(-np.asarray(model.gain), bounds=Bounds(0, 1), constraints=constraints)
    if relaxed.status != 0:  # pragma: no cover - an LP with x = 0 feasible always solves
        raise RuntimeError(f"the LP relaxation failed: {relaxed.message}")
    return bound(-relaxed.fun, "lp", greedy_schedule(requests, budget, relaxed.x))


def greedy_schedule(
    requests: Sequence[Request], budget: Mapping[str, int], guide: Sequence[float] | None = None
) -> float | None:
    """Reload seconds kept off by a feasible schedule: gaps kept greedily.

    Like PFOO-U (Berger, Beckmann and Harchol-Balter, "Practical Bounds on
    Optimal Caching with Variable Object Sizes", SIGMETRICS 2018), the gaps
    between a key's consecutive requests are taken in order and each is kept
    if it fits beside what is already kept at every request it spans. The
    order is the LP relaxation's solution when given (``guide``: its value
    per gap, in the order the model numbers them; the LP keeps whole most
    gaps the optimum keeps), then reload seconds saved per byte-request the
    gap would occupy (its bytes, each as a share of its space's budget,
    times the requests it spans). What is kept fits, so ``base + all gains -
    kept`` is the reload time of a real schedule: an upper bound of the
    optimum.

    Returns the reload seconds saved, or ``None`` when checking the gaps
    would take too long (more than ~10^9 request-spans in all: many keys
    over a long trace).
    """
    import numpy as np

    keys = [(request.cache, request.key) for request in requests]
    sizes: dict[tuple[str, str], Mapping[str, int]] = {}
    for key, request in zip(keys, requests, strict=True):
        sizes.setdefault(key, request.size)
    spaces = sorted({space for size in sizes.values() for space in size if size[space] > 0})
    slack = {space: np.full(len(requests), float(budget[space])) for space in spaces}
    for index, key in enumerate(keys):
        for space, amount in sizes[key].items():
            if amount > 0:
                slack[space][index] -= amount
    # Gaps in the model's numbering: by the request that opens them.
    following: dict[tuple[str, str], int] = {}
    gaps: list[tuple[float, float, int, int, tuple[str, str], float]] = []
    span_total = 0
    for index in range(len(requests) - 1, -1, -1):
        key = keys[index]
        after = following.get(key)
        following[key] = index
        if after is None:
            continue
        seconds = requests[after].load_seconds
        spanned = after - index - 1
        weight = sum(amount / budget[space] for space, amount in sizes[key].items() if amount > 0)
        density = math.inf if spanned == 0 or weight == 0 else seconds / (weight * spanned)
        gaps.append((0.0, density, index, after, key, seconds))
        span_total += spanned
    if span_total > 10**9:
        return None
    gaps.reverse()
    if guide is not None and len(guide) == len(gaps):
        gaps = [(float(x), *gap[1:]) for x, gap in zip(guide, gaps, strict=True)]
    gaps.sort(key=lambda gap: (-gap[0], -gap[1]))
    saved = 0.0
    for _, _, before, after, key, seconds in gaps:
        held = [(slack[space], amount) for space, amount in sizes[key].items() if amount > 0]
        if after - before > 1 and any(
            float(room[before + 1 : after].min()) < amount for room, amount in held
        ):
            continue
        for room, amount in held:
            room[before + 1 : after] -= amount
        saved += seconds
    return saved


@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    """Silence what the solver's C++ code prints to file descriptor 1 (not ``sys.stdout``).

    HiGHS writes some diagnostics straight to the process's standard output,
    which would corrupt ``--json`` output. Not thread-safe: the descriptor is
    the process's.
    """
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # pragma: no cover - no descriptor 1 to protect
        yield
        return
    try:
        with open(os.devnull, "wb") as devnull:
            os.dup2(devnull.fileno(), 1)
            try:
                yield
            finally:
                os.dup2(saved, 1)
    finally:
        os.close(saved)
