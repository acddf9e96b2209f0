"""Quant block specs: one registered class per GGML type, vectorized numpy dequantization.

Every type stores a tensor row as consecutive blocks of `block_size` elements packed into
`type_size` bytes. Each spec decodes a batch of blocks, (n_blocks, type_size) uint8, in three ways:

- `dequantize(raw)` -> (n_blocks, block_size) f32, bit-exact with `gguf.quants.dequantize`. The
  float operations happen in the same order as ggml's reference dequantizers (e.g. Q4_K computes
  `(d * sc) * q - (dmin * m)`, never `d * (sc * q)`), so every rounding step matches.
- `affine(raw)` -> `Affine(codes, scale, offset, group)` with value == scale[g] * code + offset[g]
  for each group g of `group` consecutive elements. This is the form the CPU backend repacks
  weights into: small integer codes plus one f32 scale and offset per group.
- `quantize_blocks(x)` (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) -> packed bytes, bit-exact
  with `gguf.quants.quantize`; used for the quantized KV cache and synthetic test models.

The module functions `dequantize`, `affine_rows` and `quantize` work on whole row-major tensors
and turn shape mistakes into `ModelFormatError`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from math import prod
from typing import NamedTuple

import numpy as np

from service.errors import ModelFormatError

QK_K = 256            # elements per super-block of the K-quants
_CHUNK_BLOCKS = 1 << 16  # blocks decoded per step, so temporaries stay a few MiB on huge tensors


class QuantType(enum.IntEnum):
    """Tensor element types we serve; the values are ggml's type ids as stored in GGUF."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    BF16 = 30


class Affine(NamedTuple):
    """value[i] == scale[i // group] * codes[i] + offset[i // group], per block or per row."""

    codes: np.ndarray    # (n, block_size) or (rows, K) int8
    scale: np.ndarray    # (n, block_size // group) or (rows, K // group) f32
    offset: np.ndarray   # same shape as scale, f32
    group: int


# ---------------------------------------------------------------- byte-field helpers
def _f16(raw: np.ndarray, start: int) -> np.ndarray:
    """The little-endian f16 at byte `start` of every block, widened exactly: (n, 1) f32."""
    return np.ascontiguousarray(raw[:, start:start + 2]).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """Unpack 4-bit codes: each run of `width` bytes holds `width` elements in its low nibbles
    followed by the next `width` elements in its high nibbles. (n, B) uint8 -> (n, 2B) uint8."""
    n = qs.shape[0]
    runs = qs.reshape(n, -1, 1, width)                                     # (n, R, 1, width)
    both = runs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)    # (n, R, 2, width)
    return (both & np.uint8(0x0F)).reshape(n, -1)


def _bits(packed: np.ndarray, shifts: list[int], mask: int, width: int) -> np.ndarray:
    """Bit-fields of a byte array: element `k * width + l` of each run of `width` bytes is
    `(packed[l] >> shifts[k]) & mask`. (n, B) uint8 -> (n, len(shifts) * B) uint8."""
    n = packed.shape[0]
    runs = packed.reshape(n, -1, 1, width)                                  # (n, R, 1, width)
    sh = np.array(shifts, dtype=np.uint8).reshape(1, 1, -1, 1)
    return ((runs >> sh) & np.uint8(mask)).reshape(n, -1)


