// attn_tile.cuh — the tile traits and the SIMT tile math shared by the FA2 and FA1
// forward kernels.
//
// Thread layout (one block = NUM_WARPS warps; each warp = 4 lane-rows x 8 lane-cols):
//   warp w owns the BLOCK_M / NUM_WARPS query rows starting at w · kWarpRows;
//   lane (lr, lc) = (lane / 8, lane % 8) owns rows  w·kWarpRows + lr + 4·i  (i < TR),
//   score columns  lc + 8·j (j < TC) and head-dim columns  lc + 8·t (t < TD).
// The 8 lanes of one row are consecutive, so row max / row sum are 3-step butterflies
// (warp_reduce_*<8>), and every P̃ row is written and read by one warp only.
//
// Shared memory (dynamic, one buffer, all in the accumulation type A — converted once on
// load, so the inner loops are pure FMA):
//   sQ [BLOCK_M][D + 1]   Q_i (later: staging for the O tile store)
//   sK [BLOCK_N][D + 1]   K_j
//   sV [BLOCK_N][D + 1]   V_j
//   sP [BLOCK_M][BLOCK_N + 1]  P̃_ij
// The +1 pad puts the 8 different K rows a warp reads at one k in 8 different banks.
// cuflash/plans/simt_fwd.py:attention_smem_bytes mirrors kSmemBytes term for term.
#pragma once

#include "common.cuh"
#include "mask.cuh"
#include "variants.cuh"

namespace cuflash {

template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS>
struct AttnTileTraits {
    using A = accum_t<T>;
    static constexpr int kHeadDim = HEAD_DIM;
    static constexpr int kBlockM = BLOCK_M;
    static constexpr int kBlockN = BLOCK_N;
    static constexpr int kThreads = NUM_WARPS * 32;
    static constexpr int kLaneRows = 4;
    static constexpr int kLaneCols = 8;
    static constexpr int kWarpRows = BLOCK_M / NUM_WARPS;
    static constexpr int kRowsPerThread = kWarpRows / kLaneRows;  // TR
    static constexpr int kColsPerThread = BLOCK_N / kLaneCols;    // TC
    static constexpr int kDimPerThread = HEAD_DIM / kLaneCols;    // TD
    static constexpr int kPad = 1;
    static constexpr int kRowStride = HEAD_DIM + kPad;
    static constexpr int kPStride = BLOCK_N + kPad;
    static constexpr int kSmemQ = BLOCK_M * kRowStride;
    static constexpr int kSmemK = BLOCK_N * kRowStride;
    static constexpr int kSmemV = BLOCK_N * kRowStride;
    static constexpr int kSmemP = BLOCK_M * kPStride;
    static constexpr int kSmemElems = kSmemQ + kSmemK + kSmemV + kSmemP;
    static constexpr int kSmemBytes = kSmemElems * (int)sizeof(A);

