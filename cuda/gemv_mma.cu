// gemv_mma.cu: out[c, n] (+)= sum_k W[n, k] x[c, k] for 1..64 columns c per block column, on
// int8 tensor cores (mma.sync, sm_80+) instead of gemv.cu's per-column dp4a; one column in the
// tiles' order of additions on dp4a (no MMA padding of 7 columns in 8).
//
// Inputs as gemv.cu's plain mode: W in planes (quant_types.cuh), x as 8-bit blocks: codes qa
// (C, K) int8, per 32-group (da, sa) with x[c, k] ~ da * qa[c, k], sa = sum of the group's
// codes. Per row n, column c and group j (s_j = the integer dot product of the group's weight
// codes with qa, from the MMA, exact):
//   Q4_K  (codes 0..15, scale d*sc_j, min dmin*m_j):
//           da * (d*sc_j * s_j - dmin*m_j * sa)
//   Q6_K  (codes q - 32, 16-element halves with signed scales sc0, sc1):
//           d * da * (sc0 * s_j,0 + sc1 * s_j,1)          (the integer combination is exact)
//   Q8_0  (codes int8), Q4_0 (codes q - 8):  d * da * s_j
// the same math as quant_types.cuh's dot(), not its rounding order: results differ from gemv.cu
// in the last bits (CudaBackend(gemv_mma=True) opts in). Every rounding is explicit (__fmaf_rn,
// __fmul_rn, __fadd_rn: no contraction left to the compiler), and a column's sequence of them
// depends neither on NC nor on the block's rows: a column gets the same bits from every tile.
// accumulate = 1 adds the product to what out (C, ldo) f32 holds.
//
// One column (gemv_mma_<type>_c1[p][n]): the same sums in the same order from dp4a dot
// products, one warp per row, block (32, GEMV_WARPS), grid ceil(N / GEMV_WARPS), 8 B x
// MMA_ONE_CHUNK shared per warp: see its section below. One column split over K
// (gemv_mma_<type>_c1s[p]): the same sums again, K split over a block's MMA_WARPS warps as the
// tiles split it, block (32, MMA_WARPS) of 32 / UG rows, grid ceil(N / (32 / UG)) or fewer
// blocks looping over row groups: see its section.
//
// Launch (gemv_mma_<type>_c<NC>, NC = 8, 16, 32, 64; M = MMA_M_C<NC> m-tiles of 16 rows):
// block (32, MMA_WARPS), grid (ceil(N / (16 M)), ceil(C / NC)). A block owns 16 M rows and NC
// columns (NT = NC / 8 n-tiles); its warp w takes the units b = w, w + MMA_WARPS, ... of K
// (a K-quant super-block, or 4 blocks of 32 for Q8_0 / Q4_0; split-K inside the block: enough
// warps in flight for short matrices), loads their weights for all m-tiles first, then per
// group and n-tile loads the column's codes once and runs one MMA per m-tile, scaling the int32
// results into float accumulators. The K-quant tiles and the 64-column ones first stage the
// unit's (da, sa) of the block's columns in the warp's shared memory (UG x (NC + 2) float2:
// 2.0 / 3.2 / 5.2 / 8.3 KiB a warp for Q4_K at 8 / 16 / 32 / 64 columns), read coalesced, so
// a lane gets its two columns' pairs in one 16-byte shared read instead of two 8-byte loads
// of separate lines. The warps' partial sums meet in shared memory (two n-tiles a round,
// M x 2 x 4 x 32 floats a warp) and are added in warp order (deterministic). Rows >= N and columns >= C read row
// N - 1 / column C - 1 (valid memory) and are not written.
//
// Fragments (PTX ISA, mma.m16n8k32 / m16n8k16 .s8; lane = 4 gid + tid):
//   A (16 x k, row-major): row gid in regs 0 (and 2), row gid + 8 in regs 1 (and 3);
//   B (k x 8): column gid;  D (16 x 8): rows gid (d0, d1) and gid + 8 (d2, d3), columns
//   2 tid, 2 tid + 1.  k32: MMA k-slot 4 tid + i holds byte 8 tid + i of the group and slot
//   16 + 4 tid + i byte 8 tid + 4 + i (a permutation of k, the same for A and B), so a lane reads
//   8 contiguous bytes of weights and of activations. k16 (Q6_K, one per 16-element scale):
//   slot 4 tid + i holds byte 16 e + 4 tid + i of half e.
#include "pdl.cuh"
#include "quant_types.cuh"
#include "act_quant.cuh"

// MMA_WARPS (8) and MMA_M_C<NC> (m-tiles of 16 rows per block of the NC-column tile: 2, 2, 2, 1)
// come as -D defines (service/backends/cuda/kernels.py).
#if !defined(MMA_WARPS) || !defined(MMA_M_C8) || !defined(MMA_M_C16)
#error "compile with the shared -D defines (service/backends/cuda/sources.py OPTIONS)"
#endif
#if !defined(MMA_M_C32) || !defined(MMA_M_C64)
#error "compile with the shared -D defines (service/backends/cuda/sources.py OPTIONS)"
#endif

// d = A (16 x 32 s8) * B (32 x 8 s8), int32
__device__ __forceinline__ void mma_k32(int (&d)[4], int a0, int a1, int a2, int a3, int b0,
                                        int b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %10, %10, %10};"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(0));
}

// d = A (16 x 16 s8) * B (16 x 8 s8), int32
__device__ __forceinline__ void mma_k16(int (&d)[4], int a0, int a1, int b0) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 "
                 "{%0, %1, %2, %3}, {%4, %5}, {%6}, {%7, %7, %7, %7};"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                 : "r"(a0), "r"(a1), "r"(b0), "r"(0));
}

// v as a float, exactly, for |v| < 2^22: the float 1.5 * 2^23 + v (its bits: those of 1.5 * 2^23
// plus v) minus 1.5 * 2^23; an integer add and a float add instead of the conversion unit.
__device__ __forceinline__ float exact_f(int v) {
    return __fsub_rn(__int_as_float(0x4B400000 + v), 12582912.0f);
}

