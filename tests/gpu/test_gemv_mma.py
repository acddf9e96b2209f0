"""The int8 tensor-core GEMV (cuda/gemv_mma.cu, CudaBackend(gemv_mma=True)) against the exact
product of the 8-bit activation blocks, the CPU backend and the dp4a GEMV (cuda/gemv.cu), for
every type of kernels.GEMV_MMA_TYPES at 1..64 columns (every tile: 8, 16, 32, 64, and each side
of its edges).

Error bounds (S = sum_k |w x^| per output, as in test_kernels.py): both GPU kernels compute every
32-group's integer dot product exactly and differ only in the float rounding of the scaling and
of the sums over groups (here <= 136 groups: a few dozen ulps of S, ~3e-6 S); 1e-4 S against
the exact product, 2e-5 S between the two kernels. A wrong nibble, scale, fragment slot or
column is an error of order S. Outputs are NaN-poisoned with a margin of 3 columns on each side:
a missing or stray write fails. A column's bits are the same at every width and whatever its
neighbours (the mode's batch invariance): compared bit for bit with the column computed alone.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf.quants import dequantize

from service.backends.act_quant import round_activations
from service.backends.cpu.backend import CpuBackend
from service.backends.cuda.kernels import GEMV_MMA_TYPES, GEMV_PREFETCH_TYPES
from service.backends.cuda.types import gemv_mma_kernel
from tests.gpu.test_kernels import gpu_matmul, poisoned
from tests.support.blocks import block_size, random_tensor_info

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

TYPES = tuple(t.upper() for t in GEMV_MMA_TYPES)
# tiles 8 / 16 / 32 / 64 (types.gemv_mma_nc) and each side of their edges
COLUMNS = (1, 2, 7, 8, 9, 16, 17, 31, 32, 33, 63, 64)
# N never a multiple of the 16 or 32 rows of a block. K-quants: 3, 9 and 17 super-blocks per row
# (fewer, and more, than the 8 warps of the split-K; 17: three steps for warp 0). 32-element
# types: 18, 72 and 65 groups, a warp's step being 4 of them (a short last step of 2 and 1).
SHAPES = {256: ((37, 768), (70, 2304), (45, 4352)), 32: ((37, 576), (70, 2304), (45, 2080))}


def shapes(name: str):
    return SHAPES[block_size(name)]


@pytest.fixture(scope="module")
def mma():
    """A backend whose GEMVs over the GEMV_MMA_TYPES run on tensor cores at every width."""
    from service.backends.cuda.backend import CudaBackend

    return CudaBackend(graphs=False, prefill_gemm_min_tokens=None, gemv_mma=True)


def exact(t, x: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The product of W with x's 8-bit blocks x^ in float64, S = sum |w x^| (both (T, N)), and
    R = sum |w| |x - x^| (T, N): how far the CPU backend's float32 activations may move it."""
    W = dequantize(t.raw, t.qtype).reshape(n, k).astype(np.float64)        # (N, K)
    q, d = round_activations(x)
    xh = (q.reshape(len(x), -1, 32) * d[..., None].astype(np.float64)).reshape(len(x), k)
    return xh @ W.T, np.abs(xh) @ np.abs(W).T, np.abs(x - xh) @ np.abs(W).T


def on(backend, fn, *args):
    """fn(*args) on backend's stream, the device idle before and after (the backends' streams
    differ)."""
    cp.cuda.Device().synchronize()
    with backend.stream:
        out = fn(*args)
    cp.cuda.Device().synchronize()
    return out


def rel(err: np.ndarray, S: np.ndarray) -> float:
    return float((err / (S + 1e-9)).max())


@pytest.mark.parametrize("name", TYPES)
def test_mma_gemv_against_exact_cpu_and_dp4a(cuda, mma, name):
    for n, k in shapes(name):
        launched = against_references(cuda, mma, name, n, k)
        t = name.lower()
        prefetch = n <= mma.gemv_prefetch_rows and t in GEMV_PREFETCH_TYPES
        assert [s for s in launched if s.startswith("gemv_")] == [
            gemv_mma_kernel(T, t, prefetch) for T in COLUMNS], (name, n, k)


