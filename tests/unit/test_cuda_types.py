"""CUDA backend launch choices that need no GPU (cuda_types.py is numpy only)."""

from __future__ import annotations

import numpy as np

from service.backends.cuda.kernels import (
    GEMV_MMA_NC,
    GEMV_MMA_TYPES,
    GEMV_PREFETCH_TYPES,
    mma_rows,
    registry,
)
from service.backends.cuda.types import (
    GEMV_WIDE_ROWS,
    gemv_choice,
    gemv_mma_kernel,
    gemv_mma_nc,
    norm_block,
    view_rows,
)


def test_gemv_columns_round_up_to_a_variant():
    got = {t: gemv_choice(t, 2)[0] for t in (1, 2, 3, 4, 5, 8, 9, 16, 17, 40)}
    assert got == {1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 8: 8, 9: 16, 16: 16, 17: 16, 40: 16}
    assert gemv_choice(1, 2) == (1, 1)
    assert all(gemv_choice(t, 2)[1] == GEMV_WIDE_ROWS[gemv_choice(t, 2)[0]] for t in (2, 3, 9))
    assert {gemv_choice(t, 1) for t in (1, 3, 16, 40)} == {(1, 1)}


def test_tensor_core_gemv_takes_the_smallest_tile_that_holds_the_columns():
    """gemv_mma_nc: 8 for 1..8 columns, 16 for 9..16, 32 for 17..32, 64 for 33..64 and above
    (wider steps run 64-column tiles over grid.y) for the 32-element types; the K-quants stop
    at 32 (33..64 columns: two 32-column tiles); each tile registered for every type, and the
    one-column kernel (c1; c1p for the prefetching types) that gemv_mma_kernel picks at 1, its
    residual GEMV + RMSNorm forms (c1n, c1pn), and for every type the one column split over K
    (c1s, c1sp)."""
    widths = (1, 8, 9, 16, 17, 32, 33, 64, 65, 200)
    got = {t: gemv_mma_nc(t, "q8_0") for t in widths}
    assert got == {1: 8, 8: 8, 9: 16, 16: 16, 17: 32, 32: 32, 33: 64, 64: 64, 65: 64, 200: 64}
    assert all(gemv_mma_nc(t, "q4_0") >= t for t in range(1, 65))
    for kq in ("q4_k", "q5_k", "q6_k"):
        assert {t: gemv_mma_nc(t, kq) for t in widths} == {**got, 33: 32, 64: 32, 65: 32,
                                                            200: 32}
        assert all(gemv_mma_nc(t, kq) >= min(t, 32) for t in range(1, 65))
    assert GEMV_MMA_NC == (8, 16, 32, 64)
    assert {mma_rows(nc) for nc in GEMV_MMA_NC} <= {16, 32}
    names = {k for k in registry() if k.startswith("gemv_mma_")}
    types = {n.rsplit("_c", 1)[0][len("gemv_mma_"):] for n in names}
    assert types == set(GEMV_MMA_TYPES)
    split = {f"gemv_mma_{t}_c1{v}" for t in types for v in ("s", "sp")}
    assert names == {f"gemv_mma_{t}_c{nc}" for t in types for nc in (*GEMV_MMA_NC, 1)} | {
        f"gemv_mma_{t}_c1p" for t in GEMV_PREFETCH_TYPES} | {      # and the fused-norm ones
        f"gemv_mma_{t}_c1n" for t in types} | {
        f"gemv_mma_{t}_c1pn" for t in GEMV_PREFETCH_TYPES} | split
    for t in types:
        assert gemv_mma_kernel(1, t, False) == f"gemv_mma_{t}_c1"
        assert gemv_mma_kernel(1, t, True) == f"gemv_mma_{t}_c1p"
        assert {gemv_mma_kernel(n, t, True) for n in range(2, 65)} <= names


def test_gemv_variants_chosen_are_instantiated():
    """Every (NC, R) the backend can pick is a kernel gemv.cu instantiates."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "cuda" / "gemv.cu").read_text()
    for t in range(1, 41):
        for mode in (1, 2):
            nc, r = gemv_choice(t, mode)
            assert f"ONE(name, T, {nc}, {r})" in text, (t, mode)


def test_norm_block_is_whole_warps_up_to_256():
    assert [norm_block(d) for d in (32, 64, 200, 256, 576, 2048)] == [32, 64, 224, 256, 256,
                                                                      256]


def test_view_rows_reads_strided_views():
    a = np.zeros((4, 10, 64), np.float32)
    assert view_rows(a[:, 2:6]) == (4, 4, 640, 64, 64)
    assert view_rows(a.reshape(4, 640)[:, 128:320]) == (4, 1, 640, 0, 192)
