"""Every CUDA kernel against the CPU reference (or the gguf package) on fresh random inputs.

Outputs are poisoned with NaN before each launch, so an element a kernel forgets to write
fails. Shapes are awkward on purpose: K not a multiple of 256 where the type allows, widths
past one warp's 32 groups, N not a multiple of the 8 rows a block computes (4 warps of 2), 1..16
columns and a 40-column prefill chunk. The fused kernels: test_fused_kernels.py.

Error bounds, derived:
- Quantized GEMV: activations become 8-bit blocks x^ = d q (|x - x^| <= d/2). Against the exact
  product with x^ (float64), the kernel's error is float32 rounding of its sums: about
  (groups per lane + butterfly levels + 4) ulps of S = sum |w x^|, under 2e-6 S for these widths;
  the bound used is 1e-4 S, still tens of thousands of times below what a wrong nibble or scale
  gives (an error of order S). Against the CPU backend's float32 activations, the rounding adds
  at most sum |w| |x - x^|, computed exactly from the same codes.
- Float GEMV: no rounding of x; 1e-5 S.
- Embedding rows, RoPE and KV-cache stores are computed with the reference's order of float
  operations and must be bit-identical.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf.quants import dequantize
from gguf.quants import quantize as gguf_quantize

from service.backends.act_quant import round_activations
from service.backends.cpu.backend import CpuBackend
from service.formats import KV_TYPES as KV_TYPE_LIST
from service.gguf.reader import TensorInfo
from tests.support.blocks import ALL_TYPES, block_size, qtype, random_tensor, random_tensor_info
from tests.support.kv_planes import planes_as_blocks

cp = pytest.importorskip("cupy")
KV_TYPES = [str(t) for t in KV_TYPE_LIST]
pytestmark = pytest.mark.gpu
N_ROWS = 37


def widths(name: str) -> list[int]:
    bs = block_size(name)
    if bs == 1:
        return [200, 512]                 # 200: not a multiple of 32
    if bs == 32:
        return [352, 1280]                # 11 groups (idle lanes), 40 groups (lanes loop)
    return [768, 2304]                    # 24 and 72 groups of K-quant super-blocks


def poisoned(cuda, shape):
    a = cuda.zeros(shape)
    a.fill(np.nan)
    return a


def gpu_matmul(cuda, w, x: np.ndarray, n: int, pad: int = 0) -> np.ndarray:
    """out[:, pad:pad + n] of a NaN-filled (T, n + 2 pad) buffer; the rest must stay NaN."""
    xg = cp.asarray(x)
    out = poisoned(cuda, (x.shape[0], n + 2 * pad))
    cuda.matmul(xg, w, out[:, pad:pad + n])
    host = cuda.to_host(out)
    if pad:
        assert np.isnan(host[:, :pad]).all() and np.isnan(host[:, pad + n:]).all()
    return host[:, pad:pad + n]


@pytest.mark.parametrize("name", ALL_TYPES)
def test_gemv_against_references(cuda, name):
    for k in widths(name):
        t = random_tensor_info(name, N_ROWS, k, seed=k)
        w = cuda.load_matrix([t])
        cuda.prepare(max_tokens=64, n_head=1, head_dim_v=32, n_ctx=256, n_embd=k)
        W = dequantize(t.raw, t.qtype).reshape(N_ROWS, k).astype(np.float64)   # (N, K)
        cpu = CpuBackend()
        wc = cpu.load_matrix([t])
        rng = np.random.default_rng(k + 1)
        for T in (1, 3, 16, 40):
            x = rng.normal(0, 1, (T, k)).astype(np.float32)
            got = gpu_matmul(cuda, w, x, N_ROWS, pad=3)
            assert np.isfinite(got).all()
            ref_cpu = np.empty((T, N_ROWS), np.float32)
            cpu.matmul(x, wc, ref_cpu)
            if block_size(name) == 1:
                S = np.abs(x.astype(np.float64)) @ np.abs(W).T
                ref = x.astype(np.float64) @ W.T
                assert (np.abs(got - ref) <= 1e-5 * S + 1e-7).all(), name
                assert (np.abs(got - ref_cpu) <= 2e-5 * S + 1e-6).all(), name
                continue
            q, d = round_activations(x)
            xh = (q.reshape(T, -1, 32) * d[..., None].astype(np.float64)).reshape(T, k)
            S = np.abs(xh) @ np.abs(W).T                                       # (T, N)
            ref = xh @ W.T
            err = np.abs(got - ref)
            assert (err <= 1e-4 * S + 1e-7).all(), (name, k, T, float((err / (S + 1e-9)).max()))
            rounding = np.abs(x - xh) @ np.abs(W).T
            assert (np.abs(got - ref_cpu) <= rounding + 1e-4 * S + 1e-6).all(), (name, k, T)


@pytest.fixture(scope="module")
def cuda_rows1():
    """A second backend on the one-row-per-warp GEMV (CudaBackend(gemv_rows=1))."""
    from service.backends.cuda.backend import CudaBackend

    return CudaBackend(graphs=False, gemv_rows=1, prefill_gemm_min_tokens=None)


@pytest.mark.parametrize("name", ALL_TYPES)
def test_gemv_columns_are_independent_of_the_step_size(cuda, cuda_rows1, name):
    """Column t of a launch of any width (each NC variant: 1, 2, 4, 8, 16 columns per block
    row, and chunks of 16 for 40) equals a 1-column launch of x[t] (c1r1p, c1r1e and c1r1),
    bit for bit, and so does the one-row-per-warp kernel's."""
    k = widths(name)[1]
    t = random_tensor_info(name, N_ROWS, k, seed=7)
    w = cuda.load_matrix([t])
    cuda.prepare(max_tokens=64, n_head=1, head_dim_v=32, n_ctx=256, n_embd=k)
    x = np.random.default_rng(8).normal(0, 1, (40, k)).astype(np.float32)
    wide = gpu_matmul(cuda, w, x, N_ROWS)
    for T in (2, 3, 5, 9, 16):
        part = gpu_matmul(cuda, w, x[:T], N_ROWS)
        assert np.array_equal(part, wide[:T]), T
    for i in (0, 5, 15, 16, 39):
        single = gpu_matmul(cuda, w, x[i:i + 1], N_ROWS)
        assert np.array_equal(single[0], wide[i]), i
    # the singles above ran on c1r1p for Q4_K / Q6_K (N_ROWS <= gemv_prefetch_rows), c1r1 else
    assert N_ROWS <= cuda.gemv_prefetch_rows
    prefetch = cuda.gemv_prefetch_rows
    # c1r1e: first weight group read early; c1r1: the plain loop (every type)
    for early, rows in ((True, prefetch), (False, 0)):
        cuda.gemv_early, cuda.gemv_prefetch_rows = early, rows
        try:
            for i in (0, 39):
                single = gpu_matmul(cuda, w, x[i:i + 1], N_ROWS)
                assert np.array_equal(single[0], wide[i]), (early, rows, i)
        finally:
            cuda.gemv_early, cuda.gemv_prefetch_rows = False, prefetch
    cp.cuda.Device().synchronize()               # the other backend runs on its own stream
    r1 = cuda_rows1
    w1 = r1.load_matrix([t])
    r1.prepare(max_tokens=64, n_head=1, head_dim_v=32, n_ctx=256, n_embd=k)
    with r1.stream:
        one_row = gpu_matmul(r1, w1, x, N_ROWS)
    assert np.array_equal(one_row, wide)


