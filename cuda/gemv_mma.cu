// gemv_mma.cu: out[c, n] (+)= sum_k W[n, k] x[c, k] for 2..16 columns c per block column, on
// int8 tensor cores (mma.sync, sm_80+) instead of gemv.cu's per-column dp4a.
//
// Inputs as gemv.cu's plain mode: W in planes (quant_types.cuh), x as 8-bit blocks: codes qa
// (C, K) int8, per 32-group (da, sa) with x[c, k] ~ da * qa[c, k], sa = sum of the group's
// codes. Per row n, column c and group j (s_j = the integer dot product of the group's weight
// codes with qa, from the MMA):
//   Q4_K  (codes 0..15, scale d*sc_j, min dmin*m_j):
//           da * (d*sc_j * s_j - dmin*m_j * sa)
//   Q6_K  (codes q - 32, 16-element halves with signed scales sc0, sc1):
//           d * da * (sc0 * s_j,0 + sc1 * s_j,1)          (the integer combination is exact)
// the same math as quant_types.cuh's dot(), not its rounding order: results differ from gemv.cu
// in the last bits and do not match across NC (CudaBackend(gemv_mma=True) opts in).
// accumulate = 1 adds the product to what out (C, ldo) f32 holds.
//
// Launch (gemv_mma_<type>_c<NC>, NC = 8 or 16): block (32, MMA_WARPS), grid
// (ceil(N / MMA_ROWS), ceil(C / NC)). A block owns MMA_ROWS = 16 * MMA_M rows (MMA_M m-tiles of
// 16) and NC columns (NT = NC / 8 n-tiles); its warp w takes super-blocks b = w, w + MMA_WARPS,
// ... of K (split-K inside the block: enough warps in flight for short matrices), loads their
// weights for all m-tiles first, then per group runs one MMA per (m-tile, n-tile) and scales
// the int32 results into float accumulators. The warps' partial sums meet in shared memory and
// are added in warp order (deterministic). Rows >= N and columns >= C read row N - 1 / column
// C - 1 (valid memory) and are not written.
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

// MMA_WARPS (8), MMA_M (2) and MMA_ROWS (16 * MMA_M) come as -D defines
// (service/backends/cuda/kernels.py).
#if !defined(MMA_WARPS) || !defined(MMA_M) || !defined(MMA_ROWS)
#error "compile with the shared -D defines (service/backends/cuda/sources.py OPTIONS)"
#endif
static_assert(MMA_ROWS == 16 * MMA_M, "a block's rows are MMA_M m-tiles of 16");

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

// Where a lane reads its columns: n-tile t's B column (gid) codes, and the (da, sa) rows of the
// two D columns it owns (2 tid, 2 tid + 1).
template <int NT>
struct MmaCols {
    const signed char* a[NT];
    const float2* s[NT][2];
};

__device__ __forceinline__ u8 byte_of(const u32* w, int i) { return (w[i >> 2] >> (8 * (i & 3))) & 0xFF; }

// ------------------------------------------------------------------ Q4_K
struct MmaQ4K {
    struct W {                  // one super-block of rows gid (r = 0) and gid + 8 (r = 1)
        int2 q[4][2];           // bytes 32 p + 8 tid .. + 7 of quant pair p
        u32 sc[2][3], dm[2];    // the 12 scale bytes, (d, dmin) f16 pair
    };
    __device__ static void load(const Planes& P, const size_t (&blk)[2], int tid, W& w) {
#pragma unroll
        for (int r = 0; r < 2; r++) {
#pragma unroll
            for (int p = 0; p < 4; p++)
                w.q[p][r] = *reinterpret_cast<const int2*>(P.p0 + blk[r] * 128 + 32 * p + 8 * tid);
#pragma unroll
            for (int i = 0; i < 3; i++) w.sc[r][i] = reinterpret_cast<const u32*>(P.p1 + blk[r] * 12)[i];
            w.dm[r] = *reinterpret_cast<const u32*>(P.p2 + blk[r] * 4);
        }
    }
    template <int NT>
    __device__ static void mma(const W (&w)[MMA_M], int b, int tid, const MmaCols<NT>& cols,
                               float (&acc)[MMA_M][NT][4]) {
#pragma unroll
        for (int j = 0; j < 8; j++) {           // sub-block j: nibbles (j & 1) of pair j / 2
            const int grp = 8 * b + j, p = j >> 1, sh = 4 * (j & 1);
            int bf[NT][2];
            float2 e[NT][2];
#pragma unroll
            for (int t = 0; t < NT; t++) {
                const int2 v = *reinterpret_cast<const int2*>(cols.a[t] + 32 * grp + 8 * tid);
                bf[t][0] = v.x; bf[t][1] = v.y;
                e[t][0] = cols.s[t][0][grp]; e[t][1] = cols.s[t][1][grp];
            }
#pragma unroll
            for (int m = 0; m < MMA_M; m++) {
                const int2 q0 = w[m].q[p][0], q1 = w[m].q[p][1];
                const int a0 = (q0.x >> sh) & 0x0F0F0F0F, a1 = (q1.x >> sh) & 0x0F0F0F0F;
                const int a2 = (q0.y >> sh) & 0x0F0F0F0F, a3 = (q1.y >> sh) & 0x0F0F0F0F;
                float ds[2], dm[2];
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    int sc, mn;
                    u8 q[12];
#pragma unroll
                    for (int i = 0; i < 12; i++) q[i] = byte_of(w[m].sc[r], i);
                    k_scale_min(q, j, sc, mn);
                    ds[r] = h2f(w[m].dm[r] & 0xFFFF) * (float)sc;
                    dm[r] = h2f(w[m].dm[r] >> 16) * (float)mn;
                }
#pragma unroll
                for (int t = 0; t < NT; t++) {
                    int d[4];
                    mma_k32(d, a0, a1, a2, a3, bf[t][0], bf[t][1]);
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        const float2 s = e[t][i & 1];
                        acc[m][t][i] += s.x * (ds[i >> 1] * (float)d[i] - dm[i >> 1] * s.y);
                    }
                }
            }
        }
    }
};

