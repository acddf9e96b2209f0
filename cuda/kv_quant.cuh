// kv_quant.cuh: one KV-cache row of D values stored as f16, bf16, q8_0, q5_1, q5_0, q4_1 or
// q4_0, by a whole block (any blockDim.x * blockDim.y that is a multiple of 32; one warp per
// 32-group, groups taken g = warp, warp + n_warps, ...). The formulas are ggml's (gguf.quants'
// quantize, which the CPU backend's round trip calls), so the cache holds exactly what the CPU
// backend holds:
//   f16   round to nearest even (numpy's astype(float16))
//   bf16  the top 16 bits rounded to nearest even (NaN kept quiet), ggml's fp32_to_bf16
//   q8_0  per 32: d = amax / 127, q = roundf(x * (1/d)); d stored as f16
//   q4_0  per 32: m = the element of largest |x| (lowest index among equals), d = m / -8,
//   q5_0        q = min(15, (int)(x * (1/d) + 8.5)); q5_0: d = m / -16, q = min(31, (int)(x *
//               (1/d) + 16.5))
//   q4_1  per 32: lo, hi = min, max; d = (hi - lo) / 15, q = min(15, (int)((x - lo) * (1/d) +
//   q5_1        0.5)); q5_1: / 31 and min(31, ...); d and lo stored as f16
// every product and sum rounded once, in that order (no contraction). The low 4 bits of element
// l < 16 go to the low nibble of byte l, of element l + 16 to its high nibble; q5's fifth bits
// are the u32 qh, bit l for element l.
// Planes (the layout kv_read.cuh reads; service/backends/cuda/kv.py allocates them): codes, row
// `row` at row * D u16 (f16, bf16), row * D bytes (q8_0) or row * D / 2 bytes (the 4/5-bit
// types); side words, KV_SIDE_<TYPE> u16 per 32-group, group g of row `row` at
// (row * D / 32 + g) * KV_SIDE_<TYPE>: [d], [d, lo] (q4_1), [d, qh low, qh high] (q5_0),
// [d, lo, qh low, qh high] (q5_1). Byte for byte the size of ggml's blocks.
#ifndef SPECSTREAM_KV_QUANT_CUH
#define SPECSTREAM_KV_QUANT_CUH

#include "common.cuh"

// The side words per 32-group of each type come as -D defines (service/backends/cuda/kernels.py
// KV_SIDE_WORDS), as the planes kv.py allocates.
#if !defined(KV_SIDE_Q8_0) || !defined(KV_SIDE_Q5_1) || !defined(KV_SIDE_Q5_0)
#error "compile with the shared -D defines (service/backends/cuda/sources.py OPTIONS)"
#endif
#if !defined(KV_SIDE_Q4_1) || !defined(KV_SIDE_Q4_0)
#error "compile with the shared -D defines (service/backends/cuda/sources.py OPTIONS)"
#endif

__device__ __forceinline__ int block_tid() { return threadIdx.y * blockDim.x + threadIdx.x; }
__device__ __forceinline__ int block_threads() { return blockDim.x * blockDim.y; }

struct KvPutF16 {
    __device__ static void put(const float* src, int D, size_t row, u8* codes, u16*) {
        u16* dst = reinterpret_cast<u16*>(codes) + row * D;
        for (int i = block_tid(); i < D; i += block_threads()) dst[i] = f2h(src[i]);
    }
};

struct KvPutQ8_0 {
    __device__ static void put(const float* src, int D, size_t row, u8* codes, u16* dd) {
        const int lane = block_tid() & 31, nw = block_threads() / 32;
        signed char* qs = reinterpret_cast<signed char*>(codes) + row * D;
        for (int g = block_tid() / 32; g < D / 32; g += nw) {
            const float v = src[32 * g + lane];
            const float amax = warp_max(fabsf(v));
            const float d = amax / 127.0f;
            const float id = d != 0.0f ? 1.0f / d : 0.0f;
            qs[32 * g + lane] = (signed char)(int)roundf(v * id);
            if (lane == 0) dd[row * (D / 32) + g] = f2h(d);
        }
    }
};

