// flash_fwd_tc.cu — FlashAttention-2 forward on tensor cores (flash_fwd_tc_kernel): f16 on
// sm_75+, bf16 on sm_80+, float32 on tf32 mma on sm_80+ (SPLIT: split tf32, 3 mma per
// product, about fp32 accuracy, by default; one-pass tf32 with allow_tf32=True, 10-bit
// mantissas like fp16's). One algorithm for all three: only the products differ
// (tc_gemm.cuh), and the traits (tc_tile.cuh, tf32_tile.cuh).
//
// The algorithm of flash_fwd.cu (FA2, Algorithm 1), with the tile math on mma.sync:
//
//   prologue   Q_i → shared (cp.async) → A fragments in registers, once      (line 4)
//              (not kQInRegs — D = 256, two row tiles of D = 128; float32 but one-pass
//              D ≤ 64 — Q_i stays in shared memory, re-read per k step)
//              start copying the first STAGES − 1 K_j, V_j tiles
//   main loop  for each K_j, V_j tile below the causal diagonal               (lines 6-10)
//                wait for tile j; barrier; start copying tile j + STAGES − 1
//                S = Q_i K_jᵀ · scale·log2 e      (C fragments; K rows as B)
//                m_new = max(m_i, rowmax S)       (quad shuffles)
//                P̃ = exp2(S − m_new);  ℓ_i = exp2(m_i − m_new) ℓ_i + rowsum P̃
//                acc = exp2(m_i − m_new) acc + P̃ V_j   (P̃ from S's registers as A
//                                                      fragments; V transposed as B)
//   epilogue   O_i = acc / ℓ_i → T in shared → 16-byte stores; lse_i      (lines 12-13)
//
// Attention variants as in flash_fwd.cu (variants.cuh's chain, run-time arguments): the key
// loop spans only the tiles the window reaches; softcap, ALiBi, bias and the bool mask
// turn S's fragments into scores (variant_scores), dropout scales P̃ after ℓ has summed it
// (dropout_fragments); a plain call skips both branches.
//
// A warp owns kRowTiles (1 or 2) 16-row mma tiles of Q_i: S, acc and the softmax state
// are per row tile, and each K or V fragment loaded from shared memory feeds the mma of
// every row tile. Layouts, fragments, swizzle: tc_tile.cuh and mma.cuh.
//
// The K/V pipeline: tile j lives in ring slot j % STAGES; at iteration j the thread waits
// until its copies of tile j landed
// (cp.async.wait_group STAGES − 2: the newer groups may still fly), one barrier makes
// every thread's copies visible *and* proves every warp is done with tile j − 1, whose
// slot then receives tile j + STAGES − 1. One group is committed per iteration even when
// it is empty, so the group count — and the wait — stays uniform.
#include "common.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "seqlens.cuh"
#include "variants.cuh"
#include "tc_gemm.cuh"

using namespace cuflash;

