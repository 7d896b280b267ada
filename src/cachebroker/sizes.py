"""Sizes from files and frameworks: what a model weighs, before it loads and after.

Three helpers for ``cache.acquire(key, load=..., size=..., measure=...)``:

- ``weights_bytes(path)`` reads a checkpoint's size from disk, before the load,
  for ``size=``: safetensors and GGUF files from their headers (the tensors'
  bytes, not the file's), other weight files by their size, a directory as its
  checkpoint (shards once, one format when it holds several).
- ``torch_bytes(module)`` weighs a loaded ``torch.nn.Module`` per device, for
  ``measure=``: ``{"cuda:0": ..., "ram": ...}``.
- ``measured(load, probes)`` wraps a loader so that ``measure=`` gets what the
  load took on each device, read by probes before and after it, for anything
  neither can weigh.

It reads headers with the standard library alone: importing it imports
neither torch, nor safetensors, nor gguf, nor numpy. See docs/memory.md
("Sizes from files and frameworks").
"""

from __future__ import annotations

import fnmatch
import inspect
import json
import math
import os
import struct
from collections.abc import Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any, TypeVar, cast

from ._errors import InvalidArgument
from ._shell._config import is_async_callable as _is_async_callable
from .probes import Probe

__all__ = ["measured", "torch_bytes", "weights_bytes"]

L = TypeVar("L", bound=Callable[[], object])

# --------------------------------------------------------------- formats

#: Weight formats in order of preference, with their suffixes. A directory that
#: holds one checkpoint in several formats (many Hugging Face repositories keep
#: ``model.safetensors`` beside ``pytorch_model.bin``, ``tf_model.h5`` and
#: ``flax_model.msgpack``) is counted in the first format it holds.
_FORMATS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("safetensors", (".safetensors",)),
    ("gguf", (".gguf",)),
    ("pytorch", (".bin", ".pt", ".pth", ".ckpt")),
    ("onnx", (".onnx",)),
    ("keras", (".h5",)),
    ("flax", (".msgpack",)),
    ("tensorflow", (".pb",)),
)
_RANK = {suffix: rank for rank, (_, suffixes) in enumerate(_FORMATS) for suffix in suffixes}
#: The rank of a file that only a ``pattern`` selects (its size is what counts).
_OTHER = len(_FORMATS)
_INDEX = ".index.json"  # model.safetensors.index.json, pytorch_model.bin.index.json

#: safetensors dtype -> bits per element (the safetensors crate's ``Dtype::bitsize``).
_SAFETENSORS_BITS = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}
#: The largest header the safetensors library accepts: a bigger one is corrupt.
_SAFETENSORS_MAX_HEADER = 100_000_000

#: ggml type number -> (name, elements per block, bytes per block), as the gguf
#: package's ``GGML_QUANT_SIZES`` (gguf 0.19) has them: the package is not
#: needed at run time.
_GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
    40: ("NVFP4", 64, 36),
    41: ("Q1_0", 128, 18),
}
_GGUF_MAGIC = b"GGUF"
_GGUF_VERSIONS = (2, 3)
_GGUF_ALIGNMENT = 32  # unless the metadata's general.alignment says otherwise
_GGUF_MAX_DIMS = 4  # GGML_MAX_DIMS
_GGUF_MAX_NESTING = 8  # arrays of arrays: deeper is a corrupt file
#: GGUF metadata value type -> struct format of a scalar of that type.
_GGUF_SCALARS = {
    0: "B",  # UINT8
    1: "b",  # INT8
    2: "H",  # UINT16
    3: "h",  # INT16
    4: "I",  # UINT32
    5: "i",  # INT32
    6: "f",  # FLOAT32
    7: "?",  # BOOL
    10: "Q",  # UINT64
    11: "q",  # INT64
    12: "d",  # FLOAT64
}
_GGUF_STRING, _GGUF_ARRAY, _GGUF_UINT32 = 8, 9, 4


# ---------------------------------------------------------- weights_bytes


