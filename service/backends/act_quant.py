"""Activation rounding before a quantized matmul, in numpy: what each reference rounds x to.

Two roundings, both of rows x (T, K) f32:
- `round_activations`: the 8-bit blocks of cuda/quantize.cu, which every CUDA GEMV reads;
  the CPU backend applies it with act_quant="gpu" for tight GPU-vs-CPU comparisons.
- `llamacpp_round_trip`: what llama.cpp's CPU matmuls round x to before the dot product, by
  the weight type's `vec_dot_type` (gguf/quants.BlockSpec); act_quant=True on the CPU backend,
  for comparisons with llama.cpp's logits.

Backend-neutral (numpy only, no CuPy, no numba): both backends and the tests import it.
"""

from __future__ import annotations

import numpy as np

from service.gguf import quants
from service.gguf.quants import QuantType


def round_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8-bit activation blocks of cuda/quantize.cu, computed the same way in numpy:
    per 32 values d = amax / 127, q = rint(x / d) (0 where amax = 0).
    x (T, K) f32 -> codes (T, K) int8, d (T, K/32) f32; x ~ d * q within d / 2 per element."""
    t, k = x.shape
    b = np.ascontiguousarray(x, np.float32).reshape(t, k // 32, 32)
    amax = np.abs(b).max(axis=-1)                                        # (T, G) f32
    d = (amax / np.float32(127)).astype(np.float32)
    safe = np.where(amax == 0, np.float32(1), d)
    q = np.where(amax[..., None] == 0, 0, np.rint(b / safe[..., None]))
    return q.astype(np.int8).reshape(t, k), d


def gpu_round_trip(x: np.ndarray) -> np.ndarray:
    """x (T, K) f32 as the CUDA GEMVs see it: d * q of `round_activations`, (T, K) f32."""
    q, d = round_activations(x)
    return (q.reshape(len(q), -1, 32) * d[..., None]).reshape(q.shape)


def q8_k_round_trip(x: np.ndarray) -> np.ndarray:
    """ggml's Q8_K rounding of x (T, K): per 256 values d = max/-127 (max = the value of largest
    magnitude), q = min(127, round(x/d))."""
    t, k = x.shape
    b = x.reshape(t, k // 256, 256)
    mx = np.take_along_axis(b, np.abs(b).argmax(-1)[..., None], -1)            # (T, K/256, 1)
    safe = np.where(mx == 0, np.float32(1), mx)
    iscale = np.where(mx == 0, np.float32(0), np.float32(-127.0) / safe).astype(np.float32)
    q = np.minimum(np.rint(iscale * b), 127)
    d = np.where(iscale == 0, np.float32(0), np.float32(1.0) / np.where(iscale == 0, 1, iscale))
    return (q * d.astype(np.float32)).reshape(t, k).astype(np.float32)


def llamacpp_round_trip(x: np.ndarray, weight: QuantType) -> np.ndarray:
    """x (T, K) f32 rounded through the `vec_dot_type` of `weight`'s block spec, as llama.cpp's
    CPU matmul does (unchanged for f32 weights; Q8_K rows that are no multiple of 256 fall
    back to Q8_0 blocks)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    via = quants.block_spec(weight).vec_dot_type
    if via is None:
        return x
    if via is QuantType.Q8_K:
        if x.shape[-1] % 256 == 0:
            return q8_k_round_trip(x)
        via = QuantType.Q8_0
    return quants.dequantize(quants.quantize(x, via), via, x.shape)
