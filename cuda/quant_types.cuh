// quant_types.cuh: one struct per GGUF weight type; every kernel template includes this file.
//
// Weights live on the GPU in the file's own quantization, repacked once at load into PLANES: the
// fields of every block split into separate arrays (quants, high bits, scales, d/dmin), each
// row-major over the blocks of the matrix. Block b of row r of plane p starts at byte
// (r * blocks_per_row + b) * BPB[p]; the quant planes are 16-byte aligned per 32-element group.
// The byte counts equal the file's (no padding), and service/backends/cuda/layout.py builds the
// planes (its CPU tests check every element against the gguf package's dequantizer).
//
// Each struct gives, for a block `blk` (= r * blocks_per_row + b):
//   dequant(P, blk, i)        element i of the block, in the order of operations of ggml's
//                             reference dequantizer (explicit __fmul_rn/__fadd_rn: no FMA
//                             contraction), so embedding rows equal the CPU backend's bits;
//   load(P, blk, j, g)        the weights of sub-group j (0 for 32-element types, 0..7 for
//                             256-element K-quants) into registers: a `G` of 8 words of 8-bit
//                             codes (elements 4i..4i+3 in word i) and the group's scales;
//   dot(g, a, da, sa)         sum over the group's 32 elements of w * x, where the activations x
//                             are an 8-bit block: x_k ~ da * a_k, a = 8 words of int8 codes,
//                             sa = sum_k a_k. A GEMV loads each weight group once and dots it
//                             with every column's activations (load and dot are apart for that).
//                             Integer dot products (__dp4a) per group, then
//                                 w = d * c           : d * da * sum(c a)
//                                 w = d * (c - z)     : d * da * (sum(c a) - z * sa)
//                                 w = d * c + m       : d * da * sum(c a) + m * da * sa
//                                 w = d*sc*c - dmin*m : d*sc * da * sum(c a) - dmin*m * da * sa
//                             with c the stored codes (IQ4_NL/IQ4_XS: c = the table level of
//                             the stored 4-bit index; Q2_K/Q3_K: two scales per 32 elements).
// Adding a weight type = one struct here + one row in the plane table of
// service/backends/cuda/layout.py + one line in gemv.cu / elementwise.cu instantiating the
// templates.
#ifndef SPECSTREAM_QUANT_TYPES_CUH
#define SPECSTREAM_QUANT_TYPES_CUH

#include "common.cuh"

struct Planes {
    const u8* p0;
    const u8* p1;
    const u8* p2;
    const u8* p3;
};

// 16 bytes at p (16-byte aligned) as 4 words.
__device__ __forceinline__ void ld16(const u8* p, int w[4]) {
    const int4 v = *reinterpret_cast<const int4*>(p);
    w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
}

// Spread the 4 low bits of h into bit 4 of each byte: 0x000000ab -> 0x10 per set bit.
__device__ __forceinline__ int spread4(u32 h) {
    return (int)(((h & 1u) << 4) | ((h & 2u) << 11) | ((h & 4u) << 18) | ((h & 8u) << 25));
}

// The 32 4-bit codes of 16 bytes (element j in the low nibble of byte j, element j + 16 in its
// high nibble) as 8 words of bytes: c[i] = elements 4i..4i+3.
__device__ __forceinline__ void nibbles(const u8* qs, int c[8]) {
    int w[4];
    ld16(qs, w);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        c[i] = w[i] & 0x0F0F0F0F;
        c[i + 4] = (w[i] >> 4) & 0x0F0F0F0F;
    }
}

// sum over 32 bytes of c * a (8 words of signed or unsigned 8-bit codes times int8 codes)
__device__ __forceinline__ int dp8(const int c[8], const int a[8]) {
    int s = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) s = __dp4a(c[i], a[i], s);
    return s;
}

