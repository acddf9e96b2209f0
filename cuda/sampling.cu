// sampling.cu: token choice on the GPU, so only int32 ids (and log-probabilities when asked)
// cross PCIe.
//
// argmax_rows: out[t] = the lowest index i with logits[t, i] = max_i logits[t, i]
//   logits (T, V) f32 with row stride ld; out (T,) int32.
//   Launch: grid T, block ARGMAX_THREADS (1024). Thread k scans i = k, k + 1024, ... keeping the
//   first maximum;
//   a butterfly over (value, index) pairs (larger value, then lower index) inside each warp,
//   then warp 0 over the 32 warp winners: the result is np.argmax's.
//
// record_tokens: hist[slots[t], positions[t]] = ids[t] for rows with slots[t] >= 0 (the token
//   history the repetition penalty reads). ids, slots, positions (T,) int32; hist (n_slots,
//   n_ctx) int32. Launch: grid ceil(T / 128), block 128.
//
// chosen_ids: out[r] = records[r * ld] for r < L, the chosen id (word 0) of sample_rows' output
//   records, so a draft chain feeds each step's choice to the next step's input on the device.
//   records (L, ld) int32 (ld = OUT_WORDS); out (L,) int32. Launch: grid ceil(L / 128), block 128.
//
// feed_ids: ids[t] = records[src[t] * ld] where 0 <= src[t] < L, else ids[t] unchanged: a step's
//   input ids taken from the previous step's choices before the host has read them (the
//   overlapped engine loop). records (L, ld) int32; src, ids (T,) int32.
//   Launch: grid ceil(T / 128), block 128.
//
// sample_rows: one token per logits row, exactly the chain of service/backends/cpu_sampling.py
//   (its docstring is the specification; ties and orders as there):
//     l = logits with penalty r on hist[slot, max(0, pos - n + 1) .. pos]: l/r if l > 0 else l*r
//     frequency f / presence p: c_i = count of id i in hist[slot, gen_start .. pos];
//         l_i -= f32(c_i) * f + p where c_i > 0 (each operation rounded to f32, no FMA)
//     adjustments: l_i += d_i for the row's pairs adj[adj_start .. adj_start + adj_count)
//     token mask (P_MASK >= 0 and mask_w > 0): l_i = -inf where bit i of masks row P_MASK
//         (mask_w int32 words, bit i % 32 of word i / 32) is clear
//     greedy (T == 0): argmax l, lowest id on ties
//     top-k: first k of (l desc, id asc);  w = exp(l - l_max) (f64), z = sum of w over top-k
//     min-p: w >= min_p;  top-p: shortest (l desc, id asc) prefix with sum w >= top_p * z
//     draw: q = exp((l - l_max) / T) (f64); u = counter_uniform(seed, index) (counter_rng.py,
//           splitmix64 in uint64, bit for bit); the first survivor in ascending id order whose
//           running q sum exceeds u * sum q (the last survivor if rounding leaves none)
//     log-probs (n_top >= 0): log_softmax of the raw logits in f64, stored as f32: the chosen
//           token's (the P_SCORE token's when >= 0) and the n_top largest (logit desc, id asc)
//   logits (L, V) f32 row stride ld; params (L, N_PARAMS) int32 (step_format.Param); hist as
//   above; adj (K, 2) int32 [id, delta f32 bits] (step_format.py; unique ids within a row);
//   masks (R, mask_w) int32 token masks (mask_w 0: none; every row's P_MASK is then ignored);
//   work (L, V) f32 per-row scratch (penalised logits, sized once by prepare_sampling);
//   counts (L, V) int32 per-row scratch, all zero on entry and on exit (the penalties' counts:
//   integer atomics, then one atomicExch per distinct id reads and clears its count, so exactly
//   one thread applies it);
//   out (L, OUT_WORDS) int32: [id, logprob bits, TOP_MAX ids, TOP_MAX logprob bits].
//   Launch: grid L, block SAMPLE_THREADS (512). No sorting, no scratch but the penalised row:
//   the top-k threshold is the k-th largest of the logits' order-preserving uint32 keys, found
//   by radix selection (4 passes of 8-bit histograms, integer counts); the survivors of top-k
//   and min-p, when at most CAND_MAX, are compacted into shared memory in id order; the top-p
//   threshold is found by bisection over the keys (<= 32 mass passes, over the compacted
//   survivors when they fit). Cuts inside runs of equal logits and the draw walk ids in order:
//   each thread owns a contiguous id range, thread 0 adds the per-thread sums in thread order,
//   and the thread whose range crosses the target rescans it. Every sum has a fixed order, so a
//   row's result never depends on the step it is in, and replays are bit-identical.
#include "pdl.cuh"
#include "common.cuh"
#include "argmax.cuh"
#include "sample_row.cuh"