// ------------------------------------------------------------------ Q6_K
struct MmaQ6K {
    struct W {                   // one super-block of rows gid (r = 0) and gid + 8 (r = 1)
        u32 ql[2][2][2][2];      // [half h][16-half e][u][r]: ql bytes 64h + 32u + 16e + 4tid ..
        u32 qh[2][2][2];         // [h][e][r]: qh bytes 32h + 16e + 4tid ..
        u32 sc[2][4];            // the 16 signed scale bytes
        u16 d[2];
    };
    __device__ static void load(const Planes& P, const size_t (&blk)[2], int tid, W& w) {
#pragma unroll
        for (int r = 0; r < 2; r++) {
#pragma unroll
            for (int h = 0; h < 2; h++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const size_t o = 16 * e + 4 * tid;
#pragma unroll
                    for (int u = 0; u < 2; u++)
                        w.ql[h][e][u][r] = *reinterpret_cast<const u32*>(
                            P.p0 + blk[r] * 128 + 64 * h + 32 * u + o);
                    w.qh[h][e][r] = *reinterpret_cast<const u32*>(P.p1 + blk[r] * 64 + 32 * h + o);
                }
#pragma unroll
            for (int i = 0; i < 4; i++) w.sc[r][i] = reinterpret_cast<const u32*>(P.p2 + blk[r] * 16)[i];
            w.d[r] = *reinterpret_cast<const u16*>(P.p3 + blk[r] * 2);
        }
    }
    // codes - 32 of sub-block 4h + s (s = 0..3) for the 4 bytes of ql word pair / qh word
    __device__ static int codes(const u32 (&ql)[2], u32 qh, int s) {
        const int c = (int)(((ql[s & 1] >> (s >= 2 ? 4 : 0)) & 0x0F0F0F0Fu)
                            | (((qh >> (2 * s)) & 0x03030303u) << 4));
        return __vsub4(c, 0x20202020);
    }
    template <int NT>
    __device__ static void mma(const W (&w)[MMA_M], int b, int tid, const MmaCols<NT>& cols,
                               float (&acc)[MMA_M][NT][4]) {
#pragma unroll
        for (int j = 0; j < 8; j++) {           // sub-block j = 4 h + s
            const int grp = 8 * b + j, h = j >> 2, s = j & 3;
            int bf[NT][2];
            float2 e[NT][2];
#pragma unroll
            for (int t = 0; t < NT; t++) {
#pragma unroll
                for (int half = 0; half < 2; half++)
                    bf[t][half] = *reinterpret_cast<const int*>(cols.a[t] + 32 * grp + 16 * half
                                                                + 4 * tid);
                e[t][0] = cols.s[t][0][grp]; e[t][1] = cols.s[t][1][grp];
            }
#pragma unroll
            for (int m = 0; m < MMA_M; m++) {
                int a[2][2];                    // [half][r]
                int sc[2][2];                   // [r][half]
#pragma unroll
                for (int half = 0; half < 2; half++)
#pragma unroll
                    for (int r = 0; r < 2; r++) {
                        const u32 ql[2] = {w[m].ql[h][half][0][r], w[m].ql[h][half][1][r]};
                        a[half][r] = codes(ql, w[m].qh[h][half][r], s);
                        sc[r][half] = (signed char)byte_of(w[m].sc[r], 8 * h + 2 * s + half);
                    }
                const float d0 = h2f(w[m].d[0]), d1 = h2f(w[m].d[1]);
#pragma unroll
                for (int t = 0; t < NT; t++) {
                    int d[2][4];
                    mma_k16(d[0], a[0][0], a[0][1], bf[t][0]);
                    mma_k16(d[1], a[1][0], a[1][1], bf[t][1]);
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        const int r = i >> 1;
                        const int is = sc[r][0] * d[0][i] + sc[r][1] * d[1][i];
                        acc[m][t][i] += (r ? d1 : d0) * e[t][i & 1].x * (float)is;
                    }
                }
            }
        }
    }
};

