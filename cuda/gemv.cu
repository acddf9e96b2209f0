// gemv.cu: out[c, n] = sum_k W[row(c, n), k] * x[c, k] for up to 16 columns c per block row.
//
// Quantized W (gemv_<type>): x arrives as 8-bit blocks from quantize.cu: codes qa (C, K) int8
// and per 32-group (da, sa) with x[c, k] ~ da * qa[c, k], sa = sum of the group's codes; each
// group's contribution is an integer dot product (quant_types.cuh) scaled once. Float W
// (gemv_<f32|f16|bf16>): x (C, K) f32 with row stride ldx, products summed in f32.
//
// Shapes: W has R rows of K (planes as in quant_types.cuh), N <= R output rows per column;
// out (C, ldo) f32, written at columns [0, N) of each of its rows.
// Two modes, one kernel:
//   plain     ids == nullptr: grid.y chunks of <= 16 columns; column c reads x row c and
//             weight row n.
//   gathered  ids != nullptr (mixture of experts): grid.y = number of (token, expert) pairs,
//             one column per block row; pair p reads x row p / act_div and weight row
//             ids[p] * rows_per_expert + n.
// Launch: block (32, 4): one warp per output row n = blockIdx.x * 4 + threadIdx.y; grid
// (ceil(N / 4), ceil(C / 16) or n_pairs). Lane l handles the K/32 groups g = l, l + 32, ...
// in that order and the warp sums lanes with a butterfly, so out[c, n] is computed by the same
// instructions whatever C is: a verify step's logits equal single steps' bit for bit.
#include "quant_types.cuh"

#define GEMV_WARPS 4
#define GEMV_COLS 16

template <class Q>
__device__ __forceinline__ void gemv_quant(Planes P, int K, int N, const signed char* __restrict__ qa,
                                           const float2* __restrict__ ads, int n_cols,
                                           const int* __restrict__ ids, int rows_per_expert,
                                           int act_div, float* __restrict__ out, int ldo) {
    const int lane = threadIdx.x, n = blockIdx.x * GEMV_WARPS + threadIdx.y;
    if (n >= N) return;
    constexpr int SUB = Q::QK / 32;        // 32-element groups per block
    const int G = K / 32, nb = K / Q::QK;
    int c0, nc, row;
    if (ids) {
        c0 = blockIdx.y; nc = 1;
        row = ids[blockIdx.y] * rows_per_expert + n;
    } else {
        c0 = blockIdx.y * GEMV_COLS; nc = min(GEMV_COLS, n_cols - c0);
        row = n;
    }
    float acc[GEMV_COLS];
#pragma unroll
    for (int c = 0; c < GEMV_COLS; c++) acc[c] = 0.0f;
    for (int g = lane; g < G; g += WARP) {
        const size_t blk = (size_t)row * nb + g / SUB;
        const int j = g % SUB;
#pragma unroll
        for (int c = 0; c < GEMV_COLS; c++) {
            if (c < nc) {
                const int ar = ids ? (c0 + c) / act_div : c0 + c;
                const signed char* ap = qa + (size_t)ar * K + 32 * g;
                int a[8];
                ld16(reinterpret_cast<const u8*>(ap), a);
                ld16(reinterpret_cast<const u8*>(ap) + 16, a + 4);
                const float2 ds = ads[(size_t)ar * G + g];
                acc[c] += Q::dot(P, blk, j, a, ds.x, ds.y);
            }
        }
    }
#pragma unroll
    for (int c = 0; c < GEMV_COLS; c++) {
        if (c < nc) {
            const float v = warp_sum(acc[c]);
            if (lane == 0) out[(size_t)(c0 + c) * ldo + n] = v;
        }
    }
}

template <class F>
__device__ __forceinline__ void gemv_float(const u8* __restrict__ W, int K, int N,
                                           const float* __restrict__ x, int ldx, int n_cols,
                                           const int* __restrict__ ids, int rows_per_expert,
                                           int act_div, float* __restrict__ out, int ldo) {
    const int lane = threadIdx.x, n = blockIdx.x * GEMV_WARPS + threadIdx.y;
    if (n >= N) return;
    int c0, nc, row;
    if (ids) {
        c0 = blockIdx.y; nc = 1;
        row = ids[blockIdx.y] * rows_per_expert + n;
    } else {
        c0 = blockIdx.y * GEMV_COLS; nc = min(GEMV_COLS, n_cols - c0);
        row = n;
    }
    float acc[GEMV_COLS];
#pragma unroll
    for (int c = 0; c < GEMV_COLS; c++) acc[c] = 0.0f;
    const size_t base = (size_t)row * K;
    for (int k = lane; k < K; k += WARP) {
        const float w = F::at(W, base + k);
#pragma unroll
        for (int c = 0; c < GEMV_COLS; c++) {
            if (c < nc) {
                const int ar = ids ? (c0 + c) / act_div : c0 + c;
                acc[c] += w * x[(size_t)ar * ldx + k];
            }
        }
    }
#pragma unroll
    for (int c = 0; c < GEMV_COLS; c++) {
        if (c < nc) {
            const float v = warp_sum(acc[c]);
            if (lane == 0) out[(size_t)(c0 + c) * ldo + n] = v;
        }
    }
}

#define GEMV_QUANT_KERNEL(name, Q)                                                          \
    extern "C" __global__ void __launch_bounds__(128)                                       \
    gemv_##name(const u8* p0, const u8* p1, const u8* p2, const u8* p3, int K, int N,       \
                const signed char* qa, const float2* ads, int n_cols, const int* ids,       \
                int rows_per_expert, int act_div, float* out, int ldo) {                    \
        gemv_quant<Q>(Planes{p0, p1, p2, p3}, K, N, qa, ads, n_cols, ids, rows_per_expert,  \
                      act_div, out, ldo);                                                   \
    }
FOR_QUANT_TYPES(GEMV_QUANT_KERNEL)

#define GEMV_FLOAT_KERNEL(name, F)                                                          \
    extern "C" __global__ void __launch_bounds__(128)                                       \
    gemv_##name(const u8* W, int K, int N, const float* x, int ldx, int n_cols,             \
                const int* ids, int rows_per_expert, int act_div, float* out, int ldo) {    \
        gemv_float<F>(W, K, N, x, ldx, n_cols, ids, rows_per_expert, act_div, out, ldo);    \
    }
FOR_FLOAT_TYPES(GEMV_FLOAT_KERNEL)