// ------------------------------------------------------------------ Q4_0: d * (q - 8)
// planes: qs (16 B: element j low nibble of byte j, element j+16 high nibble), d (f16)
struct Q4_0 {
    static constexpr int QK = 32;
    __device__ static float dequant(const Planes& P, size_t blk, int i) {
        const u8 q = P.p0[blk * 16 + (i & 15)];
        const int c = (i < 16 ? (q & 15) : (q >> 4)) - 8;
        return __fmul_rn((float)c, h2f(ld_u16(P.p1 + blk * 2)));
    }
    struct G { int c[8]; float d; };
    __device__ static void load(const Planes& P, size_t blk, int, G& g) {
        nibbles(P.p0 + blk * 16, g.c);
        g.d = h2f(ld_u16(P.p1 + blk * 2));
    }
    __device__ static float dot(const G& g, const int* a, float da, float sa) {
        return g.d * da * ((float)dp8(g.c, a) - 8.0f * sa);
    }
};

// ------------------------------------------------------------------ Q4_1: d * q + m
// planes: qs (16 B), dm (f16 d, f16 m)
struct Q4_1 {
    static constexpr int QK = 32;
    __device__ static float dequant(const Planes& P, size_t blk, int i) {
        const u8 q = P.p0[blk * 16 + (i & 15)];
        const int c = i < 16 ? (q & 15) : (q >> 4);
        const float d = h2f(ld_u16(P.p1 + blk * 4)), m = h2f(ld_u16(P.p1 + blk * 4 + 2));
        return __fadd_rn(__fmul_rn(d, (float)c), m);
    }
    struct G { int c[8]; float d, m; };
    __device__ static void load(const Planes& P, size_t blk, int, G& g) {
        nibbles(P.p0 + blk * 16, g.c);
        g.d = h2f(ld_u16(P.p1 + blk * 4));
        g.m = h2f(ld_u16(P.p1 + blk * 4 + 2));
    }
    __device__ static float dot(const G& g, const int* a, float da, float sa) {
        return g.d * da * (float)dp8(g.c, a) + g.m * da * sa;
    }
};

// 5-bit codes of a Q5_0/Q5_1 block as 8 words (elements 4i..4i+3 in word i).
__device__ __forceinline__ void q5_codes(const u8* qs, u32 qh, int c[8]) {
    int w[4];
    ld16(qs, w);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        c[i] = (w[i] & 0x0F0F0F0F) | spread4(qh >> (4 * i));
        c[i + 4] = ((w[i] >> 4) & 0x0F0F0F0F) | spread4(qh >> (16 + 4 * i));
    }
}

__device__ __forceinline__ int q5_code1(const u8* qs, u32 qh, int i) {
    const u8 q = qs[i & 15];
    return (i < 16 ? (q & 15) : (q >> 4)) | (((qh >> i) & 1u) << 4);
}

// ------------------------------------------------------------------ Q5_0: d * (q - 16)
// planes: qs (16 B low nibbles), qh (u32: bit j = bit 4 of element j), d (f16)
struct Q5_0 {
    static constexpr int QK = 32;
    __device__ static float dequant(const Planes& P, size_t blk, int i) {
        const u32 qh = *reinterpret_cast<const u32*>(P.p1 + blk * 4);
        const int c = q5_code1(P.p0 + blk * 16, qh, i) - 16;
        return __fmul_rn((float)c, h2f(ld_u16(P.p2 + blk * 2)));
    }
    struct G { int c[8]; float d; };
    __device__ static void load(const Planes& P, size_t blk, int, G& g) {
        q5_codes(P.p0 + blk * 16, *reinterpret_cast<const u32*>(P.p1 + blk * 4), g.c);
        g.d = h2f(ld_u16(P.p2 + blk * 2));
    }
    __device__ static float dot(const G& g, const int* a, float da, float sa) {
        return g.d * da * ((float)dp8(g.c, a) - 16.0f * sa);
    }
};

