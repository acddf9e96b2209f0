"""numba kernels of the CPU reference backend: matrix x activations on repacked quantized weights.

Every quantized GGUF type is repacked at load time (exactly, see quants.affine_rows) into one
affine group format, value[n, k] = scale[n, g] * code[n, k] + offset[n, g] with g = k // group:
int8 codes (4-, 5-, 6- and 8-bit types alike), group 16 or 32, offset absent for symmetric
types (Q8_0, Q6_K). Widening 4-bit codes to a byte doubles their memory but keeps the inner loop
a plain int8 -> float32 convert and multiply, with no nibble shift/mask per code.

    out[t, n] = sum_g scale[n,g] * (sum_{k in g} code[n,k] * x[t,k]) + offset[n,g] * xsum[t,g]

where xsum[t, g] is the sum of x[t] over group g, computed once per call. Rows are split over
threads (prange). Steps of more than `invariant_tokens` tokens (prefill chunks) dequantize tiles
of rows with `dequantize_rows` and multiply with BLAS sgemm. `attention_rows` is the decode
attention, one (query, head) pair per parallel iteration. Activations stay float32: this
backend is the numerical reference.
"""

from __future__ import annotations

import os

# numba's OpenMP workers spin up to 300,000 iterations waiting for the next parallel region.
# Next to the gRPC threads, or on a busy machine, that spinning steals the cores the next matmul
# needs (decoding several times slower on a loaded 2-core machine); not spinning at all
# (passive) costs a futex wake-up per matmul (about 2x slower decoding when idle, in our runs of
# bench/cpu_decode.py with OMP_WAIT_POLICY / GOMP_SPINCOUNT set by hand). A short spin keeps both
# cases fast. Set before numba starts its OpenMP runtime.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

import numpy as np  # noqa: E402
from numba import njit, prange  # noqa: E402

ROW_CHUNKS = 64     # matmul_q8's units of parallel work: rows split into this many chunks
# numba's fast-math flags minus `contract` (fusing a multiply and an add into one FMA): with it,
# the same kernel gave other last bits freshly compiled than loaded from numba's on-disk cache
# (the JIT and the cached object code fused different operations: 3e-5 on a random matmul, up to
# 0.86 in SmolLM2's teacher-forced logits), so a result depended on whether the process had
# compiled or loaded the kernel. Without it, compiled and cached give the same bits; reassociation
# (the vectorized sums) stays, and is the same in both.
FAST = {"reassoc", "nnan", "ninf", "nsz", "arcp", "afn"}
# attention_rows gave other bits cached than compiled even so (its dot products and sums were
# vectorized differently by the two): it adds in source order.
ORDERED = FAST - {"reassoc"}


@njit(cache=True, fastmath=FAST)
def group_sums(x: np.ndarray, group: int, out: np.ndarray) -> None:
    """out[t, g] = sum(x[t, g*group:(g+1)*group]).  x (T, K) f32, out (T, K//group) f32."""
    T, K = x.shape
    for t in range(T):
        for g in range(K // group):
            s = np.float32(0.0)
            for j in range(group):
                s += x[t, g * group + j]
            out[t, g] = s


@njit(parallel=True, cache=True, fastmath=FAST)
def matmul_q8(x, xsum, codes, scale, offset, group, out):
    """out (T, N) = x (T, K) @ W^T on int8 codes; offset (N, G) or (0, 0) when symmetric.

    Row n, token t is always computed by the same instructions in the same order, whatever T
    is (the token loop is outside the group loop, so T only repeats the same work): a verify
    step of T tokens gives bit-identical logits to T single-token steps, which keeps
    speculative decoding exactly equal to plain greedy decoding. For T > 1 the codes of a row
    are converted again per token; they are in L1 by then, so this costs ALU time only.
    """
    T, K = x.shape
    N = codes.shape[0]
    G = K // group
    has_offset = offset.shape[0] == N
    for n in prange(N):
        for t in range(T):
            acc = np.float32(0.0)
            for g in range(G):
                k0 = g * group
                s = np.float32(0.0)
                for j in range(group):
                    s += np.float32(codes[n, k0 + j]) * x[t, k0 + j]
                acc += scale[n, g] * s
                if has_offset:
                    acc += offset[n, g] * xsum[t, g]
            out[t, n] = acc


@njit(parallel=True, cache=True, fastmath=ORDERED)
def attention_rows(q, kc, vc, rows, starts, scale, out):
    """Softmax attention of each query over its own key rows of the pool.

    q (T, H, D) f32, kc (P, Hkv, D) f32, vc (P, Hkv, Dv) f32, out (T, H, Dv) f32, all
    C-contiguous; query t sees pool rows rows[starts[t]:starts[t+1]] (i64), in that order
    (none: out[t] = 0). Head h reads KV head h // (H // Hkv).

        out[t, h] = sum_j p_j v[r_j] / sum_j p_j,  p_j = exp(s_j - max s),  s_j = scale q.k[r_j]

    One (query, head) pair per parallel iteration, each computed in a fixed order over its keys
    whatever else is in the step: a token's output never depends on how the step was batched.
    """
    T, H, D = q.shape
    hkv = kc.shape[1]
    dv = vc.shape[2]
    grp = H // hkv
    for i in prange(T * H):
        t = i // H
        h = i % H
        hk = h // grp
        a = starts[t]
        n = starts[t + 1] - a
        if n == 0:
            for e in range(dv):
                out[t, h, e] = np.float32(0.0)
            continue
        s = np.empty(n, np.float32)                                  # (n,) f32 scores
        mx = np.float32(-np.inf)
        for j in range(n):
            r = rows[a + j]
            acc = np.float32(0.0)
            for e in range(D):
                acc += q[t, h, e] * kc[r, hk, e]
            acc *= scale
            s[j] = acc
            mx = max(mx, acc)
        o = np.zeros(dv, np.float32)                                 # (Dv,) f32
        tot = np.float32(0.0)
        for j in range(n):
            p = np.float32(np.exp(s[j] - mx))
            tot += p
            r = rows[a + j]
            for e in range(dv):
                o[e] += p * vc[r, hk, e]
        inv = np.float32(1.0) / tot
        for e in range(dv):
            out[t, h, e] = o[e] * inv


@njit(parallel=True, cache=True, fastmath=FAST)
def dequantize_rows(codes, scale, offset, group, r0, out):
    """out[i, k] = scale[r0+i, g] * codes[r0+i, k] + offset[r0+i, g] for the rows of out."""
    K = codes.shape[1]
    has_offset = offset.shape[0] == codes.shape[0]
    for i in prange(out.shape[0]):
        n = r0 + i
        for g in range(K // group):
            d = scale[n, g]
            m = offset[n, g] if has_offset else np.float32(0.0)
            for j in range(group):
                out[i, g * group + j] = d * np.float32(codes[n, g * group + j]) + m


@njit(parallel=True, cache=True, fastmath=FAST)
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