def against_references(cuda, mma, name: str, n: int, k: int) -> list[str]:
    """Every width of COLUMNS on an (n, k) matrix of `name`: the tensor-core GEMV against the
    exact product, the dp4a GEMV and the CPU backend -> the kernels mma launched."""
    t = random_tensor_info(name, n, k, seed=n + k)
    wm = mma.load_matrix([t])
    wd = cuda.load_matrix([t])
    for be in (mma, cuda):
        be.prepare(max_tokens=64, n_head=1, head_dim_v=32, n_ctx=256, n_embd=k)
    cpu = CpuBackend()
    wc = cpu.load_matrix([t])
    rng = np.random.default_rng(k)
    launched: list[str] = []
    launch = mma._launch
    mma._launch = lambda kname, *a: (launched.append(kname), launch(kname, *a))
    try:
        for T in COLUMNS:
            x = rng.normal(0, 1, (T, k)).astype(np.float32)
            got = on(mma, gpu_matmul, mma, wm, x, n, 3)
            dp4a = on(cuda, gpu_matmul, cuda, wd, x, n)
            what = (name, n, k, T)
            assert np.isfinite(got).all(), what
            ref, S, rounding = exact(t, x, n, k)
            err = np.abs(got - ref)
            assert (err <= 1e-4 * S + 1e-7).all(), (*what, rel(err, S))
            diff = np.abs(got - dp4a)
            assert (diff <= 2e-5 * S + 1e-7).all(), (*what, rel(diff, S))
            ref_cpu = np.empty((T, n), np.float32)
            cpu.matmul(x, wc, ref_cpu)
            assert (np.abs(got - ref_cpu) <= rounding + 1e-4 * S + 1e-6).all(), what
    finally:
        del mma._launch                                   # the class's method again
    return launched


@pytest.mark.parametrize("name", TYPES)
def test_mma_gemv_accumulates(cuda, mma, name):
    """matmul_add: out = out + W x, rounded once per element as the dp4a kernel's."""
    n, k = 45, 1024
    t = random_tensor_info(name, n, k, seed=5)
    wm = mma.load_matrix([t])
    mma.prepare(max_tokens=64, n_head=1, head_dim_v=32, n_ctx=256, n_embd=k)
    rng = np.random.default_rng(6)
    for T in (3, 12, 20, 50):
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
    """The MMA mode's batch invariance: column c of a step of T columns (every tile, any
    neighbours) equals the same column computed alone, bit for bit."""
    for n, k in shapes(name)[1:]:
        same_bits_at_every_width(mma, name, n, k)


@pytest.mark.parametrize("name", TYPES)
def test_one_column_kernels_give_the_tiles_bits(mma, name):
    """gemv_mma_<type>_c1 and _c1p (one warp per row, dp4a dot products added in the tiles'
    order) and _c1s / _c1sp (the tiles' split of K over a block's warps) against column 0 of a
    2-column step (the 8-column tile) and each other, bit for bit, on matrices of 3 to 17
    super-blocks / 18 to 72 blocks per row (units fewer and more than the tiles' warps, a short
    last unit; row counts not a multiple of a split block's rows)."""
    from service.backends.cuda.backend import CudaBackend

    plain = CudaBackend(graphs=False, prefill_gemm_min_tokens=None, gemv_mma=True,
                        gemv_prefetch_rows=0)
    split = {one: CudaBackend(graphs=False, prefill_gemm_min_tokens=None, gemv_mma=True,
                              gemv_mma_one=one.replace("loop", "split-p"))
             for one in ("split", "split-p", "loop")}
    split["loop"].gemv_split_blocks = 2           # each block loops over row groups
    for n, k in shapes(name):
        t = random_tensor_info(name, n, k, seed=n * k)
        rng = np.random.default_rng(n)
        x = rng.normal(0, 1, (2, k)).astype(np.float32)
        got = {}
        for label, be in (("c1p", mma), ("c1", plain), ("c1s", split["split"]),
                          ("c1sp", split["split-p"]), ("c1sp, 2 blocks", split["loop"])):
            w = be.load_matrix([t])
            be.prepare(max_tokens=64, n_head=1, head_dim_v=32, n_ctx=256, n_embd=k)
            got[label] = on(be, gpu_matmul, be, w, x[:1], n)[0]
            got[f"tile ({label})"] = on(be, gpu_matmul, be, w, x, n)[0]
        for label, v in got.items():
            assert np.array_equal(v, got["tile (c1)"]), (name, n, k, label)


