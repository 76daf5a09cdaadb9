"""The GGUF container, read with every length checked against the file before it is used.

Layout (GGUF v2/v3, little-endian): magic "GGUF", version u32, tensor count u64, metadata count u64; the metadata
(key string, value type u32, value); one record per tensor (name string, n_dims u32, dims u64 x n_dims innermost
first, type u32, offset u64); padding to `general.alignment` (default 32); then the tensor data, each tensor at
its offset. A string is a u64 length and its bytes; an array is an item type u32, a count u64 and the items.

Why not gguf.GGUFReader: it trusts every length. A short read past the end of its memory map is an empty array,
so an array that claims 2^62 items loops for minutes with memory growing, and it builds one numpy object per
array item even for honest files. Here a length is compared with the bytes left before anything is read or
allocated, scalar arrays are read in one numpy call, and the metadata arrays together may hold at most
MAX_ARRAY_ITEMS items. Time and memory are therefore bounded by the file size and those limits.

Tensors come back as gguf.ReaderTensor records (name, type, dims, byte count, and `data`, a read-only view of
the memory map in numpy order with quantised rows as bytes), which is what gguf.quants.dequantize expects.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf import GGUFValueType as VType

from ..errors import CheckpointError, UnsupportedCheckpointError, one_line

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
# All metadata arrays together; a real vocabulary (tokens, types, scores, merges) is well under a million items.
MAX_ARRAY_ITEMS = 1 << 22
_SCALARS: dict[VType, np.dtype] = {
    VType.UINT8: np.dtype("<u1"), VType.INT8: np.dtype("<i1"), VType.UINT16: np.dtype("<u2"),
    VType.INT16: np.dtype("<i2"), VType.UINT32: np.dtype("<u4"), VType.INT32: np.dtype("<i4"),
    VType.FLOAT32: np.dtype("<f4"), VType.BOOL: np.dtype("?"), VType.UINT64: np.dtype("<u8"),
    VType.INT64: np.dtype("<i8"), VType.FLOAT64: np.dtype("<f8"),
}
_STRUCTS = {fmt: struct.Struct(fmt) for fmt in ("<I", "<Q")}
# Numpy's view of each stored tensor type: plain types by element, every other type as raw bytes.
_ELEMENT_TYPES = {QType.F32: np.float32, QType.F16: np.float16, QType.F64: np.float64, QType.I8: np.int8,
                  QType.I16: np.int16, QType.I32: np.int32, QType.I64: np.int64}


@dataclass(frozen=True)
class GGUFFile:
    """A GGUF file's metadata (plain Python values: int, float, bool, str, lists) and tensor records."""

    path: Path
    metadata: dict[str, Any]
    tensors: list[gguf.ReaderTensor]


class _Corrupt(Exception):
    """A structural problem; read_gguf_file turns it into one CheckpointError naming the file."""


class _Cursor:
    """Reads forward through the memory map, refusing any read past its end. Reads go through a memoryview with
    struct (a vocabulary is ~10^5 strings, so per-read overhead is most of the parse)."""

    def __init__(self, data: np.ndarray) -> None:
        self.data, self.view, self.pos, self.items = data, memoryview(data), 0, 0

    def left(self) -> int:
        return len(self.data) - self.pos

    def take(self, size: int, what: str) -> memoryview:
        if size > self.left():
            raise _Corrupt(f"{what} needs {size} bytes at offset {self.pos}, but only {self.left()} are left")
        chunk = self.view[self.pos:self.pos + size]
        self.pos += size
        return chunk

    def unpack(self, fmt: str, what: str) -> int:
        return _STRUCTS[fmt].unpack(self.take(_STRUCTS[fmt].size, what))[0]

    def string(self, what: str) -> str:
        raw = self.take(self.unpack("<Q", f"the length of {what}"), what)
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError:
            raise _Corrupt(f"{what} is not UTF-8 text") from None

    def strings(self, count: int, what: str) -> list[str]:
        """`count` strings in a row, as `string` reads one: a vocabulary's ~10^5 tokens and merges in one loop with
        no method call per string (a third of a second less for a 49,152-token vocabulary)."""
        view, end, pos, out = self.view, len(self.data), self.pos, []
        length_at, append = _STRUCTS["<Q"].unpack_from, out.append
        try:
            for _ in range(count):
                if pos + 8 > end:
                    self.pos = pos
                    self.take(8, f"the length of {what}")  # raises, naming the offset
                start = pos + 8
                pos = start + length_at(view, pos)[0]
                if pos > end:
                    self.pos = start
                    self.take(pos - start, what)  # raises, naming the offset
                append(str(view[start:pos], "utf-8"))
        except UnicodeDecodeError:
            raise _Corrupt(f"{what} is not UTF-8 text") from None
        self.pos = pos
        return out

    def count_items(self, count: int, item_size: int, what: str) -> None:
        """Charge `count` array items of at least `item_size` bytes each against the file and MAX_ARRAY_ITEMS."""
        if count * item_size > self.left():
            raise _Corrupt(f"{what} claims {count} items, more than the {self.left()} bytes left in the file hold")
        self.items += count
        if self.items > MAX_ARRAY_ITEMS:
            raise _Corrupt(f"{what} brings the metadata arrays to {self.items} items, over minilade's limit "
                           f"of {MAX_ARRAY_ITEMS}")


def read_gguf_file(path: Path) -> GGUFFile:
    """Parse a GGUF file's header and locate its tensors (no tensor data is read). Raises CheckpointError naming
    the file for anything that does not fit: truncation, lengths past the end, unknown types, bad UTF-8."""
    try:
        data = np.memmap(path, mode="r") if path.stat().st_size else np.zeros(0, np.uint8)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path}: {one_line(exc)}") from exc
    try:
        return _parse(path, _Cursor(data))
    except _Corrupt as exc:
        raise CheckpointError(f"{path} is not a valid GGUF file (truncated or corrupt): {exc}") from None


