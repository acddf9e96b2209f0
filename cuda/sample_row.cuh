// sample_row.cuh: the device functions of sample_rows (sampling.cu states the chain it computes,
// its shapes and its launch: one block of SAMPLE_THREADS threads per logits row). Here: the step
// format's names (-D defines), the counter RNG (counter_rng.py), order-preserving float keys, the
// block's shared scratch with its fixed-order sums and bests, and the top-k / min-p / top-p cuts
// and the draw over a row's tokens in ascending id order.
#ifndef SPECSTREAM_SAMPLE_ROW_CUH
#define SPECSTREAM_SAMPLE_ROW_CUH

#include "common.cuh"
#include "argmax.cuh"

#if !defined(SAMPLE_THREADS)
#error "compile with the shared -D defines (service/backends/cuda/sources.py OPTIONS)"
#endif
#define SAMPLE_WARPS (SAMPLE_THREADS / 32)
#define CAND_MAX 1024    // survivors compacted into shared memory (sample_rows)
// The step format (service/backends/step_format.py) arrives as -D defines: TOP_MAX, OUT_WORDS,
// N_PARAMS and the record's word indices P_<FIELD>.
#if !defined(TOP_MAX) || !defined(OUT_WORDS) || !defined(N_PARAMS) || !defined(P_POSITION)
#error "compile with the step format's -D defines (service/backends/cuda/sources.py OPTIONS)"
#endif

typedef unsigned long long u64;

// counter_rng.py: mix(z) = splitmix64's finalizer; r = mix(mix(seed) + GOLDEN * (index + 1))
__device__ __forceinline__ u64 mix64(u64 z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

__device__ __forceinline__ double counter_uniform(u64 seed, u64 index) {
    const u64 r = mix64(mix64(seed) + 0x9E3779B97F4A7C15ull * (index + 1ull));
    return (double)(r >> 40) * 5.9604644775390625e-08;    // 2^-24
}

// Order-preserving key of a float: a < b  <=>  okey(a) < okey(b) (both zeros map to +0's key).
__device__ __forceinline__ u32 okey(float f) {
    const u32 b = __float_as_uint(f == 0.0f ? 0.0f : f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

struct SampleShared {
    double d[SAMPLE_WARPS];
    float f[SAMPLE_WARPS];
    int i[SAMPLE_WARPS];
    double part[SAMPLE_THREADS];      // per-thread sums, then their running sums
    int last[SAMPLE_THREADS];         // per-thread last id with a positive weight / counts
    int hist[SAMPLE_WARPS * 256];     // per-warp radix histograms
    float cval[CAND_MAX];             // compacted candidates: logits
    int cid[CAND_MAX];                // ... and their ids, ascending
    int cut;                          // the id a cut search found
    int crosser;                      // the thread whose range crosses the target (-1: none)
    int digit, need, n_cand;
};

// Block-wide sum in a fixed order (warp butterflies, then warps 0..15 in order); every thread
// returns the same value.
__device__ double block_sum(double v, SampleShared& sh) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) sh.d[threadIdx.x / 32] = v;
    __syncthreads();
    double t = 0.0;
    for (int w = 0; w < SAMPLE_WARPS; w++) t += sh.d[w];
    return t;
}

// Block-wide best (value desc, index asc) pair; every thread returns the same pair.
__device__ void block_best(float& v, int& i, SampleShared& sh) {
    warp_argmax(v, i);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) { sh.f[threadIdx.x / 32] = v; sh.i[threadIdx.x / 32] = i; }
    __syncthreads();
    v = sh.f[0];
    i = sh.i[0];
    for (int w = 1; w < SAMPLE_WARPS; w++) better(v, i, sh.f[w], sh.i[w]);
}

// The block's first maximum of l[0, V) (argmax.cuh: each thread scans i = tid, tid +
// SAMPLE_THREADS, ...), then block_best; every thread returns the same pair.
__device__ __forceinline__ void block_argmax(const float* l, int V, float& v, int& i,
                                             SampleShared& sh) {
    thread_argmax(l, V, threadIdx.x, SAMPLE_THREADS, v, i);
    block_best(v, i, sh);
}

// The tokens a row's filters look at: n logits l[j] with ids id(j) (cid = null: id(j) = j, the
// whole row; else candidates compacted into shared memory in ascending id order). Token id
// survives top-k when key > kk or (key == kk and id <= kcut), min-p when w >= min_p (min_p = -1:
// off), top-p when key > pk or (key == pk and id <= pcut).
struct RowState {
    const float* l;
    const int* cid;
    int n;
    double lmax, min_p, t;            // t: the temperature
    u32 kk, pk;
    int kcut, pcut;
};

__device__ __forceinline__ int rid(const RowState& r, int j) { return r.cid ? r.cid[j] : j; }