// ------------------------------------------------------------------ Q5_1: d * q + m
// planes: qs (16 B), qh (u32), dm (f16 d, f16 m)
struct Q5_1 {
    static constexpr int QK = 32;
    __device__ static float dequant(const Planes& P, size_t blk, int i) {
        const u32 qh = *reinterpret_cast<const u32*>(P.p1 + blk * 4);
        const int c = q5_code1(P.p0 + blk * 16, qh, i);
        const float d = h2f(ld_u16(P.p2 + blk * 4)), m = h2f(ld_u16(P.p2 + blk * 4 + 2));
        return __fadd_rn(__fmul_rn(d, (float)c), m);
    }
    struct G { int c[8]; float d, m; };
    __device__ static void load(const Planes& P, size_t blk, int, G& g) {
        q5_codes(P.p0 + blk * 16, *reinterpret_cast<const u32*>(P.p1 + blk * 4), g.c);
        g.d = h2f(ld_u16(P.p2 + blk * 4));
        g.m = h2f(ld_u16(P.p2 + blk * 4 + 2));
    }
    __device__ static float dot(const G& g, const int* a, float da, float sa) {
        return g.d * da * (float)dp8(g.c, a) + g.m * da * sa;
    }
};

// ------------------------------------------------------------------ Q8_0: d * q
// planes: qs (32 B signed), d (f16)
struct Q8_0 {
    static constexpr int QK = 32;
    __device__ static float dequant(const Planes& P, size_t blk, int i) {
        const int c = (signed char)P.p0[blk * 32 + i];
        return __fmul_rn((float)c, h2f(ld_u16(P.p1 + blk * 2)));
    }
    struct G { int c[8]; float d; };
    __device__ static void load(const Planes& P, size_t blk, int, G& g) {
        ld16(P.p0 + blk * 32, g.c);
        ld16(P.p0 + blk * 32 + 16, g.c + 4);
        g.d = h2f(ld_u16(P.p1 + blk * 2));
    }
    __device__ static float dot(const G& g, const int* a, float da, float) {
        return g.d * da * (float)dp8(g.c, a);
    }
};

