"""The online optimum: the best any policy could do knowing each key's popularity, not the order.

The offline optimum knows the future order of requests; no policy can. The
online optimum is the reference a policy *could* reach: the optimal policy
for requests drawn independently from the trace's observed popularity (each
key's share of the requests), run on the trace itself. It is a Markov
decision process over cache contents: the state is the set of resident keys;
a request for a resident key costs nothing, one for a missing key costs its
load seconds and the policy chooses which residents to keep (any subset that
fits beside the requested key). Solved by backward induction over the
trace's length (finite-horizon value iteration, from the empty cache), the
policy minimises the *expected* total reload time of a trace of that length
and popularity among all online policies, whatever they remember.

Keys are grouped by the spaces they share: keys of disjoint spaces never
compete, so each group is its own process (requests for the others leave it
unchanged). A group is solved over every subset of its keys, 2^n states, so
it is done up to ``max_keys`` keys a group (14 by default: 16,384 states);
beyond, ``online_optimum`` raises ``InvalidArgument`` unless asked to
approximate (as ``simulate`` does).

The approximation keeps the ``max_keys`` keys of the greatest share x load
seconds as the process's keys and lets the others *pass through*: each of
their requests loads the key (keeping the best subset of the contents it
fits beside) and drops it once served. That is a restriction of the online
policies, so its expectation is never below the online optimum's; and it is
at most ``slack_seconds`` above it, the expected load seconds of the passing
keys' requests: a passing policy can follow the optimal one's choices over
the kept keys (a subset of what the optimal one holds always fits, also
beside a passing key it holds after serving it), paying only for the
passing keys' requests that the optimal one would have served from memory.
The passing keys are those whose requests cost least in expectation, which
makes that slack the least of any choice of kept keys.

The induction stops as soon as each further
request adds the same expected cost in every state (to a relative 1e-9 of
the total), usually after tens to hundreds of requests: the built-in
workload's 12 keys take under a second per budget. A key requested rarely
delays that by about 20 / its share of the requests; at 14 keys each
request of induction costs a few milliseconds (5,000 requests with one key
at 0.3%: about 25 s here).

Sizes are each key's largest in the trace (a schedule for them fits the
real ones) and a miss costs the request's own ``load_seconds``, as in the
offline optimum, whose model (sequential: loads take no time) it shares.
The realised figure is therefore never below the offline optimum; the
expected one is never above any online policy's expectation on traces drawn
from that popularity. Neither is a bound of a policy on the trace itself:
a policy that guessed the order well may come in under the realised figure.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from .._errors import InvalidArgument
from ._request import Request, check_fits

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

__all__ = ["OnlineOptimum", "online_optimum"]

#: Bytes of value tables kept for the last requests of a trace (older ones
#: use the stationary values, which the tables have converged to by then).
_TABLE_BYTES = 64 * 2**20
#: The largest ``max_keys``: 2 ** 20 states take 8 MiB a table, and a
#: request of induction about a second here.
MAX_KEYS = 20


@attrs.frozen(kw_only=True)
class OnlineOptimum:
    """The optimal online policy for a trace's observed popularity, and what it cost.

    Attributes:
        reload_seconds: Its total reload time on the trace (sequential model).
        expected_seconds: Its expected total reload time on a trace of the
            same length drawn from the same popularity: the least any online
            policy can expect there.
        keys: Distinct keys of the trace.
        largest_group: Keys of the largest group sharing spaces (the process
            solved has ``2 ** largest_group`` states).
        solve_seconds: Wall-clock time spent solving and running it.
        passed_keys: Keys the approximation loads for each request and drops
            once served, never keeping them (0: the exact optimum).
        slack_seconds: How far above the online optimum's expectation
            ``expected_seconds`` may be (0.0 when exact): the expected reload
            seconds of the passed keys' requests. The least any online
            policy can expect lies in ``[expected_seconds - slack_seconds,
            expected_seconds]``.
    """

    reload_seconds: float
    expected_seconds: float
    keys: int
    largest_group: int
    solve_seconds: float
    passed_keys: int = 0
    slack_seconds: float = 0.0

    @property
    def exact(self) -> bool:
        """Whether this is the exact online optimum (no key passed through)."""
        return self.passed_keys == 0


Key = tuple[str, str]


@attrs.define
class _Group:
    """Keys sharing spaces: solved as one process."""

    keys: list[Key]
    index: dict[Key, int]
    sizes: dict[str, list[int]]  # per space, each key's bytes
    costs: list[float]  # each key's mean load seconds
    shares: list[float]  # each key's share of all requests
    #: Keys loaded for their request and dropped once served, never kept
    #: (the approximation beyond ``max_keys``): the same fields, by key.
    passing: list[Key] = attrs.Factory(list)
    passing_sizes: dict[str, list[int]] = attrs.Factory(dict)
    passing_costs: list[float] = attrs.Factory(list)
    passing_shares: list[float] = attrs.Factory(list)

    def pass_all_but(self, kept: int) -> None:
        """Keep the ``kept`` keys of the greatest share x load seconds; the others pass through."""
        order = sorted(range(len(self.keys)), key=lambda k: -self.shares[k] * self.costs[k])
        stay, go = sorted(order[:kept]), order[kept:]
        self.passing = [self.keys[k] for k in go]
        self.passing_sizes = {space: [sizes[k] for k in go] for space, sizes in self.sizes.items()}
        self.passing_costs = [self.costs[k] for k in go]
        self.passing_shares = [self.shares[k] for k in go]
        self.keys = [self.keys[k] for k in stay]
        self.index = {key: i for i, key in enumerate(self.keys)}
        self.sizes = {space: [sizes[k] for k in stay] for space, sizes in self.sizes.items()}
        self.costs = [self.costs[k] for k in stay]
        self.shares = [self.shares[k] for k in stay]

    @property
    def slack_seconds_per_request(self) -> float:
        """What the passing keys' requests cost per request: the approximation's bound."""
        return sum(p * c for p, c in zip(self.passing_shares, self.passing_costs, strict=True))


def online_optimum(
    requests: Sequence[Request],
    budget: Mapping[str, int],
    *,
    max_keys: int = 14,
    approximate: bool = False,
) -> OnlineOptimum:
    """Solve and run the optimal online policy for the popularity observed in ``requests``.

    Args:
        requests: The trace, in time order.
        budget: Bytes per space.
        max_keys: The most keys one group of keys sharing spaces may have
            (the process has ``2 ** max_keys`` states), from 1 to ``MAX_KEYS`` (20).
        approximate: For a larger group, solve the best policy that may keep
            only the ``max_keys`` keys of the greatest share x load seconds
            and loads each other key for its request and drops it once
            served, instead of refusing. Its expectation is within
            ``slack_seconds`` above the online optimum's (see the module).

    Raises:
        InvalidArgument: a group of keys sharing spaces has more than
            ``max_keys`` keys (and ``approximate`` is false), ``max_keys`` is
            not an integer from 1 to 20, or a request does not fit its space's budget.
        ImportError: numpy is not installed (the ``sim`` extra).
    """
    return _online(requests, budget, max_keys=max_keys, approximate=approximate)


def _online(
    requests: Sequence[Request],
    budget: Mapping[str, int],
    *,
    max_keys: int = 14,
    approximate: bool = False,
    shares: Mapping[Key, float] | None = None,
) -> OnlineOptimum:
    """``online_optimum``, optionally for a given popularity (``shares``) instead of the trace's."""
    try:
        import numpy as np  # noqa: F401
    except ImportError as exc:  # pragma: no cover - exercised without the extra
        raise ImportError(
            "the online optimum needs numpy: pip install scipy (cachebroker's 'sim' extra)"
        ) from exc
    check_max_keys(max_keys)
    check_fits(requests, budget)
    started = time.perf_counter()
    groups = _groups(requests, shares)
    largest = max((len(group.keys) for group in groups), default=0)
    if largest > max_keys and not approximate:
        raise InvalidArgument(
            f"the online optimum is solved over every set of keys that share spaces, up to "
            f"{max_keys} keys; {largest} keys of this trace share spaces"
        )
    keys = sum(len(group.keys) for group in groups)
    horizon = len(requests)
    realised = expected = slack = 0.0
    passed = 0
    for group in groups:
        if len(group.keys) > max_keys:
            group.pass_all_but(max_keys)
            passed += len(group.passing)
            slack += horizon * group.slack_seconds_per_request
        values = _Values(group, budget, horizon)
        expected += values.expected
        realised += _run(group, values, requests)
    return OnlineOptimum(
        reload_seconds=realised,
        expected_seconds=expected,
        keys=keys,
        largest_group=largest,
        solve_seconds=time.perf_counter() - started,
        passed_keys=passed,
        slack_seconds=slack,
    )


