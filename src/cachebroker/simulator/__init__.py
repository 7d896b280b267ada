"""Trace-driven capacity planning: replay a workload under each policy and budget.

``simulate`` replays a trace through the broker's own core and policies on a
virtual clock (no sleeping, no second implementation of eviction) and sets
each budget's results beside the offline optimum. The command line
``cachebroker simulate`` is built on it; see docs/simulator.md.

    from cachebroker.simulator import builtin_workload, simulate

    for comparison in simulate(builtin_workload(), budgets=["48GiB", "64GiB"]):
        for result in comparison.results:
            print(comparison.label, result.policy, result.reload_seconds)

The optimum, ``figure`` and ``plot`` need the ``sim`` extra (scipy,
matplotlib): ``pip install -e '.[sim]'`` in a checkout of cachebroker.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from .. import _exports
from .._errors import InvalidArgument
from .._policies import make_policy as _make_policy
from .._sizes import parse_budget as _parse_budget
from .._units import DEFAULT_SPACE as _DEFAULT_SPACE
from .._units import format_bytes
from ._csv import COLUMNS, TraceError, parse_trace, read_trace
from ._online import OnlineOptimum, online_optimum
from ._online import check_max_keys as _check_max_keys
from ._optimum import Bound, offline_bound
from ._replay import TIMINGS, ReplayResult, replay
from ._replay import Timing as _Timing
from ._request import PROMOTE_FRACTION, Request
from ._request import check_tiers as _check_tiers
from ._workload import BUDGETS, CATALOGUE, builtin_workload

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = (
    "BUDGETS",
    "CATALOGUE",
    "COLUMNS",
    "POLICIES",
    "TIMINGS",
    "Bound",
    "Comparison",
    "OnlineOptimum",
    "PROMOTE_FRACTION",
    "ReplayResult",
    "Request",
    "TraceError",
    "builtin_workload",
    "figure",
    "offline_bound",
    "online_optimum",
    "parse_trace",
    "plot",
    "read_trace",
    "replay",
    "resolve_budgets",
    "simulate",
)

#: The policies compared when none are named.
POLICIES: tuple[str, ...] = ("lru", "fifo", "gdsf", "cost")


@attrs.frozen(kw_only=True)
class Comparison:
    """Every policy's result at one budget, and the offline optimum there.

    Attributes:
        budget: Bytes per space.
        results: One ``ReplayResult`` per policy, in the order asked for.
        bound: The offline optimum or a lower bound on it (``None`` if not computed).
        timing: How the policies were replayed: ``"sequential"`` (the
            optimum's model) or ``"replay"`` (the virtual clock).
        online: The optimal online policy for the trace's observed popularity
            (``None`` if not computed; ``online_note`` then says why when it
            was asked for).
        online_note: Why the online optimum was skipped (tiers), or how it
            was approximated (more keys share spaces than ``max_keys``), or
            ``None``.
        tiers: The lower tier of each tiered space (empty without tiers);
            ``budget`` has the lower tiers' bytes too.
    """

    budget: Mapping[str, int]
    results: tuple[ReplayResult, ...]
    bound: Bound | None = None
    timing: _Timing = "sequential"
    online: OnlineOptimum | None = None
    online_note: str | None = None
    tiers: Mapping[str, str] = attrs.field(factory=dict)

    @property
    def label(self) -> str:
        """The budget for people: ``"48.0 GiB"``, ``"ram=16.0 GiB,cuda:0=24.0 GiB"``, or
        with a lower tier ``"48.0 GiB + ram 64.0 GiB"``."""
        return _budget_label(self.budget, self.tiers)

    @property
    def top_budget(self) -> dict[str, int]:
        """``budget`` without the lower tiers: the spaces the trace's requests use."""
        lower = set(self.tiers.values())
        return {space: amount for space, amount in self.budget.items() if space not in lower}

    @property
    def tier_budget(self) -> dict[str, int]:
        """The lower tiers' bytes (empty without tiers)."""
        lower = set(self.tiers.values())
        return {space: amount for space, amount in self.budget.items() if space in lower}


def _budget_label(budget: Mapping[str, int], tiers: Mapping[str, str] | None = None) -> str:
    """``"48.0 GiB"`` for a budget of one space, ``"ram=16.0 GiB,cuda:0=24.0 GiB"`` for
    several; lower tiers follow as ``" + ram 64.0 GiB"``."""
    lower = set((tiers or {}).values())
    top = {space: amount for space, amount in budget.items() if space not in lower}
    if len(top) == 1:
        label = format_bytes(next(iter(top.values())))
    else:
        label = ",".join(f"{space}={format_bytes(amount)}" for space, amount in top.items())
    for space, amount in budget.items():
        if space in lower:
            label += f" + {space} {format_bytes(amount)}"
    return label


def resolve_budgets(
    budgets: Iterable[int | str | Mapping[str, int | str]], requests: Sequence[Request]
) -> list[dict[str, int]]:
    """Turn each budget into bytes per space of the trace.

    A single quantity (``"48GiB"``, ``51539607552``) is the budget of the one
    space the trace uses; a trace using several spaces needs a mapping (or
    its text, ``"ram=16GiB,cuda:0=24GiB"``, as for ``Broker(budget=...)``).

    Raises:
        InvalidArgument: a budget is malformed, or does not name every space the trace uses.
    """
    spaces = sorted({space for request in requests for space in request.size}) or [_DEFAULT_SPACE]
    resolved: list[dict[str, int]] = []
    for budget in budgets:
        parsed = _parse_budget(budget)
        named = isinstance(budget, Mapping) or (isinstance(budget, str) and "=" in budget)
        if not named:
            # One quantity: the budget of the one space that the trace uses.
            if len(spaces) > 1:
                raise InvalidArgument(
                    f"the trace uses the spaces {', '.join(spaces)}: give each a budget, "
                    f"e.g. {','.join(f'{space}=24GiB' for space in spaces)}"
                )
            parsed = {spaces[0]: parsed[_DEFAULT_SPACE]}
        missing = [space for space in spaces if space not in parsed]
        if missing:
            given = ",".join(f"{space}={format_bytes(amount)}" for space, amount in parsed.items())
            raise InvalidArgument(
                f"budget {given} has no amount for the space(s) "
                f"{', '.join(missing)} that the trace uses"
                + (
                    " (its sizes name no space: give one amount, such as 8GiB)"
                    if spaces == [_DEFAULT_SPACE] and len(parsed) == 1
                    else ""
                )
            )
        resolved.append(parsed)
    if not resolved:
        raise InvalidArgument("give at least one budget")
    return resolved


def simulate(
    requests: Sequence[Request],
    budgets: Iterable[int | str | Mapping[str, int | str]],
    policies: Sequence[str] = POLICIES,
    *,
    idle_ttl: float | None = None,
    timing: _Timing = "sequential",
    bound: bool = True,
    bound_time_limit: float = 30.0,
    online: bool = True,
    max_keys: int = 14,
    progress: Callable[[str], None] | None = None,
    tiers: Mapping[str, str] | None = None,
) -> list[Comparison]:
    """Replay ``requests`` under every policy at every budget.

    Args:
        requests: The trace, in time order (``read_trace``, ``builtin_workload``).
        budgets: Bytes or ``"48GiB"`` for a trace of one space; mappings of
            space to either for several.
        policies: Names of built-in policies.
        idle_ttl: Release entries idle this many seconds (virtual time).
        timing: ``"sequential"`` (loads take no time and leases end at once:
            the offline optimum's model, so it is a lower bound of every
            policy) or ``"replay"`` (the virtual clock with load times and
            holds, where requests may wait for space).
        bound: Compute the offline optimum at each budget (needs scipy).
        bound_time_limit: Seconds the MILP may take per budget before its best
            proven bound is reported instead.
        online: Compute the online optimum at each budget (needs numpy, in
            the ``sim`` extra): the optimal policy for the trace's observed
            popularity, run on the trace.
        max_keys: The most keys sharing spaces the online optimum is solved
            over exactly (``2 ** max_keys`` states). A larger group gets its
            approximation: the best such policy that keeps only the
            ``max_keys`` keys of the greatest share x load seconds, loading
            the others for their requests only; ``online.exact`` is then false,
            ``online.slack_seconds`` bounds how far its expectation lies above
            the online optimum's, and ``online_note`` says so.
        progress: Called with a short description as each step starts.
        tiers: Each tiered space's lower tier, ``{"default": "ram"}``: an idle
            value may be moved down instead of dropped, and promoted back for
            its next request at its ``promote_seconds`` (see ``replay``).
            Every budget must then give the lower tiers' bytes too (``{"default":
            "48GiB", "ram": "64GiB"}``). The offline optimum covers the tiers;
            the online optimum does not, and is skipped with a note.

    Raises:
        InvalidArgument: a budget, policy or request is unusable (a request
            larger than its space's budget, for one); ``tiers`` names a space
            a budget lacks, or a request has a negative ``promote_seconds``.
        ImportError: ``bound`` is true and scipy is not installed, or
            ``online`` is true and numpy is not.
    """
    resolved = resolve_budgets(budgets, requests)
    names = [_policy_name(policy) for policy in policies]
    if not names:
        raise InvalidArgument("give at least one policy")
    if idle_ttl is not None and not idle_ttl > 0:
        raise InvalidArgument(f"idle_ttl must be a positive number of seconds, got {idle_ttl!r}")
    _check_max_keys(max_keys)
    lower = [_check_tiers(tiers, budget, requests) for budget in resolved]
    comparisons = []
    for budget, tiered in zip(resolved, lower, strict=True):
        label = _budget_label(budget, tiered)
        results = []
        for name in names:
            if progress is not None:
                progress(f"{name} at {label}")
            results.append(
                replay(requests, budget, name, idle_ttl=idle_ttl, timing=timing, tiers=tiered)
            )
        optimum = None
        if bound:
            if progress is not None:
                progress(f"optimum at {label}")
            optimum = offline_bound(requests, budget, time_limit=bound_time_limit, tiers=tiered)
        reference = note = None
        if online and tiered:
            note = "it does not model tiers"
        elif online:
            if progress is not None:
                progress(f"online optimum at {label}")
            reference = online_optimum(requests, budget, max_keys=max_keys, approximate=True)
            if not reference.exact:
                note = _approximation_note(reference, max_keys)
        comparisons.append(
            Comparison(
                budget=budget,
                results=tuple(results),
                bound=optimum,
                timing=timing,
                online=reference,
                online_note=note,
                tiers=tiered,
            )
        )
    return comparisons


def _approximation_note(online: OnlineOptimum, max_keys: int) -> str:
    return (
        f"{online.largest_group} keys share spaces, more than the {max_keys} solved "
        f"exactly (max_keys): the {online.passed_keys} of the least share x load seconds "
        f"are loaded for their requests and dropped once served; the expected reload "
        f"seconds are at most {online.slack_seconds:,.0f} s above the online optimum's"
    )


def _policy_name(policy: str) -> str:
    if not isinstance(policy, str):
        raise TypeError(f"policies are named by strings such as 'lru', got {policy!r}")
    name = policy.strip().lower()
    _make_policy(name)  # raises for an unknown name, listing the built-in ones
    return name


# long: one figure, its three panels drawn in order.
def figure(comparisons: Sequence[Comparison], *, title: str | None = None) -> Figure:
    """Draw the comparisons against budget: reload seconds, hit ratio and waits for space.

    One line per policy in each panel: total reload seconds (with the offline
    optimum, or its bound, dashed in black, and the online optimum dotted),
    hit ratio, and, for comparisons replayed with ``timing="replay"``, the
    mean (solid) and 99th-percentile (dashed) wait for space (in the
    sequential model no request waits, so that panel is left out). ``title``
    names the workload; without it the figure is titled by the number of
    requests. Budgets must be of a single space (the x axis is bytes), not
    counting lower tiers: comparisons with a tier are drawn as lines of their
    own, the policy's colour with a marker per tier (labelled ``"lru + ram
    64.0 GiB"``; their optimum in black with the same marker). Needs
    matplotlib; the figure is not registered with ``pyplot``, so nothing
    needs closing.

    Raises:
        InvalidArgument: no comparison, or budgets of several spaces.
        ImportError: matplotlib is not installed.
    """
    if not comparisons:
        raise InvalidArgument("nothing to plot: no comparison")
    if any(len(comparison.top_budget) != 1 for comparison in comparisons):
        raise InvalidArgument("plots need budgets of a single space (the x axis is bytes)")
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:  # pragma: no cover - exercised without the extra
        raise ImportError(
            "plots need matplotlib: pip install matplotlib (cachebroker's 'sim' extra)"
        ) from exc
    timed = any(comparison.timing == "replay" for comparison in comparisons)
    drawn = Figure(figsize=(15 if timed else 10, 4.4), layout="constrained")
    panels = list(drawn.subplots(1, 3 if timed else 2))
    reloads, ratios = panels[:2]
    # One set of lines per tier (the comparisons without one first).
    variants: dict[str, list[Comparison]] = {}
    for comparison in comparisons:
        suffix = _budget_label(comparison.tier_budget, comparison.tiers) if comparison.tiers else ""
        variants.setdefault(suffix.removeprefix(" "), []).append(comparison)
    colors: dict[str, str] = {}
    for number, (suffix, group) in enumerate(sorted(variants.items(), key=lambda v: bool(v[0]))):
        ordered = sorted(group, key=lambda c: next(iter(c.top_budget.values())))
        gib = [next(iter(c.top_budget.values())) / 2**30 for c in ordered]
        marker = "o" if not suffix else "sD^vP*X"[(number - 1) % 7]
        named = f" {suffix}" if suffix else ""
        for index, result in enumerate(ordered[0].results):
            series = [c.results[index] for c in ordered]
            style: dict[str, Any] = {"marker": marker, "label": result.policy + named}
            if result.policy in colors:
                style["color"] = colors[result.policy]
            (line,) = reloads.plot(gib, [r.reload_seconds for r in series], **style)
            color = colors.setdefault(result.policy, line.get_color())
            style["color"] = color
            ratios.plot(gib, [r.hit_ratio for r in series], **style)
            if timed:
                waits = panels[2]
                waits.plot(gib, [r.mean_wait for r in series], **style)
                waits.plot(
                    gib, [r.p99_wait for r in series], marker="x", linestyle="--", color=color
                )
        bounds = [c.bound for c in ordered]
        if all(b is not None for b in bounds):
            exact = all(b is not None and b.method == "exact" for b in bounds)
            reloads.plot(
                gib,
                [b.reload_seconds for b in bounds if b is not None],
                linestyle="--",
                color="black",
                label=("optimum" if exact else "optimum (lower bound)") + named,
                **({"marker": marker} if suffix else {}),
            )
        online = [c.online for c in ordered]
        if all(o is not None for o in online):
            reloads.plot(
                gib,
                [o.reload_seconds for o in online if o is not None],
                linestyle=":",
                color="black",
                label=(
                    "online optimum" if all(o.exact for o in online if o) else "online (approx.)"
                )
                + named,
            )
    reloads.set(xlabel="budget (GiB)", ylabel="total reload seconds", title="Reload time")
    ratios.set(xlabel="budget (GiB)", ylabel="hit ratio", title="Hit ratio")
    if timed:
        panels[2].set(
            xlabel="budget (GiB)",
            ylabel="seconds waited for space",
            title="Wait for space: mean (solid), p99 (dashed)",
        )
        panels[2].set_ylim(bottom=0)
    for axes in panels:
        axes.grid(alpha=0.3)
        axes.legend()
    reloads.set_ylim(bottom=0)
    if title is None:
        title = f"{comparisons[0].results[0].requests:,} requests"
    drawn.suptitle(title)
    return drawn


def plot(
    comparisons: Sequence[Comparison], path: str | os.PathLike[str], *, title: str | None = None
) -> None:
    """Save ``figure(comparisons, title=title)`` to ``path`` (PNG, SVG or PDF, by the suffix).

    Raises:
        InvalidArgument: no comparison, or budgets of several spaces.
        ImportError: matplotlib is not installed.
    """
    figure(comparisons, title=title).savefig(os.fspath(path), dpi=110)


# Public names claim this module (tracebacks, reprs and pickles name
# ``cachebroker.simulator.X``), whichever private module defines them.
_exports.claim(__name__, globals(), __all__)
