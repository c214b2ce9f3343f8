// flash_bwd.cu — FlashAttention-2 backward pass (plain SIMT: shared memory, shuffles, FMA).
//
// Forward:  S = scale · Q Kᵀ,  P = exp(S − lse),  O = P V          (lse stored per row)
// Backward (FlashAttention-2, Algorithm 2), with P recomputed from lse, never stored:
//     D   = rowsum(dO ∘ O)                       flash_bwd_preprocess_kernel
//     dV  = Pᵀ dO                                flash_bwd_dkdv_kernel
//     dP  = dO Vᵀ                                flash_bwd_dkdv_kernel, flash_bwd_dq_kernel
//     dS  = P ∘ (dP − D)                         both
//     dK  = dSᵀ Q · scale                        flash_bwd_dkdv_kernel
//     dQ  = dS K · scale                         flash_bwd_dq_kernel
//
// Work split — every output element is written by exactly one thread, in a fixed order:
// no atomics, so every run is bitwise identical.
//   * dK/dV: one thread block per (K/V block of BC keys, kv head, batch). K_j, V_j, dK_j,
//     dV_j live in registers; Q_i, dO_i tiles (BR rows) are streamed through shared
//     memory. Under GQA the block also loops over the query heads of its group, so the
//     sum over the group needs no atomics.
//   * dQ: one thread block per (Q block, query head, batch). Q_i, dO_i, dQ_i live in
//     registers; K_j, V_j tiles (BC rows) are streamed through shared memory.
//
// Thread layout (both kernels): a warp is cut into 32/G groups of G lanes. A group owns
// a few rows (keys for dK/dV, queries for dQ); lane g of the group holds the head-dim
// columns g, g+G, g+2G, …  (DPL = D/G of them). A dot product over d is DPL FMAs per
// lane plus log2(G) xor-shuffles; interleaved columns make a group's shared-memory reads
// of one row consecutive words (conflict-free; all groups read the same row = broadcast).
//
// Layout of the arguments: q, dO, o are (B, Hq, Nq, d) and k, v are (B, Hkv, Nk, d) with
// any int64 element strides for the first three axes and a contiguous last axis; lse and
// D are contiguous (B, Hq, Nq) in the accumulation type; dq/dk/dv get their own strides.
// D (the template parameter) is the head-dim bucket: columns d..D−1 are treated as zero.
// d > D (beyond the largest bucket) runs the *_chunked kernels at the end of this file.
// Causal masking is bottom-right aligned: key j is masked for query i when j > i + Nk − Nq.

#include "bwd_utils.cuh"

using cuflash::accum_t;
using cuflash::fast_exp2;
using cuflash::from_float;
using cuflash::MathConst;
using cuflash::neg_inf;
using cuflash::to_float;
using cuflash::warp_reduce_sum;
using cuflash_bwd::fma_acc;
using cuflash_bwd::imax;
using cuflash_bwd::imin;
using cuflash_bwd::lse_log2;

typedef long long i64;

// ─────────────────────────────────────────────────────────────────────────────────────
// Preprocess: D_i = rowsum(dO_i ∘ O_i), one warp per query row.
// ─────────────────────────────────────────────────────────────────────────────────────
template <typename T>
__global__ void __launch_bounds__(128)
flash_bwd_preprocess_kernel(const T* __restrict__ dO, const T* __restrict__ O,
                            accum_t<T>* __restrict__ Dout,
                            int H, int N, int d, i64 rows,
                            i64 do_sb, i64 do_sh, i64 do_sn,
                            i64 o_sb, i64 o_sh, i64 o_sn) {
    using Acc = accum_t<T>;
    const int lane = threadIdx.x & 31;
    const i64 row = (i64)blockIdx.x * 4 + (threadIdx.x >> 5);
    if (row >= rows) return;  // whole warp leaves together: the shuffles below stay full
    const i64 n = row % N;
    const i64 h = (row / N) % H;
    const i64 b = row / ((i64)N * H);
    const T* dOr = dO + b * do_sb + h * do_sh + n * do_sn;
    const T* Or = O + b * o_sb + h * o_sh + n * o_sn;
    Acc acc = Acc(0);
    for (int c = lane; c < d; c += 32) acc += to_float(dOr[c]) * to_float(Or[c]);
    acc = warp_reduce_sum<32>(acc);
    if (lane == 0) Dout[row] = acc;  // D is contiguous (B, H, N)
}

