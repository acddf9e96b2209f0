"""The prefill path (dequantize to f16 + cuBLAS GEMM) and the pinned weight upload.

Error bounds of the GEMM, derived (u = 2^-11, the unit roundoff of f16):
- x and W are rounded to f16 (nearest even): |x~ - x| <= u |x| + 2^-25 (the second term for
  values in f16's subnormal range, spacing 2^-24), the same for W. So per product
  |x~ w~ - x w| <= (2u + u^2) |x w| + 2^-25 (|x| + |w|) + 2^-50.
- The products of f16 values are exact in f32; cuBLAS sums K of them in f32. Even if every
  addition truncated (2^-23 relative, tensor cores may not round to nearest), the summation
  error is at most K 2^-23 S~ with S~ = sum |x~ w~|.
- Against the exact product of the rounded inputs the kernel's error is only that summation
  term. Against the CPU backend's prefill matmul (sgemm over its own dequantized float32 W:
  one more float32 rounding per weight, 2^-24 relative, and its own summation, K 2^-24 S) the
  bound is (2u + u^2 + 2^-23 + 2 K 2^-23) S + 2^-25 (sum |x| + sum |w|): a relative error of
  about 1e-3 of S = sum |x w|. A wrong row, tile or block gives an error of order S / sqrt(K),
  over ten times these bounds; a wrong element in a block is caught bit for bit by the
  dequantization test.
"""

from __future__ import annotations

import numpy as np
import pytest

from service.backends.cpu.backend import CpuBackend
from service.gguf.quants import dequantize
from service.gguf.reader import TensorInfo
from tests.support.blocks import ALL_TYPES, block_size, qtype, random_tensor, random_tensor_info

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu
U16 = 2.0 ** -11
N_ROWS = 333                  # not a multiple of 8, 64 or 128 (cuBLAS tiles, our row tiles)
F16_NAN = 0xFFFF              # poison: an f16 NaN bit pattern


def widths(name: str) -> list[int]:
    bs = block_size(name)
    if bs == 1:
        return [203, 512]                 # 203: rows of an odd width (a tail of < 8 elements)
    if bs == 32:
        return [352, 1280]
    return [768, 2304]


def backend(**options):
    from service.backends.cuda.backend import CudaBackend

    return CudaBackend(graphs=False, **options)


@pytest.fixture(scope="module", params=["whole", "tiled"])
def gemm(request):
    """GEMM from 17 tokens on; "tiled": the smallest weight scratch (64 rows of the widest
    matrix loaded so far), so the N_ROWS rows take several dequantize + GEMM tiles (six at
    the widest K)."""
    be = backend(prefill_gemm_min_tokens=17,
                 prefill_scratch_mib=256 if request.param == "whole" else 0)
    with be.stream:
        yield be


def prepare(be, k: int, max_tokens: int = 256) -> None:
    be.prepare(max_tokens=max_tokens, n_head=1, head_dim_v=32, n_ctx=64, n_embd=k)


@pytest.mark.parametrize("name", ALL_TYPES)
def test_dequant_equals_gguf_after_f16_rounding(gemm, name):
    for k in widths(name):
        t = random_tensor_info(name, 37, k, seed=k, label="g")
        w = gemm.load_matrix([t])
        prepare(gemm, k)
        want = dequantize(t.raw, t.qtype, (37, k)).astype(np.float16).view(np.uint16)
        for r0, n in ((0, 37), (5, 11), (36, 1)):
            out = cp.full(37 * k + 40, F16_NAN, cp.uint16)
            gemm.dequant_rows(w, r0, n, out)
            host = gemm.to_host(out)
            assert np.array_equal(host[:n * k], want[r0:r0 + n].reshape(-1)), (name, k, r0)
            assert (host[n * k:] == F16_NAN).all(), (name, k, r0, "wrote past the rows")


def test_round_f16_equals_numpy(gemm):
    x = np.random.default_rng(1).normal(0, 50, (19, 300)).astype(np.float32)
    x[0, :4] = [1e-6, -3e-8, 70000.0, 65519.0]       # subnormal, below it, overflow, tie
    xd = cp.asarray(np.pad(x, ((0, 0), (0, 20))))[:, :300]    # a row stride of 320
    out = cp.full(19 * 300 + 7, F16_NAN, cp.uint16)
    gemm.round_f16(xd, out)
    host = gemm.to_host(out)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).view(np.uint16).reshape(-1)
    assert np.array_equal(host[:19 * 300], want)
    assert (host[19 * 300:] == F16_NAN).all()


@pytest.mark.parametrize("name", ALL_TYPES)
def test_gemm_against_references(gemm, name):
    for k in widths(name):
        t = random_tensor_info(name, N_ROWS, k, seed=k + 5, label="g")
        w = gemm.load_matrix([t])
        prepare(gemm, k)
        W32 = dequantize(t.raw, t.qtype, (N_ROWS, k))                         # (N, K) f32
        W = W32.astype(np.float64)
        Wr = W32.astype(np.float16).astype(np.float64)
        cpu = CpuBackend()
        wc = cpu.load_matrix([t])
        rng = np.random.default_rng(k)
        for T in (17, 64, 256):
            x = rng.normal(0, 1, (T, k)).astype(np.float32)
            out = cp.full((T, N_ROWS + 6), np.nan, cp.float32)
            gemm.matmul(cp.asarray(x), w, out[:, 3:3 + N_ROWS])
            host = gemm.to_host(out)
            assert np.isnan(host[:, :3]).all() and np.isnan(host[:, 3 + N_ROWS:]).all()
            got = host[:, 3:3 + N_ROWS].astype(np.float64)
            assert np.isfinite(got).all(), (name, k, T)
            xr = x.astype(np.float16).astype(np.float64)
            S_r = np.abs(xr) @ np.abs(Wr).T                                    # (T, N)
            err_r = np.abs(got - xr @ Wr.T)
            assert (err_r <= k * 2.0 ** -23 * S_r + 1e-30).all(), (
                name, k, T, float((err_r / (S_r + 1e-30)).max()))
            ref_cpu = np.empty((T, N_ROWS), np.float32)
            cpu.matmul(x, wc, ref_cpu)
            xa = np.abs(x.astype(np.float64))
            S = xa @ np.abs(W).T
            tiny = 2.0 ** -25 * (xa.sum(1)[:, None] + np.abs(W).sum(1)[None, :])
            bound = (2 * U16 + U16 ** 2 + 2.0 ** -23 + 2 * k * 2.0 ** -23) * S + tiny
            err = np.abs(got - ref_cpu)
            assert (err <= bound).all(), (name, k, T, float((err / S).max()))


