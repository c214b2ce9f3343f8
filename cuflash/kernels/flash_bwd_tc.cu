// flash_bwd_tc.cu — FlashAttention-2 backward on tensor cores: f16 on sm_75+, bf16 on sm_80+
// (flash_bwd_*_tc_kernel), float32 on tf32 mma on sm_80+ (the same kernels, SPLIT: split
// tf32 by default, one-pass with allow_tf32=True, as the float32 forward). One algorithm for
// all three: only the products differ (gemm_own_rows, gemm_c_tile in tc_gemm.cuh).
//
// The algorithm of flash_bwd.cu (FA2, Algorithm 2, P recomputed from lse), with every
// product on mma.sync and P, dS on the mma accumulators:
//     D   = rowsum(dO ∘ O)          flash_bwd.cu's preprocess kernel (a bandwidth-bound
//                                   row sum: nothing for tensor cores to do)
//     dV  = Pᵀ dO,  dK = dSᵀ Q · scale     flash_bwd_dkdv_tc_kernel
//     dQ  = dS K · scale                   DQ_PARTS: the same blocks, then flash_bwd_dq_sum
//                                          else flash_bwd_dq_tc_kernel
// Two ways to dQ, both bitwise reproducible (every sum in a fixed order):
//   5 GEMMs (DQ_PARTS, 16-bit, d ≤ 128, no score variant or dropout: the window and
//     causal masks only; the default): every key block adds to every dQ
//     row, so FlashAttention-2's deterministic scheme: W workers per (batch, K/V head),
//     worker w the dK/dV block of key blocks w, w + W, … in turn, each adding dQ_i += dS K_j
//     into its own float32 partial of dQ (one thread per element: its additions in program
//     order); flash_bwd_dq_sum then adds the W partials in order. Per tile: Sᵀ, dPᵀ, dV,
//     dK and dQ, five GEMMs.
//   7 GEMMs (float32, d > 128, variants, or too few workers to fill the GPU): a dQ kernel of
//     its own recomputes S, dP and dS beside dQ_i += dS K_j; one writer per element.
//
//   dK/dV: one block per (K/V block of BLOCK_ROWS keys, head-dim chunk, K/V head, batch);
//   DQ_PARTS: per (worker, K/V head, batch), each of its key blocks in turn as below
//     prologue   K_j, V_j → shared (cp.async) → A fragments in registers (OWN_IN_REGS;
//                else they stay in shared memory, e.g. beside D = 128's 128 accumulators)
//                start copying the first STAGES − 1 (Q_i, dO_i, (lse_i · log2 e, D_i)) tiles
//     main loop  for each query head of the GQA group, each Q_i tile below the diagonal
//                  wait for tile i; barrier; start copying tile i + STAGES − 1
//                  Sᵀ = K_j Q_iᵀ, dPᵀ = V_j dO_iᵀ          (keys as rows: tc_bwd_tile.cuh)
//                  Pᵀ = exp2(Sᵀ·scale·log2 e − lse_i·log2 e), dSᵀ = Pᵀ ∘ (dPᵀ − D_i)
//                  dV_j += Pᵀ dO_i,  dK_j += dSᵀ Q_i        (C fragments as A fragments)
//                  DQ_PARTS: dSᵀ → shared (sdS); barrier; dQ_i += dS K_j (A: dS by
//                  ldmatrix.trans of sdS, B: K_j as V_j in P̃ V), the warps tiling dQ_i,
//                  each thread's elements added (red.add) to the worker's partial
//     epilogue   dK_j · scale, dV_j → T in shared → 16-byte stores
//   head-dim chunks (CHUNK_COLS < HEAD_DIM, D = 256): dK_j, dV_j whole would be 256
//     accumulator registers, so a block accumulates only its CHUNK_COLS (128) columns of
//     dV_j and dK_j; Sᵀ and dPᵀ still run over the full head dim (computed once per chunk)
//   dQ: one block per (Q block of BLOCK_ROWS queries, head-dim chunk, query head, batch);
//     16-bit dQ plans have one chunk (at D = 256 Q_i, dO_i stay in shared memory);
//     float32 at D = 256 takes chunks of 128 (64 on sm_120)
//     prologue   Q_i, dO_i → A fragments; lse_i, D_i of the thread's rows g, g + 8
//     main loop  for each K_j, V_j tile below the diagonal (the same ring)
//                  S = Q_i K_jᵀ, dP = dO_i V_jᵀ, P, dS as above, dQ_i += dS K_j
//     epilogue   dQ_i · scale → T → 16-byte stores
//
// The ring follows flash_fwd_tc.cu: tile i lives in slot i % STAGES; at iteration i a
// thread waits until its copies of tile i landed (cp.async.wait_group STAGES − 2), one
// barrier makes everyone's copies visible and proves every warp is done with tile i − 1,
// whose slot then receives tile i + STAGES − 1; one group is committed per iteration, even
// empty. Padding rows and head-dim columns ≥ d are zero-filled; padding keys and queries
// are masked (P = 0), and a row with lse = −inf (it saw no key) gets P = 0: zero
// gradients, no NaN.
//
// Attention variants (window, softcap, ALiBi, bias, mask, dropout): flash_bwd.cu's chain
// (recompute_p_ds_variants) on the fragments in one rolled loop per tile (p_ds_variants,
// tc_bwd_tile.cuh); the window skips query tiles (dK/dV: row_end) and key tiles (dQ:
// key_begin) outside it. A plain call (no score variant, no dropout: causal and the
// window are masks) runs a main loop of its own with p_ds in line: the iteration is one
// lambda, instantiated for each loop (Bool<plain>), so the plain loop never tests the
// variants and its exp2 per score is in straight-line code. dbias = dS (before softcap's
// factor) summed over the bias's broadcast axes, as flash_bwd.cu, with one writer per
// element: the dQ kernel adds each thread's own elements (a bias broadcast over heads or
// batch: one launch per head or batch row sharing it, in stream order); for a bias
// broadcast over query rows the dK/dV kernel adds each tile's column sums Σ_i dS_ij of
// its keys.
#include "common.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "variants.cuh"
#include "seqlens.cuh"
#include "tc_tile.cuh"
#include "tc_bwd_tile.cuh"

