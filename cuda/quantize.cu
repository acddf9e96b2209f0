// quantize.cu: 8-bit activation blocks for the GEMVs, and KV-cache row stores.
//
// quantize_act: for each row c of x (C, K) f32 (row stride ldx) and each 32-group g:
//     amax = max |x|,  d = amax / 127,  q = rint(x / d) (0 when amax = 0),  s = sum q
//     qa[c, 32g + l] = q (int8), ads[c, g] = (d, s)
//   so |x - d q| <= d / 2 per element. The CPU backend's act_quant="gpu" mode rounds the same
//   way (numpy float32 division and rint), so GPU and CPU see identical activations.
//   Launch: block (32, 4), one warp per (row, group); grid ceil(C * K/32 / 4).
//
// kv_store_<type>: cache[slot[t], pos[t], h, :] = round(src[t, h, :]) for t < T, h < Hkv, with
//   src a (T, Hkv, D) view (strides st, sh, 1) and the cache (n_slots, n_ctx, Hkv, D) of:
//     f16   round to nearest even (as numpy's astype(float16))
//     q8_0  per 32: d = amax / 127, q = roundf(x * (1/d)); d stored as f16   (ggml's formulas)
//     q4_0  per 32: m = the element of largest |x| (first), d = m / -8,
//           q = min(15, (int)(x * (1/d) + 8.5)); d stored as f16; element l < 16 in the low
//           nibble of byte l, element l + 16 in its high nibble
//   so the GPU cache holds exactly what the CPU backend's round trip produces. Rows with
//   slot[t] < 0 are padding and are skipped.
//   Launch: grid (T, Hkv), block (32, ceil(D / 32)): one warp per 32-group of the row.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(128)
quantize_act(const float* __restrict__ x, int ldx, int C, int K, signed char* __restrict__ qa,
             float2* __restrict__ ads) {
    const int G = K / 32;
    const int item = blockIdx.x * 4 + threadIdx.y;
    if (item >= C * G) return;
    const int c = item / G, g = item % G, lane = threadIdx.x;
    const float v = x[(size_t)c * ldx + 32 * g + lane];
    const float amax = warp_max(fabsf(v));
    const float d = amax / 127.0f;
    const int q = amax == 0.0f ? 0 : (int)rintf(v / d);
    const int s = warp_sum_int(q);
    qa[(size_t)c * K + 32 * g + lane] = (signed char)q;
    if (lane == 0) ads[(size_t)c * G + g] = make_float2(d, (float)s);
}

__device__ __forceinline__ size_t kv_row(const int* slots, const int* positions, int t, int h,
                                         int n_ctx, int Hkv) {
    return ((size_t)slots[t] * n_ctx + positions[t]) * Hkv + h;
}

extern "C" __global__ void kv_store_f16(const float* __restrict__ src, int st, int sh, int D,
                                        const int* __restrict__ slots,
                                        const int* __restrict__ positions, int n_ctx, int Hkv,
                                        u16* __restrict__ dst) {
    const int t = blockIdx.x, h = blockIdx.y;
    if (slots[t] < 0) return;
    const int i = threadIdx.y * 32 + threadIdx.x;
    if (i >= D) return;
    const size_t row = kv_row(slots, positions, t, h, n_ctx, Hkv);
    dst[row * D + i] = f2h(src[(size_t)t * st + (size_t)h * sh + i]);
}

extern "C" __global__ void kv_store_q8_0(const float* __restrict__ src, int st, int sh, int D,
                                         const int* __restrict__ slots,
                                         const int* __restrict__ positions, int n_ctx, int Hkv,
                                         signed char* __restrict__ qs, u16* __restrict__ dd) {
    const int t = blockIdx.x, h = blockIdx.y;
    if (slots[t] < 0) return;
    const int g = threadIdx.y, lane = threadIdx.x, i = 32 * g + lane;
    const float v = src[(size_t)t * st + (size_t)h * sh + i];
    const float amax = warp_max(fabsf(v));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    const size_t row = kv_row(slots, positions, t, h, n_ctx, Hkv);
    qs[row * D + i] = (signed char)(int)roundf(v * id);
    if (lane == 0) dd[row * (D / 32) + g] = f2h(d);
}

extern "C" __global__ void kv_store_q4_0(const float* __restrict__ src, int st, int sh, int D,
                                         const int* __restrict__ slots,
                                         const int* __restrict__ positions, int n_ctx, int Hkv,
                                         u8* __restrict__ qs, u16* __restrict__ dd) {
    const int t = blockIdx.x, h = blockIdx.y;
    if (slots[t] < 0) return;
    const int g = threadIdx.y, lane = threadIdx.x, i = 32 * g + lane;
    const float v = src[(size_t)t * st + (size_t)h * sh + i];
    // The element of largest magnitude, the lowest index among equal magnitudes.
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
    const size_t row = kv_row(slots, positions, t, h, n_ctx, Hkv);
    if (lane < 16) qs[row * (D / 2) + 16 * g + lane] = (u8)(q | (hi << 4));
    if (lane == 0) dd[row * (D / 32) + g] = f2h(d);
}
