// bwd_tile.cuh — the tile traits and the SIMT pieces shared by the two backward kernels
// of flash_bwd.cu (dK/dV and dQ), as attn_tile.cuh is for the forward's.
//
// Thread layout: a warp is cut into 32/G groups of G = LANES_PER_ROW lanes. A group owns
// ROWS_PER_GROUP rows of the block (keys in the dK/dV kernel, queries in the dQ kernel);
// lane g of the group holds the head-dim columns g, g+G, g+2G, … (DPL = D/G of them).
// A dot product over d is DPL FMAs per lane plus log2(G) xor-shuffles; interleaved
// columns make a group's shared-memory reads of one row consecutive words
// (conflict-free; all groups read the same row = broadcast).
//
// Shared memory (static, one array in the accumulation type A, carved in this order):
//   tile pair   2 x [TILE_ROWS][D]   the streamed operands: Q_i, dO_i (dK/dV kernel) or
//                                    K_j, V_j (dQ kernel); zero beyond d and the last row
//   row stats   2 x [TILE_ROWS]      lse_i·log2 e, D_i of the streamed rows (dK/dV only)
//   scores      2 x [TILE_ROWS x block rows]  Σ S_ij, Σ dP_ij over the head-dim chunks
//                                    visited so far (CHUNKED only)
// cuflash/plans/simt_bwd.py:bwd_smem_bytes mirrors kSmemBytes term for term (and the compile
// gate checks both against ptxas).
#pragma once

#include "common.cuh"
#include "variants.cuh"

namespace cuflash {

template <typename T, int HEAD_DIM, int LANES_PER_ROW, int ROWS_PER_GROUP, int NUM_WARPS,
          int TILE_ROWS, bool CHUNKED, bool QUERY_TILES>
struct BwdTileTraits {
    using A = accum_t<T>;
    static constexpr int kHeadDim = HEAD_DIM;
    static constexpr int kLanesPerRow = LANES_PER_ROW;              // G
    static constexpr int kDimPerLane = HEAD_DIM / LANES_PER_ROW;    // DPL
    static constexpr int kRowsPerGroup = ROWS_PER_GROUP;
    static constexpr int kGroupsPerWarp = 32 / LANES_PER_ROW;
    static constexpr int kThreads = NUM_WARPS * 32;
    // Rows a block owns: Bc keys (dK/dV) or Br queries (dQ).
    static constexpr int kBlockRows = NUM_WARPS * kGroupsPerWarp * ROWS_PER_GROUP;
    static constexpr int kTileRows = TILE_ROWS;
    static constexpr int kSmemTile = TILE_ROWS * HEAD_DIM;                // each of the pair
    static constexpr int kSmemRowStat = QUERY_TILES ? TILE_ROWS : 0;      // each of lse, D
    static constexpr int kSmemScores = CHUNKED ? TILE_ROWS * kBlockRows : 0;  // each of S, dP
    static constexpr int kSmemElems = 2 * kSmemTile + 2 * kSmemRowStat + 2 * kSmemScores;
    static constexpr int kSmemBytes = kSmemElems * (int)sizeof(A);