    static_assert(BLOCK_M % (NUM_WARPS * kLaneRows) == 0,
                  "BLOCK_M must be a multiple of 4 * NUM_WARPS (4 lane-rows per warp)");
    static_assert(BLOCK_N % kLaneCols == 0, "BLOCK_N must be a multiple of 8 (lane-cols)");
    static_assert(HEAD_DIM % kLaneCols == 0, "HEAD_DIM bucket must be a multiple of 8");
    static_assert(kRowsPerThread * kDimPerThread * (int)sizeof(A) <= 64 * 4,
                  "O accumulator exceeds 64 registers per thread: shrink BLOCK_M or HEAD_DIM");
    static_assert(kSmemBytes <= 227 * 1024,
                  "tile exceeds the largest shared memory of any GPU (227 KB)");
};

// The thread's place in the layout above.
template <class Tr> struct ThreadCoord {
    int warp, lane_row, lane_col;
    __device__ __forceinline__ ThreadCoord() {
        const int lane = threadIdx.x % 32;
        warp = threadIdx.x / 32;
        lane_row = lane / Tr::kLaneCols;
        lane_col = lane % Tr::kLaneCols;
    }
    // Row (within the tile) of the thread's i-th row.
    __device__ __forceinline__ int row(int i) const {
        return warp * Tr::kWarpRows + lane_row + i * Tr::kLaneRows;
    }
    __device__ __forceinline__ int col(int j) const { return lane_col + j * Tr::kLaneCols; }
};

// Load rows [row0, row0 + ROWS) x columns [col0, col0 + HEAD_DIM) of a (rows x d) matrix
// with row stride `ld` (last dim contiguous) into smem [ROWS][kRowStride], converting to
// A. Rows >= n_rows and columns >= n_cols are written as 0: zero-padding makes the
// padded head-dim columns add nothing to Q Kᵀ and keeps P̃ · V finite (0 · NaN = NaN, and
// the emulator fills shared memory with NaN).
// Each thread keeps one column and walks rows (no per-element div/mod; a trip count known
// at compile time), and consecutive threads read consecutive columns: coalesced.
template <class Tr, int ROWS, typename T>
__device__ __forceinline__ void load_tile(typename Tr::A* __restrict__ s, const T* __restrict__ g,
                                          long long ld, int row0, int n_rows, int col0,
                                          int n_cols) {
    using A = typename Tr::A;
    constexpr int D = Tr::kHeadDim, NT = Tr::kThreads;
    static_assert(NT % D == 0 || D % NT == 0, "HEAD_DIM and the thread count must nest");
    constexpr int kColsPerPass = D < NT ? D : NT;    // columns covered by one pass
    constexpr int kRowsPerPass = NT / kColsPerPass;  // rows covered by one pass
    constexpr int kColPasses = D / kColsPerPass;
    const int c0 = threadIdx.x % kColsPerPass;
    const int r0 = threadIdx.x / kColsPerPass;
#pragma unroll
    for (int cp = 0; cp < kColPasses; ++cp) {
        const int c = c0 + cp * kColsPerPass;
        const bool col_ok = col0 + c < n_cols;
// unroll 2, not 4: two loads in flight per thread, and half the NVRTC time of 4
#pragma unroll 2
        for (int r = r0; r < ROWS; r += kRowsPerPass) {
            A x = A(0);
            if (col_ok && row0 + r < n_rows) x = to_float(g[(long long)(row0 + r) * ld + (col0 + c)]);
            s[r * Tr::kRowStride + c] = x;
        }
    }
}

// s[i][j] += Σ_k sQ[row(i)][k] · sK[col(j)][k]  — one D-wide chunk of S = Q Kᵀ.
template <class Tr>
__device__ __forceinline__ void gemm_qk(typename Tr::A (&s)[Tr::kRowsPerThread][Tr::kColsPerThread],
                                        const typename Tr::A* __restrict__ sQ,
                                        const typename Tr::A* __restrict__ sK,
                                        const ThreadCoord<Tr>& tc) {
    using A = typename Tr::A;
    constexpr int D = Tr::kHeadDim;
#pragma unroll 4
    for (int k = 0; k < D; ++k) {
        A qv[Tr::kRowsPerThread], kv[Tr::kColsPerThread];
#pragma unroll
        for (int i = 0; i < Tr::kRowsPerThread; ++i) qv[i] = sQ[tc.row(i) * Tr::kRowStride + k];
#pragma unroll
        for (int j = 0; j < Tr::kColsPerThread; ++j) kv[j] = sK[tc.col(j) * Tr::kRowStride + k];
#pragma unroll
        for (int i = 0; i < Tr::kRowsPerThread; ++i)
#pragma unroll
            for (int j = 0; j < Tr::kColsPerThread; ++j) s[i][j] = fma(qv[i], kv[j], s[i][j]);
    }
}

// acc[i][t] += Σ_n sP[row(i)][n] · sV[n][col(t)]  — O += P̃ V.
template <class Tr>
__device__ __forceinline__ void gemm_pv(typename Tr::A (&acc)[Tr::kRowsPerThread][Tr::kDimPerThread],
                                        const typename Tr::A* __restrict__ sP,
                                        const typename Tr::A* __restrict__ sV,
                                        const ThreadCoord<Tr>& tc) {
    using A = typename Tr::A;
    constexpr int BN = Tr::kBlockN;
#pragma unroll 4
    for (int n = 0; n < BN; ++n) {
        A pv[Tr::kRowsPerThread];
#pragma unroll
        for (int i = 0; i < Tr::kRowsPerThread; ++i) pv[i] = sP[tc.row(i) * Tr::kPStride + n];
#pragma unroll
        for (int t = 0; t < Tr::kDimPerThread; ++t) {
            const A vv = sV[n * Tr::kRowStride + tc.col(t)];
#pragma unroll
            for (int i = 0; i < Tr::kRowsPerThread; ++i) acc[i][t] = fma(pv[i], vv, acc[i][t]);
        }
    }
}

// The thread's TR x TC register tile to and from its own entries of sP. The variant chain
// and dropout run in one rolled loop over those entries (`#pragma unroll 1`): inlined into
// the unrolled TR x TC register loop, the chain (tanh, bias and mask reads, ALiBi) and
// Philox's ten rounds would be compiled TR·TC times over — NVRTC time, not speed — and a
// rolled loop cannot index registers without local memory. Only this thread touches these
// entries, so no barrier is needed; sP is free between the previous P̃ V and this P̃.
template <class Tr>
__device__ __forceinline__ void stage_to_sp(
    const typename Tr::A (&s)[Tr::kRowsPerThread][Tr::kColsPerThread], typename Tr::A* sP,
    const ThreadCoord<Tr>& tc) {
#pragma unroll
    for (int i = 0; i < Tr::kRowsPerThread; ++i)
#pragma unroll
        for (int j = 0; j < Tr::kColsPerThread; ++j)
            sP[tc.row(i) * Tr::kPStride + tc.col(j)] = s[i][j];
}

template <class Tr>
__device__ __forceinline__ void unstage_from_sp(
    typename Tr::A (&s)[Tr::kRowsPerThread][Tr::kColsPerThread], const typename Tr::A* sP,
    const ThreadCoord<Tr>& tc) {
#pragma unroll
    for (int i = 0; i < Tr::kRowsPerThread; ++i)
#pragma unroll
        for (int j = 0; j < Tr::kColsPerThread; ++j)
            s[i][j] = sP[tc.row(i) * Tr::kPStride + tc.col(j)];
}

// Dropout on the thread's own P̃ entries of sP, once they are written: P̃ ∘ keep/(1 − p).
template <class Tr, typename T>
__device__ __forceinline__ void dropout_sp(typename Tr::A* sP, int m0, int n0,
                                           const Variants<T>& var, const ThreadCoord<Tr>& tc) {
#pragma unroll 1
    for (int e = 0; e < Tr::kRowsPerThread * Tr::kColsPerThread; ++e) {
        const int r = tc.row(e / Tr::kColsPerThread), c = tc.col(e % Tr::kColsPerThread);
        sP[r * Tr::kPStride + c] *= var.keep(m0 + r, n0 + c);
    }
}

// S_ij = Q_i K_jᵀ over all head-dim chunks, then scaled by scale·log2(e) and masked;
// with variants, the score chain of variants.cuh runs in natural units first, on the
// thread's own entries of sP (stage_to_sp above).
// With one chunk Q_i stays resident in sQ (loaded in the prologue); with more, each chunk
// of Q_i and K_j is staged in turn. On return sK/sQ are free only after a barrier.
// Precondition: K chunk 0 (and Q chunk 0 when n_chunks > 1) loaded and synced.
template <class Tr, typename T>
__device__ __forceinline__ void compute_scores(
    typename Tr::A (&s)[Tr::kRowsPerThread][Tr::kColsPerThread], typename Tr::A* sQ,
    typename Tr::A* sK, typename Tr::A* sP, const T* q_bh, long long q_sr, const T* k_tile,
    long long k_sr,
    int m0, int n0, int Nq, int Nk, int d, int n_chunks, typename Tr::A scale_log2,
    const CausalMask& mask, const Variants<T>& var, const ThreadCoord<Tr>& tc) {
    using A = typename Tr::A;
    constexpr int D = Tr::kHeadDim;
#pragma unroll
    for (int i = 0; i < Tr::kRowsPerThread; ++i)
#pragma unroll
        for (int j = 0; j < Tr::kColsPerThread; ++j) s[i][j] = A(0);
    gemm_qk<Tr>(s, sQ, sK, tc);
    for (int c = 1; c < n_chunks; ++c) {  // only for d beyond the largest bucket
        __syncthreads();                  // everyone done with the previous chunk
        load_tile<Tr, Tr::kBlockM>(sQ, q_bh, q_sr, m0, Nq, c * D, d);
        load_tile<Tr, Tr::kBlockN>(sK, k_tile, k_sr, 0, Nk - n0, c * D, d);
        __syncthreads();
        gemm_qk<Tr>(s, sQ, sK, tc);
    }
    // Fold softmax_scale · log2(e) into one multiply: P̃ = exp2(S' − m) with S' in log2
    // units is exp(scale · S − m) at the cost of exp2 (one MUFU op) instead of exp.
    const bool needs_mask = mask.tile_needs_mask(m0, n0, Tr::kBlockN);
    if (var.scores()) {
        // softcap, ALiBi and bias act on the natural score scale·q·k; the chain runs
        // before the log2 units, and only on (row, key) pairs in range and not hidden.
        const A scale = scale_log2 * MathConst<A>::ln2;
        stage_to_sp<Tr>(s, sP, tc);
#pragma unroll 1
        for (int e = 0; e < Tr::kRowsPerThread * Tr::kColsPerThread; ++e) {
            const int r = tc.row(e / Tr::kColsPerThread), c = tc.col(e % Tr::kColsPerThread);
            A& x = sP[r * Tr::kPStride + c];
            A t, y = neg_inf<A>();
            if (m0 + r < Nq && !(needs_mask && mask.masked(m0 + r, n0 + c)))
                y = var.score(x * scale, m0 + r, n0 + c, t) * MathConst<A>::log2e;
            x = y;
        }
        unstage_from_sp<Tr>(s, sP, tc);
        return;
    }
#pragma unroll
    for (int i = 0; i < Tr::kRowsPerThread; ++i)
#pragma unroll
        for (int j = 0; j < Tr::kColsPerThread; ++j) {
            s[i][j] *= scale_log2;
            // Masked keys get −inf, so P̃ = exp2(−inf − m) = 0 exactly.
            if (needs_mask && mask.masked(m0 + tc.row(i), n0 + tc.col(j))) s[i][j] = neg_inf<A>();
        }
}

}  // namespace cuflash