using namespace cuflash;

// ─────────────────────────────────────────────────────────────────────────────────────
// dK_j, dV_j: the block's keys own the rows of every product; Q_i, dO_i tiles streamed.
// ─────────────────────────────────────────────────────────────────────────────────────
template <class Tr, typename T>
__device__ __forceinline__ void flash_bwd_dkdv_tc(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const T* __restrict__ dO, const float* __restrict__ stats,
    T* __restrict__ dk, T* __restrict__ dv, int Hq, int group, int Nq, int Nk, int d,
    Strides q_st, Strides k_st, Strides v_st, Strides do_st,
    Strides dk_st, Strides dv_st, float scale, int causal,
    float* __restrict__ dbias_cols, int want_dbias_cols, float* __restrict__ dq_parts,
    Strides dqp_st, long long dqp_w, Variants<T> var, const Seqlens& seq) {
    constexpr int BN = Tr::kBlockRows, BM = Tr::kTileRows, STAGES = Tr::kStages;

    // Block → (worker, head-dim chunk, K/V head, batch); worker w takes key blocks w,
    // w + workers, … in turn (one each when the grid has a block per key block). Key blocks
    // first-first: under causal masking the first keys are seen by the most queries, so the
    // longest blocks start first. Chunked (CHUNK_COLS < D): the block owns columns [col0,
    // col0 + CHUNK_COLS) of dK_j, dV_j; Sᵀ and dPᵀ still sum over the full head dim.
    const int n_chunks = Tr::kChunked ? (d + Tr::kChunkCols - 1) / Tr::kChunkCols : 1;
    const int worker = blockIdx.x / n_chunks, workers = gridDim.x / n_chunks;
    const int col0 = (blockIdx.x % n_chunks) * Tr::kChunkCols;
    const int h_kv = blockIdx.y;
    const long long b = blockIdx.z;
    const int Nk_grid = Nk;  // (the grid's: a parameter, read again by the epilogue)
    Nq = seq.len_q(b, Nq);  // from here on, batch row b's own lengths (seqlens.cuh)
    Nk = seq.len_k(b, Nk);
    // The sequence's first query row as a row offset (an int through the loop), not in
    // pointers that would have to be kept: q + b·q_st.b + h·q_st.h is free to recompute.
    // (Its first key: read where it is used, at each key block's start and end.)
    const int q_row0 = seq.start_q(b);

    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* sK = reinterpret_cast<T*>(smem_raw);
    T* sV = sK + Tr::kSmemOwn;
    T* sQ = sV + Tr::kSmemOwn;
    T* sdO = sQ + Tr::kSmemRing;
    float* sS = reinterpret_cast<float*>(sdO + Tr::kSmemRing);  // (lse_i · log2 e, D_i)
    T* sdS = reinterpret_cast<T*>(sS + 2 * Tr::kSmemStats);      // dSᵀ (DQ_PARTS)
    constexpr int kSlot = BM * Tr::kHeadDim;  // elements of one ring slot
    // The products: 16-bit tiles' ldmatrix addressed once (BwdFragAddrs); float32's
    // tc_gemm.cuh products, addressed per tile.
    constexpr bool kFragProducts = !Tr::kTf32;

    const int lane = threadIdx.x % 32;
    const int warp_row0 = (threadIdx.x / 32) * Tr::kWarpRows;
    const int g = lane >> 2, t = lane % 4;
    const CausalMask mask{Nq, Nk, causal != 0, var.win_left, var.win_right};
    const bool plain = !var.scores() && !var.dropout();
    if (Tr::kDqParts && !plain) __trap();  // never launched so (kernel_backward.py)
    const float scale_log2 = softmax_scale_log2(scale);
    constexpr unsigned kRowBytes = Tr::kHeadDim * sizeof(T);
    // the shared tiles as addresses: the warp's own rows of K_j, V_j; the rings' first slots
    // (each a fixed offset from sK, so that they become immediates in the ldmatrix). Their
    // base is held: ptxas would rebuild it at every use (from the CTA id on sm_90); sm_100's
    // K_j rows take it anew (held, they spill 20 bytes at D = 128).
    const unsigned s_base = fresh(smem_addr(sK));
    auto from_k = [&](const T* tile) { return s_base + unsigned(tile - sK) * sizeof(T); };
    const unsigned s_k = (CUFLASH_ARCH >= 1000 ? smem_addr(sK) : s_base) + warp_row0 * kRowBytes;
    const unsigned s_v = from_k(sV) + warp_row0 * kRowBytes;
    const unsigned s_q = from_k(sQ), s_do = from_k(sdO);
    const BwdFragAddrs<Tr> ad(lane);
    const DqPartAddrs<Tr> dq_at(sdS, lane);  // (DQ_PARTS)

    // -- key block n0: dK_j, dV_j (and dQ's partial) of keys n0 .. n0 + BN − 1
    auto key_block = [&](const int n0) {
        // The tiles: every query head h of the group, and its Q_i tiles from the first row
        // that sees key n0 (causal block skipping, rounded down to a whole tile) to the last
        // row a window's left edge lets see the block's last key.
        const int m_begin = mask.first_row(n0) / BM * BM;
        const int m_end = mask.row_end(min(n0 + BN, Nk));
        const int m_tiles = m_end > m_begin ? (m_end - m_begin + BM - 1) / BM : 0;
        const int h_end = m_tiles > 0 ? (h_kv + 1) * group : h_kv * group;  // none: no head
        // Tile i as (query head h, first row m0, slot i % STAGES), walked one step at a
        // time rather than divided out of i: the next tile's rows, or the next head's first.
        auto next = [&](Tile x) {
            x.m0 += BM;
            if (x.m0 >= m_end) x.m0 = m_begin, ++x.h;
            x.slot = x.slot + 1 == STAGES ? 0 : x.slot + 1;
            return x;
        };
        auto ahead = [&](Tile x) {  // the tile STAGES − 1 after x
#pragma unroll
            for (int st = 0; st < STAGES - 1; ++st) x = next(x);
            return x;
        };
        // The copies. 16-bit tiles (kLeanCopy): `cp`, the next tile to copy (STAGES − 1
        // ahead of the one computed), and each thread's pointers into its rows of Q_i, dO_i
        // (TileCopy), stepped one tile at a time and found anew only at a new head. float32
        // tiles: each tile's rows from its head and first row (no state kept: their
        // kernels are at the register limit).
        using RowCopy = TileCopy<Tr, BM, T>;
        constexpr bool kLeanCopy = RowCopy::kFits && !Tr::kTf32;
        const Tile first{h_kv * group, m_begin, 0};
        Tile cp = first;
        const RowCopy q_copy(q_st.r, d), do_copy(do_st.r, d);
        auto rows_of = [&](const T* x, const Strides& st, Tile at) {  // (b read anew)
            return x + fresh((int)b) * st.b + at.h * st.h + (long long)(q_row0 + at.m0) * st.r;
        };
        const T* q_next = kLeanCopy ? q_copy.thread_rows(rows_of(q, q_st, cp)) : q;
        const T* do_next = kLeanCopy ? do_copy.thread_rows(rows_of(dO, do_st, cp)) : dO;
        // DQ_PARTS: the statistics' pointer stepped with them (the two-kernel dK/dV kernel
        // finds it per tile: a register less there, where CUDA 13.5 spilled on sm_90)
        constexpr bool kStatsCursor = kLeanCopy && Tr::kDqParts;
        auto stats_of = [&](Tile at) {
            return stats + 2 * (seq.lse_row(0, (int)b, at.h, 0) + at.m0);
        };
        const float* stats_next = kStatsCursor ? stats_of(cp) : stats;
        auto issue = [&](Tile x) {  // copy tile x into its ring slot (one commit group per tile)
            // (not a block mask's empty tile: its slot is never read)
            if (x.h < h_end &&
                var.template tile_kind<BM, BN>((int)b, x.h, x.m0, n0) != kTileEmpty) {
                const int h = x.h, m0 = x.m0, slot = x.slot;
                if constexpr (kLeanCopy) {
                    constexpr unsigned kSlotBytes = kSlot * sizeof(T);
                    const unsigned sq = s_q + slot * kSlotBytes, sdo = s_do + slot * kSlotBytes;
                    if (m0 + BM <= Nq) {
                        q_copy.full(sq, q_next);
                        do_copy.full(sdo, do_next);
                    } else {
                        q_copy.edge(sq, q_next, Nq - m0, q);
                        do_copy.edge(sdo, do_next, Nq - m0, dO);
                    }
                } else {
                    copy_tile_async<Tr, BM>(sQ + slot * kSlot, q + b * q_st.b + h * q_st.h,
                                            q_st.r, q_row0 + m0, q_row0 + Nq, d);
                    copy_tile_async<Tr, BM>(sdO + slot * kSlot, dO + b * do_st.b + h * do_st.h,
                                            do_st.r, q_row0 + m0, q_row0 + Nq, d);
                }
                if constexpr (kStatsCursor) {
                    copy_row_stats_async<Tr>(sS + 2 * slot * BM, stats_next, 0, Nq - m0);
                } else {
                    const long long row_bh = seq.lse_row(0, (int)b, h, 0);  // as lse's layout
                    copy_row_stats_async<Tr>(sS + 2 * slot * BM, stats + 2 * row_bh, m0, Nq);
                }
            }
            cp_async_commit();
            if constexpr (kLeanCopy) {  // x is cp: step to the next
                cp = next(x);
                if (cp.h == x.h) {
                    q_next += BM * q_st.r;
                    do_next += BM * do_st.r;
                    if constexpr (kStatsCursor) stats_next += 2 * BM;
                } else {
                    q_next = q_copy.thread_rows(rows_of(q, q_st, cp));
                    do_next = do_copy.thread_rows(rows_of(dO, do_st, cp));
                    if constexpr (kStatsCursor) stats_next = stats_of(cp);
                }
            }
        };

        // -- prologue: K_j, V_j (group 0), then tiles 0 .. STAGES − 2
        // (addressed anew at each key block: nothing of it held through the main loop)
        const int bf = fresh((int)b), hf = fresh(h_kv), tid = fresh(threadIdx.x);
        const int k_row0 = seq.start_k(bf);
        copy_tile_async<Tr, BN>(sK, k + bf * k_st.b + hf * k_st.h, k_st.r, k_row0 + n0,
                                k_row0 + Nk, d, tid);
        copy_tile_async<Tr, BN>(sV, v + bf * v_st.b + hf * v_st.h, v_st.r, k_row0 + n0,
                                k_row0 + Nk, d, tid);
        cp_async_commit();
        Tile x = first;
#pragma unroll
        for (int st = 0; st < STAGES - 1; ++st) issue(x), x = next(x);
        cp_async_wait<STAGES - 1>();  // K_j, V_j have landed (this thread's part)
        __syncthreads();
        typename Tr::OwnFrag kf[Tr::kQFrags], vf[Tr::kQFrags];
        load_own_fragments<Tr>(kf, sK, warp_row0, lane);
        load_own_fragments<Tr>(vf, sV, warp_row0, lane);

        FragC dk_acc[Tr::kOTiles], dv_acc[Tr::kOTiles];
#pragma unroll
        for (int j = 0; j < Tr::kOTiles; ++j) {
            dk_acc[j] = FragC{0.f, 0.f, 0.f, 0.f};
            dv_acc[j] = FragC{0.f, 0.f, 0.f, 0.f};
        }

        // -- one iteration of the main loop, on tile i: plain (no variants, no dropout: P and dS
        // in line) or with the variants' chain
        auto iteration = [&](Tile tile, auto plain) {
            cp_async_wait<STAGES - 2>();  // tile i has landed (this thread's copies)
            __syncthreads();              // ... everyone's; and everyone is done with tile i − 1
            issue(kLeanCopy ? cp : ahead(tile));  // tile i + STAGES − 1, into tile i − 1's slot
            const int kind = var.template tile_kind<BM, BN>((int)b, tile.h, tile.m0, n0);
            if (kind == kTileEmpty) return;  // a block mask's empty tile
            var.enter_tile(kind);
            const int slot = tile.slot;
            const T* sQi = sQ + slot * kSlot;
            const T* sdOi = sdO + slot * kSlot;
            const float* sSi = sS + 2 * slot * BM;  // row i: (lse_i · log2 e, D_i)
            const int m0 = tile.m0;

            // -- Sᵀ = K_j Q_iᵀ and dPᵀ = V_j dO_iᵀ (rows: the warp's 16 keys; columns: queries)
            FragC s[Tr::kSTiles], dp[Tr::kSTiles];
#pragma unroll
            for (int j = 0; j < Tr::kSTiles; ++j) {
                s[j] = FragC{0.f, 0.f, 0.f, 0.f};
                dp[j] = FragC{0.f, 0.f, 0.f, 0.f};
            }
            constexpr unsigned kSlotBytes = kSlot * sizeof(T);
            if constexpr (kFragProducts) {
                gemm_own_rows<Tr>(s, kf, s_k, s_q + slot * kSlotBytes, ad);
                gemm_own_rows<Tr>(dp, vf, s_v, s_do + slot * kSlotBytes, ad);
            } else {
                gemm_own_rows<Tr>(s, kf, sK, warp_row0, sQi, lane);
                gemm_own_rows<Tr>(dp, vf, sV, warp_row0, sdOi, lane);
            }

            // -- k step kk of dV_j += Pᵀ dO_i, dK_j += dSᵀ Q_i (16-bit): the tile's queries
            // 16kk .. 16kk + 15, Pᵀ and dSᵀ of n-tiles 2kk, 2kk + 1 as A fragments in
            // registers, times the block's chunk of the columns of dO_i, Q_i (a whole swizzle
            // period on); with DQ_PARTS dSᵀ also into sdS
            auto products = [&](auto kk) {  // (generic: instantiated for 16-bit T only)
                const FragA pa = p_fragment<T>(s[2 * kk], s[2 * kk + 1]);
                const FragA dsa = p_fragment<T>(dp[2 * kk], dp[2 * kk + 1]);
                if constexpr (Tr::kDqParts) store_ds_step<Tr>(sdS, dsa, kk, warp_row0, lane);
                gemm_c_step<Tr>(dv_acc, pa, s_do + slot * kSlotBytes + col0 * sizeof(T), ad, kk);
                gemm_c_step<Tr>(dk_acc, dsa, s_q + slot * kSlotBytes + col0 * sizeof(T), ad, kk);
            };

            // -- Pᵀ = exp2(Sᵀ·scale·log2 e − lse_i·log2 e), dSᵀ = Pᵀ ∘ (dPᵀ − D_i); lse_i and
            // D_i are per column (query), from the tile's row statistics
            const int key_top = n0 + warp_row0 + g, key_bottom = key_top + 8;
            if (!is_plain(plain)) {  // element e: key row key_top + 8·(e % 4 / 2), query column c
                const int h = tile.h;
                var.bind((int)b, h, Nq, Nk);  // short-lived registers
                float sum_top = 0.f, sum_bottom = 0.f;  // the thread's Σ_i dS_ij of its two keys
                p_ds_variants(s, dp, scale, var, [&](int e, int& qi, int& kj, float& lse2,
                                                      float& Di, bool& hidden) {
                    const int c = (e >> 2) * 8 + 2 * t + (e & 1);
                    qi = m0 + c;
                    kj = (e & 2) ? key_bottom : key_top;
                    lse2 = sSi[2 * c];
                    Di = sSi[2 * c + 1];
                    hidden = qi >= Nq || mask.masked(qi, kj);
                }, [&](int e, int, int, float ds_biased, float) {
                    (e & 2 ? sum_bottom : sum_top) += ds_biased;
                });
                // dbias of a bias broadcast over query rows: cols[b, h, j] += Σ_i dS_ij over the
                // tile's queries (Sᵀ's columns: the thread's, then its quad's), tiles in order,
                // by lane t = 0 of the quad that owns key j. One writer per key, no atomics; only
                // the first chunk's block writes (every chunk sees the same dS).
                if (want_dbias_cols && col0 == 0) {
                    sum_top = row_sum_quad(sum_top);
                    sum_bottom = row_sum_quad(sum_bottom);
                    float* cols = dbias_cols + (b * Hq + h) * Nk;
                    if (t == 0 && key_top < Nk) cols[key_top] += sum_top;
                    if (t == 0 && key_bottom < Nk) cols[key_bottom] += sum_bottom;
                }
            } else {
                // A padding query (i >= Nq) is hidden like a padding key. Where the hidden
                // elements get P = dS = 0 decides spills, ptxas being at its register limit:
                // after p_ds (hide) in the plain loop, in p_ds in the one loop of split tf32
                // with chunks (swapped, fp16 D = 64 spilled on sm_75 and split D = 256 on sm_100).
                constexpr bool kInline = !Tr::kPlainLoop;
                const bool needs_mask = mask.tile_needs_mask(m0, n0, BN) || m0 + BM > Nq;
                // n-tile j (the thread's columns c, c + 1), unmasked or with the keys' Seen
                auto p_ds_tile = [&](int j, bool inline_mask, const Seen& top, const Seen& bottom) {
                    const int c = j * 8 + 2 * t;
                    // rows c, c + 1: (lse · log2 e, D) twice, one 16-byte load
                    const float4 st = *reinterpret_cast<const float4*>(sSi + 2 * c);
                    const float l0 = st.x, d0 = st.y, l1 = st.z, d1 = st.w;
                    const int i0 = m0 + c, i1 = i0 + 1;  // their query rows
                    p_ds(s[j].c0, dp[j].c0, scale_log2, l0, d0, inline_mask && top.hides(i0));
                    p_ds(s[j].c1, dp[j].c1, scale_log2, l1, d1, inline_mask && top.hides(i1));
                    p_ds(s[j].c2, dp[j].c2, scale_log2, l0, d0, inline_mask && bottom.hides(i0));
                    p_ds(s[j].c3, dp[j].c3, scale_log2, l1, d1, inline_mask && bottom.hides(i1));
                };
                if constexpr (kFragProducts) {
                    // each k step's products once its P, dS are; a tile that needs no mask
                    // (the steady state) has a path of its own without tests, and the masked
                    // one finds its keys' bounds from the thread index read anew (none of
                    // it kept through the loop)
                    auto steps = [&](auto masked) {
                        Seen top{0, 0}, bottom{0, 0};
                        if constexpr (decltype(masked)::value) {
                            const int key = n0 + warp_row0 + (fresh(threadIdx.x) % 32) / 4;
                            top = queries_seeing(mask, key);
                            bottom = queries_seeing(mask, key + 8);
                        }
#pragma unroll
                        for (int kk = 0; kk < Tr::kPVSteps; ++kk) {
#pragma unroll
                            for (int j = 2 * kk; j < 2 * kk + 2; ++j) {
                                p_ds_tile(j, false, top, bottom);
                                if constexpr (decltype(masked)::value)
                                    hide(s[j], dp[j], top, bottom, m0 + j * 8 + 2 * t);
                            }
                            products(kk);
                        }
                    };
                    if (needs_mask) steps(Bool<true>{});
                    else steps(Bool<false>{});
                } else {
                    const Seen top = queries_seeing(mask, key_top);
                    const Seen bottom = queries_seeing(mask, key_bottom);
#pragma unroll
                    for (int j = 0; j < Tr::kSTiles; ++j) {
                        p_ds_tile(j, kInline && needs_mask, top, bottom);
                        if (!kInline && needs_mask) hide(s[j], dp[j], top, bottom, m0 + j * 8 + 2 * t);
                    }
                }
            }

            // -- dV_j += Pᵀ dO_i,  dK_j += dSᵀ Q_i  (the variants' P, dS; float32: both)
            if constexpr (kFragProducts) {
                if (!is_plain(plain)) {
#pragma unroll
                    for (int kk = 0; kk < Tr::kPVSteps; ++kk) products(kk);
                }
            } else {
                gemm_c_tile<Tr>(dv_acc, s, sdOi, lane, col0);
                gemm_c_tile<Tr>(dk_acc, dp, sQi, lane, col0);
            }

            // -- dQ_i += dS K_j into the worker's partial of dQ (5-GEMM backward)
            if constexpr (Tr::kDqParts) {
                __syncthreads();  // every warp's dSᵀ is in sdS (the next barrier: all have read it)
                // the tile's rows of the partial: rows of HEAD_DIM, a head's rows_pad apart
                const int rows_pad = (int)(dqp_st.h / Tr::kHeadDim);
                add_dq_part<Tr>(dq_parts + worker * dqp_w + b * dqp_st.b +
                                    (long long)(tile.h * rows_pad + q_row0 + m0) * Tr::kHeadDim,
                                s_base, dq_at);
            }
        };

        // -- main loop over the group's query heads and their Q_i, dO_i tiles; a plain call's
        // loop of its own: no test of the variants in its iterations (DQ_PARTS: the only
        // loop; a call with variants takes the two-kernel backward)
        if constexpr (Tr::kDqParts)
            for (Tile x = first; x.h < h_end; x = next(x)) iteration(x, Bool<true>{});
        else if constexpr (!Tr::kPlainLoop)
            for (Tile x = first; x.h < h_end; x = next(x)) iteration(x, plain);
        else if (plain)
            for (Tile x = first; x.h < h_end; x = next(x)) iteration(x, Bool<true>{});
        else
            for (Tile x = first; x.h < h_end; x = next(x)) iteration(x, Bool<false>{});

        // -- epilogue: the chunk of dK_j = (Σ dSᵀ Q_i) · scale and dV_j, through the warp's own
        // rows of sK, sV. 16-bit tiles address it anew, as the prologue: nothing of it held
        // through the main loop (float32's, at the register limit too, spill that way)
        if constexpr (Tr::kDqParts) __syncthreads();  // every warp's dS K_j read all of sK
        auto store = [&](int be, int he, int row0, int keys0, int cols, int n_keys, int ln) {
            const long long k_out0 = seq.start_k(be);
            store_rows_16b<Tr>(dk + be * dk_st.b + he * dk_st.h + k_out0 * dk_st.r, dk_st.r,
                               dk_acc, scale, sK, row0, keys0, cols, n_keys, d, ln);
            store_rows_16b<Tr>(dv + be * dv_st.b + he * dv_st.h + k_out0 * dv_st.r, dv_st.r,
                               dv_acc, 1.f, sV, row0, keys0, cols, n_keys, d, ln);
        };
        if constexpr (!Tr::kTf32) {
            const int be = fresh((int)b), te = fresh(threadIdx.x), bx = fresh(blockIdx.x);
            const int chunks = Tr::kChunked ? (fresh(d) + Tr::kChunkCols - 1) / Tr::kChunkCols : 1;
            store(be, fresh(h_kv), (te / 32) * Tr::kWarpRows,
                  Tr::kDqParts ? n0 : bx / chunks * BN,  // n0
                  (bx % chunks) * Tr::kChunkCols,        // col0
                  seq.len_k(be, Nk_grid), te % 32);
        } else {
            store(fresh((int)b), fresh(h_kv), warp_row0, n0, col0, Nk, lane);
        }
    };

    // The worker's key blocks (past this sequence's keys none: the grid fits the longest).
    // Without DQ_PARTS a block has one key block: no loop, nothing carried across it.
    if constexpr (Tr::kDqParts) {
        for (int n0 = worker * BN; n0 < Nk; n0 += workers * BN) {
            key_block(n0);
            __syncthreads();  // every warp's staging in sK, sV is read before K_j, V_j land
        }
    } else if (worker * BN < Nk) {
        key_block(worker * BN);
    }
}