@pytest.mark.parametrize("name", ALL_TYPES)
def test_embedding_rows_are_bit_exact(cuda, name):
    k = widths(name)[0]
    t = random_tensor_info(name, 40, k, seed=3)
    table = cuda.load_embedding(t)
    ref = dequantize(t.raw, t.qtype).reshape(40, k).astype(np.float32)
    ids = np.array([3, 0, 39, 3, 17], np.int32)
    for scale in (1.0, 2.5):
        out = poisoned(cuda, (len(ids), k))
        cuda.embed(table, cp.asarray(ids), scale, out)
        want = ref[ids] if scale == 1.0 else ref[ids] * np.float32(scale)
        assert np.array_equal(cuda.to_host(out), want), (name, scale)


def test_rms_norm_add_glu_against_cpu(cuda):
    cpu, rng = CpuBackend(), np.random.default_rng(11)
    x = rng.normal(0, 2, (5, 7, 96)).astype(np.float32)
    w = rng.normal(1, 0.1, 96).astype(np.float32)
    out = poisoned(cuda, x.shape)
    cuda.rms_norm(cp.asarray(x), cp.asarray(w), 1e-6, out)
    ref = np.empty_like(x)
    cpu.rms_norm(x, w, 1e-6, ref)
    np.testing.assert_allclose(cuda.to_host(out), ref, rtol=2e-6, atol=1e-7)
    # In place on a strided view (per-head q norm inside the q|k|v row).
    qkv = rng.normal(0, 1, (3, 5 * 64 + 40)).astype(np.float32)
    g = cp.asarray(qkv)
    view = g[:, :320].reshape(3, 5, 64)
    wq = rng.normal(1, 0.1, 64).astype(np.float32)
    cuda.rms_norm(view, cp.asarray(wq), 1e-5, view)
    ref = qkv[:, :320].reshape(3, 5, 64).copy()
    cpu.rms_norm(ref, wq, 1e-5, ref)
    host = cuda.to_host(g)
    np.testing.assert_allclose(host[:, :320].reshape(3, 5, 64), ref, rtol=2e-6, atol=1e-7)
    assert np.array_equal(host[:, 320:], qkv[:, 320:])
    a = rng.normal(0, 1, (4, 300)).astype(np.float32)
    b = rng.normal(0, 1, 300).astype(np.float32)
    out = poisoned(cuda, a.shape)
    cuda.add(cp.asarray(a), cp.asarray(b), out)
    assert np.array_equal(cuda.to_host(out), a + b)
    for act in ("silu", "gelu_tanh"):
        gu = rng.normal(0, 3, (4, 2 * 300)).astype(np.float32)
        gg = cp.asarray(gu)
        out = poisoned(cuda, (4, 300))
        cuda.glu(gg[:, :300], gg[:, 300:], act, out)
        ref = np.empty((4, 300), np.float32)
        cpu.glu(gu[:, :300], gu[:, 300:], act, ref)
        # exp/tanh differ from numpy's by an ulp or two; for very negative g, gelu's
        # 1 + tanh(...) cancels, so that ulp of 1 is scaled by |g up|: bound it per element.
        bound = 1e-5 * np.abs(ref) + 4e-7 * np.abs(gu[:, :300] * gu[:, 300:]) + 1e-7
        assert (np.abs(cuda.to_host(out) - ref) <= bound).all(), act


