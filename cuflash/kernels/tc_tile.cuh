// tc_tile.cuh — the tensor-core forward's traits, shared-memory swizzle, tile copies and
// the online softmax and the attention variants on mma fragments (flash_fwd_tc.cu).
//
// Warp layout: warp w owns kWarpRows = 16 · kRowTiles query rows of the block, from
// w · kWarpRows: kRowTiles (1 or 2) mma row tiles, so BLOCK_M = 16 · kRowTiles · NUM_WARPS.
// Two row tiles (FlashAttention-2's 32 rows per warp) share every K and V fragment a warp
// loads from shared memory between two mma, halving the ldmatrix bytes per mma. In
// registers, per thread (g = lane >> 2, t = lane % 4, see the fragment picture in mma.cuh),
// per row tile r (the warp's rows 16r .. 16r + 15):
//   Q_i   kKSteps A fragments (the tile's 16 x D slice of Q, loaded once) while they take
//         at most 32 registers (kQInRegs: one row tile of D ≤ 128, two of D = 64); beside
//         O's 128 registers (D = 256, or two row tiles of D = 128) ptxas spills, so there
//         Q_i stays in shared memory and each k16 step re-reads its A fragment with one
//         ldmatrix (as FlashAttention-2 does for every head dim)
//   S, P̃  kSTiles C fragments: rows g and g+8, cols 8j + 2t, 8j + 2t + 1 of 16 x BLOCK_N
//   acc   kOTiles C fragments: rows g and g+8 of the tile's 16 x D slice of O
//   m_i, ℓ_i  one OnlineSoftmax per owned row (g, g+8); ℓ_i is the thread's partial sum
//
// Shared memory (dynamic, in the storage type T, rows of D elements = D/8 16-byte chunks,
// every tile swizzled by `swizzle`):
//   sQ [BLOCK_M][D]            Q_i (later: staging of the O tile for 16-byte stores)
//   sK [STAGES][BLOCK_N][D]    the K_j ring of the cp.async pipeline
//   sV [STAGES][BLOCK_N][D]    the V_j ring
// cuflash/plans/tc_fwd.py:tc_smem_bytes mirrors kSmemBytes term for term.
#pragma once

#include "common.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "variants.cuh"

namespace cuflash {

template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS, int STAGES>
struct TcTileTraits {
    using Elem = T;
    static constexpr int kHeadDim = HEAD_DIM;
    static constexpr int kBlockM = BLOCK_M;
    static constexpr int kBlockN = BLOCK_N;
    static constexpr int kStages = STAGES;
    static constexpr int kThreads = NUM_WARPS * 32;
    static constexpr int kRowTiles = BLOCK_M / (16 * NUM_WARPS);  // 16-row mma tiles per warp
    static constexpr int kWarpRows = 16 * kRowTiles;
    static constexpr int kChunkElems = 16 / (int)sizeof(T);  // elements per 16-byte chunk
    static constexpr int kChunksPerRow = HEAD_DIM / kChunkElems;
    static constexpr int kKSteps = HEAD_DIM / 16;      // k16 steps of S = Q Kᵀ
    static constexpr int kSTiles = BLOCK_N / 8;        // n-tiles of S (and P̃)
    static constexpr int kPVSteps = BLOCK_N / 16;      // k16 steps of P̃ V
    static constexpr int kOTiles = HEAD_DIM / 8;       // n-tiles of O
    // The forward's lean main loop (flash_fwd_tc.cu): copies and fragment loads addressed
    // once before the loop. sm_75's tiles of D = 128 and 256 keep the general loop,
    // addressing their copies per tile: they take all of its 64 KB, leaving no room for
    // the lean loop's paged-cache state (a static shared array); and at D = 256 its
    // copies, passing through registers without cp.async, spilled 16 bytes.
    static constexpr bool kLean = !(HEAD_DIM >= 128 && CUFLASH_ARCH < 800);
    // The lean loop's plain steady state peeled into a loop of its own, between the
    // general iterations before and after it; else one loop tests per iteration which
    // softmax it runs. Two row tiles at D = 128 hold O's 128 registers beside S's: their
    // three loops made ptxas spill (40-56 bytes, sm_80 and sm_90), the one loop does not.
    static constexpr bool kPeeled = !(kRowTiles == 2 && HEAD_DIM == 128);
    // Q_i's A fragments held in registers: kRowTiles · D / 4 registers, up to 32
    static constexpr bool kQInRegs = kLean ? kRowTiles * HEAD_DIM <= (kRowTiles == 1 ? 128 : 64)
                                           : kRowTiles * HEAD_DIM <= 128;
    static constexpr int kQFrags = kQInRegs ? kKSteps : 1;
    static constexpr bool kTf32 = false;               // 16-bit operands (tf32_tile.cuh: float)
    static constexpr bool kSplit = false;
    using OwnFrag = FragA;                             // Q_i's fragments: ldmatrix'd pairs
    static constexpr int kSmemQ = BLOCK_M * HEAD_DIM;            // elements
    static constexpr int kSmemK = STAGES * BLOCK_N * HEAD_DIM;
    static constexpr int kSmemV = STAGES * BLOCK_N * HEAD_DIM;
    static constexpr int kSmemBytes = (kSmemQ + kSmemK + kSmemV) * (int)sizeof(T);

