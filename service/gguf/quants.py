"""GGML element types through the `gguf` package, plus the affine repack the CPU kernels need.

Types are `gguf.GGMLQuantizationType` (named `QuantType` here), block layouts come from
`gguf.GGML_QUANT_SIZES`, and `dequantize` / `quantize` call `gguf.quants.dequantize` /
`gguf.quants.quantize`, adding the shape checks that turn mistakes into `ModelFormatError`.

What the package lacks is the form the CPU backend repacks quantized weights into: small
integer codes plus one f32 scale and offset per group of `group` consecutive elements,

    value[i] == scale[i // group] * codes[i] + offset[i // group]

computed in f32, bit-exact with `gguf.quants.dequantize` (tests/unit/test_quants.py checks it).
Each quantized type registers one decoder of its block layout below (`_affine`); `affine_rows`
applies it to a whole row-major tensor.

`BlockSpec` is the one record of per-type facts (layout, code width, decoder, the activation
type llama.cpp's CPU dot product pairs it with); backends key by `QuantType`, never by a type
name or id. A KV-cache element type stores its rows in the block type of the same name
(`kv_qtype`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from math import prod
from typing import NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QuantType
from gguf import quants as gguf_quants

from service.errors import ModelFormatError
from service.formats import KVType

QK_K = 256            # elements per super-block of the K-quants
_CHUNK_BLOCKS = 1 << 16  # blocks decoded per step, so temporaries stay a few MiB on huge tensors
FLOAT_TYPES = (QuantType.F32, QuantType.F16, QuantType.BF16)

__all__ = ["IQ4_NL_VALUES", "Affine", "BlockSpec", "QuantType", "affine_rows", "block_spec",
           "dequantize", "kv_qtype", "quantizable_types", "quantize", "supported_types"]

# ggml's kvalues_iq4nl: the 16 non-uniform levels a 4-bit IQ4_NL / IQ4_XS code indexes. Written
# here only: the CUDA kernels get it as the IQ4_NL_VALUES define (cuda/sources.py), and
# tests/unit/test_quants.py checks it against the gguf package's table.
IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
_IQ4_NL_LUT = np.array(IQ4_NL_VALUES, dtype=np.int8)


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


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K 6-bit (scale, min) pairs of the 8 sub-blocks, packed into 12 bytes:
    bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7, bytes 4-7 the same
    for mins, bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble).
    (n, 12) uint8 -> (n, 8) f32, (n, 8) f32."""
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


# ---------------------------------------------------------------- spec and registry
AffineDecoder = Callable[[np.ndarray], Affine]


@dataclass(frozen=True)
class BlockSpec:
    """One served GGML type: its layout (from GGML_QUANT_SIZES) and its affine decoder."""

    qtype: QuantType
    block_size: int   # elements per block
    type_size: int    # bytes per block
    bits: int         # storage width of the file's codes (2 to 8); 32 for float types
    vec_dot_type: QuantType | None   # llama.cpp's CPU activation type (None: f32, unrounded)
    decoder: AffineDecoder | None = None

    def affine(self, raw: np.ndarray) -> Affine | None:
        """(n_blocks, type_size) uint8 -> integer codes with per-group scale/offset; None for
        float types."""
        return None if self.decoder is None else self.decoder(raw)

    @property
    def is_quantized(self) -> bool:
        """True for integer-code types (those with an affine form)."""
        return self.decoder is not None

    @property
    def can_quantize(self) -> bool:
        return self.qtype in _QUANTIZABLE


_SPECS: dict[QuantType, BlockSpec] = {
    q: BlockSpec(q, *GGML_QUANT_SIZES[q], bits=32, vec_dot_type=v)
    for q, v in ((QuantType.F32, None), (QuantType.F16, QuantType.F16),
                 (QuantType.BF16, QuantType.BF16))}
# gguf.quants.quantize implements these (the K-quants it only decodes)
_QUANTIZABLE = frozenset((*FLOAT_TYPES, QuantType.Q4_0, QuantType.Q4_1, QuantType.Q5_0,
                          QuantType.Q5_1, QuantType.Q8_0))


