"""The CUDA KV cache planes (service/backends/cuda/kernels.py KV_CODE_BITS, KV_SIDE_WORDS;
cuda/kv_quant.cuh) against ggml's blocks: per 32 values the codes plus the side words take
exactly a block's bytes, the side words are the block's leading fields (so the GPU tests rebuild
ggml blocks as side bytes + codes), and the defines reach the kernels."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import quants as gguf_quants

from service.backends.base import Backend
from service.backends.cuda import kernels, sources
from service.formats import KV_TYPES
from service.gguf.quants import kv_qtype


@pytest.mark.parametrize("t", [str(t) for t in KV_TYPES])
def test_planes_hold_ggml_block_bytes(t):
    block, size = GGML_QUANT_SIZES[kv_qtype(t)]
    bits, side = kernels.KV_CODE_BITS[t], kernels.KV_SIDE_WORDS[t]
    assert 32 * bits // 8 + 2 * side == 32 // block * size
    # the backends' memory accounting (ggml bytes) is what kv.py allocates, per position
    d, hkv, n_layer = 128, 8, 2
    plane = hkv * (d * bits // 8 + d // 32 * side * 2)
    assert Backend.kv_position_bytes(None, n_layer, hkv, d, d, t, t) == n_layer * 2 * plane


@pytest.mark.parametrize("t", ["q8_0", "q5_1", "q5_0", "q4_1", "q4_0"])
def test_side_words_are_the_blocks_leading_fields(t):
    """Quantize rows with gguf, split each block into side words + codes as the GPU planes
    hold them, and check the fields: d is the f16 scale gguf decodes with, and the codes plane
    is the block's tail (the nibbles or int8 codes)."""
    qt = kv_qtype(t)
    x = np.random.default_rng(3).normal(0, 1, (4, 32)).astype(np.float32)
    blocks = gguf_quants.quantize(x, qt).reshape(4, -1)
    side = kernels.KV_SIDE_WORDS[t]
    words = np.ascontiguousarray(blocks[:, :2 * side]).view(np.uint16)       # (4, side)
    codes = blocks[:, 2 * side:]                                              # (4, 16 | 32)
    assert codes.shape[1] == 32 * kernels.KV_CODE_BITS[t] // 8
    d = words[:, 0].view(np.float16).astype(np.float32)
    deq = gguf_quants.dequantize(blocks, qt)                                  # (4, 32)
    if t in ("q4_1", "q5_1"):                  # d * code + m: element of code 0 is m
        m = words[:, 1].view(np.float16).astype(np.float32)
        lo = deq.min(axis=1)
        assert np.array_equal(lo, m)
    if t in ("q5_0", "q5_1"):                  # qh: the 2 last words, bit l for element l
        qh = words[:, -2].astype(np.uint32) | (words[:, -1].astype(np.uint32) << 16)
        nib = np.concatenate([codes & 15, codes >> 4], axis=1).astype(np.int64)
        code = nib | (((qh[:, None] >> np.arange(32)) & 1) << 4)
        c = (code if t == "q5_1" else code - 16).astype(np.float32)           # f32 math, as
        want = d[:, None] * c + m[:, None] if t == "q5_1" else d[:, None] * c  # gguf's
        assert np.array_equal(deq, want)


def test_side_word_defines_reach_the_kernels():
    defines = kernels.cuda_defines()
    text = (sources.CUDA_DIR / "kv_quant.cuh").read_text()
    for t, n in kernels.KV_SIDE_WORDS.items():
        if n:
            assert defines[f"KV_SIDE_{t.upper()}"] == n
            assert f"!defined(KV_SIDE_{t.upper()})" in text


def _codes_of_blocks(blocks: np.ndarray, t: str) -> np.ndarray:
    """(n, 32) codes of gguf's 4/5-bit blocks (n, type_size), as ggml packs them: element j in
    the low nibble of qs byte j, j + 16 in its high nibble; bit j of qh is j's fifth bit."""
    side = kernels.KV_SIDE_WORDS[t]
    words = np.ascontiguousarray(blocks[:, :2 * side]).view(np.uint16)
    qs = blocks[:, 2 * side:].astype(np.int64)
    code = np.concatenate([qs & 15, qs >> 4], axis=1)
    if t in ("q5_0", "q5_1"):
        qh = words[:, -2].astype(np.int64) | (words[:, -1].astype(np.int64) << 16)
        code |= ((qh[:, None] >> np.arange(32)) & 1) << 4
    return code


