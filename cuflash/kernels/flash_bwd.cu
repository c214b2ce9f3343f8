// flash_bwd.cu — FlashAttention-2 backward (FA2 paper, Algorithm 2), plain SIMT.
//
// Forward:  S = scale · Q Kᵀ,  P = exp(S − lse),  O = P V          (lse stored per row)
// Backward, with P recomputed from lse, never stored:
//     D   = rowsum(dO ∘ O)          flash_bwd_preprocess_kernel         (line 4)
//     dV  = Pᵀ dO                   flash_bwd_dkdv_kernel                (line 12)
//     dP  = dO Vᵀ                   both                                 (line 13)
//     dS  = P ∘ (dP − D)            both                                 (line 14)
//     dK  = dSᵀ Q · scale           flash_bwd_dkdv_kernel                (line 16)
//     dQ  = dS K · scale            flash_bwd_dq_kernel                  (line 15)
// Attention variants (run-time CUFLASH_VARIANT_PARAMS, as in flash_fwd.cu; one
// specialization for all) recompute P from the score chain of variants.cuh and scale by
// the redrawn dropout Z: dV from P ∘ Z, dS = P ∘ (dP ∘ Z − D), dbias = dS (dQ kernel;
// the dK/dV kernel's column sums Σ_i dS_ij for a bias broadcast over query rows),
// and dK, dQ from dS ∘ (1 − t²) under softcap (recompute_p_ds_variants, bwd_tile.cuh).
//
// Work split — every output element is written by exactly one thread, in a fixed order:
// no atomics, so every run is bitwise identical.
//   * dK/dV: one block per (K/V block of Bc keys, K/V head, batch). K_j, V_j, dK_j, dV_j
//     live in registers; Q_i, dO_i tiles stream through shared memory. Under GQA the
//     block also loops over the query heads of its group, so the sum over the group
//     needs no atomics.
//   * dQ: one block per (Q block of Br rows, query head, batch). Q_i, dO_i, dQ_i live in
//     registers; K_j, V_j tiles stream through shared memory.
// Thread layout, shared memory and the tile pieces: bwd_tile.cuh.
//
// Arguments: q, dO are (B, Hq, Nq, d) and k, v are (B, Hkv, Nk, d), with int64 element
// strides for batch, head and row and a contiguous last axis; lse and D are contiguous
// (B, Hq, Nq) in the accumulation type; dq, dk, dv get their own strides. `group` query
// heads share one K/V head (GQA/MQA). HEAD_DIM is the bucket: columns d..D−1 are zero.
// Packed variable-length sequences (cu_seqlens_q/_k, lse and D as (1, Hq, total_q)): each
// block finds its sequence from its batch index, as the forward does (seqlens.cuh).
//
// Head dims beyond the bucket (CHUNKED): as in the forward, a block owns one D-wide chunk
// of the columns it writes — blockIdx.x = (row block) · num_d_chunks + chunk — and the
// scores sum over every chunk:
//     S_ij = Σ_c Q_i[c] · K_j[c],   dP_ij = Σ_c dO_i[c] · V_j[c]
// The chunks of one tile are visited in turn, the block's own chunk last. After each of
// the others, lane 0 of the group that owns (i, j) adds its partial S_ij, dP_ij to the
// shared sS, sdP (one writer per element; a barrier between chunks). On the own chunk
// every lane adds the stored partials to its fresh ones and accumulates exactly as with
// one chunk, from the chunk still in shared memory and registers — so the per-thread
// state (and the register budget) is that of the one-chunk kernel. The scores are
// recomputed once per output chunk, the price of never holding more than D columns on
// chip. Without CHUNKED the chunk loop runs once and folds away at compile time.
//
// __launch_bounds__ minBlocksPerSM (bwd_min_blocks): none (0) for the one-chunk float
// kernels up to D = 128 (169-170 registers on sm_80 with CUDA 12.9: one block of 256
// threads per SM); 1 for the chunked ones, as in
// flash_fwd.cu (with the bare thread count ptxas capped sm_70's 16-bit chunked dK/dV
// kernel at 128 registers and spilled), for D = 256 (146-169 registers: one block per SM
// either way; CUDA 13's ptxas capped sm_75's 16-bit dQ kernel at 128 and spilled), and for
// double, whose dK/dV kernels CUDA 13's ptxas capped at 128 registers and spilled.
#include "common.cuh"
#include "mask.cuh"
#include "seqlens.cuh"
#include "variants.cuh"
#include "bwd_tile.cuh"

