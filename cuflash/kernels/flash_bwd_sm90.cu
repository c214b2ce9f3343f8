// flash_bwd_sm90.cu — the FlashAttention backward's dK, dV on Hopper's asynchronous machinery
// (sm_90a): TMA, mbarriers, warp specialization and wgmma, FlashAttention-3's structure.
//
// A block takes 128 keys K_j, V_j of one (K/V head, batch) and walks the query blocks of
// 64 rows i of every query head of its group that see a key of the block (causal, a
// sliding window: from the first row whose reach gets there to the last whose window's
// left edge does), accumulating dK_j and dV_j in registers; then, where the grid has fewer
// blocks than key blocks, its next key block, gridDim.x on:
//
//   warpgroup 2 (producer)   gives its registers up; one elected thread loads K_j, V_j once
//                            the consumers are done with the last (kv_empty), then per
//                            query block i: waits until the consumers freed the ring slot
//                            (empty), announces the bytes and starts the TMA boxes of Q_i
//                            and dO_i (full)
//   warpgroups 0, 1          take the registers; each owns 64 of the block's 128 keys.
//   (consumers)              Per query block i (Algorithm 2, lines 11-21, transposed: keys
//                            are the rows of every product):
//                              Sᵀ = K_j Q_iᵀ, dPᵀ = V_j dO_iᵀ   wgmma m64n64k16, both from
//                                                               shared memory
//                              Pᵀ = exp2(Sᵀ·c − lse_i·log2 e), dSᵀ = Pᵀ ∘ (dPᵀ − D_i)
//                                                               on the accumulators
//                              dV_j += Pᵀ dO_i, dK_j += dSᵀ Q_i wgmma m64nDk16: Pᵀ, dSᵀ from
//                                                               registers (packed to 16
//                                                               bits), dO_i, Q_i MN-major
//                            then free the slot (empty); at the end dK_j *= scale, and both
//                            go out from registers.
//
// dQ is the second kernel's (flash_bwd_dq_sm90_kernel): a block takes 128 query rows Q_i, dO_i
// of one (head, batch), loaded once, and walks the key tiles of 64 that its rows see (from
// its first row's window edge to its last row's reach):
//
//   warpgroup 2 (producer)   loads Q_i, dO_i once, then K_j, V_j per key tile into a ring
//   warpgroups 0, 1          64 rows each: S = Q_i K_jᵀ, dP = dO_i V_jᵀ (wgmma m64n64k16,
//   (consumers)              shared memory), P = exp2(S·c − lse·log2 e), dS = P ∘ (dP − D),
//                            dQ_i += dS K_j (wgmma m64nDk16: dS from registers, K_j
//                            MN-major); at the end dQ_i · scale goes out from registers.
//
// Seven GEMMs per block of scores in all, each sum in one block in a fixed order. Or five
// (DQ_PARTS, the default where it applies): the dK/dV pass also adds dQ's parts into
// float32 partials by bulk reduce-adds, one partial per warpgroup of a block, each taking
// its key blocks' parts in order, and flash_bwd_dq_sum_sm90_kernel sums the partials in
// order (deterministic=False: every block adds into one). Bitwise deterministic either
// way, but for deterministic=False's dQ. D = rowsum(dO ∘ O) comes from flash_bwd.cu's
// preprocess.
//
// Layout: q, k, v, do (B, H, N, D) in T (float16 or bfloat16) with strides TMA reads (as
// flash_fwd_sm90.cu's), 4-D maps (D, N, H, B): K and V in boxes of 64 columns × 128 rows,
// Q and dO in boxes of 64 columns × 64 rows, 128-byte swizzle; rows past a sequence's end
// come in as zeros and are masked (the dQ kernel: Q, dO in boxes of 128 rows, K, V of 64).
// lse, D (B, Hq, Nq) float32 (the dK/dV kernel reads them by 2-D maps (Nq', B·Hq) of rows
// padded to 16 bytes, 64 at a time); dq, dk, dv contiguous (B, H, N, D) in T. Packed
// sequences (cu_q, cu_k: row offsets, else null): q, k, v, do, o and the gradients (1, H,
// total, D), lse and D (1, Hq, total_q), Nq and Nk the totals; a block of batch row b reads
// its own sequence's rows (the boxes' rows past its end, the next sequence's, are masked)
// and returns at once where its rows start past its sequence's end. Causal and
// the window (left, right; −1: unbounded) are bottom-right aligned (mask.cuh). The other
// variants (softcap, ALiBi, bias, bool mask, dropout) take every score of a step through
// flash_bwd.cu's chain (recompute_p_ds_variants, bwd_tile.cuh), inlined once in a rolled
// loop. dbias = dS before softcap's factor, with no atomics: a bias with its query axis by
// the dQ kernel, each element by the one thread that holds it (the heads or batch rows
// sharing a row of dbias take one launch each, in stream order: head0, batch0); a bias
// broadcast over query rows by the dK/dV kernel, as column sums over each query head's
// rows (cols[b, h, j] += Σ_i dS_ij, by the block that owns key j).
#include "bwd_tile.cuh"
#include "common.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "sm90.cuh"
#include "variants.cuh"

using namespace cuflash;

