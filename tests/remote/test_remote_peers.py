"""The daemon survives every peer: what one connection does ends that connection only.

A hostile, broken or merely greedy peer of ``cachebroker serve``: a frame that
nests too deeply (before the hello, after it, and from another user being
refused), arbitrary bytes and frames (fuzzed), connections that never say
hello (bounded: the oldest are closed), ``accept()`` failing for want of file
descriptors (backed off and retried). After each, a well-behaved process is
served. The daemon runs in the test's loop on every backend, and as a real
``cachebroker serve`` process where an operating-system limit is the point.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import resource
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, MutableMapping
from typing import Any

import anyio
import anyio.abc
import anyio.from_thread
import anyio.lowlevel
import pytest
import sniffio
from anyio.streams.buffered import BufferedByteReceiveStream
from hypothesis import given
from hypothesis import strategies as st

from cachebroker import Broker, BrokerClosed
from cachebroker.__main__ import main
from cachebroker._core import Reason, Request
from cachebroker._remote import _connection, _daemon, _ps
from cachebroker._remote import _protocol as wire
from cachebroker._remote._daemon import Daemon, DaemonBroker
from tests.remote.processes import Procs, frame
from tests.remote.support import Plugin, until, used, value

pytestmark = pytest.mark.anyio

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SO_PEERCRED, /proc")

#: 200,000 nested arrays: json.loads raises RecursionError on it.
BOMB = frame(b"[" * 200_000)


@contextlib.asynccontextmanager
async def serving(**options: Any) -> AsyncIterator[Daemon]:
    """A daemon (``options`` are ``Daemon``'s) on a fresh socket, budget ``{"m": 100}``."""
    directory = tempfile.mkdtemp(prefix="cb-", dir="/tmp")  # (socket paths are short)
    daemon = Daemon(
        DaemonBroker({"m": 100}, release_timeout=3), os.path.join(directory, "s.sock"), **options
    )
    try:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                await tg.start(daemon.run)
                try:
                    yield daemon
                finally:
                    tg.cancel_scope.cancel()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


async def served(address: str, key: str = "good") -> None:
    """A well-behaved process connects, loads, holds and releases: the daemon serves on."""
    with anyio.fail_after(10):
        async with Broker.connect(address) as broker:
            async with broker.cache("w", Plugin()) as cache:
                async with cache.acquire(key, load=value(key), size=5) as lease:
                    assert lease.value == key


async def hostile(
    address: str, payload: bytes, *, hello: bool, open_cache: bool = False
) -> list[dict[str, Any]]:
    """Send ``payload`` (after a hello, if ``hello``), then the end of the stream.

    What the daemon sent back, once it closed the connection: it has dealt
    with every byte by then.
    """
    received: list[dict[str, Any]] = []
    with anyio.fail_after(10):
        async with await anyio.connect_unix(address) as stream:
            reader = BufferedByteReceiveStream(stream)
            if hello:
                await wire.send(stream, {"op": "hello", "version": wire.VERSION, "pid": 1})
                if open_cache:
                    await wire.send(stream, {"op": "open", "cache": "h"})
                assert (await wire.receive(reader))["op"] == "welcome"
            with contextlib.suppress(anyio.BrokenResourceError):
                await stream.send(payload)
                await stream.send_eof()
            with contextlib.suppress(
                anyio.EndOfStream,
                anyio.IncompleteRead,
                anyio.BrokenResourceError,
                wire.ProtocolError,
            ):
                while True:
                    received.append(await wire.receive(reader))
    return received


def failures(events: list[MutableMapping[str, Any]]) -> list[str]:
    return [e["error"] for e in events if e["event"] == "cachebroker.peer.failed"]


# ------------------------------------------------------------------ the decoder


def depth(value: Any) -> int:
    """How deeply ``value``'s arrays and objects nest (a scalar: 0)."""
    if isinstance(value, list):
        return 1 + max(map(depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(depth, value.values()), default=0)
    return 0


#: Strings full of what the depth check must see through: quotes, escapes, brackets.
tricky_text = st.text(alphabet=st.sampled_from('[]{}"\\\\/ab\n\u00e9\u2028'), max_size=12)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | tricky_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(tricky_text, inner, max_size=3),
    max_leaves=40,
)


def nested(levels: int, leaf: Any) -> Any:
    for i in range(levels):
        leaf = [leaf] if i % 2 else {"k": leaf}
    return leaf


@given(
    st.one_of(
        json_values,
        st.builds(nested, st.integers(wire.MAX_DEPTH - 3, wire.MAX_DEPTH + 3), json_values),
    ),
    st.booleans(),
)
def test_the_depth_check_refuses_exactly_what_nests_deeper_than_the_limit(
    message: Any, ascii_only: bool
) -> None:
    """Whatever strings hold (brackets, quotes, escapes, non-ASCII as such or escaped),
    ``check_depth`` refuses a JSON text if and only if it nests deeper than ``MAX_DEPTH``."""
    body = json.dumps(message, ensure_ascii=ascii_only).encode()
    if depth(message) > wire.MAX_DEPTH:
        with pytest.raises(wire.ProtocolError, match="deeper than"):
            wire.check_depth(body)
    else:
        wire.check_depth(body)


@given(st.binary(max_size=200) | st.lists(st.sampled_from(b'[]{}"\\,:0a'), max_size=300).map(bytes))
def test_a_frame_of_any_bytes_is_a_message_or_a_protocol_error(body: bytes) -> None:
    """``decode`` returns a message (an object with an ``op``) or raises ``ProtocolError``,
    never anything else: no ``RecursionError``, no ``UnicodeDecodeError``."""
    try:
        message = wire.decode(body)
    except wire.ProtocolError:
        return
    assert isinstance(message, dict) and isinstance(message["op"], str)


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"[" * 200_000, "deeper than 16"),
        (b'{"op":"x","a":' + b"[" * 17 + b"]" * 17 + b"}", "deeper than 16"),
        (b'{"op":"acquire","cost":NaN}', "NaN is not a number"),
        (b'{"op":"acquire","cost":-Infinity}', "Infinity is not a number"),
        (b'{"op":"acquire","id":' + b"9" * 5000 + b"}", "not JSON"),
        (b'{"op":"hello","x":"\xff"}', "not JSON"),
    ],
)
def test_the_decoder_refuses_what_no_peer_may_send(body: bytes, why: str) -> None:
    with pytest.raises(wire.ProtocolError, match=why):
        wire.decode(body)


