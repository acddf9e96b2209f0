"""Read a GGUF header, refusing corrupt counts and lengths before anything is allocated.

The `gguf` package trusts the header: a string length of 2**60 or an array count of 10**15 makes
it build huge numpy views or loop for ever; and it builds a numpy view per array entry, which
for a 262,144-token vocabulary takes seconds. `prescan` walks the layout with `struct` reads
over a read-only memory map, checks every count and length against the bytes left in the file
*before* using it, and returns the metadata as plain Python values (arrays of numbers in one
`numpy.frombuffer` each) with the tensor table, so the worst a corrupt file costs is one pass
over its header.

Layout (GGUF v2/v3, all integers little-endian unless the file is byte-swapped):
    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv x      (string key, u32 value_type, value)
    n_tensors x (string name, u32 n_dims, u64 ne[n_dims], u32 ggml_type, u64 offset)
    padding to `general.alignment` (default 32) | tensor data
    string = u64 length + bytes;  array value = u32 item_type + u64 count + count x item
A tensor's bytes are prod(ne) / block_size * type_size, and its data lives at
data_start + offset, where data_start is the header end rounded up to the alignment.
"""

from __future__ import annotations

import enum
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES

from service.errors import ModelFormatError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4                     # GGML_MAX_DIMS
MAX_ARRAY_NESTING = 8            # arrays of arrays deeper than this are refused (no real use)
INT64_MAX = (1 << 63) - 1

# ggml type id -> (elements per block, bytes per block), keyed by plain int for lookups.
QUANT_SIZES: dict[int, tuple[int, int]] = {int(t): s for t, s in GGML_QUANT_SIZES.items()}
QUANT_NAMES: dict[int, str] = {int(t): t.name for t in GGML_QUANT_SIZES}


class ValueType(enum.IntEnum):
    """GGUF metadata value types (gguf spec, `gguf_type`)."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


# struct codes of the fixed-size scalar types
SCALAR_CODES: dict[ValueType, str] = {
    ValueType.UINT8: "B", ValueType.INT8: "b", ValueType.UINT16: "H", ValueType.INT16: "h",
    ValueType.UINT32: "I", ValueType.INT32: "i", ValueType.FLOAT32: "f", ValueType.BOOL: "?",
    ValueType.UINT64: "Q", ValueType.INT64: "q", ValueType.FLOAT64: "d",
}
SCALAR_SIZES: dict[ValueType, int] = {t: struct.calcsize(c) for t, c in SCALAR_CODES.items()}
# The fewest bytes one value of a type can take: a string is at least its u64 length, an array at
# least its u32 item type and u64 count. Used to bound counts before looping over them.
MIN_VALUE_SIZE: dict[ValueType, int] = {
    **SCALAR_SIZES, ValueType.STRING: 8, ValueType.ARRAY: 12,
}
MIN_KV_SIZE = 8 + 4 + 1          # empty key, value type, smallest value
MIN_TENSOR_INFO_SIZE = 8 + 4 + 4 + 8   # empty name, n_dims = 0, type, offset


@dataclass(frozen=True)
class TensorEntry:
    """One tensor info as stored: dims in ggml order (innermost first)."""

    name: str
    type_id: int
    dims: tuple[int, ...]
    offset: int              # bytes from the start of the data section
    n_bytes: int


@dataclass(frozen=True)
class Header:
    """What the header says, checked: metadata values and where each tensor's bytes are."""

    version: int
    byte_order: str          # "<" or ">" (a file written on a big-endian host)
    alignment: int
    metadata: dict[str, Any]  # str, int, float, bool, or (nested) lists of them
    tensors: tuple[TensorEntry, ...]
    data_start: int          # file offset of the data section
    file_size: int
    # key -> (value type,) or (ARRAY, item type): what a copy needs to write the same types
    value_types: dict[str, tuple[ValueType, ...]] = field(default_factory=dict)


