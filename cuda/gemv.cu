// gemv.cu: out[c, n] (+)= sum_k W[row(c, n), k] * x[c, k] for up to NC columns c per block row.
//
// Quantized W (gemv_<type>_c<NC>r<R>): x arrives as 8-bit blocks (quantize.cu, or fused into
// the op that produced x): codes qa (C, K) int8 and per 32-group (da, sa) with
// x[c, k] ~ da * qa[c, k], sa = sum of the group's codes; each group's contribution is an
// integer dot product (quant_types.cuh) scaled once. Float W (gemv_<f32|f16|bf16>_c<NC>r<R>):
// x (C, K) f32 with row stride ldx, products summed in f32.
//
// Shapes: W has R_total rows of K (planes as in quant_types.cuh), N <= R_total output rows per
// column; out (C, ldo) f32, written at columns [0, N) of each of its rows. accumulate = 1 adds
// the product to what out holds (the residual add of an output projection, fused): exactly the
// rounding of a GEMV followed by add_rows.
// Two modes, one kernel:
//   plain     ids == nullptr: grid.y chunks of <= NC columns; column c reads x row c and
//             weight row n.
//   gathered  ids != nullptr (mixture of experts, NC = 1): grid.y = number of (token, expert)
//             pairs; pair p reads x row p / act_div and weight row ids[p] * rows_per_expert + n.
// Launch: block (32, GEMV_WARPS); warp w of block b owns the R output rows
// n = (GEMV_WARPS b + w) R + r, r < R; grid (ceil(N / (GEMV_WARPS R)), ceil(C / NC) or n_pairs).
// Lane l handles the K/32 groups g = l, l + 32, ... in that order for each of its rows and
// columns, and the warp sums lanes with a butterfly,
// so out[c, n] is computed by the same instructions whatever NC, R and C are: a verify step's
// logits equal single steps' bit for bit. A lane takes U = GEMV_UNROLL / R of its groups per
// pass (the 1-column 1-row kernel: one, activations first): it loads their weights first, then
// dots each weight group with every column's activations, so the weights are read once per
// launch whatever NC is. R rows per warp share each activation load; NC is the step's column
// count rounded up to 1, 2, 4, 8, 16 (chosen per launch; columns past n_cols are skipped).
// Programmatic launch (pdl.cuh): every read and write comes after the kernel's wait, except in
// gemv_<type>_c1r1e (quantized types), the 1-column 1-row kernel that loads each lane's first
// weight group before it (more registers; CudaBackend(gemv_early=True) picks it at 1 column),
// and gemv_<type>_c1r1p, the same loop with the next group's loads issued before each dot
// (two groups in flight per lane; CudaBackend picks it at 1 column for Q4_K / Q6_K matrices
// of at most gemv_prefetch_rows rows, where one warp per row leaves the SMs few warps).
#include "pdl.cuh"
#include "quant_types.cuh"
#include "act_quant.cuh"

// GEMV_WARPS (4: warps per block) comes as a -D define (service/backends/cuda/kernels.py).
#if !defined(GEMV_WARPS)
#error "compile with the shared -D defines (service/backends/cuda/sources.py OPTIONS)"
#endif
#define GEMV_UNROLL 4

struct GemvCols {            // which columns and weight rows one warp works on
    int c0, nc, row0, act_div;
    bool gathered;
};

__device__ __forceinline__ GemvCols gemv_cols(int NC, int n0, int n_cols, const int* ids,
                                              int rows_per_expert, int act_div) {
    GemvCols g;
    g.gathered = ids != nullptr;
    if (g.gathered) {
        g.c0 = blockIdx.y; g.nc = 1; g.act_div = act_div;
        g.row0 = ids[blockIdx.y] * rows_per_expert + n0;
    } else {
        g.c0 = blockIdx.y * NC; g.nc = min(NC, n_cols - g.c0); g.act_div = 1;
        g.row0 = n0;
    }
    return g;
}

