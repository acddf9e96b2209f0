"""The paged KV cache of the CUDA backend (base.py: a pool of blocks and a device block table
every KV kernel reads through): its planes, the block table, KV row stores (quantize.cu
kv_store_<type>) and KV row moves for tree compaction (quantize.cu kv_move).

Per layer, K and V are (n_blocks * block_size, Hkv, D | Dv) rows of the cache type's codes,
plus, for the quantized types, KV_SIDE_WORDS u16 per 32 values (the f16 scale, offset and q5's
fifth bits: kv_quant.cuh), ggml's bytes per block in all. `KVOps` owns nothing
beyond the caches it makes; the cache (types.CudaKVCache) owns its planes and table.
"""

from __future__ import annotations

from typing import Any

import cupy as cp
import numpy as np

from service.backends.base import checked_block_table, initial_block_table, kv_pool_geometry
from service.backends.cuda.kernels import ATT_MAX_D, ATT_MAX_DV, KV_CODE_BITS, KV_SIDE_WORDS
from service.backends.cuda.launcher import Launcher
from service.backends.cuda.types import (
    I32,
    KV_TYPES,
    NULL,
    CudaKVCache,
    ceil_div,
    check_rows,
    view_rows,
)


class KVOps:
    def __init__(self, stream: Any, launcher: Launcher) -> None:
        self.stream = stream
        self._launcher = launcher

    def new_cache(self, n_layer: int, n_slots: int, n_ctx: int, n_head_kv: int,
                  head_dim: int, head_dim_v: int, type_k: str, type_v: str, n_blocks: int = 0,
                  block_size: int = 16) -> CudaKVCache:
        for t, d in ((type_k, head_dim), (type_v, head_dim_v)):
            if t not in KV_TYPES:
                raise ValueError(f"KV cache type {t!r} not supported by the CUDA backend")
            if KV_SIDE_WORDS[t] and d % 32:
                raise ValueError(f"KV cache type {t} needs a head size that is a multiple "
                                 f"of 32, this model's is {d}")
        if head_dim > ATT_MAX_D or head_dim_v > ATT_MAX_DV:
            raise ValueError(f"head sizes {head_dim}/{head_dim_v} exceed the attention "
                             f"kernel's {ATT_MAX_D}/{ATT_MAX_DV}")
        max_blocks, n_blocks = kv_pool_geometry(n_slots, n_ctx, n_blocks, block_size)
        rows = n_blocks * block_size * n_head_kv

        def planes(t, d):
            # codes (rows * d * bits / 8 bytes; u16 for the 16-bit types) and the side words
            # (KV_SIDE_WORDS u16 per 32-group; None without): kv_quant.cuh's planes
            bits, side = KV_CODE_BITS[t], KV_SIDE_WORDS[t]
            with self.stream:
                if bits == 16:
                    return cp.zeros(rows * d, cp.uint16), None
                return (cp.zeros(rows * d * bits // 8, cp.uint8),
                        cp.zeros(rows * (d // 32) * side, cp.uint16))

        k = [planes(type_k, head_dim) for _ in range(n_layer)]
        v = [planes(type_v, head_dim_v) for _ in range(n_layer)]
        # kv_move's table: every plane and the bytes of one position in it
        ptrs, sizes = [], []
        for per_layer, d, t in ((k, head_dim, type_k), (v, head_dim_v, type_v)):
            for codes, scales in per_layer:
                ptrs.append(codes.data.ptr)
                sizes.append(n_head_kv * d * KV_CODE_BITS[t] // 8)
                if scales is not None:
                    ptrs.append(scales.data.ptr)
                    sizes.append(n_head_kv * (d // 32) * KV_SIDE_WORDS[t] * 2)
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

    def write(self, cache: CudaKVCache, layer: int, k, v, slots, positions) -> None:
        for src, (codes, scales), t in ((k, cache.k[layer], cache.type_k),
                                        (v, cache.v[layer], cache.type_v)):
            T, H, st, sh, D = view_rows(src)
            self._launcher.launch(f"kv_store_{t}", (T, H), (32, ceil_div(D, 32)),
                                  [src, I32(st), I32(sh), I32(D), slots, positions,
                                   *cache.table_args(), I32(H), codes,
                                   scales if scales is not None else NULL])

    def move(self, cache: CudaKVCache, slots, src, dst) -> None:
        n = len(src)
        check_rows(n, slots=slots, src=src, dst=dst)
        if n == 0:
            return
        P = cache.move_planes.size
        self._launcher.launch("kv_move", (P,), (256,),
                              [cache.move_planes, cache.move_bytes, *cache.table_args(), slots,
                               src, dst, I32(n)])
