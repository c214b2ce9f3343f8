// bwd_utils.cuh — the few device helpers the backward kernels (flash_bwd.cu) need beyond
// common.cuh (owned by the forward; everything shared lives there, once).
#pragma once

#include "common.cuh"

namespace cuflash_bwd {

using cuflash::accum_t;
using cuflash::neg_inf;

// +inf in either precision: the negation of common.cuh's bit-pattern −inf.
template <typename A> __device__ __forceinline__ A pos_inf() { return -neg_inf<A>(); }

// Fused multiply-add in the accumulation precision (one rounding, one instruction).
__device__ __forceinline__ float fma_acc(float a, float b, float c) { return fmaf(a, b, c); }
__device__ __forceinline__ double fma_acc(double a, double b, double c) { return fma(a, b, c); }

// int min/max without relying on the host/device overload sets of min()/max().
__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int imax(int a, int b) { return a > b ? a : b; }

// lse_i · log2(e) for the P recomputation P = exp2(S·scale·log2e − lse·log2e); a row with
// lse = −inf (no visible key, or a padding row) gets +inf so P = exp2(S − inf) = 0
// instead of exp2(+inf) = inf and then inf·0 = NaN.
template <typename A> __device__ __forceinline__ A lse_log2(A lse) {
    return lse == neg_inf<A>() ? pos_inf<A>() : lse * cuflash::MathConst<A>::log2e;
}

}  // namespace cuflash_bwd
