"""The prefill GEMM of the CUDA backend: matmuls of wide steps as dequantize + cuBLAS GEMM.

A step of T >= min_tokens tokens (more than the decode/verify widths, which stay on the
step-size-invariant GEMV): x rounded to f16 once per matmul, W's rows dequantized to f16
tile by tile into a scratch (cuda/dequant.cu), and out[:, tile rows] (+)= x W_tile^T by cuBLAS
with f16 inputs and f32 accumulation and output, written straight into out's columns (beta = 1
adds into out: the residual add of matmul_add). F16 weights go to cuBLAS as they are. In
cuBLAS's column-major terms: C (rows, T; ldc = ldo) = op_T(W tile stored (K, rows)) x (K, T).
A segmented step (several prompts' chunks, base.py) dequantizes each tile once and runs one
GEMM per chunk on it, each with the chunk's own T, as the chunk's step alone would.
`GemmOps` owns the threshold (`CudaBackend.prefill_gemm_min_tokens`: None keeps every matmul on
the GEMV; it becomes None when cuBLAS cannot be loaded), the cuBLAS handle and the scratch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog

from service.backends.cuda.launcher import ActivationBlocks, Launcher
from service.backends.cuda.memory import DeviceMemory
from service.backends.cuda.types import I32, CudaMatrix, ceil_div, check_dtype, view_rows

# Steps of at least this many tokens (and more than the invariant decode/verify widths) run
# their matmuls as dequantize + cuBLAS GEMM. Measured on the H200 (bench/gpu_prefill.py, Q4_K):
# the GEMM path wins from 32 columns for 14336x4096 (141 vs 126 us) and from 64 for 4096x4096
# (at 32: 67 vs 88 us); 32 favours the large matrices, which dominate a step's time.
PREFILL_GEMM_MIN_TOKENS = 32
# cuBLAS / CUDA library enum values (cublas_api.h, library_types.h), spelled out so they do not
# depend on which names a CuPy version exports.
_BLAS_OP_N, _BLAS_OP_T, _BLAS_POINTER_HOST = 0, 1, 0
_BLAS_COMPUTE_32F, _BLAS_GEMM_DEFAULT = 68, -1
_R_32F, _R_16F = 0, 2
log = structlog.get_logger(__name__)


@dataclass
class GemmScratch:
    """Buffers of the prefill GEMM path (sized by prepare)."""

    limit: int                        # bytes the weight tile may take at most
    xh: Any = None                    # (max_tokens * max K) f16 bits: x rounded to f16
    wh: Any = None                    # (tile_elems,) f16 bits: a tile of W's rows
    blas: int = 0                     # cuBLAS handle (pointer mode host)
    lib: Any = None                   # cupy_backends' cublas module (imported at first use)
    one: Any = field(default_factory=lambda: np.ones(1, np.float32))    # alpha, host
    zero: Any = field(default_factory=lambda: np.zeros(1, np.float32))  # beta, host


class GemmOps:
    def __init__(self, stream: Any, launcher: Launcher, blocks: ActivationBlocks,
                 min_tokens: int | None, scratch_bytes: int) -> None:
        self.stream = stream
        self.min_tokens = min_tokens              # steps this wide take the GEMM; None: never
        self.scratch = GemmScratch(limit=scratch_bytes)
        self._launcher = launcher
        self._blocks = blocks

    def wanted(self, x) -> bool:
        m = self.min_tokens
        return m is not None and x.shape[0] >= m

    def prepare(self, max_tokens: int, max_k: int, max_elems: int,
                memory: DeviceMemory) -> None:
        """The cuBLAS handle and the scratch for steps of up to max_tokens tokens over matrices
        of at most max_k columns and max_elems elements (none when no step takes the GEMM)."""
        g = self.scratch
        m = self.min_tokens
        if m is None or max_tokens < m or not max_elems:
            g.xh = g.wh = None
            return
        tile = min(max_elems, max(g.limit // 2, 64 * max_k))
        if not g.blas:
            # Imported here: a CuPy without a loadable cuBLAS still serves, on the GEMV only.
            try:
                from cupy_backends.cuda.libs import cublas

                g.blas, g.lib = cublas.create(), cublas
                cublas.setPointerMode(g.blas, _BLAS_POINTER_HOST)
            except (ImportError, OSError, RuntimeError) as e:
                log.warning("cuBLAS unavailable: every matmul stays on the GEMV", error=str(e))
                self.min_tokens = None
                g.xh = g.wh = None
                return
        g.xh = memory.zeros((max_tokens * max_k,), "uint16")     # (T*K,) f16 bits
        g.wh = memory.zeros((tile,), "uint16")                   # (rows*K,) f16 bits

    def round_f16(self, x, out) -> None:
        """out[: T*K] (f16 bits, rows of K) = x (T, K) f32 rounded to nearest even."""
        T, _, ldx, _, K = view_rows(x)
        check_dtype(x, np.float32, "round_f16 x")
        check_dtype(out, np.uint16, "round_f16 out")
        if out.ndim != 1 or out.size < T * K:
            raise ValueError(f"round_f16: out {out.shape} cannot hold {T}x{K}")
        self._launcher.launch("round_f16", (ceil_div(K, 256), T), (256,),
                              [x, I32(ldx), I32(T), I32(K), out])

    def dequant_rows(self, w: CudaMatrix, r0: int, n_rows: int, out) -> None:
        """out[: n_rows*K] (f16 bits, rows of K) = W[r0 : r0 + n_rows] rounded to f16."""
        check_dtype(out, np.uint16, "dequant out")
        n = n_rows * w.k
        if not (0 <= r0 and n_rows > 0 and r0 + n_rows <= w.rows) or out.ndim != 1 \
                or out.size < n:
            raise ValueError(f"dequant: rows [{r0}, {r0 + n_rows}) of {w.rows} into "
                             f"{out.shape}")
        self._launcher.launch(f"dequant_{w.layout.kernel}", (ceil_div(ceil_div(n, 8), 256),),
                              (256,), [*w.args(), I32(w.k), np.int64(r0), np.int64(n), out])

    def matmul(self, x, w: CudaMatrix, out, accumulate: bool = False,
               runs: tuple[tuple[int, int], ...] | None = None) -> None:
        """out = x W^T (+ out with `accumulate`) for the rows of each run [a, b) (None: all
        rows as one run): x's rows rounded to f16 once, each tile of W dequantized once, then
        one cuBLAS GEMM per run and tile with the run's own column count and the run's
        columns' pointers, so a run's products are the calls, and the bits, of a matmul over
        its rows alone (the same tiles: their size depends on N, K and the scratch only)."""
        T, _, _, _, K = view_rows(x)
        C, _, ldo, _, N = view_rows(out)
        g = self.scratch
        if K != w.k or N != w.n or C != T or w.n_expert != 1:
            raise ValueError(f"matmul: x {x.shape} / out {out.shape} vs W ({w.n}, {w.k})")
        check_dtype(x, np.float32, "matmul x")
        check_dtype(out, np.float32, "matmul out")
        if g.xh is None or T * K > g.xh.size:
            raise ValueError(f"GEMM of {T}x{K} exceeds the prepared buffers")
        runs = ((0, T),) if runs is None else runs
        xh = g.xh[: T * K]
        self.round_f16(x, xh)
        direct = w.layout.kernel == "f16"
        tile = N if direct else min(N, g.wh.size // K)
        if tile < N and tile >= 128:
            tile -= tile % 128            # whole GEMM tiles except in the last one
        if tile < 1:
            raise ValueError(f"GEMM scratch holds no row of width {K}")
        beta = g.one if accumulate else g.zero
        with self.stream:
            for r0 in range(0, N, tile):
                n = min(tile, N - r0)
                if direct:
                    a = w.planes[0].data.ptr + r0 * K * 2
                else:
                    self.dequant_rows(w, r0, n, g.wh)
                    a = g.wh.data.ptr
                g.lib.setStream(g.blas, self.stream.ptr)
                for t0, t1 in runs:       # run rows t0..t1: columns of x^T and of out^T
                    g.lib.gemmEx(g.blas, _BLAS_OP_T, _BLAS_OP_N, n, t1 - t0, K,
                                 g.one.ctypes.data, a, _R_16F, K, xh.data.ptr + t0 * K * 2,
                                 _R_16F, K, beta.ctypes.data,
                                 out.data.ptr + (t0 * ldo + r0) * 4, _R_32F, ldo,
                                 _BLAS_COMPUTE_32F, _BLAS_GEMM_DEFAULT)
        self._blocks.forget()             # cuBLAS wrote out behind the launcher's bookkeeping