namespace {

// The tile and its shared memory: K_j, V_j (128 rows), and the Q_i, dO_i ring (64 rows), each
// as D / 64 boxes of 64 columns (on 1024-byte boundaries as the 128-byte swizzle needs).
// DQ_PARTS: each warpgroup's dSᵀ also goes to shared memory (`ds`: its 64 keys × the
// block's 64 queries, 128-byte rows, the 128-byte swizzle), from which it computes its part
// of dQ_i = dS K_j (wgmma, both operands MN-major), stores it to `dq` in its accumulators'
// order (float4 c of thread x at c · 128 + x: no bank conflict) and adds it to a float32
// partial laid out in that order, 64 queries × D a tile, by one bulk reduce-add.
template <typename T, int HEAD_DIM, bool DQ_PARTS = false> struct Sm90BwdTraits {
    static constexpr int kBlockN = 128, kBlockM = 64, kStages = 2;
    static constexpr int kBoxes = HEAD_DIM / 64;
    static constexpr int kKvBoxElems = 128 * 64, kQBoxElems = 64 * 64;
    static constexpr unsigned kKvBoxBytes = kKvBoxElems * 2, kQBoxBytes = kQBoxElems * 2;
    static constexpr int kThreads = 384;
    static constexpr int kAcc = HEAD_DIM / 2;  // a consumer thread's accumulators of 64 x D
    // setmaxnreg: the producer's registers and the consumers' (128 · 24 + 256 · 240 is the
    // block's 384 · 168). DQ_PARTS' producer, which walks key blocks, spilled in 24 under
    // CUDA 13.5
    static constexpr int kProducerRegs = DQ_PARTS ? 32 : 24, kConsumerRegs = DQ_PARTS ? 232 : 240;
    struct __align__(1024) Smem {
        T k[kBoxes][kKvBoxElems];
        T v[kBoxes][kKvBoxElems];
        T q[kStages][kBoxes][kQBoxElems];
        T dout[kStages][kBoxes][kQBoxElems];
        float lse2[kStages][kBlockM];   // the query block's lse_log2(lse) (made on the host)
                                        // and D, with its Q_i and dO_i
        float dsum[kStages][kBlockM];
        alignas(1024) T ds[DQ_PARTS ? 2 : 1][DQ_PARTS ? 64 * 64 : 1];
        float4 dq[DQ_PARTS ? 2 : 1][DQ_PARTS ? HEAD_DIM / 4 * 64 : 1];
    };
    static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "HEAD_DIM: 64 or 128");

};

// The dK/dV pass's steps in order, query block i of [i_begin, i_end) of query head hq, one
// head's blocks after another's: carried from step to step (no division by the range)
struct QueryStep {
    int i, hq, i_begin, i_end;
    __device__ __forceinline__ void advance() {
        if (++i == i_end) {
            i = i_begin;
            ++hq;
        }
    }
};

// The dQ kernel's tile: Q_i and dO_i (128 rows), and the K_j, V_j ring (64 rows).
template <typename T, int HEAD_DIM> struct Sm90BwdDqTraits {
    static constexpr int kBlockM = 128, kBlockN = 64, kStages = 2;
    static constexpr int kBoxes = HEAD_DIM / 64;
    static constexpr int kQBoxElems = 128 * 64, kKvBoxElems = 64 * 64;
    static constexpr unsigned kQBoxBytes = kQBoxElems * 2, kKvBoxBytes = kKvBoxElems * 2;
    static constexpr int kThreads = 384;
    static constexpr int kAcc = HEAD_DIM / 2;
    struct __align__(1024) Smem {
        T q[kBoxes][kQBoxElems];
        T dout[kBoxes][kQBoxElems];
        T k[kStages][kBoxes][kKvBoxElems];
        T v[kStages][kBoxes][kKvBoxElems];
    };
    static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "HEAD_DIM: 64 or 128");
};

// acc (64 x D) += A (64 x 16 of k step kk, in registers) · B (16 x D, MN-major)
template <typename T, int D>
__device__ __forceinline__ void wgmma_rs(float (&acc)[D / 2], const unsigned (&a)[4],
                                         unsigned long long b_desc) {
    if constexpr (D == 64) sm90::wgmma_m64n64k16_rs<T>(acc, a, b_desc, 1);
    else sm90::wgmma_m64n128k16_rs<T>(acc, a, b_desc, 1);
}

}  // namespace

