// argmax.cuh: the first maximum of a row, by threads, warps and blocks (sampling.cu).
//
// Pairs (value, index) are ordered by larger value, then lower index ("better"), so every
// reduction below ends at the lowest index holding the row's maximum, np.argmax's choice:
//   thread_argmax  the first maximum of row[k] over k = start, start + stride, ... < n, scanned
//                  in order (v = -inf, i = INT_MAX when the range is empty; a NaN is taken
//                  only as a first element, as the scan's comparison leaves it);
//   warp_argmax    the best pair of the warp's 32 lanes by butterfly, in every lane.
// No launch geometry of its own (see the kernel files).
#ifndef SPECSTREAM_ARGMAX_CUH
#define SPECSTREAM_ARGMAX_CUH

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

__device__ __forceinline__ void thread_argmax(const float* row, int n, int start, int stride,
                                              float& v, int& i) {
    v = NEG_INF;
    i = 0x7fffffff;
    for (int k = start; k < n; k += stride) {
        const float x = row[k];
        if (x > v || i == 0x7fffffff) { v = x; i = k; }
    }
}

#endif  // SPECSTREAM_ARGMAX_CUH
