"""The int8 tensor-core GEMV (cuda/gemv_mma.cu, CudaBackend(gemv_mma=True)) against the exact
product of the 8-bit activation blocks, the CPU backend and the dp4a GEMV (cuda/gemv.cu).

Error bounds (S = sum_k |w x^| per output, as in test_kernels.py): both GPU kernels compute every
32-group's integer dot product exactly and differ only in the float rounding of the scaling and
of the sums over groups (here <= 72 groups: a few dozen ulps of S, ~3e-6 S); 1e-4 S against
the exact product, 1e-5 S between the two kernels. A wrong nibble, scale, fragment slot or
column is an error of order S. Outputs are NaN-poisoned with a margin of 3 columns on each side:
a missing or stray write fails.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf.quants import dequantize

from service.backends.act_quant import round_activations
from service.backends.cpu.backend import CpuBackend
from tests.gpu.test_kernels import gpu_matmul, poisoned
from tests.support.blocks import random_tensor_info

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

TYPES = ("Q4_K", "Q6_K")
COLUMNS = (2, 5, 8, 9, 16, 40)        # NC = 8: 2, 5, 8; NC = 16: 9, 16, 40 (16 + 16 + 8)
SHAPES = ((37, 768), (70, 2304))      # N not a multiple of the 32 rows of a block; 3 and 9
                                      # super-blocks per row (fewer, and more, than 8 warps)


@pytest.fixture(scope="module")
def mma():
    """A backend whose GEMVs over Q4_K / Q6_K run on tensor cores at every width."""
    from service.backends.cuda.backend import CudaBackend

    return CudaBackend(graphs=False, prefill_gemm_min_tokens=None, gemv_mma=True)


def exact(t, x: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The product of W with x's 8-bit blocks x^ in float64, S = sum |w x^| (both (T, N)), and
    R = sum |w| |x - x^| (T, N): how far the CPU backend's float32 activations may move it."""
    W = dequantize(t.raw, t.qtype).reshape(n, k).astype(np.float64)        # (N, K)
    q, d = round_activations(x)
    xh = (q.reshape(len(x), -1, 32) * d[..., None].astype(np.float64)).reshape(len(x), k)
    return xh @ W.T, np.abs(xh) @ np.abs(W).T, np.abs(x - xh) @ np.abs(W).T


def on(backend, fn):
    """fn() on backend's stream, the device idle before and after (the backends' streams
    differ)."""
    cp.cuda.Device().synchronize()
    with backend.stream:
        out = fn()
    cp.cuda.Device().synchronize()
    return out


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("n,k", SHAPES)
def test_mma_gemv_against_exact_cpu_and_dp4a(cuda, mma, name, n, k):
    t = random_tensor_info(name, n, k, seed=n + k)
    wm = mma.load_matrix([t])
    wd = cuda.load_matrix([t])
    for be in (mma, cuda):
        be.prepare(max_tokens=64, n_head=1, head_dim_v=32, n_ctx=256, n_embd=k)
    cpu = CpuBackend()
    wc = cpu.load_matrix([t])
    rng = np.random.default_rng(k)
    launched = []
    launch = mma._launch
    mma._launch = lambda kname, *a: (launched.append(kname), launch(kname, *a))
    try:
        for T in COLUMNS:
            x = rng.normal(0, 1, (T, k)).astype(np.float32)
            got = on(mma, lambda x=x: gpu_matmul(mma, wm, x, n, pad=3))
            dp4a = on(cuda, lambda x=x: gpu_matmul(cuda, wd, x, n))
            assert np.isfinite(got).all(), (name, T)
            ref, S, rounding = exact(t, x, n, k)
            err = np.abs(got - ref)
            assert (err <= 1e-4 * S + 1e-7).all(), (name, T, float((err / (S + 1e-9)).max()))
            diff = np.abs(got - dp4a)
            assert (diff <= 1e-5 * S + 1e-7).all(), (name, T, float((diff / (S + 1e-9)).max()))
            ref_cpu = np.empty((T, n), np.float32)
            cpu.matmul(x, wc, ref_cpu)
            assert (np.abs(got - ref_cpu) <= rounding + 1e-4 * S + 1e-6).all(), (name, T)
    finally:
        del mma._launch                                   # the class's method again
    nc = {T: 8 if T <= 8 else 16 for T in COLUMNS}
    assert [s for s in launched if s.startswith("gemv_")] == [
        f"gemv_mma_{name.lower()}_c{nc[T]}" for T in COLUMNS]


@pytest.mark.parametrize("name", TYPES)
def test_mma_gemv_accumulates(cuda, mma, name):
    """matmul_add: out = out + W x, rounded once per element as the dp4a kernel's."""
    n, k = 45, 1024
    t = random_tensor_info(name, n, k, seed=5)
    wm = mma.load_matrix([t])
    mma.prepare(max_tokens=64, n_head=1, head_dim_v=32, n_ctx=256, n_embd=k)
    rng = np.random.default_rng(6)
    for T in (3, 12):
        x = rng.normal(0, 1, (T, k)).astype(np.float32)
        base = rng.normal(0, 1, (T, n)).astype(np.float32)

        def run(x=x, base=base):
            prod = poisoned(mma, (len(x), n))
            mma.matmul(cp.asarray(x), wm, prod)
            acc = cp.asarray(base)
            mma.matmul_add(cp.asarray(x), wm, acc, None)
            return mma.to_host(prod), mma.to_host(acc)

        prod, acc = on(mma, run)
        assert np.array_equal(acc, base + prod), (name, T)
        ref, S, _ = exact(t, x, n, k)
        assert (np.abs(prod - ref) <= 1e-4 * S + 1e-7).all(), (name, T)


@pytest.mark.parametrize("name", TYPES)
def test_a_column_gets_the_same_bits_at_every_width(mma, name):
    """The MMA mode's batch invariance: column c of a step of T columns (NC = 8 or 16, any
    neighbours) equals the same column computed alone, bit for bit."""
    n, k = 70, 2304
    t = random_tensor_info(name, n, k, seed=11)
    wm = mma.load_matrix([t])
    mma.prepare(max_tokens=64, n_head=1, head_dim_v=32, n_ctx=256, n_embd=k)
    rng = np.random.default_rng(12)
    x = rng.normal(0, 1, (40, k)).astype(np.float32)
    alone = np.concatenate([on(mma, lambda i=i: gpu_matmul(mma, wm, x[i:i + 1], n))
                            for i in range(40)])
    for T in (2, 8, 9, 16, 40):
        got = on(mma, lambda T=T: gpu_matmul(mma, wm, x[:T], n))
        assert np.array_equal(got, alone[:T]), (name, T)
    other = x.copy()
    other[1:] = rng.normal(0, 1, (39, k))                 # other neighbours, same column 0
    assert np.array_equal(on(mma, lambda: gpu_matmul(mma, wm, other[:16], n))[0], alone[0])
