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

With memory tiers (``tiers={"gpu": "ram"}``) a key may also wait in the
lower tier through a gap, and then costs its ``promote_seconds`` instead of
its ``load_seconds`` at the gap's end. It may stay on top for the first part
of a gap and go down for the rest (when the top is needed and the lower tier
has room only then), so the model is indexed by time there: a variable per
request of its space that the gap spans says whether it is still on top,
and may only fall along the gap (``_build_tiered``). Its capacity rows are
written in shares of each space's budget. Demotions and promotions take no
time, as loads do, but a value promoted at a request holds its room below
during that request (no two values swap tiers at once, as in the core), so
with tiers too this is a lower bound of every policy replayed in sequential
timing. It has about ten times as many variables: the built-in workload's
2,000 requests take 1-15 s where the lower tier has room for what is
demoted; where it is short too, the solver may not close the gap in
minutes, and the bracket below is what comes back.

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
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal

import attrs

from ._request import Request, check_fits, check_tiers

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
        variables: Gaps between consecutive requests of a key (one variable
            each), and with tiers one more per request of its space that a
            gap of a demotable key spans.
        rows: Capacity rows after dropping repeats, and with tiers the rows
            that keep a value from climbing back up a tier inside a gap.
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
    gain: list[float] = attrs.Factory(list)  # per variable: the reload seconds it avoids
    starts: list[int] = attrs.Factory(lambda: [0])
    columns: list[int] = attrs.Factory(list)
    values: list[float] = attrs.Factory(list)
    limits: list[float] = attrs.Factory(list)
    # With tiers, per gap (numbered by the request that opens it): the
    # variable "kept somewhere through the gap" and the variable "still in its
    # top space at the gap's end" (the same one for a gap kept or dropped whole).
    kept: list[int] = attrs.Factory(list)
    top: list[int] = attrs.Factory(list)

    def row(self, entries: Iterable[tuple[int, float]], limit: float) -> None:
        for column, value in entries:
            self.columns.append(column)
            self.values.append(value)
        self.starts.append(len(self.columns))
        self.limits.append(limit)


def build_model(
    requests: Sequence[Request],
    budget: Mapping[str, int],
    tiers: Mapping[str, str] | None = None,
) -> _Model:
    """The interval formulation of ``requests`` (see the module docstring)."""
    if tiers:
        return _build_tiered(requests, budget, tiers)
    model = _Model()
    keys, following = _following(requests)
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


class _Gap:
    """A gap of a key that may wait in a lower tier, while the model is built."""

    __slots__ = (
        "current",
        "kept",
        "load",
        "lower",
        "number",
        "promote",
        "size",
        "source",
        "tops",
    )

    def __init__(
        self,
        number: int,
        kept: int,
        size: Mapping[str, int],
        source: str,
        lower: str,
        request: Request,
    ) -> None:
        self.number = number  # the gap's, in the order gaps open
        self.kept = kept  # the variable "kept somewhere through the gap"
        self.size = size
        self.source = source
        self.lower = lower
        self.load = request.load_seconds  # of the request that closes the gap
        self.promote = request.promote_seconds
        self.tops: list[int] = []  # "still in source" at each request of source it spans
        self.current = kept  # the variable in force: kept (on top), then the latest of tops

    def occupies(self, space: str) -> list[tuple[int, float]]:
        """Its bytes in ``space`` now, as (variable, coefficient) terms."""
        amount = float(self.size[self.source])
        if space == self.source:
            return [(self.current, amount)]
        own = float(self.size.get(space, 0))
        terms = [(self.kept, own)] if own else []
        if space == self.lower and self.current != self.kept:
            terms += [(self.kept, amount), (self.current, -amount)]  # in the lower tier
        return terms


def _following(requests: Sequence[Request]) -> tuple[list[tuple[str, str]], list[int | None]]:
    """Each request's (cache, key), and the index of the next request of the same key."""
    keys = [(request.cache, request.key) for request in requests]
    following: list[int | None] = [None] * len(requests)
    last: dict[tuple[str, str], int] = {}
    for index in range(len(requests) - 1, -1, -1):
        following[index] = last.get(keys[index])
        last[keys[index]] = index
    return keys, following


