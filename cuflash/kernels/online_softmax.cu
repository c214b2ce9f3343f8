// online_softmax.cu — softmax over axis 1 of a (P, n, Q) array given with strides,
// equal to scipy.special.softmax(x, axis=1), NaN and inf semantics included.
//
// Pass 1 is the online softmax (Milakov & Gimelshein 2018): one read of the row keeps the running pair
//   m = max(m, x),   ℓ = ℓ · e^{m_old − m} + e^{x − m}
// (not a max pass followed by a sum pass). Pass 2 writes e^{x − m} / ℓ.
//
// Two launch shapes share that math:
//   softmax_rows_kernel  one block per (p, q) line, threads stride along n and merge
//                        their (m, ℓ) pairs (best when Q is small, e.g. Q = 1);
//   softmax_cols_kernel  one thread per (p, q) line, walking n serially; neighbouring
//                        threads take neighbouring q (coalesced when Q is contiguous).
//
// scipy semantics: a NaN anywhere makes the whole line NaN (e^{NaN − m} makes ℓ NaN, and
// it stays NaN through every later rescale and merge); a +inf gives e^{inf − inf} = NaN, so its line is NaN; an all −inf line gives
// e^{−inf − (−inf)} = NaN in pass 2, as scipy does. During pass 1 the −inf − (−inf) case
// must not poison ℓ for lines that do have finite entries later, hence the guards
// (those of common.cuh's OnlineSoftmax, the state the attention kernels keep too).
#include "common.cuh"

using namespace cuflash;

namespace {

// x · log2 e − m as one fma (m in log2 units): 2^{x·log2 e − m} = e^{x − m·ln 2}.
template <typename A> __device__ __forceinline__ A shifted(A x, A m) {
    return fma(x, MathConst<A>::log2e, -m);
}

// Pass 1 for one element x (natural units): m_new = max(m, x · log2 e),
// ℓ = α ℓ + 2^{x · log2 e − m_new}, the exponent taken by shifted() exactly as pass 2 does.
// The state is common.cuh's OnlineSoftmax: (m, ℓ) in log2 units, m the max of x · log2 e.
template <typename A> __device__ __forceinline__ void push(OnlineSoftmax<A>& st, A x) {
    st.update(x * MathConst<A>::log2e);
    st.l_i += fast_exp2(shifted(x, st.shift()));
}

// Pass 2 for one element: e^{x − m} / ℓ. The exponent is the very expression pass 1
// summed (one explicit fma, never left to the compiler's contraction choices), and the
// division is exact-rounded, so a line whose terms sum to ℓ exactly (one element, equal
// elements) gives exactly 1/n, as scipy does. No guard here on purpose: an all −inf line
// gives 2^{NaN} / 0 = NaN, as scipy.
template <typename A> __device__ __forceinline__ A softmax_out(A x, A m, A l) {
    return fast_exp2(shifted(x, m)) / l;
}

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
    OnlineSoftmax<A> st;
    st.init();
    for (int i = threadIdx.x; i < n; i += NUM_THREADS) push(st, to_float(xl[i * x_sn]));

    // -- merge the pairs: butterfly inside each warp, then across warps via shared memory
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
        const OnlineSoftmax<A> other{__shfl_xor_sync(0xffffffffu, st.m_i, offset),
                                     __shfl_xor_sync(0xffffffffu, st.l_i, offset)};
        st.merge(other);
    }
    __shared__ A s_m[kWarps], s_l[kWarps];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) {
        s_m[warp] = st.m_i;
        s_l[warp] = st.l_i;
    }
    __syncthreads();
    st.init();
#pragma unroll
    for (int w = 0; w < kWarps; ++w) st.merge(OnlineSoftmax<A>{s_m[w], s_l[w]});

    // -- pass 2: normalise
    for (int i = threadIdx.x; i < n; i += NUM_THREADS)
        yl[i * y_sn] = from_float<T>(softmax_out(to_float(xl[i * x_sn]), st.m_i, st.l_i));
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
    OnlineSoftmax<A> st;
    st.init();
    for (int i = 0; i < n; ++i) push(st, to_float(xl[i * x_sn]));
    // -- pass 2: normalise
    for (int i = 0; i < n; ++i)
        yl[i * y_sn] = from_float<T>(softmax_out(to_float(xl[i * x_sn]), st.m_i, st.l_i));
}
