// elementwise.cu: the small ops of a step. Every product that the CPU reference computes as
// separate numpy float32 operations is written with __fmul_rn / __fadd_rn (no FMA
// contraction), so these ops round exactly as the reference does where its math functions
// (exp, tanh, sqrt) agree.
//
// embed_<type>  out[t, k] = dequant(table[ids[t], k]) * scale       out (T, E) f32
//               grid (T, ceil(E / ROW_THREADS)), block ROW_THREADS (256)
// rms_norm      out[r, :] = x[r, :] * (1 / sqrt(sum(x[r, :]^2) / D + eps)) * w
//               rows r = (i, j) of an (n0, n1, D) view, strides (s0, s1, 1) for x and out;
//               grid n0 * n1, block B (a multiple of 32, <= NORM_MAX_THREADS, fixed per D):
//               fixed-order
//               block sum
// rms_norm_quant  rows t of (T, D): rms_norm into out, plus out's 8-bit blocks (qa, ads) as
//               quantize.cu makes them; grid (T, S), block as rms_norm (D % 32 == 0): each of
//               a row's S slices sums the whole row (the same order, so the same r) and
//               writes the groups of its own register passes (pass i of slice i % S), which
//               splits the serial quantization shuffles of one block over S blocks
// rms_norm_add  x[t, :] += rms_norm(o[t, :]) * w (a post-norm fused with the residual add)
//               grid T, block as rms_norm
// add_rows      out[t, n] = a[t, n] + b[t, n] (b's row stride 0 = a broadcast vector)
//               grid (ceil(N / ROW_THREADS), T), block ROW_THREADS
// copy_rows     out[t, n] = src[t, n] (row strides lds, ldo): a step's hidden-state tap, the
//               residual rows a drafter reads copied into the runner's buffer
//               grid (ceil(N / ROW_THREADS), T), block ROW_THREADS
// glu           out[t, f] = act(gate[t, f]) * up[t, f]; act 0 = silu g / (1 + exp(-g)),
//               1 = gelu_tanh 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))
//               grid (ceil(F / ROW_THREADS), T), block ROW_THREADS; glu_quant also writes
//               out's 8-bit blocks (F % 32 == 0)
// rope          in place on an (T, H, D) view (strides s0, s1, 1), first 2 * half dims:
//               (a, b) -> (a cos - b sin, a sin + b cos) with cos/sin[positions[t], i];
//               pairs (2i, 2i+1) (normal) or (i, i + half) (neox); grid (T, H), block 64
// moe_route     per token: softmax (or, with sigmoid, the logistic function) over n_expert
//               router logits (in place), the n_used experts with the largest probability
//               (+ bias[e] when bias is not null: the selection only; lowest index first
//               among equals), their probabilities, renormalized when asked (by a sum of at
//               least 2^-14), times scale; one warp per token, n_expert <= MOE_MAX_EXPERTS
//               (lane l holds experts l + 32 j in registers; the softmax sum added by lane 0
//               in expert order, each pick a warp arg-max on (value, -index)), grid
//               ceil(T / (MOE_ROUTE_THREADS / 32)), block MOE_ROUTE_THREADS (64)
// softplus_gate a[t, k] *= softplus(g[t, (k / Dv) * G + (G == 1 ? 0 : k % Dv)]) for k < HD
//               (HD = H * Dv; G = 1: one gate per head, G = Dv: one per element); softplus
//               as ggml's: v > 20 ? v : log(1 + exp(v)); grid (ceil(HD / ROW_THREADS), T),
//               block ROW_THREADS
// moe_combine   out[t, e] = sum_u w[t, u] * y[t * n_used + u, e], u in order
//               grid (ceil(E / ROW_THREADS), T), block ROW_THREADS
#include "pdl.cuh"
#include "quant_types.cuh"
#include "act_quant.cuh"
#include "rope.cuh"
#include "glu.cuh"

// ROW_THREADS (256), MOE_ROUTE_THREADS (64), MOE_MAX_EXPERTS (512) and NORM_REGS (32) come as
// -D defines (service/backends/cuda/kernels.py).
#if !defined(ROW_THREADS) || !defined(MOE_ROUTE_THREADS) || !defined(MOE_MAX_EXPERTS)
#error "compile with the shared -D defines (service/backends/cuda/sources.py OPTIONS)"
#endif
#if !defined(NORM_REGS)
#error "compile with the shared -D defines (service/backends/cuda/sources.py OPTIONS)"
#endif

