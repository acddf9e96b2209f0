"""CPU reference backend ops against direct numpy formulas (it is the oracle for GPU kernels)."""

from __future__ import annotations

import numpy as np
import pytest

from service.backends.cpu.backend import CpuBackend
from service.gguf import quants
from service.gguf.quants import QuantType
from service.gguf.reader import TensorInfo
from tests.support.models import open_gguf

RNG = np.random.default_rng(7)
QUANTIZABLE = [QuantType.Q4_0, QuantType.Q4_1, QuantType.Q5_0, QuantType.Q5_1, QuantType.Q8_0,
               QuantType.F16, QuantType.BF16, QuantType.F32]


def tensor(name: str, w: np.ndarray, qt: QuantType) -> TensorInfo:
    raw = quants.quantize(w.astype(np.float32), qt).reshape(-1).view(np.uint8)
    return TensorInfo(name, qt, w.shape, raw)


@pytest.mark.parametrize("qt", QUANTIZABLE)
@pytest.mark.parametrize("T", [1, 3, 16])
def test_matmul_equals_dequantized_weights(qt, T):
    be = CpuBackend()
    w = RNG.standard_normal((48, 96)).astype(np.float32)
    t = tensor("w", w, qt)
    m = be.load_matrix([t])
    x = RNG.standard_normal((T, 96)).astype(np.float32)
    out = np.empty((T, 48), np.float32)
    be.matmul(x, m, out)
    ref = x.astype(np.float64) @ quants.dequantize(t.raw, qt, w.shape).T.astype(np.float64)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)


def test_k_quant_matmul_from_fixture_tensors():
    """Q4_K/Q5_K/Q6_K (no quantizer here) from the mixed-quant fixture model."""
    f = open_gguf("tiny-llama-mixq")
    be = CpuBackend()
    seen = set()
    for t in f.tensors.values():
        if t.qtype in (QuantType.Q4_K, QuantType.Q5_K, QuantType.Q6_K) and len(t.shape) == 2:
            seen.add(t.qtype)
            x = RNG.standard_normal((2, t.shape[1])).astype(np.float32)
            out = np.empty((2, t.shape[0]), np.float32)
            be.matmul(x, be.load_matrix([t]), out)
            ref = x @ quants.dequantize(t.raw, t.qtype, t.shape).T
            np.testing.assert_allclose(out, ref, rtol=1e-3, atol=1e-3)
    assert seen == {QuantType.Q4_K, QuantType.Q5_K, QuantType.Q6_K}


@pytest.mark.parametrize("name", ["Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS"])
@pytest.mark.parametrize("act_quant", [False, True])
def test_new_weight_types_matmul_equals_dequantized(name, act_quant):
    """Q2_K/Q3_K/IQ4_NL/IQ4_XS (no quantizer in gguf) from random valid blocks: the repacked
    matmul equals x @ dequantize(W)^T (gguf's decoder), with x first rounded as llama.cpp's CPU
    dot product rounds it (Q8_0 / Q8_K blocks) when act_quant is set."""
    from service.backends import act_quant as aq
    from tests.support.blocks import random_tensor_info

    be = CpuBackend(act_quant=act_quant)
    t = random_tensor_info(name, 40, 512, seed=11)
    m = be.load_matrix([t])
    w = quants.dequantize(t.raw, t.qtype, t.shape).astype(np.float64)       # (40, 512)
    for T in (1, 5, 40):                   # 40 > invariant_tokens: the dequantized tiles
        x = RNG.standard_normal((T, 512)).astype(np.float32)
        out = np.empty((T, 40), np.float32)
        be.matmul(x, m, out)
        xr = aq.llamacpp_round_trip(x, t.qtype) if act_quant else x
        ref = xr.astype(np.float64) @ w.T
        if act_quant:       # the rounding moved x by more than the float error: it was applied
            assert np.abs(x.astype(np.float64) @ w.T - ref).max() > 1e-3
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_fused_rows_equal_separate_matmuls():
    be = CpuBackend()
    ws = [RNG.standard_normal((n, 64)).astype(np.float32) for n in (32, 16, 16)]
    ts = [tensor(f"w{i}", w, QuantType.Q5_0) for i, w in enumerate(ws)]
    assert be.can_fuse(ts)
    x = RNG.standard_normal((2, 64)).astype(np.float32)
    fused = np.empty((2, 64), np.float32)
    be.matmul(x, be.load_matrix(ts), fused)
    parts = []
    for t in ts:
        o = np.empty((2, t.shape[0]), np.float32)
        be.matmul(x, be.load_matrix([t]), o)
        parts.append(o)
    np.testing.assert_array_equal(fused, np.concatenate(parts, axis=1))


