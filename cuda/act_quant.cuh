// act_quant.cuh: device functions shared by the kernels that produce a GEMV input or a norm.
//
// quant_group: one warp turns the 32 values v (one per lane) of a group into the 8-bit block
//   the quantized GEMVs read:  amax = max |v|,  d = amax / 127,  q = rint(v / d) (0 when
//   amax = 0),  s = sum q;  qa[lane] = q, ads = (d, s). quantize_act and every fused producer
//   (RMSNorm, GLU, attention) call it, so a fused op quantizes exactly as the separate pass.
// block_inv_rms: 1 / sqrt(sum(x^2) / D + eps) over a row of D floats, every thread of the block
//   taking k = tid, tid + blockDim.x, ... then a butterfly per warp and the warps in order: the
//   bits depend on D and blockDim.x only (callers use blockDim.x = norm_block(D));
//   block_inv_rms_regs: the same sum over the row loaded into registers first (same bits);
//   norm_quant_row_128: rms_norm_quant's row by a 128-thread block, same bits (the epilogue of
//   the fused residual GEMVs, gemv.cu and gemv_mma.cu: last_block_norm_quant).
#ifndef SPECSTREAM_ACT_QUANT_CUH
#define SPECSTREAM_ACT_QUANT_CUH

#include "common.cuh"

// NORM_MAX_THREADS (256: the largest norm block) comes as a -D define
// (service/backends/cuda/kernels.py).
#if !defined(NORM_MAX_THREADS)
#error "compile with the shared -D defines (service/backends/cuda/sources.py OPTIONS)"
#endif

__device__ __forceinline__ void quant_group(float v, signed char* __restrict__ qa,
                                            float2* __restrict__ ads) {
    const int lane = threadIdx.x & 31;
    const float amax = warp_max(fabsf(v));
    const float d = amax / 127.0f;
    const int q = amax == 0.0f ? 0 : (int)rintf(v / d);
    const int s = warp_sum_int(q);
    qa[lane] = (signed char)q;
    if (lane == 0) *ads = make_float2(d, (float)s);
}

// The block sum of per-thread partial sums s (butterfly per warp, then the warps in order) as
// 1 / sqrt(sum / D + eps).
__device__ __forceinline__ float block_inv_rms_of(float s, int D, float eps) {
    __shared__ float part[NORM_MAX_THREADS / 32];
    s = warp_sum(s);
    const int warp = threadIdx.x / 32, nw = blockDim.x / 32;
    if ((threadIdx.x & 31) == 0) part[warp] = s;
    __syncthreads();
    float tot = 0.0f;
    for (int k = 0; k < nw; k++) tot += part[k];
    __syncthreads();   // part is free for the next call
    return 1.0f / sqrtf(__fadd_rn(tot / (float)D, eps));
}

// Every thread of a block (blockDim.x a multiple of 32, <= NORM_MAX_THREADS, blockDim.y = 1)
// must call it.
__device__ __forceinline__ float block_inv_rms(const float* xr, int D, float eps) {
    float s = 0.0f;
    for (int k = threadIdx.x; k < D; k += blockDim.x) s = __fadd_rn(s, __fmul_rn(xr[k], xr[k]));
    return block_inv_rms_of(s, D, eps);
}

// The same value with the row's elements k = tid + blockDim.x i (i < NORM_REGS) loaded into
// registers first, all loads in flight at once (one load latency instead of D / blockDim.x);
// xv[i] = 0 past D. For D <= NORM_REGS * blockDim.x (callers check; else block_inv_rms).
// NORM_REGS comes as a -D define (kernels.py)
#if !defined(NORM_REGS)
#error "compile with the shared -D defines (service/backends/cuda/sources.py OPTIONS)"
#endif
__device__ __forceinline__ float block_inv_rms_regs(const float* xr, int D, float eps,
                                                    float (&xv)[NORM_REGS]) {
#pragma unroll
    for (int i = 0; i < NORM_REGS; i++) {
        const int k = threadIdx.x + blockDim.x * i;
        xv[i] = k < D ? xr[k] : 0.0f;
    }
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < NORM_REGS; i++)
        if (threadIdx.x + blockDim.x * i < D) s = __fadd_rn(s, __fmul_rn(xv[i], xv[i]));
    return block_inv_rms_of(s, D, eps);
}

