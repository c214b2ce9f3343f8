// flash_fwd.cu — FlashAttention-2 forward (Algorithm 1 of the FA2 paper), plain SIMT.
//
// One thread block per (query block i, head-dim chunk, head h, batch b). Q_i stays in
// shared memory while K_j, V_j stream through it; each row keeps the online-softmax
// state (m_i, ℓ_i) and an *unscaled* accumulator acc = Σ_j exp(S_ij − m_i) V_j, rescaled
// only when m_i grows, and divided by ℓ_i once at the end.
//
//   prologue   load Q_i                                          (Algorithm 1, line 4)
//   main loop  for each K_j, V_j tile below the causal diagonal   (lines 6-10)
//                S = Q_i K_jᵀ · scale·log2 e;  m_new = max(m_i, rowmax S)
//                P̃ = exp2(S − m_new);  ℓ_i = exp2(m_i − m_new) ℓ_i + rowsum P̃
//                acc = exp2(m_i − m_new) acc + P̃ V_j
//   epilogue   O_i = acc / ℓ_i,  lse_i = m_i + log ℓ_i           (lines 12-13)
//
// Head dims beyond the compiled bucket D run in D-wide chunks: S accumulates over every
// chunk of Q and K, and blockIdx selects which D columns of V (and O) this block owns.
// Varlen and KV-cache layouts, and split-KV: seqlens.cuh.
#include "common.cuh"
#include "mask.cuh"
#include "seqlens.cuh"
#include "variants.cuh"
#include "attn_tile.cuh"

using namespace cuflash;

