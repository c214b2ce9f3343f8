// tf32_tile.cuh — float32 on tensor cores: the forward's traits (flash_fwd_tc_kernel<float>
// in flash_fwd_tc.cu), and the fragment loads and products of every float32 kernel (through
// tc_gemm.cuh): split tf32 (3xTF32, about fp32 accuracy) or one-pass tf32.
//
// The layout of tc_tile.cuh with 4-byte elements: warp w owns query rows 16w..16w+15,
// S and O live in m16n8 C fragments, the online softmax runs on them unchanged
// (tile_row_max, exp2_rows, rescale_acc, row_*_quad come from tc_tile.cuh). What differs:
//   * shared tiles hold float32: rows of D floats = D/4 chunks of 16 bytes, swizzled by
//     the same `swizzle` (chunk ^ row % 8; D ≥ 32 floats, so a row has ≥ 8 chunks);
//   * the mma is m16n8k8 .tf32 (mma.cuh), whose k index is t and t + 4, so fragments are
//     read with plain 32-bit shared loads: ldmatrix moves 16-bit pairs (2t, 2t+1), which
//     is the wrong pairing here, and moving b16 halves of floats would need a permute
//     after it (CUTLASS's trick) to save what is one load per element anyway;
//   * every fp32 operand is rounded to tf32 in registers (cvt.rna) right before its mma.
//
// Split tf32 (SPLIT = true): x = hi + lo + O(2^-22 |x|) with hi = tf32(x), lo = tf32(x − hi)
// (x − hi is exact in fp32), and a·b ≈ hi_a·hi_b + hi_a·lo_b + lo_a·hi_b: three mma per
// product, lo_a·lo_b (2^-22 relative) dropped. One-pass (SPLIT = false): hi_a·hi_b only.
//
// Bank conflicts (32-bit loads, rows a multiple of 32 banks; bank = 4·(physical chunk % 8)
// + column % 4): a Q or K fragment reads rows r..r+7 of one chunk (g) at words t →
// chunks c ^ (r % 8) are 8 distinct, 32 banks. V, read at rows 2t, 2t+1 (see
// pv_fragment_b) and columns n0 + g (two chunks c0, c0 + 1, c0 even): physical chunks
// (c0 + g/4) ^ 2t, resp. ^ (2t + 1), are 8 distinct too. No conflicts.
//
// Shared memory (dynamic, float32, every tile swizzled):
//   sQ [BLOCK_M][D]           Q_i (later: staging of the O tile for 16-byte stores)
//   sK [STAGES][BLOCK_N][D]   the K_j ring of the cp.async pipeline
//   sV [STAGES][BLOCK_N][D]   the V_j ring
// cuflash/plans/tc_fwd.py:tc_smem_bytes mirrors kSmemBytes term for term.
#pragma once

#include "common.cuh"
#include "mma.cuh"
#include "tc_tile.cuh"

namespace cuflash {

// An fp32 operand fragment before rounding, in the m16n8k8 .tf32 layout (mma.cuh).
struct Tf32A { float x0, x1, x2, x3; };   // A[g][t], A[g+8][t], A[g][t+4], A[g+8][t+4]
struct Tf32B { float x0, x1; };           // B[k0][g], B[k1][g] (k0, k1: see the loaders)

template <int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS, int STAGES, bool SPLIT>
struct Tf32TileTraits {
    static constexpr int kHeadDim = HEAD_DIM;
    static constexpr int kBlockM = BLOCK_M;
    static constexpr int kBlockN = BLOCK_N;
    static constexpr int kStages = STAGES;
    static constexpr int kThreads = NUM_WARPS * 32;
    static constexpr int kRowTiles = 1;                // one mma row tile per warp: the fp32
    static constexpr int kWarpRows = 16;               // operands leave no registers for two
    static constexpr int kChunkElems = 4;              // floats per 16-byte chunk
    static constexpr int kChunksPerRow = HEAD_DIM / kChunkElems;
    static constexpr int kKSteps = HEAD_DIM / 8;       // k8 steps of S = Q Kᵀ
    static constexpr int kSTiles = BLOCK_N / 8;        // n-tiles of S (and P̃)
    static constexpr int kPVSteps = BLOCK_N / 8;       // k8 steps of P̃ V
    static constexpr int kOTiles = HEAD_DIM / 8;       // n-tiles of O
    static constexpr bool kSplit = SPLIT;
    // Q_i's fp32 A fragments in registers (kKSteps · 4) for one-pass D ≤ 64; above, and
    // beside split tf32's hi/lo temporaries, they made ptxas spill: re-read from shared
    // memory, one k8 step at a time (a rolled loop).
    // flash_fwd_tc.cu's lean main loop (see TcTileTraits): its per-thread state spilled
    // beside split tf32's hi/lo parts (D = 128, 256) and one-pass D = 256
    static constexpr bool kLean = false;
    static constexpr bool kQInRegs = HEAD_DIM <= 64 && !SPLIT;
    static constexpr int kQFrags = kQInRegs ? kKSteps : 1;
    static constexpr bool kTf32 = true;
    using OwnFrag = Tf32A;                             // Q_i's fp32 values, rounded per mma
    static constexpr int kSmemQ = BLOCK_M * HEAD_DIM;            // floats
    static constexpr int kSmemK = STAGES * BLOCK_N * HEAD_DIM;
    static constexpr int kSmemV = STAGES * BLOCK_N * HEAD_DIM;
    static constexpr int kSmemBytes = (kSmemQ + kSmemK + kSmemV) * 4;

