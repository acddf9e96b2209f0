"""The fused CUDA kernels against their unfused compositions.

Each fused op is checked two ways: against the same ops launched separately on the GPU, bit for
bit (every fused kernel's header promises the separate kernels' rounding), and against the CPU
reference's composition (bit for bit where the separate kernels are, e.g. RoPE and KV stores;
else the separate kernels' bounds from test_kernels.py). The 8-bit activation blocks a fused op
leaves for the next GEMV are read back from the backend's scratch and must equal
act_quant.round_activations of the op's output (quantize_act's rounding) exactly. Outputs,
caches and the block scratch are poisoned (NaN, 0xff bytes, code -128 which no rounding
produces) before each launch.
"""

from __future__ import annotations

import numpy as np
import pytest

from service.backends.act_quant import round_activations
from service.backends.base import Backend
from service.backends.cpu.backend import CpuBackend
from tests.gpu.test_kernels import KV_TYPES, _gpu_cache_values, poisoned
from tests.support.blocks import random_tensor_info
from tests.support.fused import qkv_views

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu
RNG = np.random.default_rng(31)
PAIRS = [(k, v) for k in KV_TYPES for v in KV_TYPES]      # all 49


def normal(*shape, scale=1.0) -> np.ndarray:
    return RNG.normal(0, scale, shape).astype(np.float32)


def prepared(cuda, k: int, n_head: int = 8, head_dim_v: int = 64, n_ctx: int = 600):
    """A Q8_0 matrix of width k (the block scratch is sized by the widest matrix loaded) and
    the step buffers; returns the matrix."""
    w = cuda.load_matrix([random_tensor_info("Q8_0", 40, k, seed=k)])
    cuda.prepare(max_tokens=16, n_head=n_head, head_dim_v=head_dim_v, n_ctx=n_ctx, n_embd=k)
    return w


def poison_blocks(cuda) -> None:
    cuda._s.qa.fill(-128)
    cuda._s.ads.fill(np.nan)