using namespace cuflash;

template <typename T, int HEAD_DIM, bool CHUNKED>
constexpr int bwd_min_blocks() {
    return (CHUNKED || HEAD_DIM >= 256 || sizeof(accum_t<T>) == 8) ? 1 : 0;
}

// ─────────────────────────────────────────────────────────────────────────────────────
// Preprocess: D_i = rowsum(dO_i ∘ O_i), one warp per query row; and the pairs (lse_i ·
// log2 e, D_i) (+inf for a row that saw no key: P = 0), which the tensor-core dK/dV kernel
// reads per column, one 8-byte copy per row.
// ─────────────────────────────────────────────────────────────────────────────────────
template <typename T, int ROWS_PER_BLOCK>
__global__ void __launch_bounds__(ROWS_PER_BLOCK * 32)
flash_bwd_preprocess_kernel(const T* __restrict__ dO, const T* __restrict__ o,
                            const accum_t<T>* __restrict__ lse, accum_t<T>* __restrict__ Delta,
                            accum_t<T>* __restrict__ stats, int Hq, int Nq, int d, long long rows,
                            __grid_constant__ const Strides do_st,
                            __grid_constant__ const Strides o_st) {
    using A = accum_t<T>;
    const int lane = threadIdx.x % 32;
    const long long row = (long long)blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / 32;
    if (row >= rows) return;  // whole warp leaves together: the shuffles below stay full
    // lse and D are contiguous (B, Hq, Nq), stats (B, Hq, Nq, 2); stats[row, 0] written
    // first: lse's pointer is dead before the divisions below
    if (lane == 0) stats[2 * row] = lse_log2(lse[row]);
    const long long i = row % Nq;
    const long long h = (row / Nq) % Hq;
    const long long b = row / ((long long)Nq * Hq);
    const T* do_row = dO + b * do_st.b + h * do_st.h + i * do_st.r;
    const T* o_row = o + b * o_st.b + h * o_st.h + i * o_st.r;
    A acc = A(0);
    for (int c = lane; c < d; c += 32) acc = fma(to_float(do_row[c]), to_float(o_row[c]), acc);
    acc = warp_reduce_sum<32>(acc);
    if (lane == 0) Delta[row] = stats[2 * row + 1] = acc;
}

// ─────────────────────────────────────────────────────────────────────────────────────
// dK_j, dV_j: one K/V block per thread block, Q_i / dO_i tiles streamed.
// ─────────────────────────────────────────────────────────────────────────────────────
template <typename T, int HEAD_DIM, int LANES_PER_ROW, int ROWS_PER_GROUP, int NUM_WARPS,
          int TILE_ROWS, bool CHUNKED>
