// attention_tiled.cu: causal GQA attention of a long step (a prefill chunk), queries in tiles.
//
//   out[t, h, :] = sum_j softmax_j(scale * q[t, h] . K[j]) V[j]   over the cache rows j of
//   slot[t] with lo <= j <= pos[t], lo = max(0, pos[t] - window + 1) when window > 0 else 0
//   (the formula of attention.cu without tree rows). K, V rows of kv head h / G (G = H / Hkv),
//   any KV type through the paged cache (common.cuh kv_page_row, kv_read.cuh).
//
// attention.cu gives each query its own blocks and re-reads the keys for every query; here a
// block takes AT_ROWS = 32 query rows that share a kv head (QT = 32 / G consecutive tokens x
// the G heads of kv head hk) and reads each tile of AT_KEYS = 32 keys once into shared memory
// for all of them: keys are read T / QT times per step instead of T times.
//
// attnt_<K>_<V>_d<128|256> (K, V: kv_read.cuh readers, kinds kk, vk; Dv <= 128 | 256):
//   grid (ceil(T / QT), Hkv), block (32, AT_WARPS), dynamic shared memory (32 D + 32 D +
//   32 (Dv + 1)) floats: q rows [32][D], the key tile transposed [D][32] and the value tile
//   [32][Dv + 1] (padded: conflict-free stores and loads).
//   Row r of the block is token tq0 + r / G, head hk G + r % G; warp w owns rows 8w .. 8w + 7
//   (AT_ROWS_PER_WARP = 8).
//   Rows of one slot are processed together (a step of several slots takes one pass per slot
//   present in the block); keys [jlo, jhi) of the pass (the union of its rows' ranges) in tiles
//   aligned to multiples of 32 ABSOLUTE positions; lane l holds key jt + l of a tile for the
//   scores and dims l, l + 32, ... of the accumulators.
//   Per row and tile: scores dot(q, k) (products in order of d, one accumulator) * scale, the
//   tile's max and sum by butterfly (common.cuh), online softmax (m, l, acc) and acc += p_j V_j
//   over the tile's keys in order. Keys outside a row's range count as p = 0 and tiles without
//   any key of the row are skipped, so a row's bits depend on its own query and keys only,
//   never on which rows share its block or step (tested: tests/gpu/test_attention_tiled.py).
//   Not the bits of attention.cu (other order of additions; within float rounding of it).
//   Rows with slot < 0 get 0. D % 8 == 0, D <= 256, Dv % 32 == 0, Dv <= 256, G <= 32.
//   Everything comes after the programmatic-launch wait (pdl.cuh).
//   out (T, H, Dv) view with strides (o0, o1, 1), q (T, H, D) with strides (q0, q1, 1).
#include "pdl.cuh"
#include "kv_read.cuh"

// AT_ROWS (32), AT_KEYS (32) and AT_WARPS (4: block (32, AT_WARPS)) come as -D defines
// (service/backends/cuda/kernels.py).
#if !defined(AT_ROWS) || !defined(AT_KEYS) || !defined(AT_WARPS)
#error "compile with the shared -D defines (service/backends/cuda/sources.py OPTIONS)"
#endif
static_assert(AT_ROWS == WARP && AT_ROWS % AT_WARPS == 0,
              "lane r of warp 0 keeps row r's range; each warp owns AT_ROWS / AT_WARPS rows");
#define AT_ROWS_PER_WARP (AT_ROWS / AT_WARPS)