// Where a lane reads its columns: n-tile t's B column (ca + 8 t: the lane's gid) codes, and the
// (da, sa) of the two D columns it owns (8 t + 2 tid + i of the block, i = 0, 1); columns past
// the last read the last one (valid memory, never written). STAGED: the scales from the warp's
// unit of them staged in shared memory (stage_scales: row g - g0, SP = NC + 2 float2 a row, one
// 16-byte read for both columns); else straight from global memory.
template <bool STAGED>
struct MmaCols {
    const signed char* qa;
    const float2* ads;       // STAGED: the warp's staged scales, [group - g0][column - c0]
    int K, G, ca, cs, tid, g0, sp, last;
    __device__ __forceinline__ const signed char* codes(int t, int grp) const {
        return qa + (size_t)min(ca + 8 * t, last) * K + 32 * grp;
    }
    // (da, sa) of the lane's columns 8 t + 2 tid (x, y) and 8 t + 2 tid + 1 (z, w)
    __device__ __forceinline__ float4 scales(int t, int grp) const {
        if (STAGED)
            return *reinterpret_cast<const float4*>(ads + (grp - g0) * sp + 8 * t + 2 * tid);
        const float2 a = ads[(size_t)min(cs + 8 * t, last) * G + grp];
        const float2 b = ads[(size_t)min(cs + 8 * t + 1, last) * G + grp];
        return make_float4(a.x, a.y, b.x, b.y);
    }
};

// The (da, sa) of groups g0 .. g0 + UG - 1 (clamped to G - 1) of the block's NC columns c0 ..
// (clamped to last) into sm[g - g0][c - c0] (row stride NC + 2), read as each column's UG
// consecutive pairs (UG lanes a column: 256 contiguous bytes an instruction for UG = 8).
template <int UG, int NC>
__device__ __forceinline__ void stage_scales(float2* sm, const float2* __restrict__ ads, int G,
                                             int g0, int c0, int last, int lane) {
#pragma unroll
    for (int e = lane; e < UG * NC; e += WARP) {
        const int c = e / UG, g = e % UG;
        sm[g * (NC + 2) + c] = ads[(size_t)min(c0 + c, last) * G + min(g0 + g, G - 1)];
    }
}

__device__ __forceinline__ u8 byte_of(const u32* w, int i) { return (w[i >> 2] >> (8 * (i & 3))) & 0xFF; }

// ------------------------------------------------------------------ Q4_K, Q5_K
// HB = false: Q4_K, planes qs (128 B), scales (12 B), dm;  HB = true: Q5_K, planes qs, qh (32 B:
// bit j of byte l = bit 4 of element l of sub-block j), scales, dm. Codes 0..15 / 0..31.
template <bool HB>
struct MmaK45 {
    static constexpr int QK = 256;                 // elements per weight block
    __device__ static int units(int G) { return G / 8; }   // a warp's step: one super-block
    struct W {                  // one super-block of rows gid (r = 0) and gid + 8 (r = 1)
        int2 q[4][2];           // bytes 32 p + 8 tid .. + 7 of quant pair p
        int2 qh[2];             // Q5_K: qh bytes 8 tid .. + 7
        u32 sc[2][3], dm[2];    // the 12 scale bytes, (d, dmin) f16 pair
    };
    __device__ static void load(const Planes& P, const size_t (&row)[2], int b, int, int tid,
                                W& w) {
        const u8* scales = HB ? P.p2 : P.p1;
        const u8* dms = HB ? P.p3 : P.p2;
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const size_t blk = row[r] + b;
#pragma unroll
            for (int p = 0; p < 4; p++)
                w.q[p][r] = *reinterpret_cast<const int2*>(P.p0 + blk * 128 + 32 * p + 8 * tid);
            w.qh[r] = HB ? *reinterpret_cast<const int2*>(P.p1 + blk * 32 + 8 * tid)
                         : make_int2(0, 0);
#pragma unroll
            for (int i = 0; i < 3; i++) w.sc[r][i] = reinterpret_cast<const u32*>(scales + blk * 12)[i];
            w.dm[r] = *reinterpret_cast<const u32*>(dms + blk * 4);
        }
    }
    // the lane's codes of sub-block j from its quant word and high-bit word
    __device__ static int code(int q, int qh, int j) {
        const int lo = (q >> (4 * (j & 1))) & 0x0F0F0F0F;
        return HB ? lo | (((qh >> j) & 0x01010101) << 4) : lo;
    }
    template <int M, int NT, class C>
    __device__ static void mma(const W (&w)[M], int b, int, int tid, const C& cols,
                               float (&acc)[M][NT][4]) {
#pragma unroll
        for (int j = 0; j < 8; j++) {           // sub-block j: nibbles (j & 1) of pair j / 2
            const int grp = 8 * b + j, p = j >> 1;
            int a[M][4];
            float ds[M][2], dm[M][2];
#pragma unroll
            for (int m = 0; m < M; m++) {
                const int2 q0 = w[m].q[p][0], q1 = w[m].q[p][1];
                const int2 h0 = w[m].qh[0], h1 = w[m].qh[1];
                a[m][0] = code(q0.x, h0.x, j); a[m][1] = code(q1.x, h1.x, j);
                a[m][2] = code(q0.y, h0.y, j); a[m][3] = code(q1.y, h1.y, j);
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    int sc, mn;
                    u8 q[12];
#pragma unroll
                    for (int i = 0; i < 12; i++) q[i] = byte_of(w[m].sc[r], i);
                    k_scale_min(q, j, sc, mn);
                    ds[m][r] = __fmul_rn(h2f(w[m].dm[r] & 0xFFFF), (float)sc);
                    dm[m][r] = __fmul_rn(h2f(w[m].dm[r] >> 16), (float)mn);
                }
            }
#pragma unroll
            for (int t = 0; t < NT; t++) {
                const int2 v = *reinterpret_cast<const int2*>(cols.codes(t, grp) + 8 * tid);
                const float4 e4 = cols.scales(t, grp);
                const float2 e[2] = {make_float2(e4.x, e4.y), make_float2(e4.z, e4.w)};
#pragma unroll
                for (int m = 0; m < M; m++) {
                    int d[4];
                    mma_k32(d, a[m][0], a[m][1], a[m][2], a[m][3], v.x, v.y);
#pragma unroll
                    for (int i = 0; i < 4; i++) {   // da * (d*sc * s - dmin*m * sa)
                        const float2 s = e[i & 1];
                        const int r = i >> 1;
                        const float u = __fmaf_rn(ds[m][r], exact_f(d[i]),
                                                  -__fmul_rn(dm[m][r], s.y));
                        acc[m][t][i] = __fmaf_rn(s.x, u, acc[m][t][i]);
                    }
                }
            }
        }
    }
};
using MmaQ4K = MmaK45<false>;
using MmaQ5K = MmaK45<true>;

