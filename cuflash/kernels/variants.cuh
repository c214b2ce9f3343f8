// variants.cuh — the score chain of every attention variant, in one place.
//
// In the order of cuflash.variants (and docs/api.md):
//     s = scale·q·kᵀ → softcap·tanh(s/softcap) → − slope·|i + Nk − Nq − j| + bias
//       → causal / window (mask.cuh) / bool mask → softmax → dropout → ·V
// A kernel receives the options as run-time arguments (no template flag: one
// specialization serves every combination), binds them to its (batch, head) once with
// bind(), and calls score() on each score in natural units (variant_score: from the raw
// product, with the causal/window mask, in log2 units) and keep() on each P̃.
// bias and mask are read in place with four element strides (0 along a broadcast axis).
// A call's score_mod and mask_mod (cuflash.programmable) come as code compiled before the
// kernel (programmable/cuda_c.py): CUFLASH_SCORE_MOD with cuflash_score_mod and its
// derivative cuflash_score_mod_grad, CUFLASH_MASK_MOD with cuflash_mask_mod, and
// CUFLASH_MODS with their captured arrays (CUFLASH_MOD_PARAMS, the record cuflash_mods).
// The score_mod runs first, on scale·q·k; the mask_mod with the masks. With a block mask
// (CUFLASH_BLOCK_MASK, cuflash.block_mask) the record also holds the kind of each of the
// kernel's tiles: the key loops skip empty tiles (neither copied nor computed) and run full
// ones without the mask_mod (tile_kind, enter_tile).
#pragma once

#include "common.cuh"
#include "mask.cuh"
#include "philox.cuh"