// ─────────────────────────────────────────────────────────────────────────────────────
// dK, dV: one K/V block per thread block, Q/dO tiles streamed.
//   T      element type (__half, __nv_bfloat16, float, double)
//   D      head-dim bucket (32, 64, 128, 256), G lanes per key, DPL = D/G columns a lane
//   KPG    keys per lane group (register blocking: each Q/dO value read from shared
//          memory serves KPG keys)
//   NWARPS warps per block; BC = NWARPS·(32/G)·KPG keys per block
//   BR     query rows per shared-memory tile
// Shared memory (static): 2·BR·D + 2·BR accumulators (mirrored in cuflash/tiling.py:bwd_smem_bytes).
// ─────────────────────────────────────────────────────────────────────────────────────
template <typename T, int D, int G, int KPG, int NWARPS, int BR, bool CAUSAL>
__global__ void __launch_bounds__(NWARPS * 32)
flash_bwd_dkdv_kernel(const T* __restrict__ q, const T* __restrict__ k,
                      const T* __restrict__ v, const T* __restrict__ dO,
                      const accum_t<T>* __restrict__ lse,
                      const accum_t<T>* __restrict__ Dvec,
                      T* __restrict__ dk, T* __restrict__ dv,
                      int Hq, int Hkv, int Nq, int Nk, int d,
                      accum_t<T> scale,
                      i64 q_sb, i64 q_sh, i64 q_sn,
                      i64 k_sb, i64 k_sh, i64 k_sn,
                      i64 v_sb, i64 v_sh, i64 v_sn,
                      i64 do_sb, i64 do_sh, i64 do_sn,
                      i64 dk_sb, i64 dk_sh, i64 dk_sn,
                      i64 dv_sb, i64 dv_sh, i64 dv_sn) {
    using Acc = accum_t<T>;
    static_assert(G >= 1 && G <= 32 && (G & (G - 1)) == 0, "G must be a power of two <= 32");
    static_assert(D % G == 0, "the head-dim bucket D must be a multiple of G");
    constexpr int DPL = D / G;                 // columns per lane
    constexpr int NT = NWARPS * 32;
    constexpr int BC = NWARPS * (32 / G) * KPG;

    __shared__ Acc sQ[BR][D];    // Q_i  (zero beyond d and Nq)
    __shared__ Acc sdO[BR][D];   // dO_i
    __shared__ Acc sL[BR];       // lse_i · log2(e), +inf for rows that see no key
    __shared__ Acc sD[BR];       // D_i

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int g = lane % G;                              // lane within its group
    const int grp = (tid >> 5) * (32 / G) + lane / G;   // group within the block
    const int c0 = blockIdx.x * BC;                      // first key of the block
    const int hkv = blockIdx.y;
    const i64 b = blockIdx.z;
    const int group_size = Hq / Hkv;                     // query heads per K/V head (GQA)
    const int off = Nk - Nq;                             // bottom-right causal alignment

    // Fold scale and log2(e) into one multiply: P = exp2(S·scale·log2e − lse·log2e).
    const Acc scale_log2 = scale * MathConst<Acc>::log2e;

    // ── prologue: K_j, V_j into registers; dK_j, dV_j accumulators to zero ──
    Acc kr[KPG][DPL], vr[KPG][DPL], dkr[KPG][DPL], dvr[KPG][DPL];
    const T* kb = k + b * k_sb + hkv * k_sh;
    const T* vb = v + b * v_sb + hkv * v_sh;
#pragma unroll
    for (int t = 0; t < KPG; ++t) {
        const int key = c0 + grp * KPG + t;
#pragma unroll
        for (int j = 0; j < DPL; ++j) {
            const int col = g + G * j;
            const bool ok = key < Nk && col < d;
            kr[t][j] = ok ? to_float(kb[key * k_sn + col]) : Acc(0);
            vr[t][j] = ok ? to_float(vb[key * v_sn + col]) : Acc(0);
            dkr[t][j] = Acc(0);
            dvr[t][j] = Acc(0);
        }
    }

    // Causal block skipping: rows i < c0 − off see none of this block's keys.
    int row_begin = 0;
    if (CAUSAL) row_begin = imax(0, c0 - off);
    row_begin = (row_begin / BR) * BR;

    // ── main loop: the group's query heads, then Q tiles ──
    for (int hq = hkv * group_size; hq < (hkv + 1) * group_size; ++hq) {
        const T* qb = q + b * q_sb + hq * q_sh;
        const T* dob = dO + b * do_sb + hq * do_sh;
        const Acc* lseb = lse + (b * Hq + hq) * (i64)Nq;
        const Acc* Db = Dvec + (b * Hq + hq) * (i64)Nq;
        for (int r0 = row_begin; r0 < Nq; r0 += BR) {
            __syncthreads();  // every thread is done with the previous tile
            for (int idx = tid; idx < BR * D; idx += NT) {
                const int r = idx / D, col = idx % D;
                const int row = r0 + r;
                const bool ok = row < Nq && col < d;
                sQ[r][col] = ok ? to_float(qb[row * q_sn + col]) : Acc(0);
                sdO[r][col] = ok ? to_float(dob[row * do_sn + col]) : Acc(0);
            }
            for (int r = tid; r < BR; r += NT) {
                const int row = r0 + r;
                // Padding rows act as fully masked rows: lse = −inf → P = 0.
                sL[r] = lse_log2(row < Nq ? lseb[row] : neg_inf<Acc>());
                sD[r] = row < Nq ? Db[row] : Acc(0);
            }
            __syncthreads();

            const int nrows = imin(BR, Nq - r0);
#pragma unroll 1
            for (int r = 0; r < nrows; ++r) {
                const int row = r0 + r;
                Acc qv[DPL], dov[DPL];
#pragma unroll
                for (int j = 0; j < DPL; ++j) {
                    qv[j] = sQ[r][g + G * j];
                    dov[j] = sdO[r][g + G * j];
                }
                const Acc Lr = sL[r], Dr = sD[r];
#pragma unroll
                for (int t = 0; t < KPG; ++t) {
                    // S_ij = q_i · k_j and dP_ij = dO_i · v_j: per-lane partial dots, then
                    // a sum over the group's G lanes.
                    Acc s = Acc(0), dp = Acc(0);
#pragma unroll
                    for (int j = 0; j < DPL; ++j) {
                        s = fma_acc(qv[j], kr[t][j], s);
                        dp = fma_acc(dov[j], vr[t][j], dp);
                    }
                    s = warp_reduce_sum<G>(s);
                    dp = warp_reduce_sum<G>(dp);
                    Acc p = fast_exp2(s * scale_log2 - Lr);       // P_ij = exp(S_ij − lse_i)
                    if (CAUSAL && c0 + grp * KPG + t > row + off) p = Acc(0);
                    const Acc ds = p * (dp - Dr);                 // dS_ij = P_ij (dP_ij − D_i)
#pragma unroll
                    for (int j = 0; j < DPL; ++j) {
                        dvr[t][j] = fma_acc(p, dov[j], dvr[t][j]);   // dV_j += P_ijᵀ dO_i
                        dkr[t][j] = fma_acc(ds, qv[j], dkr[t][j]);   // dK_j += dS_ijᵀ Q_i
                    }
                }
            }
        }
    }

    // ── epilogue: dK_j · scale, dV_j → global, in the element type ──
    T* dkb = dk + b * dk_sb + hkv * dk_sh;
    T* dvb = dv + b * dv_sb + hkv * dv_sh;
#pragma unroll
    for (int t = 0; t < KPG; ++t) {
        const int key = c0 + grp * KPG + t;
        if (key >= Nk) continue;
#pragma unroll
        for (int j = 0; j < DPL; ++j) {
            const int col = g + G * j;
            if (col < d) {
                dkb[key * dk_sn + col] = from_float<T>(dkr[t][j] * scale);
                dvb[key * dv_sn + col] = from_float<T>(dvr[t][j]);
            }
        }
    }
}

