// kv_quant.cuh: one KV-cache row of D values stored as f16, q8_0 or q4_0, by a whole block
// (any blockDim.x * blockDim.y that is a multiple of 32; one warp per 32-group, groups taken
// g = warp, warp + n_warps, ...). The formulas are ggml's, so the cache holds exactly what the
// CPU backend's round trip produces:
//   f16   round to nearest even (numpy's astype(float16))
//   q8_0  per 32: d = amax / 127, q = roundf(x * (1/d)); d stored as f16
//   q4_0  per 32: m = the element of largest |x| (lowest index among equals), d = m / -8,
//         q = min(15, (int)(x * (1/d) + 8.5)); d stored as f16; element l < 16 in the low
//         nibble of byte l, element l + 16 in its high nibble
// Row `row` of the cache plane starts at row * D codes (f16, q8_0), row * D / 2 bytes (q4_0),
// and row * D / 32 scales.
#ifndef SPECSTREAM_KV_QUANT_CUH
#define SPECSTREAM_KV_QUANT_CUH

#include "common.cuh"

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

struct KvPutQ4_0 {
    __device__ static void put(const float* src, int D, size_t row, u8* codes, u16* dd) {
        const int lane = block_tid() & 31, nw = block_threads() / 32;
        u8* qs = codes + row * (D / 2);
        for (int g = block_tid() / 32; g < D / 32; g += nw) {
            const float v = src[32 * g + lane];
            float best = fabsf(v);
            int bi = lane;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                const float ob = __shfl_xor_sync(FULL_MASK, best, o);
                const int oi = __shfl_xor_sync(FULL_MASK, bi, o);
                if (ob > best || (ob == best && oi < bi)) { best = ob; bi = oi; }
            }
            const float mx = __shfl_sync(FULL_MASK, v, bi);
            const float d = mx / -8.0f;
            const float id = d != 0.0f ? 1.0f / d : 0.0f;
            const int q = min(15, (int)__fadd_rn(__fmul_rn(v, id), 8.5f));
            const int hi = __shfl_down_sync(FULL_MASK, q, 16);
            if (lane < 16) qs[16 * g + lane] = (u8)(q | (hi << 4));
            if (lane == 0) dd[row * (D / 32) + g] = f2h(d);
        }
    }
};

// name, policy for each cache type
#define FOR_KV_TYPES(X) X(f16, KvPutF16) X(q8_0, KvPutQ8_0) X(q4_0, KvPutQ4_0)

#endif  // SPECSTREAM_KV_QUANT_CUH