def _affine(qtype: QuantType, bits: int) -> Callable[[AffineDecoder], AffineDecoder]:
    """Register `qtype`'s decoder; its vec_dot_type is Q8_K for the 256-element K-quants and
    Q8_0 for the 32-element types (ggml's type traits)."""
    via = QuantType.Q8_K if GGML_QUANT_SIZES[qtype][0] == QK_K else QuantType.Q8_0

    def deco(fn: AffineDecoder) -> AffineDecoder:
        _SPECS[qtype] = BlockSpec(qtype, *GGML_QUANT_SIZES[qtype], bits=bits, vec_dot_type=via,
                                  decoder=fn)
        return fn
    return deco


# ---------------------------------------------------------------- 32-element legacy quants
# The symmetric types store d * (q - c): d * q and c * d are exact in f32 (11-bit x 5-bit at
# most), so d*q + (-c*d) rounds once, like gguf's d * (q - c).
@_affine(QuantType.Q4_0, 4)
def _q4_0(raw: np.ndarray) -> Affine:
    """d: f16, qs: 16 bytes of 4-bit codes q. value = d * (q - 8)."""
    d, q = _f16(raw, 0), _nibbles(raw[:, 2:18], 16)               # (n, 1) f32, (n, 32) u8
    return Affine(q.view(np.int8), d, -8 * d, 32)


@_affine(QuantType.Q4_1, 4)
def _q4_1(raw: np.ndarray) -> Affine:
    """d, m: f16, qs: 16 bytes of 4-bit codes q. value = d * q + m."""
    q = _nibbles(raw[:, 4:20], 16)
    return Affine(q.view(np.int8), _f16(raw, 0), _f16(raw, 2), 32)