    static_assert(sizeof(T) == 2, "tensor-core tiles hold f16 or bf16");
    static_assert(kRowTiles == 1 || kRowTiles == 2, "each warp owns one or two 16-row mma tiles");
    static_assert(BLOCK_M == kWarpRows * NUM_WARPS, "BLOCK_M = 16 * kRowTiles * NUM_WARPS, kRowTiles 1 or 2");
    static_assert(BLOCK_N % 16 == 0, "BLOCK_N must be a multiple of 16 (k16 steps of P V, ldmatrix.x4 pairs)");
    static_assert(HEAD_DIM % 64 == 0, "HEAD_DIM must be a multiple of 64: the swizzle permutes 8 chunks of 16 bytes");
    static_assert(STAGES >= 2, "the cp.async pipeline needs at least two stages to overlap copy and math");
    static_assert(kSmemBytes <= 227 * 1024, "tile exceeds the largest shared memory of any GPU (227 KB)");
};

// The XOR swizzle of every shared tile: logical 16-byte chunk `chunk` of row `row` lives at
// physical chunk chunk ^ (row % 8). Rows are ≥ 128 bytes, so without it the 8 rows one
// ldmatrix phase reads (same chunk, rows r..r+7) would all sit in the same 4 banks (8-way
// conflict); with it they cover all 32 banks, and so do the 8 chunks of one row that 8
// neighbouring threads store. A bijection on each row's chunks (row-local: nothing moves
// between rows), so no padding is needed.
__device__ __forceinline__ int swizzle(int row, int chunk) { return chunk ^ (row & 7); }

// Element offset of (row, col) in a swizzled [rows][D] tile (col within a chunk kept).
template <class Tr> __device__ __forceinline__ int tile_offset(int row, int col) {
    constexpr int C = Tr::kChunkElems;
    return row * Tr::kHeadDim + swizzle(row, col / C) * C + col % C;
}

// The forward's K_j tiles trade chunks within every 16-row group: the odd chunks of rows
// 0-7 and the even chunks of rows 8-15 swap places (then the swizzle as everywhere). An
// ldmatrix.x4 addressed as for Q and V (FragAddrs) then returns K's B fragments in the
// register order the mma takes (b_lo.b0, b_lo.b1, b_hi.b0, b_hi.b1), so K needs no
// addresses of its own (see FragAddrs).
template <class Tr> __device__ __forceinline__ int k_tile_offset(int row, int col) {
    constexpr int C = Tr::kChunkElems;
    int chunk = col / C;
    const bool odd = chunk & 1, low = (row & 8) == 0;
    if (low && odd) row += 8, chunk -= 1;
    else if (!low && !odd) row -= 8, chunk += 1;
    return row * Tr::kHeadDim + swizzle(row, chunk) * C + col % C;
}

// x as a value the compiler cannot carry over from where it was computed: what is derived
// from it is computed anew where it is used, not hoisted out of a loop and held in a
// register through it (addresses worth recomputing once per key block, say, where the
// main loop needs every register).
__device__ __forceinline__ int fresh(int x) {
    asm volatile("mov.b32 %0, %0;" : "+r"(x));
    return x;
}

// Rows [row0, row0 + ROWS) x columns [0, D) of a (rows x d) matrix with row stride `ld`
// (16-byte aligned rows) into the swizzled tile s, by cp.async in 16-byte chunks:
// consecutive threads take consecutive chunks of a row (coalesced). Rows >= n_rows and
// chunks at columns >= d (d a multiple of the chunk) are zero-filled (src-size 0), so
// padded head-dim columns add nothing to Q Kᵀ and padded keys give P̃ V finite zeros.
// Unrolled where each thread copies at most 4 chunks, else a rolled loop: unrolled, ptxas
// hoists every chunk's addresses out of the main loop (they are loop-invariant but for the
// tile's row offset) and keeps them in registers, which spilled with 8–32 chunks per
// thread (1–2 warps, 256-wide or float tiles). K_LAYOUT: the forward's K_j layout
// (k_tile_offset), for FragAddrs' ldmatrix. `tid`: the thread's index (e.g. fresh).
template <class Tr, int ROWS, bool K_LAYOUT = false, typename T>
__device__ __forceinline__ void copy_tile_async(T* __restrict__ s, const T* __restrict__ g,
                                                long long ld, int row0, int n_rows, int d,
                                                int tid = threadIdx.x) {
    constexpr int CPR = Tr::kChunksPerRow, C = Tr::kChunkElems;
    constexpr int kChunks = ROWS * CPR, NT = Tr::kThreads;
    auto copy_chunk = [&](int i) {
        const int r = i / CPR, c = i % CPR;
        const bool valid = row0 + r < n_rows && c * C < d;
        // a zero-filled chunk still names a valid address (the matrix's first element)
        const T* src = valid ? g + (long long)(row0 + r) * ld + c * C : g;
        const int at = K_LAYOUT ? k_tile_offset<Tr>(r, c * C) : tile_offset<Tr>(r, c * C);
        cp_async_16(s + at, src, valid);
    };
    if constexpr (kChunks <= 4 * NT) {
#pragma unroll
        for (int it = 0; it < (kChunks + NT - 1) / NT; ++it) {
            const int i = tid + it * NT;
            if (kChunks % NT == 0 || i < kChunks) copy_chunk(i);
        }
    } else {
#pragma unroll 1
        for (int i = tid; i < kChunks; i += NT) copy_chunk(i);
    }
}

constexpr int gcd(int a, int b) { return b == 0 ? a : gcd(b, a % b); }

// A streamed tile's copy with its addressing fixed before the main loop (the forward's K_j
// and V_j): with kThreads a multiple of kChunksPerRow, thread x copies chunk column
// x % CPR of rows x / CPR + it·kRowStep. Its global addresses are then its own pointer
// into the tile (`thread_rows`, advanced one tile at a time by the caller) plus it row
// steps, and its shared ones a few per-thread offsets (the swizzle depends on the row mod
// 8: kPeriod of them) plus immediates. A full tile costs one cp.async and one address add
// per chunk; only an edge tile tests its rows (zero-filling those past n_rows, as
// copy_tile_async does).
template <class Tr, int ROWS, typename T, bool K_LAYOUT = false> struct TileCopy {
    static constexpr int CPR = Tr::kChunksPerRow, C = Tr::kChunkElems, NT = Tr::kThreads;
    static constexpr int kRowStep = NT >= CPR ? NT / CPR : 1;  // (fewer threads: !kFits)
    static constexpr int kIters = ROWS / kRowStep;
    // rows after which a thread's shared offsets repeat: the swizzle's 8 (K_LAYOUT: 16)
    static constexpr int kRepeat = K_LAYOUT ? 16 : 8;
    static constexpr int kPeriod = kRepeat / gcd(kRowStep, kRepeat);
    static constexpr int kOffsets = kPeriod < kIters ? kPeriod : kIters;
    // this addressing applies (else the caller copies with copy_tile_async)
    static constexpr bool kFits = NT % CPR == 0 && ROWS % kRowStep == 0 && kIters <= 8 &&
                                  kPeriod <= 4;

    unsigned s_off[kOffsets];  // bytes from the tile's start, rows row .. row + kPeriod − 1
    long long g_off, g_step;   // elements: the thread's first chunk in a tile, one row step
    unsigned src_size;         // 16, or 0 for a chunk past column d (zero-filled)

    __device__ __forceinline__ TileCopy(long long ld, int d) {
        const int c = threadIdx.x % CPR, row = threadIdx.x / CPR;
        const bool col_ok = c * C < d;
        src_size = col_ok ? 16u : 0u;
        g_off = (long long)row * ld + (col_ok ? c * C : 0);  // a zero-filled chunk: row start
        g_step = (long long)kRowStep * ld;
#pragma unroll
        for (int i = 0; i < kOffsets; ++i)
            s_off[i] = (K_LAYOUT ? k_tile_offset<Tr>(row + i * kRowStep, c * C)
                                 : tile_offset<Tr>(row + i * kRowStep, c * C)) *
                       (unsigned)sizeof(T);
    }

    // The thread's first chunk of the tile whose row 0 is at g_tile.
    __device__ __forceinline__ const T* thread_rows(const T* g_tile) const {
        return g_tile + g_off;
    }
    __device__ __forceinline__ unsigned s_at(unsigned s_tile, int it) const {
        constexpr unsigned kRowBytes = Tr::kHeadDim * sizeof(T);
        return s_tile + s_off[it % kOffsets] + (it / kOffsets) * kOffsets * kRowStep * kRowBytes;
    }

    // Every row of the tile is in range; g: thread_rows of the tile. `whole`: so is every
    // column (d = HEAD_DIM), and no chunk tests it.
    template <bool whole = false>
    __device__ __forceinline__ void full(unsigned s_tile, const T* g) const {
#pragma unroll
        for (int it = 0; it < kIters; ++it)
            cp_async_16(s_at(s_tile, it), g + it * g_step, whole ? 16u : src_size);
    }

    // Rows >= n_rows zero-filled; g: thread_rows of the tile. A zero-filled chunk reads
    // nothing but still names a valid address: `any`, e.g. the matrix's first element.
    __device__ __forceinline__ void edge(unsigned s_tile, const T* g, int n_rows,
                                         const T* any) const {
        const int first = threadIdx.x / CPR;  // row, recomputed: a register less in the loop
#pragma unroll
        for (int it = 0; it < kIters; ++it) {
            const bool in = first + it * kRowStep < n_rows;
            cp_async_16(s_at(s_tile, it), in ? g + it * g_step : any, in ? src_size : 0u);
        }
    }
};

// The A fragment of k16 step kk of the warp's 16 x D slice of Q_i (one ldmatrix.x4): lanes
// 0-15 address rows 0-15 at the step's first 8 columns, lanes 16-31 the same rows 8 columns
// on, so registers 0..3 are a0..a3.
template <class Tr, typename T>
__device__ __forceinline__ FragA q_fragment(const T* sQ, int warp_row0, int kk, int lane) {
    FragA a;
    ldmatrix_x4(a.a0, a.a1, a.a2, a.a3,
                sQ + tile_offset<Tr>(warp_row0 + lane % 16, kk * 16 + (lane / 16) * 8));
    return a;
}

// Q_i's A fragments into registers, once per block (when kQInRegs): row tile r is the
// warp's rows 16r .. 16r + 15.
template <class Tr, int R, typename T>
__device__ __forceinline__ void load_q_fragments(FragA (&qf)[R][Tr::kQFrags], const T* sQ,
                                                 int warp_row0, int lane) {
    if constexpr (Tr::kQInRegs) {
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int kk = 0; kk < Tr::kKSteps; ++kk)
                qf[r][kk] = q_fragment<Tr>(sQ, warp_row0 + 16 * r, kk, lane);
    }
}

