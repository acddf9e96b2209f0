// rope.cuh: the RoPE rotation of one row, shared by elementwise.cu's rope and rope_kv.cu.
//
// For i < half (the threads of the block take i = tid, tid + blockDim.x, ...), with
// c = cos_t[pos, i], s = sin_t[pos, i] (tables (n_ctx, half) f32) and the pair (ia, ib) =
// (i, i + half) (neox) or (2i, 2i + 1) (normal):
//   row[ia], row[ib] <- row[ia] c - row[ib] s, row[ia] s + row[ib] c
// each product and sum rounded on its own (no FMA contraction), as the CPU reference rounds.
// row: global or shared memory; no launch geometry of its own (see the kernel files).
#ifndef SPECSTREAM_ROPE_CUH
#define SPECSTREAM_ROPE_CUH

__device__ __forceinline__ void rope_rotate(float* row, const float* __restrict__ cos_t,
                                            const float* __restrict__ sin_t, int pos, int half,
                                            int neox) {
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const int ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
        const float c = cos_t[(size_t)pos * half + i], s = sin_t[(size_t)pos * half + i];
        const float a = row[ia], b = row[ib];
        row[ia] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
        row[ib] = __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
    }
}

#endif  // SPECSTREAM_ROPE_CUH
