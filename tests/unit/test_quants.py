"""service.gguf.quants: the affine repack (ours) exact against `gguf.quants.dequantize`, and the
shape checks around gguf's own dequantize / quantize."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as ref

from service.errors import ModelFormatError
from service.gguf import quants
from service.gguf.quants import QuantType

# Byte offsets of the f16 scale fields in each block; random bytes there could be NaN/inf, which
# would make "bit-exact" compare NaN payloads rather than the decoding we want to test.
F16_FIELDS: dict[QuantType, tuple[int, ...]] = {
    QuantType.Q4_0: (0,),
    QuantType.Q4_1: (0, 2),
    QuantType.Q5_0: (0,),
    QuantType.Q5_1: (0, 2),
    QuantType.Q8_0: (0,),
    QuantType.Q4_K: (0, 2),
    QuantType.Q5_K: (0, 2),
    QuantType.Q6_K: (208,),
    QuantType.Q2_K: (80, 82),
    QuantType.Q3_K: (108,),
    QuantType.IQ4_NL: (0,),
    QuantType.IQ4_XS: (0,),
}
QUANTIZED = list(F16_FIELDS)
FLOATS = [QuantType.F32, QuantType.F16, QuantType.BF16]
QUANTIZABLE = [QuantType.F32, QuantType.F16, QuantType.BF16, QuantType.Q8_0,
               QuantType.Q4_0, QuantType.Q4_1, QuantType.Q5_0, QuantType.Q5_1]
CODE_RANGE = {
    QuantType.Q4_0: (0, 15), QuantType.Q4_1: (0, 15), QuantType.Q4_K: (0, 15),
    QuantType.Q5_0: (0, 31), QuantType.Q5_1: (0, 31), QuantType.Q5_K: (0, 31),
    QuantType.Q6_K: (-32, 31), QuantType.Q8_0: (-128, 127),
    QuantType.Q2_K: (0, 3), QuantType.Q3_K: (-4, 3),
    QuantType.IQ4_NL: (-127, 113), QuantType.IQ4_XS: (-127, 113),
}
GROUP = {q: 32 for q in QUANTIZED} | {q: 16 for q in (QuantType.Q6_K, QuantType.Q2_K,
                                                      QuantType.Q3_K)}
BITS = {QuantType.Q4_0: 4, QuantType.Q4_1: 4, QuantType.Q4_K: 4, QuantType.Q2_K: 2,
        QuantType.Q3_K: 3} | {
    q: 8 for q in (QuantType.Q5_0, QuantType.Q5_1, QuantType.Q5_K, QuantType.Q6_K,
                   QuantType.Q8_0, QuantType.IQ4_NL, QuantType.IQ4_XS)} | {q: 32 for q in FLOATS}


def finite_f16_bits(rng: np.random.Generator, n: int) -> np.ndarray:
    """n random finite f16 values (normals, subnormals, zeros, both signs) as (n, 2) uint8."""
    magnitude = rng.integers(0, 0x7C00, size=n, dtype=np.uint16)   # exponent 31 = inf/NaN
    sign = rng.integers(0, 2, size=n, dtype=np.uint16) << 15
    return (magnitude | sign).view(np.uint8).reshape(n, 2)


def random_blocks(qtype: QuantType, n_blocks: int, seed: int = 0) -> np.ndarray:
    """(n_blocks, type_size) uint8 of random codes with finite random f16 scales."""
    rng = np.random.default_rng(seed)
    spec = quants.block_spec(qtype)
    raw = rng.integers(0, 256, size=(n_blocks, spec.type_size), dtype=np.uint8)
    for off in F16_FIELDS.get(qtype, ()):
        raw[:, off:off + 2] = finite_f16_bits(rng, n_blocks)
    return raw


def reference_dequantize(raw: np.ndarray, qtype: QuantType) -> np.ndarray:
    return ref.dequantize(raw, GGMLQuantizationType(int(qtype))).astype(np.float32, copy=False)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


# ---------------------------------------------------------------- specs
@pytest.mark.parametrize("qtype", quants.supported_types())
def test_spec_is_ggml_layout(qtype):
    spec = quants.block_spec(qtype)
    assert spec.qtype is qtype and isinstance(qtype, GGMLQuantizationType)
    assert (spec.block_size, spec.type_size) == GGML_QUANT_SIZES[qtype]
    assert spec.bits == BITS[qtype]
    assert spec.is_quantized == (qtype in QUANTIZED)


def test_supported_types():
    assert set(quants.supported_types()) == set(QUANTIZED) | set(FLOATS)
    assert set(quants.quantizable_types()) == set(QUANTIZABLE)


def test_block_spec_unknown_types():
    assert quants.block_spec(QuantType.IQ2_XXS) is None     # a ggml type we do not serve
    assert quants.block_spec(999) is None
    assert quants.block_spec(2) is quants.block_spec(QuantType.Q4_0)


# ---------------------------------------------------------------- dequantize (gguf's, reshaped)
@pytest.mark.parametrize("qtype", QUANTIZED + FLOATS)
def test_dequantize_tensor_shape(qtype):
    spec = quants.block_spec(qtype)
    k = 2 * max(spec.block_size, 32)
    rows = 6
    raw = random_blocks(qtype, rows * k // spec.block_size, seed=7).reshape(-1)
    want = reference_dequantize(raw.reshape(rows, -1), qtype)
    got = quants.dequantize(raw, qtype, (2, 3, k))
    assert got.shape == (2, 3, k) and got.dtype == np.float32
    assert same_bits(got.reshape(rows, k), want)
    got[...] = 0                   # a new array, never a view of the file's bytes
    assert np.array_equal(raw, random_blocks(qtype, rows * k // spec.block_size, 7).ravel())


# ---------------------------------------------------------------- affine form (ours)
def affine_value(a: quants.Affine) -> np.ndarray:
    """scale * code + offset per group, in f32 as the repacked kernels read it."""
    n = a.codes.shape[0]
    c = a.codes.reshape(n, -1, a.group).astype(np.float32)
    return (a.scale[:, :, None] * c + a.offset[:, :, None]).reshape(n, -1)


@pytest.mark.parametrize("qtype", QUANTIZED)
def test_affine_equals_gguf_dequantize(qtype):
    """The repack is exact: every value equals gguf's decode in f32 (zeros may differ in
    sign: d*q + (-c*d) gives +0 where d*(q - c) gives -0)."""
    spec = quants.block_spec(qtype)
    raw = random_blocks(qtype, 300, seed=100 + int(qtype))
    a = spec.affine(raw)
    n = raw.shape[0]
    assert a.group == GROUP[qtype]
    assert a.codes.dtype == np.int8 and a.codes.shape == (n, spec.block_size)
    assert a.scale.dtype == a.offset.dtype == np.float32
    assert a.scale.shape == a.offset.shape == (n, spec.block_size // a.group)
    lo, hi = CODE_RANGE[qtype]
    assert a.codes.min() >= lo and a.codes.max() <= hi
    want = reference_dequantize(raw, qtype).reshape(n, spec.block_size)
    assert np.array_equal(affine_value(a), want)


@pytest.mark.parametrize("qtype", QUANTIZED)
def test_affine_rows(qtype, monkeypatch):
    monkeypatch.setattr(quants, "_CHUNK_BLOCKS", 4)   # a tensor that spans several chunks
    spec = quants.block_spec(qtype)
    rows, k = 5, 3 * spec.block_size
    raw = random_blocks(qtype, rows * 3, seed=3)
    a = quants.affine_rows(raw, qtype, (rows, k))
    assert a.codes.shape == (rows, k) and a.scale.shape == a.offset.shape == (rows, k // a.group)
    want = reference_dequantize(raw.reshape(rows, -1), qtype)
    assert np.array_equal(affine_value(a), want)


@pytest.mark.parametrize("qtype", FLOATS)
def test_affine_none_for_floats(qtype):
    raw = random_blocks(qtype, 8)
    assert quants.block_spec(qtype).affine(raw) is None
    assert quants.affine_rows(raw, qtype, (2, 4)) is None


# ---------------------------------------------------------------- quantize (gguf's, as bytes)
@pytest.mark.parametrize("qtype", QUANTIZABLE)
def test_quantize_gives_gguf_bytes(qtype):
    spec = quants.block_spec(qtype)
    x = np.random.default_rng(42).standard_normal((70, 2 * max(spec.block_size, 32)))
    want = np.ascontiguousarray(ref.quantize(x.astype(np.float32), qtype)).view(np.uint8)
    got = quants.quantize(x, qtype)                       # f64 input is taken as f32
    assert got.dtype == np.uint8
    assert got.shape == (x.shape[0], x.shape[1] // spec.block_size * spec.type_size)
    assert np.array_equal(got, want)
    got3 = quants.quantize(x.reshape(2, 35, -1), qtype)   # leading dimensions are kept
    assert got3.shape == (2, 35, got.shape[1])
    assert np.array_equal(got3.reshape(got.shape), got)


ROUND_TRIP_STEP = {   # (step of the code grid for one block, allowed error in steps)
    QuantType.Q8_0: (lambda b: np.abs(b).max(1) / 127, 0.6),
    QuantType.Q4_0: (lambda b: np.abs(b).max(1) / 8, 1.05),    # -max clips from +8 to +7
    QuantType.Q5_0: (lambda b: np.abs(b).max(1) / 16, 1.05),
    QuantType.Q4_1: (lambda b: np.ptp(b, 1) / 15, 0.6),
    QuantType.Q5_1: (lambda b: np.ptp(b, 1) / 31, 0.6),
}


@pytest.mark.parametrize("qtype", list(ROUND_TRIP_STEP))
def test_round_trip_error_bounded(qtype):
    step_of, allowed = ROUND_TRIP_STEP[qtype]
    x = np.random.default_rng(5).standard_normal((128, 64)).astype(np.float32)
    y = quants.dequantize(quants.quantize(x, qtype), qtype, x.shape)
    blocks, err = x.reshape(-1, 32), np.abs(y - x).reshape(-1, 32).max(1)
    # f16 rounding of the scale and min adds up to 2^-11 relative on top of half a step
    slack = np.abs(blocks).max(1) * 2.0 ** -10
    assert np.all(err <= allowed * step_of(blocks) + slack)


@pytest.mark.parametrize("qtype,rel", [(QuantType.F32, 0.0), (QuantType.F16, 2.0 ** -11),
                                       (QuantType.BF16, 2.0 ** -8)])
def test_round_trip_floats(qtype, rel):
    x = np.random.default_rng(6).standard_normal((4, 64)).astype(np.float32)
    y = quants.dequantize(quants.quantize(x, qtype), qtype, x.shape)
    assert np.all(np.abs(y - x) <= rel * np.abs(x))


@pytest.mark.parametrize("qtype", [QuantType.Q4_K, QuantType.Q5_K, QuantType.Q6_K,
                                   QuantType.Q2_K, QuantType.Q3_K, QuantType.IQ4_XS])
def test_quantize_k_quants_not_implemented(qtype):
    with pytest.raises(NotImplementedError, match=qtype.name):
        quants.quantize(np.zeros((1, 256), np.float32), qtype)


# ---------------------------------------------------------------- shape errors
@pytest.mark.parametrize("qtype", [QuantType.Q4_0, QuantType.Q6_K, QuantType.F16])
def test_shape_errors(qtype):
    spec = quants.block_spec(qtype)
    raw = random_blocks(qtype, 4)
    k = 4 * spec.block_size
    with pytest.raises(ModelFormatError, match="bytes"):
        quants.dequantize(raw, qtype, (2, k))                   # needs twice the bytes
    with pytest.raises(ModelFormatError, match="bytes"):
        quants.affine_rows(raw[:3], qtype, (1, k))
    with pytest.raises(ModelFormatError, match="non-empty"):
        quants.dequantize(raw, qtype, (0, k))
    if spec.block_size > 1:
        with pytest.raises(ModelFormatError, match="multiple"):
            quants.dequantize(raw, qtype, (4, spec.block_size + 1))
        if spec.can_quantize:
            with pytest.raises(ModelFormatError, match="multiple"):
                quants.quantize(np.zeros((2, spec.block_size + 16), np.float32), qtype)
    if spec.can_quantize:
        with pytest.raises(ModelFormatError):
            quants.quantize(np.float32(1.0), qtype)
        with pytest.raises(ModelFormatError, match="dtype"):
            quants.quantize(np.zeros((1, k), np.int32), qtype)


def test_unsupported_type_raises():
    with pytest.raises(ModelFormatError, match="unsupported"):
        quants.dequantize(np.zeros(66, np.uint8), int(QuantType.IQ2_XXS), (256,))


def test_kv_types_are_block_types():
    """Every KV-cache element type names the GGML block type its rows are stored in, one that
    can be encoded; the bytes one position takes follow from that type's layout."""
    from service.backends.base import Backend
    from service.formats import KVType

    for kv in KVType:
        spec = quants.block_spec(quants.kv_qtype(kv))
        assert spec.qtype.name.lower() == kv.value and spec.can_quantize, kv
    per_row = {"f16": 2 * 64, "q8_0": 64 + 64 // 16, "q4_0": 64 // 2 + 64 // 16}
    for t, n in per_row.items():
        assert Backend.kv_position_bytes(None, 1, 1, 64, 64, t, t) == 2 * n


def test_vec_dot_types_are_llamacpp_activation_types():
    """The activation type llama.cpp's CPU matmul pairs each weight type with."""
    want = {QuantType.F32: None, QuantType.F16: QuantType.F16, QuantType.BF16: QuantType.BF16,
            QuantType.Q4_K: QuantType.Q8_K, QuantType.Q5_K: QuantType.Q8_K,
            QuantType.Q6_K: QuantType.Q8_K, QuantType.Q2_K: QuantType.Q8_K,
            QuantType.Q3_K: QuantType.Q8_K, QuantType.IQ4_XS: QuantType.Q8_K}
    for q in quants.supported_types():
        assert quants.block_spec(q).vec_dot_type == want.get(q, QuantType.Q8_0), q


def test_iq4_nl_values_are_ggml_table():
    """The one written copy of kvalues_iq4nl equals the gguf package's (the oracle's) table."""
    assert quants.IQ4_NL_VALUES == tuple(ref.IQ4_NL.kvalues)
    assert list(quants.IQ4_NL_VALUES) == sorted(set(quants.IQ4_NL_VALUES))