def weights_bytes(path: str | os.PathLike[str], *, pattern: str | None = None) -> int:
    """Return the bytes of the weights in a model file or directory.

    Give it to ``size=`` to reserve a model's memory before it loads.

    - A ``.safetensors`` file: the bytes of its tensors, from its header (each
      tensor's ``data_offsets``, checked against its dtype and shape).
    - A ``.gguf`` file: the bytes of its tensors, from its header's tensor
      infos and each ggml type's block size (quantized types included).
    - A ``.bin``, ``.pt``, ``.pth``, ``.ckpt``, ``.onnx``, ``.h5``,
      ``.msgpack`` or ``.pb`` file, or any other file named: its size.
    - A ``*.index.json`` file of a sharded checkpoint: its shards' bytes.
    - A directory: its checkpoint, searched recursively (hidden entries
      skipped, symbolic links followed, each real file counted once). Only
      one format counts: the first present of safetensors, GGUF, PyTorch
      (``.bin``, ``.pt``, ``.pth``, ``.ckpt``), ONNX, Keras (``.h5``), Flax
      (``.msgpack``), TensorFlow (``.pb``). Index files are metadata, never
      counted; without ``pattern``, a directory holding an index counts the
      shards it lists (all present) and not other files of that format.

    Args:
        path: A file or a directory.
        pattern: In a directory, which files are weights: a glob matched
            against each file's path below ``path`` and against its name
            (``"*.safetensors"``, ``"model-Q4_K_M*.gguf"``). By default, every
            file with one of the suffixes above. Files that only the pattern
            selects count by their size. A file given as ``path`` must match it.

    Raises:
        InvalidArgument: ``path`` does not exist or cannot be read, a directory
            holds no weight file (matching ``pattern``), a header is corrupt or
            truncated, or an index lists a shard that is missing. The message
            names the file.
    """
    root = Path(os.fspath(path))
    try:
        is_dir = root.is_dir()
        exists = is_dir or root.exists()
    except OSError as exc:  # a path too long, a loop of links
        raise InvalidArgument(f"{root}: cannot be read: {exc}") from None
    if not exists:
        what = "is a broken symbolic link" if root.is_symlink() else "does not exist"
        raise InvalidArgument(f"{root}: {what}")
    if is_dir:
        return _directory_bytes(root, pattern)
    if pattern is not None and not fnmatch.fnmatchcase(root.name, pattern):
        raise InvalidArgument(f"{root}: does not match pattern {pattern!r}")
    if root.name.endswith(_INDEX):
        return _sum_once(_index_shards(root))
    return _file_bytes(root)


def _file_bytes(path: Path) -> int:
    """The weight bytes of one file, by its name's suffix."""
    suffix = path.suffix.lower()
    try:
        if suffix == ".safetensors":
            return _safetensors_bytes(path)
        if suffix == ".gguf":
            return _gguf_bytes(path)
        return path.stat().st_size
    except OSError as exc:
        raise InvalidArgument(f"{path}: cannot be read: {exc}") from None