// The general iteration's softmax on S = Q_i K_jᵀ (raw products, tile keys n0 ..): the
// scores in log2 units, masked (−inf: P̃ = 0 exactly) or through the variants' chain; the
// online softmax's update (α into alpha_*, acc *= α for two row tiles; the caller rescales
// one after this, see flash_fwd_tc); P̃ = exp2(S − m_new) in place, dropped out for P̃ V.
template <class Tr, int R, typename T>
__device__ __forceinline__ void softmax_general(
    FragC (&s)[R][Tr::kSTiles], FragC (&acc)[R][Tr::kOTiles], OnlineSoftmax<float> (&row_top)[R],
    OnlineSoftmax<float> (&row_bottom)[R], float (&alpha_top)[R], float (&alpha_bottom)[R],
    Variants<T>& var, const CausalMask& mask, float scale, float scale_log2, int m0, int n0,
    int r_top, int t, int b, int h, int Nq, int Nk) {
    constexpr int BN = Tr::kBlockN;
    // S · scale·log2 e, masked (−inf: P̃ = 0 exactly), or the variants' chain
    if (var.scores()) {  // the chain runs on the natural score scale·qk, then log2 units
        var.bind(b, h, Nq, Nk);  // here, not before the loop: short-lived registers
        variant_scores(s, var, mask, scale, r_top, n0 + 2 * t);
    } else {
        const bool needs_mask = mask.tile_needs_mask(m0, n0, BN);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int row = r_top + 16 * r;
#pragma unroll
            for (int i = 0; i < Tr::kSTiles; ++i) {
                s[r][i].c0 *= scale_log2;
                s[r][i].c1 *= scale_log2;
                s[r][i].c2 *= scale_log2;
                s[r][i].c3 *= scale_log2;
                if (needs_mask) {
                    const int c = n0 + i * 8 + 2 * t;
                    if (mask.masked(row, c)) s[r][i].c0 = neg_inf<float>();
                    if (mask.masked(row, c + 1)) s[r][i].c1 = neg_inf<float>();
                    if (mask.masked(row + 8, c)) s[r][i].c2 = neg_inf<float>();
                    if (mask.masked(row + 8, c + 1)) s[r][i].c3 = neg_inf<float>();
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        float max_top, max_bottom;
        tile_row_max(s[r], max_top, max_bottom);
        alpha_top[r] = row_top[r].update(row_max_quad(max_top));  // also ℓ_i *= α
        alpha_bottom[r] = row_bottom[r].update(row_max_quad(max_bottom));
        if constexpr (R > 1) {  // in the lean loop these are its few edge tiles: rescaled
            // always (a vote here made CUDA 13.5 spill D = 64 on sm_90)
            if constexpr (Tr::kLean) rescale_acc(acc[r], alpha_top[r], alpha_bottom[r]);
            else rescale_acc_if_moved<Tr>(acc[r], alpha_top[r], alpha_bottom[r]);
        }
        float sum_top, sum_bottom;  // S → P̃ = exp2(S − m_new)
        exp2_rows(s[r], row_top[r].shift(), row_bottom[r].shift(), sum_top, sum_bottom);
        row_top[r].l_i += sum_top;  // ℓ sums the undropped P̃: lse is the pre-dropout one
        row_bottom[r].l_i += sum_bottom;
    }
    if (var.dropout()) {  // P̃ V only
        var.bind(b, h, Nq, Nk);
        dropout_fragments(s, var, r_top, n0 + 2 * t);
    }
}

template <class Tr, typename T>
__device__ __forceinline__ void flash_fwd_tc(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ o,
    float* __restrict__ lse, int Hq, int group, int Nq, int Nk, int d,
    Strides q_st, Strides k_st, Strides v_st, Strides o_st,
    float scale, int causal, int num_m_blocks, const Seqlens& seq, float* __restrict__ o_part,
    Variants<T> var) {
    constexpr int BM = Tr::kBlockM, BN = Tr::kBlockN, STAGES = Tr::kStages;
    // The lean main loop (16-bit tiles, see TcTileTraits::kLean): copies and fragment loads
    // addressed once (TileCopy, FragAddrs), a plain steady state (peeled from the general
    // iterations, or tested per iteration: kPeeled). Otherwise one general loop
    // recomputing its addresses.
    constexpr bool kLean = Tr::kLean;
    static_assert(!kLean || !Tr::kTf32, "the lean loop's fragment loads are ldmatrix (16-bit)");
    // The products: 16-bit tiles' ldmatrix addressed once (FragAddrs, K_j in the K layout),
    // in either loop; float32's tc_gemm.cuh products, addressed per tile.
    constexpr bool kFragProducts = !Tr::kTf32;

    // Block → (m_block, split, h, b); query blocks last-first (the causal tail, as
    // flash_fwd.cu). Varlen / KV-cache lengths and split-KV: seqlens.cuh.
    int bid = blockIdx.x;
    const int m_block = num_m_blocks - 1 - bid % num_m_blocks;
    bid /= num_m_blocks;
    const int split = bid % seq.num_splits;
    bid /= seq.num_splits;
    const int h = bid % Hq;
    const int b = bid / Hq;
    const int h_kv = h / group;  // GQA/MQA
    Nq = seq.len_q(b, Nq);  // from here on, batch row b's own lengths
    Nk = seq.len_k(b, Nk);
    const int m0 = m_block * BM;
    if (m0 >= Nq) return;  // past this sequence's end (the grid fits the longest)
    const long long q_row0 = seq.start_q(b);
    const T* q_bh = q + b * q_st.b + h * q_st.h + q_row0 * q_st.r;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw);
    T* sK = sQ + Tr::kSmemQ;
    T* sV = sK + Tr::kSmemK;
    // the rings, as addresses; their base held (sm_90 finds it from the cluster's CTA id:
    // ptxas would rebuild it at every use)
    const unsigned s_k = fresh(smem_addr(sK)), s_v = s_k + Tr::kSmemK * sizeof(T);
    constexpr unsigned kSlotBytes = BN * Tr::kHeadDim * sizeof(T);  // one ring slot

    const int lane = threadIdx.x % 32;
    const int warp_row0 = (threadIdx.x / 32) * Tr::kWarpRows;  // the warp's first row in the block
    const int g = lane >> 2, t = lane % 4;
    constexpr int R = Tr::kRowTiles;  // the warp's 16-row mma tiles: rows warp_row0 + 16r ..
    const int r_top = m0 + warp_row0 + g;  // row tile r's rows: r_top + 16r and r_top + 16r + 8
    const CausalMask mask{Nq, Nk, causal != 0, var.win_left, var.win_right};
    // Block skipping: tiles entirely above the diagonal, or outside the window, are never
    // loaded (the first tile starts on a BLOCK_N boundary, as in flash_fwd.cu); then this
    // split's share of them (seqlens.cuh).
    int n_begin = mask.key_begin(m0) / BN * BN, n_end = mask.key_end(min(m0 + BM, Nq));
    seq.clip_to_split(split, Nk, BN, n_begin, n_end);
    const int t_begin = n_begin / BN, t_end = (n_end + BN - 1) / BN;  // key tiles to visit
    const float scale_log2 = softmax_scale_log2(scale);
    // The steady state: tiles [t_lo, t_hi) that every row sees whole, in a call with no
    // variant (and a positive scale: those fold it into the exponent, after the row max).
    // The tiles before and after them take the general iteration (masks, variants).
    int t_lo = t_end, t_hi = t_end;
    if (kLean && !var.scores() && !var.dropout() && scale > 0.f)
        mask.full_tiles(m0, min(m0 + BM, Nq), BN, t_begin, t_end, t_lo, t_hi);

    // K_j, V_j (lean): each thread keeps its own pointers into the next tile to copy
    // (TileCopy::thread_rows) and steps them one tile at a time; in a paged cache, at a
    // page's end, to the next page of the block table (a key tile never straddles two
    // pages: seqlens.cuh). Otherwise each tile's rows come from seq.key_tile.
    const T* k_h = k + h_kv * k_st.h;
    const T* v_h = v + h_kv * v_st.h;
    using KCopy = TileCopy<Tr, BN, T, /*K_LAYOUT=*/kLean>;
    using VCopy = TileCopy<Tr, BN, T>;
    const KCopy k_copy(k_st.r, d);
    const VCopy v_copy(v_st.r, d);
    const int n_first = t_begin < t_end ? t_begin * BN : 0;  // (a block with no tile: any)
    const T* k_next = k_copy.thread_rows(seq.key_tile(k_h, k_st, b, n_first));
    const T* v_next = v_copy.thread_rows(seq.key_tile(v_h, v_st, b, n_first));
    // a paged cache's block-table entry of the next tile's page, and that tile's first row
    // in it: shared by the block, kept in shared memory (registers are scarce in the loop)
    __shared__ int page_state[2];
    if (kLean && seq.block_table) {
        if (threadIdx.x == 0) {
            page_state[0] = b * seq.table_stride + n_first / seq.page_size;
            page_state[1] = n_first % seq.page_size;
        }
        __syncthreads();
    }
    // Tiles jt < t_plain copy without a test: every row and column in range, not paged.
    const int t_plain = (seq.block_table || d != Tr::kHeadDim) ? 0 : Nk / BN;
    // Copy key tile jt (K_j and V_j, keys jt·BN ..; always the next one) into the ring
    // slot at byte `slot`.
    // A block mask's empty tile is not copied (its slot is never read).
    auto copy_kv = [&](int jt, unsigned slot) {
        const int n0 = jt * BN;
        const bool visit = var.template tile_kind<BM, BN>(b, h, m0, n0) != kTileEmpty;
        if constexpr (kLean && KCopy::kFits && VCopy::kFits) {
            if (!visit) {
            } else if (jt < t_plain) {
                k_copy.template full<true>(s_k + slot, k_next);
                v_copy.template full<true>(s_v + slot, v_next);
            } else {
                if (seq.block_table) {  // every thread reads the state, then thread 0
                    const int entry = page_state[0], row = page_state[1];  // updates it
                    __syncthreads();
                    if (row == seq.page_size) {  // on to the next page
                        const long long turn =
                            seq.block_table[entry + 1] - seq.block_table[entry];
                        k_next += turn * k_st.b - (long long)seq.page_size * k_st.r;
                        v_next += turn * v_st.b - (long long)seq.page_size * v_st.r;
                    }
                    if (threadIdx.x == 0) {
                        page_state[0] = entry + (row == seq.page_size);
                        page_state[1] = (row == seq.page_size ? 0 : row) + BN;
                    }
                    __syncthreads();
                }
                if (n0 + BN <= Nk) {
                    k_copy.full(s_k + slot, k_next);
                    v_copy.full(s_v + slot, v_next);
                } else {
                    k_copy.edge(s_k + slot, k_next, Nk - n0, k);
                    v_copy.edge(s_v + slot, v_next, Nk - n0, v);
                }
            }
            k_next += BN * k_st.r;
            v_next += BN * v_st.r;
        } else if (visit) {
            copy_tile_async<Tr, BN, /*K_LAYOUT=*/kFragProducts>(
                sK + slot / sizeof(T), seq.key_tile(k_h, k_st, b, n0), k_st.r, 0, Nk - n0, d);
            copy_tile_async<Tr, BN>(sV + slot / sizeof(T), seq.key_tile(v_h, v_st, b, n0),
                                    v_st.r, 0, Nk - n0, d);
        }
    };

    // -- prologue: Q_i (group 0), then the first STAGES − 1 tiles (one group each);
    // tile t_begin + i lives in ring slot i % STAGES
    copy_tile_async<Tr, BM>(sQ, q_bh, q_st.r, m0, Nq, d);
    cp_async_commit();
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) {
        if (t_begin + st < t_end) copy_kv(t_begin + st, st * kSlotBytes);
        cp_async_commit();
    }
    cp_async_wait<STAGES - 1>();  // Q_i has landed (this thread's part)
    __syncthreads();
    typename Tr::OwnFrag qf[R][Tr::kQFrags];
    load_own_fragments<Tr>(qf, sQ, warp_row0, lane);
    const unsigned s_q = smem_addr(sQ) + warp_row0 * Tr::kHeadDim * sizeof(T);  // the warp's rows
    const FragAddrs<Tr> at(lane);

    // rows g and g + 8 of each row tile; ℓ here is this thread's partial row sum (the quad
    // sums it at the end)
    OnlineSoftmax<float> row_top[R], row_bottom[R];
    FragC acc[R][Tr::kOTiles];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        row_top[r].init();
        row_bottom[r].init();
#pragma unroll
        for (int j = 0; j < Tr::kOTiles; ++j) acc[r][j] = FragC{0.f, 0.f, 0.f, 0.f};
    }

    if constexpr (kLean) {
        // -- one iteration of the main loop, on tile j in ring slot `slot`: plain (the steady
        // state: no mask, no variant) or general; `plain` a Bool<> (peeled loops) or a bool
        unsigned slot = 0;
        auto iteration = [&](int j, auto plain) {
            cp_async_wait<STAGES - 2>();  // tile j has landed (this thread's copies)
            __syncthreads();              // ... everyone's; and everyone is done with tile j − 1
            {
                const int jn = j + STAGES - 1;  // refill the slot tile j − 1 used
                if (jn < t_end)
                    copy_kv(jn, slot == 0 ? (STAGES - 1) * kSlotBytes : slot - kSlotBytes);
                cp_async_commit();
            }
            const int n0 = j * BN;
            const int kind = var.template tile_kind<BM, BN>(b, h, m0, n0);
            if (kind == kTileEmpty) {  // a block mask's empty tile: on to the next slot
                slot = slot + kSlotBytes == STAGES * kSlotBytes ? 0u : slot + kSlotBytes;
                return;
            }
            var.enter_tile(kind);

            // -- compute qk: S = Q_i K_jᵀ
            FragC s[R][Tr::kSTiles];
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int i = 0; i < Tr::kSTiles; ++i) s[r][i] = FragC{0.f, 0.f, 0.f, 0.f};
            gemm_qk_fwd<Tr>(s, qf, s_q, s_k + slot, at);

            // -- update m_i and ℓ_i: m_new = max(m_i, rowmax S), α = exp2(m_i − m_new);
            // acc *= α, skipped by a warp none of whose rows' max moved. Where acc *= α goes
            // is ptxas's register allocation, not the algorithm's: with two row tiles after
            // both tiles' α in the steady state (after each, CUDA 13.5 spilled D = 64 on
            // sm_90) and right after each α in the general iterations (after the dropout
            // branch, D = 128 spilled on sm_75), with one after the dropout branch (before
            // it, split tf32 D = 256 spilled).
            float alpha_top[R], alpha_bottom[R];
            if (plain) {  // S raw: the row max of S, scaled; P̃ = exp2(S·c − c·max)
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    float max_top, max_bottom;
                    tile_row_max(s[r], max_top, max_bottom);
                    alpha_top[r] = row_top[r].update(row_max_quad(max_top) * scale_log2);
                    alpha_bottom[r] = row_bottom[r].update(row_max_quad(max_bottom) * scale_log2);
                }
                if constexpr (R > 1)
#pragma unroll
                    for (int r = 0; r < R; ++r)
                        rescale_acc_if_moved<Tr>(acc[r], alpha_top[r], alpha_bottom[r]);
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    float sum_top, sum_bottom;
                    exp2_rows_scaled(s[r], scale_log2, row_top[r].shift(), row_bottom[r].shift(),
                                     sum_top, sum_bottom);
                    row_top[r].l_i += sum_top;
                    row_bottom[r].l_i += sum_bottom;
                }
            } else {
                softmax_general<Tr>(s, acc, row_top, row_bottom, alpha_top, alpha_bottom, var, mask,
                                    scale, scale_log2, m0, n0, r_top, t, b, h, Nq, Nk);
            }
            if constexpr (R == 1) rescale_acc_if_moved<Tr>(acc[0], alpha_top[0], alpha_bottom[0]);

            // -- acc += P̃ V_j
            FragA pa[R][Tr::kPVSteps];
            pack_p<Tr>(pa, s);
            gemm_pv_fwd<Tr>(acc, pa, s_v + slot, at);
            slot = slot + kSlotBytes == STAGES * kSlotBytes ? 0u : slot + kSlotBytes;
        };

        // -- main loop over K_j, V_j: the general iterations before the steady state (a
        // window's left edge), the steady state, and the general ones after it (the causal
        // diagonal, the sequence's last partial tile); in three loops, or in one (kPeeled)
        if constexpr (Tr::kPeeled) {
            int j = t_begin;
            for (; j < t_lo; ++j) iteration(j, Bool<false>{});
            for (; j < t_hi; ++j) iteration(j, Bool<true>{});
            for (; j < t_end; ++j) iteration(j, Bool<false>{});
        } else {
            for (int j = t_begin; j < t_end; ++j) iteration(j, j >= t_lo && j < t_hi);
        }
    } else {  // one general loop; its copies addressed per tile
        constexpr int kSlot = BN * Tr::kHeadDim;  // elements of one ring slot
        for (int j = t_begin; j < t_end; ++j) {
            cp_async_wait<STAGES - 2>();  // tile j has landed (this thread's copies)
            __syncthreads();              // ... everyone's; and everyone is done with tile j − 1
            {
                const int jn = j + STAGES - 1;  // refill the slot tile j − 1 used
                if (jn < t_end) copy_kv(jn, (jn - t_begin) % STAGES * kSlotBytes);
                cp_async_commit();
            }
            const int ring = (j - t_begin) % STAGES;  // tile j's slot
            const int n0 = j * BN;
            const int kind = var.template tile_kind<BM, BN>(b, h, m0, n0);
            if (kind == kTileEmpty) continue;  // a block mask's empty tile
            var.enter_tile(kind);

            // -- compute qk: S = Q_i K_jᵀ · scale·log2 e, masked (−inf: P̃ = 0 exactly)
            FragC s[R][Tr::kSTiles];
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int i = 0; i < Tr::kSTiles; ++i) s[r][i] = FragC{0.f, 0.f, 0.f, 0.f};
            if constexpr (kFragProducts)
                gemm_qk_fwd<Tr>(s, qf, s_q, s_k + ring * kSlotBytes, at);
            else
                gemm_own_rows<Tr>(s, qf, sQ, warp_row0, sK + ring * kSlot, lane);
            float alpha_top[R], alpha_bottom[R];
            softmax_general<Tr>(s, acc, row_top, row_bottom, alpha_top, alpha_bottom, var, mask,
                                scale, scale_log2, m0, n0, r_top, t, b, h, Nq, Nk);
            if constexpr (R == 1) rescale_acc_if_moved<Tr>(acc[0], alpha_top[0], alpha_bottom[0]);

            // -- acc += P̃ V_j
            if constexpr (kFragProducts) {
                FragA pa[R][Tr::kPVSteps];
                pack_p<Tr>(pa, s);
                gemm_pv_fwd<Tr>(acc, pa, s_v + ring * kSlotBytes, at);
            } else {
                gemm_c_tile<Tr>(acc, s, sV + ring * kSlot, lane);
            }
        }
    }

    // -- epilogue: O_i = acc / ℓ_i (ℓ = 0: a row that saw no key gets 0), lse_i
    // The block's split, head and batch row: 16-bit tiles find them anew rather than hold
    // them through the loop (4-7 registers on sm_80); float32's epilogue has no room for
    // the divisions (split tf32 D = 256 spilled), so it keeps them.
    int split_e = split, h_e = h, b_e = b;
    if constexpr (!Tr::kTf32) {
        const int rest = fresh(blockIdx.x) / num_m_blocks;  // as at the start
        split_e = rest % seq.num_splits;
        h_e = rest / seq.num_splits % Hq;
        b_e = rest / seq.num_splits / Hq;
    }
    float inv_top[R], inv_bottom[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        row_top[r].l_i = row_sum_quad(row_top[r].l_i);
        row_bottom[r].l_i = row_sum_quad(row_bottom[r].l_i);
        inv_top[r] = row_top[r].inv_l();
        inv_bottom[r] = row_bottom[r].inv_l();
        const int row = r_top + 16 * r;
        if (t == 0) {  // one writer per row
            if (row < Nq) lse[seq.lse_row(split_e, b_e, h_e, row)] = row_top[r].lse();
            if (row + 8 < Nq) lse[seq.lse_row(split_e, b_e, h_e, row + 8)] = row_bottom[r].lse();
        }
    }
    if (o_part) {  // a split's partial O_i, in float, straight from the fragments
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int row = r_top + 16 * r;
#pragma unroll
            for (int j = 0; j < Tr::kOTiles; ++j) {
                const int col = j * 8 + 2 * t;
                if (col >= d) continue;
                if (row < Nq)
                    *reinterpret_cast<float2*>(o_part + seq.lse_row(split_e, b_e, h_e, row) * d + col) =
                        make_float2(acc[r][j].c0 * inv_top[r], acc[r][j].c1 * inv_top[r]);
                if (row + 8 < Nq)
                    *reinterpret_cast<float2*>(o_part + seq.lse_row(split_e, b_e, h_e, row + 8) * d + col) =
                        make_float2(acc[r][j].c2 * inv_bottom[r], acc[r][j].c3 * inv_bottom[r]);
            }
        }
        return;
    }
    // (the sequence's first row read again here, not held in a register through the loop)
    T* o_bh = o + b_e * o_st.b + h_e * o_st.h + seq.start_q(b_e) * o_st.r;
    // O goes through the warp's own rows of sQ (no other warp reads them after the
    // prologue), converted to T, so that each thread then stores whole 16-byte chunks.
    T* sO = sQ;
    __syncwarp();  // the warp's reads of Q_i precede these writes
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int row = warp_row0 + 16 * r + g;
#pragma unroll
        for (int j = 0; j < Tr::kOTiles; ++j) {
            const int col = j * 8 + 2 * t;
            store_pair(sO + tile_offset<Tr>(row, col), acc[r][j].c0 * inv_top[r],
                       acc[r][j].c1 * inv_top[r]);
            store_pair(sO + tile_offset<Tr>(row + 8, col), acc[r][j].c2 * inv_bottom[r],
                       acc[r][j].c3 * inv_bottom[r]);
        }
    }
    __syncwarp();
    constexpr int CPR = Tr::kChunksPerRow, C = Tr::kChunkElems;