@pytest.mark.parametrize("neox", [False, True])
def test_rope_is_bit_exact(cuda, neox):
    cpu, rng = CpuBackend(), np.random.default_rng(12)
    n_dims = 48                                   # partial rotary: 48 of 64 dims
    x = rng.normal(0, 1, (6, 4, 64)).astype(np.float32)
    pos = np.array([0, 1, 17, 300, 301, 511], np.int32)
    gx = cp.asarray(x)
    cuda.rope(gx, cp.asarray(pos), cuda.rope_table(512, n_dims, 10000.0), neox)
    ref = x.copy()
    cpu.rope(ref, pos, cpu.rope_table(512, n_dims, 10000.0), neox)
    assert np.array_equal(cuda.to_host(gx), ref)


def _kv_pair_caches(cuda, type_k, type_v, n_ctx=600, hkv=2, d=64):
    cpu = CpuBackend()
    cc = cpu.new_kv_cache(1, 2, n_ctx, hkv, d, d, type_k, type_v)
    gc = cuda.new_kv_cache(1, 2, n_ctx, hkv, d, d, type_k, type_v)
    rng = np.random.default_rng(13)
    for slot in (0, 1):
        for start in range(0, n_ctx, 150):       # write in steps of 150 rows
            n = min(150, n_ctx - start)
            k = rng.normal(0, 1, (n, hkv, d)).astype(np.float32)
            v = rng.normal(0, 1, (n, hkv, d)).astype(np.float32)
            pos = np.arange(start, start + n, dtype=np.int32)
            slots = np.full(n, slot, np.int32)
            cpu.kv_write(cc, 0, k, v, slots, pos)
            cuda.kv_write(gc, 0, cp.asarray(k), cp.asarray(v), cp.asarray(slots),
                          cp.asarray(pos))
    return cpu, cc, gc