def _high_bit_32(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: bit j of the little-endian u32 `qh` is bit 4 of element j. (n, 4) -> (n, 32)."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K 6-bit (scale, min) pairs of the 8 sub-blocks, packed into 12 bytes:
    bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7, bytes 4-7 the same
    for mins, bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble).
    (n, 12) uint8 -> (n, 8) f32, (n, 8) f32."""
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _safe_inverse(d: np.ndarray) -> np.ndarray:
    """1/d in f32, 0 where d == 0 (an all-zero block quantizes to zero codes)."""
    return np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)


def _round_half_away(x: np.ndarray) -> np.ndarray:
    """C roundf: halves go away from zero. `a - floor(a)` is exact, so no double rounding."""
    a = np.abs(x)
    f = np.floor(a)
    return np.copysign(f + (a - f >= np.float32(0.5)), x)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    """(n, 1) f32 -> (n, 2) uint8, rounded to nearest even like GGML_FP32_TO_FP16."""
    return x.astype(np.float16).view(np.uint8)


# ---------------------------------------------------------------- spec base and registry
@dataclass(frozen=True)
class BlockSpec:
    """Layout of one GGML type plus its block decoders. Subclasses register one instance each."""

    qtype: QuantType
    block_size: int   # elements per block
    type_size: int    # bytes per block
    bits: int         # storage width of `affine()` codes (4 or 8); 32 for float types

    def dequantize(self, raw: np.ndarray) -> np.ndarray:
        """(n_blocks, type_size) uint8 -> (n_blocks, block_size) f32."""
        raise NotImplementedError

    def affine(self, raw: np.ndarray) -> Affine | None:
        """Integer codes with per-group scale/offset; None for float types."""
        return None

    def quantize_blocks(self, x: np.ndarray) -> np.ndarray:
        """(n_blocks, block_size) f32 -> (n_blocks, type_size) uint8."""
        raise NotImplementedError(_no_quantizer_message(self.qtype))

    @property
    def is_quantized(self) -> bool:
        """True for integer-code types (those with an `affine()` form)."""
        return type(self).affine is not BlockSpec.affine

    @property
    def can_quantize(self) -> bool:
        return type(self).quantize_blocks is not BlockSpec.quantize_blocks


_SPECS: dict[QuantType, BlockSpec] = {}


def _register(qtype: QuantType, block_size: int, type_size: int, bits: int):
    def deco(cls: type[BlockSpec]) -> type[BlockSpec]:
        _SPECS[qtype] = cls(qtype, block_size, type_size, bits)
        return cls
    return deco


# ---------------------------------------------------------------- float types
@_register(QuantType.F32, 1, 4, 32)
class _F32(BlockSpec):
    def dequantize(self, raw):
        return np.ascontiguousarray(raw).view(np.float32)

    def quantize_blocks(self, x):
        return x.astype(np.float32).view(np.uint8)


@_register(QuantType.F16, 1, 2, 32)
class _F16(BlockSpec):
    def dequantize(self, raw):
        return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)

    def quantize_blocks(self, x):
        return x.astype(np.float16).view(np.uint8)


@_register(QuantType.BF16, 1, 2, 32)
class _BF16(BlockSpec):
    def dequantize(self, raw):
        # bf16 is the top half of an f32: shift the 16 bits into place.
        u16 = np.ascontiguousarray(raw).view(np.uint16)
        return (u16.astype(np.uint32) << 16).view(np.float32)

    def quantize_blocks(self, x):
        # ggml_compute_fp32_to_bf16: NaNs become quiet NaNs (bit 6 of the high half set);
        # everything else rounds to nearest even by adding 0x7fff + lsb before truncating.
        u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
        nan = (u & 0x7FFFFFFF) > 0x7F800000
        rounded = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
        out = np.where(nan, (u >> 16) | 64, rounded)
        return out.astype(np.uint16).view(np.uint8)


# ---------------------------------------------------------------- 32-element legacy quants
@_register(QuantType.Q4_0, 32, 18, 4)
class _Q4_0(BlockSpec):
    """d: f16, qs: 16 bytes of 4-bit codes q. value = d * (q - 8)."""

    def _fields(self, raw):
        return _f16(raw, 0), _nibbles(raw[:, 2:18], 16)          # (n, 1) f32, (n, 32) u8

    def dequantize(self, raw):
        d, q = self._fields(raw)
        return d * (q.astype(np.float32) - np.float32(8))

    def affine(self, raw):
        # d * q and 8 * d are exact in f32 (11-bit x 4-bit), so d*q - 8d == d*(q - 8) exactly.
        d, q = self._fields(raw)
        return Affine(q.view(np.int8), d, -8 * d, 32)

    def quantize_blocks(self, x):
        # d = (signed value of largest magnitude) / -8, so that value maps to code 0.
        imax = np.abs(x).argmax(axis=1, keepdims=True)
        d = np.take_along_axis(x, imax, axis=1) / np.float32(-8)      # (n, 1) f32
        q = np.trunc(x * _safe_inverse(d) + np.float32(8.5))
        q = np.minimum(q, 15).astype(np.uint8)                          # (n, 32)
        return np.concatenate([_f16_bytes(d), q[:, :16] | (q[:, 16:] << 4)], axis=1)


class _ScaleMin32(BlockSpec):
    """Blocks of 32 with an f16 scale d and min m: value = d * q + m (Q4_1, Q5_1)."""

    def _fields(self, raw):
        raise NotImplementedError

    def dequantize(self, raw):
        d, m, q = self._fields(raw)
        return d * q.astype(np.float32) + m

    def affine(self, raw):
        d, m, q = self._fields(raw)
        return Affine(q.view(np.int8), d, m, 32)


def _min_max_codes(x: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml's min/max rounding of blocks x (n, 32) to codes 0..top: (d, min, codes u8)."""
    lo = x.min(axis=1, keepdims=True)
    d = (x.max(axis=1, keepdims=True) - lo) / np.float32(top)
    q = np.trunc((x - lo) * _safe_inverse(d) + np.float32(0.5))
    return d, lo, np.minimum(q, top).astype(np.uint8)


