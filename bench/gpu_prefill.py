"""GPU benchmark: prefill on the GEMM path (weights dequantized to f16 + cuBLAS) against the
GEMV in 16-column chunks (the baseline), both in the same run.

    python bench/gpu_prefill.py [--tokens 512] [--layers N] [--crossover-only | --prefill-only]

1. Crossover per matrix (Q4_K; N x K = 4096x4096 and 14336x4096): one matmul of T columns,
   T = 16, 32, 64, 128, 256, on each path, and the dequantization's share of the GEMM path.
   Prefill steps (more than 16 tokens) run eagerly, so both paths are timed eagerly: CUDA events
   around 10 back-to-back calls after 3 warm-up calls, median of 5, weights rotated over copies
   larger than the 50 MB L2. The smallest T where the GEMM path is faster is the measured
   setting for `CudaBackend(prefill_gemm_min_tokens=...)` (never below 17: decode and verify
   steps stay on the GEMV, whose columns do not depend on the step size).
2. A --tokens prefill (one step, one logits row) of the synthetic llama3-8b Q4_K_M file
   (bench/gpu_load.py generates or reuses it): tokens per second on each path, the same
   loaded weights, the path switched by the backend option.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import cupy as cp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from gpu_breakdown import prefill_kernels  # noqa: E402
from gpu_decode import event_time  # noqa: E402
from gpu_tables import prefill_kernel_table  # noqa: E402

from bench.gpu_load import synthetic_file  # noqa: E402
from service.backends.cuda.backend import CudaBackend  # noqa: E402
from service.gguf.quants import QuantType  # noqa: E402
from service.gguf.reader import GGUFFile, TensorInfo  # noqa: E402
from service.model.spec import ModelSpec  # noqa: E402
from service.model.transformer import Transformer  # noqa: E402
from service.tools.synth import random_tensor  # noqa: E402

L2_BYTES = 50 * 2**20
COLUMNS = (16, 32, 64, 128, 256)
GEMV_ONLY, GEMM_ALWAYS = None, 1     # values of prefill_gemm_min_tokens that force a path
LLAMA_CPP_PP512 = 9050               # tok/s, docs/design.md (not measured in this run)


def eager_time(stream, call, copies: int, reps: int = 10) -> float:
    """Seconds per call of `call(i)`, reps calls back to back between two events."""
    for i in range(3):
        call(i % copies)

    def calls():
        for i in range(reps):
            call(i % copies)

    return event_time(stream, calls, reps)


def crossover(name: str = "Q4_K") -> None:
    print(f"\nPer-matrix crossover, {name}, eager (us per matmul; dequant = the GEMM path's "
          "f16 dequantization of W alone)")
    print(f"{'N x K':>12} {'T':>4} {'GEMV chunks':>11} {'GEMM path':>9} {'dequant':>8} "
          f"{'GEMV/GEMM':>9}")
    rng = np.random.default_rng(0)
    for n, k in ((4096, 4096), (14336, 4096)):
        _crossover_rows(name, n, k, rng)
        cp.get_default_memory_pool().free_all_blocks()


def _crossover_rows(name: str, n: int, k: int, rng: np.random.Generator) -> None:
    be = CudaBackend(graphs=False, prefill_gemm_min_tokens=17)
    qt = QuantType[name]
    t = TensorInfo("w", qt, (n, k), random_tensor(qt, (n, k), int(rng.integers(1 << 31))))
    copies = max(2, -(-L2_BYTES * 2 // t.raw.size))
    ws = [be.load_matrix([TensorInfo(f"w{n}x{k}.{i}", t.qtype, t.shape, t.raw)])
          for i in range(copies)]
    be.prepare(max_tokens=max(COLUMNS), n_head=1, head_dim_v=32, n_ctx=64, n_embd=k)
    x = be.zeros((max(COLUMNS), k))                                   # (T, K) f32
    out = be.zeros((max(COLUMNS), n))                                 # (T, N) f32
    with be.stream:
        x[...] = cp.asarray(rng.normal(0, 1, x.shape).astype(np.float32))
    first = None
    for T in COLUMNS:
        times = {}
        for label, m in (("gemv", GEMV_ONLY), ("gemm", GEMM_ALWAYS)):
            be.prefill_gemm_min_tokens = m
            times[label] = eager_time(
                be.stream, lambda i, T=T: be.matmul(x[:T], ws[i], out[:T]), copies)
        deq = eager_time(be.stream, lambda i: be.dequant_rows(ws[i], 0, n, be._gs.wh), copies)
        if first is None and times["gemm"] < times["gemv"]:
            first = T
        print(f"{n:>5}x{k:<6} {T:>4} {times['gemv'] * 1e6:11.1f} {times['gemm'] * 1e6:9.1f} "
              f"{deq * 1e6:8.1f} {times['gemv'] / times['gemm']:8.2f}x")
    print(f"{'':12} GEMM path faster from T = {first if first else '> ' + str(COLUMNS[-1])}")


def prefill(tokens: int, layers: int | None) -> None:
    path = synthetic_file(layers=layers)
    f = GGUFFile(path)
    spec = ModelSpec.from_gguf(f)
    be = CudaBackend(graphs=False, prefill_gemm_min_tokens=17)
    t0 = time.perf_counter()
    tr = Transformer(spec, f, be, n_ctx=tokens, n_slots=1, max_tokens=tokens, max_logits=1)
    be.synchronize()
    print(f"\n{tokens}-token prefill, {path.name} (loaded in {time.perf_counter() - t0:.1f} s, "
          f"{be.weight_bytes / 1e9:.2f} GB of weights), one step, one logits row, eager")
    ids, pos, slots = (be.zeros((tokens,), "int32") for _ in range(3))
    rng = np.random.default_rng(1)
    be.upload_ints(rng.integers(0, spec.vocab_size, tokens, dtype=np.int32), ids)
    be.upload_ints(np.arange(tokens, dtype=np.int32), pos)
    be.upload_ints(np.zeros(tokens, np.int32), slots)
    print(f"{'path':22} {'ms':>8} {'tok/s':>9} {'vs GEMV':>8}")
    base = None
    for label, m in (("GEMV in 16-col chunks", GEMV_ONLY), ("dequant + cuBLAS GEMM", 17)):
        be.prefill_gemm_min_tokens = m
        runs = []
        for _ in range(4):                        # the first one loads kernels: not counted
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(be.stream)
            tr.forward(ids, pos, slots, tokens, 1)
            e1.record(be.stream)
            e1.synchronize()
            runs.append(cp.cuda.get_elapsed_time(e0, e1) / 1e3)
        s = float(np.median(runs[1:]))
        base = base or s
        print(f"{label:22} {s * 1e3:8.1f} {tokens / s:9.0f} {base / s:7.2f}x")
    print(f"llama.cpp pp512 on this GPU (docs/design.md, not this run): {LLAMA_CPP_PP512} tok/s")
    be.prefill_gemm_min_tokens = 17
    _breakdown(be, lambda: tr.forward(ids, pos, slots, tokens, 1), tokens)


def _breakdown(be: CudaBackend, step, tokens: int) -> None:
    """Where a GEMM-path prefill step's time goes, per kernel name, with the cuBLAS GEMMs and
    the rest apart: events around every launch and matmul of one more step (the events add a
    little time of their own)."""
    entry = prefill_kernels(cp, be, step, "synthetic llama3-8b", tokens)
    print(prefill_kernel_table(entry))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--crossover-only", action="store_true")
    ap.add_argument("--prefill-only", action="store_true")
    a = ap.parse_args()
    if not a.prefill_only:
        crossover()
    if not a.crossover_only:
        prefill(a.tokens, a.layers)


if __name__ == "__main__":
    main()