def _gpu_cache_blocks(planes, kind: str) -> np.ndarray:
    """The GPU cache planes as ggml blocks (n, type_size) uint8 (tests.support.kv_planes)."""
    codes, side = (cp.asnumpy(p) if p is not None else None for p in planes)
    return planes_as_blocks(codes, side, kind)


def _gpu_cache_values(planes, kind: str, shape) -> np.ndarray:
    """Dequantize the GPU cache planes with the gguf package (planes -> ggml blocks)."""
    blocks = _gpu_cache_blocks(planes, kind)
    return dequantize(blocks.reshape(-1), qtype(kind.upper())).reshape(shape)


@pytest.mark.parametrize("kind", KV_TYPES)
def test_kv_store_is_bit_exact(cuda, kind):
    _, cc, gc = _kv_pair_caches(cuda, kind, kind)
    shape = cc.k[0].shape
    assert np.array_equal(_gpu_cache_values(gc.k[0], kind, shape), cc.k[0])
    assert np.array_equal(_gpu_cache_values(gc.v[0], kind, shape), cc.v[0])


def _awkward_rows(n_rows: int, d: int) -> np.ndarray:
    """(n_rows, 1, d) f32 rows whose 32-groups take every branch of ggml's quantizers: random
    groups, all zeros (d = 0), one constant (max == min), ties of |x| at both signs (the
    lowest index wins), a single spike, halves of rounding ties (x / d + 0.5 exact), huge and
    tiny magnitudes, and bf16 rounding ties, infinities and NaNs (group 9)."""
    rng = np.random.default_rng(41)
    x = rng.normal(0, 1, (n_rows, 1, d)).astype(np.float32)
    g = x.reshape(-1, 32)
    g[1] = 0.0
    g[2] = 0.75
    g[3, :] = rng.normal(0, 1, 32)
    g[3, [4, 9]] = [3.0, -3.0]
    g[4, :] = 0.0
    g[4, 17] = -5.0
    g[5] = (np.arange(32) - 16) / 2.0
    g[6] *= 1e30
    g[7] *= 1e-30
    g[8] = np.arange(32, dtype=np.float32) / 15.0
    bits = np.array([0x3F808000, 0x3F818000, 0x7F800000, 0xFF800000, 0x7F800001, 0xFFC12345,
                     0x00008000, 0x80018000], np.uint32).view(np.float32)
    g[9, :8] = bits
    return x


@pytest.mark.parametrize("kind", KV_TYPES)
def test_kv_store_blocks_equal_ggml_quantizer(cuda, kind):
    """The blocks the CUDA KV store writes equal gguf.quants.quantize's bytes for the same
    rows (the bf16 NaN/infinity/ties group only for bf16: ggml's integer quantizers have no
    NaN rule)."""
    n, d = 16, 64
    x = _awkward_rows(n, d)
    if kind != "bf16":          # NaN payloads: bf16's rule only (f16's cvt and numpy differ)
        x.reshape(-1, 32)[9, 4:6] = 1.0
    if kind not in ("f16", "bf16"):
        x.reshape(-1, 32)[9, :8] = 1.0
    gc = cuda.new_kv_cache(1, 1, n, 1, d, d, kind, kind, block_size=16)
    pos, slots = cp.arange(n, dtype=cp.int32), cp.zeros(n, cp.int32)
    cuda.kv_write(gc, 0, cp.asarray(x), cp.asarray(x), slots, pos)
    want = np.ascontiguousarray(gguf_quantize(x.reshape(n, d), qtype(kind.upper())))
    want = want.view(np.uint8).reshape(-1)                  # ggml's blocks, row after row
    for planes in (gc.k[0], gc.v[0]):
        got = _gpu_cache_blocks(planes, kind).reshape(-1)[: want.size]
        assert np.array_equal(got, want), kind


PAIRS = [(k, v) for k in KV_TYPES for v in KV_TYPES]      # all 49


