"""The one-column GEMV kernels side by side (CUDA): us per call inside a graph of 20 calls that
rotates weight copies past the L2, through `CudaBackend.matmul` (activation quantization
included), for the dp4a default and the tensor-core family's one-column kernels (`gemv_mma_one`
"warp", "split", "split-p"), with the read-only kernel over the same bytes, and whether the
family's kernels agree bit for bit (they must).

    python3 bench/gpu_gemv_one_column.py [--only N]

docs/PERFORMANCE.md section 23 holds a run of it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

# the 8B's matrices (q, k|v, o, gate|up halves, down, LM head), the 1B's, and the other types
MATRICES = (("Q4_K", 4096, 14336), ("Q4_K", 14336, 4096), ("Q4_K", 4096, 4096),
            ("Q4_K", 1024, 4096), ("Q6_K", 4096, 14336), ("Q6_K", 14336, 4096),
            ("Q8_0", 4096, 14336), ("Q8_0", 14336, 4096), ("Q4_K", 2048, 8192),
            ("Q4_K", 8192, 2048), ("Q6_K", 128256, 4096), ("Q4_0", 4096, 14336))
VARIANTS = (("dp4a c1", False, "warp"), ("mma c1 (warp)", True, "warp"),
            ("c1s", True, "split"), ("c1sp", True, "split-p"))


def row(cp, G, be, ro, rng, name: str, n: int, k: int) -> str:
    """One matrix's table row."""
    from gpu_bench import _random_raw, rotating_copies

    from service.gguf.quants import QuantType
    from service.gguf.reader import TensorInfo

    t = TensorInfo(f"b.{name}.{n}x{k}", QuantType[name], (n, k), _random_raw(name, n, k, rng))
    w0, ws, flat, nbytes = rotating_copies(cp, be, t)
    copies = len(ws)
    sink = cp.zeros(1, cp.int32)
    be.prepare(max_tokens=2, n_head=1, head_dim_v=32, n_ctx=256, n_embd=k)
    x, out = be.zeros((1, k)), be.zeros((1, n))
    with be.stream:
        x[...] = cp.asarray(rng.normal(0, 1, (1, k)).astype(np.float32))
    be.synchronize()
    times, bits = {}, {}
    with be.stream:
        times["ro"] = G.graph_time(be.stream, lambda i: ro(
            (264,), (512,), (flat[i % copies], np.int64(nbytes // 16), sink)), 20)
        for label, mma, one in VARIANTS:
            be.gemv_mma, be.gemv_mma_one = mma, one
            times[label] = G.graph_time(
                be.stream, lambda i: be.matmul(x, ws[i % copies], out), 20)
            be.matmul(x, w0, out)
            bits[label] = cp.asnumpy(out).copy()
    be.synchronize()
    be.gemv_mma, be.gemv_mma_one = False, "warp"
    family = [bits[v[0]] for v in VARIANTS if v[1]]
    same = all(np.array_equal(b, family[0]) for b in family)
    return (f"| {name} {n}x{k} | {times['ro'] * 1e6:.1f} | "
            + " | ".join(f"{times[v[0]] * 1e6:.1f}" for v in VARIANTS)
            + f" | {'same' if same else 'DIFFER'} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", type=int, default=len(MATRICES), help="the first N matrices")
    a = ap.parse_args()
    import cupy as cp
    import gpu_decode as G

    from service.backends.cuda.backend import CudaBackend

    be = CudaBackend(graphs=False, prefill_gemm_min_tokens=None)
    ro = cp.RawKernel(G.READ_ONLY, "read_only")
    rng = np.random.default_rng(0)
    print("| matrix (N x K) | read-only | " + " | ".join(v[0] for v in VARIANTS)
          + " | family bits |")
    print("| --- " * (len(VARIANTS) + 3) + "|")
    for name, n, k in MATRICES[:a.only]:
        print(row(cp, G, be, ro, rng, name, n, k), flush=True)
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
