"""The GEMVs of the CUDA backend: activation 8-bit blocks (quantize_act, or the blocks a fused
producer left: launcher.ActivationBlocks), the dp4a GEMVs of cuda/gemv.cu (the variant by the
step's width, the one-column early-read and prefetching kernels, the residual GEMV with the
next RMSNorm fused), and the tensor-core GEMVs of cuda/gemv_mma.cu.

`GemvOps` owns the GEMV settings (the CudaBackend options of the same names):
- rows: 2 (the default) picks the variant by the step's width (types.gemv_choice); 1 runs the
  one-column one-row kernel at every width (the earlier kernel, kept for benchmarks). Both give
  the same bits.
- early: one-column quantized GEMVs use the c1r1e kernel, which reads each lane's first weight
  group before the programmatic-launch wait (same bits, more registers).
- prefetch_rows: one-column Q4_K / Q6_K GEMVs of matrices with at most this many rows use the
  c1r1p kernel (the next weight group loaded before each dot; same bits), where one warp per
  row leaves too few loads in flight; 0 never (docs/PERFORMANCE.md section 11: faster at 4096
  rows on the H200, not at 6144 and more, nor on Q8_0 / Q4_0).
- mma: every GEMV over kernels.GEMV_MMA_TYPES weights (plain mode, any width) runs in the
  tensor-core family: 2..64 columns on the int8 tensor cores, one tile of 8, 16, 32 or 64
  columns per block row (types.gemv_mma_nc: the smallest tile that holds the step, so a step of
  up to 64 rows reads each weight once; the K-quants stop at 32 columns, two 32-column tiles
  being faster there), and one column on gemv_mma_<type>_c1[p], dp4a dot products added in
  the tiles' order (the tiles' bits, read as the dp4a GEMV reads; the p loop by the
  prefetch_rows rule): a column's result depends on neither the step's width nor its
  neighbours, so batching and verify stay exact within the mode. Off by default: its sums
  are rounded in another order than the dp4a kernels' (other last bits), and its one column
  still costs 1.06-1.17x the dp4a kernel's time on the 8B's Q4_K matrices (H100; one stream
  end to end 0.90-0.94x; docs/PERFORMANCE.md section 20) while 8 / 16 columns cost
  ~1.1x / ~1.2-1.3x of a column of the mode (section 9). With fuse_norm the one-column
  residual GEMV and the next RMSNorm run as gemv_mma_<type>_c1[p]n.
- mma_one: the tensor-core family's one-column kernel (same bits either way): "warp" (one warp
  per row, gemv_mma_<type>_c1[p], the p loop by the prefetch_rows rule), "split" / "split-p"
  (gemv_mma_<type>_c1s / c1sp: the tiles' split of K over a block's MMA_WARPS warps, each
  slot's chain in one lane, RW = 32 / UG rows a block; split-p loads a warp's next unit before
  this unit's dots). "warp" is the default: the split kernels lose on the 8B's large Q4_K /
  Q6_K matrices (docs/PERFORMANCE.md section 23, bench/gpu_gemv_one_column.py).
- fuse_norm: a one-column residual GEMV followed by an RMSNorm (matmul_add_norm) runs as one
  launch whose last block normalizes the row; False (the default) launches the two kernels.
  Both give the same bits. Off by default: measured slower on the H200 (0.89x / 0.94x of the
  default decode on the 8B / 1B shapes, `make bench-gpu`'s versions table; docs/PERFORMANCE.md
  section 13).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from service.backends.cuda.kernels import (
    GEMV_MMA_TYPES,
    GEMV_PREFETCH_TYPES,
    GEMV_WARPS,
    MMA_WARPS,
    QUANT_WARPS,
    mma_rows,
    mma_unit_groups,
)
from service.backends.cuda.launcher import ActivationBlocks, Launcher
from service.backends.cuda.memory import DeviceMemory
from service.backends.cuda.types import (
    F32,
    I32,
    NULL,
    CudaMatrix,
    ceil_div,
    check_dtype,
    gemv_choice,
    gemv_mma_kernel,
    gemv_mma_nc,
    matrix_key,
    norm_block,
    view_rows,
)

# GemvOps.mma_one's values (the CudaBackend option gemv_mma_one)
MMA_ONE = ("warp", "split", "split-p")


class GemvOps:
    def __init__(self, launcher: Launcher, blocks: ActivationBlocks, *, rows: int, early: bool,
                 prefetch_rows: int, mma: bool, fuse_norm: bool, mma_one: str = "warp") -> None:
        if rows not in (1, 2):
            raise ValueError(f"gemv_rows must be 1 or 2, not {rows}")
        if mma_one not in MMA_ONE:
            raise ValueError(f"gemv_mma_one must be one of {', '.join(MMA_ONE)}, not {mma_one!r}")
        self.mma_one = mma_one
        self.split_blocks = 0         # > 0: at most this many blocks of the split kernel (each
        #                               then loops over row groups); 0: one per row group
        self.rows, self.early, self.prefetch_rows = rows, early, prefetch_rows
        self.mma, self.fuse_norm = mma, fuse_norm
        self.done: Any = None         # (1,) int32 blocks of a fused-norm GEMV done, 0 between
        self._launcher = launcher
        self._blocks = blocks

    def prepare(self, memory: DeviceMemory) -> None:
        self.done = memory.zeros((1,), "int32")                # the kernel leaves it at 0

    def quantize(self, x) -> tuple[Any, Any]:
        """The 8-bit blocks of x (T, K): the scratch's when a fused op just wrote x's, else
        made now. Blocks made here are not remembered: x may be written by anything (a copy
        from the host) before the next matmul, only the backend's own producers are known."""
        T, _, ldx, _, K = view_rows(x)
        if self._blocks.holds(x):
            qa, ads = self._blocks.args(T, K)
            return qa, ads
        if not self._blocks.room(T, K):
            raise ValueError(f"activations {x.shape} exceed the prepared buffers or K % 32")
        qa, ads = self._blocks.args(T, K)
        self._launcher.launch("quantize_act", (ceil_div(T * K // 32, QUANT_WARPS),),
                              (32, QUANT_WARPS),
                              [x, I32(ldx), I32(T), I32(K), qa, ads])
        return qa, ads

    def matmul(self, x, w: CudaMatrix, out, ids=None, n_pairs: int = 0, act_div: int = 1,
               accumulate: bool = False) -> None:
        """out (C, N) (+)= x W^T; with `ids` (gathered experts) row p of out is x row
        p / act_div times expert ids[p]'s matrix, for p < n_pairs."""
        T, _, ldx, _, K = view_rows(x)
        C, _, ldo, _, N = view_rows(out)
        if x.ndim != 2 or out.ndim != 2 or K != w.k or N != w.n:
            raise ValueError(f"matmul: x {x.shape} / out {out.shape} vs W ({w.n}, {w.k})")
        check_dtype(x, np.float32, "matmul x")
        check_dtype(out, np.float32, "matmul out")
        if ids is None:
            if C != T:
                raise ValueError(f"matmul: {T} input rows, {C} output rows")
            nc, R = gemv_choice(T, self.rows)
            grid, ids_arg, rpe = (ceil_div(N, GEMV_WARPS * R), ceil_div(T, nc)), NULL, 0
        else:                                 # gathered experts: one column per block row
            check_dtype(ids, np.int32, "matmul ids")
            if C != n_pairs or ids.size < n_pairs:
                raise ValueError(f"gathered matmul: {n_pairs} pairs, out {out.shape}")
            nc, R = 1, 1
            grid, ids_arg, rpe = (ceil_div(N, GEMV_WARPS * R), n_pairs), ids, w.n
        tail = [I32(C), ids_arg, I32(rpe), I32(act_div), out, I32(ldo),
                I32(1 if accumulate else 0)]
        if w.layout.quantized:
            qa, ads = self.quantize(x)
            if self.mma and ids is None and w.layout.kernel in GEMV_MMA_TYPES:
                self._mma(w, qa, ads, T, out, ldo, accumulate)
                return
            args = [*w.args(), I32(K), I32(N), qa, ads, *tail]
        else:
            args = [w.planes[0], I32(K), I32(N), x, I32(ldx), *tail]
        variant = ""
        if w.layout.quantized and (nc, R) == (1, 1):
            variant = ("e" if self.early else
                       "p" if N <= self.prefetch_rows and ids is None
                       and w.layout.kernel in GEMV_PREFETCH_TYPES else "")
        self._launcher.launch(f"gemv_{w.layout.kernel}_c{nc}r{R}{variant}", grid,
                              (32, GEMV_WARPS), args)
        self._blocks.wrote(out)

    def _mma(self, w: CudaMatrix, qa, ads, C: int, out, ldo: int, accumulate: bool) -> None:
        """out[:C] (+)= the product of W with the 8-bit blocks (qa, ads) of C columns on tensor
        cores (cuda/gemv_mma.cu); shapes were checked by matmul."""
        if qa.size < C * w.k or ads.shape[0] < C * w.k // 32 or w.k % w.layout.block_size:
            raise ValueError(f"gemv_mma: blocks {qa.size} / {ads.shape} for {C} x {w.k}")
        t = w.layout.kernel
        name = gemv_mma_kernel(C, t, w.n <= self.prefetch_rows and t in GEMV_PREFETCH_TYPES)
        if C == 1 and self.mma_one != "warp":  # the tiles' split of K, a slot's chain a lane
            name = f"gemv_mma_{t}_c1s{'p' if self.mma_one == 'split-p' else ''}"
            groups = ceil_div(w.n, 32 // mma_unit_groups(t))
            grid = (min(groups, self.split_blocks) if self.split_blocks > 0 else groups, 1)
            block = (32, MMA_WARPS)
        elif C == 1:                          # one warp per row, the tiles' order of additions
            grid, block = (ceil_div(w.n, GEMV_WARPS), 1), (32, GEMV_WARPS)
        else:
            nc = gemv_mma_nc(C, t)
            grid, block = (ceil_div(w.n, mma_rows(nc)), ceil_div(C, nc)), (32, MMA_WARPS)
        self._launcher.launch(name, grid, block,
                              [*w.args(), I32(w.k), I32(w.n), qa, ads, I32(C), out, I32(ldo),
                               I32(1 if accumulate else 0)])
        self._blocks.wrote(out)

    def matmul_add_norm(self, x, w: CudaMatrix, out, norm_w, eps: float, h,
                        gemm: bool) -> bool:
        """One column: out += x W^T and, in the GEMV's last block, h = rms_norm(out) * norm_w
        with h's 8-bit blocks (gemv.cu gemv_<type>_c1r1[p]n, or with gemv_mma
        gemv_mma.cu gemv_mma_<type>_c1[p]n; the bits of the two launches). False, launching
        nothing, for other shapes, float weights, a step that takes the GEMM (`gemm`), or
        fuse_norm off: the caller runs the two ops."""
        T, _, _, _, K = view_rows(x)
        C, _, ldo, _, N = view_rows(out)
        fused = (self.fuse_norm and T == 1 and C == 1 and x.ndim == 2 and out.ndim == 2
                 and h.shape == out.shape and norm_w.shape == (N,) and w.layout.quantized
                 and K == w.k and N == w.n and not gemm and not self.early
                 and self._blocks.room(1, N) and self._blocks.room(1, K)
                 and self.done is not None)
        if not fused:
            return False
        for a, what in ((x, "x"), (out, "out"), (norm_w, "norm_w"), (h, "h")):
            check_dtype(a, np.float32, f"matmul_add_norm {what}")
        qa, ads = self.quantize(x)           # read by every block before the last one writes
        t = w.layout.kernel
        p = "p" if N <= self.prefetch_rows and t in GEMV_PREFETCH_TYPES else ""
        # the tensor-core family's one-column kernel (the tiles' order of additions) or dp4a's
        name = f"gemv_mma_{t}_c1{p}n" if self.mma and t in GEMV_MMA_TYPES else f"gemv_{t}_c1r1{p}n"
        self._launcher.launch(name,
                              (ceil_div(N, GEMV_WARPS), 1), (32, GEMV_WARPS),
                              [*w.args(), I32(K), I32(N), qa, ads, out, self.done, norm_w,
                               F32(eps), I32(norm_block(N)), h, *self._blocks.args(1, N)])
        self._blocks.made(matrix_key(h))
        return True