template <typename T, int HEAD_DIM, bool DQ_PARTS = false>
__global__ void __launch_bounds__(384, 1)
flash_bwd_dkdv_sm90_kernel(const __grid_constant__ sm90::TensorMap map_q,
                           const __grid_constant__ sm90::TensorMap map_k,
                           const __grid_constant__ sm90::TensorMap map_v,
                           const __grid_constant__ sm90::TensorMap map_do,
                           const __grid_constant__ sm90::TensorMap map_lse,
                           const __grid_constant__ sm90::TensorMap map_dsum,
                           T* __restrict__ dk, T* __restrict__ dv, float* __restrict__ dq_accum,
                           unsigned part_tiles, float* __restrict__ dbias_cols, int want_dbias_cols,
                           const int* __restrict__ cu_q, const int* __restrict__ cu_k, int Hq,
                           int group, int Nq, int Nk, float scale, int causal,
                           CUFLASH_VARIANT_PARAMS(T)) {
    using Tr = Sm90BwdTraits<T, HEAD_DIM, DQ_PARTS>;
    constexpr int BN = Tr::kBlockN, BM = Tr::kBlockM, STAGES = Tr::kStages;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    auto& sm = *reinterpret_cast<typename Tr::Smem*>(smem_raw);
    __shared__ __align__(8) unsigned long long kv_full, kv_empty;   // K_j, V_j
    __shared__ sm90::Ring<STAGES> ring;  // Q_i, dO_i, lse, D

    const int bh_kv = blockIdx.y;  // bh_kv = b·Hkv + h_kv
    const int Hkv = Hq / group, b = bh_kv / Hkv, h_kv = bh_kv % Hkv;
    // packed: batch row b's first rows and lengths; the tensors' batch coordinate is 0
    const int q_row0 = cu_q ? cu_q[b] : 0, k_row0 = cu_k ? cu_k[b] : 0, tb = cu_q ? 0 : b;
    const long long out0 = ((long long)tb * Hkv + h_kv) * Nk + k_row0;  // dK, dV's row 0
    if (cu_q) {
        Nq = cu_q[b + 1] - q_row0;
        Nk = cu_k[b + 1] - k_row0;
    }
    Variants<T> var = CUFLASH_VARIANTS(T);
    const CausalMask mask{Nq, Nk, causal != 0, var.win_left, var.win_right};
    // The block's key blocks, in order: keys n0 = BN (blockIdx.x + r gridDim.x), r = 0, 1, ..
    // below the sequence's end (one where the grid has a block per key block). Those of
    // K_j's query blocks that see a key of it, for each of the group's query heads:
    // [first, end)
    auto key_block = [](int r) { return (int)(blockIdx.x + r * gridDim.x) * BN; };
    auto query_blocks = [&](int n0) {
        return make_int2(mask.first_row(n0) / BM, (mask.row_end(min(n0 + BN, Nk)) + BM - 1) / BM);
    };
    const int warpgroup = sm90::warpgroup_index();

    if (threadIdx.x == 256) {  // the producer's first thread, while thread 0 sets the barriers
        sm90::prefetch_tensormaps(map_q, map_k, map_v, map_do, map_lse, map_dsum);
    }
    if (threadIdx.x == 0) {
        sm90::mbar_init(&kv_full, 1);
        sm90::mbar_init(&kv_empty, 256);
        ring.init(256);
        sm90::mbar_init_fence();
    }
    __syncthreads();

    if (warpgroup == 2) {  // the producer
        sm90::regs_dec<Tr::kProducerRegs>();
        if (threadIdx.x / 32 == 8 && sm90::elect_one()) {
            // the first rows, read again: held from the start, they took a register the
            // consumers needed
            const int q_row = cu_q ? cu_q[b] : 0, k_row = cu_k ? cu_k[b] : 0;
            int pos = 0;  // tiles loaded
            for (int r = 0, n0; (n0 = key_block(r)) < Nk; ++r) {
                if (r > 0) sm90::mbar_wait(&kv_empty, (r - 1) & 1);   // the last K_j, V_j read
                sm90::mbar_arrive_expect_tx(&kv_full, 2 * Tr::kBoxes * Tr::kKvBoxBytes);
                for (int c = 0; c < Tr::kBoxes; ++c) {
                    sm90::tma_load_4d(sm.k[c], map_k, 64 * c, k_row + n0, h_kv, tb, &kv_full);
                    sm90::tma_load_4d(sm.v[c], map_v, 64 * c, k_row + n0, h_kv, tb, &kv_full);
                }
                const int2 qb = query_blocks(n0);
                const int steps = group * max(0, qb.y - qb.x);
                QueryStep step{qb.x, h_kv * group, qb.x, qb.y};
                for (int it = 0; it < steps; ++it, step.advance()) {
                    const int hq = step.hq, m0 = step.i * BM;
                    if (var.template tile_kind<BM, BN>(b, hq, m0, n0) == kTileEmpty) continue;
                    const int s = pos % STAGES;  // (a block mask's empty tile: not loaded)
                    auto* full = ring.acquire(pos++, 2 * Tr::kBoxes * Tr::kQBoxBytes + 2 * BM * 4);
                    for (int c = 0; c < Tr::kBoxes; ++c) {
                        sm90::tma_load_4d(sm.q[s][c], map_q, 64 * c, q_row + m0, hq, tb, full);
                        sm90::tma_load_4d(sm.dout[s][c], map_do, 64 * c, q_row + m0, hq, tb, full);
                    }
                    sm90::tma_load_2d(sm.lse2[s], map_lse, m0, b * Hq + hq, full);
                    sm90::tma_load_2d(sm.dsum[s], map_dsum, m0, b * Hq + hq, full);
                }
            }
        }
        return;
    }

    // -- the consumers: warp w of warpgroup wg owns keys 64 wg + 16 w .. of the block; a
    // thread keys g and g + 8 of those (accumulator i: n-tile i / 4, key + 8 for i % 4 ≥ 2,
    // column 8 (i / 4) + 2t + i % 2: mma.sync's C fragments side by side)
    sm90::regs_inc<Tr::kConsumerRegs>();
    const bool variants = var.scores() || var.dropout();
    const int lane = threadIdx.x % 32, g = lane >> 2, t = lane % 4;
    const int key_row = warpgroup * 64 + (threadIdx.x / 32 % 4) * 16 + g;   // in K_j
    const float c = softmax_scale_log2(scale);
    const unsigned long long k_desc = sm90::desc_k_major_sw128(sm.k[0] + warpgroup * 64 * 64);
    const unsigned long long v_desc = sm90::desc_k_major_sw128(sm.v[0] + warpgroup * 64 * 64);
    // the ring's descriptors, made once: a slot, a box and a k step move them by constants
    constexpr unsigned kSlotDesc = Tr::kBoxes * Tr::kQBoxBytes >> 4, kBoxDesc = Tr::kQBoxBytes >> 4;
    const unsigned long long q_desc = sm90::desc_k_major_sw128(sm.q[0][0]);
    const unsigned long long do_desc = sm90::desc_k_major_sw128(sm.dout[0][0]);
    const unsigned long long q_mn = sm90::desc_mn_major_sw128(sm.q[0][0], Tr::kQBoxBytes);
    const unsigned long long do_mn = sm90::desc_mn_major_sw128(sm.dout[0][0], Tr::kQBoxBytes);
    float s_t[32], dp_t[32];   // Sᵀ, dPᵀ: the warpgroup's 64 keys × the block's 64 queries
    unsigned pa[BM / 16][4], pds[BM / 16][4];
    // DQ_PARTS: dQ_i's part from the warpgroup's keys (64 queries × D), its dS (A: the
    // warpgroup's dSᵀ, queries along its 128-byte rows) and K_j's rows (B), both MN-major
    float acc_dq[32];   // 64 queries × 64 columns of dQ at a time (unused without DQ_PARTS)
    const unsigned long long ds_desc =
        DQ_PARTS ? sm90::desc_mn_major_sw128(sm.ds[DQ_PARTS ? warpgroup : 0], 0) : 0;
    // its rows: key r's 16-byte chunk n (queries 8n ..) at chunk n ^ (r % 8) (128-byte
    // swizzle). Lane l stores row l % 8 (+ 8 for odd l / 8) of chunks 2kk + l / 16: at
    // ds_row ^ 32kk
    const unsigned ds_rows = sm90::smem(sm.ds[DQ_PARTS ? warpgroup : 0]);
    const int ds_key = (threadIdx.x / 32 % 4) * 16 + lane % 8 + 8 * (lane / 8 % 2);
    const unsigned ds_row = ds_key * 128 + (((lane / 16) ^ (lane % 8)) << 4);
    const unsigned long long k_mn =
        DQ_PARTS ? sm90::desc_mn_major_sw128(sm.k[0] + warpgroup * 64 * 64, Tr::kKvBoxBytes) : 0;
    // DQ_PARTS: the warpgroup's first thread adds its dQ part to tile (b·Hq + hq)·q_tiles + i
    // of its float32 partial, 2 blockIdx.x + warpgroup (part_tiles tiles apart; 0: all add
    // into one), a 32-bit count of tiles (the tiles of 64 x D floats number fewer than 2^31;
    // flash_bwd_dq_sum_sm90 puts them back in rows). A thread of warps 1 and 7, off the
    // producer's SMSP, took 7 instructions more
    const unsigned q_tiles = (unsigned)(Nq + BM - 1) / BM;
    const unsigned head_tiles =
        (2 * blockIdx.x + warpgroup) * part_tiles + (unsigned)b * Hq * q_tiles;
    const bool adder = DQ_PARTS && threadIdx.x % 128 == 0;

    auto pos = ring.at(0);  // the next tile consumed: its slot and phase, as the producer's
    for (int r = 0, n0; (n0 = key_block(r)) < Nk; ++r) {
        const int key_top = n0 + key_row;
        float acc_dk[Tr::kAcc], acc_dv[Tr::kAcc];
#pragma unroll
        for (int i = 0; i < Tr::kAcc; ++i) acc_dk[i] = acc_dv[i] = 0.f;
        // (through a shuffle: ptxas holds them rather than remake them at every step)
        const int2 qb = query_blocks(n0);
        const int first = __shfl_sync(0xffffffffu, qb.x, 0);
        const int end = __shfl_sync(0xffffffffu, qb.y, 0);
        QueryStep step{first, h_kv * group, first, end};
        sm90::mbar_wait(&kv_full, r & 1);
        for (int left = group * max(0, end - first); left > 0; --left, step.advance()) {
            const int m0 = step.i * BM, hq = step.hq;
            const int kind = var.template tile_kind<BM, BN>(b, hq, m0, n0);
            if (kind == kTileEmpty) continue;  // a block mask's empty tile
            var.enter_tile(kind);
            const unsigned s = pos.slot;
            ring.wait(pos);
            sm90::wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < HEAD_DIM / 16; ++kk)  // k16 steps along D: box kk / 4, 32 B each
                sm90::wgmma_m64n64k16_ss<T>(
                    s_t, k_desc + (kk / 4) * (Tr::kKvBoxBytes >> 4) + 2 * (kk % 4),
                    q_desc + s * kSlotDesc + (kk / 4) * kBoxDesc + 2 * (kk % 4), kk > 0);
#pragma unroll
            for (int kk = 0; kk < HEAD_DIM / 16; ++kk)
                sm90::wgmma_m64n64k16_ss<T>(
                    dp_t, v_desc + (kk / 4) * (Tr::kKvBoxBytes >> 4) + 2 * (kk % 4),
                    do_desc + s * kSlotDesc + (kk / 4) * kBoxDesc + 2 * (kk % 4), kk > 0);
            sm90::wgmma_commit();
            sm90::wgmma_wait<0>();

            // Pᵀ = exp2(Sᵀ·c − lse·log2 e) (0 where masked: past Nk or Nq, right of a query's
            // diagonal, outside its window), dSᵀ = Pᵀ ∘ (dPᵀ − D); each thread's 16 query
            // columns, their lse and D come with Q_i. Only the steps that cross the diagonal, a
            // window edge or an end take the per-score test
            auto p_ds = [&](auto masked) {
#pragma unroll
                for (int n = 0; n < 8; ++n) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int col = m0 + 8 * n + 2 * t + e;
                        const bool in = !masked || col < Nq;
                        const float l2 = in ? sm.lse2[s][col - m0] : -neg_inf<float>();
                        const float dsum = in ? sm.dsum[s][col - m0] : 0.f;
#pragma unroll
                        for (int half = 0; half < 2; ++half) {
                            const int i = 4 * n + 2 * half + e, key = key_top + 8 * half;
                            const float p = masked && mask.masked(col, key)
                                                ? 0.f : fast_exp2(fmaf(s_t[i], c, -l2));
                            s_t[i] = p;
                            dp_t[i] = p * (dp_t[i] - dsum);
                        }
                    }
                }
            };
            if (variants) {  // Pᵀ ∘ Z (dropout) for dV, dSᵀ ∘ (1 − t²) (softcap) for dK
                var.bind(b, hq, Nq, Nk);
                float cols_top = 0.f, cols_bottom = 0.f;  // Σ over the thread's queries of dS
#pragma unroll 1
                for (int e = 0; e < 32; ++e) {
                    const int col = m0 + 8 * (e / 4) + 2 * t + e % 2;
                    const int key = key_top + 8 * (e % 4 >= 2);
                    const bool hidden = col >= Nq || mask.masked(col, key);
                    float p, ds, ds_raw;
                    recompute_p_ds_variants(s_t[0], dp_t[0], scale, sm.lse2[s][col - m0],
                                            sm.dsum[s][col - m0], hidden, var, col, key, p, ds,
                                            ds_raw);
                    rotate(s_t, p);
                    rotate(dp_t, ds_raw);
                    (e % 4 >= 2 ? cols_bottom : cols_top) += ds;
                }
                if (want_dbias_cols) {  // the quad's four threads hold a key's 64 queries
                    cols_top = warp_reduce_sum<4>(cols_top);
                    cols_bottom = warp_reduce_sum<4>(cols_bottom);
                    float* cols = dbias_cols + ((long long)b * Hq + hq) * Nk;
                    if (t == 0 && key_top < Nk) cols[key_top] += cols_top;
                    if (t == 0 && key_top + 8 < Nk) cols[key_top + 8] += cols_bottom;
                }
            } else if (m0 + BM > Nq || !mask.sees_all(m0, m0 + BM, n0, n0 + BN)) {
                p_ds(Bool<true>{});
            } else {
                p_ds(Bool<false>{});
            }