// ------------------------------------------------------------------ Q6_K
struct MmaQ6K {
    static constexpr int QK = 256;
    __device__ static int units(int G) { return G / 8; }
    struct W {                   // one super-block of rows gid (r = 0) and gid + 8 (r = 1)
        u32 ql[2][2][2][2];      // [half h][16-half e][u][r]: ql bytes 64h + 32u + 16e + 4tid ..
        u32 qh[2][2][2];         // [h][e][r]: qh bytes 32h + 16e + 4tid ..
        u32 sc[2][4];            // the 16 signed scale bytes
        u16 d[2];
    };
    __device__ static void load(const Planes& P, const size_t (&row)[2], int b, int, int tid,
                                W& w) {
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const size_t blk = row[r] + b;
#pragma unroll
            for (int h = 0; h < 2; h++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const size_t o = 16 * e + 4 * tid;
#pragma unroll
                    for (int u = 0; u < 2; u++)
                        w.ql[h][e][u][r] = *reinterpret_cast<const u32*>(
                            P.p0 + blk * 128 + 64 * h + 32 * u + o);
                    w.qh[h][e][r] = *reinterpret_cast<const u32*>(P.p1 + blk * 64 + 32 * h + o);
                }
#pragma unroll
            for (int i = 0; i < 4; i++) w.sc[r][i] = reinterpret_cast<const u32*>(P.p2 + blk * 16)[i];
            w.d[r] = *reinterpret_cast<const u16*>(P.p3 + blk * 2);
        }
    }
    // codes - 32 of sub-block 4h + s (s = 0..3) for the 4 bytes of ql word pair / qh word
    __device__ static int codes(const u32 (&ql)[2], u32 qh, int s) {
        const int c = (int)(((ql[s & 1] >> (s >= 2 ? 4 : 0)) & 0x0F0F0F0Fu)
                            | (((qh >> (2 * s)) & 0x03030303u) << 4));
        return __vsub4(c, 0x20202020);
    }
    template <int M, int NT, class C>
    __device__ static void mma(const W (&w)[M], int b, int, int tid, const C& cols,
                               float (&acc)[M][NT][4]) {
#pragma unroll
        for (int j = 0; j < 8; j++) {           // sub-block j = 4 h + s
            const int grp = 8 * b + j, h = j >> 2, s = j & 3;
            int a[M][2][2];                 // [m][half][r]
            int sc[M][2][2];                // [m][r][half]
            float dr[M][2];
#pragma unroll
            for (int m = 0; m < M; m++) {
#pragma unroll
                for (int half = 0; half < 2; half++)
#pragma unroll
                    for (int r = 0; r < 2; r++) {
                        const u32 ql[2] = {w[m].ql[h][half][0][r], w[m].ql[h][half][1][r]};
                        a[m][half][r] = codes(ql, w[m].qh[h][half][r], s);
                        sc[m][r][half] = (signed char)byte_of(w[m].sc[r], 8 * h + 2 * s + half);
                    }
                dr[m][0] = h2f(w[m].d[0]); dr[m][1] = h2f(w[m].d[1]);
            }
#pragma unroll
            for (int t = 0; t < NT; t++) {
                const signed char* pa = cols.codes(t, grp) + 4 * tid;
                const int b0 = *reinterpret_cast<const int*>(pa);
                const int b1 = *reinterpret_cast<const int*>(pa + 16);
                const float4 e4 = cols.scales(t, grp);
                const float da[2] = {e4.x, e4.z};
#pragma unroll
                for (int m = 0; m < M; m++) {
                    int d[2][4];
                    mma_k16(d[0], a[m][0][0], a[m][0][1], b0);
                    mma_k16(d[1], a[m][1][0], a[m][1][1], b1);
#pragma unroll
                    for (int i = 0; i < 4; i++) {   // d * da * (sc0 * s0 + sc1 * s1), exact ints
                        const int r = i >> 1;
                        const int is = sc[m][r][0] * d[0][i] + sc[m][r][1] * d[1][i];
                        acc[m][t][i] = __fmaf_rn(__fmul_rn(dr[m][r], da[i & 1]),
                                                 __int2float_rn(is), acc[m][t][i]);
                    }
                }
            }
        }
    }
};

// ------------------------------------------------------------------ Q8_0, Q4_0, Q4_1, Q5_0, Q5_1
// 32-element blocks; per block the lane's 8 codes (elements 8 tid .. 8 tid + 7, for the MMA's
// k permutation) as two words, the scale d and, for the types with a min (w = d * q + m), m:
//   Q8_0  codes int8                       planes qs (32 B), d
//   Q4_0  codes q - 8                      planes qs (16 B: element j low nibble of byte j,
//                                          j + 16 its high nibble), d
//   Q4_1  codes q (0..15), min m           planes qs, (d, m)
//   Q5_0  codes q - 16 (bit 4 from qh)     planes qs, qh (u32: bit j = bit 4 of element j), d
//   Q5_1  codes q (0..31), min m           planes qs, qh, (d, m)
// so that d * da * s (+ m * da * sa) is the group's product, s the exact integer dot product.
__device__ __forceinline__ int2 nibbles8(const u8* qs, int tid) {
    const int2 v = *reinterpret_cast<const int2*>(qs + 8 * (tid & 1));   // tid 0, 1: low nibbles
    const int sh = 4 * (tid >> 1);                                        // tid 2, 3: high
    return make_int2((v.x >> sh) & 0x0F0F0F0F, (v.y >> sh) & 0x0F0F0F0F);
}
__device__ __forceinline__ int2 high8(const u8* qh, int tid) {          // bit 4 of the 8 codes
    const u32 h = *reinterpret_cast<const u32*>(qh);
    return make_int2(spread4(h >> (8 * tid)), spread4(h >> (8 * tid + 4)));
}
__device__ __forceinline__ int2 minus(int2 c, int z) { return make_int2(__vsub4(c.x, z), __vsub4(c.y, z)); }
__device__ __forceinline__ int2 with_high(int2 c, int2 h) { return make_int2(c.x | h.x, c.y | h.y); }

