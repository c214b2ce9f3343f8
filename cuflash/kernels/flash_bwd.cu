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
// Shared memory (static): 2·BR·D + 2·BR accumulators (mirrored in kernel_backward.py).
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
// Shared memory (static): 2·BC·D accumulators (mirrored in kernel_backward.py).
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