#pragma unroll
            for (int kk = 0; kk < BM / 16; ++kk)
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    pa[kk][r] = pack2<T>(s_t[8 * kk + 2 * r], s_t[8 * kk + 2 * r + 1]);
                    pds[kk][r] = pack2<T>(dp_t[8 * kk + 2 * r], dp_t[8 * kk + 2 * r + 1]);
                }
            if constexpr (DQ_PARTS) {  // dSᵀ to the warpgroup's tile, once the last step's dQ
                // product read it: pds[kk] as four 8x8 matrices (keys + 0, 8 of queries 16kk,
                // then of 16kk + 8), lane l giving a row's address (ds_row)
                sm90::bar_sync(3 + warpgroup, 128);
#pragma unroll
                for (int kk = 0; kk < BM / 16; ++kk)
                    sm90::stmatrix_x4(ds_rows + (ds_row ^ (kk << 5)), pds[kk]);
                sm90::fence_proxy_async();
                sm90::bar_sync(3 + warpgroup, 128);
            }
            // dV += Pᵀ dO_i, dK += dSᵀ Q_i: k step kk takes queries 16kk .. (2048 bytes on), the
            // next 64 columns one box (8 KB) on
            sm90::wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BM / 16; ++kk)
                wgmma_rs<T, HEAD_DIM>(acc_dv, pa[kk], do_mn + s * kSlotDesc + 128 * kk);