def _q5_codes(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: low nibbles plus bit j of the little-endian u32 qh as bit 4 of element j.
    (n, 4), (n, 16) uint8 -> (n, 32) uint8 0..31."""
    return _nibbles(qs, 16) | (np.unpackbits(qh, axis=-1, bitorder="little") << 4)


@_affine(QuantType.Q5_0, 8)
def _q5_0(raw: np.ndarray) -> Affine:
    """d: f16, qh: u32 of 5th bits, qs: 16 bytes of low nibbles. value = d * (q - 16)."""
    d = _f16(raw, 0)
    return Affine(_q5_codes(raw[:, 2:6], raw[:, 6:22]).view(np.int8), d, -16 * d, 32)


@_affine(QuantType.Q5_1, 8)
def _q5_1(raw: np.ndarray) -> Affine:
    """d, m: f16, qh: u32 of 5th bits, qs: 16 bytes of low nibbles. value = d * q + m."""
    q = _q5_codes(raw[:, 4:8], raw[:, 8:24])
    return Affine(q.view(np.int8), _f16(raw, 0), _f16(raw, 2), 32)


@_affine(QuantType.Q8_0, 8)
def _q8_0(raw: np.ndarray) -> Affine:
    """d: f16, qs: 32 int8 codes. value = q * d."""
    d = _f16(raw, 0)
    return Affine(np.ascontiguousarray(raw[:, 2:34]).view(np.int8), d, np.zeros_like(d), 32)


# ---------------------------------------------------------------- 256-element K-quants
def _scale_min_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: d, dmin f16 at bytes 0 and 2, 6-bit (scale, min) pairs at 4..15.
    -> (d * sc, dmin * m), each (n, 8) f32 and exact (11-bit x 6-bit)."""
    sc, mn = _k_scales(raw[:, 4:16])
    return _f16(raw, 0) * sc, _f16(raw, 2) * mn


@_affine(QuantType.Q4_K, 4)
def _q4_k(raw: np.ndarray) -> Affine:
    """8 sub-blocks of 32 with 128 bytes of nibbles (each 32-byte run: low nibbles = one
    sub-block, high nibbles = the next). value = (d * sc) * q - (dmin * m)."""
    dl, ml = _scale_min_k(raw)
    q = _nibbles(raw[:, 16:144], 32)                               # (n, 256) u8
    return Affine(q.view(np.int8), dl, -ml, 32)


@_affine(QuantType.Q5_K, 8)
def _q5_k(raw: np.ndarray) -> Affine:
    """Q4_K plus 32 bytes of 5th bits: bit s of qh[l] belongs to element l of sub-block s."""
    dl, ml = _scale_min_k(raw)
    hi = _bits(raw[:, 16:48], list(range(8)), 0x01, 32)            # (n, 256) 0..1
    q = _nibbles(raw[:, 48:176], 32) | (hi << 4)
    return Affine(q.view(np.int8), dl, -ml, 32)


@_affine(QuantType.Q6_K, 8)
def _q6_k(raw: np.ndarray) -> Affine:
    """ql: 128 bytes of low nibbles, qh: 64 bytes of 2-bit high parts, 16 int8 scales (one per
    16 elements), d: f16. In each 128-element half, ql's 64 bytes give elements 0-63 (low
    nibbles) and 64-127 (high nibbles); bits 2k..2k+1 of qh[l] top element 32k + l.
    value = (d * sc) * (q - 32)."""
    lo = _nibbles(raw[:, 0:128], 64)                               # (n, 256) 0..15
    hi = _bits(raw[:, 128:192], [0, 2, 4, 6], 0x03, 32)            # (n, 256) 0..3
    q = (lo | (hi << 4)).view(np.int8) - np.int8(32)               # (n, 256) -32..31
    sc = np.ascontiguousarray(raw[:, 192:208]).view(np.int8).astype(np.float32)
    dl = _f16(raw, 208) * sc                                       # (n, 16) f32, exact
    return Affine(q, dl, np.zeros_like(dl), 16)


@_affine(QuantType.Q2_K, 2)
def _q2_k(raw: np.ndarray) -> Affine:
    """scales: 16 bytes (low nibble sc, high nibble m, one per 16 elements), qs: 64 bytes of
    2-bit codes (in each 128-element half, bits 2k..2k+1 of byte l give element 32k + l),
    d, dmin: f16. value = (d * sc) * q - (dmin * m)."""
    sc = raw[:, 0:16]
    q = _bits(raw[:, 16:80], [0, 2, 4, 6], 0x03, 32)               # (n, 256) 0..3
    dl = _f16(raw, 80) * (sc & 0x0F).astype(np.float32)            # (n, 16) f32, exact
    ml = _f16(raw, 82) * (sc >> 4).astype(np.float32)
    return Affine(q.view(np.int8), dl, -ml, 16)


@_affine(QuantType.Q3_K, 3)
def _q3_k(raw: np.ndarray) -> Affine:
    """hmask: 32 bytes (bit k of byte l: the high bit of element 32k + l), qs: 64 bytes of low
    2-bit parts (as Q2_K), 12 bytes of 16 6-bit scales (bytes 0-7: low nibbles of scales 0-7
    then 8-15; bytes 8-11: bits 2k..2k+1 of byte l = high bits of scale 4k + l), d: f16.
    q = low - 4 where the high bit is clear. value = (d * (sc - 32)) * q."""
    lo = _bits(raw[:, 32:96], [0, 2, 4, 6], 0x03, 32).view(np.int8)   # (n, 256) 0..3
    hi = _bits(raw[:, 0:32], list(range(8)), 0x01, 32).view(np.int8)  # (n, 256) 0..1
    q = lo - np.int8(4) * (np.int8(1) - hi)                            # (n, 256) -4..3
    sl = _bits(raw[:, 96:104], [0, 4], 0x0F, 8)                        # (n, 16) 0..15
    sh = _bits(raw[:, 104:108], [0, 2, 4, 6], 0x03, 4)                 # (n, 16) 0..3
    sc = (sl | (sh << 4)).astype(np.float32) - np.float32(32)          # (n, 16) -32..31
    dl = _f16(raw, 108) * sc                                           # (n, 16) f32, exact
    return Affine(q, dl, np.zeros_like(dl), 16)


# ---------------------------------------------------------------- non-linear 4-bit codes
# The code is IQ4_NL_VALUES[nibble], a signed byte: the affine form holds the looked-up level.
@_affine(QuantType.IQ4_NL, 8)
def _iq4_nl(raw: np.ndarray) -> Affine:
    """d: f16, qs: 16 bytes of 4-bit indices (as Q4_0). value = d * IQ4_NL_VALUES[q]."""
    d = _f16(raw, 0)
    return Affine(_IQ4_NL_LUT[_nibbles(raw[:, 2:18], 16)], d, np.zeros_like(d), 32)


@_affine(QuantType.IQ4_XS, 8)
def _iq4_xs(raw: np.ndarray) -> Affine:
    """d: f16, scales_h: u16 (bits 2j..2j+1: high bits of scale j), scales_l: 4 bytes (nibble j
    of the 8: low bits of scale j), qs: 128 bytes, 16 per 32-element sub-block as in IQ4_NL.
    value = (d * (ls - 32)) * IQ4_NL_VALUES[q]."""
    sh = np.ascontiguousarray(raw[:, 2:4]).view(np.uint16)             # (n, 1) u16
    hi = (sh >> (2 * np.arange(8, dtype=np.uint16))) & np.uint16(3)      # (n, 8) 0..3
    lo = _bits(raw[:, 4:8], [0, 4], 0x0F, 1)                           # (n, 8) 0..15
    ls = (lo | (hi.astype(np.uint8) << 4)).astype(np.float32) - np.float32(32)
    dl = _f16(raw, 0) * ls                                             # (n, 8) f32, exact
    return Affine(_IQ4_NL_LUT[_nibbles(raw[:, 8:136], 16)], dl, np.zeros_like(dl), 32)


# ---------------------------------------------------------------- tensor-level API
def block_spec(qtype: QuantType | int) -> BlockSpec | None:
    """The spec of `qtype`, or None for a type id we cannot serve."""
    try:
        return _SPECS.get(QuantType(int(qtype)))
    except ValueError:
        return None


def kv_qtype(kv: KVType | str) -> QuantType:
    """The block type a KV-cache element type's rows are stored as (q8_0 -> Q8_0)."""
    return QuantType[KVType(kv).name]


def supported_types() -> list[QuantType]:
    """The element types a tensor may have, in ggml's id order."""
    return sorted(_SPECS)


def quantizable_types() -> list[QuantType]:
    return [q for q in supported_types() if q in _QUANTIZABLE]


def _no_quantizer_message(qtype: QuantType) -> str:
    return (f"quantizing to {qtype.name} is not supported (gguf.quants has no quantizer for "
            "it); supported: " + ", ".join(q.name for q in quantizable_types()))


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
    """Decode a whole tensor with gguf.quants: raw bytes (any shape) -> a new f32 array of
    row-major `shape`."""
    spec = _spec_or_raise(qtype)
    blocks = _blocks(raw, spec, shape)
    shape = tuple(int(s) for s in shape)
    rows = blocks.reshape(*shape[:-1], shape[-1] // spec.block_size * spec.type_size)
    out = gguf_quants.dequantize(rows, spec.qtype)
    if np.may_share_memory(out, raw):     # F32 decodes to a view of the (read-only) bytes
        out = out.copy()
    return out.astype(np.float32, copy=False).reshape(shape)


def affine_rows(raw: np.ndarray, qtype: QuantType | int, shape: tuple[int, ...]) -> Affine | None:
    """A tensor as (rows, K) int8 codes plus (rows, K // group) f32 scale and offset, where
    rows = prod(shape[:-1]) and K = shape[-1]. None for float types (nothing to repack)."""
    spec = _spec_or_raise(qtype)
    blocks = _blocks(raw, spec, shape)
    if not spec.is_quantized:
        return None
    k = int(shape[-1])
    rows = blocks.shape[0] * spec.block_size // k
    parts = [spec.decoder(blocks[i:i + _CHUNK_BLOCKS])
             for i in range(0, blocks.shape[0], _CHUNK_BLOCKS)]
    group = parts[0].group
    codes = np.concatenate([p.codes for p in parts]).reshape(rows, k)          # (rows, K) i8
    scale = np.concatenate([p.scale for p in parts]).reshape(rows, k // group)  # f32
    offset = np.concatenate([p.offset for p in parts]).reshape(rows, k // group)
    return Affine(codes, scale, offset, group)


def quantize(x: np.ndarray, qtype: QuantType | int) -> np.ndarray:
    """Encode (..., K) floats with gguf.quants -> (..., K // block_size * type_size) uint8
    (F32/F16 results, which gguf returns as floats, viewed as their bytes)."""
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
    out = gguf_quants.quantize(np.ascontiguousarray(x, dtype=np.float32), spec.qtype)
    return np.ascontiguousarray(out).view(np.uint8).reshape(
        *x.shape[:-1], x.shape[-1] // spec.block_size * spec.type_size)