def check_max_keys(max_keys: object) -> None:
    """Refuse a ``max_keys`` that is not an integer from 1 to ``MAX_KEYS``."""
    if isinstance(max_keys, bool) or not isinstance(max_keys, int) or not 1 <= max_keys <= MAX_KEYS:
        raise InvalidArgument(
            f"max_keys must be an integer from 1 to {MAX_KEYS} (the process solved has "
            f"2 ** max_keys states), got {max_keys!r}"
        )


def _groups(requests: Sequence[Request], shares: Mapping[Key, float] | None) -> list[_Group]:
    """The trace's keys, grouped by shared spaces, with sizes, costs and popularity."""
    counts: dict[Key, int] = {}
    seconds: dict[Key, float] = {}
    sizes: dict[Key, dict[str, int]] = {}
    for request in requests:
        key = (request.cache, request.key)
        counts[key] = counts.get(key, 0) + 1
        seconds[key] = seconds.get(key, 0.0) + request.load_seconds
        largest = sizes.setdefault(key, {})
        for space, amount in request.size.items():
            if amount > 0:
                largest[space] = max(largest.get(space, 0), amount)
    if shares is None:
        shares = {key: count / len(requests) for key, count in counts.items()}
    # Union-find over spaces: keys charging a common space share a group.
    parent: dict[str, str] = {}

    def root(space: str) -> str:
        while parent.setdefault(space, space) != space:
            space = parent[space]
        return space

    for size in sizes.values():
        spaces = list(size)
        for other in spaces[1:]:
            parent[root(other)] = root(spaces[0])
    members: dict[object, list[Key]] = {}
    for key, size in sizes.items():
        # A key charging nothing is never evicted for room: a group of its own.
        members.setdefault(root(next(iter(size))) if size else key, []).append(key)
    groups = []
    for keys in members.values():
        spaces = sorted({space for key in keys for space in sizes[key]})
        groups.append(
            _Group(
                keys=keys,
                index={key: i for i, key in enumerate(keys)},
                sizes={space: [sizes[key].get(space, 0) for key in keys] for space in spaces},
                costs=[seconds[key] / counts[key] for key in keys],
                shares=[shares.get(key, 0.0) for key in keys],
            )
        )
    return groups