struct BlkQ8_0 {
    static constexpr bool MIN = false;
    __device__ static int2 codes(const Planes& P, size_t blk, int tid) {
        return *reinterpret_cast<const int2*>(P.p0 + blk * 32 + 8 * tid);
    }
    __device__ static float2 dm(const Planes& P, size_t blk) { return make_float2(h2f(ld_u16(P.p1 + blk * 2)), 0.0f); }
};
struct BlkQ4_0 {
    static constexpr bool MIN = false;
    __device__ static int2 codes(const Planes& P, size_t blk, int tid) {
        return minus(nibbles8(P.p0 + blk * 16, tid), 0x08080808);
    }
    __device__ static float2 dm(const Planes& P, size_t blk) { return make_float2(h2f(ld_u16(P.p1 + blk * 2)), 0.0f); }
};
struct BlkQ4_1 {
    static constexpr bool MIN = true;
    __device__ static int2 codes(const Planes& P, size_t blk, int tid) {
        return nibbles8(P.p0 + blk * 16, tid);
    }
    __device__ static float2 dm(const Planes& P, size_t blk) {
        return make_float2(h2f(ld_u16(P.p1 + blk * 4)), h2f(ld_u16(P.p1 + blk * 4 + 2)));
    }
};
struct BlkQ5_0 {
    static constexpr bool MIN = false;
    __device__ static int2 codes(const Planes& P, size_t blk, int tid) {
        return minus(with_high(nibbles8(P.p0 + blk * 16, tid), high8(P.p1 + blk * 4, tid)),
                     0x10101010);
    }
    __device__ static float2 dm(const Planes& P, size_t blk) { return make_float2(h2f(ld_u16(P.p2 + blk * 2)), 0.0f); }
};
struct BlkQ5_1 {
    static constexpr bool MIN = true;
    __device__ static int2 codes(const Planes& P, size_t blk, int tid) {
        return with_high(nibbles8(P.p0 + blk * 16, tid), high8(P.p1 + blk * 4, tid));
    }
    __device__ static float2 dm(const Planes& P, size_t blk) {
        return make_float2(h2f(ld_u16(P.p2 + blk * 4)), h2f(ld_u16(P.p2 + blk * 4 + 2)));
    }
};

// A warp's step is U consecutive blocks of a row (loads in flight), the last step of a row
// guarded (K / 32 need not be a multiple of U).
template <int U, class B>
struct Mma32 {
    static constexpr int QK = 32;
    __device__ static int units(int G) { return (G + U - 1) / U; }
    struct W {                 // U blocks of rows gid (r = 0) and gid + 8 (r = 1)
        int2 q[U][2];          // the lane's 8 codes
        float2 dm[U][2];       // (d, m), m = 0 without a min
    };
    __device__ static void load(const Planes& P, const size_t (&row)[2], int b, int G, int tid,
                                W& w) {
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int g = b * U + u;
#pragma unroll
            for (int r = 0; r < 2; r++) {
                if (g < G) {
                    const size_t blk = row[r] + g;
                    w.q[u][r] = B::codes(P, blk, tid);
                    w.dm[u][r] = B::dm(P, blk);
                } else {
                    w.q[u][r] = make_int2(0, 0);
                    w.dm[u][r] = make_float2(0.0f, 0.0f);
                }
            }
        }
    }
    template <int M, int NT, class C>
    __device__ static void mma(const W (&w)[M], int b, int G, int tid, const C& cols,
                               float (&acc)[M][NT][4]) {
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int grp = b * U + u;
            if (grp >= G) break;                // warp-uniform: the row's last step
#pragma unroll
            for (int t = 0; t < NT; t++) {
                const int2 v = *reinterpret_cast<const int2*>(cols.codes(t, grp) + 8 * tid);
                const float4 e4 = cols.scales(t, grp);
                const float2 e[2] = {make_float2(e4.x, e4.y), make_float2(e4.z, e4.w)};
#pragma unroll
                for (int m = 0; m < M; m++) {
                    int d[4];
                    mma_k32(d, w[m].q[u][0].x, w[m].q[u][1].x, w[m].q[u][0].y, w[m].q[u][1].y,
                            v.x, v.y);
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        const float2 ws = w[m].dm[u][i >> 1], s = e[i & 1];
                        if (B::MIN)             // da * (d * s + m * sa)
                            acc[m][t][i] = __fmaf_rn(s.x, __fmaf_rn(ws.x, exact_f(d[i]),
                                                                    __fmul_rn(ws.y, s.y)),
                                                     acc[m][t][i]);
                        else                    // (d * da) * s
                            acc[m][t][i] = __fmaf_rn(__fmul_rn(ws.x, s.x), exact_f(d[i]),
                                                     acc[m][t][i]);
                    }
                }
            }
        }
    }
};
// MMA_U32 (-D define, kernels.py): 32-element blocks per unit of a warp's split-K (and of c1)
#if !defined(MMA_U32)
#error "compile with the shared -D defines (service/backends/cuda/sources.py OPTIONS)"
#endif
using MmaQ8_0 = Mma32<MMA_U32, BlkQ8_0>;
using MmaQ4_0 = Mma32<MMA_U32, BlkQ4_0>;
using MmaQ4_1 = Mma32<MMA_U32, BlkQ4_1>;
using MmaQ5_0 = Mma32<MMA_U32, BlkQ5_0>;
using MmaQ5_1 = Mma32<MMA_U32, BlkQ5_1>;

