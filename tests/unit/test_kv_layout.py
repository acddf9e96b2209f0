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