class _Scanner:
    """A cursor over the mapped file; every read is checked against the bytes left first."""

    def __init__(self, path: Path, buf: mmap.mmap | bytes, size: int):
        self.path = path
        self.buf = buf
        self.size = size
        self.pos = 0
        self.order = "<"

    def fail(self, message: str) -> ModelFormatError:
        return ModelFormatError(f"{self.path}: {message}")

    @property
    def left(self) -> int:
        return self.size - self.pos

    def need(self, n: int, what: str) -> None:
        if n > self.left:
            raise self.fail(f"truncated: {what} needs {n} bytes at offset {self.pos} but only "
                            f"{self.left} bytes are left in the file ({self.size} bytes)")

    def unpack(self, code: str, what: str) -> int | float | bool:
        n = struct.calcsize(code)
        self.need(n, what)
        (value,) = struct.unpack_from(self.order + code, self.buf, self.pos)
        self.pos += n
        return value

    def u32(self, what: str) -> int:
        return int(self.unpack("I", what))

    def u64(self, what: str) -> int:
        return int(self.unpack("Q", what))

    def skip_string(self, what: str) -> int:
        """Skip a length-prefixed string; returns its length."""
        length = self.u64(f"{what} string length")
        if length > self.left:
            raise self.fail(f"{what} string length {length} exceeds the {self.left} bytes "
                            f"left in the file")
        self.pos += length
        return length

    def read_string(self, what: str) -> str:
        start = self.pos + 8
        length = self.skip_string(what)
        raw = bytes(self.buf[start:start + length])
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"{what} is not valid UTF-8 ({exc.reason} at byte "
                            f"{start + exc.start})") from None

    def check_count(self, count: int, item_size: int, what: str) -> None:
        """Refuse `count` items of at least `item_size` bytes that cannot fit in what is left."""
        if count * item_size > self.left:
            raise self.fail(f"{what} {count} needs at least {count * item_size} bytes but only "
                            f"{self.left} bytes are left in the file")

    def value_type(self, what: str) -> ValueType:
        raw = self.u32(f"{what} value type")
        try:
            return ValueType(raw)
        except ValueError:
            raise self.fail(f"{what} has unknown value type {raw}; known types: "
                            + ", ".join(f"{t.value} ({t.name})" for t in ValueType)) from None


# ---------------------------------------------------------------- metadata
def _read_value(sc: _Scanner, vtype: ValueType, what: str, depth: int = 0) -> Any:
    if vtype in SCALAR_SIZES:
        return sc.unpack(SCALAR_CODES[vtype], what)
    if vtype is ValueType.STRING:
        return sc.read_string(what)
    return _read_array(sc, what, depth)


def _read_array(sc: _Scanner, what: str, depth: int) -> list:
    if depth >= MAX_ARRAY_NESTING:
        raise sc.fail(f"{what} nests arrays more than {MAX_ARRAY_NESTING} levels deep")
    item_type = sc.value_type(f"{what} array item")
    count = sc.u64(f"{what} array count")
    sc.check_count(count, MIN_VALUE_SIZE[item_type], f"{what} array count")
    if item_type in SCALAR_SIZES:
        dtype = np.dtype(sc.order + SCALAR_CODES[item_type])
        values = np.frombuffer(sc.buf, dtype, count, sc.pos).tolist()
        sc.pos += count * SCALAR_SIZES[item_type]
        return values
    if item_type is ValueType.STRING:
        return _read_strings(sc, what, count)
    return [_read_array(sc, f"{what}[{i}]", depth + 1) for i in range(count)]


