"""The GEMV family of the CUDA backend: activation 8-bit blocks (quantize_act, or the blocks a
fused producer left), the dp4a GEMVs of cuda/gemv.cu (the variant by the step's width, the
one-column prefetching and fused-norm kernels), the tensor-core GEMVs of cuda/gemv_mma.cu, and
the matmul entry points that choose between them and the prefill GEMM (gemm.py).

A mixin of CudaBackend: it uses the backend's `_launch`, scratch `_s`, its 8-bit block
bookkeeping (`_block_room`, `_block_args`, `_blocks`) and its GEMV settings.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from service.backends.cuda.types import (
    F32,
    GEMV_MMA_ROWS,
    GEMV_MMA_TYPES,
    GEMV_MMA_WARPS,
    GEMV_PREFETCH_TYPES,
    GEMV_WARPS,
    I32,
    NULL,
    CudaMatrix,
    ceil_div,
    check_dtype,
    gemv_choice,
    gemv_mma_nc,
    matrix_key,
    norm_block,
    overlaps,
    view_rows,
)


class GemvOps:
    """Matmul launchers of CudaBackend (one launcher per kernel family)."""

    def _quantize(self, x) -> tuple[Any, Any]:
        """The 8-bit blocks of x (T, K): the scratch's when a fused op just wrote x's, else
        made now. Blocks made here are not remembered: x may be written by anything (a copy
        from the host) before the next matmul, only the backend's own producers are known."""
        T, _, ldx, _, K = view_rows(x)
        if self._blocks == matrix_key(x):
            qa, ads = self._block_args(T, K)
            return qa, ads
        if not self._block_room(T, K):
            raise ValueError(f"activations {x.shape} exceed the prepared buffers or K % 32")
        qa, ads = self._block_args(T, K)
        self._launch("quantize_act", (ceil_div(T * K // 32, 4),), (32, 4),
                     [x, I32(ldx), I32(T), I32(K), qa, ads])
        return qa, ads

    def _gemv(self, x, w: CudaMatrix, out, ids=None, n_pairs: int = 0, act_div: int = 1,
              accumulate: bool = False):
        T, _, ldx, _, K = view_rows(x)
        C, _, ldo, _, N = view_rows(out)
        if x.ndim != 2 or out.ndim != 2 or K != w.k or N != w.n:
            raise ValueError(f"matmul: x {x.shape} / out {out.shape} vs W ({w.n}, {w.k})")
        check_dtype(x, np.float32, "matmul x")
        check_dtype(out, np.float32, "matmul out")
        if ids is None:
            if C != T:
                raise ValueError(f"matmul: {T} input rows, {C} output rows")
            nc, R = gemv_choice(T, self.gemv_rows)
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
            qa, ads = self._quantize(x)
            if self.gemv_mma and ids is None and w.layout.kernel in GEMV_MMA_TYPES:
                self._gemv_mma(w, qa, ads, T, out, ldo, accumulate)
                return
            args = [*w.args(), I32(K), I32(N), qa, ads, *tail]
        else:
            args = [w.planes[0], I32(K), I32(N), x, I32(ldx), *tail]
        variant = ""
        if w.layout.quantized and (nc, R) == (1, 1):
            variant = ("e" if self.gemv_early else
                       "p" if N <= self.gemv_prefetch_rows and ids is None
                       and w.layout.kernel in GEMV_PREFETCH_TYPES else "")
        self._launch(f"gemv_{w.layout.kernel}_c{nc}r{R}{variant}", grid, (32, GEMV_WARPS), args)
        if self._blocks is not None and overlaps(out, self._blocks):
            self._blocks = None

    def _gemv_mma(self, w: CudaMatrix, qa, ads, C: int, out, ldo: int, accumulate: bool):
        """out[:C] (+)= the product of W with the 8-bit blocks (qa, ads) of C columns on tensor
        cores (cuda/gemv_mma.cu); shapes were checked by _gemv."""
        if qa.size < C * w.k or ads.shape[0] < C * w.k // 32 or w.k % 256:
            raise ValueError(f"gemv_mma: blocks {qa.size} / {ads.shape} for {C} x {w.k}")
        nc = gemv_mma_nc(C)
        grid = (ceil_div(w.n, GEMV_MMA_ROWS), ceil_div(C, nc))
        self._launch(f"gemv_mma_{w.layout.kernel}_c{nc}", grid, (32, GEMV_MMA_WARPS),
                     [*w.args(), I32(w.k), I32(w.n), qa, ads, I32(C), out, I32(ldo),
                      I32(1 if accumulate else 0)])
        if self._blocks is not None and overlaps(out, self._blocks):
            self._blocks = None

    def matmul(self, x, w: CudaMatrix, out):
        if self._gemm_wanted(x):
            self._gemm_matmul(x, w, out)
        else:
            self._gemv(x, w, out)

    def matmul_add(self, x, w: CudaMatrix, out, tmp):
        del tmp                               # the GEMV (or GEMM, beta = 1) adds into out
        if self._gemm_wanted(x):
            self._gemm_matmul(x, w, out, accumulate=True)
        else:
            self._gemv(x, w, out, accumulate=True)

    def matmul_add_norm(self, x, w: CudaMatrix, out, tmp, norm_w, eps, h):
        """One column: the GEMV with its residual add and, in its last block, the next RMSNorm
        and its 8-bit blocks (gemv.cu gemv_<type>_c1r1[p]n; the bits of the two launches).
        Other shapes, float or tensor-core weights, or fuse_norm off: the two ops."""
        T, _, _, _, K = view_rows(x)
        C, _, ldo, _, N = view_rows(out)
        fused = (self.fuse_norm and T == 1 and C == 1 and x.ndim == 2 and out.ndim == 2
                 and h.shape == out.shape and norm_w.shape == (N,) and w.layout.quantized
                 and K == w.k and N == w.n and not self._gemm_wanted(x) and not self.gemv_early
                 and not (self.gemv_mma and w.layout.kernel in GEMV_MMA_TYPES)
                 and self._block_room(1, N) and self._block_room(1, K)
                 and self._s.gemv_done is not None)
        if not fused:
            super().matmul_add_norm(x, w, out, tmp, norm_w, eps, h)
            return
        for a, what in ((x, "x"), (out, "out"), (norm_w, "norm_w"), (h, "h")):
            check_dtype(a, np.float32, f"matmul_add_norm {what}")
        qa, ads = self._quantize(x)          # read by every block before the last one writes
        prefetch = N <= self.gemv_prefetch_rows and w.layout.kernel in GEMV_PREFETCH_TYPES
        self._launch(f"gemv_{w.layout.kernel}_c1r1{'p' if prefetch else ''}n",
                     (ceil_div(N, GEMV_WARPS), 1), (32, GEMV_WARPS),
                     [*w.args(), I32(K), I32(N), qa, ads, out, self._s.gemv_done, norm_w,
                      F32(eps), I32(norm_block(N)), h, *self._block_args(1, N)])
        self._blocks = matrix_key(h)
