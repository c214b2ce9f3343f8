// tc_bwd_tile.cuh — the tensor-core backward's traits and the pieces its kernels share
// (flash_bwd_tc.cu): P and dS on mma fragments, the row statistics' copies, the epilogue.
//
// Both kernels give each warp 16 rows of the block ("own" rows: keys in the dK/dV kernel,
// queries in the dQ kernel) and stream the other operand pair in tiles of TILE_ROWS rows.
// Every product then has the warp's own rows as its M dimension:
//
//   dK/dV kernel (own: K_j, V_j; streamed: Q_i, dO_i)
//     Sᵀ  = K_j Q_iᵀ        A: K_j (own)       B: Q_i rows
//     dPᵀ = V_j dO_iᵀ       A: V_j (own)       B: dO_i rows
//     dV_j += Pᵀ dO_i       A: Pᵀ (C → A)      B: dO_i (transposed)
//     dK_j += dSᵀ Q_i       A: dSᵀ (C → A)     B: Q_i (transposed)
//   dQ kernel (own: Q_i, dO_i; streamed: K_j, V_j)
//     S   = Q_i K_jᵀ        A: Q_i (own)       B: K_j rows
//     dP  = dO_i V_jᵀ       A: dO_i (own)      B: V_j rows
//     dQ_i += dS K_j        A: dS (C → A)      B: K_j (transposed)
//
// So the dK/dV kernel computes the *transposed* scores Sᵀ (keys as rows): Pᵀ and dSᵀ land
// in C fragments whose rows are the warp's keys, which are exactly the A fragments that
// dV_j += Pᵀ dO_i and dK_j += dSᵀ Q_i need — no transpose through shared memory, no second
// copy of P. The price is that lse_i and D_i belong to the fragment's *columns*: they come
// with each Q_i tile into shared memory as (lse_i · log2 e, D_i) pairs (cp.async, 8 bytes
// per row) and every thread reads those of its columns 8j + 2t, 8j + 2t + 1 (16 bytes).
//
// Every product is one of tc_gemm.cuh's two shapes: gemm_own_rows (own A fragments × the
// rows of a streamed tile: the forward's Q Kᵀ) and gemm_c_tile (C fragments as A × a
// streamed tile: the forward's P̃ V), on f16/bf16 or tf32 mma. They read these traits by
// the forward's names: kQInRegs / kQFrags are the own operands' A fragments (held in
// registers, or re-read from shared memory at every k step), kSTiles the n-tiles of S
// (TILE_ROWS / 8), kPVSteps the k steps over the streamed rows, kOTiles the n-tiles of an
// accumulator (CHUNK_COLS / 8: a block accumulates CHUNK_COLS of the output's columns,
// HEAD_DIM unless chunked).
//
// Shared memory (dynamic, tiles in T, swizzled as in tc_tile.cuh):
//   own pair     2 x [BLOCK_ROWS][D]            K_j, V_j  |  Q_i, dO_i   (then: the
//                                               epilogue's staging of dK_j, dV_j | dQ_i)
//   ring pair    2 x [STAGES][TILE_ROWS][D]     Q_i, dO_i |  K_j, V_j
//   row stats    [STAGES][TILE_ROWS] x 2 float  (lse_i · log2 e, D_i) (dK/dV kernel only)
//   dSᵀ          [BLOCK_ROWS][TILE_ROWS + 8]    the tile's dSᵀ for dQ_i += dS K_j (dK/dV
//                                               kernel with DQ_PARTS only; rows padded by
//                                               16 bytes: its stores and ldmatrix.trans
//                                               reads hit 32 distinct banks)
// cuflash/plans/tc_bwd.py:tc_bwd_smem_bytes mirrors kSmemBytes term for term.
#pragma once

#include "common.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "tc_gemm.cuh"
#include "bwd_tile.cuh"

