"""Where tiers and aliases meet: circles made by an alias, and the names moves are asked by.

An alias of two spaces that lie on one chain of tiers (``g0 -> ram -> disk``
with ``g0`` and ``disk`` one memory) would make the tiers a circle, which the
broker refuses when given directly: it is refused however it arises, given at
construction (an error naming the circle) or learned at run time (not merged,
logged as ``cachebroker.alias.refused``). And an owner is asked to move a value
by the space names it gave (its acquire's, or the tiers' below them), whatever
name a merge keeps for the space inside the books: the books first, then the
shell on every backend.
"""

from __future__ import annotations

from collections.abc import Hashable, MutableMapping
from typing import Any

import anyio
import pytest

from cachebroker import Broker, InvalidArgument
from cachebroker._core import Request, State
from tests.harness import Harness
from tests.helpers import Device, steps_until

GIB = 1 << 30
CHAIN = {"g0": "ram", "ram": "disk"}


def chain() -> Harness:
    return Harness({"g0": 100, "ram": 100, "disk": 100}, tiers=CHAIN, moves=True)


def load(h: Harness, key: str, need: dict[str, int]) -> None:
    """Request ``key``; end the moves, releases and load it waits for; end its lease."""
    ticket = h.acquire(key, need, task=key)
    for _ in range(20):  # (bounded by steps: each one ends a move, a release or a load)
        if ticket.outcome is not None:
            break
        if h.moving:
            h.move(h.moving[0][0])
        elif h.releasing:
            h.ack(h.releasing[0])
        else:
            h.finish(h.loading[0])
    assert ticket.outcome is True, (ticket.entry, h.moving, h.releasing, h.loading)
    h.end(ticket)
    while h.moving:  # (moves its lease's end set off)
        h.move(h.moving[0][0])


# -- a circle made by an alias: the books --------------------------------------


def test_merging_spaces_that_would_close_a_tier_circle_is_refused_naming_it() -> None:
    h = chain()
    with pytest.raises(InvalidArgument, match=r"circle: g0 -> ram -> g0"):
        h.core.merge_spaces("g0", "disk")
    assert h.core.aliases() == [] and h.core.tiers == CHAIN  # nothing was merged
    h.core.check()


def test_evidence_for_an_alias_that_would_close_a_tier_circle_merges_nothing() -> None:
    h = chain()
    learned = h.core.note_alias_evidence(["disk"], ["g0"], threshold=1)
    assert learned.merged == []
    assert [(r.spaces, r.circle) for r in learned.refused] == [
        (("g0", "disk"), ("g0", "ram", "g0"))
    ]
    assert h.core.aliases() == [] and h.core.tiers == CHAIN and not h.core.canon.evidence
    # The tiers still work: a value goes down the chain and comes back up.
    load(h, "a", {"g0": 60})
    load(h, "b", {"g0": 60})
    load(h, "c", {"g0": 60})
    entries = h.owner.entries
    assert entries["a"].charge == {"disk": 60} and entries["b"].charge == {"ram": 60}
    load(h, "a", {"g0": 60})
    assert entries["a"].charge == {"g0": 60}
    h.core.check()


def test_evidence_for_an_alias_off_the_tier_chain_is_still_merged() -> None:
    h = Harness({"g0": 100, "g1": 100, "ram": 100}, tiers={"g0": "ram", "g1": "ram"})
    learned = h.core.note_alias_evidence(["g1"], ["g0"], threshold=1)
    assert learned.merged == [("g0", "g1")] and learned.refused == []
    assert h.core.tiers == {"g0": "ram"}


# -- the names moves are asked by: the books ------------------------------------


def one_gpu() -> Harness:
    """Two names of one GPU over RAM, merged as ``Broker(aliases=...)`` merges them."""
    h = Harness(
        {"llama": 100, "whisper": 100, "ram": 200},
        tiers={"llama": "ram", "whisper": "ram"},
        moves=True,
    )
    h.core.merge_spaces("llama", "whisper")  # the books keep "llama"
    return h