template <class Q>
__device__ __forceinline__ void embed_quant(Planes P, int E, const int* ids, float scale,
                                            float* out) {
    const int t = blockIdx.x, k = blockIdx.y * ROW_THREADS + threadIdx.x;
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
        PDL_ENTRY();                                                                        \
        embed_quant<Q>(Planes{p0, p1, p2, p3}, E, ids, scale, out);                         \
    }
FOR_QUANT_TYPES(EMBED_KERNEL)
FOR_FLOAT_TYPES(EMBED_KERNEL)

// put(k, x_k, r) for each k < D of a row x, r = 1 / sqrt(sum(x^2) / D + eps), by the whole block
// (blockDim.x = norm_block(D)): the sum as act_quant.cuh's block_inv_rms, the row held in
// registers when it fits (all loads in flight). x_k() is x[k] (a register, or a load the caller
// places where its expression reads it, so rms_norm and rms_norm_add keep their load order).
template <class Put>
__device__ __forceinline__ void rms_row(const float* xr, int D, float eps, Put put) {
    if (D <= NORM_REGS * (int)blockDim.x) {
        float xv[NORM_REGS];
        const float r = block_inv_rms_regs(xr, D, eps, xv);
#pragma unroll
        for (int u = 0; u < NORM_REGS; u++) {
            const int k = threadIdx.x + blockDim.x * u;
            if (k < D) put(k, [&] { return xv[u]; }, r);
        }
        return;
    }
    const float r = block_inv_rms(xr, D, eps);
    for (int k = threadIdx.x; k < D; k += blockDim.x) put(k, [&] { return xr[k]; }, r);
}

// rms_row's put for rms_norm (out[k] = x_k * r * w[k]) and rms_norm_add (x[k] += x_k * r * w[k]):
// functors, not generic lambdas, which NVRTC 13.0 takes for host functions
struct PutNorm {
    float* out;
    const float* w;
    template <class X>
    __device__ __forceinline__ void operator()(int k, X x_k, float r) const {
        out[k] = __fmul_rn(__fmul_rn(x_k(), r), w[k]);
    }
};
struct PutNormAdd {
    float* x;
    const float* w;
    template <class X>
    __device__ __forceinline__ void operator()(int k, X x_k, float r) const {
        x[k] = __fadd_rn(x[k], __fmul_rn(__fmul_rn(x_k(), r), w[k]));
    }
};

extern "C" __global__ void rms_norm(const float* __restrict__ x, int n1, int s0, int s1, int D,
                                    const float* __restrict__ w, float eps, float* out,
                                    int o0, int o1) {
    PDL_ENTRY();
    const int i = blockIdx.x / n1, j = blockIdx.x % n1;
    const float* xr = x + (size_t)i * s0 + (size_t)j * s1;
    float* orow = out + (size_t)i * o0 + (size_t)j * o1;
    rms_row(xr, D, eps, PutNorm{orow, w});
}

// rms_norm of rows t of x (T, D) into out, and the 8-bit blocks of out for the next GEMV.
extern "C" __global__ void rms_norm_quant(const float* __restrict__ x, int ldx, int D,
                                          const float* __restrict__ w, float eps, float* out,
                                          int ldo, signed char* __restrict__ qa,
                                          float2* __restrict__ ads) {
    PDL_ENTRY();
    const int t = blockIdx.x, slice = blockIdx.y, S = gridDim.y;
    const float* xr = x + (size_t)t * ldx;
    float* orow = out + (size_t)t * ldo;
    // warp-uniform: at each step a warp holds one whole 32-group (D % 32 == 0)
    if (D <= NORM_REGS * (int)blockDim.x) {        // the row in registers: loads in flight
        float xv[NORM_REGS], wv[NORM_REGS];
#pragma unroll
        for (int i = 0; i < NORM_REGS; i++) {
            const int k = threadIdx.x + blockDim.x * i;
            wv[i] = k < D && i % S == slice ? w[k] : 0.0f;
        }
        const float r = block_inv_rms_regs(xr, D, eps, xv);
#pragma unroll
        for (int i = 0; i < NORM_REGS; i++) {
            const int k = threadIdx.x + blockDim.x * i, k0 = k - (threadIdx.x & 31);
            if (k0 < D && i % S == slice) {
                const float v = __fmul_rn(__fmul_rn(xv[i], r), wv[i]);
                orow[k] = v;
                quant_group(v, qa + (size_t)t * D + k0, ads + (size_t)t * (D / 32) + k0 / 32);
            }
        }
        return;
    }
    const float r = block_inv_rms(xr, D, eps);
    for (int k0 = (threadIdx.x / 32) * 32 + slice * blockDim.x; k0 < D; k0 += blockDim.x * S) {
        const int k = k0 + (threadIdx.x & 31);
        const float v = __fmul_rn(__fmul_rn(xr[k], r), w[k]);
        orow[k] = v;
        quant_group(v, qa + (size_t)t * D + k0, ads + (size_t)t * (D / 32) + k0 / 32);
    }
}