template <class T, int M, int NT>
__device__ __forceinline__ void gemv_mma(Planes P, int K, int N, const signed char* __restrict__ qa,
                                         const float2* __restrict__ ads, int n_cols,
                                         float* __restrict__ out, int ldo, int accumulate) {
    constexpr int RNT = NT < 2 ? NT : 2;          // n-tiles per round of the block's reduction
    __shared__ float red[MMA_WARPS][M * RNT * 4][WARP];
    PDL_ENTRY();
    const int lane = threadIdx.x, warp = threadIdx.y, gid = lane >> 2, tid = lane & 3;
    const int n0 = blockIdx.x * 16 * M, c0 = blockIdx.y * 8 * NT;
    const int G = K / 32, bpr = K / T::QK, units = T::units(G);
    size_t row[M][2];                          // clamped row * blocks per row
#pragma unroll
    for (int m = 0; m < M; m++)
#pragma unroll
        for (int r = 0; r < 2; r++) row[m][r] = (size_t)min(n0 + 16 * m + 8 * r + gid, N - 1) * bpr;
    // Scales staged a unit at a time where it measured faster (the K-quants, 64-column tiles)
    constexpr bool STAGED = T::QK == 256 || NT == 8;
    constexpr int UG = T::QK == 256 ? 8 : MMA_U32, SP = 8 * NT + 2;
    __shared__ __align__(16) float2 stage[STAGED ? MMA_WARPS : 1][STAGED ? UG * SP : 2];
    MmaCols<STAGED> cols{qa, STAGED ? stage[warp] : ads, K, G, c0 + gid, c0 + 2 * tid, tid, 0, SP,
                         n_cols - 1};
    float acc[M][NT][4];
#pragma unroll
    for (int m = 0; m < M; m++)
#pragma unroll
        for (int t = 0; t < NT; t++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[m][t][i] = 0.0f;
    for (int b = warp; b < units; b += MMA_WARPS) {
        typename T::W w[M];                   // every m-tile's weights before any MMA
#pragma unroll
        for (int m = 0; m < M; m++) T::load(P, row[m], b, G, tid, w[m]);
        if (STAGED) {
            cols.g0 = UG * b;
            __syncwarp();                     // the last unit's scales are read
            stage_scales<UG, 8 * NT>(stage[warp], ads, G, cols.g0, c0, n_cols - 1, lane);
            __syncwarp();
        }
        T::template mma<M, NT>(w, b, G, tid, cols, acc);
    }
    // The warps' partials meet in shared memory, RNT n-tiles a round; thread (lane, warp) adds
    // those of fragment slots v = warp, warp + MMA_WARPS, ... in warp order.
#pragma unroll
    for (int t0 = 0; t0 < NT; t0 += RNT) {
#pragma unroll
        for (int m = 0; m < M; m++)
#pragma unroll
            for (int t = 0; t < RNT; t++)
#pragma unroll
                for (int i = 0; i < 4; i++) red[warp][(m * RNT + t) * 4 + i][lane] = acc[m][t0 + t][i];
        __syncthreads();
        for (int v = warp; v < M * RNT * 4; v += MMA_WARPS) {
            float s = 0.0f;
#pragma unroll
            for (int w = 0; w < MMA_WARPS; w++) s = __fadd_rn(s, red[w][v][lane]);
            const int m = v / (RNT * 4), t = t0 + (v / 4) % RNT, i = v % 4;
            const int n = n0 + 16 * m + gid + 8 * (i >> 1), c = c0 + 8 * t + 2 * tid + (i & 1);
            if (n < N && c < n_cols) {
                float* o = out + (size_t)c * ldo + n;
                *o = accumulate ? __fadd_rn(*o, s) : s;
            }
        }
        __syncthreads();
    }
}

// Launch bounds: 256 threads, the registers left to ptxas (it keeps the narrow tiles at <= 128,
// two blocks an SM); Q5_K asks for one block an SM, as at 128 its 8-column tile spills.
#define MMA_BOUNDS __launch_bounds__(32 * MMA_WARPS)
#define MMA_BOUNDS_1 __launch_bounds__(32 * MMA_WARPS, 1)
#define GEMV_MMA_KERNEL(name, T, NC, BOUNDS)                                                \
    extern "C" __global__ void BOUNDS                                                       \
    gemv_mma_##name##_c##NC(const u8* p0, const u8* p1, const u8* p2, const u8* p3, int K,  \
                            int N, const signed char* qa, const float2* ads, int n_cols,    \
                            float* out, int ldo, int accumulate) {                          \
        gemv_mma<T, MMA_M_C##NC, NC / 8>(Planes{p0, p1, p2, p3}, K, N, qa, ads, n_cols, out, \
                                         ldo, accumulate);                                  \
    }
#define GEMV_MMA_KERNELS(name, T, BOUNDS)                                                   \
    GEMV_MMA_KERNEL(name, T, 8, BOUNDS) GEMV_MMA_KERNEL(name, T, 16, BOUNDS)                \
    GEMV_MMA_KERNEL(name, T, 32, BOUNDS) GEMV_MMA_KERNEL(name, T, 64, BOUNDS)
GEMV_MMA_KERNELS(q4_k, MmaQ4K, MMA_BOUNDS)
GEMV_MMA_KERNELS(q5_k, MmaQ5K, MMA_BOUNDS_1)
GEMV_MMA_KERNELS(q6_k, MmaQ6K, MMA_BOUNDS)
GEMV_MMA_KERNELS(q8_0, MmaQ8_0, MMA_BOUNDS)
GEMV_MMA_KERNELS(q4_0, MmaQ4_0, MMA_BOUNDS)
// Q4_1's 64-column tile spills at the 128 registers ptxas picks for two blocks an SM
GEMV_MMA_KERNEL(q4_1, MmaQ4_1, 8, MMA_BOUNDS) GEMV_MMA_KERNEL(q4_1, MmaQ4_1, 16, MMA_BOUNDS)
GEMV_MMA_KERNEL(q4_1, MmaQ4_1, 32, MMA_BOUNDS) GEMV_MMA_KERNEL(q4_1, MmaQ4_1, 64, MMA_BOUNDS_1)
GEMV_MMA_KERNELS(q5_0, MmaQ5_0, MMA_BOUNDS)
GEMV_MMA_KERNELS(q5_1, MmaQ5_1, MMA_BOUNDS)

