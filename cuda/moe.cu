// moe.cu: the (token, expert) pairs of a mixture-of-experts step grouped by expert, and the
// expert-grouped GEMVs that read each selected expert's matrices once for all its rows.
//
// A step of T tokens routes each token to n_used distinct experts (elementwise.cu moe_route):
// pair p = t * n_used + u (token t, its u-th choice) uses expert ids[p]; P = T * n_used pairs.
//
// moe_group   counting sort of the pairs by expert, on the device (no host synchronization,
//             so it sits in a captured step graph):
//               counts[e]          = min(#{p : ids[p] = e}, cap)
//               rows[e * cap + i]  = the i-th such p in increasing p (token order), i < counts[e]
//               tiles              = for each expert e in increasing order, its rows in tiles of
//                                    NC consecutive entries: tile j = (e * cap + i0,
//                                    min(NC, counts[e] - i0)) for i0 = 0, NC, 2 NC, ...
//               n_tiles[0]         = the number of tiles (at most the launcher's grid.y bound)
//             cap >= T: a token never picks an expert twice, so no expert has more than T rows.
//             One block of MOE_GROUP_THREADS threads: the ids are staged in shared memory
//             MOE_GROUP_CHUNK at a time; warp w counts experts w, w + nw, ... by a ballot per 32
//             pairs (lanes in p order, so rows come out in token order); then warp 0 scans the
//             experts' tile counts (lane l: a contiguous span of experts) and writes the tiles.
//             n_expert <= MOE_MAX_EXPERTS.
//
// moeg_<type>_c<NC>r<R>      out[p, n] = sum_k W[e, n, k] x[p / act_div, k]   (the down GEMV)
// moeg_glu_<type>_c<NC>r<R>  out[p, f] = act(sum_k G[e, f, k] x[p / act_div, k])
//                                        * sum_k U[e, f, k] x[p / act_div, k]  (gate | up + GLU)
//             for every pair p of every tile, e its expert. Weights: rows_per_expert (N) rows of
//             K per expert, expert e's row n at e * rows_per_expert + n (a stack as gemv.cu's
//             gathered mode reads it). Quantized W: x as 8-bit blocks (qa, ads) as gemv.cu
//             reads them; float W: x (rows, ldx) f32.
// Launch: block (32, GEMV_WARPS), grid (ceil(N / (GEMV_WARPS R)), max_tiles); block (b, j)
// works on tile j (blocks past n_tiles exit at once) and output rows n = (GEMV_WARPS b + w) R + r
// of warp w, for the tile's <= NC columns: each weight group is loaded once per block and dotted
// with every column's activations. Per column the sum is gemv.cu's: lane l takes the K/32 groups
// g = l, l + 32, ... in that order, acc += Q::dot(...), then the warp's butterfly; so out[p, n]
// does not depend on which other pairs share the tile or the step, nor on NC and R, and equals
// the bits of gemv.cu's gathered mode (gemv_<type>_c1r1 with ids). The GLU variant has 2R
// weight rows per warp (R gate rows, the same R rows of up) and writes
// __fmul_rn(glu_act(gate, act), up) (glu.cuh): elementwise.cu glu's bits on the same sums.
#include "pdl.cuh"
#include "quant_types.cuh"
#include "glu.cuh"

// GEMV_WARPS (warps per block), MOE_GROUP_THREADS, MOE_GROUP_CHUNK and MOE_MAX_EXPERTS come as
// -D defines (service/backends/cuda/kernels.py).
#if !defined(GEMV_WARPS) || !defined(MOE_GROUP_THREADS)
#error "compile with the shared -D defines (service/backends/cuda/sources.py OPTIONS)"
#endif
#if !defined(MOE_GROUP_CHUNK) || !defined(MOE_MAX_EXPERTS)
#error "compile with the shared -D defines (service/backends/cuda/sources.py OPTIONS)"
#endif
#define MOEG_UNROLL 4          // weight groups in flight per lane and pass (gemv.cu's unroll)

