// attention.cu: causal GQA attention of T queries over the KV cache, split over the KV length.
//
//   out[t, h, :] = sum_j softmax_j(scale * q[t, h] . K[j]) V[j]   over the cache rows j of
//   slot[t] with lo <= j <= pos[t], lo = max(0, pos[t] - window + 1) when window > 0 else 0;
//   with attn_lo / attn_mask (tree verify rows; null: b = pos[t] + 1, mask 0, the line above),
//   the keys are LOGICAL positions j in [lo, b + popc(mask)): key j < b is cache row j, key
//   b + k is the row b + (the k-th set bit of mask), the node's ancestor at depth k (DFS order
//   puts ancestors first, by depth). So a tree row runs over the same positions, splits and
//   tiles as plain decoding of its path and gives the same bits; the window is judged on j,
//   the RoPE position of the key. An ordinary row computes what it computed without arrays.
//   K, V rows of kv head h / (H / Hkv), stored as any KV type (kv_quant.cuh's planes, read
//   through kv_read.cuh's readers; kk, vk: the K and V readers' kinds).
//   The cache is paged: cache row r of slot s is pool row table[s, r >> lb] * 2^lb + (r & (2^lb
//   - 1)) (common.cuh kv_page_row; table (n_slots, max_blocks) int32, 2^lb = block size), for
//   keys and values alike (a pool of fewer than 2^31 rows); the order of additions does not
//   depend on the table.
//
// attn_<K>_<V>_d<128|256> (K, V: readers f16, bf16, q8_0, nib; Dv <= 128 | 256: 4 | 8
//   accumulators per lane): one kernel, grid (S, H, T), block (32, ATT_WARPS). Split s covers
//   the ABSOLUTE positions [s * chunk, (s + 1) * chunk): its boundaries never depend on the
//   step or on how long the context is, and positions past pos[t] are skipped, so the same
//   query gives the same bits in any step. Warp w takes tiles of 32 keys (one per lane) with
//   an online softmax (running max m, sum l, accumulator over Dv, lane d holding dims d,
//   d + 32, ...); the 4 warps merge in order.
//   Writes part_ml[t, h, s] = (m, l) (l = 0: no key in the split) and part_acc[t, h, s, :].
//   q (T, H, D) view with strides (q0, q1, 1); D <= 512 and D % 8 == 0 (keys are read 8
//   elements per vector load), Dv <= 256, S = gridDim.x = ceil(n_ctx / chunk).
//   The number of splits is fixed by n_ctx: a step never needs the host to know a KV length,
//   so one captured graph serves every position.
// The combine runs in the same launch: each of the row's S_t = ceil(hi / chunk) splits (keys
//   [0, hi); 1 for a padding row) adds 1 to counters[t, h] after writing its partials, and
//   blocks s >= S_t return at once; the block that brings it to S_t (whichever it is) merges
//   the S_t partials in split order and resets the counter to 0 for the next step:
//   out[t, h, d] = sum_s acc_s[d] e^(m_s - M) / sum_s l_s e^(m_s - M), M = max m_s over
//   splits with l_s > 0. out (T, H, Dv) view (strides o0, o1, 1); rows with slot < 0 get 0.
//   When qa is not null the same block also writes the 8-bit blocks of out (act_quant.cuh) as
//   rows of width H * Dv (Dv % 32 == 0) for the output projection's GEMV.
#include "pdl.cuh"
#include "act_quant.cuh"
#include "kv_read.cuh"

// ATT_WARPS (4: block (32, ATT_WARPS)), ATT_MAX_D (512) and ATT_MAX_DV (256) come as -D defines
// (service/backends/cuda/kernels.py).
#if !defined(ATT_WARPS) || !defined(ATT_MAX_D) || !defined(ATT_MAX_DV)
#error "compile with the shared -D defines (service/backends/cuda/sources.py OPTIONS)"
#endif

// The cache row of logical key j of a row (b = attn_lo, bits = attn_mask): j itself below b,
// else the row of the (j - b)-th set bit of bits (a tree node's ancestors, by depth).
__device__ __forceinline__ int key_row(int j, int b, u32 bits) {
    return j < b ? j : b + (int)__fns(bits, 0u, j - b + 1);
}