@pytest.mark.parametrize("type_k,type_v", PAIRS)
def test_attention_against_cpu(cuda, type_k, type_v):
    """Queries across split boundaries (chunks of 128 positions), GQA 8/2, windows, 2 slots.
    Softmax weights and sums run in float32 in another order than numpy's: 1e-5 of the
    output's scale is ~10x their rounding; a wrong key, mask or split merge is off by O(1)."""
    cpu, cc, gc = _kv_pair_caches(cuda, type_k, type_v)
    cuda.prepare(max_tokens=16, n_head=8, head_dim_v=64, n_ctx=600, n_embd=64)
    rng = np.random.default_rng(14)
    pos = np.array([0, 5, 255, 256, 300, 511, 599, 599], np.int32)
    slots = np.array([0, 1, 0, 1, 0, 1, 0, 1], np.int32)
    q = rng.normal(0, 1, (8, 8, 64)).astype(np.float32)
    for window in (0, 100):
        out = poisoned(cuda, (8, 8, 64))
        cuda.attention(cp.asarray(q), gc, 0, cp.asarray(slots), cp.asarray(pos), 600, window,
                       0.125, out)
        ref = np.empty((8, 8, 64), np.float32)
        cpu.attention(q, cc, 0, slots, pos, 600, window, 0.125, ref)
        got = cuda.to_host(out)
        assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max(), (window,)
        for i in (0, 4, 7):                      # the same query alone: the same bits
            one = poisoned(cuda, (1, 8, 64))
            cuda.attention(cp.asarray(q[i:i + 1]), gc, 0, cp.asarray(slots[i:i + 1]),
                           cp.asarray(pos[i:i + 1]), 600, window, 0.125, one)
            assert np.array_equal(cuda.to_host(one)[0], got[i]), (window, i)


def test_argmax_lowest_index_on_ties(cuda):
    rng = np.random.default_rng(15)
    x = rng.normal(0, 1, (5, 50000)).astype(np.float32)
    x[1, [7, 4000, 49999]] = 10.0                # ties: the lowest index wins
    x[2, :] = -np.inf
    x[3, 49999] = 99.0
    out = cuda.zeros((5,), "int32")
    out.fill(-1)
    cuda.argmax(cp.asarray(x), out)
    got = cuda.to_host(out)
    assert got.tolist() == np.argmax(x, axis=1).tolist()
    assert got[1] == 7 and got[2] == 0 and got[3] == 49999


@pytest.mark.parametrize("name,f,e", [("Q8_0", 64, 96), ("IQ4_NL", 64, 96), ("Q2_K", 256, 256),
                                      ("Q3_K", 256, 512), ("IQ4_XS", 512, 256)])
def test_moe_against_cpu(cuda, name, f, e):
    """Routing (softmax, top-4 of 8, renormalized), gathered expert GEMVs and the weighted
    sum, experts in each weight type MoE files ship in. Two 8-bit activation roundings (the
    experts' inputs and the down projection's) give the GPU an error of about 1% of the output
    scale against float32 activations; 3% bounds it, a wrong expert choice or weight moves
    outputs by their full scale."""
    rng = np.random.default_rng(16)
    n_exp = 8
    # a matrix loaded alone is kept by name in the session's backend: one name per case
    router = TensorInfo(f"moe.router.{name}.{e}", qtype("F32"), (n_exp, e),
                        rng.normal(0, 1, n_exp * e).astype(np.float32).view(np.uint8))
    mats = {}
    for nm, shape in (("gate", (n_exp, f, e)), ("up", (n_exp, f, e)), ("down", (n_exp, e, f))):
        raw = random_tensor(name, shape[0] * shape[1], shape[2], rng)
        mats[nm] = TensorInfo(nm, qtype(name), shape, raw)
    cpu = CpuBackend()
    wc = [cpu.load_matrix([router])] + [cpu.load_experts(mats[n]) for n in ("gate", "up", "down")]
    wg = [cuda.load_matrix([router])] + [cuda.load_experts(mats[n]) for n in ("gate", "up", "down")]
    cuda.prepare(max_tokens=8, n_head=1, head_dim_v=32, n_ctx=256, n_embd=e, moe_experts=n_exp,
                 moe_used=4, moe_ff=f)
    x = rng.normal(0, 1, (6, e)).astype(np.float32)
    ref = np.empty((6, e), np.float32)
    cpu.moe(x, *wc, 4, True, "silu", ref)
    out = poisoned(cuda, (6, e))
    cuda.moe(cp.asarray(x), *wg, 4, True, "silu", out)
    got = cuda.to_host(out)
    assert np.abs(got - ref).max() <= 0.03 * np.abs(ref).max()