extern "C" __global__ void __launch_bounds__(MOE_GROUP_THREADS)
moe_group(const int* __restrict__ ids, int P, int n_expert, int cap, int nc,
          int* __restrict__ counts, int* __restrict__ rows, int* __restrict__ tiles,
          int* __restrict__ n_tiles) {
    __shared__ int sid[MOE_GROUP_CHUNK];
    __shared__ int cnt[MOE_MAX_EXPERTS];
    PDL_ENTRY();
    const int lane = threadIdx.x & 31, warp = threadIdx.x / 32, nw = blockDim.x / 32;
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) cnt[e] = 0;
    for (int base = 0; base < P; base += MOE_GROUP_CHUNK) {
        const int n = min(MOE_GROUP_CHUNK, P - base);
        __syncthreads();                     // the previous chunk is read; cnt is initialized
        for (int i = threadIdx.x; i < n; i += blockDim.x) sid[i] = ids[base + i];
        __syncthreads();
        for (int e = warp; e < n_expert; e += nw) {
            int c = cnt[e];
            for (int p0 = 0; p0 < n; p0 += WARP) {
                const bool hit = p0 + lane < n && sid[p0 + lane] == e;
                const unsigned m = __ballot_sync(FULL_MASK, hit);
                const int i = c + __popc(m & ((1u << lane) - 1u));
                if (hit && i < cap) rows[(size_t)e * cap + i] = base + p0 + lane;
                c += __popc(m);
            }
            __syncwarp();
            if (lane == 0) cnt[e] = c;
        }
    }
    __syncthreads();
    if (warp != 0) return;
    // tiles: lane l owns experts [e0, e1); an exclusive scan of the lanes' tile counts places
    // each lane's tiles after those of the lanes before it (experts in increasing order)
    const int per = (n_expert + WARP - 1) / WARP;
    const int e0 = min(lane * per, n_expert), e1 = min(e0 + per, n_expert);
    int mine = 0;
    for (int e = e0; e < e1; e++) mine += (min(cnt[e], cap) + nc - 1) / nc;
    int incl = mine;
#pragma unroll
    for (int o = 1; o < WARP; o <<= 1) {
        const int v = __shfl_up_sync(FULL_MASK, incl, o);
        if (lane >= o) incl += v;
    }
    int j = incl - mine;
    for (int e = e0; e < e1; e++) {
        const int c = min(cnt[e], cap);
        counts[e] = c;
        for (int i0 = 0; i0 < c; i0 += nc, j++) {
            tiles[2 * j] = e * cap + i0;
            tiles[2 * j + 1] = min(nc, c - i0);
        }
    }
    if (lane == WARP - 1) *n_tiles = incl;
}

// The tile of block row blockIdx.y: its first entry in rows, its column count and its expert's
// first weight row; false past n_tiles.
struct MoeTile {
    int base, n, row0;
};

__device__ __forceinline__ bool moe_tile(const int* tiles, const int* n_tiles, int cap,
                                         int rows_per_expert, MoeTile& t) {
    const int j = blockIdx.y;
    if (j >= *n_tiles) return false;
    t.base = tiles[2 * j];
    t.n = tiles[2 * j + 1];
    t.row0 = (t.base / cap) * rows_per_expert;
    return true;
}

// The activation row of each of the tile's columns (its pair / act_div; column c >= t.n: 0,
// never read).
template <int NC>
__device__ __forceinline__ void moe_columns(const MoeTile& t, const int* rows, int act_div,
                                            int (&arow)[NC]) {
#pragma unroll
    for (int c = 0; c < NC; c++) arow[c] = c < t.n ? rows[t.base + c] / act_div : 0;
}

// Lane 0 writes row n0 + r of each column's pair (re-read from rows: fewer registers held
// through the loop): the sum (GLU: act(gate sum) * up sum).
template <int NC, int R, bool GLU>
__device__ __forceinline__ void moe_store(float (&acc)[NC][GLU ? 2 * R : R], const MoeTile& t,
                                          const int* rows, int n0, int N, int act,
                                          float* __restrict__ out, int ldo) {
#pragma unroll
    for (int c = 0; c < NC; c++) {
#pragma unroll
        for (int r = 0; r < R; r++) {
            float v = warp_sum(acc[c][r]);
            if constexpr (GLU) v = __fmul_rn(glu_act(v, act), warp_sum(acc[c][R + r]));
            if (c < t.n && n0 + r < N && threadIdx.x == 0)
                out[(size_t)rows[t.base + c] * ldo + n0 + r] = v;
        }
    }
}

