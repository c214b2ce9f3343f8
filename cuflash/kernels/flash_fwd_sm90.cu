// flash_fwd_sm90.cu — the FlashAttention forward on Hopper's asynchronous machinery (sm_90a):
// TMA, mbarriers, warp specialization and wgmma, FlashAttention-3's structure.
//
// The grid walks the (query block, head, batch) tiles head by head (the blocks running at
// once share their heads' K and V in L2), causal ones heaviest first within a head; block
// x takes tiles x, x + gridDim.x, …: one tile per block by default, or a persistent grid
// of one block per SM whose tiles' prologues and epilogues run under their neighbours'
// products (launch's choice).
//
//   warpgroup 2 (producer)   gives its registers up (warpgroup 1 where one consumer runs,
//                            kNarrow); one elected thread, per tile: waits until the
//                            consumers are done with Q (q_empty), loads Q_i, then
//                            per key tile j: waits until the consumers freed K's ring slot
//                            (empty), announces the bytes and starts the TMA boxes of K_j
//                            (full), then the same for V_j in V's ring. The rings run on
//                            across tiles. float32 (tf32): its last three warps round each
//                            K_j in place and write V_jᵀ from V_j (see Sm90FwdTraits).
//   warpgroups 0, 1          take the registers; each owns 64 of the tile's 128 query rows
//                            (float32's narrow tiles: warpgroup 0 alone, 64 rows).
//   (consumers)              Per key tile j (Algorithm 1, lines 6-10):
//                              S = Q_i K_jᵀ           wgmma m64n128k16, both from shared memory
//                              m_new = max(m_i, rowmax S · c), P̃ = exp2(S·c − m_new), ℓ
//                                                     on the accumulators (quad shuffles,
//                                                     c = scale·log2 e, as flash_fwd_tc.cu)
//                              acc = α acc + P̃ V_j   wgmma m64nDk16: P̃ from registers (the
//                                                     accumulators packed to 16 bits), V_j
//                                                     MN-major from shared memory
//                            freeing K_j's slot once S_j has retired and V_j's once P̃_j V_j
//                            has (empty); after the last, free Q (q_empty),
//                            and O_i = acc / ℓ_i goes out through the warpgroup's rows of
//                            the O buffer and a TMA store (read while the next tile runs),
//                            lse_i directly.
//                            Pipelined within the warpgroup as FlashAttention-3 does: S_j
//                            and P̃_{j−1} V_{j−1} issued together, the softmax of tile j run
//                            while the product still runs, acc *= α_j once it retired; and
//                            the two warpgroups take turns to issue (ping-pong, two named
//                            barriers), so one's products run under the other's softmax.
//
// Layout: q, k, v, o (B, H, N, D) in T (float16, bfloat16 or float32), any strides TMA takes
// (rows of contiguous elements; row, head and batch strides multiples of 16 bytes); the tensor
// maps are 4-D (D, N, H, B), boxes of 128-byte rows (64 16-bit head-dim columns, 32 floats;
// 128-byte swizzle: wgmma's K-major layout for Q and K, its MN-major one for V) by 128 rows; rows past a sequence's end
// come in as zeros and are masked (keys) or dropped by the store (queries). GQA: query head h reads
// K/V head h / group. Lengths per batch row (VARLEN, seqlens.cuh's layouts): packed
// sequences (cu_q, cu_k: row offsets; q, k, v, o (1, H, total, D), lse (1, H, total_q), Nq
// and Nk the totals), a KV cache (used_k: keys in use of the padded k, v) and a paged one
// (block_table: key tile j of row b in page block_table[b][j·BN / page_size], k and v
// (pages, H, page_size, D), page_size a multiple of BN); the grid's query blocks those of
// the longest sequence. A tile reads its sequence's rows at its offsets (the boxes' rows
// past its end, the next sequence's, are masked as keys or left unwritten as queries: its
// O leaves from registers, row by row), and a tile whose rows start past its sequence's
// end is skipped. A specialization of its own: the tile's rows and lengths read
// from memory would move the padded walk's descriptor arithmetic off the uniform datapath.
// Causal masking and the sliding window are mask.cuh's (bottom-right aligned): key tiles
// outside every row's reach are never loaded; those some row sees only in part are masked
// score by score.
// Split-KV (num_splits > 1, where the tiles alone would leave SMs idle): the walk's tiles
// are (query block, split, head, batch), each over its split's share of the key tiles
// (seqlens.cuh's rule); a split's O_i = acc / ℓ_i leaves in float, from registers, to
// o_part, and its lse_i split·split_stride rows on, both merged afterwards
// (cuflash.merge_states).
#include "common.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "seqlens.cuh"
#include "sm90.cuh"
#include "variants.cuh"

using namespace cuflash;

