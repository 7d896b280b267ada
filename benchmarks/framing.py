"""The wire's encoding: the standard library's JSON beside msgpack and msgspec.

For three typical messages (an ``acquire``, a ``report`` after a load, and a
``ps`` reply listing 1,000 entries), the time to encode and decode each with:

* ``json``: what ``cachebroker._remote._protocol`` does (``json.dumps`` with
  compact separators; ``_protocol.decode``: the depth check, then one
  ``JSONDecoder`` refusing ``NaN``), and plain ``json.loads`` beside it;
* ``msgpack`` (``packb`` / ``unpackb``), when installed;
* ``msgspec.json`` and ``msgspec.msgpack``, when installed.

Then the depth bomb, 200,000 nested ``[``, in each: what decoding it raises
and how long it takes to refuse it; and the depth check's cost on the
largest frames a peer may send (16 MiB) built to make it work hardest.
Prints tables; asserts nothing.

    python benchmarks/framing.py [--number N]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import timeit
from collections.abc import Callable
from typing import Any

from cachebroker._remote import _protocol as wire

ACQUIRE = {
    "op": "acquire",
    "id": 1234,
    "cache": "whisper",
    "key": "'large-v3'",
    "need": {"cuda:0": 3 << 30, "ram": 2 << 30},
    "cost": 12.5,
    "urgent": False,
    "holding": [17, 42],
    "priority": 0,
}

REPORT = {
    "op": "report",
    "id": 1234,
    "state": "held",
    "charge": {"cuda:0": 3221225472},
    "loads": 3,
}

PS = {
    "op": "ps",
    "daemon": {
        "pid": 4121,
        "address": "/run/user/1000/cachebroker.sock",
        "used": {"cuda:0": 11274289152, "ram": 2147483648},
        "budget": {"cuda:0": 21474836480, "ram": 62058000384},
        "limit": {"cuda:0": 21474836480, "ram": 62058000384},
    },
    "processes": list(range(4000, 4016)),
    "entries": [
        {
            "pid": 4000 + i % 16,
            "cache": "llm",
            "key": f"'model-{i}'",
            "charge": {"cuda:0": 8053063680 + i},
            "state": "ready",
            "leases": i % 2,
            "idle_seconds": 41.318 if i % 2 == 0 else None,
            "pinned": False,
            "priority": 0,
            "waiting": 0,
            "loads": 3,
        }
        for i in range(1000)
    ],
}

BOMB = b"[" * 200_000

Codec = tuple[Callable[[Any], bytes], Callable[[bytes], Any]]


def codecs() -> dict[str, Codec]:
    def json_encode(message: Any) -> bytes:
        return wire.encode(message)[4:]

    def json_decode(body: bytes) -> Any:
        return wire.decode(body)

    found: dict[str, Codec] = {
        "json (stdlib, depth-checked)": (json_encode, json_decode),
        "json (stdlib, unchecked)": (json_encode, json.loads),
    }
    try:
        import msgpack  # type: ignore[import-untyped,unused-ignore]
    except ImportError:
        pass
    else:
        found["msgpack"] = (msgpack.packb, msgpack.unpackb)
    try:
        import msgspec  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        pass
    else:
        found["msgspec.json"] = (msgspec.json.encode, msgspec.json.decode)
        found["msgspec.msgpack"] = (msgspec.msgpack.encode, msgspec.msgpack.decode)
    return found


def per_call(function: Callable[[], object], number: int, repeat: int = 15) -> float:
    """Microseconds per call: the best of ``repeat`` runs of ``number`` calls."""
    return min(timeit.repeat(function, number=number, repeat=repeat)) / number * 1e6


def bomb_for(name: str) -> bytes:
    if name.startswith("json") or name == "msgspec.json":
        return BOMB
    return b"\x91" * 200_000  # msgpack: an array of one element, nested


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--number", type=int, default=2000, help="calls per timing run")
    args = parser.parse_args()
    messages = {"acquire": ACQUIRE, "report": REPORT, "ps 1000": PS}
    print(f"{'codec':30} {'message':8} {'bytes':>7} {'encode us':>10} {'decode us':>10}")
    for name, (encode, decode) in codecs().items():
        for label, message in messages.items():
            body = encode(message)
            assert decode(body) == message
            number = max(1, args.number // 200) if label.startswith("ps") else args.number
            encoding = per_call(lambda: encode(message), number)  # noqa: B023
            decoding = per_call(lambda: decode(body), number)  # noqa: B023
            print(f"{name:30} {label:8} {len(body):7} {encoding:10.2f} {decoding:10.2f}")
    print()
    print(f"{'codec':30} depth bomb (200,000 levels)")
    for name, (_encode, decode) in codecs().items():
        bomb = bomb_for(name)
        try:
            decode(bomb)
        except BaseException as exc:  # (reported, whatever it is)
            outcome = f"{type(exc).__module__}.{type(exc).__qualname__}: {str(exc)[:60]}"
        else:
            outcome = "decoded"
        seconds = per_call(lambda: _attempt(decode, bomb), 20) / 1e6  # noqa: B023
        print(f"{name:30} {outcome} ({seconds * 1e3:.2f} ms)")
    print()
    print(f"{'16 MiB frame':40} {'check_depth ms':>14} {'json.loads ms':>14}")
    size = wire.MAX_FRAME
    nested = b"[" * wire.MAX_DEPTH + b"0" + b"]" * wire.MAX_DEPTH
    for label, body in {
        "[0] repeated (depth 1)": b"[" + b"[0]," * (size // 4 - 1) + b"0]",
        f"depth {wire.MAX_DEPTH} repeated (the most rounds)": (
            b"[" + (nested + b",") * (size // (len(nested) + 1) - 1) + b"0]"
        ),
        '"[" strings (brackets in strings)': b"[" + b'"[",' * (size // 4 - 1) + b"0]",
        '"[" strings in arrays': b"[" + b'["["],' * (size // 6 - 1) + b"0]",
        '"\\"[" strings (escapes)': b"[" + b'"\\"[",' * (size // 7 - 1) + b"0]",
        "[ repeated (the bomb)": b"[" * size,
    }.items():
        checking = per_call(lambda: _attempt(wire.check_depth, body), 1, 3) / 1e3  # noqa: B023
        loading = per_call(lambda: _attempt(json.loads, body), 1, 3) / 1e3  # noqa: B023
        print(f"{label:40} {checking:14.1f} {loading:14.1f}")
    print()
    print(f"{'the depth check alone':30} {'message':8} {'us':>10}")
    for label, message in messages.items():
        body = wire.encode(message)[4:]
        number = max(1, args.number // 200) if label.startswith("ps") else args.number
        checking = per_call(lambda: wire.check_depth(body), number)  # noqa: B023
        print(f"{'check_depth':30} {label:8} {checking:10.2f}")


def _attempt(decode: Callable[[bytes], Any], body: bytes) -> None:
    with contextlib.suppress(BaseException):  # (timing the refusal only)
        decode(body)


if __name__ == "__main__":
    main()