// x[t] += rms_norm(o[t]) * w: a post-norm and the residual add in one pass (Gemma-3).
extern "C" __global__ void rms_norm_add(const float* __restrict__ o, int ldo, int D,
                                        const float* __restrict__ w, float eps, float* x,
                                        int ldx) {
    PDL_ENTRY();
    const int t = blockIdx.x;
    const float* orow = o + (size_t)t * ldo;
    float* xr = x + (size_t)t * ldx;
    rms_row(orow, D, eps, PutNormAdd{xr, w});
}

extern "C" __global__ void add_rows(const float* a, int lda, const float* b, int ldb, int N,
                                    float* out, int ldo) {
    PDL_ENTRY();
    const int t = blockIdx.y, n = blockIdx.x * ROW_THREADS + threadIdx.x;
    if (n >= N) return;
    out[(size_t)t * ldo + n] = __fadd_rn(a[(size_t)t * lda + n], b[(size_t)t * ldb + n]);
}

extern "C" __global__ void copy_rows(const float* src, int lds, int N, float* out, int ldo) {
    PDL_ENTRY();
    const int t = blockIdx.y, n = blockIdx.x * ROW_THREADS + threadIdx.x;
    if (n >= N) return;
    out[(size_t)t * ldo + n] = src[(size_t)t * lds + n];
}

extern "C" __global__ void glu(const float* __restrict__ gate, int ldg,
                               const float* __restrict__ up, int ldu, int F, int act,
                               float* __restrict__ out, int ldo) {
    PDL_ENTRY();
    const int t = blockIdx.y, f = blockIdx.x * ROW_THREADS + threadIdx.x;
    if (f >= F) return;
    out[(size_t)t * ldo + f] = __fmul_rn(glu_act(gate[(size_t)t * ldg + f], act),
                                         up[(size_t)t * ldu + f]);
}

// glu, and the 8-bit blocks of its output for the down projection (F % 32 == 0: a warp is one
// 32-group, wholly inside or outside [0, F)).
extern "C" __global__ void glu_quant(const float* __restrict__ gate, int ldg,
                                     const float* __restrict__ up, int ldu, int F, int act,
                                     float* __restrict__ out, int ldo,
                                     signed char* __restrict__ qa, float2* __restrict__ ads) {
    PDL_ENTRY();
    const int t = blockIdx.y, f = blockIdx.x * ROW_THREADS + threadIdx.x;
    if (f - (threadIdx.x & 31) >= F) return;
    const float y = __fmul_rn(glu_act(gate[(size_t)t * ldg + f], act), up[(size_t)t * ldu + f]);
    out[(size_t)t * ldo + f] = y;
    const int g0 = f & ~31;
    quant_group(y, qa + (size_t)t * F + g0, ads + (size_t)t * (F / 32) + g0 / 32);
}

extern "C" __global__ void rope(float* x, int s0, int s1, const int* __restrict__ positions,
                                const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                int half, int neox) {
    PDL_ENTRY();
    const int t = blockIdx.x, h = blockIdx.y;
    float* row = x + (size_t)t * s0 + (size_t)h * s1;
    const int p = positions[t];
    if (p < 0) return;
    rope_rotate(row, cos_t, sin_t, p, half, neox);
}

extern "C" __global__ void moe_route(float* logits, int ld, int T, int n_expert, int n_used,
                                     int normalize, int sigmoid, const float* bias, float scale,
                                     int* ids, float* weights) {
    PDL_ENTRY();
    constexpr int EPL = MOE_MAX_EXPERTS / 32;         // experts per lane, in registers
    constexpr int NONE = 0x7fffffff;                  // no expert picked yet
    const int lane = threadIdx.x & 31;
    const int t = blockIdx.x * (MOE_ROUTE_THREADS / 32) + threadIdx.x / 32;
    if (t >= T) return;                               // the whole warp leaves together
    float* p = logits + (size_t)t * ld;
    float v[EPL];                                     // v[j]: expert lane + 32 j
#pragma unroll
    for (int j = 0; j < EPL; j++) {
        const int e = lane + 32 * j;
        v[j] = e < n_expert ? p[e] : 0.0f;
    }
    if (sigmoid) {
#pragma unroll
        for (int j = 0; j < EPL; j++) v[j] = 1.0f / __fadd_rn(1.0f, expf(-v[j]));
    } else {
        float mx = __int_as_float(0xff800000);        // -inf; fmaxf: one maximum in any order
#pragma unroll
        for (int j = 0; j < EPL; j++)
            if (lane + 32 * j < n_expert) mx = fmaxf(mx, v[j]);
        for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, o));