#pragma unroll
            for (int kk = 0; kk < BM / 16; ++kk)
                wgmma_rs<T, HEAD_DIM>(acc_dk, pds[kk], q_mn + s * kSlotDesc + 128 * kk);
            // DQ_PARTS: dQ_i = dS K_j over the warpgroup's keys, 64 columns (one box of K_j) at
            // a time; k step kk its keys 16kk .. (2048 bytes on in both). D = 64 issues it with
            // dV and dK; at D = 128 that spilled (CUDA 12.9: 28 bytes), so both halves follow them
            constexpr bool kDqWithDkDv = Tr::kBoxes == 1;
            auto issue_dq = [&](int box) {
#pragma unroll
                for (int kk = 0; kk < 64 / 16; ++kk)
                    sm90::wgmma_m64n64k16_ss_tt<T>(acc_dq, ds_desc + 128 * kk,
                                                   k_mn + box * (Tr::kKvBoxBytes >> 4) + 128 * kk,
                                                   kk > 0);
            };
            if constexpr (DQ_PARTS && kDqWithDkDv) issue_dq(0);
            sm90::wgmma_commit();
            sm90::wgmma_wait<0>();
            ring.release(pos);
            pos.advance();
            if constexpr (DQ_PARTS) {  // its part of dQ_i to `dq`, once the last step's add read it
                const int tid = threadIdx.x % 128;
                if (adder) sm90::bulk_wait_read();
                sm90::bar_sync(3 + warpgroup, 128);
#pragma unroll
                for (int box = 0; box < Tr::kBoxes; ++box) {
                    if (box > 0 || !kDqWithDkDv) {   // (the next) 64 columns
                        sm90::wgmma_fence();
                        issue_dq(box);
                        sm90::wgmma_commit();
                        sm90::wgmma_wait<0>();
                    }
#pragma unroll
                    for (int i = 0; i < 32; i += 4)
                        sm.dq[warpgroup][(8 * box + i / 4) * 128 + tid] =
                            make_float4(acc_dq[i], acc_dq[i + 1], acc_dq[i + 2], acc_dq[i + 3]);
                }
                sm90::fence_proxy_async();
                sm90::bar_sync(3 + warpgroup, 128);
                if (adder) {
                    const unsigned tile = head_tiles + hq * q_tiles + step.i;
                    sm90::bulk_reduce_add(dq_accum + (size_t)tile * (BM * HEAD_DIM),
                                          sm.dq[warpgroup], BM * HEAD_DIM * 4);
                    sm90::bulk_commit();
                }
            }
        }
        sm90::mbar_arrive(&kv_empty);   // K_j, V_j read: the producer may load the next

        // -- dK_j · scale and dV_j, from registers: a thread's two 16-bit columns per n-tile
