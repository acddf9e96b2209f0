// glu.cuh: the activation of a gated linear unit, shared by elementwise.cu (glu, glu_quant) and
// moe.cu (the expert-grouped gate | up GEMV with the GLU fused), so both round alike:
//   act 0 (silu): g / (1 + exp(-g))
//   act 1 (gelu, tanh form): 0.5 g (1 + tanh(0.7978845608 g (1 + 0.044715 g^2)))
// each product and sum rounded once (__fmul_rn / __fadd_rn: no contraction), as the CPU
// reference computes it. No launch geometry of its own.
#ifndef SPECSTREAM_GLU_CUH
#define SPECSTREAM_GLU_CUH

__device__ __forceinline__ float glu_act(float g, int act) {
    if (act == 0) return g / __fadd_rn(expf(-g), 1.0f);
    float y = __fmul_rn(g, g);
    y = __fmul_rn(y, 0.044715f);
    y = __fadd_rn(y, 1.0f);
    y = __fmul_rn(y, g);
    y = __fmul_rn(y, 0.7978845608028654f);
    y = tanhf(y);
    y = __fadd_rn(y, 1.0f);
    y = __fmul_rn(y, g);
    return __fmul_rn(y, 0.5f);
}

#endif  // SPECSTREAM_GLU_CUH