def _read_strings(sc: _Scanner, what: str, count: int) -> list[str]:
    # the hot loop: a vocabulary holds up to a few hundred thousand strings
    unpack_from, buf, order = struct.unpack_from, sc.buf, sc.order + "Q"
    pos, size = sc.pos, sc.size
    out: list[str] = []
    append = out.append
    for i in range(count):
        if pos + 8 > size:
            sc.pos = pos
            sc.need(8, f"{what}[{i}] string length")
        (length,) = unpack_from(order, buf, pos)
        pos += 8
        if length > size - pos:
            raise sc.fail(f"{what}[{i}] string length {length} exceeds the {size - pos} "
                          f"bytes left in the file")
        try:
            append(buf[pos:pos + length].decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise sc.fail(f"{what}[{i}] is not valid UTF-8 ({exc.reason} at byte "
                          f"{pos + exc.start})") from None
        pos += length
    sc.pos = pos
    return out


def _scan_metadata(sc: _Scanner, n_kv: int
                   ) -> tuple[dict[str, Any], int, dict[str, tuple[ValueType, ...]]]:
    """Read the key/value section; returns it, the data alignment the file asks for and each
    key's value type (with the item type of an array)."""
    alignment = DEFAULT_ALIGNMENT
    metadata: dict[str, Any] = {}
    types: dict[str, tuple[ValueType, ...]] = {}
    for i in range(n_kv):
        key = sc.read_string(f"metadata key #{i}")
        if key in metadata:
            raise sc.fail(f"metadata key {key!r} appears twice")
        what = f"metadata key {key!r}"
        vtype = sc.value_type(what)
        if key == "general.alignment":
            if vtype is not ValueType.UINT32:
                raise sc.fail(f"{what} has type {vtype.name}, expected UINT32")
            alignment = sc.u32(what)
            if alignment == 0 or alignment & (alignment - 1):
                raise sc.fail(f"{what} is {alignment}, expected a non-zero power of two")
            metadata[key] = alignment
        else:
            start = sc.pos
            metadata[key] = _read_value(sc, vtype, what)
            if vtype is ValueType.ARRAY:     # its item type was checked by _read_array
                (item,) = struct.unpack_from(sc.order + "I", sc.buf, start)
                types[key] = (vtype, ValueType(item))
                continue
        types[key] = (vtype,)
    return metadata, alignment, types


# ---------------------------------------------------------------- tensor infos
def _scan_tensor_info(sc: _Scanner, index: int) -> TensorEntry:
    """One tensor info (its offset is relative to the data start)."""
    name = sc.read_string(f"tensor #{index} name")
    what = f"tensor {name!r}"
    n_dims = sc.u32(f"{what} n_dims")
    if n_dims > MAX_DIMS:
        raise sc.fail(f"{what} has n_dims {n_dims}; at most {MAX_DIMS} are allowed")
    sc.need(8 * n_dims, f"{what} dimensions")
    dims = struct.unpack_from(f"{sc.order}{n_dims}Q", sc.buf, sc.pos)
    sc.pos += 8 * n_dims
    n_elements = 1
    for d in dims:
        # ggml keeps ne as int64: each dimension and their product must stay representable
        if d > INT64_MAX or n_elements * d > INT64_MAX:
            raise sc.fail(f"{what} dimensions {list(dims)} overflow int64")
        n_elements *= d
    type_id = sc.u32(f"{what} type")
    if type_id not in QUANT_SIZES:
        raise sc.fail(f"{what} has unknown ggml type {type_id}")
    block_size, type_size = QUANT_SIZES[type_id]
    if dims and dims[0] % block_size:
        raise sc.fail(f"{what} row length {dims[0]} is not a multiple of the "
                      f"{QUANT_NAMES[type_id]} block size {block_size}")
    offset = sc.u64(f"{what} offset")
    return TensorEntry(name, type_id, tuple(dims), offset, n_elements // block_size * type_size)


def _check_tensor_data(sc: _Scanner, tensors: list[TensorEntry],
                       data_start: int, alignment: int) -> None:
    for t in tensors:
        name, offset, n_bytes = t.name, t.offset, t.n_bytes
        if offset % alignment:
            raise sc.fail(f"tensor {name!r} data offset {offset} is not a multiple of the "
                          f"alignment {alignment}")
        start = data_start + offset
        end = start + n_bytes
        if start > sc.size:
            raise sc.fail(f"tensor {name!r} data offset {offset} starts at byte {start}, past "
                          f"the end of the file ({sc.size} bytes)")
        if end > sc.size:
            raise sc.fail(f"truncated: tensor {name!r} data ends at byte {end} past the end of "
                          f"the file ({sc.size} bytes)")


# ---------------------------------------------------------------- entry point
def _scan(sc: _Scanner) -> Header:
    sc.need(4, "magic")
    magic = bytes(sc.buf[0:4])
    if magic != GGUF_MAGIC:
        raise sc.fail(f"bad magic {magic!r}, expected {GGUF_MAGIC!r}: not a GGUF file")
    sc.pos = 4
    version = sc.u32("version")
    if version & 0xFFFF == 0 and version:
        # written on a host of the other byte order (as the gguf package detects it)
        sc.order = ">"
        version = int.from_bytes(version.to_bytes(4, "little"), "big")
    if version not in SUPPORTED_VERSIONS:
        raise sc.fail(f"unsupported GGUF version {version}; supported: "
                      + ", ".join(map(str, SUPPORTED_VERSIONS)))
    n_tensors = sc.u64("tensor count")
    n_kv = sc.u64("metadata key/value count")
    sc.check_count(n_kv, MIN_KV_SIZE, "metadata key/value count")
    sc.check_count(n_tensors, MIN_TENSOR_INFO_SIZE, "tensor count")
    metadata, alignment, value_types = _scan_metadata(sc, n_kv)
    sc.check_count(n_tensors, MIN_TENSOR_INFO_SIZE, "tensor count")
    tensors = []
    seen: set[str] = set()
    for i in range(n_tensors):
        info = _scan_tensor_info(sc, i)
        if info.name in seen:
            raise sc.fail(f"tensor {info.name!r} appears twice")
        seen.add(info.name)
        tensors.append(info)
    data_start = -(-sc.pos // alignment) * alignment
    _check_tensor_data(sc, tensors, data_start, alignment)
    return Header(version, sc.order, alignment, metadata, tuple(tensors), data_start, sc.size,
                  value_types)


def prescan(path: Path) -> Header:
    """Read and check the header; raise ModelFormatError before any count or length exceeds
    the file."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size == 0:
                raise ModelFormatError(f"{path}: the file is empty: not a GGUF file")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _scan(_Scanner(path, buf, size))
    except OSError as exc:
        raise ModelFormatError(f"{path}: cannot read the file ({exc})") from exc
