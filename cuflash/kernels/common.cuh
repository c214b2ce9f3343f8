// common.cuh — device code every cuflash kernel shares, written once.
//
//   * accum_t<T>            the accumulation type (float; double for double)
//   * to_float / from_float conversions between storage and accumulation types
//   * neg_inf<A>()          −inf without <cmath> (NVRTC has no host headers)
//   * fast_exp2 / fast_log2 one spelling for float and double
//   * softmax_scale_log2    scale · log2 e, the one multiply that puts scores in log2 units
//   * lse_log2              lse · log2 e for the backward's recomputation of P
//   * warp_reduce_max/sum   butterfly reductions with __shfl_xor_sync
//   * Strides               an array's (batch, head, row) element strides, one kernel argument
//   * OnlineSoftmax         the running state (m_i, ℓ_i) of one softmax row, with the
//                           three phases of the papers' Algorithm 1: init, update,
//                           finalize (→ 1/ℓ for O, and lse); used by the forward
//                           kernels (online_softmax.cu keeps its own, in natural units)
//
// Everything is plain SIMT C++ (no inline PTX) so the CPU emulator runs it unchanged.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace cuflash {

// A compile-time flag as a value, to pick a lambda's code path (`if constexpr
// (decltype(tag)::value)`, or a plain `if (tag)` that also takes a run-time bool): one
// body written once, instantiated per path.
template <bool B> struct Bool {
    static constexpr bool value = B;
    constexpr operator bool() const { return B; }
};

// ---------------------------------------------------------------------------------
// Types and conversions
// ---------------------------------------------------------------------------------

// 16-bit and float inputs accumulate in float; double stays double.
template <typename T> struct AccumType { using type = float; };
template <> struct AccumType<double> { using type = double; };
template <typename T> using accum_t = typename AccumType<T>::type;

__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ double to_float(double x) { return x; }  // "to accum": double stays double

// Storage type from its accumulation type, rounding to nearest even.
template <typename T> __device__ __forceinline__ T from_float(accum_t<T> x);
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ double from_float<double>(double x) { return x; }

// ---------------------------------------------------------------------------------
// Kernel arguments
// ---------------------------------------------------------------------------------

// Element strides of a (B, H, N, d) array along its batch, head and row axes (its last
// axis is contiguous); b = 0 for packed sequences, whose rows carry the batch offset
// (seqlens.cuh). cuflash/backends/marshal.py's STRIDES record. A kernel takes it by value
// or as a __grid_constant__ (read in place, where used): the tensor-core kernels sit at
// 255 registers, where either form can tip ptxas into spilling, so each takes the one with
// which the gate finds no spill on either toolkit.
struct Strides {
    long long b, h, r;
};

// ---------------------------------------------------------------------------------
// Constants and math that NVRTC lacks host headers for
// ---------------------------------------------------------------------------------

// −inf by bit pattern: NVRTC has no <cmath>/INFINITY.
template <typename A> __device__ __forceinline__ A neg_inf();
template <> __device__ __forceinline__ float neg_inf<float>() { return __int_as_float(0xff800000); }
template <> __device__ __forceinline__ double neg_inf<double>() {
    return __longlong_as_double(0xfff0000000000000ULL);
}

template <typename A> struct MathConst;
template <> struct MathConst<float> {
    static constexpr float log2e = 1.4426950408889634f;
    static constexpr float ln2 = 0.6931471805599453f;
};
template <> struct MathConst<double> {
    static constexpr double log2e = 1.4426950408889634074;
    static constexpr double ln2 = 0.69314718055994530942;
};

// exp2 is one hardware instruction (MUFU.EX2) in float; scores are pre-multiplied by
// log2(e) so that exp(x) = exp2(x · log2 e) costs no extra multiply per element.
__device__ __forceinline__ float fast_exp2(float x) { return exp2f(x); }
__device__ __forceinline__ double fast_exp2(double x) { return exp2(x); }
__device__ __forceinline__ float fast_log2(float x) { return log2f(x); }
__device__ __forceinline__ double fast_log2(double x) { return log2(x); }

