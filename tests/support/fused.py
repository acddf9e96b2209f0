"""Inputs of the fused-op tests on every backend."""

from __future__ import annotations


def qkv_views(a, T: int, H: int, hkv: int, D: int):
    """q (T, H, D), k and v (T, hkv, D): views of the columns of one (T, (H + 2 hkv) D) row
    block, as the transformer splits its q|k|v matmul output."""
    return (a[:, :H * D].reshape(T, H, D), a[:, H * D:(H + hkv) * D].reshape(T, hkv, D),
            a[:, (H + hkv) * D:].reshape(T, hkv, D))