__device__ __forceinline__ bool top_k_keeps(const RowState& r, int j, u32 key) {
    return key > r.kk || (key == r.kk && rid(r, j) <= r.kcut);
}

// Whether j survives top-k and min-p; w = exp(l - l_max) (0 when it does not survive).
__device__ __forceinline__ bool s1_keeps(const RowState& r, int j, u32 key, double& w) {
    w = 0.0;
    if (!top_k_keeps(r, j, key)) return false;
    const double e = exp((double)r.l[j] - r.lmax);
    if (!(e >= r.min_p)) return false;
    w = e;
    return true;
}

__device__ __forceinline__ double s1_weight(const RowState& r, int j, u32 key) {
    double w;
    s1_keeps(r, j, key, w);
    return w;
}

enum CutMode { CUT_K_TIES = 0, CUT_P_TIES = 1, CUT_DRAW = 2 };

// The weight of j in a cut search (-1: not a candidate, so never the crossing id).
__device__ __forceinline__ double cut_weight(const RowState& r, int mode, int j) {
    const u32 key = okey(r.l[j]);
    if (mode == CUT_K_TIES) return key == r.kk ? 1.0 : -1.0;
    double w;
    const bool s1 = s1_keeps(r, j, key, w);
    if (mode == CUT_P_TIES) return key == r.pk && s1 ? w : -1.0;
    if (!s1 || !(key > r.pk || (key == r.pk && rid(r, j) <= r.pcut))) return -1.0;
    return exp(((double)r.l[j] - r.lmax) / r.t);
}

// Walking the tokens in ascending id order with a running sum starting at `base`, the first id
// whose sum reaches the target (>= target; CUT_DRAW: > u * total, `target` being u). When
// rounding leaves none, the last candidate id (-1 when there is no candidate).
__device__ int id_cut(const RowState& r, int mode, double base, double target, SampleShared& sh) {
    const int tid = threadIdx.x;
    const int chunk = (r.n + SAMPLE_THREADS - 1) / SAMPLE_THREADS;
    const int j0 = tid * chunk, j1 = min(r.n, j0 + chunk);
    double part = 0.0;
    int last = -1;
    for (int j = j0; j < j1; j++) {
        const double e = cut_weight(r, mode, j);
        if (e >= 0.0) { part += e; last = rid(r, j); }
    }
    __syncthreads();
    sh.part[tid] = part;
    sh.last[tid] = last;
    __syncthreads();
    if (tid == 0) {   // running sums in thread order; the target of a draw needs the total
        double s = base, total = base;
        for (int t = 0; t < SAMPLE_THREADS; t++) total += sh.part[t];
        const bool draw = mode == CUT_DRAW;
        if (draw) target = target * total;
        int crosser = -1, last_id = -1;
        for (int t = 0; t < SAMPLE_THREADS; t++) {
            const double before = s;
            s += sh.part[t];
            sh.part[t] = before;
            if (sh.last[t] >= 0) last_id = sh.last[t];
            if (crosser < 0 && sh.last[t] >= 0 && (draw ? s > target : s >= target)) crosser = t;
        }
        sh.crosser = crosser;
        sh.cut = crosser < 0 ? last_id : sh.last[crosser];
        sh.d[0] = target;
    }
    __syncthreads();
    if (tid == sh.crosser) {
        const bool draw = mode == CUT_DRAW;
        const double tgt = sh.d[0];
        double s = sh.part[tid];
        for (int j = j0; j < j1; j++) {
            const double e = cut_weight(r, mode, j);
            if (e >= 0.0) {
                s += e;
                if (draw ? s > tgt : s >= tgt) { sh.cut = rid(r, j); break; }
            }
        }
    }
    __syncthreads();
    return sh.cut;
}

// The k-th largest key (1 <= k <= n, counted with multiplicity) by radix selection, 8 bits per
// pass from the top: per-warp histograms (integer counts, so exact), merged per bin, and the
// bin where the count from the top reaches k. *need: how many tokens equal to the result the
// first k take (the others of the k are larger).
__device__ u32 kth_largest_key(const RowState& r, int k, int* need, SampleShared& sh) {
    const int tid = threadIdx.x, warp = tid / 32;
    u32 prefix = 0u, mask = 0u;
    int left = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        __syncthreads();
        for (int b = tid; b < SAMPLE_WARPS * 256; b += SAMPLE_THREADS) sh.hist[b] = 0;
        __syncthreads();
        for (int j = tid; j < r.n; j += SAMPLE_THREADS) {
            const u32 key = okey(r.l[j]);
            if ((key & mask) == prefix)
                atomicAdd(&sh.hist[warp * 256 + ((key >> shift) & 255u)], 1);
        }
        __syncthreads();
        for (int b = tid; b < 256; b += SAMPLE_THREADS) {
            int c = 0;
            for (int w = 0; w < SAMPLE_WARPS; w++) c += sh.hist[w * 256 + b];
            sh.hist[b] = c;
        }
        __syncthreads();
        if (tid == 0) {
            int d = 255;
            while (d > 0 && sh.hist[d] < left) left -= sh.hist[d--];
            sh.digit = d;
            sh.need = left;
        }
        __syncthreads();
        prefix |= (u32)sh.digit << shift;
        mask |= 255u << shift;
        left = sh.need;
    }
    *need = left;
    return prefix;
}