@pytest.mark.parametrize(
    ("message", "why"),
    [
        ({"victims": [["c", "'a'"]], "spaces": []}, "'victims' is"),
        ({"victims": [["c", "'a'", "1"]], "spaces": []}, "'victims' is"),
        ({"victims": [[1, "'a'", None]], "spaces": []}, "'victims' is"),
        ({"victims": {}, "spaces": []}, "'victims' is"),
        ({"victims": [], "spaces": "default"}, "'spaces' is"),
        ({"victims": [], "spaces": [1]}, "'spaces' is"),
    ],
)
def test_a_malformed_freed_answer_is_a_protocol_error(message: dict[str, Any], why: str) -> None:
    with pytest.raises(wire.ProtocolError, match=why):
        wire.decode_freed({"op": "freed", "id": 1, **message}, lambda id: None)


def test_a_freed_answer_names_the_asking_process_own_victims_as_it_knows_them() -> None:
    """A victim of the asking process (its number given) by its own cache and key; another
    process's by its cache in the daemon's books and its key's ``repr``."""
    fields = wire.encode_freed([("c", "'a'", 7), ("w@42", "'b'", None)], {"gpu", "ram"})
    freed = wire.decode_freed({"op": "freed", "id": 1, **fields}, {7: ("c", ("a", 1))}.get)
    assert freed.victims == (("c", ("a", 1)), ("w@42", "'b'"))
    assert freed.spaces == {"gpu", "ram"}


@pytest.mark.parametrize(
    "fields",
    [
        {"need": {"cuda:0": 1}, "places": "cuda:0"},
        {"need": {"cuda:0": 1}, "places": []},
        {"need": {"cuda:0": 1}, "places": ["cuda:0", "cuda:0"]},
        {"need": {"cuda:0": 1}, "places": ["cuda:1", "cuda:0"]},
        {"need": {"cuda:0": 1}, "places": ["cuda:0", 1]},
        {"need": None, "places": ["cuda:0"]},
    ],
)
def test_an_acquire_s_places_must_lead_with_its_need(fields: dict[str, Any]) -> None:
    """``places`` is a list of distinct names whose first is the one ``need`` names
    (the size in the first of them); anything else is a protocol error."""
    with pytest.raises(wire.ProtocolError, match="'places' is"):
        wire.decode_request({"op": "acquire", **fields}, "k", load=print, measure=print)


def test_an_acquire_s_places_travel_whole() -> None:
    request = Request("k", {"cuda:1": 5}, cost=2.0, priority=3, places=("cuda:1", "cuda:0"))
    message = {"op": "acquire", **wire.encode_request(request)}
    back = wire.decode_request(message, "k", load=print, measure=print)
    assert (back.need, back.places, back.cost, back.priority) == (
        {"cuda:1": 5},
        ("cuda:1", "cuda:0"),
        2.0,
        3,
    )