// ─────────────────────────────────────────────────────────────────────────────────────
// dQ: one Q block per thread block, K/V tiles streamed.
//   QPG    query rows per lane group; BRQ = NWARPS·(32/G)·QPG rows per block
//   BC     keys per shared-memory tile
// Shared memory (static): 2·BC·D accumulators (mirrored in cuflash/tiling.py:bwd_smem_bytes).
// ─────────────────────────────────────────────────────────────────────────────────────
template <typename T, int D, int G, int QPG, int NWARPS, int BC, bool CAUSAL>
__global__ void __launch_bounds__(NWARPS * 32)
flash_bwd_dq_kernel(const T* __restrict__ q, const T* __restrict__ k,
                    const T* __restrict__ v, const T* __restrict__ dO,
                    const accum_t<T>* __restrict__ lse,
                    const accum_t<T>* __restrict__ Dvec,
                    T* __restrict__ dq,
                    int Hq, int Hkv, int Nq, int Nk, int d,
                    accum_t<T> scale,
                    i64 q_sb, i64 q_sh, i64 q_sn,
                    i64 k_sb, i64 k_sh, i64 k_sn,
                    i64 v_sb, i64 v_sh, i64 v_sn,
                    i64 do_sb, i64 do_sh, i64 do_sn,
                    i64 dq_sb, i64 dq_sh, i64 dq_sn) {
    using Acc = accum_t<T>;
    static_assert(G >= 1 && G <= 32 && (G & (G - 1)) == 0, "G must be a power of two <= 32");
    static_assert(D % G == 0, "the head-dim bucket D must be a multiple of G");
    constexpr int DPL = D / G;
    constexpr int NT = NWARPS * 32;
    constexpr int BRQ = NWARPS * (32 / G) * QPG;

    __shared__ Acc sK[BC][D];   // K_j (zero beyond d)
    __shared__ Acc sV[BC][D];   // V_j

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int g = lane % G;
    const int grp = (tid >> 5) * (32 / G) + lane / G;
    const int r0 = blockIdx.x * BRQ;                     // first query row of the block
    const int hq = blockIdx.y;
    const i64 b = blockIdx.z;
    const int hkv = hq / (Hq / Hkv);                     // GQA: the K/V head this head reads
    const int off = Nk - Nq;
    const Acc scale_log2 = scale * MathConst<Acc>::log2e;

    // ── prologue: Q_i, dO_i, lse_i, D_i into registers; dQ_i to zero ──
    Acc qr[QPG][DPL], dor[QPG][DPL], dqr[QPG][DPL], Lr[QPG], Dr[QPG];
    const T* qb = q + b * q_sb + hq * q_sh;
    const T* dob = dO + b * do_sb + hq * do_sh;
    const Acc* lseb = lse + (b * Hq + hq) * (i64)Nq;
    const Acc* Db = Dvec + (b * Hq + hq) * (i64)Nq;
#pragma unroll
    for (int t = 0; t < QPG; ++t) {
        const int row = r0 + grp * QPG + t;
#pragma unroll
        for (int j = 0; j < DPL; ++j) {
            const int col = g + G * j;
            const bool ok = row < Nq && col < d;
            qr[t][j] = ok ? to_float(qb[row * q_sn + col]) : Acc(0);
            dor[t][j] = ok ? to_float(dob[row * do_sn + col]) : Acc(0);
            dqr[t][j] = Acc(0);
        }
        // Padding rows act as fully masked rows: lse = −inf → P = 0.
        Lr[t] = lse_log2(row < Nq ? lseb[row] : neg_inf<Acc>());
        Dr[t] = row < Nq ? Db[row] : Acc(0);
    }

    // Causal block skipping: keys j > (last row of the block) + off are masked for all rows.
    int c_end = Nk;
    if (CAUSAL) c_end = imax(0, imin(Nk, r0 + BRQ + off));

    const T* kb = k + b * k_sb + hkv * k_sh;
    const T* vb = v + b * v_sb + hkv * v_sh;
    // ── main loop over K/V tiles ──
    for (int c0 = 0; c0 < c_end; c0 += BC) {
        __syncthreads();  // every thread is done with the previous tile
        for (int idx = tid; idx < BC * D; idx += NT) {
            const int c = idx / D, col = idx % D;
            const int key = c0 + c;
            const bool ok = key < Nk && col < d;
            sK[c][col] = ok ? to_float(kb[key * k_sn + col]) : Acc(0);
            sV[c][col] = ok ? to_float(vb[key * v_sn + col]) : Acc(0);
        }
        __syncthreads();

        const int ncols = imin(BC, c_end - c0);
#pragma unroll 1
        for (int c = 0; c < ncols; ++c) {
            const int key = c0 + c;
            Acc kv[DPL], vv[DPL];
#pragma unroll
            for (int j = 0; j < DPL; ++j) {
                kv[j] = sK[c][g + G * j];
                vv[j] = sV[c][g + G * j];
            }
#pragma unroll
            for (int t = 0; t < QPG; ++t) {
                Acc s = Acc(0), dp = Acc(0);
#pragma unroll
                for (int j = 0; j < DPL; ++j) {
                    s = fma_acc(qr[t][j], kv[j], s);       // S_ij = q_i · k_j
                    dp = fma_acc(dor[t][j], vv[j], dp);    // dP_ij = dO_i · v_j
                }
                s = warp_reduce_sum<G>(s);
                dp = warp_reduce_sum<G>(dp);
                Acc p = fast_exp2(s * scale_log2 - Lr[t]);          // P_ij = exp(S_ij − lse_i)
                if (CAUSAL && key > r0 + grp * QPG + t + off) p = Acc(0);
                const Acc ds = p * (dp - Dr[t]);                   // dS_ij = P_ij (dP_ij − D_i)
#pragma unroll
                for (int j = 0; j < DPL; ++j) dqr[t][j] = fma_acc(ds, kv[j], dqr[t][j]);  // dQ_i += dS_ij K_j
            }
        }
    }

    // ── epilogue: dQ_i · scale → global ──
    T* dqb = dq + b * dq_sb + hq * dq_sh;
#pragma unroll
    for (int t = 0; t < QPG; ++t) {
        const int row = r0 + grp * QPG + t;
        if (row >= Nq) continue;
#pragma unroll
        for (int j = 0; j < DPL; ++j) {
            const int col = g + G * j;
            if (col < d) dqb[row * dq_sn + col] = from_float<T>(dqr[t][j] * scale);
        }
    }
}