def test_a_value_goes_down_and_back_up_by_the_names_its_request_gave() -> None:
    h = one_gpu()
    load(h, "w", {"whisper": 60})
    load(h, "l", {"llama": 60})  # w goes down
    load(h, "w", {"whisper": 60})  # l goes down, w comes back up
    load(h, "l", {"llama": 60})  # w goes down, l comes back up
    assert h.moved == [("w", "ram"), ("l", "ram"), ("w", "whisper"), ("w", "ram"), ("l", "llama")]
    h.core.check()


def test_a_value_goes_down_to_the_name_its_tier_gives_when_the_tier_is_merged() -> None:
    h = Harness({"gpu": 100, "cpu": 100, "ram": 200}, tiers={"gpu": "ram"}, moves=True)
    h.core.merge_spaces("cpu", "ram")  # the books keep "cpu"
    load(h, "a", {"gpu": 60})
    load(h, "b", {"gpu": 60})
    assert h.moved == [("a", "ram")] and h.owner.entries["a"].charge == {"cpu": 60}
    load(h, "a", {"gpu": 60})
    assert h.moved == [("a", "ram"), ("b", "ram"), ("a", "gpu")]


def test_a_value_merged_after_its_load_comes_back_by_its_own_name() -> None:
    h = Harness(
        {"llama": 100, "whisper": 100, "ram": 200},
        tiers={"llama": "ram", "whisper": "ram"},
        moves=True,
    )
    load(h, "w", {"whisper": 60})
    h.core.merge_spaces("llama", "whisper")
    load(h, "l", {"llama": 60})  # w goes down
    load(h, "w", {"whisper": 60})  # l goes down, w comes back up
    assert h.moved == [("w", "ram"), ("l", "ram"), ("w", "whisper")]


# -- the shell -------------------------------------------------------------------


class Models(Device):
    """A device whose owner can move values, and checks the spaces it is told."""

    def __init__(self, capacity: int, spaces: set[str]) -> None:
        super().__init__(capacity)
        self.spaces = spaces
        self.moves: list[tuple[Hashable, str]] = []

    async def move(self, key: Hashable, value: Any, to: str) -> Any:
        await anyio.lowlevel.checkpoint()
        if to not in self.spaces:
            raise RuntimeError(f"{key!r}: no space {to!r} here (only {sorted(self.spaces)})")
        self.moves.append((key, to))
        return value


def test_a_broker_given_an_alias_that_closes_a_tier_circle_is_refused() -> None:
    with pytest.raises(InvalidArgument, match=r"'g0' and 'disk'.*circle: g0 -> ram -> g0"):
        Broker(budget={"g0": 24, "ram": 24, "disk": 24}, tiers=CHAIN, aliases=[("g0", "disk")])


async def use(cache: Any, device: Device, key: str, size: int, space: str) -> None:
    async with cache.acquire(key, load=device.loader(key, size), size={space: size}):
        pass


async def overdraw(broker: Broker, cache: Any, device: Device) -> dict[Hashable, Any]:
    """Fill g0 and ram with idle values, then have a load measured larger than declared
    drive g0 over its capacity: the eviction that follows, waited for by nobody, looks
    for room a tier down (what recursed for ever when the tiers went round a circle)."""
    for key in "abcde":
        await use(cache, device, key, 10, "g0")
    load = device.loader("f", 10)
    async with cache.acquire("f", load=load, size={"g0": 2}, measure=lambda _: {"g0": 10}):
        pass
    core = broker._core
    assert await steps_until(lambda: all(e.state is not State.MOVING for e in core.entries()))
    return {info.key: info.charge for info in await broker.entries()}


@pytest.mark.anyio
async def test_a_learned_alias_that_would_close_a_tier_circle_is_refused_and_logged(
    events: list[MutableMapping[str, Any]],
) -> None:
    device = Models(24, {"g0", "ram", "disk"})
    broker = Broker(budget={"g0": 24, "ram": 24, "disk": 24}, tiers=CHAIN, alias_threshold=1)
    async with broker, broker.cache("m", device) as cache:
        await use(cache, device, "x", 20, "g0")
        await use(cache, device, "y", 10, "disk")  # fits only once x is freed: evidence
        stats = await broker.stats()
        assert stats.aliases == () and stats.oom_retries == 1
        refused = [e for e in events if e["event"] == "cachebroker.alias.refused"]
        assert [(e["spaces"], e["circle"]) for e in refused] == [
            (["disk", "g0"], ["disk", "ram", "disk"])
        ]
        device.capacity = 1000  # (the device's own limit has served its purpose)
        charges = await overdraw(broker, cache, device)
        assert charges == {
            "a": {"disk": 10},
            "b": {"disk": 10},  # (y, the oldest in disk, made room for it)
            "c": {"ram": 10},
            "d": {"ram": 10},
            "e": {"g0": 10},
            "f": {"g0": 10},
        }
        assert device.freed == ["x", "y"]
        stats = await broker.stats()
        assert stats.moves_failed == 0 and stats.quarantined_keys == ()
    assert device.used == 0  # closing released everything