def test_a_release_reason_is_a_known_one_or_a_protocol_error() -> None:
    assert wire.reason({"op": "release", "id": 1}) is Reason.CAPACITY
    assert wire.reason({"op": "release", "id": 1, "reason": "retry"}) is Reason.RETRY
    for bad in ("bored", ["retry"], None):
        with pytest.raises(wire.ProtocolError, match="'release' message: 'reason' is"):
            wire.reason({"op": "release", "id": 1, "reason": bad})


def test_a_bad_field_is_named_in_a_few_words_whatever_its_size() -> None:
    with pytest.raises(wire.ProtocolError) as caught:
        wire.field({"op": "cancel", "id": "x" * 10**6}, "id", int)
    assert str(caught.value).startswith("'cancel' message: 'id' is 'xxx")
    assert len(str(caught.value)) < 200


# ------------------------------------------------------------------ a depth bomb


async def test_a_depth_bomb_before_the_hello_ends_only_its_connection(
    events: list[MutableMapping[str, Any]],
) -> None:
    async with serving() as daemon:
        assert await hostile(daemon.address, BOMB, hello=False) == []
        await served(daemon.address)
        assert failures(events) == ["a frame of 200000 bytes is over the limit of 4096"]
        # Within the first frame's limit, the nesting is what is refused.
        assert await hostile(daemon.address, frame(b"[" * 4000), hello=False) == []
        await served(daemon.address)
        assert "deeper than 16" in failures(events)[-1]


async def test_a_depth_bomb_after_the_hello_ends_only_its_connection(
    events: list[MutableMapping[str, Any]],
) -> None:
    async with serving() as daemon:
        async with Broker.connect(daemon.address) as broker:
            async with broker.cache("w", Plugin()) as cache:
                held = await cache.acquire("a", load=value(1), size=10)
                assert await hostile(daemon.address, BOMB, hello=True, open_cache=True) == []
                [failed] = failures(events)
                assert "deeper than 16" in failed
                await served(daemon.address)
                assert used(daemon) == 10 and held.value == 1
                await held.release()


async def test_a_depth_bomb_from_another_user_is_refused_and_the_daemon_serves_on(
    events: list[MutableMapping[str, Any]],
) -> None:
    async with serving(uid=os.getuid() + 1) as daemon:
        for payload in (BOMB, frame(b"[" * 4000)):
            [refusal] = await hostile(daemon.address, payload, hello=False)
            assert refusal["op"] == "error" and "may not use the broker" in refusal["message"]
        with pytest.raises(BrokerClosed, match="refused"):
            async with Broker.connect(daemon.address):
                pass
        refused = [e for e in events if e["event"] == "cachebroker.peer.refused"]
        assert len(refused) == 3
        daemon.uid = os.getuid()  # (the same daemon, now serving this user)
        await served(daemon.address)


@linux
@pytest.mark.parametrize("anyio_backend", [pytest.param(("asyncio", {}), id="asyncio")])
async def test_cachebroker_serve_survives_a_depth_bomb_before_and_after_the_hello(
    procs: Procs,
) -> None:
    """The real command: a bomb at once, and a bomb once welcomed; then a process of the
    user connects and is served, and the daemon is still there."""
    with anyio.fail_after(30):
        daemon = await procs.daemon("100")
        for hello in (False, True):
            assert await hostile(procs.socket, BOMB, hello=hello) == []
        client = procs.steps("client", {"do": "connect"}, {"do": "acquire", "key": "a"})
        assert await client.exit() == 0, client.stderr()
        assert client.events("acquired", key="a")
        assert daemon.popen.poll() is None, daemon.stderr()
        stderr = daemon.stderr()
        assert stderr.count("cachebroker.peer.failed") == 2, stderr
        assert "over the limit of 4096" in stderr and "deeper than 16" in stderr


# ------------------------------------------------------------------ fuzzing

#: Fields of each op the daemon dispatches, with a value that it accepts.
OPS: dict[str, dict[str, Any]] = {
    "open": {"cache": "h"},
    "close": {"cache": "h"},
    "acquire": {
        "id": 1,
        "cache": "h",
        "key": "'k'",
        "need": {"m": 10},
        "cost": 1.5,
        "urgent": False,
        "holding": [],
        "priority": 0,
    },
    "report": {
        "id": 1,
        "state": "held",
        "charge": {"m": 10},
        "loads": 1,
        "reason": "idle",
        "error": "it failed",
    },
    "cancel": {"id": 1},
    "ps": {},
    "totals": {},
    "hello": {"version": wire.VERSION, "pid": 1, "observer": True},
}

any_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=10,
)