// ─────────────────────────────────────────────────────────────────────────────────────
// dQ_i: the block's queries own the rows; K_j, V_j tiles streamed.
// ─────────────────────────────────────────────────────────────────────────────────────
template <class Tr, typename T>
__device__ __forceinline__ void flash_bwd_dq_tc(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const T* __restrict__ dO, const float* __restrict__ lse, const float* __restrict__ Delta,
    T* __restrict__ dq, int Hq, int group, int Nq, int Nk, int d,
    Strides q_st, Strides k_st, Strides v_st, Strides do_st,
    Strides dq_st, float scale, int causal, float* __restrict__ dbias,
    long long dbias_sb, long long dbias_sh, long long dbias_sr, long long dbias_sc,
    int want_dbias, int h, long long b, Variants<T> var, const Seqlens& seq) {
    constexpr int BM = Tr::kBlockRows, BN = Tr::kTileRows, STAGES = Tr::kStages;

    // Block → (query block, head-dim chunk, query head h, batch row b: blockIdx.y, z plus
    // the launch's offsets); query blocks last-first (the causal tail, as flash_fwd_tc.cu).
    // GQA/MQA: query head h reads K/V head h / group.
    // Chunked: the block owns columns [col0, col0 + CHUNK_COLS) of dQ_i.
    const int n_chunks = Tr::kChunked ? (d + Tr::kChunkCols - 1) / Tr::kChunkCols : 1;
    const int m0 = (gridDim.x / n_chunks - 1 - blockIdx.x / n_chunks) * BM;
    const int col0 = (blockIdx.x % n_chunks) * Tr::kChunkCols;
    Nq = seq.len_q(b, Nq);  // from here on, batch row b's own lengths (seqlens.cuh)
    Nk = seq.len_k(b, Nk);
    if (m0 >= Nq) return;  // past this sequence's rows (the grid fits the longest)
    // The sequence's rows as row offsets (one int through the loop), not in the pointers:
    // k_bh, v_bh stay functions of the parameters and blockIdx, free to recompute.
    const int q_row0 = seq.start_q(b), k_row0 = seq.start_k(b);
    const int h_kv = h / group;
    const T* q_bh = q + b * q_st.b + h * q_st.h + (long long)q_row0 * q_st.r;
    const T* do_bh = dO + b * do_st.b + h * do_st.h + (long long)q_row0 * do_st.r;
    const T* k_bh = k + b * k_st.b + h_kv * k_st.h;
    const T* v_bh = v + b * v_st.b + h_kv * v_st.h;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw);
    T* sdO = sQ + Tr::kSmemOwn;
    T* sK = sdO + Tr::kSmemOwn;
    T* sV = sK + Tr::kSmemRing;
    constexpr int kSlot = BN * Tr::kHeadDim;

    const int lane = threadIdx.x % 32;
    const int warp_row0 = (threadIdx.x / 32) * Tr::kWarpRows;
    const int g = lane >> 2, t = lane % 4;
    const CausalMask mask{Nq, Nk, causal != 0, var.win_left, var.win_right};
    const bool plain = !var.scores() && !var.dropout();
    const float scale_log2 = softmax_scale_log2(scale);
    // Block skipping: key tiles above the diagonal or outside the window (as flash_fwd_tc.cu)
    const int n_begin = mask.key_begin(m0) / BN * BN;
    const int n_end = mask.key_end(min(m0 + BM, Nq));
    const int n_tiles = n_end > n_begin ? (n_end - n_begin + BN - 1) / BN : 0;
    auto issue = [&](int j) {  // (not a block mask's empty tile: its slot is never read)
        if (j < n_tiles &&
            var.template tile_kind<BM, BN>((int)b, h, m0, n_begin + j * BN) != kTileEmpty) {
            const int n0 = n_begin + j * BN;
            copy_tile_async<Tr, BN>(sK + (j % STAGES) * kSlot, k_bh, k_st.r, k_row0 + n0,
                                         k_row0 + Nk, d);
            copy_tile_async<Tr, BN>(sV + (j % STAGES) * kSlot, v_bh, v_st.r, k_row0 + n0,
                                         k_row0 + Nk, d);
        }
        cp_async_commit();
    };

    // -- prologue: Q_i, dO_i (group 0), tiles 0 .. STAGES − 2; lse_i, D_i of rows g, g + 8
    copy_tile_async<Tr, BM>(sQ, q_bh, q_st.r, m0, Nq, d);
    copy_tile_async<Tr, BM>(sdO, do_bh, do_st.r, m0, Nq, d);
    cp_async_commit();
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) issue(st);
    const int r_top = m0 + warp_row0 + g, r_bottom = r_top + 8;
    const float* lse_bh = lse + seq.lse_row(0, (int)b, h, 0);
    const float* delta_bh = Delta + seq.lse_row(0, (int)b, h, 0);
    // padding rows act as rows that saw no key: lse = −inf → P = 0
    const float lse2_top = lse_log2(r_top < Nq ? lse_bh[r_top] : neg_inf<float>());
    const float lse2_bottom = lse_log2(r_bottom < Nq ? lse_bh[r_bottom] : neg_inf<float>());
    const float d_top = r_top < Nq ? delta_bh[r_top] : 0.f;
    const float d_bottom = r_bottom < Nq ? delta_bh[r_bottom] : 0.f;
    cp_async_wait<STAGES - 1>();  // Q_i, dO_i have landed (this thread's part)
    __syncthreads();
    typename Tr::OwnFrag qf[Tr::kQFrags], dof[Tr::kQFrags];
    load_own_fragments<Tr>(qf, sQ, warp_row0, lane);
    load_own_fragments<Tr>(dof, sdO, warp_row0, lane);

    FragC dq_acc[Tr::kOTiles];