def _sum_once(files: list[Path]) -> int:
    """The bytes of ``files``, each real file once (links and their targets are one file)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for file in files:
        identity = _identity(file)
        if identity not in seen:
            seen.add(identity)
            total += _file_bytes(file)
    return total


def _directory_bytes(root: Path, pattern: str | None) -> int:
    by_rank: dict[int, list[Path]] = {}
    indexes: list[Path] = []
    for file in _walk(root):
        if file.name.endswith(_INDEX):
            indexes.append(file)
        elif _selected(root, file, pattern):
            by_rank.setdefault(_rank(file.name), []).append(file)
    if not by_rank:
        which = "no weight file" if pattern is None else f"no file matching {pattern!r}"
        raise InvalidArgument(f"{root}: {which} in this directory")
    rank = min(by_rank)
    files = by_rank[rank]
    if pattern is None:
        files = _as_indexed(files, [i for i in indexes if _rank(i.name[: -len(_INDEX)]) == rank])
    return _sum_once(files)


def _walk(root: Path) -> Iterator[Path]:
    """Every file below ``root``, following links to directories once, hidden entries skipped."""
    seen: set[str] = set()

    def fail(error: OSError) -> None:
        raise InvalidArgument(f"{error.filename or root}: cannot be read: {error}") from None

    for directory, subdirectories, names in os.walk(root, onerror=fail, followlinks=True):
        real = os.path.realpath(directory)
        if real in seen:  # a link back up the tree, or a second link to one directory
            subdirectories.clear()
            continue
        seen.add(real)
        subdirectories[:] = sorted(d for d in subdirectories if not d.startswith("."))
        for name in sorted(names):
            if not name.startswith("."):
                yield Path(directory, name)


def _selected(root: Path, file: Path, pattern: str | None) -> bool:
    if pattern is None:
        return _rank(file.name) < _OTHER
    below = file.relative_to(root).as_posix()
    return fnmatch.fnmatchcase(below, pattern) or fnmatch.fnmatchcase(file.name, pattern)


def _rank(name: str) -> int:
    return _RANK.get(os.path.splitext(name)[1].lower(), _OTHER)


def _as_indexed(files: list[Path], indexes: list[Path]) -> list[Path]:
    """``files``, where each directory holding an index keeps only the shards it lists."""
    if not indexes:
        return files
    listed: set[tuple[int, int]] = set()
    for index in indexes:
        listed.update(_identity(shard) for shard in _index_shards(index))
    indexed = {index.parent for index in indexes}
    return [f for f in files if f.parent not in indexed or _identity(f) in listed]


def _identity(file: Path) -> tuple[int, int]:
    """What makes two paths one file: links, and links to links, name their target."""
    try:
        status = file.stat()
    except OSError as exc:
        raise InvalidArgument(f"{file}: cannot be read: {exc}") from None
    return status.st_dev, status.st_ino


def _index_shards(index: Path) -> list[Path]:
    """The shard files a sharded checkpoint's index lists in its ``weight_map``, checked present."""
    try:
        document = json.loads(index.read_bytes())
    except OSError as exc:
        raise InvalidArgument(f"{index}: cannot be read: {exc}") from None
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
        raise InvalidArgument(f"{index}: not a JSON index of shards: {exc}") from None
    weight_map = document.get("weight_map") if isinstance(document, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(shard, str) and shard for shard in weight_map.values()
    ):
        raise InvalidArgument(
            f"{index}: an index of shards needs a 'weight_map' of tensor names to shard files"
        )
    shards = []
    for name in sorted(set(weight_map.values())):
        shard = index.parent / name
        if not shard.is_file():
            raise InvalidArgument(f"{index}: lists shard {name!r}, but {shard} is missing")
        shards.append(shard)
    return shards


# ----------------------------------------------------------- safetensors


