// kv_read.cuh: reading one KV-cache row of D values stored as any KV type (the planes
// kv_quant.cuh writes and its header describes), as float values equal to the CPU backend's
// dequantized cache (gguf.quants' dequantize):
//   f16, bf16   the half value (exact)
//   q8_0        code * d                (one rounding, __fmul_rn)
//   q4_0, q5_0  (code - 8 | 16) * d     (one rounding)
//   q4_1, q5_1  d * code + lo           (two roundings, __fmul_rn then __fadd_rn)
// A reader per storage class (KvF16, KvBF16, KvQ8_0, KvNibble for the four 4/5-bit types):
// vrow<NV>(row, lane, v): elements d = lane + 32 i (i < NV) of a row, 0 past D; load8(i0, v):
// elements i0..i0+7 (i0 % 8 == 0) with one vector load; at(i): element i.
// Device functions only (no launch geometry): used by attention.cu and attention_tiled.cu.
#ifndef SPECSTREAM_KV_READ_CUH
#define SPECSTREAM_KV_READ_CUH

#include "common.cuh"
#include "kv_quant.cuh"

// KV_SIDE_<TYPE>: the side words per 32-group (-D defines, kernels.py KV_SIDE_WORDS)
#if !defined(KV_SIDE_Q5_1) || !defined(KV_SIDE_Q5_0)
#error "compile with the shared -D defines (service/backends/cuda/sources.py OPTIONS)"
#endif
#if !defined(KV_SIDE_Q4_1) || !defined(KV_SIDE_Q4_0)
#error "compile with the shared -D defines (service/backends/cuda/sources.py OPTIONS)"
#endif
// KV_KIND_HIGH, KV_KIND_MIN: the kind bits of the 4/5-bit reader (kernels.py KV_READ)
#if !defined(KV_KIND_HIGH) || !defined(KV_KIND_MIN)
#error "compile with the shared -D defines (service/backends/cuda/sources.py OPTIONS)"
#endif

// vrow through at(): element d = lane + 32 i of the row, 0 past D.
template <class KT, int NV>
__device__ __forceinline__ void vrow_by_element(const KT& kt, const u8* qs, const u8* dd,
                                                size_t row, int D, int lane, float (&v)[NV]) {
#pragma unroll
    for (int i = 0; i < NV; i++)
        v[i] = lane + 32 * i < D ? kt.at(qs, dd, row, D, lane + 32 * i) : 0.0f;
}