// minBlocksPerSM = 1 lets ptxas use the registers it needs: with the bare thread count it
// sometimes aims at a higher occupancy and spills (sm_90, double, D = 128).
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS>
__global__ void __launch_bounds__(NUM_WARPS * 32, 1)
flash_fwd_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                 T* __restrict__ o, accum_t<T>* __restrict__ lse,
                 int Hq, int group, int Nq, int Nk, int d,
                 __grid_constant__ const Strides q_st, __grid_constant__ const Strides k_st,
                 __grid_constant__ const Strides v_st, __grid_constant__ const Strides o_st,
                 accum_t<T> scale, int causal, int num_m_blocks, int num_d_chunks,
                 CUFLASH_SEQLENS_PARAMS(accum_t<T>), CUFLASH_VARIANT_PARAMS(T)) {
    using Tr = AttnTileTraits<T, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS>;
    using A = typename Tr::A;
    constexpr int TR = Tr::kRowsPerThread, TC = Tr::kColsPerThread, TD = Tr::kDimPerThread;

    // Block → (m_block, d_chunk, split, h, b). Query blocks run last-first: under causal
    // masking the last ones see the most keys, and starting them first evens out the tail.
    int bid = blockIdx.x;
    const int m_block = num_m_blocks - 1 - bid % num_m_blocks;
    bid /= num_m_blocks;
    const int d_chunk = bid % num_d_chunks;
    bid /= num_d_chunks;
    const int split = bid % layout.num_splits;
    bid /= layout.num_splits;
    const int h = bid % Hq;
    const int b = bid / Hq;
    const int h_kv = h / group;  // GQA/MQA: `group` consecutive query heads share K/V

    const Seqlens seq = CUFLASH_SEQLENS;
    Nq = seq.len_q(b, Nq);  // from here on, batch row b's own lengths
    Nk = seq.len_k(b, Nk);
    const int m0 = m_block * BLOCK_M;
    if (m0 >= Nq) return;  // past this sequence's end (the grid fits the longest)
    const long long q_row0 = seq.start_q(b);
    const T* q_bh = q + b * q_st.b + h * q_st.h + q_row0 * q_st.r;
    T* o_bh = o + b * o_st.b + h * o_st.h + q_row0 * o_st.r;
    const T* k_h = k + h_kv * k_st.h;  // key tiles: seq.key_tile (padded, packed or paged)
    const T* v_h = v + h_kv * v_st.h;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    A* sQ = reinterpret_cast<A*>(smem_raw);
    A* sK = sQ + Tr::kSmemQ;
    A* sV = sK + Tr::kSmemK;
    A* sP = sV + Tr::kSmemV;

    const ThreadCoord<Tr> tc;
    Variants<T> var = CUFLASH_VARIANTS(T);  // softcap, ALiBi, bias, bool mask, dropout
    const CausalMask mask{Nq, Nk, causal != 0, var.win_left, var.win_right};
    var.bind(b, h, Nq, Nk);
    const int m1 = min(m0 + BLOCK_M, Nq);
    const int dv0 = d_chunk * HEAD_DIM;  // first V/O column this block owns
    // Block skipping: tiles entirely above the diagonal, or outside the window, are never
    // visited (the first tile starts on a BLOCK_N boundary, as without a window).
    int n_begin = mask.key_begin(m0) / BLOCK_N * BLOCK_N;
    int n_end = mask.key_end(m1);
    seq.clip_to_split(split, Nk, BLOCK_N, n_begin, n_end);
    const A scale_log2 = softmax_scale_log2(scale);  // scores in log2 units: P̃ = exp2(S − m)

    // -- prologue: Q_i into shared memory (once, when d fits one chunk); state init
    if (num_d_chunks == 1) load_tile<Tr, BLOCK_M>(sQ, q_bh, q_st.r, m0, Nq, 0, d);

    OnlineSoftmax<A> row[TR];
    A acc[TR][TD];
#pragma unroll
    for (int i = 0; i < TR; ++i) {
        row[i].init();  // m = −inf, ℓ = 0: ℓ here is this lane's partial row sum
#pragma unroll
        for (int t = 0; t < TD; ++t) acc[i][t] = A(0);
    }

    // -- main loop over K_j, V_j
    for (int n0 = n_begin; n0 < n_end; n0 += BLOCK_N) {
        const int kind = var.template tile_kind<BLOCK_M, BLOCK_N>(b, h, m0, n0);
        if (kind == kTileEmpty) continue;  // a block mask's empty tile: never read
        var.enter_tile(kind);
        if (num_d_chunks > 1) load_tile<Tr, BLOCK_M>(sQ, q_bh, q_st.r, m0, Nq, 0, d);
        const T* k_tile = seq.key_tile(k_h, k_st, b, n0);  // key rows n0 ..
        load_tile<Tr, BLOCK_N>(sK, k_tile, k_st.r, 0, Nk - n0, 0, d);
        load_tile<Tr, BLOCK_N>(sV, seq.key_tile(v_h, v_st, b, n0), v_st.r, 0, Nk - n0, dv0,
                               d);
        __syncthreads();

        // -- compute qk: S = Q_i K_jᵀ · scale·log2 e, masked
        A s[TR][TC];
        compute_scores<Tr>(s, sQ, sK, sP, q_bh, q_st.r, k_tile, k_st.r, m0, n0, Nq, Nk, d,
                           num_d_chunks, scale_log2, mask, var, tc);

        // -- update m_i and l_i; P̃ = exp2(S − m_i) into sP
#pragma unroll
        for (int i = 0; i < TR; ++i) {
            A tile_max = neg_inf<A>();
#pragma unroll
            for (int j = 0; j < TC; ++j) tile_max = max_(tile_max, s[i][j]);
            tile_max = warp_reduce_max<Tr::kLaneCols>(tile_max);
            const A alpha = row[i].update(tile_max);  // also rescales ℓ_i
            const A shift = row[i].shift();
            A rowsum = A(0);
#pragma unroll
            for (int j = 0; j < TC; ++j) {
                const A p = fast_exp2(s[i][j] - shift);
                rowsum += p;  // ℓ sums the undropped P̃: lse is the pre-dropout one
                sP[tc.row(i) * Tr::kPStride + tc.col(j)] = p;
            }
            // ℓ stays a per-lane partial sum (alpha is the same on all 8 lanes of the
            // row): the butterfly sum runs once in the epilogue, not once per tile.
            row[i].l_i += rowsum;
#pragma unroll
            for (int t = 0; t < TD; ++t) acc[i][t] *= alpha;
        }
        if (var.dropout()) dropout_sp<Tr>(sP, m0, n0, var, tc);  // P̃ ∘ keep/(1 − p): acc only
        __syncwarp();  // sP rows are written and read by the same warp only

        // -- acc += P̃ V_j
        gemm_pv<Tr>(acc, sP, sV, tc);
        __syncthreads();  // sQ/sK/sV/sP are overwritten by the next tile
    }

    // -- epilogue: O_i = acc / ℓ_i (fully masked rows: ℓ = 0 → O = 0), lse_i
    __syncthreads();  // sQ is reused for staging (no loop iteration may have synced)
#pragma unroll
    for (int i = 0; i < TR; ++i) {
        row[i].l_i = warp_reduce_sum<Tr::kLaneCols>(row[i].l_i);
        const A inv_l = row[i].inv_l();
#pragma unroll
        for (int t = 0; t < TD; ++t)
            sQ[tc.row(i) * Tr::kRowStride + tc.col(t)] = acc[i][t] * inv_l;
        const int gi = m0 + tc.row(i);
        if (d_chunk == 0 && tc.lane_col == 0 && gi < Nq)  // one writer per row
            lse[seq.lse_row(split, b, h, gi)] = row[i].lse();
    }
    __syncthreads();
    // Store through shared memory so consecutive threads write consecutive columns; a
    // split's partial O_i goes to o_part in the accumulation type.
    for (int idx = threadIdx.x; idx < BLOCK_M * HEAD_DIM; idx += Tr::kThreads) {
        const int r = idx / HEAD_DIM, c = idx % HEAD_DIM;
        if (m0 + r >= Nq || dv0 + c >= d) continue;
        const A x = sQ[r * Tr::kRowStride + c];
        if (o_part)
            o_part[seq.lse_row(split, b, h, m0 + r) * d + dv0 + c] = x;
        else
            o_bh[(long long)(m0 + r) * o_st.r + dv0 + c] = from_float<T>(x);
    }
}
