"""The mixture-of-experts op of the CUDA backend: router GEMV, top-n routing (elementwise.cu
moe_route: softmax or sigmoid router, optional selection bias and weight scale), the expert
GEMVs with the GLU, and the weighted combine (moe_combine).

Two ways to run the expert GEMVs, the same bits (cuda/moe.cu's header):
- grouped (moe.cu): the step's (token, expert) pairs are sorted by expert on the device
  (moe_group, a counting sort into fixed-capacity buffers), then each selected expert's gate,
  up and down matrices are read once per step for all its rows (tiles of up to NC columns),
  the GLU fused into the gate | up GEMV;
- gathered (gemv.cu's gathered mode): one (token, expert) pair per block row, each expert's
  matrices read once per pair.
`group_min_tokens` (CudaBackend(moe_group_min_tokens=...)): steps of at least that many tokens
run grouped (2, the default: every step but a one-token decode, where the two read the same
bytes); None: always gathered (kept for comparison). `group_nc`: the tile width, None for
types.moe_group_nc's choice (benchmarks set it).

`MoeOps` owns the per-pair scratch (sized by prepare for max_tokens * n_used pairs) and the
grouping buffers, and uses the GEMV and elementwise parts it is given for the matmuls.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from service.backends.cuda.elementwise import _ACTIVATIONS, ElementwiseOps
from service.backends.cuda.gemv import GemvOps
from service.backends.cuda.kernels import (
    GEMV_WARPS,
    MOE_GROUP_THREADS,
    MOE_MAX_EXPERTS,
    MOE_ROUTE_THREADS,
    MOEG_GLU_ROWS,
    MOEG_ROWS,
    ROW_THREADS,
)
from service.backends.cuda.launcher import Launcher
from service.backends.cuda.memory import DeviceMemory
from service.backends.cuda.types import (
    F32,
    I32,
    MOEG_NC,
    CudaMatrix,
    ceil_div,
    check_dtype,
    moe_group_nc,
    moe_group_tiles,
    opt_ptr,
    view_rows,
)


class MoeOps:
    def __init__(self, launcher: Launcher, gemv: GemvOps, elementwise: ElementwiseOps, *,
                 group_min_tokens: int | None = 2) -> None:
        self.scratch: dict[str, Any] = {}
        self.group_min_tokens = group_min_tokens
        self.group_nc: int | None = None
        self._cap = 0                 # rows per expert the grouping buffers hold (max_tokens)
        self._launcher = launcher
        self._gemv = gemv
        self._ew = elementwise

    def prepare(self, memory: DeviceMemory, *, max_tokens: int, n_embd: int, n_expert: int,
                n_used: int, n_ff: int) -> None:
        if n_expert > MOE_MAX_EXPERTS or not 0 < n_used <= n_expert:
            raise ValueError(f"mixture of experts: {n_used} of {n_expert} experts; the CUDA "
                             f"router takes 1..n_expert of at most {MOE_MAX_EXPERTS}")
        rows, z = max_tokens * max(1, n_used), memory.zeros
        self._cap = max_tokens        # a token picks an expert at most once
        self.scratch = {"logits": z((max_tokens, n_expert)),        # (T, n_expert) f32
                        "ids": z((rows,), "int32"),                  # (P,) i32 expert ids
                        "w": z((rows,)),                             # (P,) f32 weights
                        "g": z((rows, n_ff)), "u": z((rows, n_ff)),  # (P, F) f32
                        "a": z((rows, n_ff)), "y": z((rows, n_embd)),
                        # moe_group's output (cuda/moe.cu)
                        "counts": z((n_expert,), "int32"),           # (n_expert,) i32
                        "rows": z((n_expert * max_tokens,), "int32"),  # (n_expert, cap) i32
                        "tiles": z((rows, 2), "int32"),              # (<= P, 2) i32
                        "n_tiles": z((1,), "int32")}

    def grouped(self, n_tokens: int) -> bool:
        """Whether a step of n_tokens tokens runs the expert-grouped GEMVs."""
        return self.group_min_tokens is not None and n_tokens >= self.group_min_tokens

    def moe(self, x, router: CudaMatrix, gate: CudaMatrix, up: CudaMatrix, down: CudaMatrix,
            n_used: int, normalize: bool, activation: str, out, *, gating: str = "softmax",
            bias=None, scale: float = 1.0) -> None:
        if gating not in ("softmax", "sigmoid"):
            raise ValueError(f"moe: router {gating!r}: 'softmax' or 'sigmoid'")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"moe: activation {activation!r}: one of {sorted(_ACTIVATIONS)}")
        T = x.shape[0]
        m, P = self.scratch, T * n_used
        ids, w, y = m["ids"][:P], m["w"][:P], m["y"][:P]
        self._route(x, router, n_used, normalize, gating, bias, scale)
        if self.grouped(T):
            self._grouped(x, gate, up, down, T, n_used, activation, y)
        else:
            g, u, a = m["g"][:P], m["u"][:P], m["a"][:P]
            self._gemv.matmul(x, gate, g, ids, P, n_used)              # (P, F)
            self._gemv.matmul(x, up, u, ids, P, n_used)
            self._ew.glu(g, u, activation, a)
            self._gemv.matmul(a, down, y, ids, P, 1)                   # (P, E)
        _, _, ldo, _, E = view_rows(out)
        self._launcher.launch("moe_combine", (ceil_div(E, ROW_THREADS), T), (ROW_THREADS,),
                              [y, w, I32(n_used), I32(E), out, I32(ldo)])

    def _route(self, x, router: CudaMatrix, n_used: int, normalize: bool, gating: str, bias,
               scale: float) -> None:
        """ids[:P], w[:P] = each token's n_used experts and their weights."""
        T = x.shape[0]
        m, P = self.scratch, T * n_used
        logits = m["logits"][:T]
        self._gemv.matmul(x, router, logits)                           # (T, n_expert)
        self._launcher.launch("moe_route", (ceil_div(T, MOE_ROUTE_THREADS // 32),),
                              (MOE_ROUTE_THREADS,),
                              [logits, I32(logits.shape[1]), I32(T), I32(router.n),
                               I32(n_used), I32(1 if normalize else 0),
                               I32(1 if gating == "sigmoid" else 0), opt_ptr(bias), F32(scale),
                               m["ids"][:P], m["w"][:P]])

    # ---------------------------------------------------------------- expert-grouped path
    def _grouped(self, x, gate: CudaMatrix, up: CudaMatrix, down: CudaMatrix, T: int,
                 n_used: int, activation: str, y) -> None:
        """y[:P] = down(act(gate x) * up x) per pair, each expert's matrices read once."""
        m, P, n_expert = self.scratch, T * n_used, gate.n_expert
        if T > self._cap or n_expert != m["counts"].shape[0]:
            raise ValueError(f"moe: {T} tokens / {n_expert} experts, prepared for "
                             f"{self._cap} / {m['counts'].shape[0]}")
        nc = self.group_nc or moe_group_nc(T, n_used, n_expert)
        if nc not in MOEG_NC:
            raise ValueError(f"moe: group_nc {nc}: one of {MOEG_NC}")
        tiles = self.group(P, n_expert, nc)
        a = m["a"][:P]                                                 # (P, F) f32
        act = _ACTIVATIONS[activation]
        if gate.layout.kernel == up.layout.kernel:
            self.grouped_matmul(x, (gate, up), a, nc, tiles, n_used, act)
        else:                         # no fused kernel for two weight types: GLU apart
            g, u = m["g"][:P], m["u"][:P]
            self.grouped_matmul(x, (gate,), g, nc, tiles, n_used)
            self.grouped_matmul(x, (up,), u, nc, tiles, n_used)
            self._ew.glu(g, u, activation, a)
        self.grouped_matmul(a, (down,), y, nc, tiles, 1)              # (P, E)

    def group(self, n_pairs: int, n_expert: int, nc: int) -> int:
        """moe_group over the scratch's ids[:n_pairs]: per expert its count and pairs (token
        order), and tiles of up to nc of them (cuda/moe.cu). Returns the tile bound (grid.y of
        the grouped GEMVs)."""
        m = self.scratch
        if n_pairs > m["tiles"].shape[0] or n_expert != m["counts"].shape[0] or nc not in MOEG_NC:
            raise ValueError(f"moe_group: {n_pairs} pairs, {n_expert} experts, {nc} columns "
                             f"per tile; prepared for {m['tiles'].shape[0]} / "
                             f"{m['counts'].shape[0]}, tiles of {MOEG_NC}")
        self._launcher.launch("moe_group", (1,), (MOE_GROUP_THREADS,),
                              [m["ids"][:n_pairs], I32(n_pairs), I32(n_expert), I32(self._cap),
                               I32(nc), m["counts"], m["rows"], m["tiles"], m["n_tiles"]])
        return moe_group_tiles(n_pairs, n_expert, nc)

    def grouped_matmul(self, x, mats: tuple[CudaMatrix, ...], out, nc: int, tiles: int,
                       act_div: int, act: int = 0) -> None:
        """out[p] = x[p / act_div] W_e^T for every pair p of the grouping moe_group last made
        (e = the pair's expert), W = mats[0]; with two matrices (gate, up) of one weight type,
        out[p] = act(x G_e^T) * (x U_e^T). `tiles`: grid.y, at least the tiles made."""
        w, glu = mats[0], len(mats) == 2
        T, _, ldx, _, K = view_rows(x)
        C, _, ldo, _, N = view_rows(out)
        if x.ndim != 2 or out.ndim != 2 or K != w.k or N != w.n or not 1 <= len(mats) <= 2:
            raise ValueError(f"grouped matmul: x {x.shape} / out {out.shape} vs W ({w.n}, "
                             f"{w.k})")
        if glu and (mats[1].layout.kernel != w.layout.kernel or mats[1].rows != w.rows
                    or mats[1].k != w.k):
            raise ValueError("grouped matmul: gate and up differ in type or shape")
        check_dtype(x, np.float32, "grouped matmul x")
        check_dtype(out, np.float32, "grouped matmul out")
        if nc not in MOEG_NC:
            raise ValueError(f"grouped matmul: {nc} columns per tile, one of {MOEG_NC}")
        m = self.scratch
        if C > T * act_div or C > m["tiles"].shape[0] or tiles > m["tiles"].shape[0]:
            raise ValueError(f"grouped matmul: {T} input rows / {C} pairs / {tiles} tiles")
        R = (MOEG_GLU_ROWS if glu else MOEG_ROWS)[nc]
        tail = [m["tiles"], m["n_tiles"], m["rows"], I32(self._cap), I32(w.n), I32(act_div)]
        if w.layout.quantized:
            qa, ads = self._gemv.quantize(x)
            planes = [p for mat in mats for p in mat.args()]
            args = [*planes, I32(K), I32(N), qa, ads, *tail]
        else:
            args = [*(mat.planes[0] for mat in mats), I32(K), I32(N), x, I32(ldx), *tail]
        if glu:
            args.append(I32(act))
        self._launcher.launch(f"moeg_{'glu_' if glu else ''}{w.layout.kernel}_c{nc}r{R}",
                              (ceil_div(N, GEMV_WARPS * R), tiles), (32, GEMV_WARPS),
                              [*args, out, I32(ldo)])
        self._launcher.blocks.wrote(out)