// ------------------------------------------------------------------ one column: gemv_mma_<type>_c1
// A tile's accumulator for (row n, column c) is, per warp w (units b = w, w + MMA_WARPS, ...)
// and per group of each unit in order, acc_w = __fmaf_rn(p, q, acc_w) with (p, q) a function
// of the group alone (below); then out = (((0 + acc_0) + acc_1) + ...) + acc_{MMA_WARPS-1}.
// The one-column kernel computes the same (p, q) from dp4a integer dot products (the group's
// integer sum is exact either way) and applies them in the same order, so one column gets the
// tiles' bits while reading its weights as the dp4a GEMV does (no 8-column MMA fragments of
// which 7 are padding). Per group, s = sum_k code_k a_k (codes as the tiles' fragments hold
// them) and (da, sa) the column's block:
//   Q4_K, Q5_K   p = da,           q = fma(d*sc, s, -(dmin*m * sa))
//   Q6_K         p = d * da,       q = float(sc0 s_0 + sc1 s_1)      (16-element halves)
//   Q8_0, Q4_0, Q5_0  p = d * da,  q = s                              (codes q - 8, q - 16)
//   Q4_1, Q5_1   p = da,           q = fma(d, s, m * sa)
// Launch (gemv_mma_<type>_c1[p]): block (32, GEMV_WARPS), grid ceil(N / GEMV_WARPS); warp w of
// block b owns row n = GEMV_WARPS b + w. A round of the warp covers 32 consecutive groups, lane
// l group g0 + l (as gemv.cu's one-column loop); units are UG consecutive groups (UG = 8 for the
// K-quants' super-blocks, MMA_U32 blocks for the 32-element types), unit u belongs to the warp
// slot u mod MMA_WARPS of the tiles. Each lane leaves its (p, q) in the warp's shared chunk of
// MMA_ONE_CHUNK groups with no barrier between rounds (loads of later rounds overlap earlier
// dots); at the end of a chunk lane s < MMA_WARPS adds, in order, the terms of slot s's units in
// the chunk to its register accumulator (the tiles' per-warp chain), and the slots meet in slot
// order by shuffles. The p variant (Q4_K, Q6_K: kernels.GEMV_PREFETCH_TYPES) loads the next
// round's weights and activations before this round's dots.
template <class QT>
struct C1K45 {                  // Q4_K, Q5_K: w = d*sc * q - dmin*m
    using Q = QT;
    static constexpr int UG = 8;
    __device__ static float2 term(const typename Q::G& g, const int* a, float2 e) {
        return make_float2(e.x, __fmaf_rn(g.ds, exact_f(dp8(g.c, a)), -__fmul_rn(g.dm, e.y)));
    }
};
using C1Q4K = C1K45<Q4_K>;
using C1Q5K = C1K45<Q5_K>;
struct C1Q6K {
    using Q = Q6_K;
    static constexpr int UG = 8;
    __device__ static float2 term(const Q::G& g, const int* a, float2 e) {
        int s0 = 0, s1 = 0;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            s0 = __dp4a(g.c[i], a[i], s0);
            s1 = __dp4a(g.c[i + 4], a[i + 4], s1);
        }
        return make_float2(__fmul_rn(g.d, e.x), __int2float_rn(g.sc0 * s0 + g.sc1 * s1));
    }
};
// codes minus z in every byte (the tiles' signed codes of Q4_0 / Q5_0), dotted with a
__device__ __forceinline__ int dp8_minus(const int c[8], int z, const int a[8]) {
    int s = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) s = __dp4a((int)__vsub4(c[i], z), a[i], s);
    return s;
}
struct C1Q8_0 {
    using Q = Q8_0;
    static constexpr int UG = MMA_U32;
    __device__ static float2 term(const Q::G& g, const int* a, float2 e) {
        return make_float2(__fmul_rn(g.d, e.x), exact_f(dp8(g.c, a)));
    }
};
struct C1Q4_0 {
    using Q = Q4_0;
    static constexpr int UG = MMA_U32;
    __device__ static float2 term(const Q::G& g, const int* a, float2 e) {
        return make_float2(__fmul_rn(g.d, e.x), exact_f(dp8_minus(g.c, 0x08080808, a)));
    }
};
struct C1Q5_0 {
    using Q = Q5_0;
    static constexpr int UG = MMA_U32;
    __device__ static float2 term(const Q::G& g, const int* a, float2 e) {
        return make_float2(__fmul_rn(g.d, e.x), exact_f(dp8_minus(g.c, 0x10101010, a)));
    }
};
template <class QT>
struct C1Min {                  // Q4_1, Q5_1: w = d * q + m
    using Q = QT;
    static constexpr int UG = MMA_U32;
    __device__ static float2 term(const typename Q::G& g, const int* a, float2 e) {
        return make_float2(e.x, __fmaf_rn(g.d, exact_f(dp8(g.c, a)), __fmul_rn(g.m, e.y)));
    }
};
using C1Q4_1 = C1Min<Q4_1>;
using C1Q5_1 = C1Min<Q5_1>;

#if !defined(GEMV_WARPS)
#error "compile with the shared -D defines (service/backends/cuda/sources.py OPTIONS)"
#endif

constexpr int MMA_ONE_CHUNK = 256;     // groups per shared chunk of the one-column kernel

// One lane's walk over the weight groups of one row, one group per round (group g, then
// g + step, ...): the activation group's 32 bytes and (d, sum), the weight group, and its
// term C::term. PF: the next round's loads are issued before this round's dot. Groups past G
// give the term (0, -0): fma(0, -0, acc) is acc exactly, so slot chains run over whole units
// unchecked. Used by both one-column kernels (c1[p] and c1s[p]).
template <class C, bool PF>
struct GroupWalk {
    using Q = typename C::Q;
    static constexpr int SUB = Q::QK / 32;
    typename Q::G w;
    int a[8];
    float2 e;

    __device__ __forceinline__ void load(Planes P, const u8* ap, const float2* __restrict__ ads,
                                         size_t rb, int g) {
        ld16(ap + 32 * g, a);
        ld16(ap + 32 * g + 16, a + 4);
        e = ads[g];
        Q::load(P, rb + g / SUB, g % SUB, w);
    }
    // before the first round (PF): group g's loads
    __device__ __forceinline__ void start(Planes P, const u8* ap, const float2* ads, size_t rb,
                                          int g, int G) {
        if (PF && g < G) load(P, ap, ads, rb, g);
    }
    // group g's term; PF: group g + step's loads go out first
    __device__ __forceinline__ float2 term(Planes P, const u8* ap, const float2* ads, size_t rb,
                                           int g, int step, int G) {
        float2 t = make_float2(0.0f, -0.0f);
        if constexpr (PF) {
            GroupWalk nx;
            if (g + step < G) nx.load(P, ap, ads, rb, g + step);
            if (g < G) t = C::term(w, a, e);
            w = nx.w;
            e = nx.e;
#pragma unroll
            for (int i = 0; i < 8; i++) a[i] = nx.a[i];
        } else if (g < G) {
            load(P, ap, ads, rb, g);
            t = C::term(w, a, e);
        }
        return t;
    }
};