def _parse(path: Path, cur: _Cursor) -> GGUFFile:
    if cur.left() < 4 or cur.take(4, "the magic").tobytes() != MAGIC:
        raise _Corrupt("it does not start with the GGUF magic bytes")
    version = cur.unpack("<I", "the version")
    if version not in VERSIONS:
        if version & 0xFFFF == 0:
            raise UnsupportedCheckpointError(f"{path}: big-endian GGUF files are not supported")
        raise _Corrupt(f"version {version} (minilade reads versions {', '.join(map(str, VERSIONS))})")
    n_tensors, n_fields = cur.unpack("<Q", "the tensor count"), cur.unpack("<Q", "the metadata count")
    # Smallest possible record: a metadata entry 13 bytes (empty key, type, one byte); a tensor record 24.
    if n_fields * 13 + n_tensors * 24 > cur.left():
        raise _Corrupt(f"{n_fields} metadata entries and {n_tensors} tensors cannot fit in {cur.left()} bytes")
    metadata: dict[str, Any] = {}
    for _ in range(n_fields):
        key = cur.string("a metadata key")
        if key in metadata:
            raise _Corrupt(f"metadata key {key!r} appears twice")
        metadata[key] = _value(cur, _value_type(cur.unpack("<I", key), key), key, depth=0)
    records = [_tensor_record(cur) for _ in range(n_tensors)]
    alignment = metadata.get("general.alignment", 32)
    if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
        raise _Corrupt(f"general.alignment = {alignment!r} is not a power of two")
    start = -(-cur.pos // alignment) * alignment
    return GGUFFile(path, metadata, _tensors(cur.data, records, start))


def _value_type(raw: int, key: str) -> VType:
    try:
        return VType(raw)
    except ValueError:
        raise _Corrupt(f"metadata {key!r} has unknown value type {raw}") from None


def _value(cur: _Cursor, kind: VType, key: str, depth: int) -> Any:
    """One metadata value as a plain Python value; arrays of scalars in one numpy read."""
    if kind in _SCALARS:
        dtype = _SCALARS[kind]
        return np.frombuffer(cur.take(dtype.itemsize, key).tobytes(), dtype)[0].item()
    if kind == VType.STRING:
        return cur.string(f"metadata {key!r}")
    if depth > 0:
        raise _Corrupt(f"metadata {key!r} nests arrays more than one level deep")
    item_kind = _value_type(cur.unpack("<I", key), key)
    count = cur.unpack("<Q", f"the length of {key!r}")
    if item_kind in _SCALARS:
        dtype = _SCALARS[item_kind]
        cur.count_items(count, dtype.itemsize, f"metadata {key!r}")
        return np.frombuffer(cur.take(count * dtype.itemsize, key).tobytes(), dtype).tolist()
    what = f"metadata {key!r}"
    cur.count_items(count, 8 if item_kind == VType.STRING else 12, what)
    if item_kind == VType.STRING:
        return cur.strings(count, what)
    return [_value(cur, item_kind, key, depth + 1) for _ in range(count)]


def _tensor_record(cur: _Cursor) -> tuple[str, tuple[int, ...], QType, int]:
    """(name, dims innermost first, type, offset from the data start) of one tensor record."""
    name = cur.string("a tensor name")
    n_dims = cur.unpack("<I", f"tensor {name}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise _Corrupt(f"tensor {name} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
    dims = tuple(cur.unpack("<Q", f"tensor {name}") for _ in range(n_dims))
    raw_type = cur.unpack("<I", f"tensor {name}")
    try:
        kind = QType(raw_type)
        gguf.GGML_QUANT_SIZES[kind]
    except (ValueError, KeyError):
        raise _Corrupt(f"tensor {name} has unknown type {raw_type}") from None
    return name, dims, kind, cur.unpack("<Q", f"tensor {name}")


def _tensors(data: np.ndarray, records: list[tuple[str, tuple[int, ...], QType, int]],
             start: int) -> list[gguf.ReaderTensor]:
    """Reader records whose data views lie inside the file, each checked before the view is made."""
    tensors, seen = [], set()
    for name, dims, kind, offset in records:
        if name in seen:
            raise _Corrupt(f"tensor {name} appears twice")
        seen.add(name)
        block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
        if dims[0] % block_size:
            raise _Corrupt(f"tensor {name} has rows of {dims[0]} values, not a multiple of {kind.name}'s "
                           f"block of {block_size}")
        n_elements = int(np.prod(dims, dtype=object))
        n_bytes = n_elements // block_size * type_size
        begin = start + offset
        if begin + n_bytes > len(data):
            raise _Corrupt(f"tensor {name} ({n_bytes} bytes at offset {begin}) extends past the end of the file "
                           f"({len(data)} bytes)")
        shape = tuple(reversed(dims))  # numpy order, outermost first
        element = _ELEMENT_TYPES.get(kind)
        if element is None:
            shape = (*shape[:-1], dims[0] // block_size * type_size)  # quantised rows as bytes
            element = np.uint8
        view = data[begin:begin + n_bytes].view(element).reshape(shape)
        tensors.append(gguf.ReaderTensor(name=name, tensor_type=kind, shape=np.array(dims, dtype=np.uint64),
                                         n_elements=n_elements, n_bytes=n_bytes, data_offset=begin, data=view,
                                         field=None))
    return tensors