class _Values:
    """Backward induction over a group's cache contents.

    ``table(n)[S]`` is the least expected reload time of the next ``n``
    requests from contents ``S`` (a bit set of the group's keys); ``expected``
    is ``table(horizon)[0]``, from the empty cache.

    Induction stops early once every further request adds the same expected
    cost in every state (to a relative 1e-9 of the total): later tables then
    differ from the last by a constant, which no decision sees, and the
    expected total lies within that tolerance. Tables are kept while they fit
    ``_TABLE_BYTES``; past that, one in ``stride`` is kept and the ones
    between are computed again from it when the run reaches them.
    """

    def __init__(self, group: _Group, budget: Mapping[str, int], horizon: int) -> None:
        import numpy as np

        count = len(group.keys)
        states = 1 << count
        self.masks = masks = np.arange(states)
        self.member = member = ((masks[:, None] >> np.arange(count)) & 1).astype(bool)
        fits = np.ones(states, dtype=bool)
        # Per passing key: the states it fits beside.
        self.fits_with = beside = [np.ones(states, dtype=bool) for _ in group.passing]
        for space, sizes in group.sizes.items():
            loads = _loads(sizes, budget[space])
            fits &= loads <= budget[space]
            for j, size in enumerate(group.passing_sizes.get(space, ())):
                beside[j] &= loads + size <= budget[space]
        self.fits = fits
        self.shares = shares = np.asarray(group.shares, dtype=np.float64)
        self.costs = np.asarray(group.costs, dtype=np.float64)
        self.passing = [
            (share, cost)
            for share, cost in zip(group.passing_shares, group.passing_costs, strict=True)
        ]
        # Per state: a hit, or a request for another group's key, leaves it as it is.
        self.stay = 1.0 - shares.sum() - sum(group.passing_shares) + (member * shares).sum(axis=1)
        self.asked = [k for k in range(count) if shares[k] > 0.0]
        self.count = count
        self.states = states
        start = np.where(fits, 0.0, np.inf)
        keep = max(2, _TABLE_BYTES // (8 * states))
        self.stride = max(1, -(-horizon // keep))  # ceil(horizon / keep)
        self.kept: list[NDArray[np.float64]] = [start]  # table(i * stride)
        self.last = horizon  # tables past this one differ from it by a constant
        table = start
        done = 0
        self.expected = 0.0
        while done < horizon:
            new = self.step(table)
            step = new[fits] - table[fits]
            table = new
            done += 1
            if done % self.stride == 0:
                self.kept.append(table)
            more = horizon - done
            low = float(table[0]) + float(step.min()) * more
            high = float(table[0]) + float(step.max()) * more
            if high - low <= 1e-9 * abs(high):
                # The expected cost of each further request is known to
                # within the tolerance, in every state.
                self.expected = (low + high) / 2
                self.last = done
                if done % self.stride:
                    self.kept.append(table)
                break
        else:
            self.expected = float(table[0])
        self._segment = -1
        self._tables: list[NDArray[np.float64]] = []

    def step(self, table: NDArray[np.float64]) -> NDArray[np.float64]:
        """One request more: the table of ``n + 1`` requests from the table of ``n``."""
        import numpy as np

        count = self.count
        new = self.stay * np.where(self.fits, table, 0.0)
        cube = table.reshape((2,) * count)  # axis count-1-k is key k's bit
        added = new.reshape((2,) * count)
        for k in self.asked:
            axis = count - 1 - k
            # The best contents to keep after loading k into S: the least
            # value over the subsets of S, with k. Over the other keys' bits:
            with_k: list[slice] = [slice(None)] * count
            with_k[axis] = slice(1, 2)
            best = _least_over_subsets(cube[tuple(with_k)].copy())  # (k's axis: one cell)
            with_k[axis] = slice(0, 1)
            missing = added[tuple(with_k)]  # a view: the states without k
            missing += self.shares[k] * (self.costs[k] + best)
        for (share, cost), beside in zip(self.passing, self.fits_with, strict=True):
            # A passing key: keep the best subset of S it fits beside, load
            # it, drop it once served.
            best = _least_over_subsets(np.where(beside, table, np.inf).reshape((2,) * count))
            new += share * (cost + best.reshape(-1))
        return np.where(self.fits, new, np.inf)

    def table(self, n: int) -> NDArray[np.float64]:
        """The table of ``n`` requests (``n <= horizon``)."""
        if n >= self.last:
            return self.kept[-1]
        segment, offset = divmod(n, self.stride)
        if self.stride == 1:
            return self.kept[segment]
        if segment != self._segment:
            tables = [self.kept[segment]]
            for _ in range(1, self.stride):
                tables.append(self.step(tables[-1]))
            self._segment, self._tables = segment, tables
        return self._tables[offset]


def _least_over_subsets(cube: NDArray[np.float64]) -> NDArray[np.float64]:
    """``cube`` (one axis per key, its bit) with each cell made the least over the
    cells of its subsets, in place: one pass along each axis."""
    import numpy as np

    for axis in range(cube.ndim):
        view = np.moveaxis(cube, axis, 0)
        np.minimum(view[1:], view[:1], out=view[1:])
    return cube


def _loads(sizes: Sequence[int], cap: int) -> NDArray[Any]:
    """Bytes of every subset of keys, capped at ``cap + 1`` (exact integers, no overflow)."""
    import numpy as np

    loads = np.zeros(1 << len(sizes), dtype=object)
    for k, size in enumerate(sizes):
        low = loads[: 1 << k]
        loads[1 << k : 1 << (k + 1)] = np.minimum(low + min(size, cap + 1), cap + 1)
    return loads


def _run(group: _Group, values: _Values, requests: Sequence[Request]) -> float:
    """Replay ``requests`` under the policy of ``values``: the group's reload seconds."""
    import numpy as np

    contents = 0
    total = 0.0
    remaining = len(requests)
    index = group.index
    passing = {key: j for j, key in enumerate(group.passing)}
    popcount: dict[int, Any] = {}
    for request in requests:
        remaining -= 1
        key = (request.cache, request.key)
        k = index.get(key)
        j = passing.get(key)
        if (k is None and j is None) or (k is not None and contents >> k & 1):
            continue
        total += request.load_seconds
        table = values.table(remaining)
        others = [i for i in range(len(group.keys)) if contents >> i & 1]
        subsets = np.arange(1 << len(others))
        # Loading k: keep k and a subset of the others. A passing key: keep
        # a subset of the others it fits beside (it is dropped once served).
        choices = np.full(subsets.shape, 0 if k is None else 1 << k)
        for bit, i in enumerate(others):
            choices |= ((subsets >> bit) & 1) << i
        options = table[choices]
        if j is not None:
            options = np.where(values.fits_with[j][choices], options, np.inf)
        low = options.min()
        # Ties: keep the most keys (evicting more than needed never helps).
        tied = options <= low + 1e-12 * abs(low)
        sizes = popcount.get(len(others))
        if sizes is None:
            sizes = popcount[len(others)] = np.array(
                [bin(int(s)).count("1") for s in subsets], dtype=np.int64
            )
        contents = int(choices[tied][int(np.argmax(sizes[tied]))])
    return total