namespace {

// The tile and its shared memory: Q_i (and O_i's staging) as D / kBoxCols boxes of kBlockM rows
// × 128 bytes (kBoxCols = 64 16-bit elements or 32 floats), the K_j, V_j rings as such
// boxes of kBlockN rows, on 1024-byte boundaries as the 128-byte swizzle needs. D = 256 takes
// 64-key tiles (its 64 x 256 accumulators and Q_i leave room for no more) and stores O from
// registers (no staging).
// float32 (kTf32: tf32): 64-key tiles, O from registers; wgmma takes tf32's B only K-major,
// so V_j lands as it is in memory (`v`, kRawStages slots: one at D ≥ 128 one-pass, where two
// leave no room) and the producer's other three warps write V_jᵀ (`vt`: kBlockN / 32 boxes of
// D rows × 32 keys) for P̃ V_j, see transpose_v. At D = 256 the tile is 64 query rows (one
// consumer warpgroup, kNarrow) by 32 keys: Q_i 64 KB, K_j 2 × 32, V_j 32, V_jᵀ 2 × 32.
// SPLIT (split tf32, D = 64 or 128): x = hi + lo, hi = tf32(x), lo = tf32(x − hi), and a·b ≈
// hi·hi + hi·lo + lo·hi, three products each, as tf32_tile.cuh's; Q_i's, K_j's and V_jᵀ's lo
// parts in shared memory beside them, P̃'s in registers. At D = 128 they fit only beside a
// narrow tile, 64 × 32: 224 KB with both rings' two slots.
template <typename T, int HEAD_DIM, bool SPLIT = false> struct Sm90FwdTraits {
    static constexpr bool kTf32 = sizeof(T) == 4, kSplit = SPLIT;
    static constexpr int kBoxCols = 128 / sizeof(T);  // elements of a 128-byte row
    static constexpr int kK = 32 / sizeof(T);         // a wgmma's k step: 32 bytes of a row
    // split tf32 at D = 128, one-pass at D = 256: one consumer warpgroup and 32-key tiles,
    // which leave room for the lo parts and for D = 256's four-byte rows
    static constexpr bool kNarrow = kTf32 && HEAD_DIM == (SPLIT ? 128 : 256);
    static constexpr int kConsumers = kNarrow ? 1 : 2;  // warpgroups of 64 query rows
    static constexpr int kBlockM = 64 * kConsumers, kStages = 2;
    static constexpr int kBlockN = kNarrow ? 32 : HEAD_DIM == 256 || kTf32 ? 64 : 128;
    // V_j's ring: one slot where two leave no room (one-pass tf32 at D = 128 and 256)
    static constexpr int kRawStages = kTf32 && !SPLIT && HEAD_DIM >= 128 ? 1 : kStages;
    static constexpr int kBoxes = HEAD_DIM / kBoxCols;
    static constexpr int kBoxElems = kBlockM * kBoxCols, kKvBoxElems = kBlockN * kBoxCols;
    static constexpr unsigned kBoxBytes = kBlockM * 128, kKvBoxBytes = kBlockN * 128;
    static constexpr int kVtBoxes = kTf32 ? kBlockN / kBoxCols : 1;
    static constexpr int kVtBoxElems = kTf32 ? HEAD_DIM * kBoxCols : 1;
    static constexpr bool kStageO = HEAD_DIM != 256 && !kTf32;  // O through shared memory and TMA
    static constexpr int kConsumerThreads = 128 * kConsumers, kThreads = kConsumerThreads + 128;
    static constexpr int kTransposers = 96;     // the producer's last three warps (tf32)
    // of the 64 K registers: 128 · 40 + 256 · 232 (16-bit), 128 · 56 + 256 · 224 (tf32);
    // one consumer warpgroup takes all a thread may hold (no fewer than its launch gave it)
    static constexpr int kProducerRegs = kTf32 ? 56 : 40;
    static constexpr int kConsumerRegs = kNarrow ? 256 : kTf32 ? 224 : 232;
    static constexpr int kOAcc = HEAD_DIM / 2;  // a consumer thread's accumulators of 64 x D
    static constexpr int kS = kBlockN / 2;      // its scores of 64 x kBlockN
    struct Tf32Tiles {  // the V_jᵀ ring; split: the lo parts
        T vt[kTf32 ? kStages : 1][kVtBoxes][kVtBoxElems];
        T q_lo[SPLIT ? kBoxes : 1][SPLIT ? kBoxElems : 1];
        T k_lo[SPLIT ? kStages : 1][kBoxes][SPLIT ? kKvBoxElems : 1];
        T vt_lo[SPLIT ? kStages : 1][kVtBoxes][SPLIT ? kVtBoxElems : 1];
    };
    struct __align__(1024) Smem {
        T q[kBoxes][kBoxElems];
        T k[kStages][kBoxes][kKvBoxElems];
        T v[kRawStages][kBoxes][kKvBoxElems];
        union {  // never both: O_i's staging (16-bit) or the tf32 tiles
            T o[kStageO ? kBoxes : 1][kStageO ? kBoxElems : 1];
            Tf32Tiles tf;
        };
    };
    static_assert(HEAD_DIM == 64 || HEAD_DIM == 128 || HEAD_DIM == 256, "HEAD_DIM: 64, 128 or 256");
    static_assert(!SPLIT || (kTf32 && HEAD_DIM != 256), "SPLIT: float32, HEAD_DIM 64 or 128");
};

// acc (64 x D) += P̃ (64 x k of k step kk, in registers) · V (k x D): 16-bit V MN-major (the
// next 64 columns `box` bytes on), D = 256 as two products of 128 columns; tf32 Vᵀ K-major
// (D = 256: its rows 128 … 16 KB on in its box)
template <typename T, int D>
__device__ __forceinline__ void wgmma_pv(float (&acc)[D / 2], const unsigned (&a)[4],
                                         unsigned long long v_desc, unsigned box) {
    if constexpr (sizeof(T) == 4) {
        if constexpr (D == 64) {
            sm90::wgmma_m64n64k8_rs_tf32(acc, a, v_desc, 1);
        } else if constexpr (D == 128) {
            sm90::wgmma_m64n128k8_rs_tf32(acc, a, v_desc, 1);
        } else {
            sm90::wgmma_m64n128k8_rs_tf32(reinterpret_cast<float(&)[64]>(acc[0]), a, v_desc, 1);
            sm90::wgmma_m64n128k8_rs_tf32(reinterpret_cast<float(&)[64]>(acc[64]), a,
                                          v_desc + (128 * 128 >> 4), 1);
        }
    } else if constexpr (D == 64) {
        sm90::wgmma_m64n64k16_rs<T>(acc, a, v_desc, 1);
    } else if constexpr (D == 128) {
        sm90::wgmma_m64n128k16_rs<T>(acc, a, v_desc, 1);
    } else {
        sm90::wgmma_m64n128k16_rs<T>(reinterpret_cast<float(&)[64]>(acc[0]), a, v_desc, 1);
        sm90::wgmma_m64n128k16_rs<T>(reinterpret_cast<float(&)[64]>(acc[64]), a,
                                     v_desc + 2 * (box >> 4), 1);
    }
}

// acc (64 x N) = Q (64 x k of k step kk) · K (k x N), both K-major: N = 128 or 64 (tf32: 64
// or 32)
template <typename T, int N>
__device__ __forceinline__ void wgmma_s(float (&acc)[N / 2], unsigned long long q_desc,
                                        unsigned long long k_desc, int scale_d) {
    if constexpr (sizeof(T) == 4 && N == 32) sm90::wgmma_m64n32k8_ss_tf32(acc, q_desc, k_desc, scale_d);
    else if constexpr (sizeof(T) == 4) sm90::wgmma_m64n64k8_ss_tf32(acc, q_desc, k_desc, scale_d);
    else if constexpr (N == 128) sm90::wgmma_m64n128k16_ss<T>(acc, q_desc, k_desc, scale_d);
    else sm90::wgmma_m64n64k16_ss<T>(acc, q_desc, k_desc, scale_d);
}

// Two of a thread's O values, row-adjacent columns, to memory in T
template <typename T> __device__ __forceinline__ void store_pair(T* p, float a, float b) {
    if constexpr (sizeof(T) == 4) *reinterpret_cast<float2*>(p) = make_float2(a, b);
    else *reinterpret_cast<unsigned*>(p) = pack2<T>(a, b);
}

// tf32: x rounded to tf32 (hi), and the rest rounded (lo: x − hi is exact in fp32)
__device__ __forceinline__ float tf32_hi(float x) { return __uint_as_float(to_tf32(x)); }
__device__ __forceinline__ float tf32_lo(float x, float hi) { return tf32_hi(x - hi); }

// tf32: the N floats at p rounded to tf32 in place, with LO their lo parts to `lo` at the same
// offsets (16-byte chunks; the swizzle moves chunks within rows, so any layout), by `threads`
// threads from `tid`. wgmma would read their upper 19 bits as they are: truncated, twice the
// rounding's error
template <int N, bool LO>
__device__ __forceinline__ void round_to_tf32(float* p, float* lo, int tid, int threads) {
    for (int i = 4 * tid; i < N; i += 4 * threads) {
        const float4 x = *reinterpret_cast<float4*>(p + i);
        const float4 h = make_float4(tf32_hi(x.x), tf32_hi(x.y), tf32_hi(x.z), tf32_hi(x.w));
        *reinterpret_cast<float4*>(p + i) = h;
        if constexpr (LO)
            *reinterpret_cast<float4*>(lo + i) = make_float4(tf32_lo(x.x, h.x), tf32_lo(x.y, h.y),
                                                             tf32_lo(x.z, h.z), tf32_lo(x.w, h.w));
    }
}

// tf32: V_j (kBlockN keys × D, as its TMA boxes left it: 32-float rows, 16-byte chunk c of row r
// at chunk c ^ (r % 8)) into V_jᵀ, wgmma's K-major B of P̃ V_j (per 32 keys a box of D rows × 32
// keys, the same swizzle), rounded to tf32 (split: the lo parts into vt_lo), by `threads`
// threads from `tid`. Within each 8 keys, key 2i goes to position i and key 2i + 1 to i + 4:
// the order in which a thread's accumulators of S (columns 2t, 2t + 1) become the k indices
// t, t + 4 of tf32's A fragment
template <typename Tr, int D>
__device__ __forceinline__ void transpose_v(const float (*v)[Tr::kKvBoxElems],
                                            float (*vt)[Tr::kVtBoxElems],
                                            float (*vt_lo)[Tr::kSplit ? Tr::kVtBoxElems : 1],
                                            int tid, int threads) {
    constexpr int kQuads = D / 4, kChunks = Tr::kBlockN * kQuads;
    for (int ci = tid; ci < kChunks; ci += threads) {
        const int r = ci / kQuads, c = ci % kQuads / 8, q = ci % 8;
        const float4 x = *reinterpret_cast<const float4*>(v[c] + r * 32 + (q ^ (r % 8)) * 4);
        const int kp = r % 32, p = (kp & ~7) + (kp % 8) / 2 + 4 * (kp % 2);
        const float e[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int d = 32 * c + 4 * q + i, at = d * 32 + ((p / 4) ^ (d % 8)) * 4 + p % 4;
            const float hi = tf32_hi(e[i]);
            vt[r / 32][at] = hi;
            if constexpr (Tr::kSplit) vt_lo[r / 32][at] = tf32_lo(e[i], hi);
        }
    }
}

}  // namespace