#pragma unroll
    for (int i = lane; i < Tr::kWarpRows * CPR; i += 32) {
        const int r = i / CPR, c = i % CPR;
        const int gi = m0 + warp_row0 + r;
        if (gi < Nq && c * C < d)
            *reinterpret_cast<uint4*>(o_bh + (long long)gi * o_st.r + c * C) =
                *reinterpret_cast<const uint4*>(sO + tile_offset<Tr>(warp_row0 + r, c * C));
    }
}

// The traits of T: 16-bit tiles on f16/bf16 mma (one kind of product: SPLIT is false), or
// float32 tiles on tf32 mma (SPLIT: 3xTF32, about fp32 accuracy; else one-pass tf32).
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS, int STAGES, bool SPLIT>
struct FwdTraits {
    static_assert(!SPLIT, "split tf32 is a float32 mode");
    using type = TcTileTraits<T, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, STAGES>;
};
template <int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS, int STAGES, bool SPLIT>
struct FwdTraits<float, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, STAGES, SPLIT> {
    using type = Tf32TileTraits<HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, STAGES, SPLIT>;
};

// A block of NUM_WARPS · 32 threads per (query block, head, batch), flattened into
// blockIdx.x. minBlocksPerSM = 1: ptxas may take the registers it needs (up to 255) rather
// than aim at an occupancy that spills.
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS, int STAGES, bool SPLIT>
__global__ void __launch_bounds__(NUM_WARPS * 32, 1)
flash_fwd_tc_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                    T* __restrict__ o, float* __restrict__ lse,
                    int Hq, int group, int Nq, int Nk, int d,
                    Strides q_st, Strides k_st, Strides v_st, Strides o_st,
                    float scale, int causal, int num_m_blocks, CUFLASH_SEQLENS_PARAMS(float),
                    CUFLASH_VARIANT_PARAMS(T)) {
    using Tr = typename FwdTraits<T, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, STAGES, SPLIT>::type;
    if constexpr (TensorCores<T>::value) {
        flash_fwd_tc<Tr>(q, k, v, o, lse, Hq, group, Nq, Nk, d, q_st, k_st, v_st, o_st, scale,
                         causal, num_m_blocks, CUFLASH_SEQLENS, o_part, CUFLASH_VARIANTS(T));
    } else {
        __trap();  // no tensor cores for T on this architecture: the launch path never picks it
    }
}