__global__ void __launch_bounds__(NUM_WARPS * 32, (bwd_min_blocks<T, HEAD_DIM, CHUNKED>()))
flash_bwd_dkdv_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                      const T* __restrict__ dO, const accum_t<T>* __restrict__ lse,
                      const accum_t<T>* __restrict__ Delta, T* __restrict__ dk,
                      T* __restrict__ dv, int Hq, int group, int Nq, int Nk, int d,
                      __grid_constant__ const Strides q_st, __grid_constant__ const Strides k_st,
                      __grid_constant__ const Strides v_st, __grid_constant__ const Strides do_st,
                      __grid_constant__ const Strides dk_st, __grid_constant__ const Strides dv_st,
                      accum_t<T> scale, int causal, int num_d_chunks,
                      accum_t<T>* __restrict__ dbias_cols, int want_dbias_cols,
                      CUFLASH_VARLEN_PARAMS, CUFLASH_VARIANT_PARAMS(T)) {
    using Tr = BwdTileTraits<T, HEAD_DIM, LANES_PER_ROW, ROWS_PER_GROUP, NUM_WARPS, TILE_ROWS,
                             CHUNKED, /*QUERY_TILES=*/true>;
    using A = typename Tr::A;
    constexpr int DPL = Tr::kDimPerLane, BC = Tr::kBlockRows, BR = TILE_ROWS;
    const int n_chunks = CHUNKED ? num_d_chunks : 1;

    // Block → (key block, own head-dim chunk, K/V head, batch).
    const BwdThreadCoord<Tr> tc;
    const int own = blockIdx.x % n_chunks;       // the chunk of dK, dV this block owns
    const int n0 = (blockIdx.x / n_chunks) * BC;  // first key of the block
    const int key0 = n0 + tc.row(0);              // first key of the lane's group
    const int h_kv = blockIdx.y;
    const long long b = blockIdx.z;
    const Seqlens seq = CUFLASH_VARLEN;  // packed sequences: seqlens.cuh
    Nq = seq.len_q(b, Nq);  // from here on, batch row b's own lengths
    Nk = seq.len_k(b, Nk);
    if (n0 >= Nk) return;  // past this sequence's keys (the grid fits the longest)
    const long long q_row0 = seq.start_q(b), k_row0 = seq.start_k(b);
    Variants<T> var = CUFLASH_VARIANTS(T);  // softcap, ALiBi, bias, bool mask, dropout
    const CausalMask mask{Nq, Nk, causal != 0, var.win_left, var.win_right};
    const bool plain = !var.scores() && !var.dropout();
    const A scale_log2 = softmax_scale_log2(scale);
    // dbias of a bias broadcast over query rows: the column sums Σ_i dS_ij of this block's
    // keys, one (batch, query head) at a time, into the zeroed, contiguous (B, Hq, Nk)
    // buffer dbias_cols (the caller sums it over the bias's other broadcast axes). The
    // block sees every query row of its keys, so each sum is one thread's running sum over
    // the rows in a fixed order, kept in dbias_cols itself (registers here would spill the
    // D = 128 half kernels on sm_90): no atomics, nothing across blocks. Only the chunk-0
    // block writes.
    const bool write_dbias = want_dbias_cols && own == 0;

    __shared__ A smem[Tr::kSmemElems];
    A (*sQ)[HEAD_DIM] = reinterpret_cast<A (*)[HEAD_DIM]>(smem);               // Q_i
    A (*sdO)[HEAD_DIM] = reinterpret_cast<A (*)[HEAD_DIM]>(smem + Tr::kSmemTile);  // dO_i
    A* sL = smem + 2 * Tr::kSmemTile;    // lse_i · log2 e (+inf: the row sees no key)
    A* sDelta = sL + Tr::kSmemRowStat;   // D_i
    A (*sS)[BC] = reinterpret_cast<A (*)[BC]>(sDelta + Tr::kSmemRowStat);  // Σ_c S_ij
    A (*sdP)[BC] = reinterpret_cast<A (*)[BC]>(sDelta + Tr::kSmemRowStat + Tr::kSmemScores);

    // -- prologue: K_j, V_j into registers (chunked: per chunk, below); dK_j = dV_j = 0
    const T* k_bh = k + b * k_st.b + h_kv * k_st.h + k_row0 * k_st.r;
    const T* v_bh = v + b * v_st.b + h_kv * v_st.h + k_row0 * v_st.r;
    A kr[ROWS_PER_GROUP][DPL], vr[ROWS_PER_GROUP][DPL];
    A dkr[ROWS_PER_GROUP][DPL], dvr[ROWS_PER_GROUP][DPL];
    if (!CHUNKED) load_rows<Tr>(kr, vr, k_bh, k_st.r, v_bh, v_st.r, key0, Nk, 0, d, tc);
    zero_rows<Tr>(dkr);
    zero_rows<Tr>(dvr);
    // Block skipping: query tiles entirely above the diagonal (causal, or a window's right
    // edge) are never loaded (rounded down to a whole tile, so the tiles are the same with
    // and without causal), nor those entirely below a window's left edge.
    const int m_begin = mask.first_row(n0) / BR * BR;
    const int m_end = mask.row_end(min(n0 + BC, Nk));

    // -- main loop: the group's query heads, Q_i tiles, head-dim chunks (own last)
    for (int h = h_kv * group; h < (h_kv + 1) * group; ++h) {
        const T* q_bh = q + b * q_st.b + h * q_st.h + q_row0 * q_st.r;
        const T* do_bh = dO + b * do_st.b + h * do_st.h + q_row0 * do_st.r;
        const A* lse_bh = lse + seq.lse_row(0, (int)b, h, 0);
        const A* delta_bh = Delta + seq.lse_row(0, (int)b, h, 0);
        var.bind((int)b, h, Nq, Nk);
        A* dbias_bh = dbias_cols + (b * Hq + h) * Nk;  // Σ_i dS_ij of this head's keys
        for (int m0 = m_begin; m0 < m_end; m0 += BR) {
            const int kind = var.template tile_kind<BR, BC>((int)b, h, m0, n0);
            if (kind == kTileEmpty) continue;  // a block mask's empty tile: never read
            var.enter_tile(kind);
            const int m_rows = min(BR, Nq - m0);
            for (int c = 0; c < n_chunks; ++c) {
                const int chunk = (own + 1 + c) % n_chunks;
                const bool last = c == n_chunks - 1;  // the own chunk
                __syncthreads();  // every thread is done with the previous chunk / tile
                load_tile_pair<Tr>(sQ, sdO, q_bh, q_st.r, do_bh, do_st.r, m0, Nq,
                                   chunk * HEAD_DIM, d);
                if (c == 0)
                    for (int r = threadIdx.x; r < BR; r += Tr::kThreads)
                        load_row_stats(lse_bh, delta_bh, m0 + r, Nq, sL[r], sDelta[r]);
                if (CHUNKED)
                    load_rows<Tr>(kr, vr, k_bh, k_st.r, v_bh, v_st.r, key0, Nk, chunk * HEAD_DIM,
                                  d, tc);
                __syncthreads();

#pragma unroll 1
                for (int r = 0; r < m_rows; ++r) {
                    A qv[DPL], dov[DPL];
                    read_smem_row<Tr>(qv, dov, sQ[r], sdO[r], tc);
                    const A lse2 = sL[r], Di = sDelta[r];
#pragma unroll
                    for (int t = 0; t < ROWS_PER_GROUP; ++t) {
                        A s, dp, p, ds;
                        // S_ij = Q_i K_jᵀ, dP_ij = dO_i V_jᵀ
                        score_dots<Tr>(qv, kr[t], dov, vr[t], s, dp);
                        if (!complete_scores<CHUNKED>(s, dp, sS, sdP, r, tc.row(t), c, last, tc.g))
                            continue;
                        // P_ij = exp2(S_ij·scale·log2 e − lse_i·log2 e), dS_ij = P_ij (dP_ij − D_i)
                        const bool hidden = mask.masked(m0 + r, key0 + t);
                        if (plain) {
                            recompute_p_ds(s, dp, scale_log2, lse2, Di, hidden, p, ds);
                        } else {  // the variants' chain: dV from P ∘ Z, dK from dS_raw
                            A ds_biased;
                            recompute_p_ds_variants(s, dp, scale, lse2, Di, hidden, var, m0 + r,
                                                    key0 + t, p, ds_biased, ds);
                            // dbias_j += dS_ij, rows in order, by one lane of the group
                            // (every lane holds the same group-reduced dS)
                            if (write_dbias && tc.g == 0 && key0 + t < Nk)
                                dbias_bh[key0 + t] += ds_biased;
                        }
                        axpy<Tr>(p, dov, dvr[t]);  // dV_j += P_ijᵀ dO_i   (P ∘ Z)
                        axpy<Tr>(ds, qv, dkr[t]);  // dK_j += dS_ijᵀ Q_i   (dS_raw)
                    }
                }
            }
        }
    }

    // -- epilogue: this block's chunk of dK_j = (Σ dS_ijᵀ Q_i) · scale and dV_j
    store_rows<Tr>(dk + b * dk_st.b + h_kv * dk_st.h + k_row0 * dk_st.r, dk_st.r, dkr, scale,
                   key0, Nk, own * HEAD_DIM, d, tc);
    store_rows<Tr>(dv + b * dv_st.b + h_kv * dv_st.h + k_row0 * dv_st.r, dv_st.r, dvr,
                   /*factor=*/A(1), key0, Nk, own * HEAD_DIM, d, tc);
}

