// sampling.cu: token choice on the GPU, so only int32 ids cross PCIe on the greedy path.
//
// argmax_rows: out[t] = the lowest index i with logits[t, i] = max_i logits[t, i]
//   logits (T, V) f32 with row stride ld; out (T,) int32.
//   Launch: grid T, block 1024. Thread k scans i = k, k + 1024, ... keeping the first maximum;
//   a butterfly over (value, index) pairs (larger value, then lower index) inside each warp,
//   then warp 0 over the 32 warp winners: the result is np.argmax's.
#include "common.cuh"

__device__ __forceinline__ void better(float& v, int& i, float ov, int oi) {
    if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
}

__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(FULL_MASK, v, o);
        const int oi = __shfl_xor_sync(FULL_MASK, i, o);
        better(v, i, ov, oi);
    }
}

extern "C" __global__ void __launch_bounds__(1024)
argmax_rows(const float* __restrict__ logits, int ld, int V, int* __restrict__ out) {
    __shared__ float sv[32];
    __shared__ int si[32];
    const int t = blockIdx.x, tid = threadIdx.x;
    const float* row = logits + (size_t)t * ld;
    float v = NEG_INF;
    int i = 0x7fffffff;
    for (int k = tid; k < V; k += 1024) {
        const float x = row[k];
        if (x > v || i == 0x7fffffff) { v = x; i = k; }
    }
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