#pragma unroll
        for (int j = 0; j < EPL; j++) v[j] = expf(__fsub_rn(v[j], mx));
        float sum = 0.0f;                             // lane 0 adds in expert order
#pragma unroll
        for (int j = 0; j < EPL; j++) {
            if (32 * j >= n_expert) break;            // uniform over the warp
            for (int src = 0; src < 32; src++) {
                const float x = __shfl_sync(FULL_MASK, v[j], src);
                if (lane == 0 && src + 32 * j < n_expert) sum = __fadd_rn(sum, x);
            }
        }
        sum = __shfl_sync(FULL_MASK, sum, 0);
#pragma unroll
        for (int j = 0; j < EPL; j++) v[j] = v[j] / sum;
    }
#pragma unroll
    for (int j = 0; j < EPL; j++)                     // the probabilities, in place
        if (lane + 32 * j < n_expert) p[lane + 32 * j] = v[j];
    float sel[EPL];                                   // the selection score (bias added)
#pragma unroll
    for (int j = 0; j < EPL; j++) {
        const int e = lane + 32 * j;
        sel[j] = bias && e < n_expert ? __fadd_rn(v[j], bias[e]) : v[j];
    }
    unsigned taken = 0;                               // bit j: expert lane + 32 j picked
    float wsum = 0.0f;
    for (int u = 0; u < n_used; u++) {
        int best = NONE;
        float best_s = 0.0f, best_p = 0.0f;
#pragma unroll
        for (int j = 0; j < EPL; j++) {               // this lane's experts, ascending
            if (lane + 32 * j < n_expert && !(taken >> j & 1u) &&
                (best == NONE || sel[j] > best_s)) {
                best = lane + 32 * j;
                best_s = sel[j];
                best_p = v[j];
            }
        }
        for (int o = 16; o > 0; o >>= 1) {            // larger score, then lower index, wins
            const int ob = __shfl_xor_sync(FULL_MASK, best, o);
            const float os = __shfl_xor_sync(FULL_MASK, best_s, o);
            const float op = __shfl_xor_sync(FULL_MASK, best_p, o);
            if (ob != NONE &&
                (best == NONE || os > best_s || (os == best_s && ob < best))) {
                best = ob;
                best_s = os;
                best_p = op;
            }
        }
        if ((best & 31) == lane) taken |= 1u << (best >> 5);
        if (lane == 0) {
            ids[(size_t)t * n_used + u] = best;
            weights[(size_t)t * n_used + u] = best_p;
        }
        wsum = __fadd_rn(wsum, best_p);
    }
    if (lane != 0) return;
    float* wt = weights + (size_t)t * n_used;
    if (normalize) {
        wsum = fmaxf(wsum, 6.103515625e-5f);
        for (int u = 0; u < n_used; u++) wt[u] = wt[u] / wsum;
    }
    if (scale != 1.0f)
        for (int u = 0; u < n_used; u++) wt[u] = __fmul_rn(wt[u], scale);
}

extern "C" __global__ void softplus_gate(float* __restrict__ a, int lda, int HD, int Dv,
                                         const float* __restrict__ g, int ldg, int G) {
    PDL_ENTRY();
    const int t = blockIdx.y, k = blockIdx.x * ROW_THREADS + threadIdx.x;
    if (k >= HD) return;
    const int h = k / Dv;
    const float v = g[(size_t)t * ldg + h * G + (G == 1 ? 0 : k - h * Dv)];
    const float sp = v > 20.0f ? v : logf(__fadd_rn(1.0f, expf(v)));
    a[(size_t)t * lda + k] = __fmul_rn(a[(size_t)t * lda + k], sp);
}

extern "C" __global__ void moe_combine(const float* __restrict__ y, const float* __restrict__ w,
                                       int n_used, int E, float* __restrict__ out, int ldo) {
    PDL_ENTRY();
    const int t = blockIdx.y, e = blockIdx.x * ROW_THREADS + threadIdx.x;
    if (e >= E) return;
    float acc = 0.0f;
    for (int u = 0; u < n_used; u++)
        acc = __fadd_rn(acc, __fmul_rn(w[t * n_used + u], y[((size_t)t * n_used + u) * E + e]));
    out[(size_t)t * ldo + e] = acc;
}