// s += Q_i K_jᵀ for the warp's R row tiles: per k16 step and pair of n-tiles (16 keys), one
// ldmatrix.x4 of K (keys as rows, not transposed: a K row pair is a B column pair) gives
// b0, b1 of both n-tiles, and every row tile's mma uses them: R rows per B fragment load.
template <class Tr, int R, typename T>
__device__ __forceinline__ void gemm_qk_tc(FragC (&s)[R][Tr::kSTiles], const FragA (&qf)[R][Tr::kQFrags],
                                           const T* sQ, int warp_row0, const T* sK, int lane) {
#pragma unroll
    for (int kk = 0; kk < Tr::kKSteps; ++kk) {
        FragA a[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if constexpr (Tr::kQInRegs) a[r] = qf[r][kk];
            else a[r] = q_fragment<Tr>(sQ, warp_row0 + 16 * r, kk, lane);
        }
#pragma unroll
        for (int np = 0; np < Tr::kSTiles / 2; ++np) {
            FragB b_lo, b_hi;
            ldmatrix_x4(b_lo.b0, b_lo.b1, b_hi.b0, b_hi.b1,
                        sK + tile_offset<Tr>(np * 16 + lane % 8 + (lane / 16) * 8,
                                             kk * 16 + ((lane / 8) % 2) * 8));
#pragma unroll
            for (int r = 0; r < R; ++r) {
                mma_k16<T>(s[r][2 * np], a[r], b_lo);
                mma_k16<T>(s[r][2 * np + 1], a[r], b_hi);
            }
        }
    }
}

