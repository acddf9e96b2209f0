"""service.gguf.quants against the reference `gguf.quants`: bit-exact decode and encode."""

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
}
QUANTIZED = list(F16_FIELDS)
FLOATS = [QuantType.F32, QuantType.F16, QuantType.BF16]
QUANTIZABLE = [QuantType.F32, QuantType.F16, QuantType.BF16, QuantType.Q8_0,
               QuantType.Q4_0, QuantType.Q4_1, QuantType.Q5_0, QuantType.Q5_1]
CODE_RANGE = {
    QuantType.Q4_0: (0, 15), QuantType.Q4_1: (0, 15), QuantType.Q4_K: (0, 15),
    QuantType.Q5_0: (0, 31), QuantType.Q5_1: (0, 31), QuantType.Q5_K: (0, 31),
    QuantType.Q6_K: (-32, 31), QuantType.Q8_0: (-128, 127),
}
GROUP = {q: 32 for q in QUANTIZED} | {QuantType.Q6_K: 16}
BITS = {QuantType.Q4_0: 4, QuantType.Q4_1: 4, QuantType.Q4_K: 4} | {
    q: 8 for q in (QuantType.Q5_0, QuantType.Q5_1, QuantType.Q5_K, QuantType.Q6_K,
                   QuantType.Q8_0)} | {q: 32 for q in FLOATS}


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
@pytest.mark.parametrize("qtype", list(QuantType))
def test_spec_matches_ggml_sizes(qtype):
    spec = quants.block_spec(qtype)
    assert spec.qtype is qtype
    assert (spec.block_size, spec.type_size) == GGML_QUANT_SIZES[GGMLQuantizationType(int(qtype))]
    assert spec.bits == BITS[qtype]
    assert int(qtype) == int(GGMLQuantizationType[qtype.name])


def test_block_spec_unknown_types():
    assert quants.block_spec(10) is None            # Q2_K: a ggml type we do not serve
    assert quants.block_spec(999) is None
    assert quants.block_spec(2) is quants.block_spec(QuantType.Q4_0)


# ---------------------------------------------------------------- dequantize
@pytest.mark.parametrize("qtype", list(QuantType))
def test_dequantize_bit_exact(qtype):
    spec = quants.block_spec(qtype)
    n_blocks = 200 if spec.block_size > 1 else 4096
    raw = random_blocks(qtype, n_blocks, seed=int(qtype))
    if qtype in FLOATS:   # random float bits may be NaN; keep them out of the comparison
        vals = spec.dequantize(raw)
        raw = raw[np.isfinite(vals).ravel()]
    want = reference_dequantize(raw, qtype).reshape(-1, spec.block_size)
    got = spec.dequantize(raw)
    assert got.dtype == np.float32 and got.shape == (raw.shape[0], spec.block_size)
    assert same_bits(got, want)


@pytest.mark.parametrize("qtype", QUANTIZED)
def test_dequantize_tensor_shape(qtype, monkeypatch):
    spec = quants.block_spec(qtype)
    rows, k = 6, 2 * spec.block_size
    raw = random_blocks(qtype, rows * 2, seed=7).reshape(-1)     # flat bytes, like GGUFFile
    want = reference_dequantize(raw.reshape(rows, -1), qtype)
    got = quants.dequantize(raw, qtype, (2, 3, k))
    assert got.shape == (2, 3, k)
    assert same_bits(got.reshape(rows, k), want)
    # the chunked loop must give the same answer when a tensor spans several chunks
    monkeypatch.setattr(quants, "_CHUNK_BLOCKS", 5)
    assert same_bits(quants.dequantize(raw, qtype, (rows, k)), want)


