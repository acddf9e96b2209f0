"""Row-wise op launchers of the CUDA backend (cuda/elementwise.cu): the embedding lookup, the
residual / bias add, the row copy of a hidden-state tap, the attention output's softplus gate,
and the gated linear unit (with its output's 8-bit blocks for the down projection's GEMV when
it feeds one).

`ElementwiseOps` owns nothing but its launches; glu_for_matmul records the view whose blocks
it wrote in the shared launcher.ActivationBlocks.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from service.backends.cuda.kernels import ROW_THREADS
from service.backends.cuda.launcher import ActivationBlocks, Launcher
from service.backends.cuda.types import (
    F32,
    I32,
    CudaMatrix,
    ceil_div,
    check_dtype,
    matrix_key,
    view_rows,
)

_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}      # elementwise.cu glu_act's `act`


class ElementwiseOps:
    def __init__(self, launcher: Launcher, blocks: ActivationBlocks) -> None:
        self._launcher = launcher
        self._blocks = blocks

    def embed(self, table: CudaMatrix, ids, scale: float, out) -> None:
        T, E = out.shape
        check_dtype(ids, np.int32, "embed ids")
        if not out.flags.c_contiguous or E != table.k:
            raise ValueError(f"embed: out {out.shape} must be contiguous (T, {table.k})")
        self._launcher.launch(f"embed_{table.layout.kernel}", (T, ceil_div(E, ROW_THREADS)),
                              (ROW_THREADS,),
                              [*table.args(), I32(E), ids, F32(scale), out])

    def add(self, a, b, out) -> None:
        T, _, lda, _, N = view_rows(a)
        To, _, ldo, _, No = view_rows(out)
        if b.ndim == 1:
            ldb = 0
            if b.shape[0] != N:
                raise ValueError(f"add: bias {b.shape} vs rows of {N}")
        else:
            _, _, ldb, _, _ = view_rows(b)
            if b.shape != a.shape:
                raise ValueError(f"add: {a.shape} + {b.shape}")
        if (T, N) != (To, No):
            raise ValueError(f"add: out {out.shape} vs {a.shape}")
        self._launcher.launch("add_rows", (ceil_div(N, ROW_THREADS), T), (ROW_THREADS,),
                              [a, I32(lda), b, I32(ldb), I32(N), out, I32(ldo)])

    def copy_rows(self, src, out) -> None:
        """out (T, N) = src (T, N), f32 rows with their own strides (base.py)."""
        T, _, lds, _, N = view_rows(src)
        To, _, ldo, _, No = view_rows(out)
        if src.ndim != 2 or out.ndim != 2 or (T, N) != (To, No):
            raise ValueError(f"copy_rows: src {src.shape} vs out {out.shape} (2-D, equal)")
        check_dtype(src, np.float32, "copy_rows src")
        check_dtype(out, np.float32, "copy_rows out")
        self._launcher.launch("copy_rows", (ceil_div(N, ROW_THREADS), T), (ROW_THREADS,),
                              [src, I32(lds), I32(N), out, I32(ldo)])
        self._blocks.wrote(out)       # (a tap's buffer is never a GEMV input; kept exact)

    def glu(self, gate, up, activation: str, out) -> None:
        self._glu("glu", gate, up, activation, out, [])

    def softplus_gate(self, a, g) -> None:
        """a (T, H, Dv) *= softplus(g), g (T, H, 1 | Dv) (base.py)."""
        T, H, lda, sh, Dv = view_rows(a)
        Tg, Hg, ldg, gh, G = view_rows(g)
        # the kernel reads a's rows as H * Dv contiguous values and g's heads G apart
        if a.ndim != 3 or g.ndim != 3 or (Tg, Hg) != (T, H) or G not in (1, Dv) or sh != Dv \
                or gh != G:
            raise ValueError(f"softplus_gate: a {a.shape} {a.strides}, g {g.shape} {g.strides}")
        check_dtype(a, np.float32, "softplus_gate a")
        check_dtype(g, np.float32, "softplus_gate g")
        self._launcher.launch("softplus_gate", (ceil_div(H * Dv, ROW_THREADS), T),
                              (ROW_THREADS,), [a, I32(lda), I32(H * Dv), I32(Dv), g, I32(ldg),
                                               I32(G)])

    def glu_for_matmul(self, gate, up, activation: str, out) -> None:
        """glu, and out's 8-bit blocks for the next GEMV when they fit the scratch."""
        if out.ndim != 2 or not self._blocks.room(*out.shape):
            self.glu(gate, up, activation, out)
            return
        self._glu("glu_quant", gate, up, activation, out, self._blocks.args(*out.shape))
        self._blocks.made(matrix_key(out))

    def _glu(self, kernel: str, gate, up, activation: str, out, blocks: list[Any]) -> None:
        T, _, ldg, _, F = view_rows(gate)
        _, _, ldu, _, _ = view_rows(up)
        _, _, ldo, _, _ = view_rows(out)
        if gate.ndim != 2 or up.shape != gate.shape or out.shape != gate.shape:
            raise ValueError(f"{kernel}: gate {gate.shape}, up {up.shape}, out {out.shape}")
        self._launcher.launch(kernel, (ceil_div(F, ROW_THREADS), T), (ROW_THREADS,),
                              [gate, I32(ldg), up, I32(ldu), I32(F),
                               I32(_ACTIVATIONS[activation]), out, I32(ldo), *blocks])