// Weight rows r < R come from planes A, rows R..2R-1 (GLU: up) from planes B.
template <class Q, int NC, int R, bool GLU>
__device__ __forceinline__ void moeg_quant(Planes A, Planes B, int K, int N,
                                           const signed char* __restrict__ qa,
                                           const float2* __restrict__ ads,
                                           const int* __restrict__ tiles,
                                           const int* __restrict__ n_tiles,
                                           const int* __restrict__ rows, int cap,
                                           int rows_per_expert, int act_div, int act,
                                           float* __restrict__ out, int ldo) {
    constexpr int RR = GLU ? 2 * R : R;
    constexpr int SUB = Q::QK / 32;        // 32-element groups per block
    const int lane = threadIdx.x, n0 = (blockIdx.x * GEMV_WARPS + threadIdx.y) * R;
    PDL_ENTRY();
    MoeTile t;
    if (n0 >= N || !moe_tile(tiles, n_tiles, cap, rows_per_expert, t)) return;
    const int G = K / 32, nb = K / Q::QK;
    int arow[NC];
    moe_columns<NC>(t, rows, act_div, arow);
    // rows past N (the last warp of a matrix whose N is not a multiple of R) re-read row n0
    size_t rbase[RR];
#pragma unroll
    for (int r = 0; r < RR; r++) {
        const int rr = r % R;
        rbase[r] = (size_t)(t.row0 + n0 + (n0 + rr < N ? rr : 0)) * nb;
    }
    float acc[NC][RR];
#pragma unroll
    for (int c = 0; c < NC; c++)
#pragma unroll
        for (int r = 0; r < RR; r++) acc[c][r] = 0.0f;
    if constexpr (NC == 1 && RR == 1) {
        // one column, one row: gemv.cu's one-column loop (activations before weights)
        for (int g = lane; g < G; g += WARP) {
            const u8* ap = reinterpret_cast<const u8*>(qa + (size_t)arow[0] * K + 32 * g);
            int a[8];
            ld16(ap, a);
            ld16(ap + 16, a + 4);
            const float2 ds = ads[(size_t)arow[0] * G + g];
            typename Q::G w;
            Q::load(A, rbase[0] + g / SUB, g % SUB, w);
            acc[0][0] += Q::dot(w, a, ds.x, ds.y);
        }
    } else {
        constexpr int U = MOEG_UNROLL / RR > 0 ? MOEG_UNROLL / RR : 1;
        for (int g0 = lane; g0 < G; g0 += WARP * U) {
            typename Q::G w[U][RR];
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int g = g0 + WARP * u;
                if (g < G) {
#pragma unroll
                    for (int r = 0; r < RR; r++)
                        Q::load(r < R ? A : B, rbase[r] + g / SUB, g % SUB, w[u][r]);
                }
            }
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int g = g0 + WARP * u;
#pragma unroll
                for (int c = 0; c < NC; c++) {
                    if (g < G && c < t.n) {
                        const u8* ap =
                            reinterpret_cast<const u8*>(qa + (size_t)arow[c] * K + 32 * g);
                        int a[8];
                        ld16(ap, a);
                        ld16(ap + 16, a + 4);
                        const float2 ds = ads[(size_t)arow[c] * G + g];
#pragma unroll
                        for (int r = 0; r < RR; r++)
                            acc[c][r] += Q::dot(w[u][r], a, ds.x, ds.y);
                    }
                }
            }
        }
    }
    moe_store<NC, R, GLU>(acc, t, rows, n0, N, act, out, ldo);
}

// Float weights: gemv.cu's gemv_float loop (element k = lane, lane + 32, ...; f32 products).
template <class F, int NC, int R, bool GLU>
__device__ __forceinline__ void moeg_float(const u8* __restrict__ A, const u8* __restrict__ B,
                                           int K, int N, const float* __restrict__ x, int ldx,
                                           const int* __restrict__ tiles,
                                           const int* __restrict__ n_tiles,
                                           const int* __restrict__ rows, int cap,
                                           int rows_per_expert, int act_div, int act,
                                           float* __restrict__ out, int ldo) {
    constexpr int RR = GLU ? 2 * R : R;
    const int lane = threadIdx.x, n0 = (blockIdx.x * GEMV_WARPS + threadIdx.y) * R;
    PDL_ENTRY();
    MoeTile t;
    if (n0 >= N || !moe_tile(tiles, n_tiles, cap, rows_per_expert, t)) return;
    int arow[NC];
    moe_columns<NC>(t, rows, act_div, arow);
    size_t rbase[RR];
#pragma unroll
    for (int r = 0; r < RR; r++) {
        const int rr = r % R;
        rbase[r] = (size_t)(t.row0 + n0 + (n0 + rr < N ? rr : 0)) * K;
    }
    float acc[NC][RR];
#pragma unroll
    for (int c = 0; c < NC; c++)
#pragma unroll
        for (int r = 0; r < RR; r++) acc[c][r] = 0.0f;
    for (int k = lane; k < K; k += WARP) {
        float w[RR];
#pragma unroll
        for (int r = 0; r < RR; r++) w[r] = F::at(r < R ? A : B, rbase[r] + k);
#pragma unroll
        for (int c = 0; c < NC; c++) {
            if (c < t.n) {
                const float xv = x[(size_t)arow[c] * ldx + k];
#pragma unroll
                for (int r = 0; r < RR; r++) acc[c][r] += w[r] * xv;
            }
        }
    }
    moe_store<NC, R, GLU>(acc, t, rows, n0, N, act, out, ldo);
}