template <typename T, int HEAD_DIM, bool VARLEN, bool SPLIT = false>
__global__ void __launch_bounds__(Sm90FwdTraits<T, HEAD_DIM, SPLIT>::kThreads, 1)
flash_fwd_sm90_kernel(const __grid_constant__ sm90::TensorMap map_q,
                      const __grid_constant__ sm90::TensorMap map_k,
                      const __grid_constant__ sm90::TensorMap map_v,
                      const __grid_constant__ sm90::TensorMap map_o,
                      T* __restrict__ o, float* __restrict__ lse,
                      const int* __restrict__ cu_q, const int* __restrict__ cu_k,
                      const int* __restrict__ used_k, const int* __restrict__ block_table,
                      int table_stride, int page_size, int H, int group, int Nq, int Nk,
                      float scale, int causal, int num_m_blocks, int num_tiles,
                      int num_splits, long long split_stride, float* __restrict__ o_part,
                      CUFLASH_VARIANT_PARAMS(T)) {
    using Tr = Sm90FwdTraits<T, HEAD_DIM, SPLIT>;
    constexpr int BM = Tr::kBlockM, BN = Tr::kBlockN, STAGES = Tr::kStages;
    constexpr int PRODUCER = Tr::kConsumers;           // the producer's warpgroup
    constexpr int CONSUMERS = Tr::kConsumerThreads;    // the consumers' threads, before it
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    auto& sm = *reinterpret_cast<typename Tr::Smem*>(smem_raw);
    __shared__ __align__(8) unsigned long long q_full, q_empty;
    // K_j and V_j in rings of their own: K_j's slot is freed as soon as S_j has retired,
    // before the softmax, so the producer loads K_{j+2} under it (one ring for both held
    // K_j's slot until P̃_j V_j had retired, and the next load came just in time)
    // float32: the producer's other warps round K_j in place (ring_kr: rounded) and write
    // V_jᵀ from V_j (ring_v feeds them, they fill ring_vt)
    __shared__ sm90::Ring<STAGES> ring_k, ring_kr, ring_vt;
    __shared__ sm90::Ring<Tr::kRawStages> ring_v;
    const int warpgroup = sm90::warpgroup_index();

    Variants<T> var = CUFLASH_VARIANTS(T);
    // Tile `tile` of the walk: its first query row, (b, h), its split, its sequence's mask
    // (lengths), first rows and batch coordinates in q and k, its row 0 in o and lse, and
    // the key tiles [j0, j1) any of its rows sees (causal, a window: from its first row's
    // left edge to its last row's diagonal) within its split's share; skip: its rows start
    // past its sequence's end
    struct Tile {
        int m0, b, h, split, q_row0, k_row0, tb, tbk, j0, j1;
        long long row0;
        bool skip;
        CausalMask mask;
    };
    auto tile_at = [&](int tile) {
        const int m = tile % num_m_blocks, rest = tile / num_m_blocks;
        const int bh = rest / num_splits;  // bh = b·H + h
        Tile x;
        x.split = rest % num_splits;
        x.m0 = (causal || var.win_right >= 0 ? num_m_blocks - 1 - m : m) * BM;
        x.b = bh / H;
        x.h = bh % H;
        x.q_row0 = VARLEN && cu_q ? cu_q[x.b] : 0;
        x.k_row0 = VARLEN && cu_k ? cu_k[x.b] : 0;
        x.tb = VARLEN && cu_q ? 0 : x.b;
        x.tbk = VARLEN && cu_k ? 0 : x.b;
        x.row0 = ((long long)x.tb * H + x.h) * Nq + x.q_row0;
        x.mask = CausalMask{VARLEN && cu_q ? cu_q[x.b + 1] - x.q_row0 : Nq,
                            VARLEN && used_k ? used_k[x.b]
                                             : VARLEN && cu_k ? cu_k[x.b + 1] - x.k_row0 : Nk,
                            causal != 0, var.win_left, var.win_right};
        x.skip = x.m0 >= x.mask.Nq;
        int n_begin = x.mask.key_begin(x.m0), n_end = x.mask.key_end(x.m0 + BM);
        clip_to_split(x.split, num_splits, x.mask.Nk, BN, n_begin, n_end);
        x.j0 = n_begin / BN;
        x.j1 = n_end > n_begin ? (n_end + BN - 1) / BN : x.j0;
        return x;
    };

    if (threadIdx.x == CONSUMERS) {  // the producer's first thread, while thread 0 sets the barriers
        sm90::prefetch_tensormaps(map_q, map_k, map_v);
        if (Tr::kStageO && !VARLEN) sm90::prefetch_tensormaps(map_o);
    }
    if (threadIdx.x == 0) {
        sm90::mbar_init(&q_full, 1);
        sm90::mbar_init(&q_empty, CONSUMERS);
        ring_k.init(CONSUMERS);
        ring_v.init(Tr::kTf32 ? Tr::kTransposers : CONSUMERS);
        if (Tr::kTf32) {
            ring_kr.init(CONSUMERS, Tr::kTransposers);  // its "empty" side unused: ring_k's serves
            ring_vt.init(CONSUMERS, Tr::kTransposers);
        }
        sm90::mbar_init_fence();
    }
    __syncthreads();

    if (warpgroup == PRODUCER) {  // gives registers up (the warps that write V_jᵀ walk the tiles too)
        sm90::regs_dec<Tr::kProducerRegs>();
        if (threadIdx.x / 32 == 4 * PRODUCER && sm90::elect_one()) {
            int it = 0;  // key tiles loaded so far: the rings' slot and phase
            int n = 0;   // tiles loaded so far: q_empty's phase
            for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
                const Tile x = tile_at(tile);
                if (x.skip) continue;
                if (n++ > 0) sm90::mbar_wait(&q_empty, (n - 2) & 1);
                sm90::mbar_arrive_expect_tx(&q_full, Tr::kBoxes * Tr::kBoxBytes);
                for (int c = 0; c < Tr::kBoxes; ++c)
                    sm90::tma_load_4d(sm.q[c], map_q, Tr::kBoxCols * c, x.q_row0 + x.m0, x.h, x.tb,
                                      &q_full);
                // the key tiles a block mask leaves non-empty (all of them without one)
                for (int j = var.template next_tile<BM, BN>(x.b, x.h, x.m0, x.j0, x.j1); j < x.j1;
                     j = var.template next_tile<BM, BN>(x.b, x.h, x.m0, j + 1, x.j1), ++it) {
                    const int s = it % STAGES, sv = it % Tr::kRawStages;
                    int row = x.k_row0 + j * BN, kb = x.tbk;  // the tile's rows in k and v
                    if (VARLEN && block_table) {  // its page
                        kb = block_table[(long long)x.b * table_stride + j * BN / page_size];
                        row = j * BN % page_size;
                    }
                    auto* full_k = ring_k.acquire(it, Tr::kBoxes * Tr::kKvBoxBytes);
                    for (int c = 0; c < Tr::kBoxes; ++c)
                        sm90::tma_load_4d(sm.k[s][c], map_k, Tr::kBoxCols * c, row, x.h / group, kb,
                                          full_k);
                    auto* full_v = ring_v.acquire(it, Tr::kBoxes * Tr::kKvBoxBytes);
                    for (int c = 0; c < Tr::kBoxes; ++c)
                        sm90::tma_load_4d(sm.v[sv][c], map_v, Tr::kBoxCols * c, row, x.h / group, kb,
                                          full_v);
                }
            }
        } else if constexpr (Tr::kTf32) {
            if (threadIdx.x >= CONSUMERS + 32) {  // K_j rounded, V_j into V_jᵀ, as they land
                const int tid = threadIdx.x - CONSUMERS - 32;
                int it = 0;
                for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
                    const Tile x = tile_at(tile);
                    if (x.skip) continue;
                    const int j0 = var.template next_tile<BM, BN>(x.b, x.h, x.m0, x.j0, x.j1);
                    const int tiles = var.template count_tiles<BM, BN>(x.b, x.h, x.m0, j0, x.j1);
                    for (int j = 0; j < tiles; ++j, ++it) {
                        ring_k.wait(it);
                        round_to_tf32<Tr::kBoxes * Tr::kKvBoxElems, SPLIT>(
                            sm.k[it % STAGES][0], SPLIT ? sm.tf.k_lo[it % STAGES][0] : nullptr,
                            tid, Tr::kTransposers);
                        sm90::fence_proxy_async();  // the writes, before wgmma reads them
                        ring_kr.fill(it);
                        ring_v.wait(it);
                        ring_vt.wait_free(it);
                        transpose_v<Tr, HEAD_DIM>(sm.v[it % Tr::kRawStages], sm.tf.vt[it % STAGES],
                                                  sm.tf.vt_lo[SPLIT ? it % STAGES : 0], tid,
                                                  Tr::kTransposers);
                        sm90::fence_proxy_async();
                        ring_v.release(it);
                        ring_vt.fill(it);
                    }
                }
            }
        }
        return;
    }

    // -- the consumers: warp w of warpgroup wg owns rows 64 wg + 16 w .. of the block; a
    // thread rows g and g + 8 of those (accumulator i: n-tile i / 4, row + 8 for i % 4 ≥ 2,
    // column 8 (i / 4) + 2t + i % 2: mma.sync's C fragments side by side)
    sm90::regs_inc<Tr::kConsumerRegs>();
    const int lane = threadIdx.x % 32, g = lane >> 2, t = lane % 4;
    const int row = (threadIdx.x / 32 % 4) * 16 + g;   // the thread's rows in the warpgroup's 64
    const float c = softmax_scale_log2(scale);
    int m0 = 0, r_top = 0;  // the tile's first row, the thread's top row
    int tile_b = 0, tile_h = 0;  // its batch and head, for the variants
    CausalMask mask{Nq, Nk, causal != 0, var.win_left, var.win_right};  // its sequence's
    const bool scores = var.scores(), dropout = var.dropout();
    int full_lo = 0, full_hi = 0;  // the key tiles every row of the tile sees whole
    OnlineSoftmax<float> top, bottom;
    float acc[Tr::kOAcc];

    // S = Q_i K_jᵀ of tile j in slot s, issued (k steps along D, 32 bytes each in a box;
    // the next box one box on)
    constexpr int kS = Tr::kS, kK = Tr::kK;
    float sc[kS];
    // The operands' descriptors, made once: a ring slot, a box and a k step move the start
    // address field by constants (the tiles stay within shared memory's 256 KB: no carry)
    constexpr unsigned kSlotDesc = Tr::kBoxes * Tr::kKvBoxBytes >> 4, kBoxDesc = Tr::kKvBoxBytes >> 4;
    constexpr unsigned kVtBoxDesc = HEAD_DIM * 128 >> 4, kVtSlotDesc = Tr::kVtBoxes * kVtBoxDesc;
    const unsigned long long q_desc =
        sm90::desc_k_major_sw128(sm.q[0] + warpgroup * 64 * Tr::kBoxCols);
    const unsigned long long k_desc = sm90::desc_k_major_sw128(sm.k[0][0]);
    const unsigned long long v_desc = Tr::kTf32 ? sm90::desc_k_major_sw128(sm.tf.vt[0][0])
                                                : sm90::desc_mn_major_sw128(sm.v[0][0], Tr::kKvBoxBytes);
    // split: the lo parts' tiles, laid out as their hi parts' (the same offsets from each)
    const unsigned long long q_lo_desc =
        SPLIT ? sm90::desc_k_major_sw128(sm.tf.q_lo[0] + warpgroup * 64 * Tr::kBoxCols) : 0;
    const unsigned long long k_lo_desc = SPLIT ? sm90::desc_k_major_sw128(sm.tf.k_lo[0][0]) : 0;
    const unsigned long long v_lo_desc = SPLIT ? sm90::desc_k_major_sw128(sm.tf.vt_lo[0][0]) : 0;
    // Q_i's, the same at every step: held up to 8 (16 would spill: 16-bit D = 256, tf32 128)
    constexpr int kQSteps = HEAD_DIM / kK;
    unsigned long long q_descs[kQSteps];
    sm90::k_step_descs<kQSteps <= 8>(q_descs, q_desc, Tr::kBoxBytes >> 4);
    // K_j's (or its lo part's) descriptor of slot s, k step kk
    auto k_step = [&](unsigned long long desc, int s, int kk) {
        return desc + s * kSlotDesc + (kk / 4) * kBoxDesc + 2 * (kk % 4);
    };
    auto issue_s = [&](int s) {
#pragma unroll
        for (int kk = 0; kk < kQSteps; ++kk) {
            if constexpr (SPLIT) {  // the small products first: hi·lo, lo·hi, then hi·hi
                wgmma_s<T, BN>(sc, q_descs[kk], k_step(k_lo_desc, s, kk), kk > 0);
                wgmma_s<T, BN>(sc, q_lo_desc + (kk / 4) * (Tr::kBoxBytes >> 4) + 2 * (kk % 4),
                               k_step(k_desc, s, kk), 1);
                wgmma_s<T, BN>(sc, q_descs[kk], k_step(k_desc, s, kk), 1);
            } else {
                wgmma_s<T, BN>(sc, q_descs[kk], k_step(k_desc, s, kk), kk > 0);
            }
        }
        sm90::wgmma_commit();
    };
    // acc += P̃ V_j of the tile in slot s, issued: k step kk takes keys k·kk .. as the A
    // fragment and 16-bit V_j's rows 16kk .. (2048 bytes on), MN-major, the next box one box
    // on (LBO); or tf32 V_jᵀ's 8 keys 32 bytes on in its box of 32, K-major
    unsigned pa[BN / kK][4], pa_lo[SPLIT ? BN / kK : 1][4];  // P̃ (split: its lo part)
    // V_j's (tf32: V_jᵀ's or its lo part's) descriptor of slot s, k step kk
    auto v_step = [&](unsigned long long desc, int s, int kk) {
        if constexpr (Tr::kTf32) return desc + s * kVtSlotDesc + (kk / 4) * kVtBoxDesc + 2 * (kk % 4);
        else return desc + s * kSlotDesc + 128 * kk;
    };
    auto issue_pv = [&](int s) {
#pragma unroll
        for (int kk = 0; kk < BN / kK; ++kk) {
            if constexpr (SPLIT) {
                wgmma_pv<T, HEAD_DIM>(acc, pa_lo[kk], v_step(v_desc, s, kk), Tr::kKvBoxBytes);
                wgmma_pv<T, HEAD_DIM>(acc, pa[kk], v_step(v_lo_desc, s, kk), Tr::kKvBoxBytes);
            }
            wgmma_pv<T, HEAD_DIM>(acc, pa[kk], v_step(v_desc, s, kk), Tr::kKvBoxBytes);
        }
        sm90::wgmma_commit();
    };
    // The online softmax of tile j's S: masked keys −inf (past Nk, outside a row's causal
    // or window reach), or with variants each score through their chain (variants.cuh, in
    // natural units and back: rows past Nq −inf, so no bias or mask is read there); the row
    // max of S, scaled; P̃ = exp2(S·c − m_new) in place, dropped out for P̃ V; returns α
    auto softmax = [&](int j, float& alpha_top, float& alpha_bottom) {
        const int n0 = j * BN;
        var.enter_tile(var.template tile_kind<BM, BN>(tile_b, tile_h, m0, n0));
        if (scores) {  // the chain inlined once: a rolled loop takes score e from sc[0]
            var.bind(tile_b, tile_h, mask.Nq, mask.Nk);
            const float inv_c = 1.f / c;  // back from log2 units to S's
#pragma unroll 1
            for (int e = 0; e < kS; ++e) {
                const int col = n0 + 8 * (e / 4) + 2 * t + e % 2, r = r_top + (e % 4 >= 2 ? 8 : 0);
                rotate(sc, variant_score(var, mask, sc[0], scale, r, col) * inv_c);
            }
        } else if (j < full_lo || j >= full_hi) {
#pragma unroll
            for (int i = 0; i < kS; ++i) {
                const int col = n0 + 8 * (i / 4) + 2 * t + i % 2;
                if (mask.masked(r_top + (i % 4 >= 2 ? 8 : 0), col)) sc[i] = neg_inf<float>();
            }
        }
        float max_top = max_(sc[0], sc[1]), max_bottom = max_(sc[2], sc[3]);
#pragma unroll
        for (int i = 4; i < kS; i += 4) {
            max_top = max_(max_top, max_(sc[i], sc[i + 1]));
            max_bottom = max_(max_bottom, max_(sc[i + 2], sc[i + 3]));
        }
        alpha_top = top.update(warp_reduce_max<4>(max_top) * c);
        alpha_bottom = bottom.update(warp_reduce_max<4>(max_bottom) * c);
        const float shift_top = top.shift(), shift_bottom = bottom.shift();
        float sum_top = 0.f, sum_bottom = 0.f;
#pragma unroll
        for (int i = 0; i < kS; i += 4) {
            sc[i] = fast_exp2(fmaf(sc[i], c, -shift_top));
            sc[i + 1] = fast_exp2(fmaf(sc[i + 1], c, -shift_top));
            sc[i + 2] = fast_exp2(fmaf(sc[i + 2], c, -shift_bottom));
            sc[i + 3] = fast_exp2(fmaf(sc[i + 3], c, -shift_bottom));
            sum_top += sc[i] + sc[i + 1];
            sum_bottom += sc[i + 2] + sc[i + 3];
        }
        top.l_i += sum_top;  // ℓ sums the undropped P̃: lse is the pre-dropout one
        bottom.l_i += sum_bottom;
        if (dropout) {  // keep bits first (Philox inlined once: a rolled loop), then P̃
            var.bind(tile_b, tile_h, mask.Nq, mask.Nk);
            unsigned long long keep = 0;
#pragma unroll 1
            for (int e = 0; e < kS / 2; ++e)  // a row's pair of columns (scores 2e, 2e + 1)
                keep |= (unsigned long long)var.keep_pair(r_top + (e % 2) * 8, n0 + 8 * (e / 2) + 2 * t)
                        << (2 * e);
#pragma unroll
            for (int i = 0; i < kS; ++i) sc[i] = (keep >> i) & 1u ? sc[i] * var.keep_scale : 0.f;
        }
    };
    // P̃ to 16 bits, or to tf32 (columns 2t, 2t + 1 as k indices t, t + 4: V_jᵀ's order),
    // all of the tile: a wgmma owns its A registers until the wait that retires it, so none
    // may be written while the previous P̃ V still runs. tf32: half a unit of its last place
    // added, which wgmma's truncation makes a rounding to nearest, ties away (cvt.rna's, in
    // one add instead of four: P̃ lies in [0, 1]; a NaN, which the add may turn into a tiny
    // number, reaches O through ℓ)
    auto pack = [&]() {
#pragma unroll
        for (int kk = 0; kk < BN / kK; ++kk)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                if constexpr (SPLIT) {  // hi rounded by the add and a mask, lo by the add
                    const float p = sc[4 * kk + (r % 2) * 2 + r / 2];
                    pa[kk][r] = (__float_as_uint(p) + 0x1000u) & 0xffffe000u;
                    pa_lo[kk][r] = __float_as_uint(p - __uint_as_float(pa[kk][r])) + 0x1000u;
                } else if constexpr (Tr::kTf32)
                    pa[kk][r] = __float_as_uint(sc[4 * kk + (r % 2) * 2 + r / 2]) + 0x1000u;
                else
                    pa[kk][r] = pack2<T>(sc[8 * kk + 2 * r], sc[8 * kk + 2 * r + 1]);
            }
    };

    // -- the two consumers take turns to issue their products (FlashAttention-3's ping-pong):
    // a warpgroup waits for its named barrier (1 + its index), issues, then lets the other
    // go; so one's products run while the other's softmax does. Warpgroup 1 lets 0 start.
    // One consumer (kNarrow) issues when it is ready
    auto my_turn = [&] {
        if constexpr (Tr::kConsumers == 2) sm90::bar_sync(1 + warpgroup, 256);
    };
    auto your_turn = [&] {
        if constexpr (Tr::kConsumers == 2) sm90::bar_arrive(2 - warpgroup, 256);
    };
    if (warpgroup == 1) your_turn();

    // -- the pipeline within the warpgroup (FlashAttention-3): the softmax of tile j runs
    // while P̃_{j−1} V_{j−1} does; S_j first, then acc *= α_j once that product retired.
    // K_j is read by S_j and freed once it retired (before the softmax), V_j (tf32: V_jᵀ) by
    // the P̃ V of the next iteration and freed after it
    auto& ring_a = Tr::kTf32 ? ring_kr : ring_k;  // the rings the products wait for: K_j
    auto& ring_b = *[&] {                         // and V_j (tf32: rounded, V_jᵀ)
        if constexpr (Tr::kTf32) return &ring_vt;
        else return &ring_v;
    }();
    int it = 0;  // key tiles consumed so far: the rings' slot and phase, as the producer's
    int n = 0;   // tiles run so far: q_full's phase
    for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
        int j0, j1, tiles;  // the first key tile visited, the range's end, the count
        {  // the tile's fields the loop needs, in registers of their own
            const Tile x = tile_at(tile);
            if (x.skip) continue;
            j0 = var.template next_tile<BM, BN>(x.b, x.h, x.m0, x.j0, x.j1);
            j1 = x.j1;
            tiles = var.template count_tiles<BM, BN>(x.b, x.h, x.m0, j0, x.j1);
            m0 = x.m0;
            tile_b = x.b;
            tile_h = x.h;
            mask = x.mask;
        }
        mask.full_tiles(m0, m0 + BM, BN, j0, j1, full_lo, full_hi);
        r_top = m0 + warpgroup * 64 + row;
        top.init();
        bottom.init();