#pragma unroll
    for (int j = 0; j < Tr::kOTiles; ++j) dq_acc[j] = FragC{0.f, 0.f, 0.f, 0.f};
    // The products (as the dK/dV kernel's): 16-bit tiles' ldmatrix addressed once
    constexpr bool kFragProducts = !Tr::kTf32;
    constexpr unsigned kRowBytes = Tr::kHeadDim * sizeof(T), kSlotBytes = kSlot * sizeof(T);
    // the shared tiles as addresses: on sm_90 and sm_100 from one base held as the dK/dV
    // kernel's (ptxas would rebuild it from the CTA id at every use: 1–17 instructions);
    // elsewhere each its own (held, it cost sm_80's D = 128 tile 4, sm_120's D = 256 2)
    constexpr bool kHeldBase = CUFLASH_ARCH >= 900 && CUFLASH_ARCH < 1200;
    const unsigned s_base = kHeldBase ? fresh(smem_addr(sQ)) : 0u;
    auto at = [&](const T* tile) {
        return kHeldBase ? s_base + unsigned(tile - sQ) * sizeof(T) : smem_addr(tile);
    };
    const unsigned s_q = at(sQ) + warp_row0 * kRowBytes;
    const unsigned s_do = at(sdO) + warp_row0 * kRowBytes;
    const unsigned s_k = at(sK), s_v = at(sV);
    const BwdFragAddrs<Tr> ad(lane);

    // -- one iteration of the main loop, on tile j: plain or with the variants' chain
    auto iteration = [&](int j, auto plain) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        issue(j + STAGES - 1);
        const int n0 = n_begin + j * BN;
        const int kind = var.template tile_kind<BM, BN>((int)b, h, m0, n0);
        if (kind == kTileEmpty) return;  // a block mask's empty tile
        var.enter_tile(kind);
        const T* sKj = sK + (j % STAGES) * kSlot;
        const T* sVj = sV + (j % STAGES) * kSlot;

        // -- S = Q_i K_jᵀ, dP = dO_i V_jᵀ
        FragC s[Tr::kSTiles], dp[Tr::kSTiles];