// ─────────────────────────────────────────────────────────────────────────────────────
// Head dims beyond the largest bucket (d > D): the two kernels above, in D-wide chunks.
//
// As in the forward (flash_fwd.cu), a block owns one D-wide chunk of the columns it
// writes — blockIdx.x = (row block) · num_d_chunks + chunk — and the scores sum over
// every chunk:
//     S_ij = Σ_c Q_i[c] · K_j[c],   dP_ij = Σ_c dO_i[c] · V_j[c]
// The chunks of one tile are visited in turn, the block's own chunk last. After each of
// the others, lane 0 of the group that owns (i, j) adds its partial S_ij, dP_ij to the
// shared tiles sS, sdP (one writer per element; a barrier between chunks). On the own
// chunk every lane of the group adds the stored partials to its fresh ones and
// accumulates exactly as the one-chunk kernels do, from the chunk still in shared memory
// and registers — so the per-thread state (and the register budget) is that of the
// fast path. The scores are recomputed once per output chunk, the price of never holding
// more than D columns on chip. `causal` is a run-time flag here (half the
// specializations; this is not the fast path). minBlocksPerSM = 1, as in flash_fwd.cu:
// with the bare thread count ptxas capped sm_70's 16-bit dK/dV kernel at 128 registers
// and spilled 28 bytes.
// ─────────────────────────────────────────────────────────────────────────────────────