namespace cuflash {

// Bits of Variants::flags (cuflash/backends/kernel_variants.py sets them).
enum VariantFlag : int {
    kSoftcap = 1,   // softcap·tanh(s/softcap)
    kAlibi = 2,     // − slope_bh·|i + Nk − Nq − j|
    kBias = 4,      // + bias[b, h, i, j]
    kBiasF32 = 8,   // bias is float (else the input type T)
    kMask = 16,     // a bool mask: False hides the key
    kDropout = 32,  // P̃ ∘ keep / (1 − p)
    kScoreMod = 64, // cuflash_score_mod(s, b, h, i, j) (compiled in: CUFLASH_SCORE_MOD)
    kMaskMod = 128, // cuflash_mask_mod(b, h, i, j): False hides the key (CUFLASH_MASK_MOD)
};

// Kinds of a tile under a block mask (cuflash/programmable/block_mask.py's).
enum TileKind : int { kTileEmpty = 0, kTilePartial = 1, kTileFull = 2 };

__device__ __forceinline__ float tanh_(float x) { return tanhf(x); }
__device__ __forceinline__ double tanh_(double x) { return tanh(x); }

#ifdef CUFLASH_MOD_GRADS
// part[at] += v for one warp's partial, bitwise reproducibly and without atomics: the lanes
// that add to the same entry sum their values in lane order (every lane reads every
// lane's pair), and the lowest of them writes. Only this warp writes its partial, its
// additions in program order; the host sums the partials in a fixed order.
template <typename A> struct WarpPartialAdd {
    A* part;
    __device__ __forceinline__ void operator()(long long at, A v) const {
        if (__all_sync(0xffffffffu, v == A(0))) return;  // hidden scores: nothing to add
        const int lane = threadIdx.x % 32;
        A sum = A(0);
        bool lowest = true;
        for (int l = 0; l < 32; ++l) {
            const long long at_l = __shfl_sync(0xffffffffu, at, l);
            const A v_l = __shfl_sync(0xffffffffu, v, l);
            if (at_l == at) {
                sum += v_l;
                lowest = lowest && l >= lane;
            }
        }
        if (lowest && sum != A(0)) part[at] += sum;
    }
};
#endif

template <typename T> struct Variants {
    using A = accum_t<T>;
    int flags;
    A softcap;
    const A* alibi;       // (B or 1, Hq) slopes
    long long alibi_sb;   // 0 when shared by the batch
    const void* bias;     // T or float, (b, h, i, j) at b·sb + h·sh + i·sr + j·sc
    long long bias_sb, bias_sh, bias_sr, bias_sc;
    const unsigned char* mask;
    long long mask_sb, mask_sh, mask_sr, mask_sc;
    unsigned int drop_threshold, seed_lo, seed_hi;
    A keep_scale;         // 1 / (1 − p)
    int win_left, win_right;  // the sliding window (mask.cuh's; −1: unbounded)
#ifdef CUFLASH_MODS
    cuflash_mods mods;    // the mods' captured arrays
#endif
    // bound by bind():
    int off;              // Nk − Nq: the bottom-right alignment of ALiBi's distance
    int b, h;
    A slope;
    long long bias_bh, mask_bh;

    __device__ __forceinline__ void bind(int b_, int h_, int Nq, int Nk) {
        b = b_;
        h = h_;
        off = Nk - Nq;
        slope = (flags & kAlibi) ? alibi[b * alibi_sb + h] : A(0);
        bias_bh = b * bias_sb + h * bias_sh;
        mask_bh = b * mask_sb + h * mask_sh;
    }

#ifdef CUFLASH_BLOCK_MASK
    // The block mask's kind of the kernel's tile of BM query rows from m0 and BN keys from
    // n0 (multiples of BM, BN), of batch row b_ and query head h_: one byte, read by the
    // whole block (the host regrids the mask's blocks to the kernel's tiles).
    template <int BM, int BN>
    __device__ __forceinline__ int tile_kind(int b_, int h_, int m0, int n0) const {
        return mods.tile_kinds[b_ * mods.tiles_sb + h_ * mods.tiles_sh +
                               (long long)(m0 / BM) * mods.tiles_k + n0 / BN];
    }
    // A full tile runs without the mask_mod, a partial one with it.
    __device__ __forceinline__ void enter_tile(int kind) {
        flags = kind == kTileFull ? flags & ~kMaskMod : flags | kMaskMod;
    }
    // The first key tile j' in [j, j1) the block mask does not leave empty (j1: none), and
    // how many of [j, j1) it leaves non-empty: for loops whose ring counts visited tiles
    // (the Hopper kernels' producers and consumers walk the same tiles).
    template <int BM, int BN>
    __device__ __forceinline__ int next_tile(int b_, int h_, int m0, int j, int j1) const {
        while (j < j1 && tile_kind<BM, BN>(b_, h_, m0, j * BN) == kTileEmpty) ++j;
        return j;
    }
    template <int BM, int BN>
    __device__ __forceinline__ int count_tiles(int b_, int h_, int m0, int j, int j1) const {
        int n = 0;
        for (; j < j1; ++j) n += tile_kind<BM, BN>(b_, h_, m0, j * BN) != kTileEmpty;
        return n;
    }
#else
    template <int BM, int BN> __device__ __forceinline__ int tile_kind(int, int, int, int) const {
        return kTilePartial;  // every tile is visited, with the chain as it is
    }
    __device__ __forceinline__ void enter_tile(int) {}
    template <int BM, int BN>
    __device__ __forceinline__ int next_tile(int, int, int, int j, int) const { return j; }
    template <int BM, int BN>
    __device__ __forceinline__ int count_tiles(int, int, int, int j, int j1) const {
        return j1 - j;
    }
#endif

#ifdef CUFLASH_MOD_GRADS
    // The gradients of the score_mod's captured float arrays from score (i, j) (in range),
    // x = scale·q_i·k_j, whose biased score has gradient ds_biased (0: hidden): ds_biased
    // times softcap's factor is the gradient of the score_mod's result, which
    // cuflash_score_mod_vjp spreads over the entries it read. Every lane of the warp calls
    // it together: they go into the warp's own partial (WarpPartialAdd).
    __device__ __forceinline__ void add_mod_grads(A x, int i, int j, A ds_biased) const {
        A ds = ds_biased;
        if (flags & kSoftcap) {
            const A t = tanh_(cuflash_score_mod(x, b, h, i, j, mods) / softcap);
            ds *= A(1) - t * t;
        }
        const long long block =
            blockIdx.x + (long long)gridDim.x * (blockIdx.y + (long long)gridDim.y * blockIdx.z);
        const long long warp = block * (blockDim.x / 32) + threadIdx.x / 32;
        cuflash_score_mod_vjp(x, b, h, i, j, mods, ds,
                              WarpPartialAdd<A>{mods.grad_part + warp * mods.grad_stride});
    }
#else
    __device__ __forceinline__ void add_mod_grads(A, int, int, A) const {}
#endif

    // Any option that changes the scores (the plain path skips score() altogether).
    __device__ __forceinline__ bool scores() const {
        return (flags & (kSoftcap | kAlibi | kBias | kMask | kScoreMod | kMaskMod)) != 0;
    }
    // Whether the biased score's derivative with respect to x differs from 1.
    __device__ __forceinline__ bool reshapes() const {
        return (flags & (kSoftcap | kScoreMod)) != 0;
    }
    __device__ __forceinline__ bool dropout() const { return (flags & kDropout) != 0; }

    // The biased score of query i, key j (both in range) from x = scale·q_i·k_j, in
    // natural units; −inf where a mask hides the key. g gets its derivative with respect
    // to x (the backward's dS factor): score_mod'(x)·(1 − tanh²) (1 without either).
    __device__ __forceinline__ A score(A x, int i, int j, A& g) const {
        g = A(1);
#ifdef CUFLASH_SCORE_MOD
        if (flags & kScoreMod) {
            g = cuflash_score_mod_grad(x, b, h, i, j, mods);
            x = cuflash_score_mod(x, b, h, i, j, mods);
        }
#endif
        if (flags & kSoftcap) {
            const A t = tanh_(x / softcap);
            x = softcap * t;
            g *= A(1) - t * t;
        }
        if (flags & kAlibi) {
            const int dist = i + off - j;
            x -= slope * A(dist < 0 ? -dist : dist);
        }
        if (flags & kBias) {
            const long long at = bias_bh + i * bias_sr + j * bias_sc;
            x += (flags & kBiasF32) ? A(static_cast<const float*>(bias)[at])
                                    : A(to_float(static_cast<const T*>(bias)[at]));
        }
        if ((flags & kMask) && !mask[mask_bh + i * mask_sr + j * mask_sc]) x = neg_inf<A>();
#ifdef CUFLASH_MASK_MOD
        if ((flags & kMaskMod) && !cuflash_mask_mod(b, h, i, j, mods)) x = neg_inf<A>();
#endif
        return x;
    }

    // Dropout's multiplier of P̃_ij: keep/(1 − p) (the Philox map of philox.cuh).
    __device__ __forceinline__ A keep(int i, int j) const {
        const unsigned int w = philox4x32_10((unsigned int)j >> 2, (unsigned int)i,
                                             (unsigned int)h, (unsigned int)b, seed_lo,
                                             seed_hi, j & 3);
        return w >= drop_threshold ? keep_scale : A(0);
    }

    // keep() of (i, j) and (i, j + 1) for an even j, as bits 0 and 1 (1: kept): both are
    // words of one Philox counter (j div 4), so one call draws the pair (the tensor-core
    // kernels' fragments hold scores in such column pairs).
    __device__ __forceinline__ unsigned int keep_pair(int i, int j) const {
        unsigned int w0 = (unsigned int)j >> 2, w1 = (unsigned int)i, w2 = (unsigned int)h,
                     w3 = (unsigned int)b;
        philox4x32_10_words(w0, w1, w2, w3, seed_lo, seed_hi);
        const unsigned int x0 = (j & 2) ? w2 : w0, x1 = (j & 2) ? w3 : w1;
        return (x0 >= drop_threshold ? 1u : 0u) | (x1 >= drop_threshold ? 2u : 0u);
    }
};

// One score from the raw product qk: the chain in natural units (x = scale·qk), then log2
// units; −inf where the causal/window mask or the bool mask hides the key, and for rows
// and keys outside [0, Nq) × [0, Nk), whose bias and mask are never read.
template <typename T>
__device__ __forceinline__ float variant_score(const Variants<T>& var, const CausalMask& mask,
                                               float qk, float scale, int i, int j) {
    float g;
    return (i < mask.Nq && !mask.masked(i, j))
               ? var.score(qk * scale, i, j, g) * MathConst<float>::log2e
               : neg_inf<float>();
}

// Every element one place towards x[0], `in` into the last (register moves): N of them bring
// each element back to its place, so a rolled loop over a thread's scores takes element e
// from x[0] at step e without a dynamic index (which would put x in local memory), and the
// variants' chain is inlined once (the Hopper kernels; rotate_fragments for mma.sync's)
template <int N> __device__ __forceinline__ void rotate(float (&x)[N], float in) {
#pragma unroll
    for (int i = 0; i < N - 1; ++i) x[i] = x[i + 1];
    x[N - 1] = in;
}

}  // namespace cuflash

