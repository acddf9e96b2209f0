// kv_read.cuh: reading one KV-cache row of D values stored as f16, q8_0 or q4_0 (the layout
// kv_quant.cuh writes; row `row` starts at row * D codes (f16, q8_0), row * D / 2 bytes (q4_0)
// and row * D / 32 scales), as float values equal to the CPU backend's dequantized cache:
//   f16   the half value (exact)
//   q8_0  code * d                (one rounding, __fmul_rn)
//   q4_0  (nibble - 8) * d        (one rounding, __fmul_rn)
// vrow<NV>(row, lane, v): elements d = lane + 32 i (i < NV) of a row, 0 past D; load8(i0, v):
// elements i0..i0+7 (i0 % 8 == 0) with one vector load; at(i): element i.
// Device functions only (no launch geometry): used by attention.cu and attention_tiled.cu.
#ifndef SPECSTREAM_KV_READ_CUH
#define SPECSTREAM_KV_READ_CUH

#include "common.cuh"

// vrow through at(): element d = lane + 32 i of the row, 0 past D.
template <class KT, int NV>
__device__ __forceinline__ void vrow_by_element(const u8* qs, const u8* dd, size_t row, int D,
                                                int lane, float (&v)[NV]) {
#pragma unroll
    for (int i = 0; i < NV; i++)
        v[i] = lane + 32 * i < D ? KT::at(qs, dd, row, D, lane + 32 * i) : 0.0f;
}

struct KvF16 {
    static constexpr int PASS128 = 8;    // V rows in flight per pass (attention.cu, Dv <= 128)
    template <int NV>
    __device__ static void vrow(const u8* qs, const u8* dd, size_t row, int D, int lane,
                                float (&v)[NV]) {
        vrow_by_element<KvF16, NV>(qs, dd, row, D, lane, v);
    }
    __device__ static float at(const u8* qs, const u8*, size_t row, int D, int i) {
        return h2f(reinterpret_cast<const u16*>(qs)[row * D + i]);
    }
    __device__ static void load8(const u8* qs, const u8*, size_t row, int D, int i0,
                                 float v[8]) {
        const uint4 w = *reinterpret_cast<const uint4*>(qs + 2 * (row * D + i0));
        v[0] = h2f((u16)(w.x & 0xFFFFu)); v[1] = h2f((u16)(w.x >> 16));
        v[2] = h2f((u16)(w.y & 0xFFFFu)); v[3] = h2f((u16)(w.y >> 16));
        v[4] = h2f((u16)(w.z & 0xFFFFu)); v[5] = h2f((u16)(w.z >> 16));
        v[6] = h2f((u16)(w.w & 0xFFFFu)); v[7] = h2f((u16)(w.w >> 16));
    }
};
struct KvQ8_0 {
    static constexpr int PASS128 = 4;    // (8 spills within 128 registers)
    template <int NV>
    __device__ static void vrow(const u8* qs, const u8* dd, size_t row, int D, int lane,
                                float (&v)[NV]) {
        vrow_by_element<KvQ8_0, NV>(qs, dd, row, D, lane, v);
    }
    __device__ static float at(const u8* qs, const u8* dd, size_t row, int D, int i) {
        const float d = h2f(reinterpret_cast<const u16*>(dd)[row * (D / 32) + i / 32]);
        return __fmul_rn((float)reinterpret_cast<const signed char*>(qs)[row * D + i], d);
    }
    __device__ static void load8(const u8* qs, const u8* dd, size_t row, int D, int i0,
                                 float v[8]) {
        const float d = h2f(reinterpret_cast<const u16*>(dd)[row * (D / 32) + i0 / 32]);
        const uint2 w = *reinterpret_cast<const uint2*>(qs + row * D + i0);
#pragma unroll
        for (int u = 0; u < 8; u++) {
            const int c = (signed char)(((u < 4 ? w.x : w.y) >> (8 * (u & 3))) & 0xFF);
            v[u] = __fmul_rn((float)c, d);
        }
    }
};
struct KvQ4_0 {
    static constexpr int PASS128 = 8;
    // elements d = lane + 32 i (i < D / 32) of a row, as at() gives them
    template <int NV>
    __device__ static void vrow(const u8* qs, const u8* dd, size_t row, int D, int lane,
                                float (&v)[NV]) {
        const int shift = lane < 16 ? 0 : 4;
#pragma unroll
        for (int i = 0; i < NV; i++) {
            v[i] = 0.0f;
            if (32 * i < D) {
                const float d = h2f(reinterpret_cast<const u16*>(dd)[row * (D / 32) + i]);
                const int b = qs[row * (D / 2) + 16 * i + (lane & 15)];
                v[i] = __fmul_rn((float)(((b >> shift) & 15) - 8), d);
            }
        }
    }
    __device__ static float at(const u8* qs, const u8* dd, size_t row, int D, int i) {
        const float d = h2f(reinterpret_cast<const u16*>(dd)[row * (D / 32) + i / 32]);
        const u8 b = qs[row * (D / 2) + 16 * (i / 32) + (i & 15)];
        const int c = ((i & 31) < 16 ? (b & 15) : (b >> 4)) - 8;
        return __fmul_rn((float)c, d);
    }
    __device__ static void load8(const u8* qs, const u8* dd, size_t row, int D, int i0,
                                 float v[8]) {
        const float d = h2f(reinterpret_cast<const u16*>(dd)[row * (D / 32) + i0 / 32]);
        const uint2 w = *reinterpret_cast<const uint2*>(qs + row * (D / 2) + 16 * (i0 / 32)
                                                        + (i0 & 15));
        const int shift = (i0 & 31) < 16 ? 0 : 4;
#pragma unroll
        for (int u = 0; u < 8; u++) {
            const int b = ((u < 4 ? w.x : w.y) >> (8 * (u & 3))) & 0xFF;
            v[u] = __fmul_rn((float)(((b >> shift) & 15) - 8), d);
        }
    }
};

// X(kn, KT, vn, VT) for every (K type, V type) pair: the attention kernels' instantiations.
#define FOR_KV_TYPE_PAIRS_V(X, kn, KT) X(kn, KT, f16, KvF16) X(kn, KT, q8_0, KvQ8_0) \
    X(kn, KT, q4_0, KvQ4_0)
#define FOR_KV_TYPE_PAIRS(X) FOR_KV_TYPE_PAIRS_V(X, f16, KvF16) \
    FOR_KV_TYPE_PAIRS_V(X, q8_0, KvQ8_0) FOR_KV_TYPE_PAIRS_V(X, q4_0, KvQ4_0)

#endif  // SPECSTREAM_KV_READ_CUH