def _build_tiered(
    requests: Sequence[Request], budget: Mapping[str, int], tiers: Mapping[str, str]
) -> _Model:
    """The interval formulation with a lower tier (see the module docstring).

    A gap of a key charged in one tiered space (its *source*), whose
    promotion costs less than its load and that spans requests of that
    space, has a variable ``kept`` (1: the key stays cached through the gap,
    0: it is dropped and reloaded) and, at each request of the source it
    spans, a variable ``top`` (1: still in the source). ``top`` may only fall
    along the gap and never above ``kept``: the key is demoted at most once,
    at a request of its source (the only moments its room there counts), and
    stays in the lower tier until its next request promotes it. Kept and on
    top at the end, the gap costs nothing; kept below, its ``promote_seconds``;
    dropped, its ``load_seconds``. Every other gap has one variable, as
    without tiers. Capacity rows are written at each request for the spaces
    it uses, and for the lower tier of each of them (where values arrive when
    demoted). A value promoted at a request still counts below in that
    request's row: the core charges a move in both spaces until it ends, so
    two values never swap tiers at one request (each move would wait for the
    other's room).
    """
    model = _Model()
    keys, following = _following(requests)
    sizes: dict[tuple[str, str], Mapping[str, int]] = {}
    # Each key's gap in force: (the variable, its size) for a gap kept or
    # dropped whole, a _Gap for one that may be demoted.
    open_gaps: dict[tuple[str, str], tuple[int, Mapping[str, int]] | _Gap] = {}
    previous_row: dict[str, tuple[Any, ...]] = {}
    for index, request in enumerate(requests):
        key = keys[index]
        size = sizes.setdefault(key, request.size)
        closing = open_gaps.pop(key, None)
        if closing is None:
            model.base += request.load_seconds
        elif isinstance(closing, _Gap) and closing.tops:
            # Kept, it saves the load, less the promotion unless still on top.
            # (A gap that spans no request of its source stays on top and saves the load.)
            model.gain[closing.kept] = closing.load - closing.promote
            model.gain[closing.tops[-1]] = closing.promote
            model.top[closing.number] = closing.tops[-1]
        # Promoted here, the value still holds its room below while it moves
        # up: what goes down at this request cannot take that room.
        rising = closing if isinstance(closing, _Gap) and closing.tops else None
        used = [space for space, amount in size.items() if amount > 0]
        for space in used:  # a value demotable from here must leave at this request or not
            for gap in open_gaps.values():
                if isinstance(gap, _Gap) and gap.source == space:
                    column = len(model.gain)
                    model.gain.append(0.0)
                    model.row([(column, 1.0), (gap.current, -1.0)], 0.0)
                    gap.tops.append(column)
                    gap.current = column
        checked = list(used)
        checked += [tiers[space] for space in used if space in tiers and tiers[space] not in used]
        for space in dict.fromkeys(checked):
            terms: dict[int, float] = {}
            for gap in open_gaps.values():
                if isinstance(gap, _Gap):
                    for column, value in gap.occupies(space):
                        terms[column] = terms.get(column, 0.0) + value
                elif gap[1].get(space):
                    terms[gap[0]] = float(gap[1][space])
            if rising is not None and space == rising.lower:
                amount = float(rising.size[rising.source])
                terms[rising.kept] = terms.get(rising.kept, 0.0) + amount
                terms[rising.current] = terms.get(rising.current, 0.0) - amount
            # In shares of the budget: beside the ordering rows' coefficients of
            # 1, rows of bytes (up to 1e11) defeat the solver's absolute tolerances.
            scale = float(budget[space]) or 1.0
            entries = [(column, value / scale) for column, value in terms.items() if value]
            limit = (budget[space] - size.get(space, 0)) / scale
            signature = (limit, *entries)
            if not entries or previous_row.get(space) == signature:
                continue
            previous_row[space] = signature
            model.row(entries, limit)
        after = following[index]
        if after is None:
            continue
        column = len(model.gain)
        closer = requests[after]
        model.gain.append(closer.load_seconds)  # (a demotable gap's gains are set at its end)
        model.kept.append(column)
        model.top.append(column)
        source = _demotable(size, tiers)
        if source is not None and closer.promote_seconds < closer.load_seconds:
            gap = _Gap(len(model.top) - 1, column, size, source, tiers[source], closer)
            open_gaps[key] = gap
        else:
            open_gaps[key] = (column, size)
    return model


