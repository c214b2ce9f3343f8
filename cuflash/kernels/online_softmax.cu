// online_softmax.cu — softmax over axis 1 of a (P, n, Q) array given with strides,
// equal to scipy.special.softmax(x, axis=1), NaN and inf semantics included.
//
// Pass 1 is the online softmax (Milakov & Gimelshein 2018): one read of the line keeps the running pair
//   m = max(m, x),   ℓ = ℓ · e^{m_old − m} + e^{x − m}
// (not a max pass followed by a sum pass). Pass 2 writes e^{x − m} / ℓ.
//
// Two launch shapes share that math:
//   softmax_rows_kernel  one block per (p, q) line, threads stride along n and merge
//                        their (m, ℓ) pairs (best when Q is small, e.g. Q = 1);
//   softmax_cols_kernel  one thread per (p, q) line, walking n serially; neighbouring
//                        threads take neighbouring q (coalesced when Q is contiguous).
//
// m is the max of x itself, in natural units, and every exponent is (x − m) · log2 e, as
// scipy's exp(x − max). Not the attention kernels' log2-unit state (common.cuh's
// OnlineSoftmax fed x · log2 e): a max of x · log2 e has rounded, and x · log2 e − m is
// then off by up to ½ ulp(x · log2 e) at the max element itself, hundreds of log2 units
// once |x| ≳ 3e9 in float (1e19 in double), so ℓ = 2^{±512} → inf, and inf · 0 = NaN.
// x − m is exactly 0 at the max, and elsewhere off by a relative ε at most (exact, by
// Sterbenz, wherever |m| is large and e^{x − m} not negligible), for every finite x:
// x − m = −inf (x = −max, m = max) just gives e^{−inf} = 0.
//
// scipy semantics: a NaN anywhere makes the whole line NaN (e^{NaN − m} makes ℓ NaN, and
// it stays NaN through every later rescale and merge); a +inf gives e^{inf − inf} = NaN,
// so its line is NaN; an all −inf line gives e^{−inf − (−inf)} = NaN in pass 2, as scipy
// does. During pass 1 the −inf − (−inf) case must not poison ℓ for lines that do have
// finite entries later, hence the guard (common.cuh's safe_max_shift).
#include "common.cuh"

using namespace cuflash;

namespace {

// The running pair (m, ℓ) of one line or one slice of it, m in natural units.
template <typename A> struct LineSoftmax {
    A m, l;

    // e^d as one exp2: d ≤ 0 is a difference of inputs, so its product with log2 e has a
    // relative error only, never a rounded large term (and no fma to contract into).
    static __device__ __forceinline__ A exp_(A d) { return fast_exp2(d * MathConst<A>::log2e); }

    __device__ __forceinline__ void init() {
        m = neg_inf<A>();
        l = A(0);
    }

    // Raise m to m_new (≥ m), rescaling ℓ; m = m_new = −inf (nothing but −inf so far)
    // is guarded so that ℓ stays 0 rather than 0 · e^{NaN}.
    __device__ __forceinline__ void raise_to(A m_new) {
        l *= exp_(m - safe_max_shift(m_new));
        m = m_new;
    }

    // Pass 1 for one element: the exponent is the very expression pass 2 takes, so a
    // line whose terms sum to ℓ exactly (one element, equal elements) gives exactly 1/n.
    __device__ __forceinline__ void push(A x) {
        raise_to(max_(m, x));
        l += exp_(x - safe_max_shift(m));
    }

    // Merge the pair of a disjoint slice (another thread's).
    __device__ __forceinline__ void merge(A m_b, A l_b) {
        raise_to(max_(m, m_b));
        l += exp_(m_b - safe_max_shift(m)) * l_b;
    }

    // Pass 2 for one element: e^{x − m} / ℓ, exact-rounded division. No guard on
    // purpose: an all −inf line gives e^{NaN} / 0 = NaN, as scipy.
    __device__ __forceinline__ A out(A x) const { return exp_(x - m) / l; }
};

}  // namespace

template <typename T, int NUM_THREADS>
__global__ void __launch_bounds__(NUM_THREADS)
softmax_rows_kernel(const T* __restrict__ x, T* __restrict__ y, int P, int n, int Q,
                    long long x_sp, long long x_sn, long long x_sq,
                    long long y_sp, long long y_sn, long long y_sq) {
    using A = accum_t<T>;
    constexpr int kWarps = NUM_THREADS / 32;
    static_assert(NUM_THREADS % 32 == 0 && NUM_THREADS <= 1024, "whole warps, <= 1024 threads");
    const long long bid = blockIdx.x;
    const int q = (int)(bid % Q), p = (int)(bid / Q);
    const T* xl = x + p * x_sp + q * x_sq;
    T* yl = y + p * y_sp + q * y_sq;

    // -- pass 1: per-thread online (m, ℓ) over a strided slice of the line
    LineSoftmax<A> st;
    st.init();
    for (int i = threadIdx.x; i < n; i += NUM_THREADS) st.push(to_float(xl[i * x_sn]));

    // -- merge the pairs: butterfly inside each warp, then across warps via shared memory
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
        const A m_b = __shfl_xor_sync(0xffffffffu, st.m, offset);
        const A l_b = __shfl_xor_sync(0xffffffffu, st.l, offset);
        st.merge(m_b, l_b);
    }
    __shared__ A s_m[kWarps], s_l[kWarps];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) {
        s_m[warp] = st.m;
        s_l[warp] = st.l;
    }
    __syncthreads();
    st.init();
#pragma unroll
    for (int w = 0; w < kWarps; ++w) st.merge(s_m[w], s_l[w]);

    // -- pass 2: normalise
    for (int i = threadIdx.x; i < n; i += NUM_THREADS)
        yl[i * y_sn] = from_float<T>(st.out(to_float(xl[i * x_sn])));
}

template <typename T, int NUM_THREADS>
__global__ void __launch_bounds__(NUM_THREADS)
softmax_cols_kernel(const T* __restrict__ x, T* __restrict__ y, int P, int n, int Q,
                    long long x_sp, long long x_sn, long long x_sq,
                    long long y_sp, long long y_sn, long long y_sq) {
    using A = accum_t<T>;
    const long long idx = (long long)blockIdx.x * NUM_THREADS + threadIdx.x;
    if (idx >= (long long)P * Q) return;
    const int q = (int)(idx % Q), p = (int)(idx / Q);
    const T* xl = x + p * x_sp + q * x_sq;
    T* yl = y + p * y_sp + q * y_sq;

    // -- pass 1: online (m, ℓ) down the line
    LineSoftmax<A> st;
    st.init();
    for (int i = 0; i < n; ++i) st.push(to_float(xl[i * x_sn]));
    // -- pass 2: normalise
    for (int i = 0; i < n; ++i)
        yl[i * y_sn] = from_float<T>(st.out(to_float(xl[i * x_sn])));
}