// PF: round r + 1's loads are issued before round r's dot (GroupWalk).
template <class C, bool PF>
__device__ __forceinline__ void gemv_mma_one(Planes P, int K, int N, const signed char* __restrict__ qa,
                                             const float2* __restrict__ ads,
                                             float* __restrict__ out, int accumulate) {
    using Q = typename C::Q;
    constexpr int UG = C::UG, CH = MMA_ONE_CHUNK;
    static_assert(CH % WARP == 0 && CH % UG == 0 && UG % 2 == 0 && MMA_WARPS <= WARP,
                  "whole units per chunk");
    __shared__ __align__(16) float2 terms[GEMV_WARPS][CH];
    PDL_ENTRY();
    const int lane = threadIdx.x, n = blockIdx.x * GEMV_WARPS + threadIdx.y;
    if (n >= N) return;
    const int G = K / 32;
    const size_t rb = (size_t)n * (K / Q::QK);
    const u8* ap = reinterpret_cast<const u8*>(qa);
    float2* tw = terms[threadIdx.y];
    float acc = 0.0f;           // lane s < MMA_WARPS: the running sum of warp slot s
    GroupWalk<C, PF> walk;
    walk.start(P, ap, ads, rb, lane, G);
    for (int c0 = 0; c0 < G; c0 += CH) {
        const int c1 = min(G, c0 + CH);
        for (int g0 = c0; g0 < c1; g0 += WARP) {
            const int g = g0 + lane;
            tw[g - c0] = walk.term(P, ap, ads, rb, g, WARP, G);
        }
        __syncwarp();
        if (lane < MMA_WARPS) {
            // the chunk's units u0 .. u1 - 1; slot lane's first is u0 + ((lane - u0) mod
            // MMA_WARPS); a unit's terms are read as float4 pairs, then added in order
            const int u0 = c0 / UG, u1 = (c1 + UG - 1) / UG;
            for (int u = u0 + (lane - u0 % MMA_WARPS + MMA_WARPS) % MMA_WARPS; u < u1;
                 u += MMA_WARPS) {
                const float4* tu = reinterpret_cast<const float4*>(tw + (u * UG - c0));
                float4 v[UG / 2];
#pragma unroll
                for (int j = 0; j < UG / 2; j++) v[j] = tu[j];
#pragma unroll
                for (int j = 0; j < UG / 2; j++) {
                    acc = __fmaf_rn(v[j].x, v[j].y, acc);
                    acc = __fmaf_rn(v[j].z, v[j].w, acc);
                }
            }
        }
        __syncwarp();
    }
    float s = 0.0f;
#pragma unroll
    for (int slot = 0; slot < MMA_WARPS; slot++)
        s = __fadd_rn(s, __shfl_sync(0xFFFFFFFFu, acc, slot));
    if (lane == 0) out[n] = accumulate ? __fadd_rn(out[n], s) : s;
}

// the tiles' parameter list; n_cols and ldo are those of one column (1, any)
#define GEMV_MMA_ONE(name, C, V, PF)                                                        \
    extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS)                           \
    gemv_mma_##name##_c1##V(const u8* p0, const u8* p1, const u8* p2, const u8* p3, int K,  \
                            int N, const signed char* qa, const float2* ads, int n_cols,    \
                            float* out, int ldo, int accumulate) {                          \
        gemv_mma_one<C, PF>(Planes{p0, p1, p2, p3}, K, N, qa, ads, out, accumulate);        \
    }
// ------------------------------------------------------------------ one column split over K: _c1s[p]
// The tiles' decomposition with dp4a dot products instead of MMAs, so each slot's chain lives in
// one lane's register: warp w of a block takes the units u = w, w + MMA_WARPS, ... (the tile's
// warp slot w) of the block's RW = 32 / UG rows; lane (r, j) = (lane / UG, lane % UG) computes
// the term (p, q) of group j of unit u of row n0 + r (C::term, as the kernels above); the UG
// terms of a row's unit meet in the warp's shared slice (two slices alternating, one
// __syncwarp a unit) and lane (r, 0) adds them to its accumulator in order, acc = fma(p, q,
// acc): the tile's per-warp chain. The slots then meet in shared memory, added in warp order
// by lane r of warp 0: out[n0 + r] = (((0 + acc_0) + acc_1) + ...) + acc_{MMA_WARPS-1}, the
// tiles' bits. A warp's 8 lanes of a row read the unit's 128 contiguous weight bytes (Q4_K) and
// its rows share each activation load; there are MMA_WARPS times more warps than rows / RW, so
// a short matrix still fills the SMs. The p variant loads the warp's next unit before this
// unit's dots.
// Launch (gemv_mma_<type>_c1s[p]): block (32, MMA_WARPS), grid ceil(N / RW), RW = 32 / UG, or
// fewer blocks (each then takes row groups blockIdx.x, + gridDim.x, ...); shared MMA_WARPS x 2
// x 32 float2 (4 KiB) + MMA_WARPS x RW floats. Rows >= N read row N - 1 and are not written.
template <class C, bool PF>
__device__ __forceinline__ void gemv_mma_split_rows(Planes P, int K, int N,
                                               const signed char* __restrict__ qa,
                                               const float2* __restrict__ ads,
                                               float* __restrict__ out, int accumulate) {
    using Q = typename C::Q;
    constexpr int UG = C::UG, RW = WARP / UG;
    static_assert(WARP % UG == 0 && UG % 2 == 0, "whole rows per warp, float4 term pairs");
    __shared__ __align__(16) float2 terms[MMA_WARPS][2][WARP];
    __shared__ float slots[MMA_WARPS][RW];
    const int lane = threadIdx.x, warp = threadIdx.y, r = lane / UG, j = lane % UG;
    const int G = K / 32, units = (G + UG - 1) / UG;
    const u8* ap = reinterpret_cast<const u8*>(qa);
    int buf = 0;
    // grid-stride over the row groups (a grid of fewer blocks than N / RW loops)
    for (int n0 = blockIdx.x * RW; n0 < N; n0 += gridDim.x * RW) {
        const size_t rb = (size_t)min(n0 + r, N - 1) * (K / Q::QK);
        float acc = 0.0f;       // lane (r, 0): the running sum of slot `warp` for row n0 + r
        GroupWalk<C, PF> walk;
        walk.start(P, ap, ads, rb, warp * UG + j, G);
        for (int u = warp; u < units; u += MMA_WARPS) {
            float2* tb = terms[warp][buf];
            tb[lane] = walk.term(P, ap, ads, rb, u * UG + j, MMA_WARPS * UG, G);
            __syncwarp();
            if (j == 0) {
                const float4* tu = reinterpret_cast<const float4*>(tb + r * UG);
                float4 v[UG / 2];
#pragma unroll
                for (int i = 0; i < UG / 2; i++) v[i] = tu[i];
#pragma unroll
                for (int i = 0; i < UG / 2; i++) {
                    acc = __fmaf_rn(v[i].x, v[i].y, acc);
                    acc = __fmaf_rn(v[i].z, v[i].w, acc);
                }
            }
            buf ^= 1;           // the next unit writes the other slice while this one is read
        }
        if (j == 0) slots[warp][r] = acc;
        __syncthreads();
        if (warp == 0 && lane < RW && n0 + lane < N) {
            float s = 0.0f;
#pragma unroll
            for (int v = 0; v < MMA_WARPS; v++) s = __fadd_rn(s, slots[v][lane]);
            float* o = out + n0 + lane;
            *o = accumulate ? __fadd_rn(*o, s) : s;
        }
        __syncthreads();        // slots are read before the next row group writes them
    }
}
template <class C, bool PF>
__device__ __forceinline__ void gemv_mma_split(Planes P, int K, int N,
                                               const signed char* __restrict__ qa,
                                               const float2* __restrict__ ads,
                                               float* __restrict__ out, int accumulate) {
    PDL_ENTRY();
    gemv_mma_split_rows<C, PF>(P, K, N, qa, ads, out, accumulate);
}