// Without a score_mod or mask_mod compiled in, they add no parameter.
#ifndef CUFLASH_MODS
#define CUFLASH_MOD_PARAMS
#define CUFLASH_MOD_RECORD
#endif

// The variants' kernel parameters, appended to every attention kernel's list (the order
// of cuflash/backends/kernel_variants.py:variant_args), and the record built from them.
#define CUFLASH_VARIANT_PARAMS(T)                                                          \
    int var_flags, cuflash::accum_t<T> var_softcap, const cuflash::accum_t<T>* var_alibi,  \
        long long alibi_sb, const void* var_bias, long long bias_sb, long long bias_sh,    \
        long long bias_sr, long long bias_sc, const unsigned char* var_mask,               \
        long long mask_sb, long long mask_sh, long long mask_sr, long long mask_sc,        \
        unsigned int drop_threshold, unsigned int seed_lo, unsigned int seed_hi,           \
        cuflash::accum_t<T> keep_scale, int win_left, int win_right CUFLASH_MOD_PARAMS
#define CUFLASH_VARIANTS(T)                                                                \
    cuflash::Variants<T> {                                                                 \
        var_flags, var_softcap, var_alibi, alibi_sb, var_bias, bias_sb, bias_sh, bias_sr,  \
            bias_sc, var_mask, mask_sb, mask_sh, mask_sr, mask_sc, drop_threshold,         \
            seed_lo, seed_hi, keep_scale, win_left, win_right CUFLASH_MOD_RECORD           \
    }