// P̃ as the A fragment of k16 step kk, straight from the C fragments of S's n-tiles 2kk and
// 2kk+1 (see mma.cuh): no trip through shared memory.
template <typename T>
__device__ __forceinline__ FragA p_fragment(const FragC& left, const FragC& right) {
    return FragA{pack2<T>(left.c0, left.c1), pack2<T>(left.c2, left.c3),
                 pack2<T>(right.c0, right.c1), pack2<T>(right.c2, right.c3)};
}

// acc += P̃ V_j for the warp's R row tiles: per k16 step (16 keys) and pair of O n-tiles
// (16 head-dim columns), one ldmatrix.x4.trans of the row-major V tile gives b0, b1 of
// both n-tiles, shared by every row tile's mma.
template <class Tr, int R, typename T>
__device__ __forceinline__ void gemm_pv_tc(FragC (&acc)[R][Tr::kOTiles], const FragC (&p)[R][Tr::kSTiles],
                                           const T* sV, int lane) {
#pragma unroll
    for (int kk = 0; kk < Tr::kPVSteps; ++kk) {
        FragA pa[R];
#pragma unroll
        for (int r = 0; r < R; ++r) pa[r] = p_fragment<T>(p[r][2 * kk], p[r][2 * kk + 1]);
#pragma unroll
        for (int np = 0; np < Tr::kOTiles / 2; ++np) {
            FragB b_lo, b_hi;
            ldmatrix_x4_trans(b_lo.b0, b_lo.b1, b_hi.b0, b_hi.b1,
                              sV + tile_offset<Tr>(kk * 16 + lane % 8 + ((lane / 8) % 2) * 8,
                                                   np * 16 + (lane / 16) * 8));
#pragma unroll
            for (int r = 0; r < R; ++r) {
                mma_k16<T>(acc[r][2 * np], pa[r], b_lo);
                mma_k16<T>(acc[r][2 * np + 1], pa[r], b_hi);
            }
        }
    }
}

