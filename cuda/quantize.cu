// quantize.cu: 8-bit activation blocks for the GEMVs, and KV-cache row stores.
//
// quantize_act: for each row c of x (C, K) f32 (row stride ldx) and each 32-group g:
//     amax = max |x|,  d = amax / 127,  q = rint(x / d) (0 when amax = 0),  s = sum q
//     qa[c, 32g + l] = q (int8), ads[c, g] = (d, s)
//   so |x - d q| <= d / 2 per element (act_quant.cuh quant_group). The CPU backend's
//   act_quant="gpu" mode rounds the same way (numpy float32 division and rint), so GPU and CPU
//   see identical activations. Launch: block (32, QUANT_WARPS), one warp per (row, group);
//   grid ceil(C * K/32 / QUANT_WARPS).
//
// kv_store_<type>: cache[row(slot[t], pos[t]), h, :] = round(src[t, h, :]) for t < T, h < Hkv,
//   with src a (T, Hkv, D) view (strides st, sh, 1) and the cache (n_blocks * 2^lb, Hkv, D) of
//   the type's codes and f16 scales, rounded as kv_quant.cuh states. row(s, p) is the paged
//   cache's pool row table[s, p >> lb] * 2^lb + (p & (2^lb - 1)) (common.cuh kv_page_row;
//   table (n_slots, max_blocks) int32, 2^lb = block size). Rows with slot[t] < 0 are
//   padding and are skipped. Launch: grid (T, Hkv), block (32, ceil(D / 32)): one warp per
//   32-group of the row. (The decode path stores K and V inside rope_kv.cu; this kernel serves
//   steps that write the cache directly.)
//
// kv_move: for m = 0 .. n - 1 IN ORDER, every plane p of the cache (each layer's K and V codes
//   and scales), the bytes of logical position src[m] of slot slots[m] are copied to logical
//   position dst[m] of the same slot, both through the block table (row() above):
//   plane[p][row(slots[m], dst[m]) rb_p + i] = plane[p][row(slots[m], src[m]) rb_p + i]
//   for i < rb_p (rb_p = row_bytes[p], the bytes of one position: Hkv heads of codes or
//   scales). Tree compaction (service/engine/tree.py): a later move may read a row an earlier
//   one wrote, so one block walks a plane's moves in order with a barrier between them.
//   planes (P,) u64 device pointers, row_bytes (P,) i32. Launch: grid (P,), block (256,).
#include "pdl.cuh"
#include "act_quant.cuh"
#include "kv_quant.cuh"

// QUANT_WARPS (4) comes as a -D define (service/backends/cuda/kernels.py).
#if !defined(QUANT_WARPS)
#error "compile with the shared -D defines (service/backends/cuda/sources.py OPTIONS)"
#endif

extern "C" __global__ void __launch_bounds__(32 * QUANT_WARPS)
quantize_act(const float* __restrict__ x, int ldx, int C, int K, signed char* __restrict__ qa,
             float2* __restrict__ ads) {
    PDL_ENTRY();
    const int G = K / 32;
    const int item = blockIdx.x * QUANT_WARPS + threadIdx.y;
    if (item >= C * G) return;
    const int c = item / G, g = item % G;
    quant_group(x[(size_t)c * ldx + 32 * g + threadIdx.x], qa + (size_t)c * K + 32 * g,
                ads + (size_t)c * G + g);
}

template <class KP>
__device__ __forceinline__ void kv_store(const float* __restrict__ src, int st, int sh, int D,
                                         const int* __restrict__ slots,
                                         const int* __restrict__ positions,
                                         const int* __restrict__ table, int max_blocks, int lb,
                                         int Hkv, u8* codes, u16* scales) {
    const int t = blockIdx.x, h = blockIdx.y;
    if (slots[t] < 0) return;
    const size_t row = kv_page_row(table, max_blocks, lb, slots[t], positions[t]) * Hkv + h;
    KP::put(src + (size_t)t * st + (size_t)h * sh, D, row, codes, scales);
}

#define KV_STORE_KERNEL(name, KP)                                                           \
    extern "C" __global__ void kv_store_##name(const float* src, int st, int sh, int D,     \
                                               const int* slots, const int* positions,      \
                                               const int* table, int max_blocks, int lb,    \
                                               int Hkv, u8* codes, u16* scales) {           \
        PDL_ENTRY();                                                                         \
        kv_store<KP>(src, st, sh, D, slots, positions, table, max_blocks, lb, Hkv, codes,    \
                     scales);                                                                \
    }
FOR_KV_TYPES(KV_STORE_KERNEL)

extern "C" __global__ void __launch_bounds__(256)
kv_move(const unsigned long long* __restrict__ planes, const int* __restrict__ row_bytes,
        const int* __restrict__ table, int max_blocks, int lb, const int* __restrict__ slots,
        const int* __restrict__ src, const int* __restrict__ dst, int n) {
    PDL_ENTRY();
    u8* base = reinterpret_cast<u8*>(planes[blockIdx.x]);
    const size_t rb = (size_t)row_bytes[blockIdx.x];
    for (int m = 0; m < n; m++) {
        const size_t from = kv_page_row(table, max_blocks, lb, slots[m], src[m]) * rb;
        const size_t to = kv_page_row(table, max_blocks, lb, slots[m], dst[m]) * rb;
        for (size_t i = threadIdx.x; i < rb; i += blockDim.x) base[to + i] = base[from + i];
        __syncthreads();                  // move m is written before move m + 1 reads
    }
}
