#include <cuda_fp16.h>
#include <cuda_bf16.h>
// out = fma(a, b, c) and exp(a) in half / bfloat16, plus half2 arithmetic and conversions.
extern "C" __global__ void half_ops(const __half* a, const __half* b, const __half* c, __half* fma_out,
                                    __half* exp_out, float* sum2, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    fma_out[i] = __hfma(a[i], b[i], c[i]);
    exp_out[i] = hexp(a[i]);
    __half2 p = __halves2half2(a[i], b[i]);
    __half2 q = __hmul2(p, __float2half2_rn(2.0f));
    sum2[i] = __low2float(q) + __high2float(q);
}
extern "C" __global__ void bf16_ops(const __nv_bfloat16* a, const __nv_bfloat16* b, const __nv_bfloat16* c,
                                    __nv_bfloat16* fma_out, __nv_bfloat16* exp_out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    fma_out[i] = __hfma(a[i], b[i], c[i]);
    exp_out[i] = hexp(a[i]);
}