// The ldmatrix row addresses of the forward's products, fixed before the main loop. In
// every ldmatrix.x4 of Q_i, K_j and V_j here, lanes 0-15 address rows 0-15 of a 16-row step
// at its first 8 columns and lanes 16-31 the same rows 8 columns on (K_j's tile is laid
// out for it: k_tile_offset). A lane's row mod 8 is then the same in every step, so its
// address for column step m is one of four per-thread offsets, plus immediates: (m / 4)·128
// bytes (a whole swizzle period, 8 chunks) and 16 rows per row step. One set serves all
// three tiles.
template <class Tr> struct FragAddrs {
    static constexpr unsigned kRowBytes = Tr::kHeadDim * 2;
    unsigned base[4];  // from a tile's start
    __device__ __forceinline__ explicit FragAddrs(int lane) {
#pragma unroll
        for (int m = 0; m < 4; ++m)
            base[m] = (lane % 16) * kRowBytes + ((2 * m + lane / 16) ^ (lane & 7)) * 16;
    }
    // rows 16·row_step + 0..15, columns 16·col_step + 0..15 of the tile at `tile`
    __device__ __forceinline__ unsigned at(unsigned tile, int row_step, int col_step) const {
        return tile + base[col_step % 4] + (col_step / 4) * 128 + row_step * 16 * kRowBytes;
    }
};