    static_assert(BLOCK_M == kWarpRows * NUM_WARPS, "each warp owns one 16-row mma tile: BLOCK_M = 16 * NUM_WARPS");
    static_assert(BLOCK_N % 8 == 0, "BLOCK_N must be a multiple of 8 (k8 steps of P V)");
    static_assert(HEAD_DIM % 32 == 0, "HEAD_DIM must be a multiple of 32 floats: the swizzle permutes 8 chunks of 16 bytes");
    static_assert(STAGES >= 2, "the cp.async pipeline needs at least two stages to overlap copy and math");
    static_assert(kSmemBytes <= 227 * 1024, "tile exceeds the largest shared memory of any GPU (227 KB)");
};

// A fragment rounded to tf32: hi, and with SPLIT the remainder lo = tf32(x − hi).
struct SplitA { FragA hi, lo; };
struct SplitB { FragB hi, lo; };

template <bool SPLIT>
__device__ __forceinline__ void split_tf32(float x, unsigned& hi, unsigned& lo) {
    hi = to_tf32(x);
    // x − hi is exact (hi is x rounded to 11 significant bits); its tf32 keeps 11 more
    if constexpr (SPLIT) lo = to_tf32(x - __uint_as_float(hi));
    else lo = 0u;  // unused: one-pass reads hi only
}

template <bool SPLIT> __device__ __forceinline__ SplitA split_a(const Tf32A& x) {
    SplitA s;
    split_tf32<SPLIT>(x.x0, s.hi.a0, s.lo.a0);
    split_tf32<SPLIT>(x.x1, s.hi.a1, s.lo.a1);
    split_tf32<SPLIT>(x.x2, s.hi.a2, s.lo.a2);
    split_tf32<SPLIT>(x.x3, s.hi.a3, s.lo.a3);
    return s;
}

template <bool SPLIT> __device__ __forceinline__ SplitB split_b(const Tf32B& x) {
    SplitB s;
    split_tf32<SPLIT>(x.x0, s.hi.b0, s.lo.b0);
    split_tf32<SPLIT>(x.x1, s.hi.b1, s.lo.b1);
    return s;
}

// d += a·b for one k8 step. One-pass: one mma into d. Split: the three mma go into zeroed
// fragments that are then added to d in fp32 (round to nearest): the tensor core truncates
// each block sum, accumulator included, to fp32, so chaining 3 mma per k8 step into a
// long-lived accumulator would add 3 truncations of the *whole running sum* per step — a
// bias that grows with the sum's length and makes it worse than fp32; here each truncation
// is relative to one k8 step's own partial sum.
// The hi·hi sum and the two small cross terms are kept apart for infinities: an infinite
// operand (a key scoring −inf is a masked key) makes its lo = tf32(∞ − ∞) = NaN and its
// cross terms ∞·0 = NaN, so where hi·hi is not finite it alone is the answer, as in fp32.
__device__ __forceinline__ float split_sum(float big, float small) {
    return isfinite(big) ? big + small : big;
}

template <bool SPLIT>
__device__ __forceinline__ void mma_tf32(FragC& d, const SplitA& a, const SplitB& b) {
    if constexpr (SPLIT) {
        FragC small{0.f, 0.f, 0.f, 0.f}, big{0.f, 0.f, 0.f, 0.f};
        mma_m16n8k8_tf32(small, a.lo, b.hi);
        mma_m16n8k8_tf32(small, a.hi, b.lo);
        mma_m16n8k8_tf32(big, a.hi, b.hi);
        d.c0 += split_sum(big.c0, small.c0);
        d.c1 += split_sum(big.c1, small.c1);
        d.c2 += split_sum(big.c2, small.c2);
        d.c3 += split_sum(big.c3, small.c3);
    } else {
        mma_m16n8k8_tf32(d, a.hi, b.hi);
    }
}

// The fp32 A fragment of k8 step kk of the warp's 16 x D slice of Q_i (4 shared loads).
template <class Tr>
__device__ __forceinline__ Tf32A q_fragment_tf32(const float* sQ, int warp_row0, int kk, int g, int t) {
    const int r = warp_row0 + g, c = kk * 8 + t;
    return Tf32A{sQ[tile_offset<Tr>(r, c)], sQ[tile_offset<Tr>(r + 8, c)],
                 sQ[tile_offset<Tr>(r, c + 4)], sQ[tile_offset<Tr>(r + 8, c + 4)]};
}

template <class Tr>
__device__ __forceinline__ void load_q_fragments_tf32(Tf32A (&qf)[Tr::kQFrags], const float* sQ,
                                                      int warp_row0, int g, int t) {
    if constexpr (Tr::kQInRegs) {
#pragma unroll
        for (int kk = 0; kk < Tr::kKSteps; ++kk) qf[kk] = q_fragment_tf32<Tr>(sQ, warp_row0, kk, g, t);
    }
}

// s += Q_i K_jᵀ. B = K_jᵀ, so b0 = B[t][g] = K[8n + g][8kk + t] and b1 four columns on:
// key rows of the K tile, read without transposing.
template <class Tr, bool SPLIT>
__device__ __forceinline__ void gemm_qk_tf32(FragC (&s)[Tr::kSTiles], const Tf32A (&qf)[Tr::kQFrags],
                                             const float* sQ, int warp_row0, const float* sK, int g, int t) {
    // Rolled when Q_i comes from shared memory: unrolled, ptxas hoists the loads and splits
    // of many k8 steps ahead of their mma and runs out of registers.
#pragma unroll(Tr::kQInRegs ? Tr::kKSteps : 1)
    for (int kk = 0; kk < Tr::kKSteps; ++kk) {
        Tf32A x;
        if constexpr (Tr::kQInRegs) x = qf[kk];
        else x = q_fragment_tf32<Tr>(sQ, warp_row0, kk, g, t);
        const SplitA a = split_a<SPLIT>(x);
#pragma unroll
        for (int n = 0; n < Tr::kSTiles; ++n) {
            const int key = n * 8 + g, c = kk * 8 + t;
            const SplitB b = split_b<SPLIT>(Tf32B{sK[tile_offset<Tr>(key, c)], sK[tile_offset<Tr>(key, c + 4)]});
            mma_tf32<SPLIT>(s[n], a, b);
        }
    }
}

// P̃ of k8 step kk as an A fragment, straight from S's C fragment of n-tile kk, with the
// keys of the step permuted. The C fragment gives thread (g, t) the keys 2t, 2t+1 of rows
// g, g+8; the tf32 A layout wants keys t, t+4 — held by other lanes of the quad, so they
// would need 8 shuffles per n-tile or a trip through shared memory. But a k8 step sums over
// its 8 keys in any order: let the mma's k = t stand for key 2t and k = t + 4 for key
// 2t + 1. Then a0..a3 = c0, c2, c1, c3 of the thread's own registers, and the B fragment
// reads the same permutation of V's rows (pv_fragment_b). No data moves.
__device__ __forceinline__ Tf32A p_fragment_keys_permuted(const FragC& p) {
    return Tf32A{p.c0, p.c2, p.c1, p.c3};  // A[g][2t], A[g+8][2t], A[g][2t+1], A[g+8][2t+1]
}

// V's B fragment for k8 step kk and n-tile n under p_fragment_keys_permuted's key order:
// b0 = V[8kk + 2t][8n + g], b1 = V[8kk + 2t + 1][8n + g].
template <class Tr>
__device__ __forceinline__ Tf32B pv_fragment_b(const float* sV, int kk, int n, int g, int t) {
    const int key = kk * 8 + 2 * t, col = n * 8 + g;
    return Tf32B{sV[tile_offset<Tr>(key, col)], sV[tile_offset<Tr>(key + 1, col)]};
}

// acc += P̃ V_j, one k8 step (8 keys) at a time.
template <class Tr, bool SPLIT>
__device__ __forceinline__ void gemm_pv_tf32(FragC (&acc)[Tr::kOTiles], const FragC (&p)[Tr::kSTiles],
                                             const float* sV, int g, int t) {
#pragma unroll
    for (int kk = 0; kk < Tr::kPVSteps; ++kk) {
        const SplitA a = split_a<SPLIT>(p_fragment_keys_permuted(p[kk]));
#pragma unroll
        for (int n = 0; n < Tr::kOTiles; ++n)
            mma_tf32<SPLIT>(acc[n], a, split_b<SPLIT>(pv_fragment_b<Tr>(sV, kk, n, g, t)));
    }
}

}  // namespace cuflash