class Named:
    """A plugin on one device, which it knows by one name: it refuses to move elsewhere."""

    def __init__(self, space: str) -> None:
        self.space = space
        self.moves: list[tuple[Hashable, str]] = []

    async def release(self, key: Hashable, value: Any) -> None:
        pass

    async def move(self, key: Hashable, value: Any, to: str) -> Any:
        await anyio.lowlevel.checkpoint()
        if to not in (self.space, "ram"):
            raise RuntimeError(f"{key!r}: this plugin runs on {self.space!r}, not {to!r}")
        self.moves.append((key, to))
        return f"{key}@{to}"


@pytest.mark.anyio
@pytest.mark.parametrize(
    "learned",
    [(("llama:cuda:0", "whisper:cuda:0"),), (("whisper:cuda:0", "llama:cuda:0"),)],
    ids=["llama-kept", "whisper-kept"],
)
async def test_each_owner_of_one_gpu_is_asked_to_move_by_its_own_names(
    learned: tuple[tuple[str, str]],
) -> None:
    """docs/memory.md's aliasing example with a RAM tier: whichever name the merge keeps,
    each model goes down to "ram" and back up to the GPU by its plugin's name for it."""
    broker = Broker(
        budget={"whisper:cuda:0": "24GiB", "llama:cuda:0": "24GiB", "ram": "64GiB"},
        aliases=learned,
        tiers={"whisper:cuda:0": "ram", "llama:cuda:0": "ram"},
    )
    whisper, llama = Named("whisper:cuda:0"), Named("llama:cuda:0")
    async with (
        broker,
        broker.cache("whisper", whisper) as on_whisper,
        broker.cache("llama", llama) as on_llama,
    ):

        async def use(cache: Any, key: str, space: str) -> str:
            load = loader_of(f"{key}@{space}")
            # (A cold load costs 30 s: a move back up is always worth it.)
            size = {space: 16 * GIB}
            async with cache.acquire(key, load=load, size=size, cost=30.0) as lease:
                return str(lease.value)

        assert await use(on_whisper, "w", "whisper:cuda:0") == "w@whisper:cuda:0"
        assert await use(on_llama, "l", "llama:cuda:0") == "l@llama:cuda:0"  # w goes down
        assert await use(on_whisper, "w", "whisper:cuda:0") == "w@whisper:cuda:0"  # back up
        assert await use(on_llama, "l", "llama:cuda:0") == "l@llama:cuda:0"  # back up
        stats = await broker.stats()
        assert stats.moves_failed == 0 and stats.quarantined_keys == ()
        assert (stats.loads, stats.promotions) == (2, 2)
    assert whisper.moves == [("w", "ram"), ("w", "whisper:cuda:0"), ("w", "ram")]
    assert llama.moves == [("l", "ram"), ("l", "llama:cuda:0")]


def loader_of(value: str) -> Any:
    async def load() -> str:
        await anyio.lowlevel.checkpoint()
        return value

    return load


def test_a_value_measured_into_its_space_comes_back_by_the_measured_name() -> None:
    h = one_gpu()
    ticket = h.core.request(h.owner, Request("w"), "w")  # (a size unknown until measured)
    h.drain()
    h.finish(ticket.entry, measured={"whisper": 60})
    h.end(ticket)
    load(h, "l", {"llama": 60})  # w goes down
    load(h, "w", {"whisper": 60})  # w comes back up
    assert h.moved == [("w", "ram"), ("l", "ram"), ("w", "whisper")]