template <class KT, class VT, int NDV>
__device__ __forceinline__ void attn_tiled(
        const float* __restrict__ q, int q0, int q1, int T, int H, int Hkv, int D, int Dv,
        int QT, const u8* __restrict__ kq, const u8* __restrict__ kd,
        const u8* __restrict__ vq, const u8* __restrict__ vd, const int* __restrict__ slots,
        const int* __restrict__ positions, const int* __restrict__ table, int max_blocks,
        int lb, int window, float scale, float* __restrict__ out, int o0, int o1, int kk,
        int vk) {
    const KT kr(kk);
    const VT vr(vk);
    extern __shared__ float sm[];
    float* qs = sm;                            // [AT_ROWS][D]
    float* kt = qs + AT_ROWS * D;              // [D][AT_KEYS]
    float* vs = kt + D * AT_KEYS;              // [AT_KEYS][Dv + 1]
    __shared__ int r_slot[AT_ROWS], r_lo[AT_ROWS], r_hi[AT_ROWS];
    __shared__ int g_slot, g_jlo, g_jhi;
    __shared__ u32 g_act;
    const int lane = threadIdx.x, warp = threadIdx.y, tid = warp * WARP + lane;
    const int G = H / Hkv, hk = blockIdx.y, tq0 = blockIdx.x * QT;
    const int nd = Dv / 32, vstride = Dv + 1;     // nd <= NDV
    if (warp == 0) {                           // lane r: row r's slot and key range
        const int tt = lane / G, t = tq0 + tt;
        int slot = -1, lo = 0, hi = 0;
        if (tt < QT && t < T) {
            slot = slots[t];
            const int pos = positions[t];
            lo = window > 0 ? max(0, pos - window + 1) : 0;
            hi = pos + 1;
        }
        r_slot[lane] = slot; r_lo[lane] = lo; r_hi[lane] = hi;
    }
    for (int i = tid; i < AT_ROWS * D; i += AT_WARPS * WARP) {
        const int r = i / D, tt = r / G, t = tq0 + tt;
        qs[i] = tt < QT && t < T ? q[(size_t)t * q0 + (size_t)(hk * G + r % G) * q1 + i % D]
                                 : 0.0f;
    }
    __syncthreads();
    u32 done = 0;                              // rows finished (warp 0's bookkeeping)
    while (true) {
        if (warp == 0) {                       // the next pass: the slot of the first row left
            const int slot = r_slot[lane];
            const bool pend = slot >= 0 && !((done >> lane) & 1u);
            const u32 pb = __ballot_sync(FULL_MASK, pend);
            const int S = pb ? __shfl_sync(FULL_MASK, slot, __ffs(pb) - 1) : -1;
            const bool act = pend && slot == S;
            int jlo = act ? r_lo[lane] : 0x7fffffff, jhi = act ? r_hi[lane] : 0;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                jlo = min(jlo, __shfl_xor_sync(FULL_MASK, jlo, o));
                jhi = max(jhi, __shfl_xor_sync(FULL_MASK, jhi, o));
            }
            const u32 ab = __ballot_sync(FULL_MASK, act);
            done |= ab;
            if (lane == 0) { g_slot = S; g_act = ab; g_jlo = jlo; g_jhi = jhi; }
        }
        __syncthreads();
        const int S = g_slot;
        if (S < 0) break;
        const u32 act = g_act;
        const int jlo = g_jlo, jhi = g_jhi;
        float m[AT_ROWS_PER_WARP], l[AT_ROWS_PER_WARP], acc[AT_ROWS_PER_WARP][NDV];
        int rlo[AT_ROWS_PER_WARP], rhi[AT_ROWS_PER_WARP];
#pragma unroll
        for (int i = 0; i < AT_ROWS_PER_WARP; i++) {
            const int r = warp * AT_ROWS_PER_WARP + i;
            m[i] = NEG_INF; l[i] = 0.0f;
            rlo[i] = r_lo[r]; rhi[i] = (act >> r) & 1u ? r_hi[r] : 0;   // hi 0: no key
#pragma unroll
            for (int c = 0; c < NDV; c++) acc[i][c] = 0.0f;
        }
        for (int jt = (jlo / AT_KEYS) * AT_KEYS; jt < jhi; jt += AT_KEYS) {
            const int n = min(AT_KEYS, jhi - jt);
            // lane l loads key jt + l (K transposed, V as rows); warps take 8-element pieces
            const size_t krow = lane < n
                ? kv_page_row(table, max_blocks, lb, S, jt + lane) * Hkv + hk : 0;
            __syncthreads();                   // the previous tile is consumed
            for (int d8 = warp; d8 < D / 8; d8 += AT_WARPS) {
                float v8[8];
                if (lane < n) kr.load8(kq, kd, krow, D, 8 * d8, v8);
#pragma unroll
                for (int u = 0; u < 8; u++)
                    kt[(8 * d8 + u) * AT_KEYS + lane] = lane < n ? v8[u] : 0.0f;
            }
            for (int d8 = warp; d8 < Dv / 8; d8 += AT_WARPS) {
                float v8[8];
                if (lane < n) vr.load8(vq, vd, krow, Dv, 8 * d8, v8);
#pragma unroll
                for (int u = 0; u < 8; u++)
                    vs[lane * vstride + 8 * d8 + u] = lane < n ? v8[u] : 0.0f;
            }
            __syncthreads();
            float dot[AT_ROWS_PER_WARP];
#pragma unroll
            for (int i = 0; i < AT_ROWS_PER_WARP; i++) dot[i] = 0.0f;
            const float* qw = qs + warp * AT_ROWS_PER_WARP * D;
            for (int d = 0; d < D; d += 4) {
                const float k0 = kt[d * AT_KEYS + lane], k1 = kt[(d + 1) * AT_KEYS + lane];
                const float k2 = kt[(d + 2) * AT_KEYS + lane], k3 = kt[(d + 3) * AT_KEYS + lane];
#pragma unroll
                for (int i = 0; i < AT_ROWS_PER_WARP; i++) {
                    const float4 qv = *reinterpret_cast<const float4*>(qw + i * D + d);
                    dot[i] += qv.x * k0;
                    dot[i] += qv.y * k1;
                    dot[i] += qv.z * k2;
                    dot[i] += qv.w * k3;
                }
            }
            const int j = jt + lane;
            float p[AT_ROWS_PER_WARP];
#pragma unroll
            for (int i = 0; i < AT_ROWS_PER_WARP; i++) {
                p[i] = 0.0f;
                const bool ok = j >= rlo[i] && j < rhi[i];
                const float sc = ok ? dot[i] * scale : NEG_INF;
                const float tm = warp_max(sc);
                if (tm == NEG_INF) continue;   // no key of row i in this tile (warp-uniform)
                const float mn = fmaxf(m[i], tm);
                const float corr = expf(m[i] - mn);
                p[i] = ok ? expf(sc - mn) : 0.0f;
                l[i] = l[i] * corr + warp_sum(p[i]);
#pragma unroll
                for (int c = 0; c < NDV; c++) acc[i][c] *= corr;
                m[i] = mn;
            }
            for (int kk = 0; kk < n; kk++) {   // keys in order; p = 0 outside a row's range
                float vv[NDV];
#pragma unroll
                for (int c = 0; c < NDV; c++)
                    vv[c] = c < nd ? vs[kk * vstride + lane + 32 * c] : 0.0f;
#pragma unroll
                for (int i = 0; i < AT_ROWS_PER_WARP; i++) {
                    const float pk = __shfl_sync(FULL_MASK, p[i], kk);
#pragma unroll
                    for (int c = 0; c < NDV; c++) acc[i][c] += pk * vv[c];
                }
            }
        }
#pragma unroll
        for (int i = 0; i < AT_ROWS_PER_WARP; i++) {
            const int r = warp * AT_ROWS_PER_WARP + i;
            if (!((act >> r) & 1u)) continue;
            float* o = out + (size_t)(tq0 + r / G) * o0 + (size_t)(hk * G + r % G) * o1;
#pragma unroll
            for (int c = 0; c < NDV; c++)
                if (c < nd) o[lane + 32 * c] = acc[i][c] / l[i];
        }
        __syncthreads();                       // g_* are rewritten by the next pass
    }
    // padding rows (slot < 0) of real tokens: 0