// SAMPLE_THREADS (512) and ARGMAX_THREADS (1024) come as -D defines
// (service/backends/cuda/kernels.py).
#if !defined(SAMPLE_THREADS) || !defined(ARGMAX_THREADS)
#error "compile with the shared -D defines (service/backends/cuda/sources.py OPTIONS)"
#endif
static_assert(ARGMAX_THREADS == 32 * WARP, "warp 0 reduces the winners of 32 warps");

extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)
argmax_rows(const float* __restrict__ logits, int ld, int V, int* __restrict__ out) {
    PDL_ENTRY();
    __shared__ float sv[32];
    __shared__ int si[32];
    const int t = blockIdx.x, tid = threadIdx.x;
    float v;
    int i;
    thread_argmax(logits + (size_t)t * ld, V, tid, ARGMAX_THREADS, v, i);
    warp_argmax(v, i);
    if ((tid & 31) == 0) { sv[tid / 32] = v; si[tid / 32] = i; }
    __syncthreads();
    if (tid < 32) {
        v = sv[tid];
        i = si[tid];
        warp_argmax(v, i);
        if (tid == 0) out[t] = i;
    }
}

// ---------------------------------------------------------------- token history
extern "C" __global__ void record_tokens(const int* __restrict__ ids,
                                         const int* __restrict__ slots,
                                         const int* __restrict__ positions, int T, int n_slots,
                                         int n_ctx, int* __restrict__ hist) {
    PDL_ENTRY();
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= T) return;
    const int slot = slots[t], pos = positions[t];
    if (slot >= 0 && slot < n_slots && pos >= 0 && pos < n_ctx)
        hist[(size_t)slot * n_ctx + pos] = ids[t];
}

// ---------------------------------------------------------------- chosen ids
extern "C" __global__ void chosen_ids(const int* __restrict__ records, int ld, int L,
                                      int* __restrict__ out) {
    PDL_ENTRY();
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r < L) out[r] = records[(size_t)r * ld];
}

// ---------------------------------------------------------------- fed ids
extern "C" __global__ void feed_ids(const int* __restrict__ records, int ld, int L,
                                    const int* __restrict__ src, int T, int* __restrict__ ids) {
    PDL_ENTRY();
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= T) return;
    const int r = src[t];
    if (r >= 0 && r < L) ids[t] = records[(size_t)r * ld];
}

