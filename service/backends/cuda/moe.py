"""The mixture-of-experts op of the CUDA backend: router GEMV, top-n routing (elementwise.cu
moe_route: softmax or sigmoid router, optional selection bias and weight scale), gathered
expert GEMVs (gemv.cu's gathered mode: one (token, expert) pair per block row), the GLU, and
the weighted combine (moe_combine).

`MoeOps` owns the per-pair scratch (sized by prepare for max_tokens * n_used pairs) and uses
the GEMV and elementwise parts it is given for the matmuls and the GLU.
"""

from __future__ import annotations

from typing import Any

from service.backends.cuda.elementwise import ElementwiseOps
from service.backends.cuda.gemv import GemvOps
from service.backends.cuda.kernels import MOE_MAX_EXPERTS, MOE_ROUTE_THREADS, ROW_THREADS
from service.backends.cuda.launcher import Launcher
from service.backends.cuda.memory import DeviceMemory
from service.backends.cuda.types import F32, I32, CudaMatrix, ceil_div, opt_ptr, view_rows


class MoeOps:
    def __init__(self, launcher: Launcher, gemv: GemvOps, elementwise: ElementwiseOps) -> None:
        self.scratch: dict[str, Any] = {}
        self._launcher = launcher
        self._gemv = gemv
        self._ew = elementwise

    def prepare(self, memory: DeviceMemory, *, max_tokens: int, n_embd: int, n_expert: int,
                n_used: int, n_ff: int) -> None:
        if n_expert > MOE_MAX_EXPERTS or not 0 < n_used <= n_expert:
            raise ValueError(f"mixture of experts: {n_used} of {n_expert} experts; the CUDA "
                             f"router takes 1..n_expert of at most {MOE_MAX_EXPERTS}")
        rows, z = max_tokens * max(1, n_used), memory.zeros
        self.scratch = {"logits": z((max_tokens, n_expert)),        # (T, n_expert) f32
                        "ids": z((rows,), "int32"),                  # (P,) i32 expert ids
                        "w": z((rows,)),                             # (P,) f32 weights
                        "g": z((rows, n_ff)), "u": z((rows, n_ff)),  # (P, F) f32
                        "a": z((rows, n_ff)), "y": z((rows, n_embd))}

    def moe(self, x, router: CudaMatrix, gate: CudaMatrix, up: CudaMatrix, down: CudaMatrix,
            n_used: int, normalize: bool, activation: str, out, *, gating: str = "softmax",
            bias=None, scale: float = 1.0) -> None:
        if gating not in ("softmax", "sigmoid"):
            raise ValueError(f"moe: router {gating!r}: 'softmax' or 'sigmoid'")
        T = x.shape[0]
        m, P = self.scratch, T * n_used
        logits, ids, w = m["logits"][:T], m["ids"][:P], m["w"][:P]
        self._gemv.matmul(x, router, logits)                           # (T, n_expert)
        self._launcher.launch("moe_route", (ceil_div(T, MOE_ROUTE_THREADS // 32),),
                              (MOE_ROUTE_THREADS,),
                              [logits, I32(logits.shape[1]), I32(T), I32(router.n),
                               I32(n_used), I32(1 if normalize else 0),
                               I32(1 if gating == "sigmoid" else 0), opt_ptr(bias), F32(scale),
                               ids, w])
        g, u, a, y = m["g"][:P], m["u"][:P], m["a"][:P], m["y"][:P]
        self._gemv.matmul(x, gate, g, ids, P, n_used)                  # (P, F)
        self._gemv.matmul(x, up, u, ids, P, n_used)
        self._ew.glu(g, u, activation, a)
        self._gemv.matmul(a, down, y, ids, P, 1)                       # (P, E)
        _, _, ldo, _, E = view_rows(out)
        self._launcher.launch("moe_combine", (ceil_div(E, ROW_THREADS), T), (ROW_THREADS,),
                              [y, w, I32(n_used), I32(E), out, I32(ldo)])