def naive_attention(q, k, v, pos, window, scale):
    T, H, D = q.shape
    hkv = k.shape[1]
    out = np.zeros((T, H, v.shape[-1]))
    for t in range(T):
        for h in range(H):
            kh = h // (H // hkv)
            js = [j for j in range(pos[t] + 1) if not window or pos[t] - j < window]
            s = np.array([q[t, h] @ k[j, kh] for j in js]) * scale
            p = np.exp(s - s.max())
            p /= p.sum()
            out[t, h] = sum(pi * v[j, kh] for pi, j in zip(p, js, strict=True))
    return out


def written_cache(be, slots, pos, hkv: int, D: int, n_ctx: int):
    """A one-layer f16 cache of 2 slots with random K and V rows (n, hkv, D) f32 written at
    (slots[t], pos[t]); the cache, k and v."""
    n = len(pos)
    cache = be.new_kv_cache(1, 2, n_ctx, hkv, D, D, "f16", "f16")
    k = RNG.standard_normal((n, hkv, D)).astype(np.float32)
    v = RNG.standard_normal((n, hkv, D)).astype(np.float32)
    be.kv_write(cache, 0, k, v, slots, pos)
    return cache, k, v


@pytest.mark.parametrize("window", [0, 3])
def test_attention_causal_window_gqa(window):
    be = CpuBackend()
    n, H, hkv, D = 9, 4, 2, 8
    slots, pos = np.ones(n, np.int32), np.arange(n, dtype=np.int32)
    cache, k, v = written_cache(be, slots, pos, hkv, D, 16)
    q = RNG.standard_normal((n, H, D)).astype(np.float32)
    out = np.empty((n, H, D), np.float32)
    be.attention(q, cache, 0, slots, pos, n, window, 0.3, out)
    k16, v16 = k.astype(np.float16).astype(np.float64), v.astype(np.float16).astype(np.float64)
    np.testing.assert_allclose(out, naive_attention(q, k16, v16, pos, window, 0.3),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kv_type,qt", [(t, QuantType[t.upper()]) for t in
                                        ("f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0")])
def test_kv_cache_holds_what_the_type_represents(kv_type, qt):
    be = CpuBackend()
    cache = be.new_kv_cache(1, 1, 8, 2, 32, 32, kv_type, kv_type)
    k = RNG.standard_normal((3, 2, 32)).astype(np.float32)
    be.kv_write(cache, 0, k, k, np.zeros(3, np.int32), np.array([4, 5, 6], np.int32))
    expect = quants.dequantize(quants.quantize(k, qt), qt, k.shape)
    np.testing.assert_array_equal(cache.k[0][cache.rows(0, [4, 5, 6])], expect)
    assert not cache.k[0][cache.rows(0, np.arange(4))].any()


@pytest.mark.parametrize("neox", [False, True])
def test_rope_rotates_the_right_pairs(neox):
    be = CpuBackend()
    D, nd, base = 8, 6, 100.0
    table = be.rope_table(16, nd, base)
    x = RNG.standard_normal((2, 1, D)).astype(np.float32)
    pos = np.array([0, 5], np.int32)
    y = x.copy()
    be.rope(y, pos, table, neox)
    for t in range(2):
        for i in range(nd // 2):
            a, b = (i, i + nd // 2) if neox else (2 * i, 2 * i + 1)
            th = pos[t] * base ** (-2 * i / nd)
            ra = x[t, 0, a] * np.cos(th) - x[t, 0, b] * np.sin(th)
            rb = x[t, 0, a] * np.sin(th) + x[t, 0, b] * np.cos(th)
            np.testing.assert_allclose(y[t, 0, [a, b]], [ra, rb], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(y[t, 0, nd:], x[t, 0, nd:])   # beyond n_dims untouched


def test_norm_and_glu():
    be = CpuBackend()
    x = RNG.standard_normal((3, 16)).astype(np.float32)
    w = RNG.standard_normal(16).astype(np.float32)
    out = np.empty_like(x)
    be.rms_norm(x, w, 1e-6, out)
    ref = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(out, ref, rtol=1e-5)
    g, u = x, x[::-1].copy()
    be.glu(g, u, "silu", out)
    np.testing.assert_allclose(out, g / (1 + np.exp(-g)) * u, rtol=1e-5, atol=1e-6)
    be.glu(g, u, "gelu_tanh", out)
    gelu = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)))
    np.testing.assert_allclose(out, gelu * u, rtol=1e-5, atol=1e-6)