// One split's partials: (m, l) and the Dv accumulators of queries t, head h, keys of split s.
// NV = ceil(Dv / 32) elements per lane (4: Dv <= 128, 8: Dv <= 256).
template <class KT, class VT, int NV>
__device__ __forceinline__ void attn_split(
        const float* __restrict__ q, int q0, int q1, int H, int Hkv, int D, int Dv,
        const u8* __restrict__ kq, const u8* __restrict__ kd, const u8* __restrict__ vq,
        const u8* __restrict__ vd, const int* __restrict__ slots, const int* __restrict__ positions,
        const int* __restrict__ attn_lo, const int* __restrict__ attn_mask,
        const int* __restrict__ table, int max_blocks, int lb, int window, float scale,
        int chunk, float2* __restrict__ my_ml, float* __restrict__ my_acc, const KT kt,
        const VT vt) {
    __shared__ float qsh[ATT_MAX_D];
    __shared__ float wm[ATT_WARPS], wl[ATT_WARPS];
    __shared__ float wacc[ATT_WARPS][ATT_MAX_DV];
    const int s = blockIdx.x, h = blockIdx.y, t = blockIdx.z;
    const int lane = threadIdx.x, warp = threadIdx.y, tid = warp * 32 + lane;
    const int slot = slots[t], pos = positions[t];
    const int lo = window > 0 ? max(0, pos - window + 1) : 0;
    const int b = attn_lo != nullptr ? attn_lo[t] : pos + 1;
    const u32 bits = attn_mask != nullptr ? (u32)attn_mask[t] : 0u;
    const int hi = b + __popc(bits);      // logical keys [0, hi): the path's positions
    const int j0 = max(lo, s * chunk), j1 = min(hi, (s + 1) * chunk);
    if (slot < 0 || j0 >= j1) {
        if (tid == 0) *my_ml = make_float2(NEG_INF, 0.0f);
        return;
    }
    const float* qr = q + (size_t)t * q0 + (size_t)h * q1;
    for (int i = tid; i < D; i += 32 * ATT_WARPS) qsh[i] = qr[i];
    __syncthreads();
    const int hk = h / (H / Hkv);
    float m = NEG_INF, l = 0.0f, acc[NV];
#pragma unroll
    for (int i = 0; i < NV; i++) acc[i] = 0.0f;
    // Tiles of 32 keys, one key per lane: each lane dots q with its key, the warp takes the
    // tile's max and sum at once, then accumulates V over the tile's keys in order (lane d
    // holds dims d, d + 32, ...). Warp w takes the tiles starting at j0 + 32 (w + 4 i).
    // Each lane's key row in the pool (the block table read) is fetched one tile ahead, so
    // the table read overlaps the previous tile's work instead of preceding the key's loads;
    // the V pass takes each key's row from the lane that holds it (no table read).
    const int step = 32 * ATT_WARPS;
    int jn = j0 + 32 * warp + lane;
    int prow = jn < j1 ? (int)kv_page_row(table, max_blocks, lb, slot, key_row(jn, b, bits)) : 0;
    for (int base = j0 + 32 * warp; base < j1; base += step) {
        const int j = base + lane;
        bool ok = j < j1;
        const int my_row = prow;
        jn = j + step;
        prow = jn < j1 ? (int)kv_page_row(table, max_blocks, lb, slot, key_row(jn, b, bits)) : 0;
        float sc = NEG_INF;
        if (ok) {
            const size_t row = (size_t)my_row * Hkv + hk;
            float dot = 0.0f;                 // the products in order of i, 8 per load
#pragma unroll 16
            for (int i0 = 0; i0 < D; i0 += 8) {
                float kv[8];
                kt.load8(kq, kd, row, D, i0, kv);
#pragma unroll
                for (int u = 0; u < 8; u++) dot += qsh[i0 + u] * kv[u];
            }
            sc = dot * scale;
        }
        const float mn = fmaxf(m, warp_max(sc));      // finite: lane 0's key is valid
        const float corr = expf(m - mn);
        const float p = ok ? expf(sc - mn) : 0.0f;
        l = l * corr + warp_sum(p);
#pragma unroll
        for (int i = 0; i < NV; i++) acc[i] *= corr;
        const int n = min(32, j1 - base);
        // PASS keys per pass: their V elements are loaded before any is accumulated (the
        // loads in flight together), then added in key order, as one key at a time would.
        constexpr int PASS = NV <= 4 ? VT::PASS128 : KT::PASS256_AS_KEY;
#pragma unroll 1
        for (int u0 = 0; u0 < n; u0 += PASS) {
            float vv[PASS][NV];
#pragma unroll
            for (int du = 0; du < PASS; du++) {
                const size_t row = (size_t)__shfl_sync(FULL_MASK, my_row, min(u0 + du, n - 1))
                                   * Hkv + hk;
                vt.vrow(vq, vd, row, Dv, lane, vv[du]);
            }
#pragma unroll
            for (int du = 0; du < PASS; du++) {
                const float pu = __shfl_sync(FULL_MASK, p, (u0 + du) & 31);
                if (u0 + du < n) {
#pragma unroll
                    for (int i = 0; i < NV; i++) acc[i] += pu * vv[du][i];
                }
            }
        }
        m = mn;
    }
    if (lane == 0) { wm[warp] = m; wl[warp] = l; }
#pragma unroll
    for (int i = 0; i < NV; i++) {
        const int d = lane + 32 * i;
        if (d < Dv) wacc[warp][d] = acc[i];
    }
    __syncthreads();
    float M = NEG_INF;
    for (int w = 0; w < ATT_WARPS; w++) if (wl[w] > 0.0f) M = fmaxf(M, wm[w]);
    for (int d = tid; d < Dv; d += 32 * ATT_WARPS) {
        float a = 0.0f;
        for (int w = 0; w < ATT_WARPS; w++)
            if (wl[w] > 0.0f) a += wacc[w][d] * expf(wm[w] - M);
        my_acc[d] = a;
    }
    if (tid == 0) {
        float L = 0.0f;
        for (int w = 0; w < ATT_WARPS; w++) if (wl[w] > 0.0f) L += wl[w] * expf(wm[w] - M);
        *my_ml = make_float2(M, L);
    }
}