#pragma unroll
        for (int i = 0; i < Tr::kSTiles; ++i) {
            s[i] = FragC{0.f, 0.f, 0.f, 0.f};
            dp[i] = FragC{0.f, 0.f, 0.f, 0.f};
        }
        const unsigned slot = (j % STAGES) * kSlotBytes;
        if constexpr (kFragProducts) {
            gemm_own_rows<Tr>(s, qf, s_q, s_k + slot, ad);
            gemm_own_rows<Tr>(dp, dof, s_do, s_v + slot, ad);
        } else {
            gemm_own_rows<Tr>(s, qf, sQ, warp_row0, sKj, lane);
            gemm_own_rows<Tr>(dp, dof, sdO, warp_row0, sVj, lane);
        }

        // -- P = exp2(S·scale·log2 e − lse_i·log2 e), dS = P ∘ (dP − D_i)
        if (!is_plain(plain)) {  // element e: query row r_top + 8·(e % 4 / 2), key column c
            var.bind((int)b, h, Nq, Nk);  // here, not before the loop: short-lived registers
            p_ds_variants(s, dp, scale, var, [&](int e, int& qi, int& kj, float& lse2, float& Di,
                                                  bool& hidden) {
                qi = (e & 2) ? r_bottom : r_top;
                kj = n0 + (e >> 2) * 8 + 2 * t + (e & 1);
                lse2 = (e & 2) ? lse2_bottom : lse2_top;
                Di = (e & 2) ? d_bottom : d_top;
                hidden = qi >= Nq || mask.masked(qi, kj);
            }, [&](int e, int qi, int kj, float ds_biased, float x) {
                // the score_mod's arrays' gradients (every lane; a padding element at an
                // edge row or key with dS = 0); only the first chunk's block adds them
                if (col0 == 0) var.add_mod_grads(x, min(qi, Nq - 1), min(kj, Nk - 1), ds_biased);
                // dbias_ij += dS_ij: the thread's own element, key tiles in order (then the
                // launches of the heads and batches sharing it). A bias broadcast over keys
                // (dbias_sc = 0) sums its quad's four columns first, added by lane t = 0.
                // Only the first chunk's block writes.
                if (!want_dbias || col0 != 0) return;
                if (dbias_sc == 0) ds_biased = row_sum_quad(ds_biased);
                if ((dbias_sc != 0 || t == 0) && qi < Nq && kj < Nk)
                    dbias[b * dbias_sb + h * dbias_sh + qi * dbias_sr + kj * dbias_sc] +=
                        ds_biased;
            });
        } else {
            const bool needs_mask = mask.tile_needs_mask(m0, n0, BN);
#pragma unroll
            for (int i = 0; i < Tr::kSTiles; ++i) {
                const int c = n0 + i * 8 + 2 * t;
                bool m00 = false, m01 = false, m10 = false, m11 = false;
                if (needs_mask) {
                    const Seen top = keys_seen(mask, r_top), bottom = keys_seen(mask, r_bottom);
                    m00 = top.hides(c);
                    m01 = top.hides(c + 1);
                    m10 = bottom.hides(c);
                    m11 = bottom.hides(c + 1);
                }
                p_ds(s[i].c0, dp[i].c0, scale_log2, lse2_top, d_top, m00);
                p_ds(s[i].c1, dp[i].c1, scale_log2, lse2_top, d_top, m01);
                p_ds(s[i].c2, dp[i].c2, scale_log2, lse2_bottom, d_bottom, m10);
                p_ds(s[i].c3, dp[i].c3, scale_log2, lse2_bottom, d_bottom, m11);
            }
        }

        // -- dQ_i += dS K_j  (dS as A fragments; the chunk of K_j's columns)
        if constexpr (kFragProducts) {
            FragA dsa[Tr::kPVSteps];
            pack_a<Tr>(dsa, dp);
            gemm_c_tile<Tr>(dq_acc, dsa, s_k + slot + col0 * sizeof(T), ad);
        } else
            gemm_c_tile<Tr>(dq_acc, dp, sKj, lane, col0);
    };

    // -- main loop over K_j, V_j (a plain call's loop of its own)
    if constexpr (!Tr::kPlainLoop)
        for (int j = 0; j < n_tiles; ++j) iteration(j, plain);
    else if (plain)
        for (int j = 0; j < n_tiles; ++j) iteration(j, Bool<true>{});
    else
        for (int j = 0; j < n_tiles; ++j) iteration(j, Bool<false>{});

    // -- epilogue: dQ_i = (Σ dS K_j) · scale, through the warp's own rows of sQ
    // (the sequence's first row read again here, not held in a register through the loop)
    store_rows_16b<Tr>(dq + b * dq_st.b + h * dq_st.h + seq.start_q(b) * dq_st.r, dq_st.r, dq_acc,
                       scale, sQ, warp_row0, m0, col0, Nq, d, lane);
}

