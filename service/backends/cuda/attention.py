"""Attention launchers of the CUDA backend: split-KV attention with its combine in one launch
(attention.cu) for every step up to the step-size-invariant widths, and the query-tiled kernel
(attention_tiled.cu) for long steps. Tree verify rows (base.py) reach the split kernel as
optional int32 arrays (attn_lo, attn_mask); null pointers when absent.

`AttentionOps` owns the split kernel's scratch (per (token, head, split) partials and the
per (token, head) split counters the kernel leaves at 0) and the threshold of the tiled
kernel (`CudaBackend.prefill_attention_min_tokens`): steps with at least that many tokens, and
more than the invariant widths, run on the tiled kernel (keys read once per 32 query rows
instead of once per query); None keeps every step on the split kernel. A row's result depends
on neither kernel's other rows; the two kernels differ in the last bits. With blocks, the split
kernel also writes its output's 8-bit blocks (rows of H * Dv) and records the view in the
shared launcher.ActivationBlocks.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from service.backends.cuda.kernels import AT_KEYS, AT_ROWS, AT_WARPS, ATT_WARPS, KV_READ
from service.backends.cuda.launcher import ActivationBlocks, Launcher
from service.backends.cuda.memory import DeviceMemory
from service.backends.cuda.types import (
    F32,
    I32,
    NULL,
    CudaKVCache,
    ceil_div,
    check_dtype,
    check_rows,
    opt_ptr,
    view_rows,
)

ATT_CHUNK = 32 * ATT_WARPS          # KV positions per split (the chunk argument): a tile per warp
PREFILL_ATTENTION_MIN_TOKENS = 32   # the tiled kernel's threshold (`tiled_min_tokens`) default
ATT_TILED_MAX_D = 256               # head sizes (K and V) of the tiled kernel's _d256 variant


class AttentionOps:
    def __init__(self, launcher: Launcher, blocks: ActivationBlocks,
                 tiled_min_tokens: int | None) -> None:
        self.tiled_min_tokens = tiled_min_tokens
        self.part_ml: Any = None      # (T, H, S, 2) f32 per split (max, sum)
        self.part_acc: Any = None     # (T, H, S, Dv) f32 per split accumulators
        self.counters: Any = None     # (T * H) int32 splits done, 0 between launches
        self._launcher = launcher
        self._blocks = blocks

    def prepare(self, memory: DeviceMemory, *, max_tokens: int, n_head: int, head_dim_v: int,
                n_ctx: int) -> None:
        n_split, z = ceil_div(n_ctx, ATT_CHUNK), memory.zeros
        self.part_ml = z((max_tokens * n_head * n_split, 2), "float32")
        self.part_acc = z((max_tokens * n_head * n_split * head_dim_v,), "float32")
        self.counters = z((max_tokens * n_head,), "int32")       # the kernel leaves them at 0

    def attention(self, q, cache: CudaKVCache, layer: int, slots, positions, window: int,
                  scale: float, out, for_matmul: bool, attn_lo=None, attn_mask=None) -> None:
        # no KV length: positions come from the device, no host length in the launch
        T, H, q0, q1, D = view_rows(q)
        To, Ho, o0, o1, Dv = view_rows(out)
        Hkv = cache.n_head_kv
        if (q.ndim, out.ndim) != (3, 3) or (To, Ho) != (T, H) or H % Hkv or D % 8 \
                or (D, Dv) != (cache.head_dim, cache.head_dim_v):
            raise ValueError(f"attention: q {q.shape}, out {out.shape}, cache heads {Hkv} x "
                             f"{cache.head_dim}/{cache.head_dim_v}")
        check_dtype(q, np.float32, "attention q")
        check_dtype(out, np.float32, "attention out")
        if (attn_lo is None) != (attn_mask is None):
            raise ValueError("attention: attn_lo and attn_mask come together")
        check_rows(T, slots=slots, positions=positions, attn_lo=attn_lo, attn_mask=attn_mask)
        if attn_lo is None and self._tiled(T, H, Hkv, D, Dv):
            self._attention_tiled(q, cache, layer, slots, positions, window, scale, out)
            return
        n_split = ceil_div(cache.n_ctx, ATT_CHUNK)
        if self.part_ml is None or T * H * n_split > self.part_ml.shape[0] \
                or T * H > self.counters.size:
            raise ValueError(f"attention over {T} tokens exceeds the prepared buffers")
        # the output's 8-bit blocks as rows of H * Dv, when its heads are contiguous
        quant = for_matmul and o1 == Dv and Dv % 32 == 0 and self._blocks.room(T, H * Dv)
        blocks = self._blocks.args(T, H * Dv) if quant else [NULL, NULL]
        (kq, kd), (vq, vd) = cache.k[layer], cache.v[layer]
        ml, acc = self.part_ml[: T * H * n_split], self.part_acc[: T * H * n_split * Dv]
        size = 128 if Dv <= 128 else 256             # the kernel's accumulators per lane
        (kr, kk), (vr, vk) = _readers(cache)
        self._launcher.launch(
            f"attn_{kr}_{vr}_d{size}", (n_split, H, T), (32, ATT_WARPS),
            [q, I32(q0), I32(q1), I32(H), I32(Hkv), I32(D), I32(Dv), kq,
             kd if kd is not None else kq, vq, vd if vd is not None else vq, slots, positions,
             opt_ptr(attn_lo), opt_ptr(attn_mask), *cache.table_args(), I32(window), F32(scale),
             I32(ATT_CHUNK), ml, acc, self.counters, out, I32(o0), I32(o1), *blocks, I32(kk),
             I32(vk)])
        if quant:
            self._blocks.made((out.data.ptr, T, H * Dv, o0))

    def _tiled(self, T: int, H: int, Hkv: int, D: int, Dv: int) -> bool:
        """Whether a step of T query rows runs on the query-tiled kernel: long steps (prefill
        chunks) past the step-size-invariant widths, head sizes the kernel holds."""
        m = self.tiled_min_tokens
        return (m is not None and T >= m and H // Hkv <= AT_ROWS
                and D % 8 == 0 and D <= ATT_TILED_MAX_D and Dv % 32 == 0
                and Dv <= ATT_TILED_MAX_D)

    def _attention_tiled(self, q, cache: CudaKVCache, layer: int, slots, positions,
                         window: int, scale: float, out) -> None:
        # (attention_tiled.cu) checked by attention: shapes, dtypes, row arrays
        T, H, q0, q1, D = view_rows(q)
        _, _, o0, o1, Dv = view_rows(out)
        Hkv = cache.n_head_kv
        qt = AT_ROWS // (H // Hkv)                        # tokens per block
        size = 128 if Dv <= 128 else 256
        smem = 4 * (AT_ROWS * D + D * AT_KEYS + AT_KEYS * (Dv + 1))     # f32 q, K^T, V tiles
        (kq, kd), (vq, vd) = cache.k[layer], cache.v[layer]
        (kr, kk), (vr, vk) = _readers(cache)
        self._launcher.launch(
            f"attnt_{kr}_{vr}_d{size}", (ceil_div(T, qt), Hkv),
            (32, AT_WARPS),
            [q, I32(q0), I32(q1), I32(T), I32(H), I32(Hkv), I32(D), I32(Dv), I32(qt), kq,
             kd if kd is not None else kq, vq, vd if vd is not None else vq, slots, positions,
             *cache.table_args(), I32(window), F32(scale), out, I32(o0), I32(o1), I32(kk),
             I32(vk)], shared_mem=smem)


def _readers(cache: CudaKVCache) -> tuple[tuple[str, int], tuple[str, int]]:
    """(reader name, kind bits) of the cache's K and V types (kernels.KV_READ): the attention
    kernel's name part and its kk, vk arguments."""
    return KV_READ[str(cache.type_k)], KV_READ[str(cache.type_v)]