// The largest key t with F(t) >= target, F(t) = the S1 mass of the tokens with key >= t;
// F(lo) >= target must hold.
__device__ u32 bisect_mass(const RowState& r, double target, u32 lo, u32 hi, SampleShared& sh) {
    while (lo < hi) {
        const u32 mid = (u32)(((u64)lo + (u64)hi + 1ull) >> 1);
        double f = 0.0;
        for (int j = threadIdx.x; j < r.n; j += SAMPLE_THREADS) {
            const u32 key = okey(r.l[j]);
            if (key >= mid) f += s1_weight(r, j, key);
        }
        f = block_sum(f, sh);
        if (f >= target) lo = mid; else hi = mid - 1;
    }
    return lo;
}

// Sum over tokens with key >= t of their S1 mass (s1 = true) or top-k mass (s1 = false).
__device__ double pass_sum(const RowState& r, bool s1, u32 t, SampleShared& sh) {
    double f = 0.0;
    for (int j = threadIdx.x; j < r.n; j += SAMPLE_THREADS) {
        const u32 key = okey(r.l[j]);
        if (key < t) continue;
        if (s1) f += s1_weight(r, j, key);
        else if (top_k_keeps(r, j, key)) f += exp((double)r.l[j] - r.lmax);
    }
    return block_sum(f, sh);
}

// When at most CAND_MAX tokens survive top-k and min-p, copy them (logit, id) into shared
// memory in ascending id order and point r at them (their filters then keep everything): the
// top-p search and the draw read CAND_MAX entries instead of the vocabulary.
__device__ void compact_survivors(RowState& r, SampleShared& sh) {
    const int tid = threadIdx.x;
    const int chunk = (r.n + SAMPLE_THREADS - 1) / SAMPLE_THREADS;
    const int j0 = tid * chunk, j1 = min(r.n, j0 + chunk);
    int cnt = 0;
    double w;
    for (int j = j0; j < j1; j++) cnt += s1_keeps(r, j, okey(r.l[j]), w) ? 1 : 0;
    __syncthreads();
    sh.last[tid] = cnt;
    __syncthreads();
    if (tid == 0) {
        int s = 0;
        for (int t = 0; t < SAMPLE_THREADS; t++) {
            const int c = sh.last[t];
            sh.last[t] = s;
            s += c;
        }
        sh.n_cand = s;
    }
    __syncthreads();
    const int total = sh.n_cand;
    if (total > CAND_MAX) return;     // the same answer in every thread
    int o = sh.last[tid];
    for (int j = j0; j < j1; j++) {
        if (s1_keeps(r, j, okey(r.l[j]), w)) {
            sh.cval[o] = r.l[j];
            sh.cid[o] = rid(r, j);
            o++;
        }
    }
    __syncthreads();
    r.l = sh.cval;
    r.cid = sh.cid;
    r.n = total;
    r.kk = 0u;
    r.kcut = 0x7fffffff;
    r.min_p = -1.0;
}

// The drawn token of a non-greedy row (r over the whole penalised row).
__device__ int draw_token(RowState& r, int top_k, float top_p, u64 seed, int index,
                          SampleShared& sh) {
    const u32 kmax = okey((float)r.lmax);
    r.kk = 0u; r.kcut = 0x7fffffff; r.pk = 0u; r.pcut = 0x7fffffff;
    if (top_k > 0 && top_k < r.n) {
        int need;
        r.kk = kth_largest_key(r, top_k, &need, sh);
        r.kcut = id_cut(r, CUT_K_TIES, 0.0, (double)need, sh);
    }
    const double z = top_p < 1.0f ? pass_sum(r, false, 0u, sh) : 0.0;   // the top-k mass
    compact_survivors(r, sh);
    if (top_p < 1.0f) {
        const double target = (double)top_p * z;
        if (pass_sum(r, true, 0u, sh) >= target) {
            r.pk = bisect_mass(r, target, r.kk, kmax, sh);    // every S1 key is >= kk
            const double above = r.pk < 0xFFFFFFFFu ? pass_sum(r, true, r.pk + 1u, sh) : 0.0;
            r.pcut = id_cut(r, CUT_P_TIES, above, target, sh);
        }
    }
    return id_cut(r, CUT_DRAW, 0.0, counter_uniform(seed, (u64)(unsigned)index), sh);
}

#endif  // SPECSTREAM_SAMPLE_ROW_CUH