// s += Q_i K_jᵀ as gemm_qk_tc, addressed by FragAddrs: K_j's tile at s_k, Q_i's (when its
// fragments are not in registers) at s_q, the warp's rows.
template <class Tr, int R>
__device__ __forceinline__ void gemm_qk_fwd(FragC (&s)[R][Tr::kSTiles],
                                            const FragA (&qf)[R][Tr::kQFrags], unsigned s_q,
                                            unsigned s_k, const FragAddrs<Tr>& at) {
    using T = typename Tr::Elem;
#pragma unroll
    for (int kk = 0; kk < Tr::kKSteps; ++kk) {
        FragA a[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if constexpr (Tr::kQInRegs) a[r] = qf[r][kk];
            else ldmatrix_x4(a[r].a0, a[r].a1, a[r].a2, a[r].a3, at.at(s_q, r, kk));
        }
#pragma unroll
        for (int np = 0; np < Tr::kSTiles / 2; ++np) {
            FragB b_lo, b_hi;
            ldmatrix_x4(b_lo.b0, b_lo.b1, b_hi.b0, b_hi.b1, at.at(s_k, np, kk));
#pragma unroll
            for (int r = 0; r < R; ++r) {
                mma_k16<T>(s[r][2 * np], a[r], b_lo);
                mma_k16<T>(s[r][2 * np + 1], a[r], b_hi);
            }
        }
    }
}

// P̃ as the A fragments of every k16 step of P̃ V_j, packed to 16 bits as soon as it is
// final: its float registers (S's) are free again before the product.
template <class Tr, int R>
__device__ __forceinline__ void pack_p(FragA (&pa)[R][Tr::kPVSteps],
                                       const FragC (&p)[R][Tr::kSTiles]) {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int kk = 0; kk < Tr::kPVSteps; ++kk)
            pa[r][kk] = p_fragment<typename Tr::Elem>(p[r][2 * kk], p[r][2 * kk + 1]);
}

// acc += P̃ V_j as gemm_pv_tc, from pack_p's fragments, V_j's tile at s_v; `at` FragAddrs,
// or any addresses of the same pattern (the backward's BwdFragAddrs::cols()).
template <class Tr, int R, class Addrs>
__device__ __forceinline__ void gemm_pv_fwd(FragC (&acc)[R][Tr::kOTiles],
                                            const FragA (&pa)[R][Tr::kPVSteps], unsigned s_v,
                                            const Addrs& at) {
    using T = typename Tr::Elem;
#pragma unroll
    for (int kk = 0; kk < Tr::kPVSteps; ++kk) {
#pragma unroll
        for (int np = 0; np < Tr::kOTiles / 2; ++np) {
            FragB b_lo, b_hi;
            ldmatrix_x4_trans(b_lo.b0, b_lo.b1, b_hi.b0, b_hi.b1, at.at(s_v, kk, np));
#pragma unroll
            for (int r = 0; r < R; ++r) {
                mma_k16<T>(acc[r][2 * np], pa[r][kk], b_lo);
                mma_k16<T>(acc[r][2 * np + 1], pa[r][kk], b_hi);
            }
        }
    }
}

// -- the online softmax on fragments: a thread's values of row g are c0, c1 of every
// n-tile, of row g + 8 c2, c3; the other columns of those rows are in the quad.

// Max over the quad that shares a row (lanes 4g..4g+3: shuffle xor 1, 2).
__device__ __forceinline__ float row_max_quad(float v) { return warp_reduce_max<4>(v); }
__device__ __forceinline__ float row_sum_quad(float v) { return warp_reduce_sum<4>(v); }