// A block of NUM_WARPS · 32 threads per (key block | query block, head-dim chunk), head,
// batch in blockIdx (x, y, z); CHUNK_COLS = HEAD_DIM: one chunk, blockIdx.x the row block.
// minBlocksPerSM = 1, as flash_fwd_tc.cu: ptxas may take the registers it needs (up to
// 255) rather than aim at an occupancy that spills.
// T = float: float32 tiles on tf32 mma (sm_80+), SPLIT: 3xTF32 (about fp32 accuracy), else
// one-pass tf32 (allow_tf32=True); 16-bit T has one kind of product (SPLIT is false).
template <typename T, int HEAD_DIM, int BLOCK_ROWS, int TILE_ROWS, int NUM_WARPS, int STAGES,
          bool OWN_IN_REGS, int CHUNK_COLS, bool SPLIT, bool DQ_PARTS>
__global__ void __launch_bounds__(NUM_WARPS * 32, 1)
flash_bwd_dkdv_tc_kernel(const T* __restrict__ q, const T* __restrict__ k,
                         const T* __restrict__ v, const T* __restrict__ dO,
                         const float* __restrict__ stats,
                         T* __restrict__ dk, T* __restrict__ dv,
                         int Hq, int group, int Nq, int Nk, int d,
                         Strides q_st, Strides k_st, Strides v_st, Strides do_st,
                         Strides dk_st, Strides dv_st,
                         float scale, int causal, float* __restrict__ dbias_cols,
                         int want_dbias_cols, float* __restrict__ dq_parts, Strides dqp_st,
                         long long dqp_w, CUFLASH_VARLEN_PARAMS, CUFLASH_VARIANT_PARAMS(T)) {
    using Tr = TcBwdTraits<T, HEAD_DIM, BLOCK_ROWS, TILE_ROWS, NUM_WARPS, STAGES, OWN_IN_REGS,
                           CHUNK_COLS, /*ROW_STATS=*/true, SPLIT, DQ_PARTS>;
    if constexpr (TensorCores<T>::value) {
        flash_bwd_dkdv_tc<Tr>(q, k, v, dO, stats, dk, dv, Hq, group, Nq, Nk, d, q_st,
                              k_st, v_st, do_st, dk_st, dv_st, scale, causal, dbias_cols,
                              want_dbias_cols, dq_parts, dqp_st, dqp_w, CUFLASH_VARIANTS(T),
                              CUFLASH_VARLEN);
    } else {
        __trap();  // no tensor cores for T on this architecture: the launch path never picks it
    }
}

