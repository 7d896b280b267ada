"""``cachebroker.sizes``: weights from checkpoint headers, torch modules per device, measured loads.

Safetensors and GGUF files are written with their own libraries (``safetensors``,
``gguf``: the ``test`` extra), so the header parser is checked against the
real formats; corrupt and truncated headers are written by hand. ``torch_bytes``
is checked with duck-typed fakes, and against real torch when it is installed.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable, Coroutine, Iterator, Mapping
from pathlib import Path
from typing import Any

import anyio
import gguf
import numpy as np
import pytest
from safetensors.numpy import save_file

from cachebroker import InvalidArgument
from cachebroker.probes import Probe
from cachebroker.sizes import measured, torch_bytes, weights_bytes
from tests.brokers import open_broker


def save_safetensors(path: Path, tensors: Mapping[str, np.ndarray[Any, Any]]) -> int:
    """Write ``tensors`` with the safetensors library; return their bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(dict(tensors), str(path), metadata={"format": "np"})
    return sum(int(t.nbytes) for t in tensors.values())


def arrays(seed: int, *shapes: tuple[int, ...]) -> dict[str, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(seed)
    dtypes = [np.float32, np.float16, np.int64, np.uint8]
    return {
        f"layer{i}.weight": rng.random(shape).astype(dtypes[i % len(dtypes)])
        for i, shape in enumerate(shapes)
    }


def raw_safetensors(
    path: Path, header: object, data: bytes = b"", *, length: int | None = None
) -> Path:
    """A safetensors file written by hand: its header as given, even a wrong one."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)
    return path


def message_of(excinfo: pytest.ExceptionInfo[InvalidArgument]) -> str:
    return str(excinfo.value)


# ---------------------------------------------------------------- safetensors


def test_a_safetensors_file_counts_its_tensors_bytes_from_the_header(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    expected = save_safetensors(path, arrays(1, (64, 32), (17,), (3, 5, 7), (1000,)))
    assert weights_bytes(path) == expected == 64 * 32 * 4 + 17 * 2 + 3 * 5 * 7 * 8 + 1000
    assert path.stat().st_size > expected  # the header and its padding are not weights
    assert weights_bytes(str(path)) == expected  # str or PathLike


def test_a_safetensors_file_without_tensors_weighs_nothing(tmp_path: Path) -> None:
    path = raw_safetensors(tmp_path / "empty.safetensors", {"__metadata__": {"a": "b"}})
    assert weights_bytes(path) == 0


def test_a_safetensors_dtype_newer_than_the_table_is_trusted_to_its_offsets(tmp_path: Path) -> None:
    header = {"t": {"dtype": "F2_FUTURE", "shape": [10], "data_offsets": [0, 3]}}
    path = raw_safetensors(tmp_path / "future.safetensors", header, b"\0" * 3)
    assert weights_bytes(path) == 3


def test_sub_byte_safetensors_dtypes_count_their_bits(tmp_path: Path) -> None:
    header = {
        "a": {"dtype": "F4", "shape": [3, 4], "data_offsets": [0, 6]},
        "b": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [6, 9]},
    }
    assert weights_bytes(raw_safetensors(tmp_path / "fp4.safetensors", header, b"\0" * 9)) == 9


CORRUPT_HEADERS: list[tuple[str, object, bytes, str]] = [
    ("not-json", b"{not json", b"", "corrupt safetensors header"),
    ("not-utf8", b"\xff\xfe{}", b"", "corrupt safetensors header"),
    ("a-list", [1, 2], b"", "not a JSON object"),
    ("no-dtype", {"t": {"shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, "no dtype"),
    ("info-not-object", {"t": [1]}, b"", "not described by an object"),
    ("shape-not-list", {"t": {"dtype": "F32", "shape": 2, "data_offsets": [0, 8]}}, b"", "shape"),
    (
        "negative-offset",
        {"t": {"dtype": "U8", "shape": [2], "data_offsets": [-2, 0]}},
        b"",
        "data_offsets",
    ),
    (
        "offsets-reversed",
        {"t": {"dtype": "U8", "shape": [0], "data_offsets": [4, 2]}},
        b"\0" * 4,
        "end precedes its start",
    ),
    (
        "dtype-x-shape-disagrees",
        {"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}},
        b"\0" * 8,
        "F32 x [3] is 12 bytes, but its data_offsets span 8",
    ),
    (
        "data-truncated",
        {"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}},
        b"\0" * 10,
        "truncated safetensors file: tensor 't' ends at byte 16 of the data, which has 10",
    ),
]


@pytest.mark.parametrize(
    ("header", "data", "expected"),
    [pytest.param(h, d, e, id=i) for i, h, d, e in CORRUPT_HEADERS],
)
def test_a_corrupt_safetensors_header_is_an_invalid_argument_naming_the_file(
    tmp_path: Path, header: object, data: bytes, expected: str
) -> None:
    path = raw_safetensors(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(InvalidArgument) as excinfo:
        weights_bytes(path)
    assert str(path) in message_of(excinfo)
    assert expected in message_of(excinfo)
    assert excinfo.value.__cause__ is None  # no bare JSONDecodeError or KeyError behind it


def test_a_safetensors_header_longer_than_the_file_is_truncated(tmp_path: Path) -> None:
    path = tmp_path / "cut.safetensors"
    save_safetensors(path, arrays(2, (100,)))
    whole = path.read_bytes()
    for cut in (0, 5, 8, 20, len(whole) - 1):
        path.write_bytes(whole[:cut])
        with pytest.raises(InvalidArgument, match="truncated") as excinfo:
            weights_bytes(path)
        assert str(path) in message_of(excinfo)


def test_an_absurd_safetensors_header_length_is_refused_before_reading_it(tmp_path: Path) -> None:
    path = tmp_path / "huge.safetensors"
    with path.open("wb") as file:
        file.write(struct.pack("<Q", 200_000_000))
        file.truncate(200_000_100)  # sparse: a big file whose "header" would be read whole
    with pytest.raises(InvalidArgument, match="corrupt safetensors header: 200000000 bytes long"):
        weights_bytes(path)


# ---------------------------------------------------------- sharded checkpoints


def write_sharded(directory: Path, prefix: str = "model") -> int:
    """Two safetensors shards and their index, as transformers writes them."""
    directory.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    total = 0
    for number in (1, 2):
        shard = f"{prefix}-0000{number}-of-00002.safetensors"
        tensors = arrays(number, (128, 16), (33,))
        tensors = {f"s{number}.{name}": t for name, t in tensors.items()}
        total += save_safetensors(directory / shard, tensors)
        weight_map.update(dict.fromkeys(tensors, shard))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / f"{prefix}.safetensors.index.json").write_text(json.dumps(index))
    return total


def test_a_sharded_checkpoint_counts_each_shard_once_and_not_its_index(tmp_path: Path) -> None:
    total = write_sharded(tmp_path / "ckpt")
    assert weights_bytes(tmp_path / "ckpt") == total
    assert weights_bytes(tmp_path / "ckpt" / "model.safetensors.index.json") == total


def test_an_index_keeps_a_consolidated_copy_beside_its_shards_from_counting(
    tmp_path: Path,
) -> None:
    total = write_sharded(tmp_path)
    save_safetensors(tmp_path / "model.safetensors", arrays(9, (128, 16), (33,), (128, 16)))
    assert weights_bytes(tmp_path) == total
    # A pattern is an explicit choice: the consolidated file alone.
    assert weights_bytes(tmp_path, pattern="model.safetensors") == weights_bytes(
        tmp_path / "model.safetensors"
    )


def test_an_index_listing_a_missing_shard_names_it(tmp_path: Path) -> None:
    write_sharded(tmp_path)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    for path in (tmp_path, tmp_path / "model.safetensors.index.json"):
        with pytest.raises(InvalidArgument) as excinfo:
            weights_bytes(path)
        assert "model-00002-of-00002.safetensors" in message_of(excinfo)
        assert "model.safetensors.index.json" in message_of(excinfo)


@pytest.mark.parametrize(
    "content",
    [b"{oops", b"[]", b'{"weight_map": []}', b'{"weight_map": {"a": 3}}', b'{"metadata": {}}'],
)
def test_a_malformed_index_is_an_invalid_argument_naming_it(tmp_path: Path, content: bytes) -> None:
    index = tmp_path / "model.safetensors.index.json"
    index.write_bytes(content)
    save_safetensors(tmp_path / "model-00001-of-00001.safetensors", arrays(1, (4,)))
    for path in (tmp_path, index):
        with pytest.raises(InvalidArgument) as excinfo:
            weights_bytes(path)
        assert str(index) in message_of(excinfo)


def test_a_pytorch_index_lists_bin_shards(tmp_path: Path) -> None:
    for number, size in ((1, 1000), (2, 234)):
        (tmp_path / f"pytorch_model-0000{number}-of-00002.bin").write_bytes(b"\0" * size)
    weight_map = {"a": "pytorch_model-00001-of-00002.bin", "b": "pytorch_model-00002-of-00002.bin"}
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert weights_bytes(tmp_path) == 1234
    assert weights_bytes(tmp_path / "pytorch_model.bin.index.json") == 1234


# ------------------------------------------------------ one format per directory


def test_a_directory_with_safetensors_and_bin_counts_the_safetensors_only(tmp_path: Path) -> None:
    expected = save_safetensors(tmp_path / "model.safetensors", arrays(3, (256, 8)))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0" * (expected + 777))
    (tmp_path / "config.json").write_text("{}")
    assert weights_bytes(tmp_path) == expected


def test_the_format_preference_is_safetensors_gguf_pytorch_onnx_keras_flax_tensorflow(
    tmp_path: Path,
) -> None:
    sizes = {
        "tf_model.pb": 7,
        "flax_model.msgpack": 60,
        "tf_model.h5": 500,
        "model.onnx": 4_000,
        "pytorch_model.bin": 30_000,
    }
    for name, size in sizes.items():
        (tmp_path / name).write_bytes(b"\0" * size)
    assert weights_bytes(tmp_path) == 30_000
    for removed, then in [
        ("pytorch_model.bin", 4_000),
        ("model.onnx", 500),
        ("tf_model.h5", 60),
        ("flax_model.msgpack", 7),
    ]:
        (tmp_path / removed).unlink()
        assert weights_bytes(tmp_path) == then, removed
    write_gguf(tmp_path / "model.gguf")
    assert weights_bytes(tmp_path) == weights_bytes(tmp_path / "model.gguf")


def test_pytorch_suffixes_are_one_format(tmp_path: Path) -> None:
    for name, size in {"a.bin": 1, "b.pt": 20, "c.pth": 300, "d.ckpt": 4000}.items():
        (tmp_path / name).write_bytes(b"\0" * size)
    (tmp_path / "e.onnx").write_bytes(b"\0" * 50_000)
    assert weights_bytes(tmp_path) == 4321


def test_a_directory_is_searched_recursively_and_hidden_entries_are_skipped(
    tmp_path: Path,
) -> None:
    unet = save_safetensors(tmp_path / "unet" / "m.safetensors", arrays(1, (64,)))
    vae = save_safetensors(tmp_path / "vae" / "m.safetensors", arrays(2, (32, 2)))
    (tmp_path / ".git" / "lfs").mkdir(parents=True)
    save_safetensors(tmp_path / ".git" / "lfs" / "copy.safetensors", arrays(1, (64,)))
    save_safetensors(tmp_path / "vae" / ".partial.safetensors", arrays(1, (64,)))
    assert weights_bytes(tmp_path) == unet + vae


# ------------------------------------------------------------------- symlinks


def hf_cache(tmp_path: Path) -> tuple[Path, int]:
    """A Hugging Face cache layout: snapshot files are links into blobs/."""
    repo = tmp_path / "models--org--name"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    total = write_sharded(tmp_path / "staging")
    for file in sorted((tmp_path / "staging").iterdir()):
        blob = blobs / hashlib.sha256(file.read_bytes()).hexdigest()
        file.rename(blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    assert len(list(blobs.iterdir())) == 3
    return snapshot, total


def test_symlinked_shards_are_followed_and_read_by_their_link_names(tmp_path: Path) -> None:
    snapshot, total = hf_cache(tmp_path)
    assert weights_bytes(snapshot) == total
    assert weights_bytes(snapshot / "model.safetensors.index.json") == total
    # The blobs have no suffix: the repository's root holds no weight file by name.
    with pytest.raises(InvalidArgument, match="no weight file"):
        weights_bytes(tmp_path / "models--org--name" / "blobs")


def test_a_file_reached_by_two_links_counts_once(tmp_path: Path) -> None:
    expected = save_safetensors(tmp_path / "real.safetensors", arrays(4, (10, 10)))
    (tmp_path / "link-a.safetensors").symlink_to("real.safetensors")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "link-b.safetensors").symlink_to("../link-a.safetensors")
    assert weights_bytes(tmp_path) == expected


def test_a_link_back_up_the_tree_is_walked_once(tmp_path: Path) -> None:
    expected = save_safetensors(tmp_path / "m.safetensors", arrays(5, (8,)))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "loop").symlink_to("..")
    (tmp_path / "again").symlink_to("sub")
    assert weights_bytes(tmp_path) == expected


def test_a_broken_link_is_an_invalid_argument_naming_it(tmp_path: Path) -> None:
    (tmp_path / "gone.safetensors").symlink_to("nowhere.safetensors")
    with pytest.raises(InvalidArgument, match="broken symbolic link") as excinfo:
        weights_bytes(tmp_path / "gone.safetensors")
    assert str(tmp_path / "gone.safetensors") in message_of(excinfo)
    with pytest.raises(InvalidArgument) as excinfo:
        weights_bytes(tmp_path)
    assert "gone.safetensors" in message_of(excinfo)


# ---------------------------------------------------------------------- GGUF


def write_gguf(path: Path, *, big_endian: bool = False, alignment: int | None = None) -> int:
    """A real GGUF file, written by the gguf package: F32, F16, Q8_0 and Q4_K tensors.

    Returns the bytes of its tensor data as numpy holds them.
    """
    endian = gguf.GGUFEndian.BIG if big_endian else gguf.GGUFEndian.LITTLE
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_name("tiny")
    writer.add_context_length(128)
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "</s>", "hello", "world"])
    writer.add_array("tokenizer.ggml.scores", [0.0, 0.5, -1.0, 2.0])
    writer.add_array("nested", [[1, 2], [3]])
    writer.add_bool("flag", True)
    rng = np.random.default_rng(0)
    q8 = gguf.quants.quantize(rng.random((4, 64), dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
    # Q4_K: 2 rows of 2 blocks of 256 elements, 144 bytes a block, as raw bytes.
    q4k = rng.integers(0, 255, size=(2, 2 * 144), dtype=np.uint8)
    tensors: dict[str, tuple[np.ndarray[Any, Any], Any]] = {
        "tok_embd.weight": (rng.random((10, 32), dtype=np.float32), None),
        "norm.weight": (rng.random(32).astype(np.float16), None),
        "ffn.weight": (q8, gguf.GGMLQuantizationType.Q8_0),
        "attn.weight": (q4k, gguf.GGMLQuantizationType.Q4_K),
    }
    for name, (array, raw) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=raw)  # (the writer swaps bytes for big-endian)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sum(int(array.nbytes) for array, _ in tensors.values())


def test_a_gguf_file_counts_its_tensors_bytes_from_the_header(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    expected = write_gguf(path)
    assert expected == 10 * 32 * 4 + 32 * 2 + 4 * 2 * 34 + 2 * 2 * 144
    assert weights_bytes(path) == expected
    assert path.stat().st_size > expected
    reader = gguf.GGUFReader(str(path))
    assert weights_bytes(path) == sum(int(t.n_bytes) for t in reader.tensors)


def test_a_big_endian_gguf_file_is_read_too(tmp_path: Path) -> None:
    path = tmp_path / "big.gguf"
    expected = write_gguf(path, big_endian=True)
    assert path.read_bytes()[4:8] == b"\0\0\0\3"  # the version, big-endian
    assert weights_bytes(path) == expected


def test_a_gguf_file_with_its_own_alignment(tmp_path: Path) -> None:
    path = tmp_path / "aligned.gguf"
    expected = write_gguf(path, alignment=256)
    assert weights_bytes(path) == expected


def test_a_gguf_file_cut_anywhere_is_truncated(tmp_path: Path) -> None:
    path = tmp_path / "cut.gguf"
    write_gguf(path)
    whole = path.read_bytes()
    for cut in (3, 10, 30, 100, 200, len(whole) - 300, len(whole) - 1):
        path.write_bytes(whole[:cut])
        with pytest.raises(InvalidArgument, match="truncated") as excinfo:
            weights_bytes(path)
        assert str(path) in message_of(excinfo)


def gguf_file(
    tensors: list[tuple[str, list[int], int, int]],
    *,
    magic: bytes = b"GGUF",
    version: int = 3,
    metadata: list[tuple[str, int, bytes]] | None = None,
    data: int = 0,
) -> bytes:
    """A GGUF file written by hand: tensor infos ``(name, dims, ggml type, offset)``."""
    metadata = metadata or []
    out = magic + struct.pack("<IQQ", version, len(tensors), len(metadata))
    for key, kind, value in metadata:
        out += struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", kind) + value
    for name, dims, kind, offset in tensors:
        out += struct.pack("<Q", len(name)) + name.encode()
        out += struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, kind, offset)
    return out + b"\0" * (-len(out) % 32) + b"\0" * data


def test_a_hand_written_gguf_file_is_read_as_written(tmp_path: Path) -> None:
    path = tmp_path / "hand.gguf"
    string = struct.pack("<Q", 5) + b"hello"
    strings = struct.pack("<IQ", 8, 2) + string + string
    path.write_bytes(
        gguf_file(
            [("a", [32, 2], 2, 0), ("b", [7], 0, 64), ("scalar", [], 1, 96)],
            metadata=[("s", 8, string), ("arr", 9, strings), ("u", 4, b"\0" * 4)],
            data=128,
        )
    )
    assert weights_bytes(path) == 2 * 18 + 7 * 4 + 2


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        pytest.param(gguf_file([], magic=b"GGML"), "not a GGUF file", id="magic"),
        pytest.param(gguf_file([], version=1), "GGUF version 1 is not supported", id="v1"),
        pytest.param(gguf_file([("t", [32], 99, 0)], data=64), "ggml type 99", id="type"),
        pytest.param(
            gguf_file([("t", [33], 2, 0)], data=64),
            "not a multiple of Q4_0's block of 32",
            id="row",
        ),
        pytest.param(gguf_file([("t", [1] * 5, 0, 0)], data=64), "5 dimensions", id="dims"),
        pytest.param(
            gguf_file([], metadata=[("k", 13, b"")]), "unknown metadata value type 13", id="kv"
        ),
        pytest.param(
            gguf_file([], metadata=[("general.alignment", 4, struct.pack("<I", 3))]),
            "not a power of two",
            id="alignment",
        ),
        pytest.param(
            gguf_file([], metadata=[("s", 8, struct.pack("<Q", 2**40))]), "truncated", id="string"
        ),
        pytest.param(
            gguf_file([], metadata=[("a", 9, struct.pack("<IQ", 10, 2**50))]),
            "truncated",
            id="array",
        ),
        pytest.param(
            gguf_file([], metadata=[("a", 9, struct.pack("<IQ", 9, 1) * 20)]),
            "nested more than 8",
            id="nesting",
        ),
        pytest.param(gguf_file([("t", [64], 0, 0)], data=100), "truncated", id="data"),
    ],
)
def test_a_corrupt_gguf_header_is_an_invalid_argument_naming_the_file(
    tmp_path: Path, content: bytes, expected: str
) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(InvalidArgument) as excinfo:
        weights_bytes(path)
    assert str(path) in message_of(excinfo)
    assert expected in message_of(excinfo)


def test_an_unknown_ggml_type_names_the_file_and_the_type_number(tmp_path: Path) -> None:
    path = tmp_path / "new.gguf"
    path.write_bytes(gguf_file([("blk.0.weight", [256], 77, 0)], data=1024))
    with pytest.raises(InvalidArgument) as excinfo:
        weights_bytes(path)
    assert str(path) in message_of(excinfo)
    assert "77" in message_of(excinfo) and "blk.0.weight" in message_of(excinfo)


def test_the_ggml_table_matches_the_gguf_package() -> None:
    from cachebroker import sizes

    table = sizes._GGML_TYPES
    theirs = {
        int(kind): (kind.name, block, size) for kind, (block, size) in gguf.GGML_QUANT_SIZES.items()
    }
    common = table.keys() & theirs.keys()
    assert {kind: table[kind] for kind in common} == {kind: theirs[kind] for kind in common}
    # Every type up to BF16 is in every supported gguf; newer ones as the package has them.
    assert set(range(31)) - {4, 5} <= common


def test_gguf_quantizations_are_chosen_with_a_pattern(tmp_path: Path) -> None:
    small = write_gguf(tmp_path / "model-Q4_K_M.gguf")
    write_gguf(tmp_path / "model-Q8_0.gguf")
    assert weights_bytes(tmp_path) == 2 * small  # both: a directory cannot tell copies apart
    assert weights_bytes(tmp_path, pattern="model-Q4_K_M*.gguf") == small


# ------------------------------------------------------- other formats, patterns


@pytest.mark.parametrize(
    "suffix", [".bin", ".pt", ".pth", ".onnx", ".ckpt", ".h5", ".msgpack", ".pb"]
)
def test_other_weight_files_count_their_size(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"model{suffix}"
    path.write_bytes(b"\1" * 12_345)
    assert weights_bytes(path) == 12_345
    assert weights_bytes(tmp_path) == 12_345


def test_a_file_named_explicitly_counts_its_size_whatever_its_suffix(tmp_path: Path) -> None:
    (tmp_path / "weights.npz").write_bytes(b"\0" * 99)
    assert weights_bytes(tmp_path / "weights.npz") == 99


def test_a_pattern_selects_files_by_name_or_by_path_below_the_directory(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.bin").write_bytes(b"\0" * 10)
    (tmp_path / "y.bin").write_bytes(b"\0" * 200)
    (tmp_path / "z.npz").write_bytes(b"\0" * 3000)
    assert weights_bytes(tmp_path) == 210
    assert weights_bytes(tmp_path, pattern="y.bin") == 200
    assert weights_bytes(tmp_path, pattern="a/*") == 10
    assert weights_bytes(tmp_path, pattern="*.npz") == 3000  # a pattern may select any file
    assert weights_bytes(tmp_path, pattern="*") == 210  # formats are still preferred to others


def test_a_pattern_matching_nothing_names_the_directory_and_the_pattern(tmp_path: Path) -> None:
    (tmp_path / "model.bin").write_bytes(b"\0")
    with pytest.raises(InvalidArgument) as excinfo:
        weights_bytes(tmp_path, pattern="*.gguf")
    assert str(tmp_path) in message_of(excinfo) and "'*.gguf'" in message_of(excinfo)


def test_a_file_must_match_the_pattern_given_with_it(tmp_path: Path) -> None:
    (tmp_path / "model.bin").write_bytes(b"\0" * 5)
    assert weights_bytes(tmp_path / "model.bin", pattern="*.bin") == 5
    with pytest.raises(InvalidArgument, match="does not match pattern"):
        weights_bytes(tmp_path / "model.bin", pattern="*.gguf")


# -------------------------------------------------------------------- errors


def test_a_missing_path_is_an_invalid_argument_naming_it(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="does not exist") as excinfo:
        weights_bytes(tmp_path / "nope")
    assert str(tmp_path / "nope") in message_of(excinfo)
    assert isinstance(excinfo.value, ValueError)


def test_a_directory_without_weights_names_it(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "README.md").write_text("hi")
    with pytest.raises(InvalidArgument, match="no weight file") as excinfo:
        weights_bytes(tmp_path)
    assert str(tmp_path) in message_of(excinfo)


def test_an_unreadable_file_is_an_invalid_argument_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "model.safetensors"
    save_safetensors(path, arrays(1, (4,)))
    real_open = Path.open

    def refuse(self: Path, *args: Any, **kwargs: Any) -> Any:
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", refuse)
    for target in (path, tmp_path):
        with pytest.raises(InvalidArgument, match="cannot be read") as excinfo:
            weights_bytes(target)
        assert str(path) in message_of(excinfo)


def test_an_unreadable_directory_is_an_invalid_argument_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "model.bin").write_bytes(b"\0")
    locked = tmp_path / "locked"
    locked.mkdir()
    real_scandir = os.scandir

    def refuse(path: Any) -> Any:
        if Path(path) == locked:
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", refuse)  # (root reads a chmod 0 directory anyway)
    with pytest.raises(InvalidArgument, match="cannot be read") as excinfo:
        weights_bytes(tmp_path)
    assert str(locked) in message_of(excinfo)


# -------------------------------------------------------------- torch_bytes


class Device:
    def __init__(self, type: str, index: int | None = None) -> None:
        self.type = type
        self.index = index


class Storage:
    def __init__(self, pointer: int, nbytes: int) -> None:
        self.pointer = pointer
        self.size = nbytes

    def data_ptr(self) -> int:
        return self.pointer

    def nbytes(self) -> int:
        return self.size


class Tensor:
    """Duck-typed like a torch tensor; with a storage when ``storage`` is given."""

    def __init__(
        self, device: Device, numel: int, element_size: int = 4, storage: Storage | None = None
    ) -> None:
        self.device = device
        self._numel = numel
        self._element_size = element_size
        self._storage = storage

    def numel(self) -> int:
        return self._numel

    def element_size(self) -> int:
        return self._element_size

    def untyped_storage(self) -> Storage:
        if self._storage is None:
            raise RuntimeError("this tensor has no storage (a wrapper subclass)")
        return self._storage


class Module:
    def __init__(self, parameters: list[Any], buffers: list[Any] | None = None) -> None:
        self._parameters = parameters
        self._buffers = buffers or []

    def parameters(self) -> Iterator[Any]:
        return iter(self._parameters)

    def buffers(self) -> Iterator[Any]:
        return iter(self._buffers)


CPU, GPU0, GPU1 = Device("cpu"), Device("cuda", 0), Device("cuda", 1)


def test_torch_bytes_counts_parameters_and_buffers_per_device() -> None:
    module = Module(
        [Tensor(CPU, 10), Tensor(GPU0, 100, 2), Tensor(GPU1, 1000, 1), Tensor(GPU0, 5, 8)],
        [Tensor(GPU1, 3, 8), Tensor(Device("xpu", 0), 7), Tensor(Device("mps"), 1)],
    )
    assert torch_bytes(module) == {
        "ram": 40,
        "cuda:0": 240,
        "cuda:1": 1024,
        "xpu:0": 28,
        "mps": 4,
    }


def test_torch_bytes_skips_meta_tensors() -> None:
    module = Module([Tensor(Device("meta"), 10**9), Tensor(CPU, 2)])
    assert torch_bytes(module) == {"ram": 8}
    assert torch_bytes(Module([Tensor(Device("meta"), 10**9)])) == {}


def test_a_tied_parameter_counts_once() -> None:
    embedding = Tensor(GPU0, 1000)
    assert torch_bytes(Module([embedding, Tensor(GPU0, 10), embedding])) == {"cuda:0": 4040}


def test_tensors_sharing_a_storage_count_it_once_per_device() -> None:
    fused = Storage(0x1000, 3 * 400)
    q, k, v = (Tensor(GPU0, 100, 4, fused) for _ in range(3))  # views of one qkv storage
    other = Tensor(GPU1, 100, 4, Storage(0x1000, 400))  # the same address on another device
    assert torch_bytes(Module([q, k, v], [other])) == {"cuda:0": 1200, "cuda:1": 400}


def test_a_tensor_without_storage_is_weighed_by_its_elements() -> None:
    assert torch_bytes(Module([Tensor(CPU, 6, 2)])) == {"ram": 12}


def test_torch_bytes_accepts_named_parameters_and_buffers() -> None:
    class Named:
        def named_parameters(self) -> Iterator[tuple[str, Any]]:
            yield "w", Tensor(CPU, 4)

        def named_buffers(self) -> Iterator[tuple[str, Any]]:
            yield "b", Tensor(GPU0, 2)

    assert torch_bytes(Named()) == {"ram": 16, "cuda:0": 8}


def test_torch_bytes_of_a_module_without_buffers_counts_its_parameters() -> None:
    class ParametersOnly:
        def parameters(self) -> list[Any]:
            return [Tensor(CPU, 3)]

    assert torch_bytes(ParametersOnly()) == {"ram": 12}


@pytest.mark.parametrize("thing", [object(), {"w": 1}, 42, "model"])
def test_torch_bytes_of_what_is_no_module_is_a_type_error(thing: object) -> None:
    with pytest.raises(TypeError, match=r"torch.nn.Module \(an object with parameters\(\)"):
        torch_bytes(thing)


def test_torch_bytes_of_a_module_yielding_no_tensors_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="tensors with a device"):
        torch_bytes(Module([3]))

    class Deviceful:
        device = CPU

    with pytest.raises(TypeError, match="numel"):
        torch_bytes(Module([Deviceful()]))


def test_torch_bytes_with_real_torch() -> None:
    torch = pytest.importorskip("torch")
    nn = torch.nn
    linear = nn.Linear(16, 8)
    assert torch_bytes(linear) == {"ram": (16 * 8 + 8) * 4}
    norm = nn.BatchNorm1d(5)  # 2 parameters, 2 float buffers and an int64 counter
    assert torch_bytes(norm) == {"ram": 4 * 5 * 4 + 8}
    tied = nn.Sequential(nn.Embedding(100, 16), nn.Linear(16, 100, bias=False))
    tied[1].weight = tied[0].weight  # as language models tie their input and output embeddings
    assert torch_bytes(tied) == {"ram": 100 * 16 * 4}
    half = nn.Linear(16, 8).to(torch.float16)
    assert torch_bytes(half) == {"ram": (16 * 8 + 8) * 2}
    with torch.device("meta"):
        assert torch_bytes(nn.Linear(4096, 4096)) == {}
    fused = torch.zeros(3, 8, 8)
    views = nn.ParameterList([nn.Parameter(fused[i]) for i in range(3)])
    assert torch_bytes(views) == {"ram": 3 * 8 * 8 * 4}


# ---------------------------------------------------------------- measured


class Memory:
    """A device whose free bytes loads take and other processes move."""

    def __init__(self, total: int = 10_000) -> None:
        self.total = total
        self.free = total
        self.reads = 0

    def read(self) -> tuple[int, int]:
        self.reads += 1
        return self.total, self.free


@pytest.mark.anyio
async def test_measured_gives_what_an_async_load_took() -> None:
    device = Memory()

    async def load() -> str:
        device.free -= 1234
        return "model"

    wrapped, measure = measured(load, {"gpu": Probe(device.read)})
    assert device.reads == 0  # nothing is read until the load runs
    value = await wrapped()
    assert value == "model"
    assert measure(value) == {"gpu": 1234}


@pytest.mark.anyio
async def test_measured_is_never_negative() -> None:
    device = Memory()

    async def load() -> str:
        device.free += 500  # something else freed memory meanwhile
        return "model"

    wrapped, measure = measured(load, {"gpu": device.read})  # a plain reader is a probe
    assert measure(await wrapped()) == {"gpu": 0}


def test_measured_wraps_a_plain_loader_as_a_plain_loader() -> None:
    ram, gpu = Memory(), Memory()

    def load() -> list[int]:
        ram.free -= 10
        gpu.free -= 300
        return [1, 2]

    wrapped, measure = measured(load, {"ram": Probe(ram.read), "cuda:0": Probe(gpu.read)})
    value = wrapped()
    assert value == [1, 2]
    assert measure(value) == {"ram": 10, "cuda:0": 300}


@pytest.mark.anyio
async def test_measured_waits_for_the_awaitable_a_plain_loader_returns() -> None:
    device = Memory()

    async def really_load() -> str:
        device.free -= 77
        return "model"

    def load() -> Coroutine[Any, Any, str]:  # a plain loader handing back a coroutine
        return really_load()

    wrapped, measure = measured(load, {"gpu": device.read})
    pending = wrapped()
    assert device.reads == 1  # the second reading waits for the coroutine
    value = await pending
    assert device.reads == 2
    assert measure(value) == {"gpu": 77}


def test_one_pair_measures_several_loads_each_with_its_value() -> None:
    device = Memory()
    taken = iter([100, 2000])

    def load() -> object:
        device.free -= next(taken)
        return object()

    wrapped, measure = measured(load, {"gpu": device.read})
    first, second = wrapped(), wrapped()
    assert measure(second) == {"gpu": 2000}
    assert measure(first) == {"gpu": 100}
    with pytest.raises(InvalidArgument, match="did not return"):
        measure(first)  # each measurement is given once


def test_measure_of_a_value_its_loader_did_not_return_is_an_invalid_argument() -> None:
    _, measure = measured(lambda: "x", {"gpu": Memory().read})
    with pytest.raises(InvalidArgument, match="did not return"):
        measure("something else")


@pytest.mark.parametrize(
    ("load", "probes", "match"),
    [
        ("not callable", {"gpu": Memory().read}, "needs a loader"),
        (lambda: 1, {}, "mapping of space name to Probe"),
        (lambda: 1, [Memory().read], "mapping of space name to Probe"),
        (lambda: 1, {"gpu": 3}, "callable"),
        (lambda: 1, {0: Memory().read}, "space names are strings"),
    ],
)
def test_measured_checks_its_arguments(load: Any, probes: Any, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        measured(load, probes)


class Dropper:
    def __init__(self, device: Memory, sizes: dict[str, int]) -> None:
        self.device = device
        self.sizes = sizes

    async def release(self, key: str, value: str) -> None:
        self.device.free += self.sizes.pop(key)


@pytest.mark.anyio
async def test_a_broker_corrects_a_declared_size_to_the_measured_one(kind: str) -> None:
    device = Memory(total=100_000)
    loaded: dict[str, int] = {}

    def loader(key: str, size: int) -> Callable[[], Any]:
        async def load() -> str:
            device.free -= size
            loaded[key] = size
            return key

        return load

    async with open_broker(kind, budget={"cuda:0": 10_000}) as broker:
        async with broker.cache("plugin", Dropper(device, loaded)) as cache:
            load, measure = measured(loader("a", 3_000), {"cuda:0": device.read})
            async with cache.acquire("a", load=load, size={"cuda:0": 1_000}, measure=measure):
                assert (await broker.stats()).used == {"cuda:0": 3_000}
            load, measure = measured(loader("b", 8_000), {"cuda:0": device.read})
            async with cache.acquire("b", load=load, size={"cuda:0": 8_000}, measure=measure):
                pass  # a (3,000 measured) was released to make room
            assert "a" not in loaded
            await anyio.lowlevel.checkpoint()
        assert broker.export_sizes()["plugin"] == {"a": {"cuda:0": 3_000}, "b": {"cuda:0": 8_000}}


@pytest.mark.anyio
async def test_a_plain_measured_loader_runs_in_a_worker_thread(kind: str) -> None:
    device = Memory()
    threads: list[bool] = []

    def load() -> str:
        import threading

        threads.append(threading.current_thread() is threading.main_thread())
        device.free -= 64
        return "model"

    async def release(key: str, value: str) -> None:
        pass

    wrapped, measure = measured(load, {"ram": device.read})
    async with open_broker(kind, budget={"ram": 1_000}) as broker:
        async with broker.cache("plugin", release) as cache:
            async with cache.acquire("k", load=wrapped, measure=measure) as lease:
                assert lease.value == "model"
        assert broker.export_sizes()["plugin"] == {"k": {"ram": 64}}
    assert threads == [False]