#pragma unroll
        for (int i = 0; i < Tr::kOAcc; ++i) acc[i] = 0.f;
        sm90::mbar_wait(&q_full, n++ & 1);
        if constexpr (Tr::kTf32) {  // the warpgroup's 64 rows of Q_i rounded, in place
            for (int c = 0; c < Tr::kBoxes; ++c)
                round_to_tf32<64 * Tr::kBoxCols, SPLIT>(
                    sm.q[c] + warpgroup * 64 * Tr::kBoxCols,
                    SPLIT ? sm.tf.q_lo[c] + warpgroup * 64 * Tr::kBoxCols : nullptr,
                    threadIdx.x % 128, 128);
            sm90::fence_proxy_async();
            sm90::bar_sync(3 + warpgroup, 128);  // all of them, before its first S
        }
        if (tiles > 0) {
            ring_a.wait(it);
            my_turn();
            sm90::wgmma_fence();
            issue_s(it % STAGES);
            your_turn();
            sm90::wgmma_wait<0>();
            ring_k.release(it);
            float alpha_top, alpha_bottom;  // acc is 0: nothing to rescale
            softmax(j0, alpha_top, alpha_bottom);
            pack();
        }
        // the slots and phases of K_j (step it + j) and V_{j−1} (the step before)
        auto pos_k = ring_k.at(it), pos_v = pos_k;
        for (int j = 1, jt = j0; j < tiles; ++j) {  // the j-th tile visited: key tile jt
            jt = var.template next_tile<BM, BN>(tile_b, tile_h, m0, jt + 1, j1);
            pos_v = pos_k;
            pos_k.advance();
            ring_a.wait(pos_k);
            ring_b.wait(pos_v);
            my_turn();
            sm90::wgmma_fence();
            issue_s(pos_k.slot);    // S_j
            issue_pv(pos_v.slot);   // acc += P̃_{j−1} V_{j−1}
            your_turn();
            sm90::wgmma_wait<1>();  // S_j has landed (groups retire in order): K_j is free
            ring_k.release(pos_k);
            float alpha_top, alpha_bottom;
            softmax(jt, alpha_top, alpha_bottom);
            sm90::wgmma_wait<0>();  // P̃_{j−1} V_{j−1} too: acc and P̃'s registers are free
            ring_b.release(pos_v);
            // acc *= α, skipped by the whole warp when none of its rows' max moved (every α
            // exactly 1: the same bits); late in a long row most key tiles leave it alone
            if (__any_sync(0xffffffffu, alpha_top != 1.f || alpha_bottom != 1.f)) {
#pragma unroll
                for (int i = 0; i < Tr::kOAcc; i += 4) {
                    acc[i] *= alpha_top;
                    acc[i + 1] *= alpha_top;
                    acc[i + 2] *= alpha_bottom;
                    acc[i + 3] *= alpha_bottom;
                }
            }
            pack();
        }
        if (tiles > 0) {  // the last tile's P̃ V
            ring_b.wait(it + tiles - 1);
            my_turn();
            sm90::wgmma_fence();
            issue_pv((it + tiles - 1) % STAGES);
            your_turn();
            sm90::wgmma_wait<0>();
            ring_b.release(it + tiles - 1);
        }
        it += tiles;
        sm90::mbar_arrive(&q_empty);  // every S of the tile has retired: Q_i may go

        // -- epilogue: O_i = acc / ℓ_i (ℓ = 0: a row that saw no key gets 0), lse_i. O goes
        // through the warpgroup's rows of the O buffer, in the boxes' swizzled layout, once
        // the last tile's store has read them, then out by one TMA store per box: rows past
        // Nq are dropped by the store. Packed sequences store from registers: the rows past
        // the sequence's end are the next one's
        top.l_i = warp_reduce_sum<4>(top.l_i);
        bottom.l_i = warp_reduce_sum<4>(bottom.l_i);
        const float inv_top = top.inv_l(), inv_bottom = bottom.inv_l();
        const Tile x = tile_at(tile);  // its head and batch again: no registers held over the loop
        const long long row0 = x.split * split_stride + x.row0;  // its rows in lse (o_part)
        if (o_part) {  // a split's O_i, in float from registers, for the merge
#pragma unroll
            for (int i = 0; i < Tr::kOAcc; i += 4) {
                const int col = 8 * (i / 4) + 2 * t;
                if (r_top < mask.Nq)
                    *reinterpret_cast<float2*>(o_part + (row0 + r_top) * HEAD_DIM + col) =
                        make_float2(acc[i] * inv_top, acc[i + 1] * inv_top);
                if (r_top + 8 < mask.Nq)
                    *reinterpret_cast<float2*>(o_part + (row0 + r_top + 8) * HEAD_DIM + col) =
                        make_float2(acc[i + 2] * inv_bottom, acc[i + 3] * inv_bottom);
            }
        } else if constexpr (VARLEN || !Tr::kStageO) {
#pragma unroll
            for (int i = 0; i < Tr::kOAcc; i += 4) {
                const int col = 8 * (i / 4) + 2 * t;
                if (r_top < mask.Nq)
                    store_pair(o + (x.row0 + r_top) * HEAD_DIM + col, acc[i] * inv_top,
                               acc[i + 1] * inv_top);
                if (r_top + 8 < mask.Nq)
                    store_pair(o + (x.row0 + r_top + 8) * HEAD_DIM + col,
                               acc[i + 2] * inv_bottom, acc[i + 3] * inv_bottom);
            }
        } else {
            if (threadIdx.x % 128 == 0) sm90::bulk_wait_read();
            sm90::bar_sync(3 + warpgroup, 128);  // the O buffer's rows are free
#pragma unroll
            for (int i = 0; i < Tr::kOAcc; i += 4) {
                const int col = 8 * (i / 4) + 2 * t, box = col / 64;
                unsigned char* rows = reinterpret_cast<unsigned char*>(sm.o[box] + warpgroup * 64 * 64);
                // 128-byte rows, 16-byte chunk c of row r at chunk c ^ (r % 8)
                auto at = [&](int r) {
                    return rows + r * 128 + (((col % 64) / 8) ^ (r % 8)) * 16 + (col % 8) * 2;
                };
                *reinterpret_cast<unsigned*>(at(row)) = pack2<T>(acc[i] * inv_top, acc[i + 1] * inv_top);
                *reinterpret_cast<unsigned*>(at(row + 8)) =
                    pack2<T>(acc[i + 2] * inv_bottom, acc[i + 3] * inv_bottom);
            }
            sm90::fence_proxy_async();
            sm90::bar_sync(3 + warpgroup, 128);  // the warpgroup's writes all made
            if (threadIdx.x % 128 == 0) {
                for (int b = 0; b < Tr::kBoxes; ++b)
                    sm90::tma_store_4d(map_o, 64 * b, m0 + warpgroup * 64, x.h, x.b,
                                       sm.o[b] + warpgroup * 64 * 64);
                sm90::bulk_commit();
            }
        }
        if (t == 0) {
            if (r_top < mask.Nq) lse[row0 + r_top] = top.lse();
            if (r_top + 8 < mask.Nq) lse[row0 + r_top + 8] = bottom.lse();
        }
    }
    if (warpgroup == 0) my_turn();  // warpgroup 1's last turn, passed to no one
    if (threadIdx.x % 128 == 0) sm90::bulk_wait_read();  // the block's shared memory outlives the stores
}