#define MOEG_TAIL_PARAMS                                                                    \
    const int *tiles, const int *n_tiles, const int *rows, int cap, int rows_per_expert,    \
        int act_div
#define MOEG_TAIL_ARGS tiles, n_tiles, rows, cap, rows_per_expert, act_div

#define MOEG_QUANT_ONE(name, Q, NC, R)                                                      \
    extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS)                          \
    moeg_##name##_c##NC##r##R(const u8* p0, const u8* p1, const u8* p2, const u8* p3,       \
                              int K, int N, const signed char* qa, const float2* ads,       \
                              MOEG_TAIL_PARAMS, float* out, int ldo) {                      \
        const Planes W{p0, p1, p2, p3};                                                     \
        moeg_quant<Q, NC, R, false>(W, W, K, N, qa, ads, MOEG_TAIL_ARGS, 0, out, ldo);      \
    }
#define MOEG_QUANT_GLU_ONE(name, Q, NC, R)                                                  \
    extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS)                          \
    moeg_glu_##name##_c##NC##r##R(const u8* g0, const u8* g1, const u8* g2, const u8* g3,   \
                                  const u8* u0, const u8* u1, const u8* u2, const u8* u3,   \
                                  int K, int N, const signed char* qa, const float2* ads,   \
                                  MOEG_TAIL_PARAMS, int act, float* out, int ldo) {         \
        moeg_quant<Q, NC, R, true>(Planes{g0, g1, g2, g3}, Planes{u0, u1, u2, u3}, K, N, qa, \
                                   ads, MOEG_TAIL_ARGS, act, out, ldo);                     \
    }
#define MOEG_FLOAT_ONE(name, F, NC, R)                                                      \
    extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS)                          \
    moeg_##name##_c##NC##r##R(const u8* W, int K, int N, const float* x, int ldx,           \
                              MOEG_TAIL_PARAMS, float* out, int ldo) {                      \
        moeg_float<F, NC, R, false>(W, W, K, N, x, ldx, MOEG_TAIL_ARGS, 0, out, ldo);       \
    }
#define MOEG_FLOAT_GLU_ONE(name, F, NC, R)                                                  \
    extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS)                          \
    moeg_glu_##name##_c##NC##r##R(const u8* Wg, const u8* Wu, int K, int N, const float* x, \
                                  int ldx, MOEG_TAIL_PARAMS, int act, float* out, int ldo) { \
        moeg_float<F, NC, R, true>(Wg, Wu, K, N, x, ldx, MOEG_TAIL_ARGS, act, out, ldo);    \
    }
// The column variants (kernels.py MOEG_ROWS / MOEG_GLU_ROWS: NC -> R): the down GEMV with
// R = 1, 2, 4, 4 rows per warp, the gate | up GEMV with R = 1, 1, 2, 2 (2R weight rows per
// warp). An expert with more than 8 rows in a step spans several tiles.
#define MOEG_DOWN(ONE, name, T) \
    ONE(name, T, 1, 1) ONE(name, T, 2, 2) ONE(name, T, 4, 4) ONE(name, T, 8, 4)
#define MOEG_GLU(ONE, name, T) \
    ONE(name, T, 1, 1) ONE(name, T, 2, 1) ONE(name, T, 4, 2) ONE(name, T, 8, 2)
#define MOEG_QUANT_KERNELS(name, Q) MOEG_DOWN(MOEG_QUANT_ONE, name, Q) \
    MOEG_GLU(MOEG_QUANT_GLU_ONE, name, Q)
#define MOEG_FLOAT_KERNELS(name, F) MOEG_DOWN(MOEG_FLOAT_ONE, name, F) \
    MOEG_GLU(MOEG_FLOAT_GLU_ONE, name, F)
FOR_QUANT_TYPES(MOEG_QUANT_KERNELS)
FOR_FLOAT_TYPES(MOEG_FLOAT_KERNELS)