def _demotable(size: Mapping[str, int], tiers: Mapping[str, str]) -> str | None:
    """The one tiered space a key of ``size`` could be demoted from, or ``None``."""
    tiered = [space for space, amount in size.items() if amount > 0 and space in tiers]
    return tiered[0] if len(tiered) == 1 else None


# long: the public entry point's checks, the MILP or LP choice and the bracket
# it reports, in the order the docstring gives them; the model is built apart.
def offline_bound(
    requests: Sequence[Request],
    budget: Mapping[str, int],
    *,
    exact_limit: int = 100_000,
    time_limit: float = 30.0,
    tiers: Mapping[str, str] | None = None,
) -> Bound:
    """Compute the offline optimum of ``requests`` at ``budget``, or a lower bound.

    Args:
        requests: The trace, in time order.
        budget: Bytes per space.
        exact_limit: Solve traces up to this many requests as a MILP; longer
            ones as the LP relaxation.
        time_limit: Seconds the MILP may take before the bracket of its best
            proven bound and best solution found is reported instead.
        tiers: Each tiered space's lower tier, ``{"gpu": "ram"}`` (both in
            ``budget``): a value may wait there between its requests and
            cost its ``promote_seconds`` instead of its ``load_seconds``.

    Raises:
        ImportError: scipy is not installed (the ``sim`` extra).
        InvalidArgument: a request does not fit its space's whole budget;
            ``tiers`` names a space the budget does not have, or a request
            has a negative ``promote_seconds``.
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
    lower = check_tiers(tiers, budget, requests)
    started = time.perf_counter()
    model = build_model(requests, budget, lower)

    def schedule(solution: Sequence[float] | None = None) -> float | None:
        """Seconds saved by a feasible schedule (guided by a solution of the model)."""
        if lower:
            return _greedy_tiered(requests, budget, lower, model, solution)
        return greedy_schedule(requests, budget, solution)

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
        return bound(-result.fun, "lp", schedule(result.x))
    dual = getattr(result, "mip_dual_bound", None)
    if integral and dual is not None and math.isfinite(dual):
        best = -result.fun if result.x is not None and math.isfinite(result.fun) else None
        if best is None:  # no solution found in time: a greedy one tops the bracket
            best = schedule()
        elif lower:  # (with tiers, the solver's first solutions are often far worse)
            greedy = schedule()
            best = best if greedy is None else max(best, greedy)
        return bound(-dual, "milp-bound", best)
    # The MILP gave no proven bound in time: fall back to the LP relaxation,
    # with a feasible schedule above it.
    with _quiet_stdout():
        relaxed = milp(-np.asarray(model.gain), bounds=Bounds(0, 1), constraints=constraints)
    if relaxed.status != 0:  # pragma: no cover - an LP with x = 0 feasible always solves
        raise RuntimeError(f"the LP relaxation failed: {relaxed.message}")
    return bound(-relaxed.fun, "lp", schedule(relaxed.x))


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


# long: the two greedy stages (keep on top, then park below) share the room
# timelines they fill; apart, each would rebuild them.
def _greedy_tiered(
    requests: Sequence[Request],
    budget: Mapping[str, int],
    tiers: Mapping[str, str],
    model: _Model,
    solution: Sequence[float] | None,
) -> float | None:
    """``greedy_schedule`` with a lower tier: seconds saved by a feasible schedule.

    First the gaps are kept on top greedily, as without tiers; then each gap
    left over that may wait in the lower tier stays on top as long as there
    is room there and goes down for the rest of the gap, if there is room
    below. Orders: the solution's "on top at the end" (then "kept"), then
    seconds saved per byte-request.
    """
    import numpy as np

    keys = [(request.cache, request.key) for request in requests]
    sizes: dict[tuple[str, str], Mapping[str, int]] = {}
    for key, request in zip(keys, requests, strict=True):
        sizes.setdefault(key, request.size)
    spaces = sorted(
        {space for size in sizes.values() for space in size if size[space] > 0}
        | {tiers[space] for size in sizes.values() for space in size if space in tiers}
    )
    slack = {space: np.full(len(requests), float(budget[space])) for space in spaces}
    for index, key in enumerate(keys):
        for space, amount in sizes[key].items():
            if amount > 0:
                slack[space][index] -= amount
    following: dict[tuple[str, str], int] = {}
    opened: list[tuple[int, int, tuple[str, str]]] = []
    span_total = 0
    for index in range(len(requests) - 1, -1, -1):
        key = keys[index]
        after = following.get(key)
        following[key] = index
        if after is not None:
            opened.append((index, after, key))
            span_total += after - index - 1
    if span_total > 10**9:
        return None
    opened.reverse()  # the model's numbering: by the request that opens them
    guided = solution is not None and len(model.top) == len(opened)

    def density(seconds: float, before: int, after: int, key: tuple[str, str]) -> float:
        size = sizes[key]
        weight = sum(amount / budget[space] for space, amount in size.items() if amount > 0)
        spanned = after - before - 1
        return math.inf if spanned == 0 or weight == 0 else seconds / (weight * spanned)

    def fits(room: Any, before: int, after: int, amount: float) -> bool:
        return after - before <= 1 or float(room[before + 1 : after].min()) >= amount

    saved = 0.0
    first = []
    for number, (before, after, key) in enumerate(opened):
        seconds = requests[after].load_seconds
        score = float(solution[model.top[number]]) if guided and solution is not None else 0.0
        first.append((-score, -density(seconds, before, after, key), number))
    kept = set()
    for _, _, number in sorted(first):
        before, after, key = opened[number]
        held = [(slack[space], amount) for space, amount in sizes[key].items() if amount > 0]
        if all(fits(room, before, after, amount) for room, amount in held):
            for room, amount in held:
                room[before + 1 : after] -= amount
            saved += requests[after].load_seconds
            kept.add(number)
    second = []
    for number, (before, after, key) in enumerate(opened):
        closer = requests[after]
        if number in kept or after - before <= 1 or closer.promote_seconds >= closer.load_seconds:
            continue
        if _demotable(sizes[key], tiers) is None:
            continue
        seconds = closer.load_seconds - closer.promote_seconds
        score = float(solution[model.kept[number]]) if guided and solution is not None else 0.0
        second.append((-score, -density(seconds, before, after, key), number))
    for _, _, number in sorted(second):
        before, after, key = opened[number]
        size = sizes[key]
        source = _demotable(size, tiers)
        assert source is not None
        lower, amount = tiers[source], size[source]
        top = slack[source][before + 1 : after]
        short = np.flatnonzero(top < amount)
        split = before + 1 + (int(short[0]) if len(short) else after - before - 1)
        others = [
            (slack[space], float(n)) for space, n in size.items() if n > 0 and space != source
        ]
        if not all(fits(room, before, after, n) for room, n in others):
            continue
        # Below from the split on, and at its request too (its promotion holds
        # its room below until it ends).
        below = slack[lower][split : after + 1]
        if float(below.min()) < amount + size.get(lower, 0):
            continue
        for room, n in others:
            room[before + 1 : after] -= n
        slack[source][before + 1 : split] -= amount
        slack[lower][split : after + 1] -= amount
        saved += requests[after].load_seconds - requests[after].promote_seconds
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