// 6-bit (scale, min) of sub-block j of a Q4_K/Q5_K super-block from its 12 packed bytes.
__device__ __forceinline__ void k_scale_min(const u8* q, int j, int& sc, int& m) {
    if (j < 4) {
        sc = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// ------------------------------------------------------------------ Q4_K: d*sc*q - dmin*m
// 256 elements = 8 sub-blocks of 32; sub-block j uses the low (j even) or high (j odd)
// nibbles of quant bytes 32*(j/2) .. 32*(j/2)+31.
// planes: qs (128 B), scales (12 B), dm (f16 d, f16 dmin)
struct Q4_K {
    static constexpr int QK = 256;
    __device__ static float dequant(const Planes& P, size_t blk, int i) {
        const int j = i >> 5, l = i & 31;
        const u8 q = P.p0[blk * 128 + 32 * (j >> 1) + l];
        const int c = (j & 1) ? (q >> 4) : (q & 15);
        int sc, m;
        k_scale_min(P.p1 + blk * 12, j, sc, m);
        const float d = h2f(ld_u16(P.p2 + blk * 4)), dmin = h2f(ld_u16(P.p2 + blk * 4 + 2));
        return __fsub_rn(__fmul_rn(__fmul_rn(d, (float)sc), (float)c),
                         __fmul_rn(dmin, (float)m));
    }
    struct G { int c[8]; float ds, dm; };   // ds = d * sc, dm = dmin * m
    __device__ static void load(const Planes& P, size_t blk, int j, G& g) {
        const u8* qs = P.p0 + blk * 128 + 32 * (j >> 1);
        ld16(qs, g.c);
        ld16(qs + 16, g.c + 4);
        const int sh = (j & 1) * 4;
#pragma unroll
        for (int i = 0; i < 8; i++) g.c[i] = (g.c[i] >> sh) & 0x0F0F0F0F;
        int sc, m;
        k_scale_min(P.p1 + blk * 12, j, sc, m);
        g.ds = h2f(ld_u16(P.p2 + blk * 4)) * (float)sc;
        g.dm = h2f(ld_u16(P.p2 + blk * 4 + 2)) * (float)m;
    }
    __device__ static float dot(const G& g, const int* a, float da, float sa) {
        return g.ds * da * (float)dp8(g.c, a) - g.dm * da * sa;
    }
};

// ------------------------------------------------------------------ Q5_K: d*sc*q - dmin*m
// As Q4_K, plus bit 4 of element l of sub-block j = bit j of high-bit byte l.
// planes: qs (128 B), qh (32 B), scales (12 B), dm (f16 d, f16 dmin)
struct Q5_K {
    static constexpr int QK = 256;
    __device__ static float dequant(const Planes& P, size_t blk, int i) {
        const int j = i >> 5, l = i & 31;
        const u8 q = P.p0[blk * 128 + 32 * (j >> 1) + l];
        const int c = ((j & 1) ? (q >> 4) : (q & 15)) | (((P.p1[blk * 32 + l] >> j) & 1) << 4);
        int sc, m;
        k_scale_min(P.p2 + blk * 12, j, sc, m);
        const float d = h2f(ld_u16(P.p3 + blk * 4)), dmin = h2f(ld_u16(P.p3 + blk * 4 + 2));
        return __fsub_rn(__fmul_rn(__fmul_rn(d, (float)sc), (float)c),
                         __fmul_rn(dmin, (float)m));
    }
    struct G { int c[8]; float ds, dm; };   // ds = d * sc, dm = dmin * m
    __device__ static void load(const Planes& P, size_t blk, int j, G& g) {
        int h[8];
        const u8* qs = P.p0 + blk * 128 + 32 * (j >> 1);
        ld16(qs, g.c);
        ld16(qs + 16, g.c + 4);
        ld16(P.p1 + blk * 32, h);
        ld16(P.p1 + blk * 32 + 16, h + 4);
        const int sh = (j & 1) * 4;
#pragma unroll
        for (int i = 0; i < 8; i++)
            g.c[i] = ((g.c[i] >> sh) & 0x0F0F0F0F) | ((((u32)h[i] >> j) & 0x01010101u) << 4);
        int sc, m;
        k_scale_min(P.p2 + blk * 12, j, sc, m);
        g.ds = h2f(ld_u16(P.p3 + blk * 4)) * (float)sc;
        g.dm = h2f(ld_u16(P.p3 + blk * 4 + 2)) * (float)m;
    }
    __device__ static float dot(const G& g, const int* a, float da, float sa) {
        return g.ds * da * (float)dp8(g.c, a) - g.dm * da * sa;
    }
};

// ------------------------------------------------------------------ Q6_K: d * sc * (q - 32)
// 256 elements in two halves of 128; sub-block s of 32 (half h = s/4, t = s%4) takes the low
// (t < 2) or high (t >= 2) nibbles of ql bytes 64h + 32(t&1) + l and bits 2t, 2t+1 of qh byte
// 32h + l; elements l < 16 use scale 8h + 2t, the others 8h + 2t + 1 (signed 8-bit scales).
// planes: ql (128 B), qh (64 B), scales (16 x i8), d (f16)
struct Q6_K {
    static constexpr int QK = 256;
    __device__ static float dequant(const Planes& P, size_t blk, int i) {
        const int s = i >> 5, l = i & 31, h = s >> 2, t = s & 3;
        const u8 ql = P.p0[blk * 128 + 64 * h + 32 * (t & 1) + l];
        const u8 qh = P.p1[blk * 64 + 32 * h + l];
        const int c = (((t >= 2) ? (ql >> 4) : (ql & 15)) | (((qh >> (2 * t)) & 3) << 4)) - 32;
        const int sc = (signed char)P.p2[blk * 16 + 8 * h + 2 * t + (l >= 16)];
        const float d = h2f(ld_u16(P.p3 + blk * 2));
        return __fmul_rn(__fmul_rn(d, (float)sc), (float)c);
    }
    struct G { int c[8]; int sc0, sc1; float d; };   // codes - 32; elements < 16 use sc0
    __device__ static void load(const Planes& P, size_t blk, int s, G& g) {
        const int h = s >> 2, t = s & 3;
        int q[8];
        const u8* ql = P.p0 + blk * 128 + 64 * h + 32 * (t & 1);
        ld16(ql, g.c);
        ld16(ql + 16, g.c + 4);
        ld16(P.p1 + blk * 64 + 32 * h, q);
        ld16(P.p1 + blk * 64 + 32 * h + 16, q + 4);
        const int shl = (t >= 2) ? 4 : 0;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int c = ((g.c[i] >> shl) & 0x0F0F0F0F) | ((((u32)q[i] >> (2 * t)) & 0x03030303u) << 4);
            g.c[i] = __vsub4(c, 0x20202020);    // per byte c - 32, in -32..31
        }
        const signed char* sc = reinterpret_cast<const signed char*>(P.p2 + blk * 16 + 8 * h + 2 * t);
        g.sc0 = sc[0];
        g.sc1 = sc[1];
        g.d = h2f(ld_u16(P.p3 + blk * 2));
    }
    __device__ static float dot(const G& g, const int* a, float da, float) {
        int s0 = 0, s1 = 0;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            s0 = __dp4a(g.c[i], a[i], s0);
            s1 = __dp4a(g.c[i + 4], a[i + 4], s1);
        }
        return g.d * da * (float)(g.sc0 * s0 + g.sc1 * s1);
    }
};