namespace cuflash {

// Whether a main-loop iteration is plain (no variants, no dropout): a Bool (common.cuh),
// one body instantiated for each loop, so the plain loop has no branch on the variants;
// or a bool, tested in the iteration (one loop for both, Tr::kPlainLoop false).
template <bool B> __device__ __forceinline__ constexpr bool is_plain(Bool<B>) { return B; }
__device__ __forceinline__ bool is_plain(bool plain) { return plain; }

// T: __half or __nv_bfloat16 (k16 steps), or float (k8 steps of tf32; SPLIT: 3xTF32).
// DQ_PARTS (dK/dV kernel, 16-bit, one chunk): the block also adds dQ_i += dS K_j into its
// worker's float32 partial of dQ (the 5-GEMM backward, flash_bwd_tc.cu).
template <typename T, int HEAD_DIM, int BLOCK_ROWS, int TILE_ROWS, int NUM_WARPS, int STAGES,
          bool OWN_IN_REGS, int CHUNK_COLS, bool ROW_STATS, bool SPLIT, bool DQ_PARTS = false>
struct TcBwdTraits {
    using Elem = T;
    static constexpr int kHeadDim = HEAD_DIM;
    static constexpr int kBlockRows = BLOCK_ROWS;       // own rows: Bc keys | Br queries
    static constexpr int kTileRows = TILE_ROWS;         // streamed rows per tile
    static constexpr int kStages = STAGES;
    static constexpr int kThreads = NUM_WARPS * 32;
    static constexpr int kWarpRows = 16;                // one mma row tile per warp
    static constexpr int kChunkElems = 16 / (int)sizeof(T);
    static constexpr int kChunksPerRow = HEAD_DIM / kChunkElems;
    static constexpr bool kTf32 = sizeof(T) == 4;       // float32 on tf32 mma
    static constexpr bool kSplit = SPLIT;
    static constexpr int kK = kTf32 ? 8 : 16;           // the mma's k per step
    static constexpr int kKSteps = HEAD_DIM / kK;       // k steps of S (over the head dim)
    static constexpr int kSTiles = TILE_ROWS / 8;       // n-tiles of S, dP (streamed rows)
    static constexpr int kPVSteps = TILE_ROWS / kK;     // k steps of P·X (streamed rows)
    static constexpr int kChunkCols = CHUNK_COLS;       // output columns per block
    static constexpr bool kChunked = CHUNK_COLS < HEAD_DIM;
    static constexpr int kOTiles = CHUNK_COLS / 8;      // n-tiles of dK, dV, dQ (one chunk)
    static constexpr bool kQInRegs = OWN_IN_REGS;       // own A fragments in registers
    static constexpr int kQFrags = kQInRegs ? kKSteps : 1;
    // Whether a plain call runs a main loop of its own. Split tf32 with head-dim chunks
    // keeps one loop testing the variants in each iteration: with 128 accumulator
    // registers and the split's operands, two loops spill (dK/dV, sm_100), and its plain
    // path is the cheaper of the two already.
    static constexpr bool kPlainLoop = !(SPLIT && kChunked);
    using OwnFrag = typename OwnFragment<T>::type;
    static constexpr int kSmemOwn = BLOCK_ROWS * HEAD_DIM;           // elements, each of 2
    static constexpr int kSmemRing = STAGES * TILE_ROWS * HEAD_DIM;  // elements, each of 2
    static constexpr int kSmemStats = ROW_STATS ? STAGES * TILE_ROWS : 0;  // rows, 2 floats each
    static constexpr bool kDqParts = DQ_PARTS;
    static constexpr int kDsStride = TILE_ROWS + 8;                  // dSᵀ row, in elements
    static constexpr int kSmemDs = DQ_PARTS ? BLOCK_ROWS * kDsStride : 0;  // elements
    static constexpr int kSmemBytes = (2 * kSmemOwn + 2 * kSmemRing + kSmemDs) * (int)sizeof(T) +
                                      2 * kSmemStats * (int)sizeof(float);
    // dQ_i += dS K_j (DQ_PARTS): the warps tile dQ_i's TILE_ROWS x HEAD_DIM as kDqRowGroups
    // 16-row groups by the rest of the warps in columns, kDqCols each.
    static constexpr int kDqRowGroups = TILE_ROWS / 16;
    static constexpr int kDqCols = HEAD_DIM * kDqRowGroups / NUM_WARPS;

