// rope_kv.cu: the attention inputs of one layer in one pass (RoPE + KV write):
//   q[t, h]  <- rope(norm_q(q[t, h]))                       for h < H        (in place)
//   K[row(slot[t], kvp[t]), h] <- store_K(rope(norm_k(k[t, h])))  for h < Hkv
//   V[row(slot[t], kvp[t]), h] <- store_V(v[t, h])                for h < Hkv
// kvp = kv_positions (tree verify rows write their K/V at committed + node index while RoPE
// uses committed + depth); kvp[t] = pos[t] when kv_positions is null. row(s, p) is the paged
// cache's pool row table[s, p >> lb] * 2^lb + (p & (2^lb - 1)) (common.cuh kv_page_row; table
// (n_slots, max_blocks) int32, 2^lb = block size).
// norm_x(r) = r * (1 / sqrt(sum(r^2) / D + eps)) * w_x per head (Qwen3's q/k norms; identity
// when w_x is null); rope rotates the first 2 * half dims by cos/sin[pos[t], i], pairs (2i, 2i+1)
// (normal) or (i, i + half) (neox), as elementwise.cu's rope (both through rope.cuh); store_X is
// the cache type's rounding (kv_quant.cuh). Every value is rounded as the separate rms_norm, rope
// and kv_store kernels round it: the fusion changes no bit. Rows with slot[t] < 0 are padding: q
// is still rotated (pos is valid), nothing is stored.
// q, k, v: (T, H | Hkv, D | Dv) views with strides (s0, s1, 1); D <= 512.
// Launch: grid (T, H + 2 Hkv), block norm_block(D) = min(NORM_MAX_THREADS = 256, 32 ceil(D / 32))
// threads, the
// block size elementwise.cu's rms_norm uses for rows of D (so the norm's sum has the same
// order); blocks j < H rotate q heads, H <= j < H + Hkv k heads, the rest store v heads.
#include "pdl.cuh"
#include "act_quant.cuh"
#include "kv_quant.cuh"
#include "rope.cuh"

// ROPE_KV_MAX_D (512) and NORM_MAX_THREADS (256) come as -D defines
// (service/backends/cuda/kernels.py).
#if !defined(ROPE_KV_MAX_D) || !defined(NORM_MAX_THREADS)
#error "compile with the shared -D defines (service/backends/cuda/sources.py OPTIONS)"
#endif

template <class KP, class VP>
__device__ __forceinline__ void rope_kv(
        float* __restrict__ q, int q0, int q1, const float* __restrict__ k, int k0, int k1,
        const float* __restrict__ v, int v0, int v1, int H, int Hkv, int D, int Dv,
        const float* __restrict__ qn, const float* __restrict__ kn, float eps,
        const int* __restrict__ positions, const int* __restrict__ slots,
        const int* __restrict__ kv_positions, const float* __restrict__ cos_t,
        const float* __restrict__ sin_t, int half, int neox,
        const int* __restrict__ table, int max_blocks, int lb, u8* kc, u16* ks, u8* vc,
        u16* vs) {
    __shared__ float row[ROPE_KV_MAX_D];
    const int t = blockIdx.x, j = blockIdx.y;
    const int pos = positions[t], slot = slots[t];
    const int kvp = kv_positions != nullptr ? kv_positions[t] : pos;
    if (j >= H + Hkv) {                                   // a V head: store only
        const int h = j - H - Hkv;
        if (slot >= 0)
            VP::put(v + (size_t)t * v0 + (size_t)h * v1, Dv,
                    kv_page_row(table, max_blocks, lb, slot, kvp) * Hkv + h, vc, vs);
        return;
    }
    const bool is_q = j < H;
    const int h = is_q ? j : j - H;
    if (!is_q && slot < 0) return;                        // block-uniform
    const float* src = is_q ? q + (size_t)t * q0 + (size_t)h * q1
                            : k + (size_t)t * k0 + (size_t)h * k1;
    const float* nw = is_q ? qn : kn;
    if (nw != nullptr) {
        const float r = block_inv_rms(src, D, eps);
        for (int i = threadIdx.x; i < D; i += blockDim.x)
            row[i] = __fmul_rn(__fmul_rn(src[i], r), nw[i]);
    } else {
        for (int i = threadIdx.x; i < D; i += blockDim.x) row[i] = src[i];
    }
    __syncthreads();
    if (pos >= 0) rope_rotate(row, cos_t, sin_t, pos, half, neox);
    __syncthreads();
    if (is_q) {
        float* dst = q + (size_t)t * q0 + (size_t)h * q1;
        for (int i = threadIdx.x; i < D; i += blockDim.x) dst[i] = row[i];
    } else {
        KP::put(row, D, kv_page_row(table, max_blocks, lb, slot, kvp) * Hkv + h, kc, ks);
    }
}

#define ROPE_KV_KERNEL(kn_, KP, vn_, VP)                                                     \
    extern "C" __global__ void __launch_bounds__(NORM_MAX_THREADS) rope_kv_##kn_##_##vn_(   \
            float* q, int q0, int q1, const float* k, int k0, int k1, const float* v, int v0, \
            int v1, int H, int Hkv, int D, int Dv, const float* qn, const float* kn, float eps, \
            const int* positions, const int* slots, const int* kv_positions,                 \
            const float* cos_t, const float* sin_t, int half, int neox, const int* table,    \
            int max_blocks, int lb, u8* kc, u16* ks, u8* vc, u16* vs) {                      \
        PDL_ENTRY();                                                                         \
        rope_kv<KP, VP>(q, q0, q1, k, k0, k1, v, v0, v1, H, Hkv, D, Dv, qn, kn, eps,          \
                        positions, slots, kv_positions, cos_t, sin_t, half, neox, table,      \
                        max_blocks, lb, kc, ks, vc, vs);                                      \
    }
// every (K, V) pair of kv_quant.cuh's types, K outermost
#define ROPE_KV_V(kn_, KP) ROPE_KV_KERNEL(kn_, KP, f16, KvPutF16)                           \
    ROPE_KV_KERNEL(kn_, KP, bf16, KvPutBF16) ROPE_KV_KERNEL(kn_, KP, q8_0, KvPutQ8_0)        \
    ROPE_KV_KERNEL(kn_, KP, q5_1, KvPutQ5_1) ROPE_KV_KERNEL(kn_, KP, q5_0, KvPutQ5_0)        \
    ROPE_KV_KERNEL(kn_, KP, q4_1, KvPutQ4_1) ROPE_KV_KERNEL(kn_, KP, q4_0, KvPutQ4_0)
FOR_KV_TYPES(ROPE_KV_V)
