"""GPU weight layout: each GGUF block type split into planes (numpy only; no CuPy here).

A tensor of R rows x K columns of a block type (B elements in S bytes per block) is stored as
R * K / B blocks. On the GPU every field of the block goes to its own plane: plane p holds
bytes [start, start + size) of every block, blocks in row-major order, so the quants of a
32-element group start 16-byte aligned and a warp reads them in whole 16-byte loads.
The planes together hold exactly the file's bytes: no dequantized copy, no padding.

The plane order per type is the contract with cuda/quant_types.cuh (P.p0 .. P.p3).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd

import numpy as np


@dataclass(frozen=True)
class PlaneLayout:
    kernel: str                              # the suffix of gemv_/embed_ kernels
    block_size: int                          # elements per block (1 for float types)
    type_size: int                           # bytes per block in the file
    planes: tuple[tuple[int, int], ...]      # (byte start, byte count) per plane, p0 first

    @property
    def quantized(self) -> bool:
        return self.block_size > 1


# Byte ranges follow ggml's block structs: e.g. block_q4_K = {f16 d, f16 dmin, u8 scales[12],
# u8 qs[128]} and block_q6_K = {u8 ql[128], u8 qh[64], i8 scales[16], f16 d}.
LAYOUTS: dict[str, PlaneLayout] = {
    "F32": PlaneLayout("f32", 1, 4, ((0, 4),)),
    "F16": PlaneLayout("f16", 1, 2, ((0, 2),)),
    "BF16": PlaneLayout("bf16", 1, 2, ((0, 2),)),
    "Q4_0": PlaneLayout("q4_0", 32, 18, ((2, 16), (0, 2))),
    "Q4_1": PlaneLayout("q4_1", 32, 20, ((4, 16), (0, 4))),
    "Q5_0": PlaneLayout("q5_0", 32, 22, ((6, 16), (2, 4), (0, 2))),
    "Q5_1": PlaneLayout("q5_1", 32, 24, ((8, 16), (4, 4), (0, 4))),
    "Q8_0": PlaneLayout("q8_0", 32, 34, ((2, 32), (0, 2))),
    "Q4_K": PlaneLayout("q4_k", 256, 144, ((16, 128), (4, 12), (0, 4))),
    "Q5_K": PlaneLayout("q5_k", 256, 176, ((48, 128), (16, 32), (4, 12), (0, 4))),
    "Q6_K": PlaneLayout("q6_k", 256, 210, ((0, 128), (128, 64), (192, 16), (208, 2))),
    # block_q2_K = {u8 scales[16], u8 qs[64], f16 d, f16 dmin}
    "Q2_K": PlaneLayout("q2_k", 256, 84, ((16, 64), (0, 16), (80, 4))),
    # block_q3_K = {u8 hmask[32], u8 qs[64], u8 scales[12], f16 d}
    "Q3_K": PlaneLayout("q3_k", 256, 110, ((32, 64), (0, 32), (96, 12), (108, 2))),
    # block_iq4_nl = {f16 d, u8 qs[16]}
    "IQ4_NL": PlaneLayout("iq4_nl", 32, 18, ((2, 16), (0, 2))),
    # block_iq4_xs = {f16 d, u16 scales_h, u8 scales_l[4], u8 qs[128]}
    "IQ4_XS": PlaneLayout("iq4_xs", 256, 136, ((8, 128), (0, 8))),
}


def layout_of(qtype) -> PlaneLayout:
    """The plane layout of a GGUF type (an enum member whose name is the ggml type name)."""
    try:
        return LAYOUTS[qtype.name]
    except KeyError:
        raise ValueError(f"no GPU layout for weight type {qtype.name}") from None


def split_planes(raw: np.ndarray, layout: PlaneLayout) -> list[np.ndarray]:
    """(n_bytes,) uint8 of whole blocks -> one contiguous uint8 array per plane."""
    if raw.size % layout.type_size:
        raise ValueError(f"{raw.size} bytes is not a whole number of {layout.kernel} blocks")
    blocks = raw.reshape(-1, layout.type_size)                       # (n_blocks, S) u8
    if len(layout.planes) == 1:
        return [np.ascontiguousarray(raw)]
    return [np.ascontiguousarray(blocks[:, a:a + n]).reshape(-1) for a, n in layout.planes]


def plane_offsets(layout: PlaneLayout, n_blocks: int, start: int = 0) -> tuple[list[int], int]:
    """Where `write_planes` puts the planes of `n_blocks` blocks in a staging buffer, from byte
    `start` on: each plane's segment starts 16-byte aligned -> (segment offsets, end)."""
    offsets, at = [], start
    for _, n in layout.planes:
        at = -(-at // 16) * 16
        offsets.append(at)
        at += n_blocks * n
    return offsets, at


def _copy_unit(layout: PlaneLayout) -> np.dtype:
    """The widest unsigned word (<= 8 bytes) that divides the block and every plane's range:
    the plane split then copies words, not bytes."""
    g = gcd(layout.type_size, *(v for r in layout.planes for v in r))
    return np.dtype(f"u{max(u for u in (1, 2, 4, 8) if g % u == 0)}")


def write_planes(raw: np.ndarray, layout: PlaneLayout, b0: int, b1: int, out: np.ndarray,
                 offsets: list[int]) -> None:
    """Blocks [b0, b1) of `raw` ((n_bytes,) uint8, whole blocks) split into planes straight into
    `out` ((n,) uint8, e.g. a pinned staging buffer): plane p's bytes of those blocks land at
    out[offsets[p] : offsets[p] + (b1 - b0) * size_p], in block order. One read of the source
    and one write per byte; the concatenation over consecutive ranges equals split_planes."""
    ts, nb = layout.type_size, b1 - b0
    src = raw[b0 * ts:b1 * ts]
    if len(layout.planes) == 1:
        out[offsets[0]:offsets[0] + nb * ts] = src
        return
    u = _copy_unit(layout)
    blocks = src.view(u).reshape(nb, ts // u.itemsize)                 # (nb, S/u) words
    for (a, n), o in zip(layout.planes, offsets, strict=True):
        dst = out[o:o + nb * n].view(u).reshape(nb, n // u.itemsize)
        np.copyto(dst, blocks[:, a // u.itemsize:(a + n) // u.itemsize])


def join_planes(planes: list[np.ndarray], layout: PlaneLayout) -> np.ndarray:
    """The inverse of split_planes: the file's block bytes again."""
    if len(layout.planes) == 1:
        return planes[0].copy()
    n_blocks = planes[0].size // layout.planes[0][1]
    out = np.empty((n_blocks, layout.type_size), np.uint8)
    for (a, n), p in zip(layout.planes, planes, strict=True):
        out[:, a:a + n] = p.reshape(n_blocks, n)
    return out.reshape(-1)

