"""RMSNorm launchers of the CUDA backend (cuda/elementwise.cu rms_norm, rms_norm_quant,
rms_norm_add): rows of up-to-3-D views, one block of norm_block(D) threads per row, so every
kernel computing a norm of D sums in the same order.

`NormOps` owns nothing but its launches; rms_norm_for_matmul records the view whose 8-bit
blocks it wrote in the shared launcher.ActivationBlocks.
"""

from __future__ import annotations

import numpy as np

from service.backends.cuda.launcher import ActivationBlocks, Launcher
from service.backends.cuda.types import F32, I32, check_dtype, matrix_key, norm_block, view_rows


class NormOps:
    def __init__(self, launcher: Launcher, blocks: ActivationBlocks) -> None:
        self._launcher = launcher
        self._blocks = blocks

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
        self._launcher.launch("rms_norm_quant", (T,), (norm_block(D),),
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