#pragma unroll
        for (int i = 0; i < Tr::kAcc; i += 4) {
            const int col = 8 * (i / 4) + 2 * t;
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int key = key_top + 8 * half;
                if (key < Nk) {
                    const long long at = (out0 + key) * HEAD_DIM + col;
                    *reinterpret_cast<unsigned*>(dk + at) =
                        pack2<T>(acc_dk[i + 2 * half] * scale, acc_dk[i + 2 * half + 1] * scale);
                    *reinterpret_cast<unsigned*>(dv + at) =
                        pack2<T>(acc_dv[i + 2 * half], acc_dv[i + 2 * half + 1]);
                }
            }
        }
        // the adds made before the next key block's, which may reach the same tiles: each
        // element of a partial takes its key blocks' parts in order
        if (adder) sm90::bulk_wait();
    }
}

template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(384, 1)
flash_bwd_dq_sm90_kernel(const __grid_constant__ sm90::TensorMap map_q,
                         const __grid_constant__ sm90::TensorMap map_k,
                         const __grid_constant__ sm90::TensorMap map_v,
                         const __grid_constant__ sm90::TensorMap map_do,
                         const float* __restrict__ lse, const float* __restrict__ Dvec,
                         T* __restrict__ dq, float* __restrict__ dbias, long long dbias_sb,
                         long long dbias_sh, long long dbias_sr, long long dbias_sc,
                         int want_dbias, int head0, int batch0, const int* __restrict__ cu_q,
                         const int* __restrict__ cu_k, int Hq, int group, int Nq, int Nk,
                         float scale, int causal, CUFLASH_VARIANT_PARAMS(T)) {
    using Tr = Sm90BwdDqTraits<T, HEAD_DIM>;
    constexpr int BM = Tr::kBlockM, BN = Tr::kBlockN, STAGES = Tr::kStages;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    auto& sm = *reinterpret_cast<typename Tr::Smem*>(smem_raw);
    __shared__ __align__(8) unsigned long long q_full;
    __shared__ sm90::Ring<STAGES> ring;  // K_j, V_j

    // the grid's y and z: heads and batch rows, from head0 and batch0 (the launch's share
    // where they share dbias rows)
    const int m0 = blockIdx.x * BM, h = blockIdx.y + head0, b = blockIdx.z + batch0;
    const int h_kv = h / group;
    const int q_row0 = cu_q ? cu_q[b] : 0, k_row0 = cu_k ? cu_k[b] : 0, tb = cu_q ? 0 : b;
    const long long row0 = ((long long)tb * Hq + h) * Nq + q_row0;  // lse, D, dQ's row 0
    if (cu_q) {
        Nq = cu_q[b + 1] - q_row0;
        Nk = cu_k[b + 1] - k_row0;
    }
    if (m0 >= Nq) return;  // past the sequence's rows
    Variants<T> var = CUFLASH_VARIANTS(T);
    const CausalMask mask{Nq, Nk, causal != 0, var.win_left, var.win_right};
    // the key tiles [j0, j0 + tiles) any row of the block sees
    const int j0 = mask.key_begin(m0) / BN;
    const int tiles = max(0, (mask.key_end(min(m0 + BM, Nq)) + BN - 1) / BN - j0);
    const int warpgroup = sm90::warpgroup_index();

    if (threadIdx.x == 256) {  // the producer's first thread, while thread 0 sets the barriers
        sm90::prefetch_tensormaps(map_q, map_k, map_v, map_do);
    }
    if (threadIdx.x == 0) {
        sm90::mbar_init(&q_full, 1);
        ring.init(256);
        sm90::mbar_init_fence();
    }
    __syncthreads();

    if (warpgroup == 2) {  // the producer
        sm90::regs_dec<40>();
        if (threadIdx.x / 32 == 8 && sm90::elect_one()) {
            sm90::mbar_arrive_expect_tx(&q_full, 2 * Tr::kBoxes * Tr::kQBoxBytes);
            for (int c = 0; c < Tr::kBoxes; ++c) {
                sm90::tma_load_4d(sm.q[c], map_q, 64 * c, q_row0 + m0, h, tb, &q_full);
                sm90::tma_load_4d(sm.dout[c], map_do, 64 * c, q_row0 + m0, h, tb, &q_full);
            }
            for (int j = 0, pos = 0; j < tiles; ++j) {  // pos: tiles loaded, the ring's
                if (var.template tile_kind<BM, BN>(b, h, m0, (j0 + j) * BN) == kTileEmpty)
                    continue;  // a block mask's empty tile: not loaded
                const int s = pos % STAGES;
                auto* full = ring.acquire(pos++, 2 * Tr::kBoxes * Tr::kKvBoxBytes);
                for (int c = 0; c < Tr::kBoxes; ++c) {
                    const int row = k_row0 + (j0 + j) * BN;
                    sm90::tma_load_4d(sm.k[s][c], map_k, 64 * c, row, h_kv, tb, full);
                    sm90::tma_load_4d(sm.v[s][c], map_v, 64 * c, row, h_kv, tb, full);
                }
            }
        }
        return;
    }

    // -- the consumers: warp w of warpgroup wg owns rows 64 wg + 16 w .. of the block; a
    // thread rows g and g + 8 (accumulator i: n-tile i / 4, row + 8 for i % 4 ≥ 2, column
    // 8 (i / 4) + 2t + i % 2)
    sm90::regs_inc<232>();
    const bool variants = var.scores() || var.dropout();
    const int lane = threadIdx.x % 32, g = lane >> 2, t = lane % 4;
    const int r_top = m0 + warpgroup * 64 + (threadIdx.x / 32 % 4) * 16 + g;
    const float c = softmax_scale_log2(scale);
    // each row's lse·log2 e and D (rows past Nq: P = 0)
    float l2[2], dsum[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = r_top + 8 * half;
        l2[half] = r < Nq ? lse_log2(lse[row0 + r]) : -neg_inf<float>();
        dsum[half] = r < Nq ? Dvec[row0 + r] : 0.f;
    }
    float acc[Tr::kAcc];
#pragma unroll
    for (int i = 0; i < Tr::kAcc; ++i) acc[i] = 0.f;
    float s_[32], dp[32];   // S, dP: the warpgroup's 64 rows × the tile's 64 keys
    unsigned pds[BN / 16][4];
    // the descriptors, made once: a ring slot, a box and a k step move them by constants
    constexpr unsigned kSlotDesc = Tr::kBoxes * Tr::kKvBoxBytes >> 4, kKvBoxDesc = Tr::kKvBoxBytes >> 4,
                       kQBoxDesc = Tr::kQBoxBytes >> 4;
    const unsigned long long q_desc = sm90::desc_k_major_sw128(sm.q[0] + warpgroup * 64 * 64);
    const unsigned long long do_desc = sm90::desc_k_major_sw128(sm.dout[0] + warpgroup * 64 * 64);
    const unsigned long long k_desc = sm90::desc_k_major_sw128(sm.k[0][0]);
    const unsigned long long v_desc = sm90::desc_k_major_sw128(sm.v[0][0]);
    const unsigned long long k_mn = sm90::desc_mn_major_sw128(sm.k[0][0], Tr::kKvBoxBytes);

    sm90::mbar_wait(&q_full, 0);
    auto pos = ring.at(0);  // the next tile consumed: its slot and phase, as the producer's
    for (int j = 0; j < tiles; ++j) {
        const int n0 = (j0 + j) * BN;
        const int kind = var.template tile_kind<BM, BN>(b, h, m0, n0);
        if (kind == kTileEmpty) continue;  // a block mask's empty tile
        var.enter_tile(kind);
        const unsigned s = pos.slot;
        ring.wait(pos);
        sm90::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk)  // k16 steps along D: box kk / 4, 32 B each
            sm90::wgmma_m64n64k16_ss<T>(
                s_, q_desc + (kk / 4) * kQBoxDesc + 2 * (kk % 4),
                k_desc + s * kSlotDesc + (kk / 4) * kKvBoxDesc + 2 * (kk % 4), kk > 0);
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk)
            sm90::wgmma_m64n64k16_ss<T>(
                dp, do_desc + (kk / 4) * kQBoxDesc + 2 * (kk % 4),
                v_desc + s * kSlotDesc + (kk / 4) * kKvBoxDesc + 2 * (kk % 4), kk > 0);
        sm90::wgmma_commit();
        sm90::wgmma_wait<0>();

        // P = exp2(S·c − lse·log2 e) (0 where masked), dS = P ∘ (dP − D); only the tiles
        // that cross the block's diagonal, a window edge or Nk take the per-score test
        auto p_ds = [&](auto masked) {
#pragma unroll
            for (int i = 0; i < 32; ++i) {
                const int half = i % 4 >= 2, col = n0 + 8 * (i / 4) + 2 * t + i % 2;
                const float p = masked && mask.masked(r_top + 8 * half, col)
                                    ? 0.f : fast_exp2(fmaf(s_[i], c, -l2[half]));
                dp[i] = p * (dp[i] - dsum[half]);
            }
        };
        if (variants) {  // dS ∘ (1 − t²) (softcap) for dQ
            var.bind(b, h, Nq, Nk);
#pragma unroll 1
            for (int e = 0; e < 32; ++e) {
                const int half = e % 4 >= 2, row = r_top + 8 * half;
                const int col = n0 + 8 * (e / 4) + 2 * t + e % 2;
                float p, ds, ds_raw;
                recompute_p_ds_variants(s_[0], dp[0], scale, half ? l2[1] : l2[0],
                                        half ? dsum[1] : dsum[0],
                                        row >= Nq || mask.masked(row, col), var, row, col, p,
                                        ds, ds_raw);
                rotate(s_, p);
                rotate(dp, ds_raw);
                if (want_dbias) {  // dbias_ij += dS_ij (a bias broadcast over keys: the quad's sum)
                    if (dbias_sc == 0) ds = warp_reduce_sum<4>(ds);
                    if ((dbias_sc != 0 || t == 0) && row < Nq && col < Nk)
                        dbias[b * dbias_sb + h * dbias_sh + row * dbias_sr + col * dbias_sc] += ds;
                }
            }
        } else if (!mask.sees_all(m0, m0 + BM, n0, n0 + BN)) {
            p_ds(Bool<true>{});
        } else {
            p_ds(Bool<false>{});
        }
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
            for (int r = 0; r < 4; ++r) pds[kk][r] = pack2<T>(dp[8 * kk + 2 * r], dp[8 * kk + 2 * r + 1]);
        // dQ += dS K_j: k step kk takes keys 16kk .. (2048 bytes on), the next 64 columns one
        // box (8 KB) on
        sm90::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
            wgmma_rs<T, HEAD_DIM>(acc, pds[kk], k_mn + s * kSlotDesc + 128 * kk);
        sm90::wgmma_commit();
        sm90::wgmma_wait<0>();
        ring.release(pos);
        pos.advance();
    }

    // -- dQ_i · scale, from registers