// rms_norm_quant's row (elementwise.cu, blockDim.x = B = norm_block(D)) computed by a block of
// 128 threads (blockDim (32, 4)) with the bits of B threads: real thread tid plays the virtual
// threads v = tid + 128 j (j = 0, 1; v < B), real warp w the virtual warps w and w + 4, so the
// partial sums, butterflies, warp order and 32-groups are those of the B-thread kernel.
// x is read through L2 (__ldcg: other blocks of the grid wrote it), 8 loads in flight per
// thread and pass, few registers (the epilogue of a GEMV must not cost the GEMV occupancy).
// D % 32 == 0, B = norm_block(D) <= NORM_MAX_THREADS.
__device__ __forceinline__ void norm_quant_row_128(const float* x, int D, int B,
                                                   const float* __restrict__ w, float eps,
                                                   float* __restrict__ orow,
                                                   signed char* __restrict__ qa,
                                                   float2* __restrict__ ads) {
    static_assert(NORM_MAX_THREADS == 2 * 128, "two virtual threads per real thread");
    __shared__ float part[NORM_MAX_THREADS / 32];
    const int lane = threadIdx.x, warp = threadIdx.y, tid = warp * 32 + lane;
#pragma unroll 1
    for (int j = 0; j < 2; j++) {
        const int v = tid + 128 * j;             // warp-uniform: v < B (B % 32 == 0)
        if (v >= B) break;
        float s = 0.0f;
#pragma unroll 1
        for (int k0 = v; k0 < D; k0 += 8 * B) {
            float xv[8];
#pragma unroll
            for (int u = 0; u < 8; u++) xv[u] = k0 + B * u < D ? __ldcg(x + k0 + B * u) : 0.0f;
#pragma unroll
            for (int u = 0; u < 8; u++)
                if (k0 + B * u < D) s = __fadd_rn(s, __fmul_rn(xv[u], xv[u]));
        }
        s = warp_sum(s);
        if (lane == 0) part[warp + 4 * j] = s;
    }
    __syncthreads();
    float tot = 0.0f;
    for (int k = 0; k < B / 32; k++) tot += part[k];
    const float r = 1.0f / sqrtf(__fadd_rn(tot / (float)D, eps));
#pragma unroll 1
    for (int j = 0; j < 2; j++) {
        const int v = tid + 128 * j;
        if (v >= B) break;
#pragma unroll 1
        for (int k0 = v; k0 < D; k0 += 8 * B) {
            // x and w of the chunk loaded before the first group is quantized (a load after
            // a group's shuffles and stores would wait for them: one latency per element)
            float xv[8], wv[8];
#pragma unroll
            for (int u = 0; u < 8; u++) {
                const bool in = k0 + B * u < D;
                xv[u] = in ? __ldcg(x + k0 + B * u) : 0.0f;
                wv[u] = in ? w[k0 + B * u] : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < 8; u++) {
                const int k = k0 + B * u;
                if (k - lane < D) {               // warp-uniform: a whole 32-group
                    const float y = __fmul_rn(__fmul_rn(xv[u], r), wv[u]);
                    orow[k] = y;
                    quant_group(y, qa + (k - lane), ads + (k - lane) / 32);
                }
            }
        }
    }
}

// The fused residual GEMVs' epilogue (gemv.cu gemv_<type>_c1r1[p]n, gemv_mma.cu
// gemv_mma_<type>_c1[p]n), called by every thread of a (32, 4) block after the block wrote its
// outputs: the last block of the grid to finish (the counter `done`, reset by that block)
// normalizes the whole row out (N floats) into h with its 8-bit blocks (hqa, hads), as
// rms_norm_quant with B threads.
__device__ __forceinline__ void last_block_norm_quant(float* out, int N, int* done,
                                                      const float* nw, float eps, int B,
                                                      float* h, signed char* hqa,
                                                      float2* hads) {
    __shared__ int last;
    if (threadIdx.x == 0) __threadfence();     // the writers (lane 0 of each warp): outputs
    __syncthreads();                           // before the block's count
    if (threadIdx.x == 0 && threadIdx.y == 0)
        last = atomicAdd(done, 1) == (int)(gridDim.x * gridDim.y) - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    norm_quant_row_128(out, N, B, nw, eps, h, hqa, hads);
    if (threadIdx.x == 0 && threadIdx.y == 0) *done = 0;
}

#endif  // SPECSTREAM_ACT_QUANT_CUH