// Merge S partials in split order into one output row (and its 8-bit blocks when qa is set).
// Called by a whole (32, 4) block.
__device__ __forceinline__ void attn_merge(const float2* __restrict__ ml,
                                           const float* __restrict__ acc, int S, int Dv,
                                           bool valid, float* __restrict__ orow,
                                           signed char* __restrict__ qa,
                                           float2* __restrict__ ads) {
    __shared__ float res[ATT_MAX_DV];
    __shared__ float sl[32 * ATT_WARPS], se[32 * ATT_WARPS], wmax[ATT_WARPS];
    const int tid = threadIdx.y * 32 + threadIdx.x, nt = 32 * ATT_WARPS;
    // M = max m_s over splits with l_s > 0 (a max: any order), one load per thread in flight
    float M = NEG_INF;
    for (int s = tid; s < S; s += nt) {
        const float2 p = __ldcg(ml + s);
        if (p.y > 0.0f) M = fmaxf(M, p.x);
    }
    M = warp_max(M);
    if (threadIdx.x == 0) wmax[threadIdx.y] = M;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < ATT_WARPS; w++) M = fmaxf(M, wmax[w]);
    // L = sum_s l_s e_s and a_d = sum_s acc_s[d] e_s in split order (splits with l_s = 0
    // skipped), e_s = exp(m_s - M): the splits' (l_s, e_s) staged in shared memory nt at a
    // time, each thread's acc loads of a chunk issued together (loaded, then used or not).
    float L = 0.0f, a[ATT_MAX_DV / (32 * ATT_WARPS)] = {};
    for (int c0 = 0; valid && c0 < S; c0 += nt) {
        const int n = min(nt, S - c0);
        if (tid < n) {
            const float2 p = __ldcg(ml + c0 + tid);
            sl[tid] = p.y;
            se[tid] = p.y > 0.0f ? expf(p.x - M) : 0.0f;
        }
        __syncthreads();
        for (int u = 0; u < n; u++)
            if (sl[u] > 0.0f) L += sl[u] * se[u];
#pragma unroll
        for (int i = 0; i < ATT_MAX_DV / (32 * ATT_WARPS); i++) {
            const int d = tid + nt * i;
            if (d >= Dv) break;
            const float* ad = acc + (size_t)c0 * Dv + d;
#pragma unroll 8
            for (int u = 0; u < n; u++) {
                const float v = __ldcg(ad + (size_t)u * Dv);
                if (sl[u] > 0.0f) a[i] += v * se[u];
            }
        }
        __syncthreads();                      // sl, se are rewritten by the next chunk
    }
#pragma unroll
    for (int i = 0; i < ATT_MAX_DV / (32 * ATT_WARPS); i++) {
        const int d = tid + nt * i;
        if (d >= Dv) break;
        const float o = valid ? a[i] / L : 0.0f;
        orow[d] = o;
        res[d] = o;
    }
    if (qa == nullptr) return;
    __syncthreads();
    for (int g = threadIdx.y; g < Dv / 32; g += ATT_WARPS)
        quant_group(res[32 * g + threadIdx.x], qa + 32 * g, ads + g);
}