def assert_blocks_of(cuda, values: np.ndarray) -> None:
    """The scratch holds the 8-bit blocks of values (rows, K), as quantize_act makes them."""
    rows, k = values.shape
    q, d = round_activations(values)
    qa = cuda.to_host(cuda._s.qa[: rows * k]).reshape(rows, k)
    ads = cuda.to_host(cuda._s.ads[: rows * k // 32]).reshape(rows, k // 32, 2)
    assert np.array_equal(qa, q)
    assert np.array_equal(ads[..., 0], d)
    assert np.array_equal(ads[..., 1], q.reshape(rows, -1, 32).sum(-1).astype(np.float32))


def matmul_of(cuda, x, w, out=None) -> np.ndarray:
    """x @ W^T; pass `out` allocated before the op that produced x (an allocation forgets the
    blocks the op left, so the GEMV would quantize x again)."""
    out = poisoned(cuda, (x.shape[0], w.n)) if out is None else out
    cuda.matmul(x, w, out)
    return cuda.to_host(out)


def test_rms_norm_for_matmul(cuda):
    D = 576                                      # 18 groups: warps loop past the block
    w = prepared(cuda, D)
    x, nw = cp.asarray(normal(5, D, scale=2.0)), cp.asarray(normal(D, scale=0.1) + 1)
    ref = poisoned(cuda, (5, D))
    cuda.rms_norm(x, nw, 1e-6, ref)
    y_ref = matmul_of(cuda, ref, w)              # quantize_act + GEMV
    out, y = poisoned(cuda, (5, D)), poisoned(cuda, (5, w.n))
    poison_blocks(cuda)
    cuda.rms_norm_for_matmul(x, nw, 1e-6, out)
    assert cuda._blocks is not None              # the fused kernel ran, not the fallback
    got = cuda.to_host(out)
    assert np.array_equal(got, cuda.to_host(ref))
    assert_blocks_of(cuda, got)
    assert np.array_equal(matmul_of(cuda, out, w, y), y_ref)   # GEMV on the fused blocks
    cpu = np.empty((5, D), np.float32)
    CpuBackend().rms_norm(cuda.to_host(x), cuda.to_host(nw), 1e-6, cpu)
    np.testing.assert_allclose(got, cpu, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("D", [576, 2048, 4096, 8448])    # 8448: past the registers' row
def test_rms_norm_for_matmul_slices(cuda, D):
    """A row's norm split over 2..16 blocks (NormOps.slices) writes the bits of one block:
    the normalized rows and their 8-bit blocks, one row and several."""
    prepared(cuda, D)
    x, nw = cp.asarray(normal(3, D, scale=2.0)), cp.asarray(normal(D, scale=0.1) + 1)
    saved = cuda.norm_slices
    try:
        outs = {}
        for slices in (1, 2, 5, 8, 16):
            cuda.norm_slices = slices
            for T in (1, 3):
                out = poisoned(cuda, (T, D))
                poison_blocks(cuda)
                cuda.rms_norm_for_matmul(x[:T], nw, 1e-6, out)
                assert cuda._blocks is not None
                got = cuda.to_host(out)
                assert_blocks_of(cuda, got)
                outs[slices, T] = got
        for (slices, T), got in outs.items():
            assert np.array_equal(got, outs[1, T]), (slices, T)
    finally:
        cuda.norm_slices = saved
    assert cuda._norm.slices_for(1, D) == min(saved, -(-D // min(256, D)))


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_glu_for_matmul(cuda, act):
    F = 320
    w = prepared(cuda, F)
    gu = cp.asarray(normal(4, 2 * F, scale=3.0))
    ref = poisoned(cuda, (4, F))
    cuda.glu(gu[:, :F], gu[:, F:], act, ref)
    y_ref = matmul_of(cuda, ref, w)
    out, y = poisoned(cuda, (4, F)), poisoned(cuda, (4, w.n))
    poison_blocks(cuda)
    cuda.glu_for_matmul(gu[:, :F], gu[:, F:], act, out)
    assert cuda._blocks is not None
    got = cuda.to_host(out)
    assert np.array_equal(got, cuda.to_host(ref))
    assert_blocks_of(cuda, got)
    assert np.array_equal(matmul_of(cuda, out, w, y), y_ref)


@pytest.mark.parametrize("name", ["Q4_K", "Q5_0", "F16"])
def test_matmul_add_equals_matmul_then_add(cuda, name):
    k = 768
    t = random_tensor_info(name, 37, k, seed=5)
    w = cuda.load_matrix([t])
    cuda.prepare(max_tokens=16, n_head=1, head_dim_v=32, n_ctx=256, n_embd=k)
    for T in (1, 3, 16):
        a, x = cp.asarray(normal(T, k)), normal(T, 37)
        prod = poisoned(cuda, (T, 37))
        cuda.matmul(a, w, prod)
        want = poisoned(cuda, (T, 37))
        cuda.add(cp.asarray(x), prod, want)
        got, tmp = cp.asarray(x), poisoned(cuda, (T, 37))
        cuda.matmul_add(a, w, got, tmp)
        assert np.array_equal(cuda.to_host(got), cuda.to_host(want)), (name, T)
        # against the CPU: the GEMV bounds of test_kernels.py, plus the add's half ulp
        cpu, ah = CpuBackend(), cuda.to_host(a)
        ref, scratch = x.copy(), np.empty((T, 37), np.float32)
        cpu.matmul_add(ah, cpu.load_matrix([t]), ref, scratch)
        W = _dense(t).astype(np.float64)
        if t.qtype.name.startswith("F"):
            bound = 2e-5 * (np.abs(ah) @ np.abs(W).T) + 1e-6
        else:
            qq, d = round_activations(ah)
            xh = (qq.reshape(T, -1, 32) * d[..., None].astype(np.float64)).reshape(T, k)
            bound = np.abs(ah - xh) @ np.abs(W).T + 1e-4 * (np.abs(xh) @ np.abs(W).T) + 1e-6
        bound += 1e-6 * np.abs(ref)
        assert (np.abs(cuda.to_host(got) - ref) <= bound).all(), (name, T)


@pytest.mark.parametrize("name,n,k", [("Q4_K", 576, 768), ("Q6_K", 4096, 1024),
                                      ("Q8_0", 640, 512), ("Q4_1", 2048, 256),
                                      ("Q4_K", 8192, 256)])
@pytest.mark.parametrize("mma", [False, True], ids=["dp4a", "mma"])
def test_matmul_add_norm_equals_the_two_ops(cuda, name, n, k, mma):
    """The one-column residual GEMV whose last block normalizes the row (c1r1n, c1r1pn at
    <= gemv_prefetch_rows rows; with gemv_mma the tensor-core family's c1n / c1pn) gives the
    bits of matmul_add then rms_norm_for_matmul in the same mode, and leaves the norm's 8-bit
    blocks for the next GEMV; the counter is back at 0 each time."""
    assert not cuda.fuse_norm and not cuda.gemv_mma                # the defaults
    cuda.gemv_mma = mma
    try:
        _matmul_add_norm_case(cuda, name, n, k, mma)
    finally:
        cuda.gemv_mma = False


def _matmul_add_norm_case(cuda, name, n, k, mma):
    w = cuda.load_matrix([random_tensor_info(name, n, k, seed=n + k)])
    nxt = cuda.load_matrix([random_tensor_info("Q8_0", 40, n, seed=3)])   # reads the norm blocks
    cuda.prepare(max_tokens=16, n_head=1, head_dim_v=32, n_ctx=256, n_embd=max(n, k))
    nw = cp.asarray(normal(n, scale=0.1) + 1)
    for rep in range(3):                                           # counter reset each time
        a, x = cp.asarray(normal(1, k)), normal(1, n, scale=2.0)
        want_x, tmp, want_h = cp.asarray(x), poisoned(cuda, (1, n)), poisoned(cuda, (1, n))
        cuda.matmul_add_norm(a, w, want_x, tmp, nw, 1e-5, want_h)   # fuse_norm off: 2 ops
        y_want = matmul_of(cuda, want_h, nxt)
        got_x, got_h, y = cp.asarray(x), poisoned(cuda, (1, n)), poisoned(cuda, (1, nxt.n))
        poison_blocks(cuda)
        names, launch = [], cuda._launch

        def recorded(kernel, *args, names=names, launch=launch, **kwargs):
            names.append(kernel)
            launch(kernel, *args, **kwargs)

        cuda._launch = recorded                    # an instance attribute shadows the method
        cuda.fuse_norm = True
        try:
            cuda.matmul_add_norm(a, w, got_x, tmp, nw, 1e-5, got_h)
        finally:
            del cuda._launch
            cuda.fuse_norm = False
        pf = "p" if n <= 4096 and name in ("Q4_K", "Q6_K") else ""
        t = w.layout.kernel
        want = f"gemv_mma_{t}_c1{pf}n" if mma else f"gemv_{t}_c1r1{pf}n"
        assert [k for k in names if k.startswith("gemv_")] == [want]
        assert np.array_equal(cuda.to_host(got_x), cuda.to_host(want_x)), (name, rep)
        got = cuda.to_host(got_h)
        assert np.array_equal(got, cuda.to_host(want_h)), (name, rep)
        assert_blocks_of(cuda, got)
        assert np.array_equal(matmul_of(cuda, got_h, nxt, y), y_want), (name, rep)
        assert int(cuda.to_host(cuda._s.gemv_done)[0]) == 0


def _dense(t) -> np.ndarray:
    from gguf.quants import dequantize

    return dequantize(t.raw, t.qtype).reshape(t.shape).astype(np.float32)


def test_rms_norm_add_equals_norm_then_add(cuda):
    D = 640
    o, x, nw = normal(3, D, scale=4.0), normal(3, D), normal(D, scale=0.1) + 1
    go, gw = cp.asarray(o), cp.asarray(nw)
    normed = poisoned(cuda, (3, D))
    cuda.rms_norm(go, gw, 1e-6, normed)
    want = poisoned(cuda, (3, D))
    cuda.add(cp.asarray(x), normed, want)
    got = cp.asarray(x)
    cuda.rms_norm_add(go, gw, 1e-6, got)
    assert np.array_equal(cuda.to_host(got), cuda.to_host(want))
    ref, cpu_normed = x.copy(), o.copy()
    CpuBackend().rms_norm_add(cpu_normed, nw, 1e-6, ref)   # leaves the normed o in cpu_normed
    # rms_norm's bound (test_kernels.py, 2e-6 relative) on the normed term, plus the add's ulp
    bound = 2e-6 * np.abs(cpu_normed) + 1e-6 * np.abs(ref) + 1e-7
    assert (np.abs(cuda.to_host(got) - ref) <= bound).all()


def _poisoned_cache(cuda, type_k, type_v, n_ctx, hkv, d):
    c = cuda.new_kv_cache(1, 2, n_ctx, hkv, d, d, type_k, type_v)
    for planes in (c.k[0], c.v[0]):
        for p in planes:
            if p is not None:                    # f16 NaN bits / NaN scales
                p.fill(np.iinfo(p.dtype).max)
    return c


@pytest.mark.parametrize("type_k,type_v", PAIRS)
@pytest.mark.parametrize("neox", [False, True])
def test_rope_kv(cuda, type_k, type_v, neox):
    """rope_kv against rms_norm + rope + rope + kv_write launched separately (bit for bit,
    with q/k norms and a padding row), and without norms against the CPU reference."""
    T, H, hkv, D, n_ctx = 6, 8, 2, 64, 300
    table = cuda.rope_table(n_ctx, 48, 10000.0)            # partial rotary
    pos = np.array([0, 1, 130, 299, 5, 7], np.int32)
    slots = np.array([0, 1, 0, 1, -1, 1], np.int32)        # row 4 is padding
    gpos, gslots = cp.asarray(pos), cp.asarray(slots)
    qkv = normal(T, (H + 2 * hkv) * D, scale=2.0)
    qn, kn = cp.asarray(normal(D, scale=0.1) + 1), cp.asarray(normal(D, scale=0.1) + 1)
    for norms in (True, False):
        a, b = cp.asarray(qkv), cp.asarray(qkv)
        ca = _poisoned_cache(cuda, type_k, type_v, n_ctx, hkv, D)
        cb = _poisoned_cache(cuda, type_k, type_v, n_ctx, hkv, D)
        norm_q, norm_k = (qn, kn) if norms else (None, None)
        q, k, v = qkv_views(a, T, H, hkv, D)
        cuda.rope_kv(q, k, v, norm_q, norm_k, 1e-6, gpos, gslots, table, neox, ca, 0)
        q2, k2, v2 = qkv_views(b, T, H, hkv, D)
        # the base class's composition: rms_norm, rope, rope and kv_write as separate launches
        Backend.rope_kv(cuda, q2, k2, v2, norm_q, norm_k, 1e-6, gpos, gslots, table, neox, cb, 0)
        assert np.array_equal(cuda.to_host(q), cuda.to_host(q2)), norms
        for pa, pb in zip(ca.k[0] + ca.v[0], cb.k[0] + cb.v[0], strict=True):
            if pa is not None:
                assert np.array_equal(cuda.to_host(pa), cuda.to_host(pb)), norms
    # no norms, against the CPU composition on the rows that are not padding (the CPU
    # reference has no padding rows: its store of row 4 lands in slot -1, never compared)
    keep = slots >= 0
    cpu = CpuBackend()
    cc = cpu.new_kv_cache(1, 2, n_ctx, hkv, D, D, type_k, type_v)
    ref = qkv.copy()
    q3, k3, v3 = qkv_views(ref, T, H, hkv, D)
    ctable = cpu.rope_table(n_ctx, 48, 10000.0)
    cpu.rope_kv(q3, k3, v3, None, None, 1e-6, pos, slots, ctable, neox, cc, 0)
    assert np.array_equal(cuda.to_host(q), q3)
    shape = cc.k[0].shape                                            # (pool rows, Hkv, D)
    rows = cc.rows_of(slots[keep], pos[keep])      # both caches: the identity block table
    for planes, kind, want in ((ca.k[0], type_k, cc.k[0]), (ca.v[0], type_v, cc.v[0])):
        got = _gpu_cache_values(planes, kind, shape)
        assert np.array_equal(got[rows], want[rows]), kind
        written = ~np.isnan(got).all(axis=(1, 2))                        # (pool rows,)
        assert written.sum() == keep.sum(), kind  # nothing else, padding row included


def test_attention_for_matmul_writes_its_output_blocks(cuda):
    """The split-KV attention with its combine in the same launch: the output with blocks
    equals the plain launch's; the per-(token, head) counters return to 0, so launching again
    gives the same bits."""
    from tests.gpu.test_kernels import _kv_pair_caches

    _, _, gc = _kv_pair_caches(cuda, "q8_0", "f16")
    w = prepared(cuda, 8 * 64)
    pos = np.array([0, 127, 128, 300, 599, 599], np.int32)
    slots = np.array([0, 1, 0, 1, 0, 1], np.int32)
    q = cp.asarray(normal(6, 8, 64))
    args = (gc, 0, cp.asarray(slots), cp.asarray(pos), 600, 0, 0.125)
    plain = poisoned(cuda, (6, 8, 64))
    cuda.attention(q, *args, plain)
    y_ref = matmul_of(cuda, plain.reshape(6, 512), w)
    for _ in range(2):
        out, y = poisoned(cuda, (6, 8, 64)), poisoned(cuda, (6, w.n))
        poison_blocks(cuda)
        cuda.attention_for_matmul(q, *args, out)
        assert cuda._blocks is not None
        got = cuda.to_host(out)
        assert np.array_equal(got, cuda.to_host(plain))
        assert_blocks_of(cuda, got.reshape(6, 512))
        assert np.array_equal(matmul_of(cuda, out.reshape(6, 512), w, y), y_ref)
    assert not cuda.to_host(cuda._s.counters).any()
