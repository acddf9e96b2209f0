// elementwise.cu: the small ops of a step. Every product that the CPU reference computes as
// separate numpy float32 operations is written with __fmul_rn / __fadd_rn (no FMA
// contraction), so these ops round exactly as the reference does where its math functions
// (exp, tanh, sqrt) agree.
//
// embed_<type>  out[t, k] = dequant(table[ids[t], k]) * scale       out (T, E) f32
//               grid (T, ceil(E / 256)), block 256
// rms_norm      out[r, :] = x[r, :] * (1 / sqrt(sum(x[r, :]^2) / D + eps)) * w
//               rows r = (i, j) of an (n0, n1, D) view, strides (s0, s1, 1) for x and out;
//               grid n0 * n1, block B (a multiple of 32, <= 256, fixed per D): fixed-order
//               block sum
// add_rows      out[t, n] = a[t, n] + b[t, n] (b's row stride 0 = a broadcast vector)
//               grid (ceil(N / 256), T), block 256
// glu           out[t, f] = act(gate[t, f]) * up[t, f]; act 0 = silu g / (1 + exp(-g)),
//               1 = gelu_tanh 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))
//               grid (ceil(F / 256), T), block 256
// rope          in place on an (T, H, D) view (strides s0, s1, 1), first 2 * half dims:
//               (a, b) -> (a cos - b sin, a sin + b cos) with cos/sin[positions[t], i];
//               pairs (2i, 2i+1) (normal) or (i, i + half) (neox); grid (T, H), block 64
// moe_route     per token: softmax over n_expert router logits (in place), the n_used most
//               probable experts (lowest index first among equals), their probabilities,
//               renormalized when asked; one thread per token, grid ceil(T / 64), block 64
// moe_combine   out[t, e] = sum_u w[t, u] * y[t * n_used + u, e], u in order
//               grid (ceil(E / 256), T), block 256
#include "quant_types.cuh"

template <class Q>
__device__ __forceinline__ void embed_quant(Planes P, int E, const int* ids, float scale,
                                            float* out) {
    const int t = blockIdx.x, k = blockIdx.y * 256 + threadIdx.x;
    if (k >= E) return;
    const size_t blk = (size_t)ids[t] * (E / Q::QK) + k / Q::QK;
    float v = Q::dequant(P, blk, k % Q::QK);
    if (scale != 1.0f) v = __fmul_rn(v, scale);
    out[(size_t)t * E + k] = v;
}

#define EMBED_KERNEL(name, Q)                                                               \
    extern "C" __global__ void embed_##name(const u8* p0, const u8* p1, const u8* p2,       \
                                            const u8* p3, int E, const int* ids,            \
                                            float scale, float* out) {                      \
        embed_quant<Q>(Planes{p0, p1, p2, p3}, E, ids, scale, out);                         \
    }
FOR_QUANT_TYPES(EMBED_KERNEL)
FOR_FLOAT_TYPES(EMBED_KERNEL)

extern "C" __global__ void rms_norm(const float* __restrict__ x, int n1, int s0, int s1, int D,
                                    const float* __restrict__ w, float eps, float* out,
                                    int o0, int o1) {
    __shared__ float part[8];
    const int i = blockIdx.x / n1, j = blockIdx.x % n1;
    const float* xr = x + (size_t)i * s0 + (size_t)j * s1;
    float* orow = out + (size_t)i * o0 + (size_t)j * o1;
    float s = 0.0f;
    for (int k = threadIdx.x; k < D; k += blockDim.x) s = __fadd_rn(s, __fmul_rn(xr[k], xr[k]));
    s = warp_sum(s);
    const int warp = threadIdx.x / 32, nw = blockDim.x / 32;
    if ((threadIdx.x & 31) == 0) part[warp] = s;
    __syncthreads();
    float tot = 0.0f;
    for (int k = 0; k < nw; k++) tot += part[k];
    const float r = 1.0f / sqrtf(__fadd_rn(tot / (float)D, eps));
    for (int k = threadIdx.x; k < D; k += blockDim.x) orow[k] = __fmul_rn(__fmul_rn(xr[k], r), w[k]);
}