// ---------------------------------------------------------------- sampling
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
sample_rows(const float* logits, int ld, int V, const int* __restrict__ params,
            const int* __restrict__ hist, int n_ctx, const int* __restrict__ adj,
            const int* __restrict__ masks, int mask_w, float* work, int* __restrict__ counts,
            int* __restrict__ out) {
    PDL_ENTRY();
    // logits and work carry no __restrict__: the filters read the row through one pointer
    // that is either, and work is written in this kernel (no read-only cache loads for it)
    __shared__ SampleShared sh;
    const int row = blockIdx.x, tid = threadIdx.x;
    const int* P = params + (size_t)row * N_PARAMS;
    const float* x = logits + (size_t)row * ld;
    const float temperature = __int_as_float(P[P_TEMPERATURE]);
    const float penalty = __int_as_float(P[P_PENALTY]);
    const int n_win = P[P_REPEAT_LAST_N], slot = P[P_SLOT], pos = P[P_POSITION];
    const float freq = __int_as_float(P[P_FREQUENCY]), pres = __int_as_float(P[P_PRESENCE]);
    const int gen = P[P_GEN_START], adj0 = P[P_ADJ_START], n_adj = P[P_ADJ_COUNT];
    const bool repeat = penalty != 1.0f && n_win > 0 && slot >= 0;
    const bool count = (freq != 0.0f || pres != 0.0f) && slot >= 0 && gen <= pos;
    const int mask_row = mask_w > 0 ? P[P_MASK] : -1;
    const float* l = x;
    if (repeat || count || n_adj > 0 || mask_row >= 0) {
        float* w = work + (size_t)row * V;
        const int* h = hist + (size_t)max(slot, 0) * n_ctx;      // read only when slot >= 0
        for (int i = tid; i < V; i += SAMPLE_THREADS) w[i] = x[i];
        __syncthreads();
        // every occurrence of an id writes the same value: distinct ids are penalised once
        if (repeat) {
            for (int j = max(0, pos - n_win + 1) + tid; j <= pos; j += SAMPLE_THREADS) {
                const int id = h[j];
                if (id >= 0 && id < V) {
                    const float v = x[id];
                    w[id] = v > 0.0f ? v / penalty : v * penalty;
                }
            }
            __syncthreads();
        }
        if (count) {
            int* c = counts + (size_t)row * V;
            for (int j = gen + tid; j <= pos; j += SAMPLE_THREADS) {
                const int id = h[j];
                if (id >= 0 && id < V) atomicAdd(&c[id], 1);
            }
            __syncthreads();
            for (int j = gen + tid; j <= pos; j += SAMPLE_THREADS) {
                const int id = h[j];
                if (id < 0 || id >= V) continue;
                const int n = atomicExch(&c[id], 0);
                if (n > 0) w[id] = __fsub_rn(w[id], __fadd_rn(__fmul_rn((float)n, freq), pres));
            }
            __syncthreads();
        }
        for (int k = tid; k < n_adj; k += SAMPLE_THREADS) {
            const int* pair = adj + 2 * (size_t)(adj0 + k);
            const int id = pair[0];
            if (id >= 0 && id < V) w[id] = __fadd_rn(w[id], __int_as_float(pair[1]));
        }
        __syncthreads();
        if (mask_row >= 0) {                 // structured output: -inf where the bit is clear
            const int* m = masks + (size_t)mask_row * mask_w;
            for (int i = tid; i < V; i += SAMPLE_THREADS)
                if (!((m[i >> 5] >> (i & 31)) & 1)) w[i] = NEG_INF;
            __syncthreads();
        }
        l = w;
    }
    // argmax of l: the greedy choice, and l_max for the filters
    float bv;
    int bi;
    block_argmax(l, V, bv, bi, sh);
    int chosen = bi;
    if (temperature != 0.0f) {
        RowState r;
        r.l = l; r.cid = nullptr; r.n = V; r.lmax = (double)bv;
        const float min_p = __int_as_float(P[P_MIN_P]);
        r.min_p = min_p > 0.0f ? (double)min_p : -1.0;
        r.t = (double)temperature;
        const u64 seed = ((u64)(u32)P[P_SEED_HI] << 32) | (u64)(u32)P[P_SEED_LO];
        chosen = draw_token(r, P[P_TOP_K], __int_as_float(P[P_TOP_P]), seed, P[P_TOKEN_INDEX],
                            sh);
    }
    int* o = out + (size_t)row * OUT_WORDS;
    const int n_top = min(P[P_N_TOP], TOP_MAX);
    for (int j = tid; j < OUT_WORDS; j += SAMPLE_THREADS)
        o[j] = (j >= 2 && j < 2 + TOP_MAX) ? -1 : 0;
    if (tid == 0) o[0] = chosen;
    if (n_top < 0) return;
    // log_softmax of the raw logits, f64
    float mv;
    int mi;
    block_argmax(x, V, mv, mi, sh);
    double se = 0.0;
    for (int i = tid; i < V; i += SAMPLE_THREADS) se += exp((double)x[i] - (double)mv);
    const double lse = (double)mv + log(block_sum(se, sh));
    const int score = P[P_SCORE];          // a prompt token's log-probability, or the chosen's
    const int scored = score >= 0 && score < V ? score : chosen;
    if (tid == 0) o[1] = __float_as_int((float)((double)x[scored] - lse));
    // the n_top best (logit desc, id asc), one block-wide pass each
    float pv = __int_as_float(0x7f800000);
    int pi = -1;
    for (int k = 0; k < n_top && k < V; k++) {
        float v = NEG_INF;
        int i = 0x7fffffff;
        for (int j = tid; j < V; j += SAMPLE_THREADS) {
            const float xv = x[j];
            if ((xv < pv || (xv == pv && j > pi)) && (xv > v || i == 0x7fffffff)) {
                v = xv;
                i = j;
            }
        }
        block_best(v, i, sh);
        if (tid == 0) {
            o[2 + k] = i;
            o[2 + TOP_MAX + k] = __float_as_int((float)((double)v - lse));
        }
        pv = v;
        pi = i;
    }
}