template <class KT, class VT, int NV>
__device__ __forceinline__ void attn_fused(
        const float* __restrict__ q, int q0, int q1, int H, int Hkv, int D, int Dv,
        const u8* __restrict__ kq, const u8* __restrict__ kd, const u8* __restrict__ vq,
        const u8* __restrict__ vd, const int* __restrict__ slots, const int* __restrict__ positions,
        const int* __restrict__ attn_lo, const int* __restrict__ attn_mask,
        const int* __restrict__ table, int max_blocks, int lb, int window, float scale,
        int chunk, float2* __restrict__ part_ml,
        float* __restrict__ part_acc, int* __restrict__ counters, float* __restrict__ out,
        int o0, int o1, signed char* __restrict__ qa, float2* __restrict__ ads, int kk,
        int vk) {
    const int s = blockIdx.x, h = blockIdx.y, t = blockIdx.z;
    // The row's splits: those that can hold one of its keys [0, hi) (one for a padding row,
    // whose merge writes zeros). The others return at once and take no part in the count, so
    // a short row pays for its own splits, not for n_ctx's; the merge skips splits without
    // keys anyway, so the bits are the same.
    const int hi = (attn_lo != nullptr ? attn_lo[t] : positions[t] + 1)
                   + (attn_mask != nullptr ? __popc((u32)attn_mask[t]) : 0);
    const int S = slots[t] < 0 ? 1 : min((int)gridDim.x, max(1, (hi + chunk - 1) / chunk));
    if (s >= S) return;
    const size_t part = ((size_t)t * H + h) * gridDim.x + s;
    attn_split<KT, VT, NV>(q, q0, q1, H, Hkv, D, Dv, kq, kd, vq, vd, slots, positions,
                           attn_lo, attn_mask, table, max_blocks, lb, window, scale, chunk,
                           part_ml + part, part_acc + part * Dv, KT(kk), VT(vk));
    // Last block of (t, h) in: merge. The fences order the partials before the count.
    __shared__ int last;
    __threadfence();
    __syncthreads();
    const int tid = threadIdx.y * 32 + threadIdx.x;
    if (tid == 0) last = atomicAdd(&counters[(size_t)t * H + h], 1) == S - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    attn_merge(part_ml + (part - s), part_acc + (part - s) * Dv, S, Dv, slots[t] >= 0,
               out + (size_t)t * o0 + (size_t)h * o1,
               qa ? qa + (size_t)t * H * Dv + (size_t)h * Dv : nullptr,
               qa ? ads + ((size_t)t * H * Dv + (size_t)h * Dv) / 32 : nullptr);
    if (tid == 0) counters[(size_t)t * H + h] = 0;
}

// (32 * ATT_WARPS, 4): with the minimum block count stated ptxas keeps every variant in <= 128
// registers without spills; left to its own heuristics it spilled a few bytes in some K/V type
// pairs.
#define ATTN_KERNEL(kn, KT, vn, VT, nv, dmax)                                                \
    extern "C" __global__ void __launch_bounds__(32 * ATT_WARPS, 4) attn_##kn##_##vn##_d##dmax( \
            const float* q, int q0, int q1, int H, int Hkv, int D, int Dv, const u8* kq,     \
            const u8* kd, const u8* vq, const u8* vd, const int* slots, const int* positions, \
            const int* attn_lo, const int* attn_mask, const int* table, int max_blocks,      \
            int lb, int window, float scale, int chunk, float2* part_ml, float* part_acc,    \
            int* counters, float* out, int o0, int o1, signed char* qa, float2* ads, int kk, \
            int vk) {                                                                        \
        PDL_ENTRY();                                                                         \
        attn_fused<KT, VT, nv>(q, q0, q1, H, Hkv, D, Dv, kq, kd, vq, vd, slots, positions,    \
                               attn_lo, attn_mask, table, max_blocks, lb, window, scale,     \
                               chunk, part_ml, part_acc, counters, out, o0, o1, qa, ads,     \
                               kk, vk);                                                      \
    }
#define ATTN_SIZES(kn, KT, vn, VT) ATTN_KERNEL(kn, KT, vn, VT, 4, 128) \
    ATTN_KERNEL(kn, KT, vn, VT, 8, 256)
FOR_KV_READER_PAIRS(ATTN_SIZES)