def _safetensors_bytes(path: Path) -> int:
    """The tensors' bytes of a safetensors file: its 8-byte length, then its JSON header."""
    with path.open("rb") as file:
        size = os.fstat(file.fileno()).st_size
        head = file.read(8)
        if len(head) < 8:
            raise InvalidArgument(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (length,) = struct.unpack("<Q", head)
        if length > size - 8:
            raise InvalidArgument(
                f"{path}: truncated or corrupt safetensors file: its header claims "
                f"{length} bytes, the file has {size - 8} after the length"
            )
        if length > _SAFETENSORS_MAX_HEADER:
            raise InvalidArgument(f"{path}: corrupt safetensors header: {length} bytes long")
        raw = file.read(length)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
        raise InvalidArgument(f"{path}: corrupt safetensors header: {exc}") from None
    if not isinstance(header, dict):
        raise InvalidArgument(f"{path}: corrupt safetensors header: not a JSON object")
    data = size - 8 - length
    return sum(
        _safetensors_tensor(path, name, info, data)
        for name, info in header.items()
        if name != "__metadata__"
    )


def _safetensors_tensor(path: Path, name: str, info: object, data: int) -> int:
    """One tensor's bytes, ``end - start`` of its data offsets, checked against dtype x shape."""
    where = f"{path}: corrupt safetensors header: tensor {name!r}"
    if not isinstance(info, dict):
        raise InvalidArgument(f"{where} is not described by an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str):
        raise InvalidArgument(f"{where} has no dtype")
    if not isinstance(shape, list) or not all(_is_count(n) for n in shape):
        raise InvalidArgument(f"{where} has shape {shape!r}, not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))):
        raise InvalidArgument(f"{where} has data_offsets {offsets!r}, not [start, end]")
    start, end = offsets
    if start > end:
        raise InvalidArgument(f"{where} has data_offsets {offsets!r}: its end precedes its start")
    if end > data:
        raise InvalidArgument(
            f"{path}: truncated safetensors file: tensor {name!r} ends at byte {end} "
            f"of the data, which has {data}"
        )
    bits = _SAFETENSORS_BITS.get(dtype)
    # A dtype newer than this table is trusted to its offsets.
    if bits is not None and math.prod(shape) * bits != (end - start) * 8:
        whole, eighths = divmod(math.prod(shape) * bits, 8)
        expected = f"{whole:,}" if not eighths else f"{whole + eighths / 8:,}"
        raise InvalidArgument(
            f"{where}: {dtype} x {shape} is {expected} bytes, "
            f"but its data_offsets span {end - start:,}"
        )
    return int(end - start)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# ------------------------------------------------------------------ GGUF


class _Header:
    """Reads a binary header field by field, never past the file's end.

    Reads go through the file's buffer, so a header is read incrementally, and
    a multi-GB file costs only its header. A short read is a truncated file.
    """

    def __init__(self, file: IO[bytes], path: Path, size: int) -> None:
        self.file = file
        self.path = path
        self.size = size
        self.order = "<"

    def take(self, count: int) -> bytes:
        data = self.file.read(count)
        if len(data) < count:
            raise self.truncated()
        return data

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        layout = struct.Struct(self.order + fmt)
        return layout.unpack(self.take(layout.size))

    def skip(self, count: int) -> None:
        if count > self.size - self.file.tell():
            raise self.truncated()
        self.file.seek(count, os.SEEK_CUR)

    def string(self) -> bytes:
        (length,) = self.unpack("Q")
        if length > self.size - self.file.tell():
            raise self.truncated()
        return self.take(length)

    def truncated(self) -> InvalidArgument:
        return InvalidArgument(
            f"{self.path}: truncated GGUF file: its header goes past the end "
            f"of the file ({self.size} bytes)"
        )

    def corrupt(self, what: str) -> InvalidArgument:
        return InvalidArgument(f"{self.path}: corrupt GGUF header: {what}")


def _gguf_bytes(path: Path) -> int:
    """The tensors' bytes of a GGUF file (version 2 or 3), from its tensor infos."""
    with path.open("rb") as file:
        header = _Header(file, path, os.fstat(file.fileno()).st_size)
        magic = header.take(4)
        if magic != _GGUF_MAGIC:
            raise header.corrupt(f"not a GGUF file (it starts with {magic!r}, not b'GGUF')")
        (version,) = header.unpack("I")
        if version not in _GGUF_VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            if swapped not in _GGUF_VERSIONS:
                raise InvalidArgument(
                    f"{path}: GGUF version {version} is not supported (versions 2 and 3 are)"
                )
            header.order = ">"  # a big-endian file
        tensors, pairs = header.unpack("QQ")
        alignment = _gguf_alignment(header, pairs)
        total = end = 0
        for _ in range(tensors):
            nbytes, offset = _gguf_tensor(header)
            total += nbytes
            end = max(end, offset + nbytes)
        start = -(-file.tell() // alignment) * alignment
        if start + end > header.size:
            raise InvalidArgument(
                f"{path}: truncated GGUF file: its tensor data ends at byte "
                f"{start + end}, the file has {header.size}"
            )
        return total


def _gguf_alignment(header: _Header, pairs: int) -> int:
    """Skip the metadata's key-value pairs; return the data's alignment it sets."""
    alignment = _GGUF_ALIGNMENT
    for _ in range(pairs):
        key = header.string()
        (kind,) = header.unpack("I")
        if key == b"general.alignment" and kind == _GGUF_UINT32:
            (alignment,) = header.unpack("I")
            if alignment == 0 or alignment & (alignment - 1):
                raise header.corrupt(f"general.alignment is {alignment}, not a power of two")
        else:
            _gguf_skip_value(header, kind, 0)
    return alignment


def _gguf_skip_value(header: _Header, kind: int, depth: int) -> None:
    scalar = _GGUF_SCALARS.get(kind)
    if scalar is not None:
        header.skip(struct.calcsize(scalar))
    elif kind == _GGUF_STRING:
        (length,) = header.unpack("Q")
        header.skip(length)
    elif kind == _GGUF_ARRAY:
        if depth >= _GGUF_MAX_NESTING:
            raise header.corrupt(f"arrays nested more than {_GGUF_MAX_NESTING} deep")
        item, count = header.unpack("IQ")
        scalar = _GGUF_SCALARS.get(item)
        if scalar is not None:
            header.skip(count * struct.calcsize(scalar))
        else:
            for _ in range(count):
                _gguf_skip_value(header, item, depth + 1)
    else:
        raise header.corrupt(f"unknown metadata value type {kind}")


def _gguf_tensor(header: _Header) -> tuple[int, int]:
    """Read one tensor info; return its bytes and its offset in the data."""
    name = header.string().decode("utf-8", "replace")
    (dims,) = header.unpack("I")
    if dims > _GGUF_MAX_DIMS:
        raise header.corrupt(f"tensor {name!r} has {dims} dimensions (ggml allows 4)")
    shape = header.unpack(f"{dims}Q")
    kind, offset = header.unpack("IQ")
    known = _GGML_TYPES.get(kind)
    if known is None:
        raise InvalidArgument(
            f"{header.path}: tensor {name!r} has ggml type {kind}, "
            "which cachebroker does not know the size of"
        )
    type_name, block, block_bytes = known
    if shape and shape[0] % block:
        raise header.corrupt(
            f"tensor {name!r} has rows of {shape[0]} elements, "
            f"not a multiple of {type_name}'s block of {block}"
        )
    return math.prod(shape) // block * block_bytes, offset


# ------------------------------------------------------------ torch_bytes


def torch_bytes(module: object) -> dict[str, int]:
    """Return the bytes of a ``torch.nn.Module``'s parameters and buffers, per device.

    Give it to ``measure=`` (``measure=torch_bytes``) to correct a load's
    declared size with what the loaded module holds. Devices are named as the
    broker's spaces: ``"ram"`` for the CPU, ``"cuda:0"``, ``"cuda:1"``, ...,
    other device types by their torch name and index (``"xpu:0"``, ``"mps:0"``),
    or by their type alone when a tensor's device has no index. ``meta`` tensors
    hold no memory and are skipped.

    Each storage counts once, with all of its bytes: tied parameters (one
    tensor in two modules, or views of one storage) are not counted twice, and a
    parameter that is a view of a larger storage counts that storage. Tensors
    without a storage (wrapper subclasses) count ``numel() * element_size()``.

    Torch is not imported: any object with ``parameters()`` and ``buffers()``
    (or ``named_parameters()`` and ``named_buffers()``) yielding tensors will
    do, a tensor being anything with ``device`` (``.type``, ``.index``),
    ``numel()`` and ``element_size()``, and optionally ``untyped_storage()``.

    Raises:
        TypeError: ``module`` has no parameters, or yields something that is
            not a tensor.
    """
    charge: dict[str, int] = {}
    storages: set[tuple[str, int]] = set()
    for tensor in _module_tensors(module):
        space = _space(tensor)
        if space is None:
            continue
        nbytes, pointer = _tensor_bytes(tensor)
        if pointer is not None:
            if (space, pointer) in storages:
                continue
            storages.add((space, pointer))
        charge[space] = charge.get(space, 0) + nbytes
    return charge


def _module_tensors(module: object) -> Iterator[Any]:
    """The module's parameters, then its buffers, each object once."""
    parameters = _tensors(module, "parameters")
    if parameters is None:
        raise TypeError(
            "torch_bytes needs a torch.nn.Module (an object with parameters() and "
            f"buffers()), got {type(module).__name__} {_short(module)}"
        )
    seen: set[int] = set()
    for tensor in (*parameters, *(_tensors(module, "buffers") or ())):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            yield tensor


def _tensors(module: object, kind: str) -> list[Any] | None:
    plain = getattr(module, kind, None)
    if callable(plain):
        return list(plain())
    named = getattr(module, f"named_{kind}", None)
    if callable(named):
        return [tensor for _, tensor in named()]
    return None


def _space(tensor: object) -> str | None:
    """The broker's name for the space a tensor's memory is in; ``None`` for ``meta``."""
    device = getattr(tensor, "device", None)
    kind = getattr(device, "type", None)
    if not isinstance(kind, str):
        raise TypeError(
            "torch_bytes expects tensors with a device (.type, .index), "
            f"got {type(tensor).__name__} {_short(tensor)}"
        )
    if kind == "meta":
        return None
    if kind == "cpu":
        return "ram"
    index = getattr(device, "index", None)
    return kind if index is None else f"{kind}:{index}"


def _tensor_bytes(tensor: Any) -> tuple[int, int | None]:
    """The bytes of a tensor's storage and its address, else its elements' bytes and None."""
    storage_of = getattr(tensor, "untyped_storage", None)
    if callable(storage_of):
        try:
            storage = storage_of()
            return int(storage.nbytes()), int(storage.data_ptr())
        except Exception:  # a wrapper subclass without storage; weighed by its elements
            pass
    try:
        return int(tensor.numel()) * int(tensor.element_size()), None
    except AttributeError:
        raise TypeError(
            "torch_bytes expects tensors with numel() and element_size(), "
            f"got {type(tensor).__name__} {_short(tensor)}"
        ) from None


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# --------------------------------------------------------------- measured


def measured(
    load: L, probes: Mapping[str, Probe | Callable[[], tuple[int, int]]]
) -> tuple[L, Callable[[object], dict[str, int]]]:
    """Wrap ``load`` to measure what it took on devices; return the loader and its ``measure``.

    For values that neither ``weights_bytes`` nor ``torch_bytes`` can weigh::

        load, measure = measured(load_model, {"cuda:0": NvidiaGPU(0)})
        async with cache.acquire(key, load=load, size={"cuda:0": estimate}, measure=measure):
            ...

    The loader reads each probe's free memory just before ``load`` runs and
    just after it returns; ``measure(value)`` then gives, per space, the free
    bytes the load took (``before - after``, never below 0), and the broker
    corrects the declared size to it. The loader is async when ``load`` is
    (it then runs in the cache's task group), plain otherwise (it then runs in
    a worker thread, probes included; an awaitable ``load`` returns is awaited
    before the second reading).

    The difference counts whatever else changed the device's free memory
    during the load (other loads, other processes, the first use of a device's
    context, an allocator's cache), so it is a correction, not an exact size:
    give a declared ``size`` too where you have one. The measured size replaces
    the whole declared one, so name every space the value occupies.

    Args:
        load: The loader, as for ``cache.acquire(load=...)``.
        probes: Space name -> a ``Probe`` (``cachebroker.probes``) or a
            callable returning ``(total, free)`` bytes.

    Returns:
        ``(load, measure)``: give both to one ``cache.acquire``. One pair may
        serve several acquires, concurrently too: each measurement is kept
        with the value its load returned until ``measure`` is called with it.

    Raises:
        TypeError: ``load`` is not callable, or a probe is neither a ``Probe``
            nor a callable.
        InvalidArgument: ``measure`` is called with a value its loader did not
            return (when the broker calls it, the load fails with that error).
    """
    if not callable(load):
        raise TypeError(f"measured() needs a loader, a callable taking no argument, got {load!r}")
    readers = _probes(probes)
    taken: dict[int, list[dict[str, int]]] = {}

    def free() -> dict[str, int]:
        return {space: probe.read()[1] for space, probe in readers.items()}

    def record(value: object, before: dict[str, int]) -> None:
        after = free()
        delta = {space: max(0, before[space] - after[space]) for space in readers}
        taken.setdefault(id(value), []).append(delta)

    async def finish(awaitable: Awaitable[object], before: dict[str, int]) -> object:
        value = await awaitable
        record(value, before)
        return value

    if _is_async_callable(load):

        async def load_measured() -> object:
            before = free()
            value = await cast(Callable[[], Awaitable[object]], load)()
            record(value, before)
            return value

        wrapped: Callable[[], object] = load_measured
    else:

        def load_plain() -> object:
            before = free()
            value = load()
            if inspect.isawaitable(value):
                return finish(value, before)
            record(value, before)
            return value

        wrapped = load_plain

    def measure(value: object) -> dict[str, int]:
        deltas = taken.get(id(value))
        if not deltas:
            raise InvalidArgument(
                f"measure() was given {_short(value)}, which its measured loader did not return"
            )
        delta = deltas.pop(0)
        if not deltas:
            del taken[id(value)]
        return delta

    return cast(L, wrapped), measure


def _probes(probes: object) -> dict[str, Probe]:
    if not isinstance(probes, Mapping) or not probes:
        raise TypeError(
            "measured() needs probes as a mapping of space name to Probe, "
            f"such as {{'cuda:0': NvidiaGPU(0)}}, got {probes!r}"
        )
    readers: dict[str, Probe] = {}
    for space, probe in probes.items():
        if not isinstance(space, str):
            raise TypeError(f"space names are strings, got {space!r}")
        readers[space] = probe if isinstance(probe, Probe) else Probe(probe, name=space)
    return readers