// A reader is made in the kernel from the launch's kind (KvReader(kind)); only KvNibble uses it.
struct KvF16 {
    static constexpr int PASS128 = 8;    // V rows in flight per pass (attention.cu, Dv <= 128)
    static constexpr int PASS256_AS_KEY = 4;   // ... Dv <= 256, when the keys are of this type
    __device__ explicit KvF16(int) {}
    template <int NV>
    __device__ void vrow(const u8* qs, const u8* dd, size_t row, int D, int lane,
                         float (&v)[NV]) const {
        vrow_by_element<KvF16, NV>(*this, qs, dd, row, D, lane, v);
    }
    __device__ float at(const u8* qs, const u8*, size_t row, int D, int i) const {
        return h2f(reinterpret_cast<const u16*>(qs)[row * D + i]);
    }
    __device__ void load8(const u8* qs, const u8*, size_t row, int D, int i0, float v[8]) const {
        const uint4 w = *reinterpret_cast<const uint4*>(qs + 2 * (row * D + i0));
        v[0] = h2f((u16)(w.x & 0xFFFFu)); v[1] = h2f((u16)(w.x >> 16));
        v[2] = h2f((u16)(w.y & 0xFFFFu)); v[3] = h2f((u16)(w.y >> 16));
        v[4] = h2f((u16)(w.z & 0xFFFFu)); v[5] = h2f((u16)(w.z >> 16));
        v[6] = h2f((u16)(w.w & 0xFFFFu)); v[7] = h2f((u16)(w.w >> 16));
    }
};
struct KvQ8_0 {
    static constexpr int PASS256_AS_KEY = 4;
    static constexpr int PASS128 = 4;    // (8 spills within 128 registers)
    __device__ explicit KvQ8_0(int) {}
    template <int NV>
    __device__ void vrow(const u8* qs, const u8* dd, size_t row, int D, int lane,
                         float (&v)[NV]) const {
        vrow_by_element<KvQ8_0, NV>(*this, qs, dd, row, D, lane, v);
    }
    __device__ float at(const u8* qs, const u8* dd, size_t row, int D, int i) const {
        const float d = h2f(reinterpret_cast<const u16*>(dd)[row * (D / 32) + i / 32]);
        return __fmul_rn((float)reinterpret_cast<const signed char*>(qs)[row * D + i], d);
    }
    __device__ void load8(const u8* qs, const u8* dd, size_t row, int D, int i0, float v[8]) const {
        const float d = h2f(reinterpret_cast<const u16*>(dd)[row * (D / 32) + i0 / 32]);
        const uint2 w = *reinterpret_cast<const uint2*>(qs + row * D + i0);
#pragma unroll
        for (int u = 0; u < 8; u++) {
            const int c = (signed char)(((u < 4 ? w.x : w.y) >> (8 * (u & 3))) & 0xFF);
            v[u] = __fmul_rn((float)c, d);
        }
    }
};
// bf16: the top half of a float (exact), as f16 but for the conversion.
struct KvBF16 {
    static constexpr int PASS256_AS_KEY = 4;
    static constexpr int PASS128 = 8;
    __device__ explicit KvBF16(int) {}
    template <int NV>
    __device__ void vrow(const u8* qs, const u8* dd, size_t row, int D, int lane,
                         float (&v)[NV]) const {
        vrow_by_element<KvBF16, NV>(*this, qs, dd, row, D, lane, v);
    }
    __device__ float at(const u8* qs, const u8*, size_t row, int D, int i) const {
        return bf2f(reinterpret_cast<const u16*>(qs)[row * D + i]);
    }
    __device__ void load8(const u8* qs, const u8*, size_t row, int D, int i0, float v[8]) const {
        const uint4 w = *reinterpret_cast<const uint4*>(qs + 2 * (row * D + i0));
        v[0] = bf2f((u16)(w.x & 0xFFFFu)); v[1] = bf2f((u16)(w.x >> 16));
        v[2] = bf2f((u16)(w.y & 0xFFFFu)); v[3] = bf2f((u16)(w.y >> 16));
        v[4] = bf2f((u16)(w.z & 0xFFFFu)); v[5] = bf2f((u16)(w.z >> 16));
        v[6] = bf2f((u16)(w.w & 0xFFFFu)); v[7] = bf2f((u16)(w.w >> 16));
    }
};

// The 4/5-bit types (kv_quant.cuh KvPutNibble's layout) in one reader, their rule chosen by the
// launch's kind bits (KV_KIND_HIGH: q5_0, q5_1; KV_KIND_MIN: q4_1, q5_1; kernels.py KV_READ),
// so the attention kernels exist per reader pair (16) instead of per type pair (49). Code c of
// element l of a group is its nibble, plus bit l of qh as bit 4 (HIGH); the value is
// (c - 8) * d, (c - 16) * d (q5_0) or d * c + lo (MIN), each operation rounded once, as
// gguf.quants' dequantize computes it. A group's side words: d, then lo (MIN), then qh as two
// halves (HIGH): 1 + MIN + 2 HIGH of them.
static_assert(KV_SIDE_Q4_0 == 1 && KV_SIDE_Q4_1 == 2 && KV_SIDE_Q5_0 == 3 && KV_SIDE_Q5_1 == 4,
              "KvNibble derives the side words from the kind bits");
