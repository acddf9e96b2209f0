"""The attention part of the CPU backend: the paged KV cache (float32 rows of a pool of blocks,
each row rounded through the cache's element type when written (any of formats.KVType, through
ggml's quantizers in gguf.quants), so attention sees exactly what such a cache would return;
the memory saving of a quantized cache is the GPU backend's business), KV stores, attention
(per query for decode and verify steps: one numba kernel over each query's own key rows in a
fixed order, so a row's output never depends on the step; one masked product per slot for
prefill chunks) and KV row moves for tree compaction.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from service.backends.base import (
    KVCache,
    checked_block_table,
    initial_block_table,
    kv_pool_geometry,
)
from service.backends.cpu import kernels as K
from service.backends.cpu.threads import ThreadBudget
from service.formats import BACKEND_KV_TYPES, KVType
from service.gguf import quants

KV_TYPES: tuple[KVType, ...] = BACKEND_KV_TYPES["cpu"]


@dataclass
class CpuKVCache(KVCache):
    k: list[np.ndarray]              # per layer (n_blocks * block_size, Hkv, D) f32
    v: list[np.ndarray]              # per layer (n_blocks * block_size, Hkv, Dv) f32
    type_k: str
    type_v: str
    n_slots: int
    n_ctx: int
    n_head_kv: int
    block_size: int
    n_blocks: int
    max_blocks: int
    block_table: np.ndarray          # (n_slots, max_blocks) i32

    def rows(self, slot: int, positions) -> np.ndarray:
        """Physical pool rows of the logical positions (an int array) of `slot`."""
        p = np.asarray(positions, np.int64)
        return self.block_table[slot, p // self.block_size].astype(np.int64) * self.block_size \
            + p % self.block_size

    def rows_of(self, slots, positions) -> np.ndarray:
        """Physical rows of (slots[t], positions[t]) pairs (slots >= 0)."""
        p = np.asarray(positions, np.int64)
        return self.block_table[slots, p // self.block_size].astype(np.int64) \
            * self.block_size + p % self.block_size


def _round_trip(x: np.ndarray, kv_type: str) -> np.ndarray:
    """The values an element type stores for x (..., D) f32 (ggml's quantizers, bit-exact)."""
    if kv_type == KVType.F16:   # IEEE round-to-nearest-even, as ggml's f16 conversion
        return x.astype(np.float16).astype(np.float32)
    qt = quants.kv_qtype(kv_type)
    raw = quants.quantize(np.ascontiguousarray(x, dtype=np.float32), qt)
    return quants.dequantize(raw, qt, x.shape)


class CpuAttention:
    """KV caches and the attention ops; owns the key rows of the last decode step's queries
    (the same for every layer of a step, so computed once per step)."""

    def __init__(self, threads: ThreadBudget, invariant_tokens: int):
        self.threads = threads
        self.invariant_tokens = invariant_tokens
        self._keys: tuple = ((), None)           # ((cache, step key...), (rows, starts))

    def new_kv_cache(self, n_layer, n_slots, n_ctx, n_head_kv, head_dim, head_dim_v,
                     type_k, type_v, n_blocks=0, block_size=16) -> CpuKVCache:
        for t in (type_k, type_v):
            if t not in KV_TYPES:
                raise ValueError(f"KV cache type {t!r} not supported by the CPU backend")
        max_blocks, n_blocks = kv_pool_geometry(n_slots, n_ctx, n_blocks, block_size)
        self._keys = ((), None)
        rows = n_blocks * block_size
        # np.zeros maps untouched pages lazily: memory grows with the blocks written.
        k = [np.zeros((rows, n_head_kv, head_dim), np.float32) for _ in range(n_layer)]
        v = [np.zeros((rows, n_head_kv, head_dim_v), np.float32) for _ in range(n_layer)]
        return CpuKVCache(k, v, type_k, type_v, n_slots, n_ctx, n_head_kv, block_size, n_blocks,
                          max_blocks, initial_block_table(n_slots, max_blocks, n_blocks))

    def set_block_table(self, cache: CpuKVCache, host) -> None:
        cache.block_table[...] = checked_block_table(cache, host)
        self._keys = ((), None)

    def kv_write(self, cache: CpuKVCache, layer, k, v, slots, positions):
        kq = k if cache.type_k == "f32" else _round_trip(k, cache.type_k)
        vq = v if cache.type_v == "f32" else _round_trip(v, cache.type_v)
        real = slots >= 0                                   # padding rows (slot -1) store nothing
        if not real.all():
            kq, vq, slots, positions = kq[real], vq[real], slots[real], positions[real]
        rows = cache.rows_of(slots, positions)                          # (T,) pool rows
        cache.k[layer][rows] = kq
        cache.v[layer][rows] = vq

    def attention(self, q, cache: CpuKVCache, layer, slots, positions, kv_len, window, scale,
                  out, attn_lo=None, attn_mask=None):
        self.threads.enter(q.shape[0])
        tree = attn_lo is not None and (attn_mask.any() or (attn_lo != positions + 1).any())
        if q.shape[0] <= self.invariant_tokens or tree:
            self._attention_per_query(q, cache, layer, slots, positions, window, scale, out,
                                      attn_lo if tree else None, attn_mask)
        else:
            self._attention_masked(q, cache, layer, slots, positions, window, scale, out)

    def _attention_per_query(self, q, cache, layer, slots, positions, window, scale, out,
                             attn_lo=None, attn_mask=None):
        # Each query over exactly the keys it may see (j <= pos, inside the window), in one
        # numba kernel computing every query alone in a fixed order (kernels.attention_rows):
        # a token's output never depends on how the step was batched. A tree row sees the rows
        # below attn_lo and then its mask's rows, in row order (for an ancestor mask, the order
        # plain decoding of its path sees them), those inside the window by its RoPE position.
        if attn_lo is None:
            rows, starts = self._query_rows(cache, slots, positions, window)
        else:
            rows, starts = self._tree_rows(cache, slots, positions, window, attn_lo, attn_mask)
        K.attention_rows(np.ascontiguousarray(q, np.float32), cache.k[layer], cache.v[layer],
                         rows, starts, np.float32(scale), out)

    def _query_rows(self, cache, slots, positions, window):
        """(rows (sum n,) i64, starts (T+1,) i64): the pool rows each decode row sees, keys
        max(0, pos - window + 1) .. pos (none for padding rows). The same for every layer of
        one window in a step, so kept until the step's rows, the window or the block table
        change."""
        key = (window, slots.tobytes(), positions.tobytes())
        held = self._keys[0]
        if held and held[0] is cache and held[1:] == key:       # the cache itself, not its id
            return self._keys[1]
        pos = np.asarray(positions, np.int64)                                # (T,)
        lo = np.maximum(0, pos - window + 1) if window else np.zeros_like(pos)
        n = np.where(slots >= 0, pos + 1 - lo, 0)                            # (T,) keys each
        starts = np.zeros(len(pos) + 1, np.int64)                            # (T+1,)
        np.cumsum(n, out=starts[1:])
        keys = np.arange(starts[-1]) - np.repeat(starts[:-1] - lo, n)        # (sum n,) positions
        rows = cache.rows_of(np.repeat(slots, n), keys)                      # (sum n,) pool rows
        self._keys = ((cache, *key), (rows, starts))
        return rows, starts

    @staticmethod
    def _tree_rows(cache, slots, positions, window, attn_lo, attn_mask):
        """(rows (sum n,) i64, starts (T+1,) i64): the pool rows each tree-verify row sees."""
        per = []
        for t in range(len(slots)):
            slot, pos = int(slots[t]), int(positions[t])
            if slot < 0:                  # a padding row: attends to nothing, outputs 0
                per.append(np.zeros(0, np.int64))
                continue
            lo = max(0, pos - window + 1) if window else 0
            bits = int(attn_mask[t]) & 0xFFFFFFFF
            base = int(attn_lo[t])
            keys = np.concatenate([np.arange(lo, base),
                                   base + np.flatnonzero([(bits >> j) & 1 for j in range(32)])])
            per.append(cache.rows(slot, keys[keys >= lo]))   # the window applies to every key
        starts = np.zeros(len(per) + 1, np.int64)
        np.cumsum([len(r) for r in per], out=starts[1:])
        return np.concatenate(per).astype(np.int64), starts

    def _attention_masked(self, q, cache, layer, slots, positions, window, scale, out):
        # Prefill chunks: all queries of a slot at once against its keys, with a causal (and
        # sliding-window) mask; one batched matmul instead of a Python loop per token.
        T, H, D = q.shape
        hkv = cache.n_head_kv
        g = H // hkv
        out[slots < 0] = 0.0                 # padding rows attend to nothing
        for slot in np.unique(slots[slots >= 0]):
            idx = np.nonzero(slots == slot)[0]
            pos = positions[idx]                                             # (Tq,)
            lo = max(0, int(pos.min()) - window + 1) if window else 0
            hi = int(pos.max()) + 1
            rows = cache.rows(slot, np.arange(lo, hi))                       # (n,) pool rows
            kc = cache.k[layer][rows]                                        # (n, Hkv, D)
            vc = cache.v[layer][rows]                                        # (n, Hkv, Dv)
            tq = len(idx)
            qh = q[idx].reshape(tq, hkv, g, D).transpose(1, 2, 0, 3).reshape(hkv, g * tq, D)
            s = np.matmul(qh, kc.transpose(1, 2, 0))                         # (Hkv, G*Tq, n)
            s *= np.float32(scale)
            j = np.arange(lo, hi)[None, :]                                   # key positions
            p = np.tile(pos, g)[:, None]                                     # (G*Tq, 1)
            visible = j <= p
            if window:
                visible &= (p - j) < window
            s[:, ~visible] = -np.inf
            s -= s.max(axis=-1, keepdims=True)
            np.exp(s, out=s)
            s /= s.sum(axis=-1, keepdims=True)
            o = np.matmul(s, vc.transpose(1, 0, 2))                          # (Hkv, G*Tq, Dv)
            out[idx] = o.reshape(hkv, g, tq, -1).transpose(2, 0, 1, 3).reshape(tq, H, -1)

    def kv_move(self, cache: CpuKVCache, slots, src, dst):
        a_rows = cache.rows_of(slots, src)                            # (n,) pool rows
        b_rows = cache.rows_of(slots, dst)                            # (n,) pool rows
        for a, b in zip(a_rows, b_rows, strict=True):   # in order: a later move may read an
            for planes in (cache.k, cache.v):           # earlier one's destination
                for layer in planes:
                    layer[b] = layer[a]

    @staticmethod
    def kv_position_bytes(n_layer, n_head_kv, head_dim, head_dim_v, type_k, type_v) -> int:
        """float32 rows whatever the type (each value rounded through the type when written)."""
        del type_k, type_v
        return 4 * n_layer * n_head_kv * (head_dim + head_dim_v)