// ------------------------------------------------------------------ Q2_K: d*sc*q - dmin*m
// 256 elements, 16 sub-blocks of 16 with a 4-bit scale (low nibble) and min (high nibble) each;
// in each 128-element half h, bits 2k..2k+1 of quant byte 32h + l give element 128h + 32k + l.
// planes: qs (64 B), scales (16 B), dm (f16 d, f16 dmin)
struct Q2_K {
    static constexpr int QK = 256;
    __device__ static float dequant(const Planes& P, size_t blk, int i) {
        const int h = i >> 7, k = (i >> 5) & 3, l = i & 31;
        const int c = (P.p0[blk * 64 + 32 * h + l] >> (2 * k)) & 3;
        const u8 s = P.p1[blk * 16 + (i >> 4)];
        const float d = h2f(ld_u16(P.p2 + blk * 4)), dmin = h2f(ld_u16(P.p2 + blk * 4 + 2));
        return __fsub_rn(__fmul_rn(__fmul_rn(d, (float)(s & 15)), (float)c),
                         __fmul_rn(dmin, (float)(s >> 4)));
    }
    // codes 0..3; s: the two scale bytes (elements < 16: byte 0, the others byte 1)
    struct G { int c[8]; int s; float d, dmin; };
    __device__ static void load(const Planes& P, size_t blk, int j, G& g) {
        const u8* qs = P.p0 + blk * 64 + 32 * (j >> 2);
        ld16(qs, g.c);
        ld16(qs + 16, g.c + 4);
        const int sh = 2 * (j & 3);
#pragma unroll
        for (int i = 0; i < 8; i++) g.c[i] = (g.c[i] >> sh) & 0x03030303;
        g.s = ld_u16(P.p1 + blk * 16 + 2 * j);
        g.d = h2f(ld_u16(P.p2 + blk * 4));
        g.dmin = h2f(ld_u16(P.p2 + blk * 4 + 2));
    }
    // llama.cpp's vec_dot_q2_K: d * sum_s sc_s * da * sum(c a) - dmin * sum_s m_s * da * sum(a),
    // the sums of a taken per 16-element half (sa covers all 32)
    __device__ static float dot(const G& g, const int* a, float da, float) {
        int s0 = 0, s1 = 0, a0 = 0, a1 = 0;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            s0 = __dp4a(g.c[i], a[i], s0);
            s1 = __dp4a(g.c[i + 4], a[i + 4], s1);
            a0 = __dp4a(0x01010101, a[i], a0);
            a1 = __dp4a(0x01010101, a[i + 4], a1);
        }
        const int sc = (g.s & 15) * s0 + ((g.s >> 8) & 15) * s1;
        const int m = ((g.s >> 4) & 15) * a0 + ((g.s >> 12) & 15) * a1;
        return da * (g.d * (float)sc - g.dmin * (float)m);
    }
};