// rowmax of the thread's part of S (top: row g, bottom: row g + 8), from its first pair
// rather than from −inf: one max fewer per row.
template <int N>
__device__ __forceinline__ void tile_row_max(const FragC (&s)[N], float& top, float& bottom) {
    top = max_(s[0].c0, s[0].c1);
    bottom = max_(s[0].c2, s[0].c3);
#pragma unroll
    for (int j = 1; j < N; ++j) {
        top = max_(top, max_(s[j].c0, s[j].c1));
        bottom = max_(bottom, max_(s[j].c2, s[j].c3));
    }
}

// P̃ = exp2(S − shift) in place; the thread's part of rowsum P̃ into sum_top, sum_bottom.
template <int N>
__device__ __forceinline__ void exp2_rows(FragC (&s)[N], float shift_top, float shift_bottom,
                                          float& sum_top, float& sum_bottom) {
#pragma unroll
    for (int j = 0; j < N; ++j) {
        s[j].c0 = fast_exp2(s[j].c0 - shift_top);
        s[j].c1 = fast_exp2(s[j].c1 - shift_top);
        s[j].c2 = fast_exp2(s[j].c2 - shift_bottom);
        s[j].c3 = fast_exp2(s[j].c3 - shift_bottom);
        // the first pair starts the sums: P̃ ≥ +0, so 0 + x = x, one add fewer per row
        sum_top = j == 0 ? s[j].c0 + s[j].c1 : sum_top + (s[j].c0 + s[j].c1);
        sum_bottom = j == 0 ? s[j].c2 + s[j].c3 : sum_bottom + (s[j].c2 + s[j].c3);
    }
}

// The same from raw products S = Q Kᵀ: P̃ = exp2(S·c − shift), c = scale·log2 e, one FFMA
// and one exp2 per score (the plain path: the row max is taken of S itself, and shift =
// c·max is the same for every score of the row, so its rounding cancels in O and lse).
template <int N>
__device__ __forceinline__ void exp2_rows_scaled(FragC (&s)[N], float c, float shift_top,
                                                 float shift_bottom, float& sum_top,
                                                 float& sum_bottom) {
#pragma unroll
    for (int j = 0; j < N; ++j) {
        s[j].c0 = fast_exp2(fmaf(s[j].c0, c, -shift_top));
        s[j].c1 = fast_exp2(fmaf(s[j].c1, c, -shift_top));
        s[j].c2 = fast_exp2(fmaf(s[j].c2, c, -shift_bottom));
        s[j].c3 = fast_exp2(fmaf(s[j].c3, c, -shift_bottom));
        // the first pair starts the sums: P̃ ≥ +0, so 0 + x = x, one add fewer per row
        sum_top = j == 0 ? s[j].c0 + s[j].c1 : sum_top + (s[j].c0 + s[j].c1);
        sum_bottom = j == 0 ? s[j].c2 + s[j].c3 : sum_bottom + (s[j].c2 + s[j].c3);
    }
}

// acc *= α per row (rows g and g + 8 of every n-tile).
template <int N>
__device__ __forceinline__ void rescale_acc(FragC (&acc)[N], float alpha_top, float alpha_bottom) {
#pragma unroll
    for (int j = 0; j < N; ++j) {
        acc[j].c0 *= alpha_top;
        acc[j].c1 *= alpha_top;
        acc[j].c2 *= alpha_bottom;
        acc[j].c3 *= alpha_bottom;
    }
}

// The forward's acc *= α, skipped by the whole warp when none of its rows' max moved: then
// every α is exactly 1 and the products would change nothing (the result is the same bit
// for bit). Late in a long row most key tiles leave its max alone. Split tf32 rescales
// always: it gains nothing there, its registers being full.
template <class Tr, int N>
__device__ __forceinline__ void rescale_acc_if_moved(FragC (&acc)[N], float alpha_top,
                                                     float alpha_bottom) {
    if constexpr (!Tr::kSplit)
        if (!__any_sync(0xffffffffu, alpha_top != 1.f || alpha_bottom != 1.f)) return;
    rescale_acc(acc, alpha_top, alpha_bottom);
}

// -- attention variants on fragments (variants.cuh's chain, applied as attn_tile.cuh's
// compute_scores and flash_fwd.cu apply it). The thread's elements of S are (r_top, c),
// (r_top, c + 1), (r_top + 8, c), (r_top + 8, c + 1) with c = c0 + 8j: c0 + 8j is even.