@pytest.mark.parametrize("t", ["q5_1", "q5_0", "q4_1", "q4_0"])
def test_nibble_writer_and_readers_index_arithmetic(t):
    """kv_quant.cuh KvPutNibble's stores and kv_read.cuh KvNibble's loads (at, vrow, load8),
    transcribed index for index, on gguf's codes for rows of D = 128: the planes the writer
    fills are gguf's blocks (tests.support.kv_planes, as the GPU tests decode them), and every
    reader gives gguf's dequantized values."""
    from tests.support.kv_planes import planes_as_blocks

    qt, sw = kv_qtype(t), kernels.KV_SIDE_WORDS[t]
    n_rows, D = 3, 128
    x = np.random.default_rng(5).normal(0, 1, (n_rows, D)).astype(np.float32)
    blocks = gguf_quants.quantize(x, qt).reshape(n_rows * D // 32, -1)
    words = np.ascontiguousarray(blocks[:, :2 * sw]).view(np.uint16)
    code = _codes_of_blocks(blocks, t)                              # (groups, 32)
    qs = np.full(n_rows * D // 2, 0xAA, np.uint8)                   # poisoned planes
    dd = np.full(n_rows * D // 32 * sw, 0xAAAA, np.uint16)
    for row in range(n_rows):
        for g in range(D // 32):                                    # one warp a group
            q = code[row * D // 32 + g]                             # q of each lane
            w = words[row * D // 32 + g]
            for lane in range(32):
                hi = q[lane + 16] & 15 if lane < 16 else 0          # __shfl_down_sync(.., 16)
                if lane < 16:
                    qs[row * (D // 2) + 16 * g + lane] = (q[lane] & 15) | (hi << 4)
            qh = sum(((int(q[lane]) >> 4) & 1) << lane for lane in range(32))   # ballot
            base = (row * (D // 32) + g) * sw
            dd[base] = w[0]                                         # f2h(d)
            if t in ("q4_1", "q5_1"):
                dd[base + 1] = w[1]                                 # f2h(lo)
            if t in ("q5_0", "q5_1"):
                dd[base + sw - 2], dd[base + sw - 1] = qh & 0xFFFF, qh >> 16
    assert np.array_equal(planes_as_blocks(qs, dd, t), blocks)

    want = gguf_quants.dequantize(blocks, qt).reshape(n_rows, D)

    def value(row, g, n, lb):                                       # KvNibble::value
        side = dd[(row * (D // 32) + g) * sw:][:sw]
        d = np.float32(side[:1].view(np.float16)[0])
        c = n
        if t in ("q5_0", "q5_1"):
            c |= ((int(side[-2]) | (int(side[-1]) << 16)) >> lb & 1) << 4
        if t in ("q4_1", "q5_1"):
            return d * np.float32(c) + np.float32(side[1:2].view(np.float16)[0])
        return np.float32(c - (16 if t == "q5_0" else 8)) * d

    for row in range(n_rows):
        for i in range(D):                                          # at(i)
            b = int(qs[row * (D // 2) + 16 * (i // 32) + (i & 15)])
            n = b & 15 if (i & 31) < 16 else b >> 4
            assert value(row, i // 32, n, i & 31) == want[row, i], (row, i)
        for lane in range(32):                                      # vrow: lane + 32 i
            shift = 0 if lane < 16 else 4
            for i in range(D // 32):
                b = int(qs[row * (D // 2) + 16 * i + (lane & 15)])
                assert value(row, i, (b >> shift) & 15, lane) == want[row, lane + 32 * i]
        for i0 in range(0, D, 8):                                   # load8: one 8-byte load
            start = row * (D // 2) + 16 * (i0 // 32) + (i0 & 15)
            w8 = qs[start:start + 8]
            shift = 0 if (i0 & 31) < 16 else 4
            for u in range(8):
                got = value(row, i0 // 32, (int(w8[u]) >> shift) & 15, (i0 & 31) + u)
                assert got == want[row, i0 + u], (row, i0, u)