@st.composite
def messages(draw: st.DrawFn, op: str | None = None) -> dict[str, Any]:
    """A message of ``op`` (else of any op), each field kept, dropped or of any JSON value."""
    if op is None:
        op = draw(st.sampled_from([*OPS, "acquire", "acquire", "report", "bogus"]))
    message: dict[str, Any] = {"op": op}
    for name, good in OPS.get(op, {"id": 1}).items():
        choice = draw(st.sampled_from(["good", "good", "missing", "any"]))
        if choice == "good":
            message[name] = draw(st.integers(1, 3)) if name == "id" else good
        elif choice == "any":
            message[name] = draw(any_json)
    if draw(st.integers(0, 7)) == 0:
        message["op"] = draw(any_json)
    return message


def framed(bodies: list[bytes]) -> bytes:
    return b"".join(frame(body) for body in bodies)


def jsons(messages: list[dict[str, Any]]) -> bytes:
    return framed([json.dumps(message).encode() for message in messages])


#: What a peer sends once welcomed (its cache "h" open): frames of any kind.
after_hello = st.one_of(
    st.lists(messages(), min_size=1, max_size=6).map(jsons),
    st.lists(messages(), min_size=1, max_size=6).map(jsons),
    st.lists(messages(), min_size=1, max_size=6).map(jsons),
    st.binary(max_size=64),
    st.lists(any_json.map(lambda v: json.dumps(v).encode()), min_size=1, max_size=3).map(framed),
    st.lists(st.binary(max_size=32), min_size=1, max_size=3).map(framed),
    st.integers(0, 2**32 - 1).map(lambda n: n.to_bytes(4, "big") + b"{}"),
    st.integers(1, 64).map(lambda n: frame(b"[" * n + b"]" * n)),
    st.integers(wire.MAX_DEPTH, 3000).map(lambda n: frame(b'{"op":"ps","x":' + b"[" * n)),
)

#: What a peer sends first: a hello of any fields then messages, or anything at all.
before_hello = st.one_of(
    st.tuples(messages("hello"), st.lists(messages(), max_size=4)).map(
        lambda session: jsons([session[0], *session[1]])
    ),
    after_hello,
)

#: A peer's bytes, and whether the test says hello (and opens "h") before them.
payloads = st.one_of(
    st.tuples(before_hello, st.just(False)),
    st.tuples(after_hello, st.just(True)),
)


def test_fuzzed_peers_never_stop_the_daemon_serving_a_good_process(
    anyio_backend: tuple[str, dict[str, Any]],
) -> None:
    """Whatever a peer sends, before its hello or after it (arbitrary bytes, frames of
    any length and body, nested JSON, every op with each field missing or of any type),
    the daemon deals with it and closes that connection at most; a process connected all
    along is served after each, and the daemon's books add up."""
    backend, options = anyio_backend
    with (
        anyio.from_thread.start_blocking_portal(backend, options) as portal,
        portal.wrap_async_context_manager(serving()) as daemon,
        portal.wrap_async_context_manager(Broker.connect(daemon.address)) as good,
        portal.wrap_async_context_manager(good.cache("w", Plugin())) as cache,
    ):

        async def attack(payload: bytes, hello: bool) -> None:
            await hostile(daemon.address, payload, hello=hello, open_cache=hello)
            await until(lambda: len(daemon.connections) == 1 and not daemon.awaiting.scopes)
            async with cache.acquire("good", load=value("good"), size=5, timeout=10) as lease:
                assert lease.value == "good"
            await until(lambda: used(daemon) == 5)
            daemon.runner.core.check()

        @given(payloads)
        def attacks(peer: tuple[bytes, bool]) -> None:
            portal.call(attack, *peer)

        attacks()
        portal.call(served, daemon.address)


# ------------------------------------------------------------------ containment


class Stop(BaseException):
    """Stands for what is no connection's doing: the daemon's own cancellation, ^C, exit."""