@_register(QuantType.Q4_1, 32, 20, 4)
class _Q4_1(_ScaleMin32):
    """d, m: f16, qs: 16 bytes of 4-bit codes q. value = d * q + m."""

    def _fields(self, raw):
        return _f16(raw, 0), _f16(raw, 2), _nibbles(raw[:, 4:20], 16)


    def quantize_blocks(self, x):
        d, lo, q = _min_max_codes(x, 15)
        return np.concatenate(
            [_f16_bytes(d), _f16_bytes(lo), q[:, :16] | (q[:, 16:] << 4)], axis=1)


def _pack_q5(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """5-bit codes (n, 32) -> high bits as a little-endian u32 (n, 4) and nibbles (n, 16)."""
    qh = np.packbits(q >> 4, axis=1, bitorder="little")
    qs = (q[:, :16] & 0x0F) | (q[:, 16:] << 4)
    return qh, qs


@_register(QuantType.Q5_0, 32, 22, 8)
class _Q5_0(BlockSpec):
    """d: f16, qh: u32 of 5th bits, qs: 16 bytes of low nibbles. value = d * (q - 16)."""

    def _fields(self, raw):
        q = _nibbles(raw[:, 6:22], 16) | (_high_bit_32(raw[:, 2:6]) << 4)  # (n, 32) 0..31
        return _f16(raw, 0), q

    def dequantize(self, raw):
        d, q = self._fields(raw)
        return d * (q.astype(np.float32) - np.float32(16))

    def affine(self, raw):
        # exact for the same reason as Q4_0: d*q and 16*d need at most 16 significant bits.
        d, q = self._fields(raw)
        return Affine(q.view(np.int8), d, -16 * d, 32)

    def quantize_blocks(self, x):
        imax = np.abs(x).argmax(axis=1, keepdims=True)
        d = np.take_along_axis(x, imax, axis=1) / np.float32(-16)
        q = np.trunc(x * _safe_inverse(d) + np.float32(16.5))
        q = np.minimum(q, 31).astype(np.uint8)
        qh, qs = _pack_q5(q)
        return np.concatenate([_f16_bytes(d), qh, qs], axis=1)


@_register(QuantType.Q5_1, 32, 24, 8)
class _Q5_1(_ScaleMin32):
    """d, m: f16, qh: u32 of 5th bits, qs: 16 bytes of low nibbles. value = d * q + m."""

    def _fields(self, raw):
        q = _nibbles(raw[:, 8:24], 16) | (_high_bit_32(raw[:, 4:8]) << 4)
        return _f16(raw, 0), _f16(raw, 2), q


    def quantize_blocks(self, x):
        d, lo, q = _min_max_codes(x, 31)
        qh, qs = _pack_q5(q)
        return np.concatenate([_f16_bytes(d), _f16_bytes(lo), qh, qs], axis=1)


@_register(QuantType.Q8_0, 32, 34, 8)
class _Q8_0(BlockSpec):
    """d: f16, qs: 32 int8 codes. value = q * d."""

    def _fields(self, raw):
        return _f16(raw, 0), np.ascontiguousarray(raw[:, 2:34]).view(np.int8)

    def dequantize(self, raw):
        d, q = self._fields(raw)
        return q.astype(np.float32) * d

    def affine(self, raw):
        d, q = self._fields(raw)
        return Affine(q, d, np.zeros_like(d), 32)

    def quantize_blocks(self, x):
        d = np.abs(x).max(axis=1, keepdims=True) / np.float32(127)
        q = _round_half_away(x * _safe_inverse(d)).astype(np.int8)
        return np.concatenate([_f16_bytes(d), q.view(np.uint8)], axis=1)


# ---------------------------------------------------------------- 256-element K-quants
class _SubblockMinK(BlockSpec):
    """K-quants with 8 sub-blocks of 32, each with a scale and a min: value = dl * q - ml.
    Subclasses decode (dl, ml, q) from their own layout in `_fields`."""

    def _fields(self, raw):
        raise NotImplementedError

    def dequantize(self, raw):
        dl, ml, q = self._fields(raw)
        y = dl[:, :, None] * q.astype(np.float32) - ml[:, :, None]
        return y.reshape(raw.shape[0], QK_K)

    def affine(self, raw):
        dl, ml, q = self._fields(raw)
        return Affine(q.reshape(raw.shape[0], QK_K).view(np.int8), dl, -ml, 32)


@_register(QuantType.Q4_K, QK_K, 144, 4)
class _Q4_K(_SubblockMinK):
    """d, dmin: f16, 12 bytes of 6-bit (scale, min) for 8 sub-blocks of 32, 128 bytes of
    nibbles (each 32-byte run: low nibbles = one sub-block, high nibbles = the next).
    value = (d * sc) * q - (dmin * m)."""

    def _fields(self, raw):
        n = raw.shape[0]
        sc, mn = _k_scales(raw[:, 4:16])
        dl = _f16(raw, 0) * sc                                   # (n, 8) f32, exact
        ml = _f16(raw, 2) * mn                                   # (n, 8) f32, exact
        q = _nibbles(raw[:, 16:144], 32).reshape(n, 8, 32)       # (n, 8, 32) u8
        return dl, ml, q



@_register(QuantType.Q5_K, QK_K, 176, 8)
class _Q5_K(_SubblockMinK):
    """Q4_K plus 32 bytes of 5th bits: bit s of qh[l] belongs to element l of sub-block s."""

    def _fields(self, raw):
        n = raw.shape[0]
        sc, mn = _k_scales(raw[:, 4:16])
        dl = _f16(raw, 0) * sc
        ml = _f16(raw, 2) * mn
        hi = _bits(raw[:, 16:48], list(range(8)), 0x01, 32)      # (n, 256) 0..1
        q = (_nibbles(raw[:, 48:176], 32) | (hi << 4)).reshape(n, 8, 32)
        return dl, ml, q



@_register(QuantType.Q6_K, QK_K, 210, 8)
class _Q6_K(BlockSpec):
    """ql: 128 bytes of low nibbles, qh: 64 bytes of 2-bit high parts, 16 int8 scales (one per
    16 elements), d: f16. In each 128-element half, ql's 64 bytes give elements 0-63 (low
    nibbles) and 64-127 (high nibbles); bits 2k..2k+1 of qh[l] top element 32k + l.
    value = (d * sc) * (q - 32)."""

    def _fields(self, raw):
        n = raw.shape[0]
        lo = _nibbles(raw[:, 0:128], 64)                          # (n, 256) 0..15
        hi = _bits(raw[:, 128:192], [0, 2, 4, 6], 0x03, 32)       # (n, 256) 0..3
        q = (lo | (hi << 4)).view(np.int8) - np.int8(32)          # (n, 256) -32..31
        sc = np.ascontiguousarray(raw[:, 192:208]).view(np.int8).astype(np.float32)
        dl = _f16(raw, 208) * sc                                   # (n, 16) f32, exact
        return dl, q.reshape(n, 16, 16)

    def dequantize(self, raw):
        dl, q = self._fields(raw)
        return (dl[:, :, None] * q.astype(np.float32)).reshape(raw.shape[0], QK_K)

    def affine(self, raw):
        dl, q = self._fields(raw)
        return Affine(q.reshape(raw.shape[0], QK_K), dl, np.zeros_like(dl), 16)


# ---------------------------------------------------------------- tensor-level API
def block_spec(qtype: QuantType | int) -> BlockSpec | None:
    """The spec of `qtype`, or None for a type id we cannot serve."""
    try:
        return _SPECS.get(QuantType(int(qtype)))
    except ValueError:
        return None


def quantizable_types() -> list[QuantType]:
    return [q for q, s in _SPECS.items() if s.can_quantize]


def _no_quantizer_message(qtype: QuantType) -> str:
    return (f"quantizing to {qtype.name} is not supported (gguf.quants has no reference "
            "quantizer to match); supported: " + ", ".join(q.name for q in quantizable_types()))


def _spec_or_raise(qtype: QuantType | int) -> BlockSpec:
    spec = block_spec(qtype)
    if spec is None:
        raise ModelFormatError(f"unsupported quant type {qtype!r}")
    return spec


def _blocks(raw: np.ndarray, spec: BlockSpec, shape: tuple[int, ...]) -> np.ndarray:
    """Check `raw` holds exactly a tensor of row-major `shape`; view it as (n_blocks, type_size)."""
    shape = tuple(int(s) for s in shape)
    name = spec.qtype.name
    if not shape or any(s <= 0 for s in shape):
        raise ModelFormatError(f"{name} tensor shape {shape} must be non-empty and positive")
    if shape[-1] % spec.block_size:
        raise ModelFormatError(
            f"{name} row length {shape[-1]} is not a multiple of the block size {spec.block_size}")
    n_blocks = prod(shape) // spec.block_size
    flat = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if flat.size != n_blocks * spec.type_size:
        raise ModelFormatError(
            f"{name} tensor of shape {shape} needs {n_blocks * spec.type_size} bytes, "
            f"got {flat.size}")
    return flat.reshape(n_blocks, spec.type_size)


def dequantize(raw: np.ndarray, qtype: QuantType | int, shape: tuple[int, ...]) -> np.ndarray:
    """Decode a whole tensor: raw bytes (any shape) -> f32 array of row-major `shape`."""
    spec = _spec_or_raise(qtype)
    blocks = _blocks(raw, spec, shape)
    out = np.empty((blocks.shape[0], spec.block_size), dtype=np.float32)
    for i in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        out[i:i + _CHUNK_BLOCKS] = spec.dequantize(blocks[i:i + _CHUNK_BLOCKS])
    return out.reshape(tuple(int(s) for s in shape))


def affine_rows(raw: np.ndarray, qtype: QuantType | int, shape: tuple[int, ...]) -> Affine | None:
    """A tensor as (rows, K) int8 codes plus (rows, K // group) f32 scale and offset, where
    rows = prod(shape[:-1]) and K = shape[-1]. None for float types (nothing to repack)."""
    spec = _spec_or_raise(qtype)
    blocks = _blocks(raw, spec, shape)
    if not spec.is_quantized:
        return None
    k = int(shape[-1])
    rows = blocks.shape[0] * spec.block_size // k
    parts = [spec.affine(blocks[i:i + _CHUNK_BLOCKS])
             for i in range(0, blocks.shape[0], _CHUNK_BLOCKS)]
    group = parts[0].group
    codes = np.concatenate([p.codes for p in parts]).reshape(rows, k)          # (rows, K) i8
    scale = np.concatenate([p.scale for p in parts]).reshape(rows, k // group)  # f32
    offset = np.concatenate([p.offset for p in parts]).reshape(rows, k // group)
    return Affine(codes, scale, offset, group)


def quantize(x: np.ndarray, qtype: QuantType | int) -> np.ndarray:
    """Encode (..., K) floats -> (..., K // block_size * type_size) uint8, bit-exact with
    `gguf.quants.quantize` (whose F32/F16 results are these bytes viewed as floats)."""
    spec = _spec_or_raise(qtype)
    if not spec.can_quantize:
        raise NotImplementedError(_no_quantizer_message(spec.qtype))
    x = np.asarray(x)
    if x.ndim == 0 or x.shape[-1] == 0 or x.shape[-1] % spec.block_size:
        raise ModelFormatError(
            f"cannot quantize shape {x.shape} to {spec.qtype.name}: the last dimension must be "
            f"a positive multiple of {spec.block_size}")
    if not np.issubdtype(x.dtype, np.floating):
        raise ModelFormatError(f"cannot quantize dtype {x.dtype}; expected floats")
    blocks = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, spec.block_size)
    out = np.empty((blocks.shape[0], spec.type_size), dtype=np.uint8)
    for i in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        out[i:i + _CHUNK_BLOCKS] = spec.quantize_blocks(blocks[i:i + _CHUNK_BLOCKS])
    return out.reshape(*x.shape[:-1], x.shape[-1] // spec.block_size * spec.type_size)