// Lane 0 writes row n0 + r of column c: out = v, or out += v.
template <int NC, int R>
__device__ __forceinline__ void gemv_store(float (&acc)[NC][R], const GemvCols& g, int n0,
                                           int N, float* __restrict__ out, int ldo,
                                           int accumulate) {
#pragma unroll
    for (int c = 0; c < NC; c++) {
#pragma unroll
        for (int r = 0; r < R; r++) {
            const float v = warp_sum(acc[c][r]);
            if (c < g.nc && n0 + r < N && threadIdx.x == 0) {
                float* o = out + (size_t)(g.c0 + c) * ldo + n0 + r;
                *o = accumulate ? __fadd_rn(*o, v) : v;
            }
        }
    }
}

template <class Q, int NC, int R, bool EARLY = false, bool PF = false>
__device__ __forceinline__ void gemv_quant(Planes P, int K, int N, const signed char* __restrict__ qa,
                                           const float2* __restrict__ ads, int n_cols,
                                           const int* __restrict__ ids, int rows_per_expert,
                                           int act_div, float* __restrict__ out, int ldo,
                                           int accumulate) {
    const int lane = threadIdx.x, n0 = (blockIdx.x * GEMV_WARPS + threadIdx.y) * R;
    constexpr int SUB = Q::QK / 32;        // 32-element groups per block
    const int G = K / 32, nb = K / Q::QK;
    // EARLY (the c1r1e variant: one column, one row, plain mode): the lane's first weight
    // group is loaded before the programmatic-launch wait (weights never change during a
    // step), so with PDL its read overlaps the previous kernel; everything else waits first.
    typename Q::G w_first;
    const bool early = EARLY && NC == 1 && R == 1 && ids == nullptr && n0 < N && lane < G;
    if (early) Q::load(P, (size_t)n0 * nb + lane / SUB, lane % SUB, w_first);
    PDL_ENTRY();
    if (n0 >= N) return;
    const GemvCols cols = gemv_cols(NC, n0, n_cols, ids, rows_per_expert, act_div);
    // rows past N (the last warp of a matrix whose N is not a multiple of R) re-read row n0
    size_t rbase[R];
#pragma unroll
    for (int r = 0; r < R; r++) rbase[r] = (size_t)(cols.row0 + (n0 + r < N ? r : 0)) * nb;
    float acc[NC][R];
#pragma unroll
    for (int c = 0; c < NC; c++)
#pragma unroll
        for (int r = 0; r < R; r++) acc[c][r] = 0.0f;
    // U groups per lane per pass: all their weight loads are issued before any dot (bytes in
    // flight), and each weight group is loaded once for all NC columns.
    if constexpr (NC == 1 && R == 1) {
        // One column, one row (decode): the plain loop, activations loaded before the weights,
        // no unrolling: fewer registers and more warps in flight (measured faster on the H200
        // than the unrolled pass below at 1 column). The same additions in the same order.
        const int ar = cols.c0 / cols.act_div;
        if constexpr (PF) {
            // c1r1p: the next group's weights and activations are loaded before this group's
            // dot (two groups in flight per lane, for matrices of few rows); same additions.
            typename Q::G w, wn;
            int a[8], an[8];
            float2 ds, dsn;
            const u8* ap = reinterpret_cast<const u8*>(qa + (size_t)ar * K);
            if (lane < G) {
                ld16(ap + 32 * lane, a);
                ld16(ap + 32 * lane + 16, a + 4);
                ds = ads[(size_t)ar * G + lane];
                Q::load(P, rbase[0] + lane / SUB, lane % SUB, w);
            }
            for (int g = lane; g < G; g += WARP) {
                const int gn = g + WARP;
                if (gn < G) {
                    ld16(ap + 32 * gn, an);
                    ld16(ap + 32 * gn + 16, an + 4);
                    dsn = ads[(size_t)ar * G + gn];
                    Q::load(P, rbase[0] + gn / SUB, gn % SUB, wn);
                }
                acc[0][0] += Q::dot(w, a, ds.x, ds.y);
                w = wn;
                ds = dsn;
#pragma unroll
                for (int i = 0; i < 8; i++) a[i] = an[i];
            }
        } else {
            for (int g = lane; g < G; g += WARP) {
                const u8* ap = reinterpret_cast<const u8*>(qa + (size_t)ar * K + 32 * g);
                int a[8];
                ld16(ap, a);
                ld16(ap + 16, a + 4);
                const float2 ds = ads[(size_t)ar * G + g];
                typename Q::G w;
                if (early && g == lane) w = w_first;
                else Q::load(P, rbase[0] + g / SUB, g % SUB, w);
                acc[0][0] += Q::dot(w, a, ds.x, ds.y);
            }
        }
        gemv_store<NC, R>(acc, cols, n0, N, out, ldo, accumulate);
        return;
    }
    constexpr int U = GEMV_UNROLL / R > 0 ? GEMV_UNROLL / R : 1;
    for (int g0 = lane; g0 < G; g0 += WARP * U) {
        typename Q::G w[U][R];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int g = g0 + WARP * u;
            if (g < G) {
#pragma unroll
                for (int r = 0; r < R; r++) Q::load(P, rbase[r] + g / SUB, g % SUB, w[u][r]);
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int g = g0 + WARP * u;
#pragma unroll
            for (int c = 0; c < NC; c++) {
                if (g < G && c < cols.nc) {
                    const int ar = (cols.c0 + c) / cols.act_div;
                    const u8* ap = reinterpret_cast<const u8*>(qa + (size_t)ar * K + 32 * g);
                    int a[8];
                    ld16(ap, a);
                    ld16(ap + 16, a + 4);
                    const float2 ds = ads[(size_t)ar * G + g];
#pragma unroll
                    for (int r = 0; r < R; r++) acc[c][r] += Q::dot(w[u][r], a, ds.x, ds.y);
                }
            }
        }
    }
    gemv_store<NC, R>(acc, cols, n0, N, out, ldo, accumulate);
}