#pragma unroll
    for (int i = 0; i < AT_ROWS_PER_WARP; i++) {
        const int r = warp * AT_ROWS_PER_WARP + i, t = tq0 + r / G;
        if (r / G < QT && t < T && r_slot[r] < 0) {
            float* o = out + (size_t)t * o0 + (size_t)(hk * G + r % G) * o1;
            for (int d = lane; d < Dv; d += WARP) o[d] = 0.0f;
        }
    }
}

// NDV = the accumulators per lane and row: Dv <= 32 NDV (_d128: NDV 4, _d256: NDV 8).
// Two blocks per SM stated (what the shared memory allows for _d256 anyway): without it, NVRTC
// 13.0's ptxas held the 4/5-bit-key _d128 kernels to 128 registers and spilled; 13.5 did not.
#define ATTNT_KERNEL(kn, KT, vn, VT, ndv, dmax)                                              \
    extern "C" __global__ void __launch_bounds__(32 * AT_WARPS, 2)                           \
    attnt_##kn##_##vn##_d##dmax(                                                             \
            const float* q, int q0, int q1, int T, int H, int Hkv, int D, int Dv, int QT,    \
            const u8* kq, const u8* kd, const u8* vq, const u8* vd, const int* slots,        \
            const int* positions, const int* table, int max_blocks, int lb, int window,      \
            float scale, float* out, int o0, int o1, int kk, int vk) {                       \
        PDL_ENTRY();                                                                         \
        attn_tiled<KT, VT, ndv>(q, q0, q1, T, H, Hkv, D, Dv, QT, kq, kd, vq, vd, slots,      \
                                positions, table, max_blocks, lb, window, scale, out, o0,    \
                                o1, kk, vk);                                                 \
    }
#define ATTNT_SIZES(kn, KT, vn, VT) ATTNT_KERNEL(kn, KT, vn, VT, 4, 128) \
    ATTNT_KERNEL(kn, KT, vn, VT, 8, 256)
FOR_KV_READER_PAIRS(ATTNT_SIZES)