    static_assert(LANES_PER_ROW >= 1 && LANES_PER_ROW <= 32 &&
                      (LANES_PER_ROW & (LANES_PER_ROW - 1)) == 0,
                  "LANES_PER_ROW must be a power of two <= 32");
    static_assert(HEAD_DIM % LANES_PER_ROW == 0,
                  "the head-dim bucket must be a multiple of LANES_PER_ROW");
    static_assert(kSmemBytes <= 48 * 1024,
                  "static shared memory is capped at 48 KB: shrink TILE_ROWS");
};

// The thread's place in the layout above.
template <class Tr> struct BwdThreadCoord {
    int g;      // lane within its group: holds columns g + G·j
    int group;  // group within the block
    __device__ __forceinline__ BwdThreadCoord() {
        const int lane = threadIdx.x % 32;
        g = lane % Tr::kLanesPerRow;
        group = (threadIdx.x / 32) * Tr::kGroupsPerWarp + lane / Tr::kLanesPerRow;
    }
    // Row (within the block) of the group's t-th row.
    __device__ __forceinline__ int row(int t) const { return group * Tr::kRowsPerGroup + t; }
    // Head-dim column (within the chunk) of the lane's j-th column.
    __device__ __forceinline__ int col(int j) const { return g + Tr::kLanesPerRow * j; }
};

// Rows row0 + t (t < NR) of a and b, this lane's columns of the chunk at col0, into
// registers; zero beyond n rows and d columns so padding adds nothing to the dots.
template <class Tr, int NR, typename T>
__device__ __forceinline__ void load_rows(typename Tr::A (&ra)[NR][Tr::kDimPerLane],
                                          typename Tr::A (&rb)[NR][Tr::kDimPerLane],
                                          const T* a, long long a_sr, const T* b, long long b_sr,
                                          int row0, int n, int col0, int d,
                                          const BwdThreadCoord<Tr>& tc) {
    using A = typename Tr::A;
#pragma unroll
    for (int t = 0; t < NR; ++t) {
        const int row = row0 + t;
#pragma unroll
        for (int j = 0; j < Tr::kDimPerLane; ++j) {
            const int col = col0 + tc.col(j);
            const bool ok = row < n && col < d;
            ra[t][j] = ok ? to_float(a[row * a_sr + col]) : A(0);
            rb[t][j] = ok ? to_float(b[row * b_sr + col]) : A(0);
        }
    }
}

template <class Tr, int NR>
__device__ __forceinline__ void zero_rows(typename Tr::A (&r)[NR][Tr::kDimPerLane]) {
#pragma unroll
    for (int t = 0; t < NR; ++t)
#pragma unroll
        for (int j = 0; j < Tr::kDimPerLane; ++j) r[t][j] = typename Tr::A(0);
}

// A TILE_ROWS x D tile of a and b (rows row0.., columns col0..col0+D−1) into shared
// memory, all threads striding over it; zero beyond n rows and d columns.
template <class Tr, typename T>
__device__ __forceinline__ void load_tile_pair(typename Tr::A (*sa)[Tr::kHeadDim],
                                               typename Tr::A (*sb)[Tr::kHeadDim],
                                               const T* a, long long a_sr, const T* b,
                                               long long b_sr, int row0, int n, int col0, int d) {
    using A = typename Tr::A;
    constexpr int D = Tr::kHeadDim;
    for (int idx = threadIdx.x; idx < Tr::kTileRows * D; idx += Tr::kThreads) {
        const int r = idx / D, col = idx % D;
        const int row = row0 + r;
        const bool ok = row < n && col0 + col < d;
        sa[r][col] = ok ? to_float(a[row * a_sr + col0 + col]) : A(0);
        sb[r][col] = ok ? to_float(b[row * b_sr + col0 + col]) : A(0);
    }
}

// This lane's columns of one shared-memory row of a and b.
template <class Tr>
__device__ __forceinline__ void read_smem_row(typename Tr::A (&ra)[Tr::kDimPerLane],
                                              typename Tr::A (&rb)[Tr::kDimPerLane],
                                              const typename Tr::A* sa,
                                              const typename Tr::A* sb,
                                              const BwdThreadCoord<Tr>& tc) {
#pragma unroll
    for (int j = 0; j < Tr::kDimPerLane; ++j) {
        ra[j] = sa[tc.col(j)];
        rb[j] = sb[tc.col(j)];
    }
}

// lse_i · log2(e) and D_i of query row i. Padding rows (i ≥ Nq) act as fully masked
// rows: lse = −inf → P = 0.
template <typename A>
__device__ __forceinline__ void load_row_stats(const A* lse_bh, const A* delta_bh, int i,
                                               int Nq, A& lse2, A& Di) {
    lse2 = lse_log2(i < Nq ? lse_bh[i] : neg_inf<A>());
    Di = i < Nq ? delta_bh[i] : A(0);
}

// S_ij = q_i · k_j and dP_ij = dO_i · v_j: per-lane partial dots over this lane's
// columns, then a sum over the group's G lanes.
template <class Tr>
__device__ __forceinline__ void score_dots(const typename Tr::A (&qv)[Tr::kDimPerLane],
                                           const typename Tr::A (&kv)[Tr::kDimPerLane],
                                           const typename Tr::A (&dov)[Tr::kDimPerLane],
                                           const typename Tr::A (&vv)[Tr::kDimPerLane],
                                           typename Tr::A& s, typename Tr::A& dp) {
    using A = typename Tr::A;
    s = A(0);
    dp = A(0);
#pragma unroll
    for (int j = 0; j < Tr::kDimPerLane; ++j) {
        s = fma(qv[j], kv[j], s);
        dp = fma(dov[j], vv[j], dp);
    }
    s = warp_reduce_sum<Tr::kLanesPerRow>(s);
    dp = warp_reduce_sum<Tr::kLanesPerRow>(dp);
}

// Chunked kernels: S_ij = Σ_c (chunk c's partial). Before the own (last) chunk, lane 0 of
// the group folds its partials into sS[r][c], sdP[r][c] (one writer per element) and the
// caller skips the accumulation (false); on the own chunk the stored sums are added
// (a barrier separates the chunks) and s, dp are complete (true). One chunk: always true.
template <bool CHUNKED, int COLS, typename A>
__device__ __forceinline__ bool complete_scores(A& s, A& dp, A (*sS)[COLS], A (*sdP)[COLS],
                                                int r, int c, int i, bool last, int g) {
    if (!CHUNKED) return true;
    if (!last) {
        if (g == 0) {
            sS[r][c] = i > 0 ? sS[r][c] + s : s;
            sdP[r][c] = i > 0 ? sdP[r][c] + dp : dp;
        }
        return false;
    }
    if (i > 0) {
        s += sS[r][c];
        dp += sdP[r][c];
    }
    return true;
}

// P_ij = exp(scale · S_ij − lse_i), recomputed (never stored), and dS_ij = P_ij (dP_ij − D_i).
// With S scaled by scale·log2 e and lse given as lse·log2 e, P is one exp2.
template <typename A>
__device__ __forceinline__ void recompute_p_ds(A s, A dp, A scale_log2, A lse2, A Di,
                                               bool masked, A& p, A& ds) {
    p = fast_exp2(s * scale_log2 - lse2);
    if (masked) p = A(0);  // causal (j > i + Nk − Nq) or a padding key
    ds = p * (dp - Di);
}

// The same with attention variants (variants.cuh), differentiating the forward's chain
// s = scale·S → softcap → + ALiBi + bias → masks → P = exp(s' − lse) → dropout (Z):
//     p_drop = P ∘ Z                       (dV += p_dropᵀ dO; Z = keep/(1 − p), 1 without)
//     ds     = P ∘ (dP ∘ Z − D)            (the gradient wrt s', so dbias = ds)
//     ds_raw = ds ∘ g, g = ∂s'/∂s                (softcap: 1 − tanh²; score_mod: its
//                                                 derivative; else ds_raw = ds)
// `hidden`: causal, window, a padding key or a padding row (no score, nothing read).
template <typename T, typename A>
__device__ __forceinline__ void recompute_p_ds_variants(A s, A dp, A scale, A lse2, A Di,
                                                        bool hidden, const Variants<T>& var,
                                                        int i, int j, A& p_drop, A& ds,
                                                        A& ds_raw) {
    A p = A(0), g = A(1), z = A(1);
    if (!hidden) {
        // The biased score in natural units (−inf where the bool mask hides the key),
        // then log2 units as lse2 is: P = exp2(s'·log2 e − lse·log2 e).
        const A x = var.score(s * scale, i, j, g);
        p = fast_exp2(x * MathConst<A>::log2e - lse2);
        if (var.dropout()) z = var.keep(i, j);  // the forward's Philox draw for (b, h, i, j)
    }
    p_drop = p * z;
    ds = p * (dp * z - Di);
    ds_raw = var.reshapes() ? ds * g : ds;
}

// acc += a · x over this lane's columns (dV_j += P_ijᵀ dO_i, dK_j += dS_ijᵀ Q_i,
// dQ_i += dS_ij K_j).
template <class Tr>
__device__ __forceinline__ void axpy(typename Tr::A a, const typename Tr::A (&x)[Tr::kDimPerLane],
                                     typename Tr::A (&acc)[Tr::kDimPerLane]) {
#pragma unroll
    for (int j = 0; j < Tr::kDimPerLane; ++j) acc[j] = fma(a, x[j], acc[j]);
}

// Epilogue: rows row0 + t of r, times `factor`, to global memory in the element type:
// this lane's columns of the chunk at col0, skipping rows ≥ n and columns ≥ d.
template <class Tr, int NR, typename T>
__device__ __forceinline__ void store_rows(T* out, long long sr,
                                           const typename Tr::A (&r)[NR][Tr::kDimPerLane],
                                           typename Tr::A factor, int row0, int n, int col0,
                                           int d, const BwdThreadCoord<Tr>& tc) {
#pragma unroll
    for (int t = 0; t < NR; ++t) {
        const int row = row0 + t;
        if (row >= n) continue;
#pragma unroll
        for (int j = 0; j < Tr::kDimPerLane; ++j) {
            const int col = col0 + tc.col(j);
            if (col < d) out[row * sr + col] = from_float<T>(r[t][j] * factor);
        }
    }
}

}  // namespace cuflash