    static_assert(sizeof(T) == 2 || kTf32, "tensor-core tiles hold f16, bf16 or float32");
    static_assert(!SPLIT || kTf32, "split tf32 is a float32 mode");
    static_assert(BLOCK_ROWS == kWarpRows * NUM_WARPS,
                  "each warp owns one 16-row mma tile: BLOCK_ROWS = 16 * NUM_WARPS");
    static_assert(TILE_ROWS % kK == 0,
                  "TILE_ROWS must be a multiple of 16 (k16 steps of P·X, ldmatrix.x4 pairs), "
                  "or of 8 for float32 (k8 steps)");
    static_assert(HEAD_DIM * (int)sizeof(T) % 128 == 0,
                  "a row must be a multiple of 128 bytes: the swizzle permutes 8 chunks of 16 bytes");
    static_assert(STAGES >= 2, "the cp.async pipeline needs at least two stages");
    static_assert(CHUNK_COLS % 16 == 0 && HEAD_DIM % CHUNK_COLS == 0,
                  "CHUNK_COLS must divide HEAD_DIM in multiples of 16 (ldmatrix.x4.trans pairs)");
    static_assert(CHUNK_COLS * (int)sizeof(T) % 128 == 0,
                  "a head-dim chunk must start on a swizzle period (8 chunks of 16 bytes)");
    static_assert((2 * kSmemOwn + 2 * kSmemRing) * (int)sizeof(T) % 16 == 0,
                  "the row statistics start 16-byte aligned");
    static_assert(!DQ_PARTS || (sizeof(T) == 2 && !kChunked && ROW_STATS),
                  "dQ partials come from the 16-bit dK/dV kernel over the whole head dim");
    static_assert(!DQ_PARTS || (NUM_WARPS % kDqRowGroups == 0 && kDqCols % 16 == 0),
                  "dQ_i's 16-row groups must divide the warps, leaving 16-column multiples");
    static_assert(kSmemBytes <= 227 * 1024, "tile exceeds the largest shared memory of any GPU (227 KB)");
};

// The ldmatrix addresses of the backward's 16-bit products, fixed before the main loop. A
// streamed tile (swizzled, rows of D elements) is read two ways: its rows as a B operand
// (Sᵀ = K_j Q_iᵀ: keys of the tile as the B columns; lanes 0-7 address rows 0-7, lanes 8-15
// the same rows 8 columns on, lanes 16-31 rows 8-15 likewise: `rows`), and transposed (dK_j
// += dSᵀ Q_i; lanes 0-15 rows 0-15, lanes 16-31 the same rows 8 columns on, FragAddrs'
// pattern: `cols`, also the own rows' A fragments). Either way a lane's row mod 8 is the same
// in every step, so its address for column step m (16 columns) of a 16-row step is one of
// four per-thread offsets plus immediates, and the four differ only in bits 5-6 (the
// swizzle's XOR, tc_tile.cuh): offset m = offset 0 ^ (m << 5). One register per pattern.
template <class Tr> struct BwdFragAddrs {
    static constexpr unsigned kRowBytes = Tr::kHeadDim * sizeof(typename Tr::Elem);
    unsigned rows0, cols0;  // column step 0 of each pattern, from a tile's start
    __device__ __forceinline__ explicit BwdFragAddrs(int lane) {
        const int x = lane & 7;
        rows0 = (x + 8 * (lane / 16)) * kRowBytes + (((lane / 8) % 2) ^ x) * 16;
        cols0 = (lane % 16) * kRowBytes + ((lane / 16) ^ x) * 16;
    }
    // rows 16·row_step + 0..15, columns 16·col_step + 0..15 of the tile at `tile`
    __device__ __forceinline__ static unsigned at(unsigned tile, unsigned off0, int row_step,
                                                  int col_step) {
        return tile + (off0 ^ ((col_step % 4) << 5)) + (col_step / 4) * 128 +
               row_step * 16 * kRowBytes;
    }
    // the `cols` pattern as FragAddrs offers its own (gemm_pv_fwd takes it)
    struct Cols {
        unsigned off0;
        __device__ __forceinline__ unsigned at(unsigned tile, int row_step, int col_step) const {
            return BwdFragAddrs::at(tile, off0, row_step, col_step);
        }
    };
    __device__ __forceinline__ Cols cols() const { return Cols{cols0}; }
};

// c += own · rowsᵀ (16-bit): the warp's 16 own rows (A: f, or read at s_own) times the rows
// of the streamed tile at s_rows, as gemm_qk_tc.
template <class Tr>
__device__ __forceinline__ void gemm_own_rows(FragC (&c)[Tr::kSTiles], const FragA (&f)[Tr::kQFrags],
                                              unsigned s_own, unsigned s_rows,
                                              const BwdFragAddrs<Tr>& ad) {
    using T = typename Tr::Elem;
#pragma unroll
    for (int kk = 0; kk < Tr::kKSteps; ++kk) {
        FragA a;
        if constexpr (Tr::kQInRegs) a = f[kk];
        else ldmatrix_x4(a.a0, a.a1, a.a2, a.a3, ad.at(s_own, ad.cols0, 0, kk));
#pragma unroll
        for (int np = 0; np < Tr::kSTiles / 2; ++np) {
            FragB b_lo, b_hi;
            ldmatrix_x4(b_lo.b0, b_lo.b1, b_hi.b0, b_hi.b1, ad.at(s_rows, ad.rows0, np, kk));
            mma_k16<T>(c[2 * np], a, b_lo);
            mma_k16<T>(c[2 * np + 1], a, b_hi);
        }
    }
}

// C fragments (dS of the dQ kernel) as the A fragments of every k16 step of a product
// (16-bit).
template <class Tr>
__device__ __forceinline__ void pack_a(FragA (&a)[Tr::kPVSteps], const FragC (&c)[Tr::kSTiles]) {
    pack_p<Tr>(one_row_tile(a), one_row_tile(c));
}

// acc += c · tile (16-bit): pack_a's fragments times the streamed tile at s_tile (its
// chunk's first column), as gemm_pv_tc: the forward's P̃ V_j product for one row tile.
template <class Tr>
__device__ __forceinline__ void gemm_c_tile(FragC (&acc)[Tr::kOTiles], const FragA (&a)[Tr::kPVSteps],
                                            unsigned s_tile, const BwdFragAddrs<Tr>& ad) {
    gemm_pv_fwd<Tr>(one_row_tile(acc), one_row_tile(a), s_tile, ad.cols());
}

// acc += a · rows 16kk .. 16kk + 15 of the streamed tile at s_tile (16-bit): one k step of
// gemm_c_tile, for a product that takes its A fragments one k step at a time.
template <class Tr>
__device__ __forceinline__ void gemm_c_step(FragC (&acc)[Tr::kOTiles], const FragA& a,
                                            unsigned s_tile, const BwdFragAddrs<Tr>& ad, int kk) {
    using T = typename Tr::Elem;
    const auto at = ad.cols();
#pragma unroll
    for (int np = 0; np < Tr::kOTiles / 2; ++np) {
        FragB b_lo, b_hi;
        ldmatrix_x4_trans(b_lo.b0, b_lo.b1, b_hi.b0, b_hi.b1, at.at(s_tile, kk, np));
        mma_k16<T>(acc[2 * np], a, b_lo);
        mma_k16<T>(acc[2 * np + 1], a, b_hi);
    }
}

// A streamed tile of the dK/dV kernel: query head h, rows m0 .. m0 + TILE_ROWS − 1, and
// the ring slot it is copied into (the walk's tiles take the slots in turn).
struct Tile {
    int h, m0, slot;
};

// The row statistics of the streamed tile's rows [row0, row0 + TILE_ROWS) of one head:
// (lse · log2 e, D) pairs (kernel_backward.preprocess's `stats`) into sS, by 8-byte
// cp.async, one row per thread of the first TILE_ROWS; rows >= n_rows are zero-filled.
// One predicated copy per thread, no loop.
template <class Tr>
__device__ __forceinline__ void copy_row_stats_async(float* __restrict__ sS,
                                                     const float* __restrict__ stats, int row0,
                                                     int n_rows) {
    static_assert(Tr::kTileRows <= Tr::kThreads, "one thread per row of the tile");
    const int i = threadIdx.x;
    if (i < Tr::kTileRows) {
        const bool valid = row0 + i < n_rows;
        cp_async_8(sS + 2 * i, valid ? stats + 2 * (row0 + i) : stats, valid);
    }
}

// The columns a row of a masked tile sees, one interval [lo, hi): the per-element test is
// then two compares, where CausalMask::masked's chain of || is a chain of branches. A
// window edge past every row or key (up to INT_MAX) is taken as unbounded, not added:
// no overflow.
struct Seen {
    int lo, hi;
    __device__ __forceinline__ bool hides(int x) const { return (x < lo) | (x >= hi); }
};

// The keys query row i sees: masked(i, j) ⇔ j ∉ [lo, hi).
__device__ __forceinline__ Seen keys_seen(const CausalMask& m, int i) {
    const int diag = i + (m.Nk - m.Nq), r = m.reach_right();  // row i's diagonal key
    return {m.left >= 0 && m.left < diag ? diag - m.left : 0,
            r >= 0 && r < m.Nk - 1 - diag ? diag + r + 1 : m.Nk};
}

// The queries that see key j, padding queries (i ≥ Nq) left out: masked(i, j) || i ≥ Nq
// ⇔ i ∉ [lo, hi); none for a padding key (j ≥ Nk).
__device__ __forceinline__ Seen queries_seeing(const CausalMask& m, int j) {
    const int diag = j - (m.Nk - m.Nq), r = m.reach_right();  // key j's diagonal row
    const int hi = m.left >= 0 && m.left < m.Nq - 1 - diag ? diag + m.left + 1 : m.Nq;
    return {r >= 0 && r < diag ? diag - r : 0, j < m.Nk ? hi : 0};
}

// One element of Algorithm 2, lines 11-14, on a C-fragment register pair (s, dp):
//   P = exp2(S · scale·log2 e − lse · log2 e)   (lse2 = lse_log2(lse): +inf for a row that
//                                                saw no key, so P = 0 rather than NaN)
//   dS = P ∘ (dP − D)
// in place: s becomes P, dp becomes dS. A masked element (causal, a padding key or query)
// gets P = dS = 0; or every element runs unmasked and `hide` zeroes the masked ones.
__device__ __forceinline__ void p_ds(float& s, float& dp, float scale_log2, float lse2, float Di,
                                     bool masked) {
    float p = fast_exp2(s * scale_log2 - lse2);
    if (masked) p = 0.f;
    dp = p * (dp - Di);
    s = p;
}

// P = dS = 0 where one n-tile of fragments is masked (causal, the window, padding): rows g
// and g + 8 see the columns `top` and `bottom`, the thread's are x0, x0 + 1. A select, not
// a product: p_ds's P may be inf there (the row's lse does not cover a key it does not
// see), its dS NaN.
__device__ __forceinline__ void hide(FragC& s, FragC& dp, const Seen& top, const Seen& bottom,
                                     int x0) {
    if (top.hides(x0)) s.c0 = dp.c0 = 0.f;
    if (top.hides(x0 + 1)) s.c1 = dp.c1 = 0.f;
    if (bottom.hides(x0)) s.c2 = dp.c2 = 0.f;
    if (bottom.hides(x0 + 1)) s.c3 = dp.c3 = 0.f;
}

// p_ds with attention variants: every element through flash_bwd.cu's chain
// (recompute_p_ds_variants, bwd_tile.cuh), in place: s becomes P ∘ Z (dropout's keep/(1 − p),
// for dV), dp becomes dS_raw (dS ∘ (1 − t²) under softcap, for dK and dQ). `at(e, i, j,
// lse2, Di, hidden)` gives element e's query i, key j, lse·log2 e and D of its query, and
// whether causal, the window or padding hide it (hidden: nothing read, P = dS = 0).
// `dbias(e, i, j, ds, x)` then receives the element's dS before softcap's factor (dbias's
// share: the gradient of the biased score; 0 where hidden) and x = scale·q_i·k_j (the
// score_mod's argument, for its arrays' gradients). One rolled loop takes the
// elements from s[0].c0, dp[0].c0 (rotate_fragments, tc_tile.cuh): the chain is inlined
// once.
template <int N, typename T, class At, class Dbias>
__device__ __forceinline__ void p_ds_variants(FragC (&s)[N], FragC (&dp)[N], float scale,
                                              const Variants<T>& var, At at, Dbias dbias) {
#pragma unroll 1
    for (int e = 0; e < 4 * N; ++e) {
        int i, j;
        float lse2, Di;
        bool hidden;
        at(e, i, j, lse2, Di, hidden);
        float p, ds_biased, ds;
        const float x = s[0].c0 * scale;
        recompute_p_ds_variants(s[0].c0, dp[0].c0, scale, lse2, Di, hidden, var, i, j, p,
                                ds_biased, ds);
        dbias(e, i, j, ds_biased, x);
        rotate_fragments(s, p);
        rotate_fragments(dp, ds);
    }
}

// k step kk of the warp's dSᵀ (rows its 16 keys, columns the tile's queries 16kk ..
// 16kk + 15) into sdS, from its A fragment: rows g, g + 8 at columns 16kk + 2t (a0, a1)
// and 8 on (a2, a3).
template <class Tr, typename T>
__device__ __forceinline__ void store_ds_step(T* sdS, const FragA& ds, int kk, int warp_row0,
                                              int lane) {
    unsigned* top = reinterpret_cast<unsigned*>(sdS + (warp_row0 + (lane >> 2)) * Tr::kDsStride +
                                                2 * (lane % 4));
    unsigned* bottom = top + 8 * Tr::kDsStride / 2;
    top[8 * kk] = ds.a0;
    bottom[8 * kk] = ds.a1;
    top[8 * kk + 4] = ds.a2;
    bottom[8 * kk + 4] = ds.a3;
}

// The addressing of add_dq_part, fixed before the main loop: the warp takes one 16-row
// group of dQ_i (r0) and kDqCols columns (c0) — both functions of the warp alone — so
// each of its ldmatrix addresses is one per-thread register plus immediates, and its
// thread's elements of a tile of the partial one offset plus immediates.
template <class Tr> struct DqPartAddrs {
    using T = typename Tr::Elem;
    static constexpr unsigned kRowBytes = Tr::kHeadDim * sizeof(T);
    static constexpr int kColSteps = Tr::kDqCols / 16;  // 16-column steps of the warp
    static_assert(!Tr::kDqParts || (kColSteps & (kColSteps - 1)) == 0,
                  "a warp's 16-column steps a power of two: its first step's swizzle bits "
                  "and its step index are disjoint, so the XOR splits (BwdFragAddrs::at)");
    unsigned ds;    // sdS: the lane's row of dSᵀ for k step 0 (bytes)
    unsigned k;     // K_j: the `cols` pattern at the warp's first column step (bytes from sK)
    int part;       // the partial: the thread's top-row element of a tile (elements)
    __device__ __forceinline__ DqPartAddrs(const T* sdS, int lane) {
        if constexpr (Tr::kDqParts) {  // (else kDqRowGroups may be 0: nothing to address)
            const int warp = threadIdx.x / 32;
            const int r0 = (warp % Tr::kDqRowGroups) * 16;
            const int c0 = (warp / Tr::kDqRowGroups) * Tr::kDqCols;
            // matrices (keys, queries): (0, 0), (0, 8), (8, 0), (8, 8) → a0 .. a3
            ds = smem_addr(sdS) + ((lane % 8 + (lane / 16) * 8) * Tr::kDsStride + r0 +
                                   ((lane / 8) % 2) * 8) * (unsigned)sizeof(T);
            const int step = c0 / 16;
            k = (BwdFragAddrs<Tr>(lane).cols0 ^ ((step % 4) << 5)) + (step / 4) * 128;
            part = (r0 + (lane >> 2)) * Tr::kHeadDim + c0 + 2 * (lane % 4);
        }
    }
};

// *p += (x, y) in global memory: one vector reduction where the GPU has it (sm_90+), else
// two (from one base address); each element's additions in program order either way.
__device__ __forceinline__ void add_pair(float2* p, float x, float y) {
#if __CUDA_ARCH__ >= 900
    atomicAdd(p, make_float2(x, y));
#else
    atomicAdd(&p->x, x);
    atomicAdd(&p->y, y);
#endif
}

// part[r, c] += (dS K_j)[r, c] for the tile's TILE_ROWS rows and HEAD_DIM columns at
// `part` (rows of HEAD_DIM floats; K_j at s_k; the partial is padded so that every tile is whole:
// padding queries have dS = 0 and padding columns of K_j are zero, so what lands there
// is zero): dS (TILE_ROWS queries x BLOCK_ROWS keys) read from sdS's dSᵀ by
// ldmatrix.trans, K_j (keys x D) from sK by ldmatrix.trans as V_j in P̃ V_j. The warp
// takes one 16-row group and kDqCols columns; its thread adds its own elements, the same
// ones at every tile, so each element of the partial has one writer and its additions
// happen in program order.
template <class Tr>
__device__ __forceinline__ void add_dq_part(float* __restrict__ part, unsigned s_k,
                                            const DqPartAddrs<Tr>& at) {
    using T = typename Tr::Elem;
    constexpr int NT = Tr::kDqCols / 8;
    FragC acc[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) acc[j] = FragC{0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int kk = 0; kk < Tr::kBlockRows / 16; ++kk) {
        FragA a;
        ldmatrix_x4_trans(a.a0, a.a1, a.a2, a.a3, at.ds + kk * 16 * Tr::kDsStride * sizeof(T));
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
            FragB b_lo, b_hi;
            ldmatrix_x4_trans(b_lo.b0, b_lo.b1, b_hi.b0, b_hi.b1,
                              s_k + (at.k ^ ((np % 4) << 5)) + (np / 4) * 128 +
                                  kk * 16 * DqPartAddrs<Tr>::kRowBytes);
            mma_k16<T>(acc[2 * np], a, b_lo);
            mma_k16<T>(acc[2 * np + 1], a, b_hi);
        }
    }
    float2* top = reinterpret_cast<float2*>(part + at.part);  // the thread's column pairs
    float2* bottom = top + 4 * Tr::kHeadDim;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        add_pair(top + j * 4, acc[j].c0, acc[j].c1);
        add_pair(bottom + j * 4, acc[j].c2, acc[j].c3);
    }
}

