"""Shapes, constants and launch helpers the parts of the CUDA backend share (numpy only, no
CuPy: the CPU tests import it): the device matrix and KV cache records, view and dtype checks,
and the launch choices (GEMV variant by width, norm block size). Shapes: T tokens in the step,
K/N the input/output width of a matrix."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from service.backends.base import KVCache
from service.backends.cuda.kernels import GEMV_MMA_C64_TYPES, GEMV_MMA_NC, NORM_MAX_THREADS
from service.backends.cuda.layout import PlaneLayout
from service.formats import BACKEND_KV_TYPES

GEMV_NC = (1, 2, 4, 8, 16)   # column variants of cuda/gemv.cu; wider steps: chunks of 16
KV_TYPES = BACKEND_KV_TYPES["cuda"]
I32, F32 = np.int32, np.float32
NULL = np.uint64(0)


@dataclass
class CudaMatrix:
    """W (rows, K) in GPU planes; `rows` = n_expert * n for a stack of experts."""

    layout: PlaneLayout
    rows: int
    k: int
    planes: list[Any]                 # cupy uint8 arrays, p0..p3 of quant_types.cuh
    n_expert: int = 1

    @property
    def n(self) -> int:               # output rows of one expert
        return self.rows // self.n_expert

    def args(self) -> list[Any]:
        ps = self.planes + [self.planes[0]] * (4 - len(self.planes))
        return ps[:4]


@dataclass
class CudaKVCache(KVCache):
    k: list[tuple[Any, Any]]         # per layer (codes, scales) planes; scales None for f16
    v: list[tuple[Any, Any]]
    type_k: str
    type_v: str
    n_slots: int
    n_ctx: int
    n_head_kv: int
    head_dim: int
    head_dim_v: int
    block_size: int
    n_blocks: int
    max_blocks: int
    block_table: Any                 # (n_slots, max_blocks) i32 on the device, never moved
    move_planes: Any = None          # (P,) u64 device pointers of every plane (kv_move)
    move_bytes: Any = None           # (P,) i32 bytes of one position in each plane

    def table_args(self) -> list[Any]:
        """The kernels' paging arguments: table pointer, max_blocks, log2(block_size)."""
        return [self.block_table, np.int32(self.max_blocks),
                np.int32(self.block_size.bit_length() - 1)]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def view_rows(a) -> tuple[int, int, int, int, int]:
    """An up-to-3-D view with a contiguous last axis as (n0, n1, stride0, stride1, D)."""
    item = a.itemsize
    if a.strides[-1] != item and a.shape[-1] > 1:
        raise ValueError(f"last axis must be contiguous, strides {a.strides}")
    if a.ndim == 1:
        return 1, 1, 0, 0, a.shape[0]
    if a.ndim == 2:
        return a.shape[0], 1, a.strides[0] // item, 0, a.shape[1]
    if a.ndim == 3:
        return a.shape[0], a.shape[1], a.strides[0] // item, a.strides[1] // item, a.shape[2]
    raise ValueError(f"expected 1-3 dimensions, got shape {a.shape}")


def check_dtype(a, dtype, what: str) -> None:
    if a.dtype != dtype:
        raise TypeError(f"{what}: dtype {a.dtype}, expected {np.dtype(dtype)}")


def opt_ptr(a: Any) -> Any:
    """An optional array argument: the array, or a null pointer."""
    return a if a is not None else NULL


def check_rows(n: int, **arrays: Any) -> None:
    """Every given per-row array is (>= n,) int32 and contiguous (None: absent)."""
    for name, a in arrays.items():
        if a is None:
            continue
        check_dtype(a, np.int32, name)
        if a.ndim != 1 or a.shape[0] < n or not a.flags.c_contiguous:
            raise ValueError(f"{name}: (>= {n},) contiguous int32 wanted, got {a.shape}")


def norm_block(d: int) -> int:
    """Threads of a block that normalizes rows of d (rope_kv.cu's norm_block(D)): the order of
    the norm's sum depends on it, so every kernel computing a norm of d uses the same."""
    return min(NORM_MAX_THREADS, ceil_div(d, 32) * 32)


# Rows per warp of the multi-column GEMV variants (cuda/gemv.cu instantiates c1r1, c1r2 and
# c{2,4,8,16}r{2,4}): more rows per warp share each activation load, which is what a
# multi-column GEMV spends its time on (bench/gpu_bench.py, docs/PERFORMANCE.md).
GEMV_WIDE_ROWS = {2: 2, 4: 4, 8: 4, 16: 4}


