"""RMSNorm launchers of the CUDA backend (cuda/elementwise.cu rms_norm, rms_norm_quant,
rms_norm_add): rows of up-to-3-D views, one block of norm_block(D) threads per row, so every
kernel computing a norm of D sums in the same order.

rms_norm_quant gives a row up to `slices` blocks: each sums the whole row in that order and
writes the normalized values and 8-bit blocks of its share of the row's register passes, so
the bits do not depend on the slice count; the serial part of a one-row norm (a warp's group
shuffles, pass after pass) is split S ways for the L2 reads of S - 1 more copies of the row.

`NormOps` owns its slice count and its launches; rms_norm_for_matmul records the view whose
8-bit blocks it wrote in the shared launcher.ActivationBlocks.
"""

from __future__ import annotations

import numpy as np

from service.backends.cuda.launcher import ActivationBlocks, Launcher
from service.backends.cuda.types import (
    F32,
    I32,
    ceil_div,
    check_dtype,
    matrix_key,
    norm_block,
    view_rows,
)

# blocks per row of rms_norm_quant (CudaBackend(norm_slices)): one register pass per block up
# to 4096-wide rows (16 passes of 256 threads); 8B one stream through the engine 274 -> 300
# tok/s on an H100 against one block (8 slices: 297, 4: 292; docs/PERFORMANCE.md section 24)
NORM_SLICES = 16
# blocks of a step's rms_norm_quant launch beyond which rows get no more slices (a prefill
# chunk's rows fill the device alone)
SLICED_BLOCKS_MAX = 1024


class NormOps:
    def __init__(self, launcher: Launcher, blocks: ActivationBlocks,
                 slices: int = NORM_SLICES) -> None:
        if slices < 1:
            raise ValueError(f"norm_slices must be at least 1, not {slices}")
        self._launcher = launcher
        self._blocks = blocks
        self.slices = slices

    def slices_for(self, T: int, D: int) -> int:
        """Blocks per row of an rms_norm_quant launch over T rows of D: at most one per
        register pass of the row, none beyond SLICED_BLOCKS_MAX blocks in all."""
        return max(1, min(self.slices, ceil_div(D, norm_block(D)), SLICED_BLOCKS_MAX // T))

    def rms_norm(self, x, w, eps: float, out) -> None:
        n0, n1, s0, s1, D = view_rows(x)
        o0, o1, p0, p1, Do = view_rows(out)
        if (n0, n1, D) != (o0, o1, Do) or w.shape != (D,):
            raise ValueError(f"rms_norm: x {x.shape}, out {out.shape}, w {w.shape}")
        self._launcher.launch("rms_norm", (n0 * n1,), (norm_block(D),),
                              [x, I32(n1), I32(s0), I32(s1), I32(D), w, F32(eps), out, I32(p0),
                               I32(p1)])

    def rms_norm_for_matmul(self, x, w, eps: float, out) -> None:
        """rms_norm, and out's 8-bit blocks for the next GEMV when they fit the scratch."""
        if x.ndim != 2 or out.ndim != 2 or not self._blocks.room(*out.shape):
            self.rms_norm(x, w, eps, out)
            return
        T, _, ldx, _, D = view_rows(x)
        _, _, ldo, _, _ = view_rows(out)
        if out.shape != (T, D) or w.shape != (D,):
            raise ValueError(f"rms_norm_for_matmul: x {x.shape}, out {out.shape}, w {w.shape}")
        for a, what in ((x, "x"), (w, "w"), (out, "out")):
            check_dtype(a, np.float32, f"rms_norm_for_matmul {what}")
        self._launcher.launch("rms_norm_quant", (T, self.slices_for(T, D)), (norm_block(D),),
                              [x, I32(ldx), I32(D), w, F32(eps), out, I32(ldo),
                               *self._blocks.args(T, D)])
        self._blocks.made(matrix_key(out))

    def rms_norm_add(self, o, w, eps: float, x) -> None:
        T, _, ldo, _, D = view_rows(o)
        _, _, ldx, _, _ = view_rows(x)
        if o.ndim != 2 or x.shape != o.shape or w.shape != (D,):
            raise ValueError(f"rms_norm_add: o {o.shape}, x {x.shape}, w {w.shape}")
        for a, what in ((o, "o"), (w, "w"), (x, "x")):
            check_dtype(a, np.float32, f"rms_norm_add {what}")
        self._launcher.launch("rms_norm_add", (T,), (norm_block(D),),
                              [o, I32(ldo), I32(D), w, F32(eps), x, I32(ldx)])
