// act_quant.cuh: device functions shared by the kernels that produce a GEMV input or a norm.
//
// quant_group: one warp turns the 32 values v (one per lane) of a group into the 8-bit block
//   the quantized GEMVs read:  amax = max |v|,  d = amax / 127,  q = rint(v / d) (0 when
//   amax = 0),  s = sum q;  qa[lane] = q, ads = (d, s). quantize_act and every fused producer
//   (RMSNorm, GLU, attention) call it, so a fused op quantizes exactly as the separate pass.
// block_inv_rms: 1 / sqrt(sum(x^2) / D + eps) over a row of D floats, every thread of the block
//   taking k = tid, tid + blockDim.x, ... then a butterfly per warp and the warps in order: the
//   bits depend on D and blockDim.x only (callers use blockDim.x = norm_block(D));
//   block_inv_rms_regs: the same sum over the row loaded into registers first (same bits).
#ifndef SPECSTREAM_ACT_QUANT_CUH
#define SPECSTREAM_ACT_QUANT_CUH

#include "common.cuh"

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
    __shared__ float part[8];
    s = warp_sum(s);
    const int warp = threadIdx.x / 32, nw = blockDim.x / 32;
    if ((threadIdx.x & 31) == 0) part[warp] = s;
    __syncthreads();
    float tot = 0.0f;
    for (int k = 0; k < nw; k++) tot += part[k];
    __syncthreads();   // part is free for the next call
    return 1.0f / sqrtf(__fadd_rn(tot / (float)D, eps));
}

// Every thread of a block (blockDim.x a multiple of 32, <= 256, blockDim.y = 1) must call it.
__device__ __forceinline__ float block_inv_rms(const float* xr, int D, float eps) {
    float s = 0.0f;
    for (int k = threadIdx.x; k < D; k += blockDim.x) s = __fadd_rn(s, __fmul_rn(xr[k], xr[k]));
    return block_inv_rms_of(s, D, eps);
}

// The same value with the row's elements k = tid + blockDim.x i (i < NORM_REGS) loaded into
// registers first, all loads in flight at once (one load latency instead of D / blockDim.x);
// xv[i] = 0 past D. For D <= NORM_REGS * blockDim.x (callers check; else block_inv_rms).
#define NORM_REGS 32
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

#endif  // SPECSTREAM_ACT_QUANT_CUH