// The 4/5-bit types: HIGH (a fifth bit per element, q5_*), MIN (an offset, *_1). The side
// words of a group: d, then lo (MIN), then qh low and high (HIGH); SW of them.
template <bool HIGH, bool MIN, int SW>
struct KvPutNibble {
    __device__ static void put(const float* src, int D, size_t row, u8* codes, u16* dd) {
        const int lane = block_tid() & 31, nw = block_threads() / 32;
        constexpr int QMAX = HIGH ? 31 : 15;
        u8* qs = codes + row * (D / 2);
        for (int g = block_tid() / 32; g < D / 32; g += nw) {
            const float v = src[32 * g + lane];
            float d, lo = 0.0f;
            int q;
            if constexpr (MIN) {
                lo = -warp_max(-v);
                d = __fsub_rn(warp_max(v), lo) / (float)QMAX;
                const float id = d != 0.0f ? 1.0f / d : 0.0f;
                q = min(QMAX, (int)__fadd_rn(__fmul_rn(__fsub_rn(v, lo), id), 0.5f));
            } else {
                float best = fabsf(v);
                int bi = lane;
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) {
                    const float ob = __shfl_xor_sync(FULL_MASK, best, o);
                    const int oi = __shfl_xor_sync(FULL_MASK, bi, o);
                    if (ob > best || (ob == best && oi < bi)) { best = ob; bi = oi; }
                }
                const float mx = __shfl_sync(FULL_MASK, v, bi);
                d = mx / (HIGH ? -16.0f : -8.0f);
                const float id = d != 0.0f ? 1.0f / d : 0.0f;
                q = min(QMAX, (int)__fadd_rn(__fmul_rn(v, id), HIGH ? 16.5f : 8.5f));
            }
            const int hi = __shfl_down_sync(FULL_MASK, q & 15, 16);
            if (lane < 16) qs[16 * g + lane] = (u8)((q & 15) | (hi << 4));
            const u32 qh = __ballot_sync(FULL_MASK, (q >> 4) & 1);
            if (lane == 0) {
                u16* side = dd + (row * (D / 32) + g) * SW;
                side[0] = f2h(d);
                if constexpr (MIN) side[1] = f2h(lo);
                if constexpr (HIGH) {
                    side[SW - 2] = (u16)(qh & 0xFFFFu);
                    side[SW - 1] = (u16)(qh >> 16);
                }
            }
        }
    }
};
static_assert(KV_SIDE_Q4_0 == 1 && KV_SIDE_Q8_0 == 1, "q4_0 and q8_0 keep one scale a group");
using KvPutQ4_0 = KvPutNibble<false, false, KV_SIDE_Q4_0>;
using KvPutQ4_1 = KvPutNibble<false, true, KV_SIDE_Q4_1>;
using KvPutQ5_0 = KvPutNibble<true, false, KV_SIDE_Q5_0>;
using KvPutQ5_1 = KvPutNibble<true, true, KV_SIDE_Q5_1>;

// ggml's fp32_to_bf16 (gguf.quants BF16): a NaN made quiet, then round to nearest even.
__device__ __forceinline__ u16 f2bf(float x) {
    u32 n = __float_as_uint(x);
    if ((n & 0x7FFFFFFFu) > 0x7F800000u) n = (n & 0xFFFF0000u) | (64u << 16);
    return (u16)((n + (0x7FFFu + ((n >> 16) & 1u))) >> 16);
}

struct KvPutBF16 {
    __device__ static void put(const float* src, int D, size_t row, u8* codes, u16*) {
        u16* dst = reinterpret_cast<u16*>(codes) + row * D;
        for (int i = block_tid(); i < D; i += block_threads()) dst[i] = f2bf(src[i]);
    }
};

// name, policy for each cache type
// (the order of service.formats.KVType)
#define FOR_KV_TYPES(X) X(f16, KvPutF16) X(bf16, KvPutBF16) X(q8_0, KvPutQ8_0) \
    X(q5_1, KvPutQ5_1) X(q5_0, KvPutQ5_0) X(q4_1, KvPutQ4_1) X(q4_0, KvPutQ4_0)

#endif  // SPECSTREAM_KV_QUANT_CUH