def test_dispatch_by_step_width():
    """Decode and verify widths (<= invariant_tokens) stay on the GEMV, bit for bit the GEMV-only
    backend's; a step of prefill_gemm_min_tokens takes the GEMM."""
    assert backend(prefill_gemm_min_tokens=4).prefill_gemm_min_tokens == 17
    assert backend(prefill_gemm_min_tokens=17, invariant_tokens=32).prefill_gemm_min_tokens == 33
    t = random_tensor_info("Q4_K", 40, 512, seed=9, label="g")
    x = np.random.default_rng(9).normal(0, 1, (17, 512)).astype(np.float32)
    outs = {}
    for label, be in (("gemv", backend(prefill_gemm_min_tokens=None)),
                      ("gemm", backend(prefill_gemm_min_tokens=17))):
        with be.stream:
            w = be.load_matrix([t])
            prepare(be, 512, max_tokens=32)
            for T in (16, 17):
                out = cp.full((T, 40), np.nan, cp.float32)
                be.matmul(cp.asarray(x[:T]), w, out)
                outs[label, T] = be.to_host(out)
    assert np.array_equal(outs["gemv", 16].view(np.uint32), outs["gemm", 16].view(np.uint32))
    assert not np.array_equal(outs["gemv", 17], outs["gemm", 17])    # 8-bit vs f16 rounding


@pytest.mark.parametrize("name", ["tiny-llama-mixq", "tiny-qwen3"])
def test_tiny_model_prefill_on_the_gemm_path(name):
    """The fixture prompt (24 tokens, all logits) as one step on the GEMM path against the CPU
    float32 reference (whose prefill is sgemm too). Rounding matmul inputs to f16 (relative
    rms about u / sqrt(3)) is some 15x finer than the GEMV's 8-bit blocks, whose noise against
    this reference is a 3.2% median on tiny-llama-mixq (tests/golden); the CPU backend with
    only x rounded to f16 gave medians of 0.16% / 0.08% (tiny-llama-mixq / tiny-qwen3), W's
    rounding adds about as much again. Bound: a 1% median and a 2% 75th percentile, and every
    clear argmax equal. The MoE model keeps its expert matmuls on the 8-bit GEMV and is left
    to test_models."""
    from tests.support.logits import relative_errors
    from tests.support.models import tiny_logits

    be = backend(prefill_gemm_min_tokens=17)
    ours, _ = tiny_logits(name, be)
    assert be._gs.xh is not None                    # prepared: the 24-token step takes it
    cpu, _ = tiny_logits(name, CpuBackend())
    rel = relative_errors(ours, cpu)
    print(f"{name}: GEMM prefill vs CPU float32 median {np.median(rel):.5f} max {rel.max():.5f}")
    assert np.median(rel) <= 0.01 and np.percentile(rel, 75) <= 0.02, rel
    top2 = np.sort(cpu, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) >= 4.0
    np.testing.assert_array_equal(ours.argmax(1)[clear], cpu.argmax(1)[clear])


# ---------------------------------------------------------------- pinned upload
@pytest.mark.parametrize("name", ALL_TYPES)
def test_pinned_upload_equals_pageable(name):
    """Through a ring of two 1 MiB buffers (tensors straddle buffers, the ring wraps, a fused
    pair is stacked without a host concatenation) the planes equal the pageable upload's byte
    for byte; the bytes are counted once each and the ring is freed at the end of the load."""
    k = widths(name)[1]
    row_bytes = random_tensor(name, 1, k, np.random.default_rng(0)).size
    rows = (3 << 19) // row_bytes + 1                   # 1.5 MiB: more than one buffer
    ts = [random_tensor_info(name, rows, k, seed=s, label="g") for s in (1, 2)]
    vec = TensorInfo("g.norm", qtype("F32"), (k,),
                     np.random.default_rng(3).normal(1, 0.1, k).astype(np.float32).view(np.uint8))
    got = {}
    for mode in ("pageable", "pinned"):
        be = backend(upload=mode, staging_buffers=2, staging_mib=1)
        with be.stream:
            single, fused = be.load_matrix([ts[0]]), be.load_matrix(ts)
            v = be.load_vector(vec)
            be.finish_load()
            got[mode] = ([be.to_host(p) for p in single.planes + fused.planes], be.to_host(v))
        n_file = 3 * ts[0].raw.size + vec.raw.size
        assert be.weight_bytes == be.tensor_bytes == n_file, mode
        if mode == "pinned":
            assert all(h is None for h in be._uploader._host)
    for a, b in zip(got["pageable"][0], got["pinned"][0], strict=True):
        assert np.array_equal(a, b), name
    assert np.array_equal(got["pageable"][1], got["pinned"][1])
    assert np.array_equal(got["pinned"][1], vec.raw.view(np.float32))