def same_bits_at_every_width(mma, name: str, n: int, k: int) -> None:
    t = random_tensor_info(name, n, k, seed=11)
    wm = mma.load_matrix([t])
    mma.prepare(max_tokens=64, n_head=1, head_dim_v=32, n_ctx=256, n_embd=k)
    rng = np.random.default_rng(12)
    x = rng.normal(0, 1, (64, k)).astype(np.float32)
    alone = np.concatenate([on(mma, gpu_matmul, mma, wm, x[i:i + 1], n) for i in range(64)])
    for T in COLUMNS:
        got = on(mma, gpu_matmul, mma, wm, x[:T], n)
        bad = np.flatnonzero((got != alone[:T]).any(axis=1))
        assert not bad.size, (name, n, k, T, bad[:8])
    other = x.copy()
    other[1:] = rng.normal(0, 1, (63, k))                 # other neighbours, same column 0
    for T in (9, 33, 64):
        got = on(mma, gpu_matmul, mma, wm, other[:T], n)[0]
        assert np.array_equal(got, alone[0]), (name, n, k, T)
    tail = x[40:].copy()                                  # columns 40.. at positions 0..
    assert np.array_equal(on(mma, gpu_matmul, mma, wm, tail, n), alone[40:])


@pytest.mark.parametrize("model", ["tiny-llama-mixq", "tiny-qwen3", "tiny-qwen3moe", "smollm2"])
def test_decode_with_the_split_one_column_kernel_gives_the_warp_kernels_bits(model):
    """A model's 8-token prefill and 6 decode steps with gemv_mma_one="split-p" (one-row GEMVs
    split over K as the tiles split it) against the warp-per-row one-column kernels of the same
    mode: every step's logits bit for bit (one order of additions, whichever kernel)."""
    from service.backends.cuda.backend import CudaBackend
    from service.model.transformer import positions_for
    from tests.support.models import build_model, model_path

    model_path(model, fetch=False)        # skips the test when a real model is not in place
    got = {}
    for one in ("warp", "split-p"):
        be = CudaBackend(graphs=False, gemv_mma=True, gemv_mma_one=one)
        tr = build_model(model, be, n_ctx=64, max_tokens=16, fetch=False)
        dev = [be.zeros((16,), "int32") for _ in range(3)]

        def run(tokens, start, tr=tr, be=be, dev=dev):
            n = len(tokens)
            be.upload_ints(np.asarray(tokens, np.int32) % tr.spec.vocab_size, dev[0])
            be.upload_ints(positions_for(start, n), dev[1])
            be.upload_ints(np.zeros(n, np.int32), dev[2])
            return be.to_host(tr.forward(dev[0][:n], dev[1][:n], dev[2][:n], start + n, 1))

        rows = [run([11, 29, 7, 301, 45, 8, 19, 3], 0)]
        for p in range(8, 14):
            rows.append(run([int(rows[-1].argmax())], p))
        got[one] = rows
    for i, (a, b) in enumerate(zip(got["split-p"], got["warp"], strict=True)):
        assert np.array_equal(a, b), (model, i)