// dK, dV for d > D. Shared memory (static): 2·BR·D + 2·BR + 2·BR·BC accumulators
// (mirrored in cuflash/tiling.py:bwd_smem_bytes).
template <typename T, int D, int G, int KPG, int NWARPS, int BR>
__global__ void __launch_bounds__(NWARPS * 32, 1)
flash_bwd_dkdv_chunked_kernel(const T* __restrict__ q, const T* __restrict__ k,
                              const T* __restrict__ v, const T* __restrict__ dO,
                              const accum_t<T>* __restrict__ lse,
                              const accum_t<T>* __restrict__ Dvec,
                              T* __restrict__ dk, T* __restrict__ dv,
                              int Hq, int Hkv, int Nq, int Nk, int d,
                              accum_t<T> scale,
                              i64 q_sb, i64 q_sh, i64 q_sn,
                              i64 k_sb, i64 k_sh, i64 k_sn,
                              i64 v_sb, i64 v_sh, i64 v_sn,
                              i64 do_sb, i64 do_sh, i64 do_sn,
                              i64 dk_sb, i64 dk_sh, i64 dk_sn,
                              i64 dv_sb, i64 dv_sh, i64 dv_sn,
                              int causal, int num_d_chunks) {
    using Acc = accum_t<T>;
    static_assert(G >= 1 && G <= 32 && (G & (G - 1)) == 0, "G must be a power of two <= 32");
    static_assert(D % G == 0, "the head-dim bucket D must be a multiple of G");
    constexpr int DPL = D / G;
    constexpr int NT = NWARPS * 32;
    constexpr int BC = NWARPS * (32 / G) * KPG;

    __shared__ Acc sQ[BR][D];    // Q_i, one chunk (zero beyond d and Nq)
    __shared__ Acc sdO[BR][D];   // dO_i, the same chunk
    __shared__ Acc sL[BR];       // lse_i · log2(e), +inf for rows that see no key
    __shared__ Acc sD[BR];       // D_i
    __shared__ Acc sS[BR][BC];   // Σ over the chunks visited so far of S_ij
    __shared__ Acc sdP[BR][BC];  // … of dP_ij

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int g = lane % G;
    const int grp = (tid >> 5) * (32 / G) + lane / G;
    const int own = blockIdx.x % num_d_chunks;           // the chunk of dK, dV this block owns
    const int c0 = (blockIdx.x / num_d_chunks) * BC;     // first key of the block
    const int hkv = blockIdx.y;
    const i64 b = blockIdx.z;
    const int group_size = Hq / Hkv;
    const int off = Nk - Nq;
    const Acc scale_log2 = scale * MathConst<Acc>::log2e;

    // ── prologue: dK_j, dV_j (own chunk) to zero ──
    Acc kr[KPG][DPL], vr[KPG][DPL], dkr[KPG][DPL], dvr[KPG][DPL];
#pragma unroll
    for (int t = 0; t < KPG; ++t)
#pragma unroll
        for (int j = 0; j < DPL; ++j) {
            dkr[t][j] = Acc(0);
            dvr[t][j] = Acc(0);
        }
    const T* kb = k + b * k_sb + hkv * k_sh;
    const T* vb = v + b * v_sb + hkv * v_sh;

    int row_begin = 0;
    if (causal) row_begin = imax(0, c0 - off);
    row_begin = (row_begin / BR) * BR;

    // ── main loop: the group's query heads, Q tiles, then head-dim chunks (own last) ──
    for (int hq = hkv * group_size; hq < (hkv + 1) * group_size; ++hq) {
        const T* qb = q + b * q_sb + hq * q_sh;
        const T* dob = dO + b * do_sb + hq * do_sh;
        const Acc* lseb = lse + (b * Hq + hq) * (i64)Nq;
        const Acc* Db = Dvec + (b * Hq + hq) * (i64)Nq;
        for (int r0 = row_begin; r0 < Nq; r0 += BR) {
            const int nrows = imin(BR, Nq - r0);
            for (int i = 0; i < num_d_chunks; ++i) {
                const int chunk = (own + 1 + i) % num_d_chunks;
                const bool last = i == num_d_chunks - 1;   // the own chunk
                const int col0 = chunk * D;
                __syncthreads();  // every thread is done with the previous chunk / tile
                for (int idx = tid; idx < BR * D; idx += NT) {
                    const int r = idx / D, col = idx % D;
                    const int row = r0 + r;
                    const bool ok = row < Nq && col0 + col < d;
                    sQ[r][col] = ok ? to_float(qb[row * q_sn + col0 + col]) : Acc(0);
                    sdO[r][col] = ok ? to_float(dob[row * do_sn + col0 + col]) : Acc(0);
                }
                if (i == 0) {
                    for (int r = tid; r < BR; r += NT) {
                        const int row = r0 + r;
                        sL[r] = lse_log2(row < Nq ? lseb[row] : neg_inf<Acc>());
                        sD[r] = row < Nq ? Db[row] : Acc(0);
                    }
                }
                // K_j, V_j of this chunk into registers.
#pragma unroll
                for (int t = 0; t < KPG; ++t) {
                    const int key = c0 + grp * KPG + t;
#pragma unroll
                    for (int j = 0; j < DPL; ++j) {
                        const int col = col0 + g + G * j;
                        const bool ok = key < Nk && col < d;
                        kr[t][j] = ok ? to_float(kb[key * k_sn + col]) : Acc(0);
                        vr[t][j] = ok ? to_float(vb[key * v_sn + col]) : Acc(0);
                    }
                }
                __syncthreads();

#pragma unroll 1
                for (int r = 0; r < nrows; ++r) {
                    const int row = r0 + r;
                    Acc qv[DPL], dov[DPL];
#pragma unroll
                    for (int j = 0; j < DPL; ++j) {
                        qv[j] = sQ[r][g + G * j];
                        dov[j] = sdO[r][g + G * j];
                    }
#pragma unroll
                    for (int t = 0; t < KPG; ++t) {
                        const int kc = grp * KPG + t;          // key within the block
                        Acc s = Acc(0), dp = Acc(0);           // this chunk's partial dots
#pragma unroll
                        for (int j = 0; j < DPL; ++j) {
                            s = fma_acc(qv[j], kr[t][j], s);
                            dp = fma_acc(dov[j], vr[t][j], dp);
                        }
                        s = warp_reduce_sum<G>(s);
                        dp = warp_reduce_sum<G>(dp);
                        if (!last) {  // lane 0 of the group keeps the running sums
                            if (g == 0) {
                                sS[r][kc] = i > 0 ? sS[r][kc] + s : s;
                                sdP[r][kc] = i > 0 ? sdP[r][kc] + dp : dp;
                            }
                            continue;
                        }
                        if (i > 0) {  // the own chunk: add the others' sums (barrier since)
                            s += sS[r][kc];
                            dp += sdP[r][kc];
                        }
                        Acc p = fast_exp2(s * scale_log2 - sL[r]);    // P_ij = exp(S_ij − lse_i)
                        if (causal && c0 + kc > row + off) p = Acc(0);
                        const Acc ds = p * (dp - sD[r]);              // dS_ij = P_ij (dP_ij − D_i)
#pragma unroll
                        for (int j = 0; j < DPL; ++j) {
                            dvr[t][j] = fma_acc(p, dov[j], dvr[t][j]);   // dV_j += P_ijᵀ dO_i
                            dkr[t][j] = fma_acc(ds, qv[j], dkr[t][j]);   // dK_j += dS_ijᵀ Q_i
                        }
                    }
                }
            }
        }
    }

    // ── epilogue: this block's chunk of dK_j · scale, dV_j → global ──
    T* dkb = dk + b * dk_sb + hkv * dk_sh;
    T* dvb = dv + b * dv_sb + hkv * dv_sh;
#pragma unroll
    for (int t = 0; t < KPG; ++t) {
        const int key = c0 + grp * KPG + t;
        if (key >= Nk) continue;
#pragma unroll
        for (int j = 0; j < DPL; ++j) {
            const int col = own * D + g + G * j;
            if (col < d) {
                dkb[key * dk_sn + col] = from_float<T>(dkr[t][j] * scale);
                dvb[key * dv_sn + col] = from_float<T>(dvr[t][j]);
            }
        }
    }
}