extern "C" __global__ void add_rows(const float* a, int lda, const float* b, int ldb, int N,
                                    float* out, int ldo) {
    const int t = blockIdx.y, n = blockIdx.x * 256 + threadIdx.x;
    if (n >= N) return;
    out[(size_t)t * ldo + n] = __fadd_rn(a[(size_t)t * lda + n], b[(size_t)t * ldb + n]);
}

extern "C" __global__ void glu(const float* __restrict__ gate, int ldg,
                               const float* __restrict__ up, int ldu, int F, int act,
                               float* __restrict__ out, int ldo) {
    const int t = blockIdx.y, f = blockIdx.x * 256 + threadIdx.x;
    if (f >= F) return;
    const float g = gate[(size_t)t * ldg + f];
    float y;
    if (act == 0) {
        y = g / __fadd_rn(expf(-g), 1.0f);
    } else {
        y = __fmul_rn(g, g);
        y = __fmul_rn(y, 0.044715f);
        y = __fadd_rn(y, 1.0f);
        y = __fmul_rn(y, g);
        y = __fmul_rn(y, 0.7978845608028654f);
        y = tanhf(y);
        y = __fadd_rn(y, 1.0f);
        y = __fmul_rn(y, g);
        y = __fmul_rn(y, 0.5f);
    }
    out[(size_t)t * ldo + f] = __fmul_rn(y, up[(size_t)t * ldu + f]);
}

extern "C" __global__ void rope(float* x, int s0, int s1, const int* __restrict__ positions,
                                const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                int half, int neox) {
    const int t = blockIdx.x, h = blockIdx.y;
    float* row = x + (size_t)t * s0 + (size_t)h * s1;
    const int p = positions[t];
    if (p < 0) return;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const int ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
        const float c = cos_t[(size_t)p * half + i], s = sin_t[(size_t)p * half + i];
        const float a = row[ia], b = row[ib];
        row[ia] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
        row[ib] = __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
    }
}

extern "C" __global__ void moe_route(float* logits, int ld, int T, int n_expert, int n_used,
                                     int normalize, int* ids, float* weights) {
    const int t = blockIdx.x * 64 + threadIdx.x;
    if (t >= T) return;
    float* p = logits + (size_t)t * ld;
    float mx = p[0];
    for (int e = 1; e < n_expert; e++) mx = fmaxf(mx, p[e]);
    float sum = 0.0f;
    for (int e = 0; e < n_expert; e++) {
        p[e] = expf(__fsub_rn(p[e], mx));
        sum = __fadd_rn(sum, p[e]);
    }
    for (int e = 0; e < n_expert; e++) p[e] = p[e] / sum;
    float wsum = 0.0f;
    for (int u = 0; u < n_used; u++) {
        int best = -1;
        for (int e = 0; e < n_expert; e++) {
            bool taken = false;
            for (int v = 0; v < u; v++) taken |= ids[t * n_used + v] == e;
            if (!taken && (best < 0 || p[e] > p[best])) best = e;
        }
        ids[t * n_used + u] = best;
        weights[t * n_used + u] = p[best];
        wsum = __fadd_rn(wsum, p[best]);
    }
    if (normalize)
        for (int u = 0; u < n_used; u++) weights[t * n_used + u] = weights[t * n_used + u] / wsum;
}

extern "C" __global__ void moe_combine(const float* __restrict__ y, const float* __restrict__ w,
                                       int n_used, int E, float* __restrict__ out, int ldo) {
    const int t = blockIdx.y, e = blockIdx.x * 256 + threadIdx.x;
    if (e >= E) return;
    float acc = 0.0f;
    for (int u = 0; u < n_used; u++)
        acc = __fadd_rn(acc, __fmul_rn(w[t * n_used + u], y[((size_t)t * n_used + u) * E + e]));
    out[(size_t)t * ldo + e] = acc;
}