template <class T, int NT>
__device__ __forceinline__ void gemv_mma(Planes P, int K, int N, const signed char* __restrict__ qa,
                                         const float2* __restrict__ ads, int n_cols,
                                         float* __restrict__ out, int ldo, int accumulate) {
    __shared__ float red[MMA_WARPS][MMA_M * NT * 4][WARP];
    PDL_ENTRY();
    const int lane = threadIdx.x, warp = threadIdx.y, gid = lane >> 2, tid = lane & 3;
    const int n0 = blockIdx.x * MMA_ROWS, c0 = blockIdx.y * 8 * NT;
    const int nb = K / 256, G = K / 32;
    size_t row[MMA_M][2];                          // clamped row * nb
#pragma unroll
    for (int m = 0; m < MMA_M; m++)
#pragma unroll
        for (int r = 0; r < 2; r++) row[m][r] = (size_t)min(n0 + 16 * m + 8 * r + gid, N - 1) * nb;
    MmaCols<NT> cols;
#pragma unroll
    for (int t = 0; t < NT; t++) {
        cols.a[t] = qa + (size_t)min(c0 + 8 * t + gid, n_cols - 1) * K;
#pragma unroll
        for (int i = 0; i < 2; i++)
            cols.s[t][i] = ads + (size_t)min(c0 + 8 * t + 2 * tid + i, n_cols - 1) * G;
    }
    float acc[MMA_M][NT][4];
#pragma unroll
    for (int m = 0; m < MMA_M; m++)
#pragma unroll
        for (int t = 0; t < NT; t++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[m][t][i] = 0.0f;
    for (int b = warp; b < nb; b += MMA_WARPS) {
        typename T::W w[MMA_M];                   // every m-tile's weights before any MMA
#pragma unroll
        for (int m = 0; m < MMA_M; m++) {
            const size_t blk[2] = {row[m][0] + b, row[m][1] + b};
            T::load(P, blk, tid, w[m]);
        }
        T::template mma<NT>(w, b, tid, cols, acc);
    }
#pragma unroll
    for (int m = 0; m < MMA_M; m++)
#pragma unroll
        for (int t = 0; t < NT; t++)
#pragma unroll
            for (int i = 0; i < 4; i++) red[warp][(m * NT + t) * 4 + i][lane] = acc[m][t][i];
    __syncthreads();
    // thread (lane, warp) adds the warps' partials of fragment slots v = warp, warp + MMA_WARPS..
    for (int v = warp; v < MMA_M * NT * 4; v += MMA_WARPS) {
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < MMA_WARPS; w++) s += red[w][v][lane];
        const int m = v / (NT * 4), t = (v / 4) % NT, i = v % 4;
        const int n = n0 + 16 * m + gid + 8 * (i >> 1), c = c0 + 8 * t + 2 * tid + (i & 1);
        if (n < N && c < n_cols) {
            float* o = out + (size_t)c * ldo + n;
            *o = accumulate ? __fadd_rn(*o, s) : s;
        }
    }
}

#define GEMV_MMA_KERNEL(name, T, NC)                                                        \
    extern "C" __global__ void __launch_bounds__(32 * MMA_WARPS)                            \
    gemv_mma_##name##_c##NC(const u8* p0, const u8* p1, const u8* p2, const u8* p3, int K,  \
                            int N, const signed char* qa, const float2* ads, int n_cols,    \
                            float* out, int ldo, int accumulate) {                          \
        gemv_mma<T, NC / 8>(Planes{p0, p1, p2, p3}, K, N, qa, ads, n_cols, out, ldo,        \
                            accumulate);                                                    \
    }
#define GEMV_MMA_KERNELS(name, T) GEMV_MMA_KERNEL(name, T, 8) GEMV_MMA_KERNEL(name, T, 16)
GEMV_MMA_KERNELS(q4_k, MmaQ4K)
GEMV_MMA_KERNELS(q6_k, MmaQ6K)