// ─────────────────────────────────────────────────────────────────────────────────────
// dQ_i: one Q block per thread block, K_j / V_j tiles streamed.
// ─────────────────────────────────────────────────────────────────────────────────────
template <typename T, int HEAD_DIM, int LANES_PER_ROW, int ROWS_PER_GROUP, int NUM_WARPS,
          int TILE_ROWS, bool CHUNKED>
__global__ void __launch_bounds__(NUM_WARPS * 32, (bwd_min_blocks<T, HEAD_DIM, CHUNKED>()))
flash_bwd_dq_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                    const T* __restrict__ dO, const accum_t<T>* __restrict__ lse,
                    const accum_t<T>* __restrict__ Delta, T* __restrict__ dq,
                    int Hq, int group, int Nq, int Nk, int d,
                    __grid_constant__ const Strides q_st, __grid_constant__ const Strides k_st,
                    __grid_constant__ const Strides v_st, __grid_constant__ const Strides do_st,
                    __grid_constant__ const Strides dq_st,
                    accum_t<T> scale, int causal, int num_d_chunks,
                    accum_t<T>* __restrict__ dbias, long long dbias_sb, long long dbias_sh,
                    long long dbias_sr, long long dbias_sc, int want_dbias, int head_reps,
                    int batch_reps, CUFLASH_VARLEN_PARAMS, CUFLASH_VARIANT_PARAMS(T)) {
    using Tr = BwdTileTraits<T, HEAD_DIM, LANES_PER_ROW, ROWS_PER_GROUP, NUM_WARPS, TILE_ROWS,
                             CHUNKED, /*QUERY_TILES=*/false>;
    using A = typename Tr::A;
    constexpr int DPL = Tr::kDimPerLane, BR = Tr::kBlockRows, BC = TILE_ROWS;
    const int n_chunks = CHUNKED ? num_d_chunks : 1;

    // Block → (query block, own head-dim chunk, query head(s), batch(es)).
    const BwdThreadCoord<Tr> tc;
    const int own = blockIdx.x % n_chunks;       // the chunk of dQ this block owns
    const int m0 = (blockIdx.x / n_chunks) * BR;  // first query row of the block
    const int row0 = m0 + tc.row(0);              // first query row of the lane's group
    const Seqlens seq = CUFLASH_VARLEN;  // packed sequences (batch_reps = 1): seqlens.cuh
    Nq = seq.len_q(blockIdx.z, Nq);      // from here on, batch row b's own lengths
    Nk = seq.len_k(blockIdx.z, Nk);
    if (m0 >= Nq) return;  // past this sequence's rows (the grid fits the longest)
    Variants<T> var = CUFLASH_VARIANTS(T);  // softcap, ALiBi, bias, bool mask, dropout
    const CausalMask mask{Nq, Nk, causal != 0, var.win_left, var.win_right};
    const bool plain = !var.scores() && !var.dropout();
    const A scale_log2 = softmax_scale_log2(scale);
    // dbias = dS summed over bias's broadcast axes, with one writer per element and no
    // atomics: the block owns dbias's rows [m0, m0 + BR) (the query axis is never
    // broadcast here) and loops over the head_reps × batch_reps (head, batch) pairs that
    // share them; lane 0 of the group owning row i adds dS_ij in a fixed order (keys, then
    // heads, then batches; dbias starts at 0), so a key-broadcast column is one thread's
    // running sum too. Only the chunk-0 block writes (every chunk sees the same dS).
    const bool write_dbias = want_dbias && own == 0;

    __shared__ A smem[Tr::kSmemElems];
    A (*sK)[HEAD_DIM] = reinterpret_cast<A (*)[HEAD_DIM]>(smem);               // K_j
    A (*sV)[HEAD_DIM] = reinterpret_cast<A (*)[HEAD_DIM]>(smem + Tr::kSmemTile);  // V_j
    A (*sS)[BC] = reinterpret_cast<A (*)[BC]>(smem + 2 * Tr::kSmemTile);  // Σ_c S_ij
    A (*sdP)[BC] = reinterpret_cast<A (*)[BC]>(smem + 2 * Tr::kSmemTile + Tr::kSmemScores);

    // Block skipping: key tiles entirely above the diagonal (causal, or a window's right
    // edge) or left of a window are never loaded (the first on a BC boundary).
    const int n_begin = mask.key_begin(m0) / BC * BC;
    const int n_end = mask.key_end(min(m0 + BR, Nq));

#pragma unroll 1
    for (int rep = 0; rep < head_reps * batch_reps; ++rep) {
        const int h = blockIdx.y * head_reps + rep % head_reps;
        const long long b = (long long)blockIdx.z * batch_reps + rep / head_reps;
        const int h_kv = h / group;  // GQA/MQA: `group` consecutive query heads share K/V
        var.bind((int)b, h, Nq, Nk);
        A* dbias_bh = dbias + b * dbias_sb + h * dbias_sh;  // stride 0 on a shared axis

        // -- prologue: Q_i, dO_i (chunked: per chunk, below), lse_i, D_i into registers;
        // dQ_i = 0
        const long long q_row0 = seq.start_q((int)b), k_row0 = seq.start_k((int)b);
        const T* q_bh = q + b * q_st.b + h * q_st.h + q_row0 * q_st.r;
        const T* do_bh = dO + b * do_st.b + h * do_st.h + q_row0 * do_st.r;
        const A* lse_bh = lse + seq.lse_row(0, (int)b, h, 0);
        const A* delta_bh = Delta + seq.lse_row(0, (int)b, h, 0);
        A qr[ROWS_PER_GROUP][DPL], dor[ROWS_PER_GROUP][DPL], dqr[ROWS_PER_GROUP][DPL];
        A lse2[ROWS_PER_GROUP], Di[ROWS_PER_GROUP];
        if (!CHUNKED) load_rows<Tr>(qr, dor, q_bh, q_st.r, do_bh, do_st.r, row0, Nq, 0, d, tc);
        zero_rows<Tr>(dqr);
#pragma unroll
        for (int t = 0; t < ROWS_PER_GROUP; ++t)
            load_row_stats(lse_bh, delta_bh, row0 + t, Nq, lse2[t], Di[t]);

        const T* k_bh = k + b * k_st.b + h_kv * k_st.h + k_row0 * k_st.r;
        const T* v_bh = v + b * v_st.b + h_kv * v_st.h + k_row0 * v_st.r;
        // -- main loop: K_j, V_j tiles, head-dim chunks (own last)
        for (int n0 = n_begin; n0 < n_end; n0 += BC) {
            const int kind = var.template tile_kind<BR, BC>((int)b, h, m0, n0);
            if (kind == kTileEmpty) continue;  // a block mask's empty tile: never read
            var.enter_tile(kind);
            const int n_cols = min(BC, n_end - n0);
            for (int c = 0; c < n_chunks; ++c) {
                const int chunk = (own + 1 + c) % n_chunks;
                const bool last = c == n_chunks - 1;  // the own chunk
                __syncthreads();  // every thread is done with the previous chunk / tile
                load_tile_pair<Tr>(sK, sV, k_bh, k_st.r, v_bh, v_st.r, n0, Nk, chunk * HEAD_DIM, d);
                if (CHUNKED)
                    load_rows<Tr>(qr, dor, q_bh, q_st.r, do_bh, do_st.r, row0, Nq, chunk * HEAD_DIM,
                                  d, tc);
                __syncthreads();

#pragma unroll 1
                for (int j = 0; j < n_cols; ++j) {
                    A kv[DPL], vv[DPL];
                    read_smem_row<Tr>(kv, vv, sK[j], sV[j], tc);
#pragma unroll
                    for (int t = 0; t < ROWS_PER_GROUP; ++t) {
                        A s, dp, p, ds;
                        // S_ij = Q_i K_jᵀ, dP_ij = dO_i V_jᵀ
                        score_dots<Tr>(qr[t], kv, dor[t], vv, s, dp);
                        if (!complete_scores<CHUNKED>(s, dp, sS, sdP, tc.row(t), j, c, last,
                                                      tc.g))
                            continue;
                        const int i = row0 + t;
                        // P_ij = exp2(S_ij·scale·log2 e − lse_i·log2 e), dS_ij = P_ij (dP_ij − D_i)
                        const bool hidden = mask.masked(i, n0 + j);
                        if (plain) {
                            recompute_p_ds(s, dp, scale_log2, lse2[t], Di[t], hidden, p, ds);
                        } else {  // the variants' chain: dbias from dS, dQ from dS_raw
                            A ds_biased;
                            recompute_p_ds_variants(s, dp, scale, lse2[t], Di[t],
                                                    hidden || i >= Nq, var, i, n0 + j, p,
                                                    ds_biased, ds);
                            if (write_dbias && tc.g == 0 && i < Nq)
                                dbias_bh[i * dbias_sr + (n0 + j) * dbias_sc] += ds_biased;
                            // the score_mod's arrays' gradients: every lane calls, lane 0 of
                            // the group adds (a padding row: dS = 0); the own-0 chunk's block
                            if (own == 0)
                                var.add_mod_grads(s * scale, min(i, Nq - 1), n0 + j,
                                                  tc.g == 0 ? ds_biased : A(0));
                        }
                        axpy<Tr>(ds, kv, dqr[t]);  // dQ_i += dS_ij K_j
                    }
                }
            }
        }

        // -- epilogue: this block's chunk of dQ_i = (Σ dS_ij K_j) · scale
        store_rows<Tr>(dq + b * dq_st.b + h * dq_st.h + q_row0 * dq_st.r, dq_st.r, dqr, scale,
                       row0, Nq, own * HEAD_DIM, d, tc);
    }
}