template <typename T, int HEAD_DIM, int BLOCK_ROWS, int TILE_ROWS, int NUM_WARPS, int STAGES,
          bool OWN_IN_REGS, int CHUNK_COLS, bool SPLIT>
__global__ void __launch_bounds__(NUM_WARPS * 32, 1)
flash_bwd_dq_tc_kernel(const T* __restrict__ q, const T* __restrict__ k,
                       const T* __restrict__ v, const T* __restrict__ dO,
                       const float* __restrict__ lse, const float* __restrict__ Delta,
                       T* __restrict__ dq, int Hq, int group, int Nq, int Nk, int d,
                       __grid_constant__ const Strides q_st, __grid_constant__ const Strides k_st,
                       __grid_constant__ const Strides v_st, __grid_constant__ const Strides do_st,
                       __grid_constant__ const Strides dq_st,
                       float scale, int causal, float* __restrict__ dbias,
                       long long dbias_sb, long long dbias_sh, long long dbias_sr,
                       long long dbias_sc, int want_dbias, int head0, int batch0,
                       CUFLASH_VARLEN_PARAMS, CUFLASH_VARIANT_PARAMS(T)) {
    using Tr = TcBwdTraits<T, HEAD_DIM, BLOCK_ROWS, TILE_ROWS, NUM_WARPS, STAGES, OWN_IN_REGS,
                           CHUNK_COLS, /*ROW_STATS=*/false, SPLIT>;
    if constexpr (TensorCores<T>::value) {
        // dbias broadcast over heads (batch): the heads (batch rows) that share a row of
        // dbias are not spread over the grid's y (z) but take one launch each, at offset
        // head0 (batch0), in stream order: each element has one writer and a fixed order.
        // (A loop over them inside the block, as flash_bwd.cu's, spilled at D = 128, 256.)
        flash_bwd_dq_tc<Tr>(q, k, v, dO, lse, Delta, dq, Hq, group, Nq, Nk, d, q_st, k_st,
                            v_st, do_st, dq_st, scale, causal, dbias, dbias_sb, dbias_sh,
                            dbias_sr, dbias_sc, want_dbias, blockIdx.y + head0,
                            (long long)blockIdx.z + batch0, CUFLASH_VARIANTS(T),
                            CUFLASH_VARLEN);
    } else {
        __trap();
    }
}