#define GEMV_MMA_SPLIT(name, C)                                                             \
    extern "C" __global__ void __launch_bounds__(32 * MMA_WARPS)                            \
    gemv_mma_##name##_c1s(const u8* p0, const u8* p1, const u8* p2, const u8* p3, int K,    \
                          int N, const signed char* qa, const float2* ads, int n_cols,      \
                          float* out, int ldo, int accumulate) {                            \
        gemv_mma_split<C, false>(Planes{p0, p1, p2, p3}, K, N, qa, ads, out, accumulate);   \
    }                                                                                       \
    extern "C" __global__ void __launch_bounds__(32 * MMA_WARPS)                            \
    gemv_mma_##name##_c1sp(const u8* p0, const u8* p1, const u8* p2, const u8* p3, int K,   \
                           int N, const signed char* qa, const float2* ads, int n_cols,     \
                           float* out, int ldo, int accumulate) {                           \
        gemv_mma_split<C, true>(Planes{p0, p1, p2, p3}, K, N, qa, ads, out, accumulate);    \
    }

// gemv_mma_<type>_c1[p]n: one column, residual add (out += W x), then the next RMSNorm, as
// gemv.cu's gemv_<type>_c1r1[p]n: the last block of the grid to finish (a counter, reset by
// that block) normalizes the whole output row into h with its 8-bit blocks (hqa, hads),
// exactly as rms_norm_quant (act_quant.cuh last_block_norm_quant). The same launch geometry.
template <class C, bool PF>
__device__ __forceinline__ void gemv_mma_norm(Planes P, int K, int N, const signed char* qa,
                                              const float2* ads, float* out, int* done,
                                              const float* nw, float eps, int B, float* h,
                                              signed char* hqa, float2* hads) {
    gemv_mma_one<C, PF>(P, K, N, qa, ads, out, 1);
    last_block_norm_quant(out, N, done, nw, eps, B, h, hqa, hads);
}
static_assert(GEMV_WARPS == 4, "the norm epilogue (norm_quant_row_128) takes (32, 4) blocks");
#define GEMV_MMA_NORM(name, C, V, PF)                                                       \
    extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS)                           \
    gemv_mma_##name##_c1##V##n(const u8* p0, const u8* p1, const u8* p2, const u8* p3,      \
                               int K, int N, const signed char* qa, const float2* ads,      \
                               float* out, int* done, const float* nw, float eps, int B,    \
                               float* h, signed char* hqa, float2* hads) {                  \
        gemv_mma_norm<C, PF>(Planes{p0, p1, p2, p3}, K, N, qa, ads,  \
                                                   out, done, nw, eps, B, h, hqa, hads);    \
    }
// c1p for the types whose dp4a one-column GEMV prefetches (kernels.GEMV_PREFETCH_TYPES)
#define GEMV_MMA_ONES(name, C) GEMV_MMA_ONE(name, C, , false) GEMV_MMA_ONE(name, C, p, true) \
    GEMV_MMA_NORM(name, C, , false) GEMV_MMA_NORM(name, C, p, true)
#define GEMV_MMA_ONE_N(name, C) GEMV_MMA_ONE(name, C, , false) GEMV_MMA_NORM(name, C, , false)
GEMV_MMA_ONES(q4_k, C1Q4K)
GEMV_MMA_ONES(q6_k, C1Q6K)
GEMV_MMA_ONE_N(q5_k, C1Q5K)
GEMV_MMA_ONE_N(q8_0, C1Q8_0)
GEMV_MMA_ONE_N(q4_0, C1Q4_0)
GEMV_MMA_ONE_N(q4_1, C1Q4_1)
GEMV_MMA_ONE_N(q5_0, C1Q5_0)
GEMV_MMA_ONE_N(q5_1, C1Q5_1)
GEMV_MMA_SPLIT(q4_k, C1Q4K)
GEMV_MMA_SPLIT(q6_k, C1Q6K)
GEMV_MMA_SPLIT(q5_k, C1Q5K)
GEMV_MMA_SPLIT(q8_0, C1Q8_0)
GEMV_MMA_SPLIT(q4_0, C1Q4_0)
GEMV_MMA_SPLIT(q4_1, C1Q4_1)
GEMV_MMA_SPLIT(q5_0, C1Q5_0)
GEMV_MMA_SPLIT(q5_1, C1Q5_1)
