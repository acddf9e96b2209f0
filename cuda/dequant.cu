// dequant.cu: the f16 inputs of the prefill GEMM (cuBLAS, f16 x f16 -> f32 accumulation).
//
// dequant_<type>: out[i] = f16(W[e0 + i]) for 0 <= i < n, e0 = r0 * K,
//   W the matrix (R, K) in the planes of quant_types.cuh read as one row-major sequence of
//   elements (blocks never straddle rows: K is a multiple of the block size), so out holds rows
//   r0 .. r0 + n/K - 1 of W, (n/K, K) row-major. Each element is Q::dequant (ggml's order of
//   operations, the f32 value of gguf's numpy dequantizer) rounded to nearest even, as numpy's
//   astype(float16): out equals dequantize(W).astype(float16) bit for bit.
//   out: u16 (f16 bits), 16-byte aligned. Launch: block 256, grid ceil(ceil(n / 8) / 256): each
//   thread writes 8 consecutive elements with one 16-byte store (all 8 in one 32-element group
//   of a block, so their scales are loaded once); a tail of n % 8 is written element by element.
//
// round_f16: out[t * K + k] = f16(x[t * ldx + k]) for t < T, k < K (round to nearest even),
//   x (T, ldx) f32. Launch: grid (ceil(K / 256), T), block 256.
#include "pdl.cuh"
#include "quant_types.cuh"

template <class Q>
__device__ __forceinline__ void dequant_rows(const Planes& P, int K, long long r0, long long n,
                                             u16* __restrict__ out) {
    const long long i0 = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * 8;
    if (i0 >= n) return;
    const long long e0 = r0 * K + i0;
    if (i0 + 8 <= n) {
        u16 h[8];
        if constexpr (Q::QK == 1) {
#pragma unroll
            for (int j = 0; j < 8; j++) h[j] = f2h(Q::dequant(P, (size_t)(e0 + j), 0));
        } else {
            // One block, one 32-group: with the offset's low 3 bits visibly zero the compiler
            // sees the same group index in all 8 calls and loads the scales once.
            const size_t blk = (size_t)(e0 / Q::QK);
            const int ib = (int)(e0 % Q::QK) & ~7;
#pragma unroll
            for (int j = 0; j < 8; j++) h[j] = f2h(Q::dequant(P, blk, ib | j));
        }
        uint4 v;
        v.x = (u32)h[0] | ((u32)h[1] << 16);
        v.y = (u32)h[2] | ((u32)h[3] << 16);
        v.z = (u32)h[4] | ((u32)h[5] << 16);
        v.w = (u32)h[6] | ((u32)h[7] << 16);
        *reinterpret_cast<uint4*>(out + i0) = v;
    } else {
        for (long long i = i0; i < n; i++) {
            const long long e = r0 * K + i;
            out[i] = f2h(Q::dequant(P, (size_t)(e / Q::QK), (int)(e % Q::QK)));
        }
    }
}

#define DEQUANT_KERNEL(name, Q)                                                             \
    extern "C" __global__ void __launch_bounds__(256)                                       \
    dequant_##name(const u8* p0, const u8* p1, const u8* p2, const u8* p3, int K,           \
                   long long r0, long long n, u16* out) {                                   \
        PDL_ENTRY();                                                                        \
        dequant_rows<Q>(Planes{p0, p1, p2, p3}, K, r0, n, out);                             \
    }
FOR_QUANT_TYPES(DEQUANT_KERNEL)
FOR_FLOAT_TYPES(DEQUANT_KERNEL)

extern "C" __global__ void __launch_bounds__(256)
round_f16(const float* __restrict__ x, int ldx, int T, int K, u16* __restrict__ out) {
    PDL_ENTRY();
    const int k = blockIdx.x * blockDim.x + threadIdx.x, t = blockIdx.y;
    if (k >= K || t >= T) return;
    out[(size_t)t * K + k] = f2h(x[(size_t)t * ldx + k]);
}