#pragma unroll
    for (int i = 0; i < Tr::kAcc; i += 4) {
        const int col = 8 * (i / 4) + 2 * t;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = r_top + 8 * half;
            if (r < Nq)
                *reinterpret_cast<unsigned*>(dq + (row0 + r) * HEAD_DIM + col) =
                    pack2<T>(acc[i + 2 * half] * scale, acc[i + 2 * half + 1] * scale);
        }
    }
}

// dQ from the dK/dV pass's float32 partials (DQ_PARTS): dq = scale · Σ_p parts[p], summed in
// order p = 0, 1, .. (one fixed sum per element: the same bits on every run), and put back
// from the tiles' accumulator order into rows. A partial holds (B·Hq) × ⌈Nq / 64⌉ tiles of
// 64 queries × HEAD_DIM, part_stride float4s apart; float4 128c + x of a tile (x = 32w +
// 4g + t) holds query 16w + g's columns 8c + 2t, 8c + 2t + 1, then query 16w + g + 8's. One
// float4 per thread, two pairs of dq (B, Hq, Nq, HEAD_DIM), contiguous, in T.
template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(256)
flash_bwd_dq_sum_sm90_kernel(const float4* __restrict__ parts, T* __restrict__ dq, long long n,
                             int num_parts, long long part_stride, int Nq, float scale) {
    constexpr int kTile = 64 * HEAD_DIM / 4;   // float4s of a tile
    const long long f = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (f >= n) return;
    const int q_tiles = (Nq + 63) / 64, x = f % kTile % 128;
    const long long bh = f / kTile / q_tiles;
    const int row = f / kTile % q_tiles * 64 + 16 * (x / 32) + x % 32 / 4;
    const int col = 8 * (f % kTile / 128) + 2 * (x % 4);
    float4 acc = parts[f];
    for (int p = 1; p < num_parts; ++p) {
        const float4 y = parts[f + p * part_stride];
        acc.x += y.x, acc.y += y.y, acc.z += y.z, acc.w += y.w;
    }
    T* out = dq + (bh * Nq + row) * HEAD_DIM + col;
    if (row < Nq) *reinterpret_cast<unsigned*>(out) = pack2<T>(acc.x * scale, acc.y * scale);
    if (row + 8 < Nq)
        *reinterpret_cast<unsigned*>(out + 8 * HEAD_DIM) = pack2<T>(acc.z * scale, acc.w * scale);
}