// Every element of the thread's fragments one place towards s[0].c0 (n-tile n's c0 ← c1 ←
// c2 ← c3 ← n-tile n + 1's c0), `in` into the last: register moves only; returns the
// element that leaves s[0].c0. 4·N rotations bring every element back to its place, so a
// rolled loop can take element e from s[0].c0 at step e without a dynamic index into the
// fragments (which would put them in local memory).
template <int N>
__device__ __forceinline__ float rotate_fragments(FragC (&s)[N], float in) {
#pragma unroll
    for (int n = N - 1; n >= 0; --n) {
        const float out = s[n].c0;
        s[n].c0 = s[n].c1;
        s[n].c1 = s[n].c2;
        s[n].c2 = s[n].c3;
        s[n].c3 = in;
        in = out;
    }
    return in;
}

// The same through R row tiles' fragments: row tile r + 1's first element moves into row
// tile r's last.
template <int R, int N>
__device__ __forceinline__ float rotate_fragments(FragC (&s)[R][N], float in) {
#pragma unroll
    for (int r = R - 1; r >= 0; --r) in = rotate_fragments(s[r], in);
    return in;
}

// S (raw products) → the variants' scores in log2 units, in place, for the warp's R row
// tiles (row tile r's rows are r_top + 16r and r_top + 16r + 8). The chain is inlined once,
// not once per element: a rolled loop takes the thread's 4·R·N elements one by one from
// s[0][0].c0 (rotate_fragments). This keeps the variant branch's code, and the compile
// time, small.
template <int R, int N, typename T>
__device__ __forceinline__ void variant_scores(FragC (&s)[R][N], const Variants<T>& var,
                                               const CausalMask& mask, float scale, int r_top,
                                               int c0) {
#pragma unroll 1
    for (int r = 0; r < R; ++r) {
#pragma unroll 1
        for (int e = 0; e < 4 * N; ++e) {  // element e: n-tile e / 4, register e % 4
            const int i = r_top + 16 * r + (e & 2) * 4, j = c0 + (e >> 2) * 8 + (e & 1);
            rotate_fragments(s, variant_score(var, mask, s[0][0].c0, scale, i, j));
        }
    }
}

// One keep bit per element of a thread's part of S: 32 bits where they do, else 64 (two
// row tiles of Bc = 64).
template <bool Wide> struct KeepBits { using type = unsigned int; };
template <> struct KeepBits<true> { using type = unsigned long long; };

// Dropout: P̃ → P̃ ∘ keep / (1 − p) in place, after ℓ has summed P̃ (lse stays the
// pre-dropout one), for the warp's R row tiles. The keep decisions are drawn first, into
// one bit per element (a rolled loop, one Philox call per row and column pair: the
// generator is inlined once), then applied.
template <int R, int N, typename T>
__device__ __forceinline__ void dropout_fragments(FragC (&p)[R][N], const Variants<T>& var,
                                                  int r_top, int c0) {
    static_assert(4 * R * N <= 64, "one keep bit per element of the thread's part of S");
    using Bits = typename KeepBits<(4 * R * N > 32)>::type;
    Bits bits = 0;
#pragma unroll 1
    for (int r = 0; r < R; ++r) {
#pragma unroll 1
        for (int e = 0; e < 2 * N; ++e)  // n-tile e / 2, row + 8·(e % 2): 2 bits at 2·e
            bits |= (Bits)var.keep_pair(r_top + 16 * r + (e & 1) * 8, c0 + (e >> 1) * 8)
                    << (2 * (r * 2 * N + e));
    }
    const float ks = var.keep_scale;
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int j = 0; j < N; ++j) {
            const unsigned keep = (unsigned)(bits >> (4 * (r * N + j))) & 0xfu;
            p[r][j].c0 = keep & 1u ? p[r][j].c0 * ks : 0.f;
            p[r][j].c1 = keep & 2u ? p[r][j].c1 * ks : 0.f;
            p[r][j].c2 = keep & 4u ? p[r][j].c2 * ks : 0.f;
            p[r][j].c3 = keep & 8u ? p[r][j].c3 * ks : 0.f;
        }
    }
}

}  // namespace cuflash
