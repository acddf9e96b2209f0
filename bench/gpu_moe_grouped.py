"""Expert-grouped against gathered MoE on the GPU: one qwen3-30b-a3b-shaped MoE layer (128
experts, 8 used, hidden 2048, expert FFN 768, gate / up / down in one weight type, an F32
router) through `CudaBackend.moe`, at 1, 6, 8, 16 and 64 tokens (decode, verify widths, many
streams).

    python bench/gpu_moe_grouped.py [--tokens 1 6 8 16 64] [--type Q4_K] [--reps 20] [--json PATH]

Each row: the MoE op (router GEMV, routing, expert GEMVs, combine) timed inside one CUDA graph
of `reps` calls, each call on another random input (other experts, so the selected experts'
bytes come from memory, not the L2), gathered (CudaBackend(moe_group_min_tokens=None): each
expert read once per (token, expert) pair) against grouped (each selected expert read once per
step) at the default tile width and at every width; the bytes of the distinct experts the
inputs select (the ideal of issue 21) and of the pairs (what the gathered GEMVs ask for), and
the grouped op's ideal bytes per second. Ratios are against the gathered path measured in the
same run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

N_EXPERT, N_USED, N_EMBD, N_FF = 128, 8, 2048, 768        # qwen3-30b-a3b


def _experts(be, qt, shape: tuple[int, int, int], seed: int):
    """A stack of experts of random valid blocks (4096 distinct rows, repeated: the values do
    not change the speed, generating 100 MB of them would take minutes)."""
    from service.gguf.reader import TensorInfo
    from service.tools.synth import random_tensor

    rows, k = shape[0] * shape[1], shape[2]
    small = random_tensor(qt, (min(rows, 4096), k), seed)
    raw = np.resize(small, rows * (small.size // min(rows, 4096)))
    return be.load_experts(TensorInfo(f"moe_bench.{seed}", qt, shape, raw))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 6, 8, 16, 64])
    ap.add_argument("--type", default="Q4_K", help="the experts' weight type (default Q4_K)")
    ap.add_argument("--reps", type=int, default=20, help="calls per captured graph")
    ap.add_argument("--json", type=Path, help="write the rows here too")
    a = ap.parse_args(argv)

    import cupy as cp
    from gpu_decode import graph_time

    from service.backends.cuda.backend import CudaBackend
    from service.backends.cuda.types import MOEG_NC, moe_group_nc
    from service.gguf.quants import QuantType
    from service.gguf.reader import TensorInfo

    qt = QuantType[a.type]
    be = CudaBackend(graphs=False)
    rng = np.random.default_rng(0)
    router = be.load_matrix([TensorInfo(
        "moe_bench.router", QuantType.F32, (N_EXPERT, N_EMBD),
        rng.normal(0, 1, N_EXPERT * N_EMBD).astype(np.float32).view(np.uint8))])
    mats = [_experts(be, qt, (N_EXPERT, N_FF, N_EMBD), 1),
            _experts(be, qt, (N_EXPERT, N_FF, N_EMBD), 2),
            _experts(be, qt, (N_EXPERT, N_EMBD, N_FF), 3)]
    per_expert = sum(sum(int(p.size) for p in m.planes) for m in mats) // N_EXPERT
    be.prepare(max_tokens=max(a.tokens), n_head=1, head_dim_v=32, n_ctx=256, n_embd=N_EMBD,
               moe_experts=N_EXPERT, moe_used=N_USED, moe_ff=N_FF)
    moe = be._moe
    print(f"MoE layer: {N_EXPERT} experts, {N_USED} used, {N_EMBD} x {N_FF} {a.type} "
          f"({per_expert / 1e6:.2f} MB per expert: gate + up + down), {a.reps} calls per graph")
    print(f"{'tokens':>6} {'experts':>7} {'ideal MB':>8} {'pairs MB':>8} {'gathered us':>11} "
          f"{'grouped us':>10} {'NC':>3} {'grouped/gath':>12} {'ideal GB/s':>10}  every NC (us)")
    rows = []
    with be.stream:
        for T in a.tokens:
            xs = [cp.asarray(rng.normal(0, 1, (T, N_EMBD)).astype(np.float32))
                  for _ in range(a.reps)]
            out = be.zeros((T, N_EMBD))

            def run(i: int, xs=xs, out=out) -> None:
                be.moe(xs[i], router, *mats, N_USED, True, "silu", out)

            def timed(min_tokens: int | None, nc: int | None = None, run=run) -> float:
                be.moe_group_min_tokens, moe.group_nc = min_tokens, nc
                run(0)                       # eager first: its kernels loaded before capture
                be.synchronize()
                return graph_time(be.stream, run, a.reps)

            gathered = timed(None)
            grouped = timed(1)
            widths = {nc: timed(1, nc) for nc in MOEG_NC if nc // 2 < T}
            distinct = []
            for i in range(a.reps):                  # the experts each input selects
                run(i)
                distinct.append(int((cp.asnumpy(moe.scratch["counts"]) > 0).sum()))
            be.moe_group_min_tokens, moe.group_nc = 2, None
            ideal = float(np.mean(distinct)) * per_expert
            pairs = T * N_USED * per_expert
            row = {"tokens": T, "distinct_experts": float(np.mean(distinct)),
                   "ideal_bytes": ideal, "pair_bytes": pairs, "gathered_s": gathered,
                   "grouped_s": grouped, "nc": moe_group_nc(T, N_USED, N_EXPERT),
                   "by_nc_s": {str(k): v for k, v in widths.items()}, "type": a.type}
            rows.append(row)
            print(f"{T:>6} {row['distinct_experts']:>7.1f} {ideal / 1e6:>8.1f} "
                  f"{pairs / 1e6:>8.1f} {gathered * 1e6:>11.1f} {grouped * 1e6:>10.1f} "
                  f"{row['nc']:>3} {grouped / gathered:>12.2f} {ideal / grouped / 1e9:>10.0f}  "
                  + " ".join(f"c{k}={v * 1e6:.1f}" for k, v in widths.items()), flush=True)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