// The epilogue of both kernels: acc · factor (the warp's 16 own rows x the CHUNK_COLS
// columns from col0 on) converted to T into the same rows and columns of the swizzled tile s
// (no other warp touches those rows), then whole 16-byte chunks of rows < n and columns
// < d to out (row stride sr).
template <class Tr, typename T>
__device__ __forceinline__ void store_rows_16b(T* __restrict__ out, long long sr,
                                               const FragC (&acc)[Tr::kOTiles], float factor,
                                               T* s, int warp_row0, int row0, int col0, int n,
                                               int d, int lane) {
    const int g = lane >> 2, t = lane % 4;
    __syncwarp();  // the warp's own reads of these rows (ldmatrix) precede the writes
#pragma unroll
    for (int j = 0; j < Tr::kOTiles; ++j) {
        const int col = col0 + j * 8 + 2 * t;
        store_pair(s + tile_offset<Tr>(warp_row0 + g, col), acc[j].c0 * factor, acc[j].c1 * factor);
        store_pair(s + tile_offset<Tr>(warp_row0 + g + 8, col), acc[j].c2 * factor,
                   acc[j].c3 * factor);
    }
    __syncwarp();
    constexpr int CPR = Tr::kChunkCols / Tr::kChunkElems, C = Tr::kChunkElems;
#pragma unroll
    for (int i = lane; i < Tr::kWarpRows * CPR; i += 32) {
        const int r = i / CPR, c = col0 + (i % CPR) * C;
        const int gi = row0 + warp_row0 + r;
        if (gi < n && c < d)
            *reinterpret_cast<uint4*>(out + (long long)gi * sr + c) =
                *reinterpret_cast<const uint4*>(s + tile_offset<Tr>(warp_row0 + r, c));
    }
}

}  // namespace cuflash
