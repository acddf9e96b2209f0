"""The attention family of the CUDA backend: the paged KV cache (base.py: a pool of blocks and a
device block table every KV kernel reads through), RoPE, KV stores, RoPE + KV store
in one launch (rope_kv.cu), split-KV attention with its combine (attention.cu), and KV row
moves for tree compaction (kv_move in quantize.cu). Tree verify rows (base.py) reach the
kernels as optional int32 arrays (kv_positions, attn_lo, attn_mask); null pointers when absent.

A mixin of CudaBackend: it uses the backend's stream, `_launch`, scratch `_s` and its 8-bit
block bookkeeping (`_block_room`, `_block_args`, `_blocks`).
"""

from __future__ import annotations

import cupy as cp
import numpy as np

from service.backends.base import checked_block_table, initial_block_table, kv_pool_geometry
from service.backends.cuda.types import (
    ATT_CHUNK,
    ATT_MAX_D,
    ATT_MAX_DV,
    ATT_TILED_KEYS,
    ATT_TILED_MAX_D,
    ATT_TILED_ROWS,
    F32,
    I32,
    KV_TYPES,
    NULL,
    ROPE_KV_MAX_D,
    CudaKVCache,
    ceil_div,
    check_dtype,
    norm_block,
    view_rows,
)


class AttentionOps:
    """KV cache, RoPE and attention launchers of CudaBackend (one launcher per kernel)."""

    def new_kv_cache(self, n_layer, n_slots, n_ctx, n_head_kv, head_dim, head_dim_v,
                     type_k, type_v, n_blocks=0, block_size=16) -> CudaKVCache:
        for t, d in ((type_k, head_dim), (type_v, head_dim_v)):
            if t not in KV_TYPES:
                raise ValueError(f"KV cache type {t!r} not supported by the CUDA backend")
            if t != "f16" and d % 32:
                raise ValueError(f"KV cache type {t} needs a head size that is a multiple "
                                 f"of 32, this model's is {d}")
        if head_dim > ATT_MAX_D or head_dim_v > ATT_MAX_DV:
            raise ValueError(f"head sizes {head_dim}/{head_dim_v} exceed the attention "
                             f"kernel's {ATT_MAX_D}/{ATT_MAX_DV}")
        max_blocks, n_blocks = kv_pool_geometry(n_slots, n_ctx, n_blocks, block_size)
        rows = n_blocks * block_size * n_head_kv

        def planes(t, d):
            with self.stream:
                if t == "f16":
                    return cp.zeros(rows * d, cp.uint16), None
                codes = cp.zeros(rows * (d if t == "q8_0" else d // 2), cp.uint8)
                return codes, cp.zeros(rows * (d // 32), cp.uint16)

        k = [planes(type_k, head_dim) for _ in range(n_layer)]
        v = [planes(type_v, head_dim_v) for _ in range(n_layer)]
        # kv_move's table: every plane and the bytes of one position in it
        ptrs, sizes = [], []
        for per_layer, d, t in ((k, head_dim, type_k), (v, head_dim_v, type_v)):
            code_bytes = {"f16": 2 * d, "q8_0": d, "q4_0": d // 2}[t]
            for codes, scales in per_layer:
                ptrs.append(codes.data.ptr)
                sizes.append(n_head_kv * code_bytes)
                if scales is not None:
                    ptrs.append(scales.data.ptr)
                    sizes.append(n_head_kv * (d // 32) * 2)
        with self.stream:
            move_planes = cp.asarray(np.array(ptrs, np.uint64))               # (P,) u64
            move_bytes = cp.asarray(np.array(sizes, np.int32))                # (P,) i32
            table = cp.asarray(initial_block_table(n_slots, max_blocks, n_blocks))
        self.stream.synchronize()            # the host sources above are temporaries
        return CudaKVCache(k, v, type_k, type_v, n_slots, n_ctx, n_head_kv, head_dim,
                           head_dim_v, block_size, n_blocks, max_blocks, table, move_planes,
                           move_bytes)

    def set_block_table(self, cache: CudaKVCache, host) -> None:
        # (n_slots, max_blocks) i32 into the table in place (captured graphs hold its pointer),
        # on the step stream: ordered after the steps queued before and before the next one.
        # A pageable source is staged by the copy before it returns, so `host` may change then.
        src = checked_block_table(cache, host)
        cache.block_table.set(src, stream=self.stream)

    def rope_table(self, n_ctx, n_dims, base):
        inv = base ** (-np.arange(0, n_dims, 2, dtype=np.float64) / n_dims)    # (n_dims/2,)
        ang = np.arange(n_ctx, dtype=np.float64)[:, None] * inv[None, :]      # (n_ctx, n/2)
        return (self.upload_vector(np.cos(ang).astype(np.float32)),
                self.upload_vector(np.sin(ang).astype(np.float32)))

    def rope(self, x, positions, table, neox):
        T, H, s0, s1, _ = view_rows(x)
        half = table[0].shape[1]
        self._launch("rope", (T, H), (64,),
                     [x, I32(s0), I32(s1), positions, table[0], table[1], I32(half),
                      I32(1 if neox else 0)])

    def kv_write(self, cache: CudaKVCache, layer, k, v, slots, positions):
        for src, (codes, scales), t in ((k, cache.k[layer], cache.type_k),
                                        (v, cache.v[layer], cache.type_v)):
            T, H, st, sh, D = view_rows(src)
            self._launch(f"kv_store_{t}", (T, H), (32, ceil_div(D, 32)),
                         [src, I32(st), I32(sh), I32(D), slots, positions,
                          *cache.table_args(), I32(H), codes,
                          scales if scales is not None else NULL])

    def rope_kv(self, q, k, v, q_norm, k_norm, eps, positions, slots, table, neox,
                cache: CudaKVCache, layer, kv_positions=None):
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
        _check_rows(T, positions=positions, slots=slots, kv_positions=kv_positions)
        (kc, ks), (vc, vs) = cache.k[layer], cache.v[layer]
        opt = [a if a is not None else NULL for a in (q_norm, k_norm, ks, vs)]
        self._launch(f"rope_kv_{cache.type_k}_{cache.type_v}", (T, H + 2 * Hkv),
                     (norm_block(D),),
                     [q, I32(q0), I32(q1), k, I32(k0), I32(k1), v, I32(v0), I32(v1),
                      I32(H), I32(Hkv), I32(D), I32(Dv), opt[0], opt[1], F32(eps),
                      positions, slots, _opt(kv_positions), table[0], table[1], I32(half),
                      I32(1 if neox else 0),
                      *cache.table_args(), kc, opt[2], vc, opt[3]])

    def attention(self, q, cache: CudaKVCache, layer, slots, positions, kv_len, window, scale,
                  out, attn_lo=None, attn_mask=None):
        self._attention(q, cache, layer, slots, positions, window, scale, out, False, attn_lo,
                        attn_mask)

    def attention_for_matmul(self, q, cache: CudaKVCache, layer, slots, positions, kv_len,
                             window, scale, out, attn_lo=None, attn_mask=None):
        self._attention(q, cache, layer, slots, positions, window, scale, out, True, attn_lo,
                        attn_mask)

    def _attention(self, q, cache: CudaKVCache, layer, slots, positions, window, scale, out,
                   for_matmul: bool, attn_lo=None, attn_mask=None):
        # kv_len is not used: positions come from the device, no host length in the launch
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
        _check_rows(T, slots=slots, positions=positions, attn_lo=attn_lo, attn_mask=attn_mask)
        if attn_lo is None and self._tiled_attention(T, H, Hkv, D, Dv):
            self._attention_tiled(q, cache, layer, slots, positions, window, scale, out)
            return
        n_split = ceil_div(cache.n_ctx, ATT_CHUNK)
        s = self._s
        if s.part_ml is None or T * H * n_split > s.part_ml.shape[0] or T * H > s.counters.size:
            raise ValueError(f"attention over {T} tokens exceeds the prepared buffers")
        # the output's 8-bit blocks as rows of H * Dv, when its heads are contiguous
        quant = for_matmul and o1 == Dv and Dv % 32 == 0 and self._block_room(T, H * Dv)
        blocks = self._block_args(T, H * Dv) if quant else [NULL, NULL]
        (kq, kd), (vq, vd) = cache.k[layer], cache.v[layer]
        ml, acc = s.part_ml[: T * H * n_split], s.part_acc[: T * H * n_split * Dv]
        size = 128 if Dv <= 128 else 256             # the kernel's accumulators per lane
        self._launch(f"attn_{cache.type_k}_{cache.type_v}_d{size}", (n_split, H, T), (32, 4),
                     [q, I32(q0), I32(q1), I32(H), I32(Hkv), I32(D), I32(Dv), kq,
                      kd if kd is not None else kq, vq, vd if vd is not None else vq, slots,
                      positions, _opt(attn_lo), _opt(attn_mask), *cache.table_args(), I32(window),
                      F32(scale), I32(ATT_CHUNK),
                      ml, acc, s.counters, out, I32(o0), I32(o1), *blocks])
        if quant:
            self._blocks = (out.data.ptr, T, H * Dv, o0)

    def _tiled_attention(self, T: int, H: int, Hkv: int, D: int, Dv: int) -> bool:
        """Whether a step of T query rows runs on the query-tiled kernel: long steps (prefill
        chunks) past the step-size-invariant widths, head sizes the kernel holds."""
        m = self.prefill_attention_min_tokens
        return (m is not None and T >= m and H // Hkv <= ATT_TILED_ROWS
                and D % 8 == 0 and D <= ATT_TILED_MAX_D and Dv % 32 == 0
                and Dv <= ATT_TILED_MAX_D)

    def _attention_tiled(self, q, cache: CudaKVCache, layer, slots, positions, window, scale,
                         out) -> None:
        # (attention_tiled.cu) checked by _attention: shapes, dtypes, row arrays
        T, H, q0, q1, D = view_rows(q)
        _, _, o0, o1, Dv = view_rows(out)
        Hkv = cache.n_head_kv
        qt = ATT_TILED_ROWS // (H // Hkv)                 # tokens per block
        size = 128 if Dv <= 128 else 256
        name = f"attnt_{cache.type_k}_{cache.type_v}_d{size}"
        smem = 4 * (ATT_TILED_ROWS * D + D * ATT_TILED_KEYS + ATT_TILED_KEYS * (Dv + 1))
        (kq, kd), (vq, vd) = cache.k[layer], cache.v[layer]
        self._launch(name, (ceil_div(T, qt), Hkv), (32, 4),
                     [q, I32(q0), I32(q1), I32(T), I32(H), I32(Hkv), I32(D), I32(Dv), I32(qt),
                      kq, kd if kd is not None else kq, vq, vd if vd is not None else vq,
                      slots, positions, *cache.table_args(), I32(window), F32(scale), out,
                      I32(o0), I32(o1)], shared_mem=smem)

    def kv_move(self, cache: CudaKVCache, slots, src, dst):
        n = len(src)
        _check_rows(n, slots=slots, src=src, dst=dst)
        if n == 0:
            return
        P = cache.move_planes.size
        self._launch("kv_move", (P,), (256,),
                     [cache.move_planes, cache.move_bytes, *cache.table_args(), slots, src,
                      dst, I32(n)])


def _opt(a):
    return a if a is not None else NULL


def _check_rows(n: int, **arrays) -> None:
    """Every given per-row array is (>= n,) int32 and contiguous."""
    for name, a in arrays.items():
        if a is None:
            continue
        check_dtype(a, np.int32, name)
        if a.ndim != 1 or a.shape[0] < n or not a.flags.c_contiguous:
            raise ValueError(f"{name}: (>= {n},) contiguous int32 wanted, got {a.shape}")