template <class F, int NC, int R>
__device__ __forceinline__ void gemv_float(const u8* __restrict__ W, int K, int N,
                                           const float* __restrict__ x, int ldx, int n_cols,
                                           const int* __restrict__ ids, int rows_per_expert,
                                           int act_div, float* __restrict__ out, int ldo,
                                           int accumulate) {
    const int lane = threadIdx.x, n0 = (blockIdx.x * GEMV_WARPS + threadIdx.y) * R;
    if (n0 >= N) return;
    const GemvCols cols = gemv_cols(NC, n0, n_cols, ids, rows_per_expert, act_div);
    size_t rbase[R];
#pragma unroll
    for (int r = 0; r < R; r++) rbase[r] = (size_t)(cols.row0 + (n0 + r < N ? r : 0)) * K;
    float acc[NC][R];
#pragma unroll
    for (int c = 0; c < NC; c++)
#pragma unroll
        for (int r = 0; r < R; r++) acc[c][r] = 0.0f;
    for (int k = lane; k < K; k += WARP) {
        float w[R];
#pragma unroll
        for (int r = 0; r < R; r++) w[r] = F::at(W, rbase[r] + k);
#pragma unroll
        for (int c = 0; c < NC; c++) {
            if (c < cols.nc) {
                const float xv = x[(size_t)((cols.c0 + c) / cols.act_div) * ldx + k];
#pragma unroll
                for (int r = 0; r < R; r++) acc[c][r] += w[r] * xv;
            }
        }
    }
    gemv_store<NC, R>(acc, cols, n0, N, out, ldo, accumulate);
}

#define GEMV_QUANT_KERNEL(name, Q, NC, R, SUFFIX, EARLY, PF)                                \
    extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS)                          \
    gemv_##name##_c##NC##r##R##SUFFIX(const u8* p0, const u8* p1, const u8* p2,             \
                                      const u8* p3, int K, int N, const signed char* qa,    \
                                      const float2* ads, int n_cols, const int* ids,        \
                                      int rows_per_expert, int act_div, float* out,         \
                                      int ldo, int accumulate) {                            \
        gemv_quant<Q, NC, R, EARLY, PF>(Planes{p0, p1, p2, p3}, K, N, qa, ads, n_cols, ids,  \
                                        rows_per_expert, act_div, out, ldo, accumulate);    \
    }