// Scale i (0..15) of a Q3_K block, -32..31: low 4 bits in nibble i/8 of byte i%8, high 2 bits
// in bits 2(i/4)..2(i/4)+1 of byte 8 + i%4.
__device__ __forceinline__ int q3k_scale(const u8* s, int i) {
    const int lo = (s[i & 7] >> (4 * (i >> 3))) & 15;
    const int hi = (s[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
    return (lo | (hi << 4)) - 32;
}

// ------------------------------------------------------------------ Q3_K: d * sc * q
// 256 elements, 16 sub-blocks of 16 with 6-bit signed scales; low 2 bits of each code as in
// Q2_K, its high bit = bit j of hmask byte l (element 32j + l); q = low - 4 where it is clear.
// planes: qs (64 B), hmask (32 B), scales (12 B), d (f16)
struct Q3_K {
    static constexpr int QK = 256;
    __device__ static float dequant(const Planes& P, size_t blk, int i) {
        const int j = i >> 5, l = i & 31;
        const int lo = (P.p0[blk * 64 + 32 * (j >> 2) + l] >> (2 * (j & 3))) & 3;
        const int c = lo - (((P.p1[blk * 32 + l] >> j) & 1) ? 0 : 4);
        const int sc = q3k_scale(P.p2 + blk * 12, i >> 4);
        return __fmul_rn(__fmul_rn(h2f(ld_u16(P.p3 + blk * 2)), (float)sc), (float)c);
    }
    struct G { int c[8]; int sc0, sc1; float d; };   // codes -4..3; elements < 16 use sc0
    __device__ static void load(const Planes& P, size_t blk, int j, G& g) {
        int h[8];
        const u8* qs = P.p0 + blk * 64 + 32 * (j >> 2);
        ld16(qs, g.c);
        ld16(qs + 16, g.c + 4);
        ld16(P.p1 + blk * 32, h);
        ld16(P.p1 + blk * 32 + 16, h + 4);
        const int sh = 2 * (j & 3);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int c = ((g.c[i] >> sh) & 0x03030303) | ((((u32)h[i] >> j) & 0x01010101u) << 2);
            g.c[i] = __vsub4(c, 0x04040404);    // per byte (low | high << 2) - 4
        }
        g.sc0 = q3k_scale(P.p2 + blk * 12, 2 * j);
        g.sc1 = q3k_scale(P.p2 + blk * 12, 2 * j + 1);
        g.d = h2f(ld_u16(P.p3 + blk * 2));
    }
    // llama.cpp's vec_dot_q3_K: d * da * sum_s sc_s * sum(c a)
    __device__ static float dot(const G& g, const int* a, float da, float) {
        int s0 = 0, s1 = 0;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            s0 = __dp4a(g.c[i], a[i], s0);
            s1 = __dp4a(g.c[i + 4], a[i + 4], s1);
        }
        return g.d * da * (float)(g.sc0 * s0 + g.sc1 * s1);
    }
};

// ------------------------------------------------------------------ IQ4_NL / IQ4_XS levels
// ggml's kvalues_iq4nl, the 16 levels a 4-bit code indexes: written once in Python
// (service/gguf/quants.py IQ4_NL_VALUES), passed as a -D define.
#if !defined(IQ4_NL_VALUES)
#error "compile with the shared -D defines (service/backends/cuda/sources.py OPTIONS)"
#endif
__constant__ __align__(16) signed char IQ4_NL_TABLE[16] = {IQ4_NL_VALUES};

// Four codes 0..15 (one per byte of c) -> their four levels as signed bytes: a byte permute
// of table words 0-1 (codes 0..7) and 2-3 (codes 8..15), picked per byte by bit 3 of the code.
__device__ __forceinline__ int iq4_levels(u32 c) {
    const u32* t = reinterpret_cast<const u32*>(IQ4_NL_TABLE);
    const u32 sel = (c & 7u) | ((c >> 4) & 0x70u) | ((c >> 8) & 0x700u) | ((c >> 12) & 0x7000u);
    const u32 lo = __byte_perm(t[0], t[1], sel), hi = __byte_perm(t[2], t[3], sel);
    const u32 m = ((c >> 3) & 0x01010101u) * 0xFFu;
    return (int)((lo & ~m) | (hi & m));
}

__device__ __forceinline__ int iq4_code1(const u8* qs, int i) {
    const u8 q = qs[i & 15];
    return IQ4_NL_TABLE[i < 16 ? (q & 15) : (q >> 4)];
}