struct KvNibble {
    // The offset and fifth bits take registers: as values, 4 rows in flight (as q8_0); as
    // keys of a _d256 kernel, 2 value rows in flight instead of 4, so no pair spills.
    static constexpr int PASS128 = 4;
    static constexpr int PASS256_AS_KEY = 2;
    bool high, min;
    int sw;                                   // side words per group
    __device__ explicit KvNibble(int kind)
        : high((kind & KV_KIND_HIGH) != 0), min((kind & KV_KIND_MIN) != 0),
          sw(1 + (min ? 1 : 0) + (high ? 2 : 0)) {}
    struct Group {
        float d, lo;
        u32 qh;
    };
    __device__ Group group(const u8* dd, size_t row, int D, int g) const {
        const u16* side = reinterpret_cast<const u16*>(dd) + (row * (D / 32) + g) * sw;
        Group r{h2f(side[0]), 0.0f, 0u};
        if (min) r.lo = h2f(side[1]);
        if (high) r.qh = (u32)side[sw - 2] | ((u32)side[sw - 1] << 16);
        return r;
    }
    // element l (0..31) of a group whose low nibble is n
    __device__ float value(const Group& gr, int n, int l) const {
        const int c = high ? n | (int)(((gr.qh >> l) & 1u) << 4) : n;
        if (min) return __fadd_rn(__fmul_rn(gr.d, (float)c), gr.lo);
        return __fmul_rn((float)(c - (high ? 16 : 8)), gr.d);
    }
    // elements d = lane + 32 i (i < D / 32) of a row, as at() gives them
    template <int NV>
    __device__ void vrow(const u8* qs, const u8* dd, size_t row, int D, int lane,
                         float (&v)[NV]) const {
        const int shift = lane < 16 ? 0 : 4;
#pragma unroll
        for (int i = 0; i < NV; i++) {
            v[i] = 0.0f;
            if (32 * i < D) {
                const Group gr = group(dd, row, D, i);
                const int b = qs[row * (D / 2) + 16 * i + (lane & 15)];
                v[i] = value(gr, (b >> shift) & 15, lane);
            }
        }
    }
    __device__ float at(const u8* qs, const u8* dd, size_t row, int D, int i) const {
        const Group gr = group(dd, row, D, i / 32);
        const u8 b = qs[row * (D / 2) + 16 * (i / 32) + (i & 15)];
        return value(gr, (i & 31) < 16 ? (b & 15) : (b >> 4), i & 31);
    }
    __device__ void load8(const u8* qs, const u8* dd, size_t row, int D, int i0, float v[8]) const {
        const Group gr = group(dd, row, D, i0 / 32);
        const uint2 w = *reinterpret_cast<const uint2*>(qs + row * (D / 2) + 16 * (i0 / 32)
                                                        + (i0 & 15));
        const int shift = (i0 & 31) < 16 ? 0 : 4;
#pragma unroll
        for (int u = 0; u < 8; u++) {
            const int b = ((u < 4 ? w.x : w.y) >> (8 * (u & 3))) & 0xFF;
            v[u] = value(gr, (b >> shift) & 15, (i0 & 31) + u);
        }
    }
};

// X(kn, KT, vn, VT) for every (K reader, V reader) pair: the attention kernels' instantiations
// (kernels.py KV_READERS' order, K outermost).
#define FOR_KV_READER_PAIRS_V(X, kn, KT) X(kn, KT, f16, KvF16) X(kn, KT, bf16, KvBF16)       \
    X(kn, KT, q8_0, KvQ8_0) X(kn, KT, nib, KvNibble)
#define FOR_KV_READER_PAIRS(X) FOR_KV_READER_PAIRS_V(X, f16, KvF16)                          \
    FOR_KV_READER_PAIRS_V(X, bf16, KvBF16) FOR_KV_READER_PAIRS_V(X, q8_0, KvQ8_0)            \
    FOR_KV_READER_PAIRS_V(X, nib, KvNibble)

#endif  // SPECSTREAM_KV_READ_CUH