async def test_what_a_connection_cannot_have_caused_still_stops_the_daemon(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The containment of a connection's failure catches ``Exception`` only: a
    ``BaseException`` (as ``KeyboardInterrupt``, ``SystemExit`` and cancellation are)
    raised while serving a connection goes through, and the daemon stops."""

    def peer(stream: anyio.abc.SocketStream) -> Any:
        raise Stop

    monkeypatch.setattr(wire, "peer", peer)
    directory = tempfile.mkdtemp(prefix="cb-", dir="/tmp")
    try:
        daemon = Daemon(DaemonBroker({"m": 100}), os.path.join(directory, "s.sock"))

        async def run_and_connect() -> None:
            async with anyio.create_task_group() as tg:
                await tg.start(daemon.run)
                async with await anyio.connect_unix(daemon.address):
                    await anyio.sleep_forever()

        with anyio.fail_after(10), pytest.raises(BaseExceptionGroup) as stopped:
            await run_and_connect()
        assert stopped.group_contains(Stop)
        assert not os.listdir(directory)  # it stopped, removing its socket
    finally:
        shutil.rmtree(directory, ignore_errors=True)


async def test_a_bug_while_serving_one_connection_ends_that_connection_only(
    events: list[MutableMapping[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error the daemon did not foresee (here, ``dispatch`` raising ``KeyError``,
    before and after the hello) is logged as ``peer.failed`` naming it, and closes that
    connection; the daemon and its other connections go on."""
    async with serving() as daemon:
        async with Broker.connect(daemon.address) as broker:
            async with broker.cache("w", Plugin()) as cache:
                held = await cache.acquire("a", load=value(1), size=10)
                dispatch = _connection.Connection.dispatch

                async def buggy(self: _connection.Connection, message: dict[str, Any]) -> None:
                    if message["op"] == "ps":  # (which the process connected meanwhile never sends)
                        raise KeyError("bug")
                    await dispatch(self, message)

                monkeypatch.setattr(_connection.Connection, "dispatch", buggy)
                assert await hostile(daemon.address, wire.encode({"op": "ps"}), hello=True) == []
                monkeypatch.setattr(wire, "peer", lambda stream: 1 / 0)
                assert await hostile(daemon.address, b"", hello=False) == []
                monkeypatch.undo()
                assert failures(events) == [
                    "KeyError('bug')",
                    "ZeroDivisionError('division by zero')",
                ]
                await served(daemon.address)
                assert held.value == 1 and used(daemon) == 10
                await held.release()


async def test_the_daemon_cancelled_at_any_step_of_serving_stops_cleanly() -> None:
    """Cancelled after each number of scheduling steps while it serves connections in
    every phase (silent, a partial hello, a process with a lease and a request waiting
    for space, a peer that never reports its load), the daemon stops with nothing but
    its cancellation, and removes its socket."""
    for steps in range(0, 60, 2):
        await stop_after(steps)


async def stop_after(steps: int) -> None:
    """Serve peers in every phase, cancel the daemon after ``steps`` scheduling steps."""
    directory = tempfile.mkdtemp(prefix="cb-", dir="/tmp")
    address = os.path.join(directory, "s.sock")
    daemon = Daemon(DaemonBroker({"m": 100}, release_timeout=1), address)
    stopped = anyio.Event()
    scope = anyio.CancelScope()

    async def run(*, task_status: anyio.abc.TaskStatus[None]) -> None:
        with scope:
            await daemon.run(task_status=task_status)
        stopped.set()

    async def silent() -> None:
        async with await anyio.connect_unix(address):
            await anyio.sleep_forever()

    async def partial() -> None:
        async with await anyio.connect_unix(address) as stream:
            await stream.send(wire.encode({"op": "hello", "version": wire.VERSION})[:9])
            await anyio.sleep_forever()

    async def process() -> None:
        async with Broker.connect(address) as broker:
            async with broker.cache("w", Plugin()) as cache:
                async with cache.acquire("a", load=value(1), size=60):
                    async with cache.acquire("b", load=value(2), size=60):
                        pass

    async def silent_loader() -> None:
        async with await anyio.connect_unix(address) as stream:
            await wire.send(
                stream,
                {"op": "hello", "version": wire.VERSION},
                {"op": "open", "cache": "h"},
                {"op": "acquire", "id": 1, "cache": "h", "key": "'k'", "need": {"m": 30}},
            )
            await anyio.sleep_forever()

    try:
        with anyio.fail_after(10), tolerating_anyio_reader_race():
            async with anyio.create_task_group() as tg:
                await tg.start(run)
                for peer in (silent, partial, process, silent_loader):
                    # (what the daemon's end does to a peer is not this test's)
                    tg.start_soon(_quietly, peer)
                for _ in range(steps):
                    await anyio.lowlevel.checkpoint()
                scope.cancel()
                await stopped.wait()
                tg.cancel_scope.cancel()
        assert not os.listdir(directory), steps  # the socket is gone
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def tolerating_anyio_reader_race() -> Iterator[None]:
    """Let pass the one error anyio's asyncio backend raises when a task reading a UNIX
    socket is cancelled in the very loop iteration its socket became readable: the
    reader callback sets the result of the cancelled future (``InvalidStateError`` from
    ``Future.set_result``, in a loop callback; nothing is lost). Stopping a daemon while
    its processes talk to it does that; every other error still fails the test."""
    if sniffio.current_async_library() != "asyncio":
        yield
        return
    loop = asyncio.get_running_loop()
    previous = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        error = context.get("exception")
        if isinstance(error, asyncio.InvalidStateError) and "set_result" in repr(
            context.get("handle")
        ):
            return
        if previous is None:
            loop.default_exception_handler(context)
        else:
            previous(loop, context)

    loop.set_exception_handler(handler)
    try:
        yield
    finally:
        loop.set_exception_handler(previous)


async def _quietly(peer: Callable[[], Awaitable[None]]) -> None:
    with contextlib.suppress(Exception):
        await peer()


async def test_a_peer_that_goes_away_at_any_moment_is_no_failure(
    events: list[MutableMapping[str, Any]],
) -> None:
    """A peer that closes mid-header, mid-frame, before or after its hello, with the
    daemon's answers unread (its end resets the connection) or while the daemon writes
    to it, has simply gone: nothing is logged as a failure, and the daemon serves on."""
    hello = wire.encode({"op": "hello", "version": wire.VERSION})
    ps = wire.encode({"op": "ps"})
    async with serving() as daemon:
        async with Broker.connect(daemon.address) as broker:
            async with broker.cache("w", Plugin()) as cache:
                for i in range(50):  # (a listing long enough to be written after the peer left)
                    await (await cache.acquire(f"k{i}", load=value(i), size=1)).release()
                for payload in (
                    b"",
                    hello[:2],
                    hello[:9],
                    hello,
                    hello + ps[:3],
                    hello + ps[:7],
                    hello + ps,
                    hello + ps * 20,
                ):
                    async with await anyio.connect_unix(daemon.address) as stream:
                        await stream.send(payload)
                    await until(lambda: len(daemon.connections) == 1)
                    await until(lambda: not daemon.awaiting.scopes)
                await served(daemon.address)
    assert failures(events) == []


async def test_a_peer_that_does_not_read_is_not_read_either() -> None:
    """A process that asks and asks (5,000 ``ps`` requests) and never reads the answers
    cannot make the daemon hold an answer per request: with ``MAX_UNSENT`` messages
    waiting for it, the daemon stops reading from it until it reads. Others are served
    meanwhile, and once it goes, everything of it is gone."""
    async with serving() as daemon:
        async with Broker.connect(daemon.address) as broker:
            async with broker.cache("w", Plugin()) as cache:
                for i in range(20):  # (answers of some size)
                    await (await cache.acquire(f"k{i}", load=value(i), size=1)).release()
                async with await anyio.connect_unix(daemon.address) as greedy:
                    await greedy.send(wire.encode({"op": "hello", "version": wire.VERSION}))
                    await until(lambda: len(daemon.connections) == 2)
                    [connection] = [c for c in daemon.connections.values() if not c.caches]
                    for _ in range(50):
                        await greedy.send(wire.encode({"op": "ps"}) * 100)
                        assert len(connection.outbox) <= _connection.MAX_UNSENT
                    await anyio.wait_all_tasks_blocked()
                    assert len(connection.outbox) <= _connection.MAX_UNSENT
                    await served(daemon.address)
                    assert len(connection.outbox) <= _connection.MAX_UNSENT
                await until(lambda: len(daemon.connections) == 1)


# ------------------------------------------------------------------ awaiting the hello


async def test_connections_awaiting_their_hello_are_bounded_the_oldest_closed_first(
    events: list[MutableMapping[str, Any]],
) -> None:
    """Beyond ``max_pending`` connections that have not said hello, each new one closes
    the oldest: a flood ages out as it comes, and a process, which says hello at once,
    gets in while the flood is still open."""
    async with serving(max_pending=4) as daemon, contextlib.AsyncExitStack() as stack:
        silent: list[anyio.abc.SocketStream] = []
        for count in range(1, 11):
            silent.append(await stack.enter_async_context(await anyio.connect_unix(daemon.address)))
            await until(lambda: len(daemon.awaiting.scopes) == min(count, 4))  # noqa: B023
        await served(daemon.address)
        # The process's connection, awaiting its hello in turn, closed one more.
        for closed in silent[:7]:
            with anyio.fail_after(5), pytest.raises(anyio.EndOfStream):
                await closed.receive()
        assert len(daemon.awaiting.scopes) == 3
        why = failures(events)
        assert len(why) == 7
        assert all("oldest of 4 connections awaiting" in w for w in why), why
        for stream in silent[7:]:  # the newest are still open: they may say hello yet
            await wire.send(stream, {"op": "hello", "version": wire.VERSION})
            reader = BufferedByteReceiveStream(stream)
            assert (await wire.receive(reader))["op"] == "welcome"


async def test_a_connection_that_says_nothing_is_closed_after_the_hello_timeout(
    events: list[MutableMapping[str, Any]],
) -> None:
    async with serving(hello_timeout=0.05) as daemon:
        async with await anyio.connect_unix(daemon.address) as stream:
            with anyio.fail_after(5), pytest.raises(anyio.EndOfStream):
                await stream.receive()
        assert failures(events) == ["no hello within 0.05 s"]
        await served(daemon.address)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"max_pending": 0}, ValueError, "max_pending must be at least 1"),
        ({"max_pending": 2.5}, TypeError, "max_pending must be a number"),
        ({"hello_timeout": 0}, ValueError, "hello_timeout must be a positive"),
        ({"hello_timeout": None}, TypeError, "hello_timeout must be a number"),
    ],
)
def test_the_daemon_s_limits_are_checked(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        Daemon(DaemonBroker(100), "/tmp/x.sock", **options)


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--max-pending", "0"], "--max-pending must be at least 1, got '0'"),
        (["--max-pending", "many"], "--max-pending must be a whole number, got 'many'"),
        (["--hello-timeout", "-1"], "--hello-timeout must be a positive number of seconds"),
        (["--hello-timeout", "inf"], "--hello-timeout must be a positive number of seconds"),
        (["--hello-timeout", "soon"], "--hello-timeout must be a number of seconds, got 'soon'"),
        (["--idle-ttl", "-1"], "--idle-ttl '-1': expected a non-negative number of seconds"),
        (["--release-timeout", "x"], "--release-timeout 'x': expected a number of seconds (0 wait"),
    ],
)
def test_serve_says_what_is_wrong_with_its_limits(
    option: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--budget", "1MiB", "--socket", "/tmp/unused.sock", *option])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("socket", "message"),
    [
        ("/tmp/cb-no-such-dir/s.sock", "directory /tmp/cb-no-such-dir cannot be used (No such"),
        ("/tmp/" + "s" * 120 + ".sock", "is 130 bytes; a Unix socket's path holds at most"),
    ],
    ids=["no-directory", "too-long"],
)
def test_serve_says_what_is_wrong_with_its_socket_path(
    socket: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--budget", "1MiB", "--socket", socket]) == 1
    err = capsys.readouterr().err
    assert err.startswith("cachebroker serve: error: "), err
    assert message in err and "(--socket)" in err, err
    assert not os.path.exists(socket)


@linux
@pytest.mark.parametrize("anyio_backend", [pytest.param(("asyncio", {}), id="asyncio")])
async def test_cachebroker_serve_closes_the_oldest_silent_connections_and_lets_a_process_in(
    procs: Procs,
) -> None:
    """``cachebroker serve --max-pending 8``, 40 connections that never say hello: the
    32 oldest are closed, and a process connects and is served while the rest stay open."""
    with anyio.fail_after(60):
        daemon = await procs.daemon("100", "--max-pending", "8", "--hello-timeout", "120")
        async with contextlib.AsyncExitStack() as stack:
            flood = [
                await stack.enter_async_context(await anyio.connect_unix(procs.socket))
                for _ in range(40)
            ]
            for closed in flood[:32]:
                with pytest.raises(anyio.EndOfStream):
                    await closed.receive()
            client = procs.steps("client", {"do": "connect"}, {"do": "acquire", "key": "a"})
            assert await client.exit() == 0, client.stderr()
            assert client.events("acquired", key="a")
        assert daemon.popen.poll() is None, daemon.stderr()
        assert daemon.stderr().count("oldest of 8 connections awaiting") >= 32


# ------------------------------------------------------------------ accept() failing


class Failing:
    """A listener whose ``accept()`` fails as ``errors`` say, then accepts."""

    def __init__(self, listener: anyio.abc.SocketListener, errors: list[int]) -> None:
        self.listener = listener
        self.errors = errors

    async def accept(self) -> anyio.abc.SocketStream:
        await anyio.lowlevel.checkpoint()
        if self.errors:
            code = self.errors.pop(0)
            raise anyio.BrokenResourceError from OSError(code, os.strerror(code))
        return await self.listener.accept()

    async def __aenter__(self) -> Failing:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.listener.aclose()


def failing(monkeypatch: pytest.MonkeyPatch, errors: list[int]) -> None:
    listen = _daemon._listen

    async def _listen(address: str) -> Any:
        return Failing(await listen(address), errors)

    monkeypatch.setattr(_daemon, "_listen", _listen)


async def test_accept_failing_for_want_of_descriptors_is_logged_backed_off_and_retried(
    events: list[MutableMapping[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    failing(monkeypatch, [errno.EMFILE, errno.EMFILE, errno.ENFILE, errno.ECONNABORTED])
    async with serving() as daemon:
        await served(daemon.address)
        logged = [e for e in events if e["event"] == "cachebroker.accept.failed"]
        assert [(e["errno"], e["failures"]) for e in logged] == [
            ("EMFILE", 1),
            ("EMFILE", 2),
            ("ENFILE", 3),
            ("ECONNABORTED", 4),
        ]
        first, _longest = _daemon.ACCEPT_BACKOFF
        assert [e["retry_in"] for e in logged] == [first * 2**i for i in range(4)]
        assert all(e["address"] == daemon.address and e["error"] for e in logged)


def test_the_backoff_doubles_up_to_its_bound() -> None:
    first, longest = _daemon.ACCEPT_BACKOFF
    waits = [_daemon.backoff(failures) for failures in range(1, 10_001)]
    assert waits[:3] == [first, 2 * first, 4 * first]
    assert waits == sorted(waits) and waits[-1] == longest == 1.0


async def test_accept_failing_otherwise_stops_the_daemon(monkeypatch: pytest.MonkeyPatch) -> None:
    """An error of ``accept()`` that does not pass (the socket itself broken) is the daemon's:
    it stops, instead of trying again for ever."""
    failing(monkeypatch, [errno.EBADF])
    with pytest.raises(BaseExceptionGroup) as stopped:
        async with serving():
            await anyio.sleep_forever()
    assert stopped.group_contains(anyio.BrokenResourceError)


def open_descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


#: ``cachebroker serve`` ARGS on the event loop named by the first argument (the command
#: itself runs on asyncio).
SERVE_ON = """
import functools, sys, anyio
from cachebroker.__main__ import main
loop = sys.argv[1]
backend, options = ("trio", {}) if loop == "trio" else ("asyncio", {"use_uvloop": loop == "uvloop"})
anyio.run = functools.partial(anyio.run, backend=backend, backend_options=options)
sys.exit(main(sys.argv[2:]))
"""


@linux
@pytest.mark.parametrize("anyio_backend", [pytest.param(("asyncio", {}), id="asyncio")])
@pytest.mark.parametrize("loop", ["asyncio", "uvloop", "trio"])
async def test_cachebroker_serve_out_of_file_descriptors_backs_off_and_goes_on(
    procs: Procs,
    loop: str,
) -> None:
    """A real ``cachebroker serve`` (on each event loop) whose soft ``RLIMIT_NOFILE``
    leaves room for 20 more descriptors, flooded with 60 connections that never say
    hello: ``accept()`` fails with ``EMFILE``, which the daemon logs and waits out while
    it serves the process connected before; once the flood is closed, a new process
    connects and is served, and the daemon never exited."""
    if loop == "uvloop":
        pytest.importorskip("uvloop")
    argv = [sys.executable, "-c", SERVE_ON, loop, "serve", "--socket", procs.socket]
    with anyio.fail_after(60):
        daemon = procs.spawn("daemon", [*argv, "--budget", "100", "--hello-timeout", "120"])
        await daemon.wait_in_stderr("cachebroker serve: listening on")
        before = procs.steps(
            "before",
            {"do": "connect"},
            {"do": "wait", "signal": "flooded"},
            {"do": "acquire", "key": "b"},
        )
        await before.wait_for("connected")
        _soft, hard = resource.prlimit(daemon.pid, resource.RLIMIT_NOFILE)
        resource.prlimit(
            daemon.pid, resource.RLIMIT_NOFILE, (open_descriptors(daemon.pid) + 20, hard)
        )
        async with contextlib.AsyncExitStack() as stack:
            for _ in range(60):
                await stack.enter_async_context(await anyio.connect_unix(procs.socket))
            await daemon.wait_in_stderr("cachebroker.accept.failed")
            assert "EMFILE" in daemon.stderr()
            procs.signal("flooded")
            assert await before.exit() == 0, before.stderr()
            assert before.events("acquired", key="b")
        after = procs.steps("after", {"do": "connect"}, {"do": "acquire", "key": "a"})
        assert await after.exit() == 0, after.stderr()
        assert after.events("acquired", key="a")
        assert daemon.popen.poll() is None, daemon.stderr()


# ------------------------------------------------------------------ ps comes and goes quietly


async def test_ps_comes_and_goes_at_debug_level_and_a_process_at_info(
    events: list[MutableMapping[str, Any]],
) -> None:
    async with serving() as daemon:
        listing = await _ps.fetch(daemon.address)
        assert listing["processes"] == []
        await served(daemon.address)
        await until(lambda: not daemon.connections)
    levels = [
        (e["event"].rpartition(".")[2], e["log_level"])
        for e in events
        if e["event"] in ("cachebroker.peer.connected", "cachebroker.peer.gone")
    ]
    assert levels == [
        ("connected", "debug"),
        ("gone", "debug"),
        ("connected", "info"),
        ("gone", "info"),
    ]
