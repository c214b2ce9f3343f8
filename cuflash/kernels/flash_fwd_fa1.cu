// flash_fwd_fa1.cu — FlashAttention(-1) forward in the paper's loop order (FA1 paper,
// Algorithm 1), plain SIMT.
//
// K/V tiles are the OUTER loop and query blocks the inner one, so the running state of
// every query row — O_i (normalised), ℓ_i and m_i — lives in global memory (a scratch
// buffer in the accumulation type) and is read, rescaled and written back at every step:
//
//   line 2    O = 0, ℓ = 0, m = −inf                       (in HBM)
//   line 5    for each K_j, V_j: load to SRAM
//   line 7      for each Q_i: load Q_i, O_i, ℓ_i, m_i
//   line 9        S_ij = Q_i K_jᵀ
//   line 10       m̃_ij = rowmax(S_ij), P̃_ij = exp(S_ij − m̃_ij), ℓ̃_ij = rowsum(P̃_ij)
//   line 11       m_new = max(m_i, m̃_ij), ℓ_new = e^{m_i − m_new} ℓ_i + e^{m̃_ij − m_new} ℓ̃_ij
//   line 12       O_i = diag(ℓ_new)⁻¹ (diag(ℓ_i) e^{m_i − m_new} O_i + e^{m̃_ij − m_new} P̃_ij V_j)
//   line 13       write ℓ_new, m_new back
//
// As in the paper, one thread block handles one (batch, head) — all of its query rows —
// so no two blocks ever touch the same rows of O, ℓ, m. (For d beyond the compiled
// bucket there is one block per head-dim chunk of O; each has its own ℓ, m copy.)
// The epilogue converts O to the output dtype and writes lse = m + log ℓ.
#include "common.cuh"
#include "mask.cuh"
#include "variants.cuh"
#include "attn_tile.cuh"

using namespace cuflash;