// dQ for d > D. Shared memory (static): 2·BC·D + 2·BRQ·BC accumulators
// (mirrored in cuflash/tiling.py:bwd_smem_bytes).
template <typename T, int D, int G, int QPG, int NWARPS, int BC>
__global__ void __launch_bounds__(NWARPS * 32, 1)
flash_bwd_dq_chunked_kernel(const T* __restrict__ q, const T* __restrict__ k,
                            const T* __restrict__ v, const T* __restrict__ dO,
                            const accum_t<T>* __restrict__ lse,
                            const accum_t<T>* __restrict__ Dvec,
                            T* __restrict__ dq,
                            int Hq, int Hkv, int Nq, int Nk, int d,
                            accum_t<T> scale,
                            i64 q_sb, i64 q_sh, i64 q_sn,
                            i64 k_sb, i64 k_sh, i64 k_sn,
                            i64 v_sb, i64 v_sh, i64 v_sn,
                            i64 do_sb, i64 do_sh, i64 do_sn,
                            i64 dq_sb, i64 dq_sh, i64 dq_sn,
                            int causal, int num_d_chunks) {
    using Acc = accum_t<T>;
    static_assert(G >= 1 && G <= 32 && (G & (G - 1)) == 0, "G must be a power of two <= 32");
    static_assert(D % G == 0, "the head-dim bucket D must be a multiple of G");
    constexpr int DPL = D / G;
    constexpr int NT = NWARPS * 32;
    constexpr int BRQ = NWARPS * (32 / G) * QPG;

    __shared__ Acc sK[BC][D];     // K_j, one chunk (zero beyond d)
    __shared__ Acc sV[BC][D];     // V_j, the same chunk
    __shared__ Acc sS[BRQ][BC];   // Σ over the chunks visited so far of S_ij
    __shared__ Acc sdP[BRQ][BC];  // … of dP_ij

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int g = lane % G;
    const int grp = (tid >> 5) * (32 / G) + lane / G;
    const int own = blockIdx.x % num_d_chunks;           // the chunk of dQ this block owns
    const int r0 = (blockIdx.x / num_d_chunks) * BRQ;    // first query row of the block
    const int hq = blockIdx.y;
    const i64 b = blockIdx.z;
    const int hkv = hq / (Hq / Hkv);
    const int off = Nk - Nq;
    const Acc scale_log2 = scale * MathConst<Acc>::log2e;

    // ── prologue: lse_i, D_i into registers; dQ_i (own chunk) to zero ──
    Acc qr[QPG][DPL], dor[QPG][DPL], dqr[QPG][DPL], Lr[QPG], Dr[QPG];
    const T* qb = q + b * q_sb + hq * q_sh;
    const T* dob = dO + b * do_sb + hq * do_sh;
    const Acc* lseb = lse + (b * Hq + hq) * (i64)Nq;
    const Acc* Db = Dvec + (b * Hq + hq) * (i64)Nq;
#pragma unroll
    for (int t = 0; t < QPG; ++t) {
        const int row = r0 + grp * QPG + t;
#pragma unroll
        for (int j = 0; j < DPL; ++j) dqr[t][j] = Acc(0);
        Lr[t] = lse_log2(row < Nq ? lseb[row] : neg_inf<Acc>());
        Dr[t] = row < Nq ? Db[row] : Acc(0);
    }

    int c_end = Nk;
    if (causal) c_end = imax(0, imin(Nk, r0 + BRQ + off));

    const T* kb = k + b * k_sb + hkv * k_sh;
    const T* vb = v + b * v_sb + hkv * v_sh;
    // ── main loop: K/V tiles, then head-dim chunks (own last) ──
    for (int kc0 = 0; kc0 < c_end; kc0 += BC) {
        const int ncols = imin(BC, c_end - kc0);
        for (int i = 0; i < num_d_chunks; ++i) {
            const int chunk = (own + 1 + i) % num_d_chunks;
            const bool last = i == num_d_chunks - 1;   // the own chunk
            const int col0 = chunk * D;
            __syncthreads();  // every thread is done with the previous chunk / tile
            for (int idx = tid; idx < BC * D; idx += NT) {
                const int c = idx / D, col = idx % D;
                const int key = kc0 + c;
                const bool ok = key < Nk && col0 + col < d;
                sK[c][col] = ok ? to_float(kb[key * k_sn + col0 + col]) : Acc(0);
                sV[c][col] = ok ? to_float(vb[key * v_sn + col0 + col]) : Acc(0);
            }
            // Q_i, dO_i of this chunk into registers.
#pragma unroll
            for (int t = 0; t < QPG; ++t) {
                const int row = r0 + grp * QPG + t;
#pragma unroll
                for (int j = 0; j < DPL; ++j) {
                    const int col = col0 + g + G * j;
                    const bool ok = row < Nq && col < d;
                    qr[t][j] = ok ? to_float(qb[row * q_sn + col]) : Acc(0);
                    dor[t][j] = ok ? to_float(dob[row * do_sn + col]) : Acc(0);
                }
            }
            __syncthreads();

#pragma unroll 1
            for (int c = 0; c < ncols; ++c) {
                const int key = kc0 + c;
                Acc kv[DPL], vv[DPL];
#pragma unroll
                for (int j = 0; j < DPL; ++j) {
                    kv[j] = sK[c][g + G * j];
                    vv[j] = sV[c][g + G * j];
                }
#pragma unroll
                for (int t = 0; t < QPG; ++t) {
                    const int rq = grp * QPG + t;              // query row within the block
                    Acc s = Acc(0), dp = Acc(0);               // this chunk's partial dots
#pragma unroll
                    for (int j = 0; j < DPL; ++j) {
                        s = fma_acc(qr[t][j], kv[j], s);
                        dp = fma_acc(dor[t][j], vv[j], dp);
                    }
                    s = warp_reduce_sum<G>(s);
                    dp = warp_reduce_sum<G>(dp);
                    if (!last) {  // lane 0 of the group keeps the running sums
                        if (g == 0) {
                            sS[rq][c] = i > 0 ? sS[rq][c] + s : s;
                            sdP[rq][c] = i > 0 ? sdP[rq][c] + dp : dp;
                        }
                        continue;
                    }
                    if (i > 0) {  // the own chunk: add the others' sums (barrier since)
                        s += sS[rq][c];
                        dp += sdP[rq][c];
                    }
                    Acc p = fast_exp2(s * scale_log2 - Lr[t]);          // P_ij = exp(S_ij − lse_i)
                    if (causal && key > r0 + rq + off) p = Acc(0);
                    const Acc ds = p * (dp - Dr[t]);                   // dS_ij = P_ij (dP_ij − D_i)
#pragma unroll
                    for (int j = 0; j < DPL; ++j) dqr[t][j] = fma_acc(ds, kv[j], dqr[t][j]);  // dQ_i += dS_ij K_j
                }
            }
        }
    }

    // ── epilogue: this block's chunk of dQ_i · scale → global ──
    T* dqb = dq + b * dq_sb + hq * dq_sh;
#pragma unroll
    for (int t = 0; t < QPG; ++t) {
        const int row = r0 + grp * QPG + t;
        if (row >= Nq) continue;
#pragma unroll
        for (int j = 0; j < DPL; ++j) {
            const int col = own * D + g + G * j;
            if (col < d) dqb[row * dq_sn + col] = from_float<T>(dqr[t][j] * scale);
        }
    }
}