# ---------------------------------------------------------------- affine form
@pytest.mark.parametrize("qtype", QUANTIZED)
def test_affine_reproduces_dequantize(qtype):
    spec = quants.block_spec(qtype)
    raw = random_blocks(qtype, 300, seed=100 + int(qtype))
    codes, scale, offset, group = spec.affine(raw)
    n = raw.shape[0]
    assert group == GROUP[qtype]
    assert codes.dtype == np.int8 and codes.shape == (n, spec.block_size)
    assert scale.dtype == offset.dtype == np.float32
    assert scale.shape == offset.shape == (n, spec.block_size // group)
    lo, hi = CODE_RANGE[qtype]
    assert codes.min() >= lo and codes.max() <= hi
    value = (scale[:, :, None] * codes.reshape(n, -1, group) + offset[:, :, None]).reshape(n, -1)
    want = spec.dequantize(raw)
    assert np.allclose(value, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("qtype", QUANTIZED)
def test_affine_rows(qtype, monkeypatch):
    monkeypatch.setattr(quants, "_CHUNK_BLOCKS", 4)
    spec = quants.block_spec(qtype)
    rows, k = 5, 3 * spec.block_size
    raw = random_blocks(qtype, rows * 3, seed=3)
    codes, scale, offset, group = quants.affine_rows(raw, qtype, (rows, k))
    assert codes.shape == (rows, k) and scale.shape == offset.shape == (rows, k // group)
    value = np.repeat(scale, group, axis=1) * codes + np.repeat(offset, group, axis=1)
    want = quants.dequantize(raw, qtype, (rows, k))
    assert np.allclose(value, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("qtype", FLOATS)
def test_affine_none_for_floats(qtype):
    raw = random_blocks(qtype, 8)
    assert quants.block_spec(qtype).affine(raw) is None
    assert quants.affine_rows(raw, qtype, (2, 4)) is None


# ---------------------------------------------------------------- quantize
def quantize_inputs(block_size: int) -> np.ndarray:
    """Gaussian rows plus the corner cases each quantizer must round like ggml does."""
    rng = np.random.default_rng(42)
    k = max(block_size, 32)
    gauss = rng.standard_normal((64, k)).astype(np.float32) * np.float32(3)
    special = np.zeros((6, k), np.float32)                  # row 0: all zeros
    special[1] = 1.25                                       # constant block
    special[2] = -np.linspace(0, 7, k, dtype=np.float32)    # negative value dominates
    special[3] = np.arange(k) - np.float32(15.5)            # halves: ties in roundf / trunc
    special[3, 0] = 127
    special[4] = rng.standard_normal(k) * np.float32(1e-30)  # tiny: subnormal f16 scales
    special[5] = np.float32(1) + np.arange(k) * np.float32(2.0 ** -9)  # bf16/f16 ties
    return np.concatenate([gauss, special])


@pytest.mark.parametrize("qtype", QUANTIZABLE)
def test_quantize_bit_exact(qtype):
    spec = quants.block_spec(qtype)
    x = quantize_inputs(spec.block_size)
    want = np.ascontiguousarray(ref.quantize(x, GGMLQuantizationType(int(qtype)))).view(np.uint8)
    got = quants.quantize(x, qtype)
    assert got.dtype == np.uint8
    assert got.shape == (x.shape[0], x.shape[1] // spec.block_size * spec.type_size)
    assert np.array_equal(got, want)
    # leading dimensions are kept
    got3 = quants.quantize(x.reshape(2, 35, -1), qtype)
    assert np.array_equal(got3.reshape(got.shape), got)


def test_bf16_quantize_nan_and_inf():
    x = np.array([np.nan, -np.inf, np.inf, 0.0, -0.0, 3.0e38], np.float32)
    x = np.concatenate([x, np.frombuffer(np.uint32(0x7F800001).tobytes(), np.float32)])
    want = ref.quantize(x, GGMLQuantizationType.BF16)
    assert np.array_equal(quants.quantize(x, QuantType.BF16), want)


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


@pytest.mark.parametrize("qtype", [QuantType.Q4_K, QuantType.Q5_K, QuantType.Q6_K])
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
        quants.dequantize(np.zeros(84, np.uint8), 10, (256,))