def test_argmax_first_of_ties():
    be = CpuBackend()
    logits = np.array([[1, 3, 3, 0], [5, 1, 5, 5]], np.float32)
    out = np.empty(2, np.int32)
    be.argmax(logits, out)
    assert out.tolist() == [1, 0]


@pytest.mark.parametrize("window", [0, 5])
def test_prefill_attention_matches_per_query(window):
    """Steps longer than 16 tokens use one masked batched product; same result (two slots)."""
    be = CpuBackend()
    n, H, hkv, D = 40, 4, 2, 8
    slots = np.array([0] * 20 + [1] * 20, np.int32)
    pos = np.concatenate([np.arange(20), np.arange(3, 23)]).astype(np.int32)
    cache, _, _ = written_cache(be, slots, pos, hkv, D, 64)
    q = RNG.standard_normal((n, H, D)).astype(np.float32)
    batched = np.empty((n, H, D), np.float32)
    be.attention(q, cache, 0, slots, pos, 23, window, 0.3, batched)
    per_query = np.empty((n, H, D), np.float32)
    for t in range(n):
        be.attention(q[t:t + 1], cache, 0, slots[t:t + 1], pos[t:t + 1], 23, window, 0.3,
                     per_query[t:t + 1])
    np.testing.assert_allclose(batched, per_query, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("T", [6, 40])     # per-query path and the masked (prefill) path
def test_padding_rows_store_nothing_and_attend_to_nothing(T):
    """Rows with slot -1 (a step padded to its capture size) leave every cache row as it was,
    get 0 from attention, and do not change the real rows' outputs."""
    be = CpuBackend(threads=1, invariant_tokens=16)
    rng = np.random.default_rng(21)
    n_pad = 3
    cache = be.new_kv_cache(1, 2, 64, 2, 16, 16, "f16", "f16")
    q = rng.standard_normal((T, 4, 16)).astype(np.float32)
    k = rng.standard_normal((T, 2, 16)).astype(np.float32)
    v = rng.standard_normal((T, 2, 16)).astype(np.float32)
    slots = np.zeros(T, np.int32)
    pos = np.arange(T, dtype=np.int32) - n_pad
    slots[:n_pad], pos[:n_pad] = -1, 0
    be.kv_write(cache, 0, k, v, slots, pos)
    slot1 = cache.rows(1, np.arange(64))                          # slot -1 is not slot 1
    assert not cache.k[0][slot1].any() and not cache.v[0][slot1].any()
    out = np.full((T, 4, 16), np.nan, np.float32)
    be.attention(q, cache, 0, slots, pos, T - n_pad, 0, 0.25, out)
    assert not out[:n_pad].any()
    ref = np.full((T - n_pad, 4, 16), np.nan, np.float32)
    be.attention(q[n_pad:], cache, 0, slots[n_pad:], pos[n_pad:], T - n_pad, 0, 0.25, ref)
    if T - n_pad <= be.invariant_tokens or T <= be.invariant_tokens:
        assert np.array_equal(out[n_pad:], ref)
    else:
        np.testing.assert_allclose(out[n_pad:], ref, rtol=1e-6, atol=1e-6)


def test_backend_kv_types_are_the_declared_ones():
    """Startup validation reads the supported pairs from service.formats.BACKEND_KV_TYPES; the CPU
    backend's class must implement exactly those (the CUDA one is checked in tests/gpu)."""
    from service.config import SUPPORTED_KV_PAIRS
    from service.formats import BACKEND_KV_TYPES as KV_TYPES
    from service.formats import supported_kv_pairs

    assert tuple(CpuBackend.kv_types) == KV_TYPES["cpu"]
    be = CpuBackend(threads=1)
    for t in KV_TYPES["cpu"]:                 # each declared type has a storage format
        cache = be.new_kv_cache(1, 1, 32, 1, 32, 32, t, t)
        k = RNG.standard_normal((1, 1, 32)).astype(np.float32)
        be.kv_write(cache, 0, k, k, np.zeros(1, np.int32), np.zeros(1, np.int32))
    assert SUPPORTED_KV_PAIRS == supported_kv_pairs("auto")
    assert len(supported_kv_pairs("cpu")) == len(KV_TYPES["cpu"]) ** 2