// dQ of the 5-GEMM backward: dq[e] = scale · Σ_w parts[w][e'], the workers' float32
// partials summed in order w = 0, 1, …: one fixed sum per element, the same bits on every
// run. dq is contiguous (…, rows, d); a partial holds each row in head_dim ≥ d floats and
// each (batch, head) in rows_pad ≥ rows rows (padded so that the dK/dV kernel adds whole
// tiles), workers part_w floats apart. Four elements per thread (d is a multiple of 8);
// 16-bit T.
template <typename T>
__global__ void __launch_bounds__(256)
flash_bwd_dq_sum_kernel(const float* __restrict__ parts, T* __restrict__ dq, long long n,
                        int workers, float scale, int d, int rows, int rows_pad, int head_dim,
                        long long part_w) {
    const long long e = 4 * ((long long)blockIdx.x * blockDim.x + threadIdx.x);
    if (e >= n) return;
    const long long row = e / d, bh = row / rows;
    const float* p = parts + (bh * rows_pad + row % rows) * head_dim + e % d;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int w = 0; w < workers; ++w) {
        const float4 x = *reinterpret_cast<const float4*>(p + w * part_w);
        acc.x += x.x, acc.y += x.y, acc.z += x.z, acc.w += x.w;
    }
    *reinterpret_cast<uint2*>(dq + e) =
        make_uint2(pack2<T>(acc.x * scale, acc.y * scale), pack2<T>(acc.z * scale, acc.w * scale));
}