// max that ignores NaN (like fmaxf, one instruction): a NaN score still turns its row NaN
// through P̃ = exp2(NaN − m) = NaN, which makes ℓ NaN for good (NaN · α and NaN + x stay
// NaN), and only that row. So no NaN-propagating max is needed, softmax's scipy
// semantics (a NaN anywhere → the whole line NaN) included.
__device__ __forceinline__ float max_(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double max_(double a, double b) { return fmax(a, b); }

// The softmax scale folded with log2(e): scores multiplied by it are in log2 units, so
// exp(scale · s − m) = exp2(s · scale·log2 e − m') costs one exp2 (one MUFU op) and no
// extra multiply per element. Every attention kernel takes `scale` and derives this here.
template <typename A> __device__ __forceinline__ A softmax_scale_log2(A scale) {
    return scale * MathConst<A>::log2e;
}

// lse_i · log2(e), for the backward's P = exp2(S · scale·log2 e − lse · log2 e). A row
// with lse = −inf (it sees no key, or it is padding) gets +inf, so P = exp2(S − inf) = 0
// rather than exp2(+inf) = inf and then inf · 0 = NaN.
template <typename A> __device__ __forceinline__ A lse_log2(A lse) {
    return lse == neg_inf<A>() ? -neg_inf<A>() : lse * MathConst<A>::log2e;
}

// exp2(x − m) where m may be −inf: if m = −inf every x of the row is −inf as well and
// x − m would be −inf − (−inf) = NaN; subtracting 0 instead gives exp2(−inf) = 0.
template <typename A> __device__ __forceinline__ A safe_max_shift(A m) {
    return m == neg_inf<A>() ? A(0) : m;
}

// ---------------------------------------------------------------------------------
// Warp reductions
// ---------------------------------------------------------------------------------

// Butterfly reduction over the `width` consecutive lanes that share one row
// (width a power of two ≤ 32); every lane of the group gets the result.
template <int WIDTH, typename A> __device__ __forceinline__ A warp_reduce_max(A v) {
#pragma unroll
    for (int offset = WIDTH / 2; offset > 0; offset /= 2)
        v = max_(v, __shfl_xor_sync(0xffffffffu, v, offset, WIDTH));
    return v;
}

template <int WIDTH, typename A> __device__ __forceinline__ A warp_reduce_sum(A v) {
#pragma unroll
    for (int offset = WIDTH / 2; offset > 0; offset /= 2)
        v += __shfl_xor_sync(0xffffffffu, v, offset, WIDTH);
    return v;
}

// ---------------------------------------------------------------------------------
// Online softmax state of one row (papers' m_i, ℓ_i; acc lives with the caller)
// ---------------------------------------------------------------------------------
//
// Values arrive in log2 units (scores already multiplied by scale·log2 e), so m_i is in
// log2 units and P̃ = exp2(S − m_i). update() raises m_i, rescales ℓ_i and returns the
// factor α that the caller applies to whatever else is relative to the old m_i (acc).
// NaN, ±inf: see max_ and safe_max_shift above.
template <typename A> struct OnlineSoftmax {
    A m_i;  // running row max (log2 units)
    A l_i;  // running ℓ = rowsum(P̃) relative to m_i

    // -- init: m = −inf, ℓ = 0 (Algorithm 1, line 5)
    __device__ __forceinline__ void init() {
        m_i = neg_inf<A>();
        l_i = A(0);
    }

    // -- update: m_new = max(m_i, m), ℓ_i ← α ℓ_i with α = exp2(m_old − m_new), returned.
    // The caller then adds rowsum(P̃), P̃ = exp2(S − shift()), to l_i.
    __device__ __forceinline__ A update(A m) {
        const A m_new = max_(m_i, m);
        // m_old = m_new = −inf (nothing seen yet, row fully masked so far) would give
        // exp2(−inf − (−inf)) = NaN; the guarded shift makes α = exp2(−inf) = 0.
        const A alpha = fast_exp2(m_i - safe_max_shift(m_new));
        m_i = m_new;
        l_i *= alpha;
        return alpha;
    }

    // The value subtracted from every score before exp2 (guarded −inf, see above).
    __device__ __forceinline__ A shift() const { return safe_max_shift(m_i); }

    // exp2(m − m_i): rescales a sum kept relative to an older or partial max m (≤ m_i)
    // to the current one.
    __device__ __forceinline__ A weight(A m) const { return fast_exp2(m - shift()); }

    // Merge the state of disjoint values (another lane's, or one tile's):
    // ℓ_i ← α ℓ_i + exp2(m_b − m_new) ℓ_b. Returns α.
    __device__ __forceinline__ A merge(const OnlineSoftmax& b) {
        const A alpha = update(b.m_i);
        l_i += weight(b.m_i) * b.l_i;
        return alpha;
    }

    // -- finalize: O = acc / ℓ. A row that saw no key (ℓ = 0) gets O = 0, never 0/0 = NaN;
    // a NaN ℓ stays NaN so a NaN score poisons its own row only.
    __device__ __forceinline__ A inv_l() const { return l_i == A(0) ? A(0) : A(1) / l_i; }

    // lse = ln Σ exp(s) = (m + log2 ℓ) · ln 2 in natural-log units; −inf for ℓ = 0.
    __device__ __forceinline__ A lse() const {
        return l_i == A(0) ? neg_inf<A>() : (m_i + fast_log2(l_i)) * MathConst<A>::ln2;
    }
};

}  // namespace cuflash