// minBlocksPerSM = 1: without it ptxas aims at a higher occupancy for this kernel (the
// FA1 grid has only B·H blocks anyway) and spills at 96 registers.
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS>
__global__ void __launch_bounds__(NUM_WARPS * 32, 1)
flash_fwd_fa1_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                     T* __restrict__ o, accum_t<T>* __restrict__ lse,
                     accum_t<T>* __restrict__ o_acc,  // (B, Hq, Nq, d) scratch, contiguous
                     accum_t<T>* __restrict__ l_buf,  // (num_d_chunks, B, Hq, Nq) scratch
                     accum_t<T>* __restrict__ m_buf,  // (num_d_chunks, B, Hq, Nq) scratch
                     int B, int Hq, int group, int Nq, int Nk, int d,
                     __grid_constant__ const Strides q_st, __grid_constant__ const Strides k_st,
                     __grid_constant__ const Strides v_st, __grid_constant__ const Strides o_st,
                     accum_t<T> scale, int causal, int num_d_chunks,
                     CUFLASH_VARIANT_PARAMS(T)) {
    using Tr = AttnTileTraits<T, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS>;
    using A = typename Tr::A;
    constexpr int TR = Tr::kRowsPerThread, TC = Tr::kColsPerThread, TD = Tr::kDimPerThread;

    int bid = blockIdx.x;
    const int d_chunk = bid % num_d_chunks;
    bid /= num_d_chunks;
    const int h = bid % Hq;
    const int b = bid / Hq;
    const int h_kv = h / group;  // GQA/MQA

    const T* q_bh = q + b * q_st.b + h * q_st.h;
    const T* k_bh = k + b * k_st.b + h_kv * k_st.h;
    const T* v_bh = v + b * v_st.b + h_kv * v_st.h;
    T* o_bh = o + b * o_st.b + h * o_st.h;
    const long long row_base = (long long)b * Hq + h;  // (b, h) row block of lse/ℓ/m
    A* oa_bh = o_acc + row_base * Nq * d;
    A* l_bh = l_buf + ((long long)d_chunk * B * Hq + row_base) * Nq;
    A* m_bh = m_buf + ((long long)d_chunk * B * Hq + row_base) * Nq;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    A* sQ = reinterpret_cast<A*>(smem_raw);
    A* sK = sQ + Tr::kSmemQ;
    A* sV = sK + Tr::kSmemK;
    A* sP = sV + Tr::kSmemV;

    const ThreadCoord<Tr> tc;
    Variants<T> var = CUFLASH_VARIANTS(T);  // softcap, ALiBi, bias, bool mask, dropout
    const CausalMask mask{Nq, Nk, causal != 0, var.win_left, var.win_right};
    var.bind(b, h, Nq, Nk);
    const int dv0 = d_chunk * HEAD_DIM;
    const int dv1 = min(dv0 + HEAD_DIM, d);
    const A scale_log2 = softmax_scale_log2(scale);  // scores in log2 units: P̃ = exp2(S − m)

    // -- line 2: O = 0, ℓ = 0, m = −inf in global memory, with the same thread→element
    // map the updates use: each thread only ever touches its own O elements, and lane 0
    // of a row alone its ℓ, m, so no barrier orders these writes before the loop.
    for (int m0 = 0; m0 < Nq; m0 += BLOCK_M) {
#pragma unroll
        for (int i = 0; i < TR; ++i) {
            const int gi = m0 + tc.row(i);
            if (gi >= Nq) continue;
#pragma unroll
            for (int t = 0; t < TD; ++t)
                if (dv0 + tc.col(t) < dv1) oa_bh[(long long)gi * d + dv0 + tc.col(t)] = A(0);
            if (tc.lane_col == 0) {
                l_bh[gi] = A(0);
                m_bh[gi] = neg_inf<A>();
            }
        }
    }

    // -- line 5: outer loop over K_j, V_j
    for (int n0 = 0; n0 < Nk; n0 += BLOCK_N) {
        load_tile<Tr, BLOCK_N>(sK, k_bh, k_st.r, n0, Nk, 0, d);
        load_tile<Tr, BLOCK_N>(sV, v_bh, v_st.r, n0, Nk, dv0, d);

        // -- line 7: inner loop over Q_i
        for (int m0 = 0; m0 < Nq; m0 += BLOCK_M) {
            const int m1 = min(m0 + BLOCK_M, Nq);
            // Block skipping: K_j lies entirely above the diagonal, or outside the
            // window, for this Q_i.
            if (n0 >= mask.key_end(m1) || n0 + BLOCK_N <= mask.key_begin(m0)) continue;
            load_tile<Tr, BLOCK_M>(sQ, q_bh, q_st.r, m0, Nq, 0, d);
            if (num_d_chunks > 1 && m0 > 0)  // compute_scores left sK at the last chunk
                load_tile<Tr, BLOCK_N>(sK, k_bh, k_st.r, n0, Nk, 0, d);
            __syncthreads();

            // -- line 9: S_ij = Q_i K_jᵀ (scaled by scale·log2 e, masked)
            A s[TR][TC];
            compute_scores<Tr>(s, sQ, sK, sP, q_bh, q_st.r, k_bh + (long long)n0 * k_st.r, k_st.r,
                               m0, n0, Nq, Nk, d, num_d_chunks, scale_log2, mask, var, tc);
            A o_scale[TR];  // diag(ℓ_i) e^{m_i − m_new}: the weight of the old O_i
            A inv_l_new[TR];

#pragma unroll
            for (int i = 0; i < TR; ++i) {
                const int gi = m0 + tc.row(i);
                // -- line 8: load ℓ_i, m_i. Lane 0 of the row alone reads them and
                // broadcasts: it is also the one that writes them back below, so no lane
                // ever reads a value another lane is about to overwrite.
                OnlineSoftmax<A> st;
                st.init();  // rows ≥ Nq (padding): an empty state
                if (tc.lane_col == 0 && gi < Nq) {
                    st.l_i = l_bh[gi];
                    st.m_i = m_bh[gi];
                }
                st.l_i = __shfl_sync(0xffffffffu, st.l_i, 0, Tr::kLaneCols);
                st.m_i = __shfl_sync(0xffffffffu, st.m_i, 0, Tr::kLaneCols);

                // -- line 10: m̃ = rowmax S, P̃ = exp2(S − m̃), ℓ̃ = rowsum P̃
                A m_tile = neg_inf<A>();
#pragma unroll
                for (int j = 0; j < TC; ++j) m_tile = max_(m_tile, s[i][j]);
                OnlineSoftmax<A> tile{warp_reduce_max<Tr::kLaneCols>(m_tile), A(0)};
#pragma unroll
                for (int j = 0; j < TC; ++j) {
                    // shift() guards m̃ = −inf (every key of the tile masked): P̃ = 0, not NaN
                    s[i][j] = fast_exp2(s[i][j] - tile.shift());
                    tile.l_i += s[i][j];
                }
                tile.l_i = warp_reduce_sum<Tr::kLaneCols>(tile.l_i);

                // -- line 11: (m_new, ℓ_new) = (m_i, ℓ_i) ⊕ (m̃, ℓ̃)
                const A l_old = st.l_i;
                const A alpha = st.merge(tile);      // e^{m_i − m_new}
                const A beta = st.weight(tile.m_i);  // e^{m̃_ij − m_new}
                o_scale[i] = l_old * alpha;
                inv_l_new[i] = st.inv_l();  // ℓ_new = 0 only if the row saw no key yet: O = 0

                // P̃ enters line 12 multiplied by e^{m̃ − m_new}: fold it in here (dropout's
                // keep/(1 − p) below; ℓ above summed the undropped P̃).
#pragma unroll
                for (int j = 0; j < TC; ++j)
                    sP[tc.row(i) * Tr::kPStride + tc.col(j)] = s[i][j] * beta;

                if (tc.lane_col == 0 && gi < Nq) {  // -- line 13: write ℓ_new, m_new
                    l_bh[gi] = st.l_i;
                    m_bh[gi] = st.m_i;
                }
            }
            if (var.dropout()) dropout_sp<Tr>(sP, m0, n0, var, tc);
            __syncwarp();  // sP rows are written and read by the same warp only

            // -- line 12: O_i = (diag(ℓ_i) e^{m_i−m_new} O_i + e^{m̃−m_new} P̃ V_j) / ℓ_new
            A acc[TR][TD];
#pragma unroll
            for (int i = 0; i < TR; ++i) {
                const int gi = m0 + tc.row(i);
#pragma unroll
                for (int t = 0; t < TD; ++t) {
                    const int c = dv0 + tc.col(t);
                    acc[i][t] = (gi < Nq && c < dv1)
                                    ? o_scale[i] * oa_bh[(long long)gi * d + c] : A(0);
                }
            }
            gemm_pv<Tr>(acc, sP, sV, tc);
#pragma unroll
            for (int i = 0; i < TR; ++i) {
                const int gi = m0 + tc.row(i);
#pragma unroll
                for (int t = 0; t < TD; ++t) {
                    const int c = dv0 + tc.col(t);
                    if (gi < Nq && c < dv1) oa_bh[(long long)gi * d + c] = acc[i][t] * inv_l_new[i];
                }
            }
            __syncthreads();  // sQ/sK/sP are overwritten by the next Q_i (or K_j)
        }
        __syncthreads();  // sK/sV are overwritten by the next K_j
    }

    // -- epilogue: O (normalised already) to the output dtype; lse = (m + log2 ℓ) ln 2.
    // Every element is converted by the thread that last wrote it (no barrier needed).
    for (int m0 = 0; m0 < Nq; m0 += BLOCK_M) {
#pragma unroll
        for (int i = 0; i < TR; ++i) {
            const int gi = m0 + tc.row(i);
            if (gi >= Nq) continue;
#pragma unroll
            for (int t = 0; t < TD; ++t) {
                const int c = dv0 + tc.col(t);
                if (c < dv1)
                    o_bh[(long long)gi * o_st.r + c] = from_float<T>(oa_bh[(long long)gi * d + c]);
            }
            if (d_chunk == 0 && tc.lane_col == 0) {
                OnlineSoftmax<A> st{m_bh[gi], l_bh[gi]};
                lse[row_base * Nq + gi] = st.lse();
            }
        }
    }
}