// ------------------------------------------------------------------ IQ4_NL: d * kv[q]
// planes: qs (16 B, as Q4_0), d (f16)
struct IQ4_NL {
    static constexpr int QK = 32;
    __device__ static float dequant(const Planes& P, size_t blk, int i) {
        return __fmul_rn(h2f(ld_u16(P.p1 + blk * 2)), (float)iq4_code1(P.p0 + blk * 16, i));
    }
    struct G { int c[8]; float d; };   // c: the levels, signed bytes
    __device__ static void load(const Planes& P, size_t blk, int, G& g) {
        nibbles(P.p0 + blk * 16, g.c);
#pragma unroll
        for (int i = 0; i < 8; i++) g.c[i] = iq4_levels((u32)g.c[i]);
        g.d = h2f(ld_u16(P.p1 + blk * 2));
    }
    __device__ static float dot(const G& g, const int* a, float da, float) {
        return g.d * da * (float)dp8(g.c, a);
    }
};

// ------------------------------------------------------------------ IQ4_XS: d*(ls-32)*kv[q]
// 256 elements, 8 sub-blocks of 32 (16 quant bytes each, as IQ4_NL); 6-bit scale ls_j: low 4
// bits in nibble j%2 of scales_l[j/2], high 2 bits in bits 2j..2j+1 of scales_h.
// planes: qs (128 B), head (f16 d, u16 scales_h, u8 scales_l[4])
__device__ __forceinline__ float iq4xs_scale(const u8* hd, int j) {
    const int ls = ((hd[4 + (j >> 1)] >> (4 * (j & 1))) & 15) | (((ld_u16(hd + 2) >> (2 * j)) & 3) << 4);
    return __fmul_rn(h2f(ld_u16(hd)), (float)(ls - 32));
}

struct IQ4_XS {
    static constexpr int QK = 256;
    __device__ static float dequant(const Planes& P, size_t blk, int i) {
        const int j = i >> 5;
        return __fmul_rn(iq4xs_scale(P.p1 + blk * 8, j),
                         (float)iq4_code1(P.p0 + blk * 128 + 16 * j, i & 31));
    }
    struct G { int c[8]; float d; };   // c: the levels; d = d * (ls - 32)
    __device__ static void load(const Planes& P, size_t blk, int j, G& g) {
        nibbles(P.p0 + blk * 128 + 16 * j, g.c);
#pragma unroll
        for (int i = 0; i < 8; i++) g.c[i] = iq4_levels((u32)g.c[i]);
        g.d = iq4xs_scale(P.p1 + blk * 8, j);
    }
    __device__ static float dot(const G& g, const int* a, float da, float) {
        return g.d * da * (float)dp8(g.c, a);
    }
};

// ------------------------------------------------------------------ float types (one plane)
struct F32 {
    static constexpr int QK = 1;
    __device__ static float dequant(const Planes& P, size_t blk, int) {
        return reinterpret_cast<const float*>(P.p0)[blk];
    }
    __device__ static float at(const u8* p, size_t i) { return reinterpret_cast<const float*>(p)[i]; }
};

struct F16 {
    static constexpr int QK = 1;
    __device__ static float dequant(const Planes& P, size_t blk, int) {
        return h2f(reinterpret_cast<const u16*>(P.p0)[blk]);
    }
    __device__ static float at(const u8* p, size_t i) { return h2f(reinterpret_cast<const u16*>(p)[i]); }
};

struct BF16 {
    static constexpr int QK = 1;
    __device__ static float dequant(const Planes& P, size_t blk, int) {
        return bf2f(reinterpret_cast<const u16*>(P.p0)[blk]);
    }
    __device__ static float at(const u8* p, size_t i) { return bf2f(reinterpret_cast<const u16*>(p)[i]); }
};

// X-macro lists of the types, for instantiating kernel templates once per type.
#define FOR_QUANT_TYPES(X) X(q4_0, Q4_0) X(q4_1, Q4_1) X(q5_0, Q5_0) X(q5_1, Q5_1) \
    X(q8_0, Q8_0) X(q4_k, Q4_K) X(q5_k, Q5_K) X(q6_k, Q6_K) X(q2_k, Q2_K) X(q3_k, Q3_K) \
    X(iq4_nl, IQ4_NL) X(iq4_xs, IQ4_XS)
#define FOR_FLOAT_TYPES(X) X(f32, F32) X(f16, F16) X(bf16, BF16)

#endif  // SPECSTREAM_QUANT_TYPES_CUH
