"""RoPE launchers of the CUDA backend: the cos/sin table (load time), RoPE in place
(elementwise.cu rope), and a layer's attention inputs in one launch (rope_kv.cu: per-head
q/k RMSNorm, RoPE, and the K/V stores into the paged cache). Tree verify rows (base.py) reach
rope_kv as kv_positions (an int32 array, or a null pointer when absent).

`RopeOps` owns nothing but its launches; the table is uploaded through the loader's
upload_vector it is given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from service.backends.cuda.kernels import ROPE_KV_MAX_D
from service.backends.cuda.launcher import Launcher
from service.backends.cuda.types import (
    F32,
    I32,
    CudaKVCache,
    check_dtype,
    check_rows,
    norm_block,
    opt_ptr,
    view_rows,
)
from service.backends.rope_angles import rope_cos_sin


class RopeOps:
    def __init__(self, launcher: Launcher, upload_vector: Callable[[Any], Any]) -> None:
        self._launcher = launcher
        self._upload_vector = upload_vector

    def table(self, n_ctx: int, n_dims: int, base: float, scaling=None) -> tuple[Any, Any]:
        cos, sin = rope_cos_sin(n_ctx, n_dims, base, scaling)                 # (n_ctx, n/2)
        return self._upload_vector(cos), self._upload_vector(sin)

    def rope(self, x, positions, table, neox: bool) -> None:
        T, H, s0, s1, _ = view_rows(x)
        half = table[0].shape[1]
        self._launcher.launch("rope", (T, H), (64,),
                              [x, I32(s0), I32(s1), positions, table[0], table[1], I32(half),
                               I32(1 if neox else 0)])

    def rope_kv(self, q, k, v, q_norm, k_norm, eps: float, positions, slots, table, neox: bool,
                cache: CudaKVCache, layer: int, kv_positions=None) -> None:
        T, H, q0, q1, D = view_rows(q)
        Tk, Hkv, k0, k1, Dk = view_rows(k)
        Tv, Hv, v0, v1, Dv = view_rows(v)
        half = table[0].shape[1]
        if (q.ndim, k.ndim, v.ndim) != (3, 3, 3) or not T == Tk == Tv or Hkv != Hv \
                or (Hkv, D, Dk, Dv) != (cache.n_head_kv, cache.head_dim, cache.head_dim,
                                        cache.head_dim_v) \
                or D > ROPE_KV_MAX_D or 2 * half > D:
            raise ValueError(f"rope_kv: q {q.shape}, k {k.shape}, v {v.shape}, rotary "
                             f"{2 * half}, cache heads {cache.n_head_kv} x {cache.head_dim}/"
                             f"{cache.head_dim_v}")
        for a, what in ((q, "q"), (k, "k"), (v, "v"), (q_norm, "q_norm"), (k_norm, "k_norm")):
            if a is not None:
                check_dtype(a, np.float32, f"rope_kv {what}")
        for a in (q_norm, k_norm):
            if a is not None and a.shape != (D,):
                raise ValueError(f"rope_kv: norm weights {a.shape}, heads of {D}")
        check_dtype(positions, np.int32, "rope_kv positions")
        check_dtype(slots, np.int32, "rope_kv slots")
        check_rows(T, positions=positions, slots=slots, kv_positions=kv_positions)
        (kc, ks), (vc, vs) = cache.k[layer], cache.v[layer]
        self._launcher.launch(f"rope_kv_{cache.type_k}_{cache.type_v}", (T, H + 2 * Hkv),
                              (norm_block(D),),
                              [q, I32(q0), I32(q1), k, I32(k0), I32(k1), v, I32(v0), I32(v1),
                               I32(H), I32(Hkv), I32(D), I32(Dv), opt_ptr(q_norm),
                               opt_ptr(k_norm), F32(eps), positions, slots,
                               opt_ptr(kv_positions), table[0], table[1], I32(half),
                               I32(1 if neox else 0), *cache.table_args(), kc, opt_ptr(ks), vc,
                               opt_ptr(vs)])
