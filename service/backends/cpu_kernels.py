"""numba kernels of the CPU reference backend: matrix x activations on repacked quantized weights.

Every quantized GGUF type is repacked at load time (exactly, see quants.affine) into one of two
affine group formats, value[n, k] = scale[n, g] * code[n, k] + offset[n, g] with g = k // group:

- Q4: 4-bit codes (0..15), group 32, two per byte: byte g*16 + j of a row holds element
  g*32 + j in its low nibble and g*32 + 16 + j in its high nibble (ggml's Q4 order).
  Q4_0, Q4_1 and Q4_K land here.
- Q8: int8 codes, group 16 or 32; offset may be absent (symmetric types). Q5_0, Q5_1, Q5_K,
  Q6_K and Q8_0 land here.

    out[t, n] = sum_g scale[n,g] * (sum_{k in g} code[n,k] * x[t,k]) + offset[n,g] * xsum[t,g]

where xsum[t, g] is the sum of x[t] over group g, computed once per call. Rows are split over
threads (prange); for T > 1 each row is decoded once to float32 and reused for all T tokens.
Activations stay float32: this backend is the numerical reference.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

ROW_BLOCK = 64   # rows a thread decodes per work item (amortizes the scratch buffer)


@njit(cache=True, fastmath=True)
def group_sums(x: np.ndarray, group: int, out: np.ndarray) -> None:
    """out[t, g] = sum(x[t, g*group:(g+1)*group]).  x (T, K) f32, out (T, K//group) f32."""
    T, K = x.shape
    for t in range(T):
        for g in range(K // group):
            s = np.float32(0.0)
            for j in range(group):
                s += x[t, g * group + j]
            out[t, g] = s


@njit(parallel=True, cache=True, fastmath=True)
def gemv_q4(x, xsum, packed, scale, offset, out):
    """T == 1: out[0, n] for every row n, decoding nibbles on the fly."""
    N = packed.shape[0]
    G = scale.shape[1]
    for n in prange(N):
        acc = np.float32(0.0)
        for g in range(G):
            s = np.float32(0.0)
            b0 = g * 16
            x0 = g * 32
            for j in range(16):
                b = packed[n, b0 + j]
                s += np.float32(b & 15) * x[0, x0 + j] + np.float32(b >> 4) * x[0, x0 + 16 + j]
            acc += scale[n, g] * s + offset[n, g] * xsum[0, g]
        out[0, n] = acc


@njit(parallel=True, cache=True, fastmath=True)
def gemm_q4(x, xsum, packed, scale, offset, out):
    """T >= 1: decode each row once into float32, then one dot product per token."""
    T, K = x.shape
    N = packed.shape[0]
    G = scale.shape[1]
    n_blocks = (N + ROW_BLOCK - 1) // ROW_BLOCK
    for blk in prange(n_blocks):
        buf = np.empty(K, dtype=np.float32)
        for n in range(blk * ROW_BLOCK, min(N, (blk + 1) * ROW_BLOCK)):
            for g in range(G):
                d = scale[n, g]
                m = offset[n, g]
                for j in range(16):
                    b = packed[n, g * 16 + j]
                    buf[g * 32 + j] = d * np.float32(b & 15) + m
                    buf[g * 32 + 16 + j] = d * np.float32(b >> 4) + m
            for t in range(T):
                s = np.float32(0.0)
                for k in range(K):
                    s += buf[k] * x[t, k]
                out[t, n] = s


@njit(parallel=True, cache=True, fastmath=True)
def gemv_q8(x, xsum, codes, scale, offset, group, out):
    """T == 1 on int8 codes; offset has shape (N, G) or (0, 0) for symmetric types."""
    N, K = codes.shape
    G = K // group
    has_offset = offset.shape[0] == N
    for n in prange(N):
        acc = np.float32(0.0)
        for g in range(G):
            s = np.float32(0.0)
            k0 = g * group
            for j in range(group):
                s += np.float32(codes[n, k0 + j]) * x[0, k0 + j]
            acc += scale[n, g] * s
            if has_offset:
                acc += offset[n, g] * xsum[0, g]
        out[0, n] = acc


@njit(parallel=True, cache=True, fastmath=True)
def gemm_q8(x, xsum, codes, scale, offset, group, out):
    T, K = x.shape
    N = codes.shape[0]
    G = K // group
    has_offset = offset.shape[0] == N
    n_blocks = (N + ROW_BLOCK - 1) // ROW_BLOCK
    for blk in prange(n_blocks):
        buf = np.empty(K, dtype=np.float32)
        for n in range(blk * ROW_BLOCK, min(N, (blk + 1) * ROW_BLOCK)):
            for g in range(G):
                d = scale[n, g]
                m = offset[n, g] if has_offset else np.float32(0.0)
                for j in range(group):
                    buf[g * group + j] = d * np.float32(codes[n, g * group + j]) + m
            for t in range(T):
                s = np.float32(0.0)
                for k in range(K):
                    s += buf[k] * x[t, k]
                out[t, n] = s


@njit(parallel=True, cache=True, fastmath=True)
def argmax_rows(logits, out):
    """out[t] = first index of the maximum of logits[t] (np.argmax semantics)."""
    T, V = logits.shape
    for t in prange(T):
        best = 0
        bv = logits[t, 0]
        for i in range(1, V):
            if logits[t, i] > bv:
                bv = logits[t, i]
                best = i
        out[t] = best
