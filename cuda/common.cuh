// common.cuh: warp reductions and conversions shared by every kernel file.
//
// Reductions are butterflies (__shfl_xor_sync over offsets 16, 8, 4, 2, 1): every lane ends with
// the same value and the order of additions is fixed, so a result never depends on which other
// rows or tokens share the launch.
#ifndef SPECSTREAM_COMMON_CUH
#define SPECSTREAM_COMMON_CUH

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;

#define WARP 32
#define FULL_MASK 0xffffffffu
// NVRTC has no math.h: infinity from its bits.
#define NEG_INF __int_as_float(0xff800000)

// The pool row of logical position pos of a slot in the paged KV cache (service/backends/
// base.py): block table[slot * max_blocks + (pos >> lb)] of 1 << lb rows, row pos & (2^lb - 1)
// inside it. table (n_slots, max_blocks) int32, entries in [0, n_blocks).
__device__ __forceinline__ size_t kv_page_row(const int* __restrict__ table, int max_blocks,
                                              int lb, int slot, int pos) {
    return ((size_t)table[(size_t)slot * max_blocks + (pos >> lb)] << lb)
           + (size_t)(pos & ((1 << lb) - 1));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ int warp_sum_int(int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// IEEE binary16 bits -> float (exact). PTX conversions instead of cuda_fp16.h, so the kernels
// need no CUDA headers (NVRTC alone compiles them, as in `make check-cuda`).
__device__ __forceinline__ float h2f(u16 bits) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(bits));
    return f;
}

// float -> binary16 bits, round to nearest even (numpy's astype(float16), ggml's FP32_TO_FP16).
__device__ __forceinline__ u16 f2h(float x) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}

// bfloat16 bits -> float (exact: the top 16 bits of the float).
__device__ __forceinline__ float bf2f(u16 bits) {
    return __uint_as_float(((u32)bits) << 16);
}

// Little-endian u16 / u32 read from a byte pointer of any alignment.
__device__ __forceinline__ u16 ld_u16(const u8* p) {
    return (u16)p[0] | ((u16)p[1] << 8);
}

__device__ __forceinline__ u32 ld_u32(const u8* p) {
    return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
}

#endif  // SPECSTREAM_COMMON_CUH