#define GEMV_QUANT_ONE(name, Q, NC, R) GEMV_QUANT_KERNEL(name, Q, NC, R, , false, false)
// gemv_<type>_c1r1[p]n: one column, residual add (out += W x), then the next RMSNorm: the
// last block of the grid to finish (a counter, reset by that block) normalizes the whole
// output row into h with its 8-bit blocks (hqa, hads), exactly as rms_norm_quant with B
// threads (act_quant.cuh last_block_norm_quant): one launch instead of two.
static_assert(GEMV_WARPS == 4, "gemv_norm's epilogue (norm_quant_row_128) takes (32, 4) blocks");
template <class Q, bool PF>
__device__ __forceinline__ void gemv_norm(Planes P, int K, int N, const signed char* qa,
                                          const float2* ads, float* out, int* done,
                                          const float* nw, float eps, int B, float* h,
                                          signed char* hqa, float2* hads) {
    gemv_quant<Q, 1, 1, false, PF>(P, K, N, qa, ads, 1, nullptr, 0, 1, out, N, 1);
    last_block_norm_quant(out, N, done, nw, eps, B, h, hqa, hads);
}
#define GEMV_NORM_KERNEL(name, Q, SUFFIX, PF)                                               \
    extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS, 6)                       \
    gemv_##name##_c1r1##SUFFIX##n(const u8* p0, const u8* p1, const u8* p2, const u8* p3,   \
                                  int K, int N, const signed char* qa, const float2* ads,   \
                                  float* out, int* done, const float* nw, float eps, int B, \
                                  float* h, signed char* hqa, float2* hads) {               \
        gemv_norm<Q, PF>(Planes{p0, p1, p2, p3}, K, N, qa, ads, out, done, nw, eps, B, h,   \
                         hqa, hads);                                                        \
    }
#define GEMV_FLOAT_ONE(name, F, NC, R)                                                      \
    extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS)                          \
    gemv_##name##_c##NC##r##R(const u8* W, int K, int N, const float* x, int ldx, int n_cols, \
                              const int* ids, int rows_per_expert, int act_div, float* out,  \
                              int ldo, int accumulate) {                                     \
        PDL_ENTRY();                                                                         \
        gemv_float<F, NC, R>(W, K, N, x, ldx, n_cols, ids, rows_per_expert, act_div, out,    \
                             ldo, accumulate);                                               \
    }
// The variants CudaBackend picks from (cuda_types.gemv_choice): 1 column with 1 or 2 rows per
// warp, 2..16 columns with 2 or 4 rows per warp.
#define GEMV_VARIANTS(ONE, name, T) \
    ONE(name, T, 1, 1) ONE(name, T, 1, 2) ONE(name, T, 2, 2) ONE(name, T, 4, 2) \
    ONE(name, T, 8, 2) ONE(name, T, 16, 2) ONE(name, T, 2, 4) ONE(name, T, 4, 4) \
    ONE(name, T, 8, 4) ONE(name, T, 16, 4)
#define GEMV_QUANT_KERNELS(name, Q) GEMV_VARIANTS(GEMV_QUANT_ONE, name, Q) \
    GEMV_QUANT_KERNEL(name, Q, 1, 1, e, true, false) \
    GEMV_QUANT_KERNEL(name, Q, 1, 1, p, false, true) GEMV_NORM_KERNEL(name, Q, , false)
#define GEMV_FLOAT_KERNELS(name, F) GEMV_VARIANTS(GEMV_FLOAT_ONE, name, F)
FOR_QUANT_TYPES(GEMV_QUANT_KERNELS)
// the fused residual + norm GEMV on the prefetching loop: the types CudaBackend uses it for
// (cuda_types.GEMV_PREFETCH_TYPES)
GEMV_NORM_KERNEL(q4_k, Q4_K, p, true)
GEMV_NORM_KERNEL(q6_k, Q6_K, p, true)
FOR_FLOAT_TYPES(GEMV_FLOAT_KERNELS)