def gemv_choice(n_cols: int, mode: int) -> tuple[int, int]:
    """(NC, R) of the GEMV kernel for a step of n_cols columns: NC = n_cols rounded up to a
    variant (16 above: chunks of 16), R rows per warp. mode 1: the one-column one-row kernel
    at every width (one block row per column); mode 2 (the default): the tiled variants, with
    the one-row kernel for a single column. Every choice gives the same bits."""
    if mode == 1 or n_cols == 1:
        return 1, 1
    nc = next((nc for nc in GEMV_NC if nc >= n_cols), GEMV_NC[-1])
    return nc, GEMV_WIDE_ROWS[nc]


def gemv_mma_nc(n_cols: int, kernel: str) -> int:
    """Columns per block row of the tensor-core GEMV (cuda/gemv_mma.cu) for a step of n_cols
    columns over weights of layout kernel `kernel`: the smallest tile that holds them (8 for
    1..8, 16 for 9..16, 32 for 17..32, 64 for 33..64), so each block row reads its weights
    once; the 64-column tile only for kernels.GEMV_MMA_C64_TYPES (measured slower than two
    32-column tiles for the K-quants). Wider steps run the largest tile over grid.y. Every
    tile gives a column the same bits."""
    tiles = GEMV_MMA_NC if kernel in GEMV_MMA_C64_TYPES else GEMV_MMA_NC[:-1]
    return next((nc for nc in tiles if nc >= n_cols), tiles[-1])


def gemv_mma_kernel(n_cols: int, kernel: str, prefetch: bool) -> str:
    """The tensor-core family's kernel for a step of n_cols columns over `kernel` weights:
    gemv_mma_<kernel>_c1 for one column (dp4a dot products added in the tiles' order: the
    tiles' bits; `prefetch`: its c1p loop, the next groups loaded before each round's dots,
    the same bits), else the tile of gemv_mma_nc."""
    if n_cols == 1:
        return f"gemv_mma_{kernel}_c1{'p' if prefetch else ''}"
    return f"gemv_mma_{kernel}_c{gemv_mma_nc(n_cols, kernel)}"


# (pointer, rows, row width, row stride) of a matrix view: what the 8-bit activation blocks in
# the scratch were made from.
ViewKey = tuple[int, int, int, int]


def matrix_key(a) -> ViewKey:
    rows, _, ld, _, k = view_rows(a)
    return a.data.ptr, rows, k, ld


def overlaps(a, key: ViewKey) -> bool:
    """Whether the matrix view a shares a byte with the view `key` names (f32 both)."""
    p, rows, k, ld = matrix_key(a)
    q, rows2, k2, ld2 = key
    return p < q + ((rows2 - 1) * ld2 + k2) * 4 and q < p + ((rows - 1) * ld + k) * 4


# Column variants of cuda/moe.cu's expert-grouped GEMVs (kernels.MOEG_ROWS's keys).
MOEG_NC = (1, 2, 4, 8)   # wider: an expert with more rows takes several tiles


def moe_group_nc(n_tokens: int, n_used: int, n_expert: int) -> int:
    """Columns per tile of the expert-grouped GEMVs for a step of n_tokens tokens: the rows an
    expert gets on average (P = n_tokens * n_used pairs over n_expert experts, rounded up), at
    most n_tokens (no expert has more rows), rounded up to a variant. Every choice gives the same
    bits; it trades registers and idle columns (an expert with fewer rows than NC) against
    weight re-reads (an expert with more rows spans several tiles). Measured on the H200
    (bench/gpu_moe_grouped.py, 128 experts, 8 used, Q4_K): the best width at 6 and 8 tokens was
    1, at 64 tokens 4 (851 us against 971 at 8, twice the average, the earlier rule)."""
    want = min(n_tokens, -(-n_tokens * n_used // max(1, n_expert)))
    return next((nc for nc in MOEG_NC if nc >= want), MOEG_NC[-1])


def moe_group_tiles(n_pairs: int, n_expert: int, nc: int) -> int:
    """The most tiles moe_group can make of n_pairs (token, expert) pairs: each of at most
    A = min(n_expert, n_pairs) experts with c_e rows gives ceil(c_e / nc) tiles, and
    sum ceil(c_e / nc) <= (n_pairs + A (nc - 1)) / nc; never more than one tile per pair. The
    grouped GEMVs' grid.y (blocks past the step's actual count exit at once)."""
    a = min(n_expert, n_pairs)
    return min(n_pairs, (n_pairs + a * (nc - 1)) // nc)
