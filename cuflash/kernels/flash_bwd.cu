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
// d > D (beyond the largest bucket) runs the *_chunked kernels: the same bodies, in chunks.
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
// The pieces of the backward's math, once, for the plain and the chunked kernels.
// A lane holds columns col0 + g + G·j (j < DPL) of a row; col0 = 0 without chunking.
// ─────────────────────────────────────────────────────────────────────────────────────

// Rows row0 + t (t < NR) of a and b into registers; zero beyond n rows and d columns so
// padding contributes nothing to the dots.
template <int NR, int DPL, int G, typename T, typename Acc>
__device__ __forceinline__ void load_rows(Acc (&ra)[NR][DPL], Acc (&rb)[NR][DPL],
                                          const T* a, i64 a_sn, const T* b, i64 b_sn,
                                          int row0, int n, int col0, int d, int g) {
#pragma unroll
    for (int t = 0; t < NR; ++t) {
        const int row = row0 + t;
#pragma unroll
        for (int j = 0; j < DPL; ++j) {
            const int col = col0 + g + G * j;
            const bool ok = row < n && col < d;
            ra[t][j] = ok ? to_float(a[row * a_sn + col]) : Acc(0);
            rb[t][j] = ok ? to_float(b[row * b_sn + col]) : Acc(0);
        }
    }
}

template <int NR, int DPL, typename Acc>
__device__ __forceinline__ void zero_rows(Acc (&r)[NR][DPL]) {
#pragma unroll
    for (int t = 0; t < NR; ++t)
#pragma unroll
        for (int j = 0; j < DPL; ++j) r[t][j] = Acc(0);
}

// A ROWS × D tile of a and b (rows row0.., columns col0..col0+D−1) into shared memory,
// all NT threads striding over it; zero beyond n rows and d columns.
template <int ROWS, int D, int NT, typename T, typename Acc>
__device__ __forceinline__ void load_tile(Acc (*sa)[D], Acc (*sb)[D],
                                          const T* a, i64 a_sn, const T* b, i64 b_sn,
                                          int row0, int n, int col0, int d, int tid) {
    for (int idx = tid; idx < ROWS * D; idx += NT) {
        const int r = idx / D, col = idx % D;
        const int row = row0 + r;
        const bool ok = row < n && col0 + col < d;
        sa[r][col] = ok ? to_float(a[row * a_sn + col0 + col]) : Acc(0);
        sb[r][col] = ok ? to_float(b[row * b_sn + col0 + col]) : Acc(0);
    }
}

// This lane's columns of one shared-memory row of a and b (interleaved: conflict-free).
template <int DPL, int G, typename Acc>
__device__ __forceinline__ void read_smem_row(Acc (&ra)[DPL], Acc (&rb)[DPL],
                                              const Acc* sa, const Acc* sb, int g) {
#pragma unroll
    for (int j = 0; j < DPL; ++j) {
        ra[j] = sa[g + G * j];
        rb[j] = sb[g + G * j];
    }
}

// lse_i · log2(e) and D_i of one query row.
template <typename Acc>
__device__ __forceinline__ void load_row_stats(const Acc* lseb, const Acc* Db, int row, int n,
                                               Acc& L, Acc& Di) {
    // Padding rows act as fully masked rows: lse = −inf → P = 0.
    L = lse_log2(row < n ? lseb[row] : neg_inf<Acc>());
    Di = row < n ? Db[row] : Acc(0);
}

// S_ij = q_i · k_j and dP_ij = dO_i · v_j: per-lane partial dots, then a sum over the
// group's G lanes.
template <int G, int DPL, typename Acc>
__device__ __forceinline__ void score_dots(const Acc (&qv)[DPL], const Acc (&kv)[DPL],
                                           const Acc (&dov)[DPL], const Acc (&vv)[DPL],
                                           Acc& s, Acc& dp) {
    s = Acc(0);
    dp = Acc(0);
#pragma unroll
    for (int j = 0; j < DPL; ++j) {
        s = fma_acc(qv[j], kv[j], s);
        dp = fma_acc(dov[j], vv[j], dp);
    }
    s = warp_reduce_sum<G>(s);
    dp = warp_reduce_sum<G>(dp);
}

// Chunked kernels: S_ij = Σ_c (chunk c's partial). Before the own (last) chunk, lane 0 of
// the group folds its partials into sS[r][c], sdP[r][c] (one writer per element) and the
// caller skips the accumulation (false); on the own chunk the stored sums are added
// (a barrier separates the chunks) and s, dp are complete (true). Plain: always true.
template <bool CHUNKED, int BC, typename Acc>
__device__ __forceinline__ bool complete_scores(Acc& s, Acc& dp, Acc (*sS)[BC], Acc (*sdP)[BC],
                                                int r, int c, int i, bool last, int g) {
    if (!CHUNKED) return true;
    if (!last) {
        if (g == 0) {
            sS[r][c] = i > 0 ? sS[r][c] + s : s;
            sdP[r][c] = i > 0 ? sdP[r][c] + dp : dp;
        }
        return false;
    }
    if (i > 0) {
        s += sS[r][c];
        dp += sdP[r][c];
    }
    return true;
}

// P_ij = exp(S_ij − lse_i), recomputed from lse (never stored), then dS_ij = P_ij (dP_ij − D_i).
// scale·log2(e) is folded into one multiply and lse arrives as lse·log2(e), so P is one exp2.
template <typename Acc>
__device__ __forceinline__ void recompute_p_ds(Acc s, Acc dp, Acc scale_log2, Acc L, Acc Di,
                                               bool masked, Acc& p, Acc& ds) {
    p = fast_exp2(s * scale_log2 - L);
    if (masked) p = Acc(0);  // causal: key j > i + Nk − Nq
    ds = p * (dp - Di);
}

// acc += a · x over this lane's columns (dV_j += P_ijᵀ dO_i, dK_j += dS_ijᵀ Q_i, dQ_i += dS_ij K_j).
template <int DPL, typename Acc>
__device__ __forceinline__ void axpy(Acc a, const Acc (&x)[DPL], Acc (&acc)[DPL]) {
#pragma unroll
    for (int j = 0; j < DPL; ++j) acc[j] = fma_acc(a, x[j], acc[j]);
}

// Epilogue: rows row0 + t of r (· scale when SCALED) → global in the element type, this
// lane's columns, skipping rows ≥ n and columns ≥ d.
template <bool SCALED, int NR, int DPL, int G, typename T, typename Acc>
__device__ __forceinline__ void store_rows(T* out, i64 sn, const Acc (&r)[NR][DPL], Acc scale,
                                           int row0, int n, int col0, int d, int g) {
#pragma unroll
    for (int t = 0; t < NR; ++t) {
        const int row = row0 + t;
        if (row >= n) continue;
#pragma unroll
        for (int j = 0; j < DPL; ++j) {
            const int col = col0 + g + G * j;
            if (col < d) out[row * sn + col] = from_float<T>(SCALED ? r[t][j] * scale : r[t][j]);
        }
    }
}

// ─────────────────────────────────────────────────────────────────────────────────────
// Head dims beyond the largest bucket (d > D): CHUNKED = true, the same bodies in
// D-wide chunks.
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
// more than D columns on chip. `causal` is a run-time flag there (half the
// specializations; this is not the fast path). minBlocksPerSM = 1, as in flash_fwd.cu:
// with the bare thread count ptxas capped sm_70's 16-bit dK/dV kernel at 128 registers
// and spilled 28 bytes.
// Plain kernels: num_d_chunks = 1 and causal a compile-time constant, so after inlining
// the chunk loop and the sS/sdP exchange vanish and K_j, V_j (dQ: Q_i, dO_i) load once.
// ─────────────────────────────────────────────────────────────────────────────────────

// The argument lists of the kernels (see the file header for the layout), written once for
// the kernels and the bodies they run.
#define CUFLASH_BWD_DKDV_PARAMS                                                        \
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,         \
    const T* __restrict__ dO, const accum_t<T>* __restrict__ lse,                      \
    const accum_t<T>* __restrict__ Dvec, T* __restrict__ dk, T* __restrict__ dv,       \
    int Hq, int Hkv, int Nq, int Nk, int d, accum_t<T> scale,                          \
    i64 q_sb, i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn,                        \
    i64 v_sb, i64 v_sh, i64 v_sn, i64 do_sb, i64 do_sh, i64 do_sn,                     \
    i64 dk_sb, i64 dk_sh, i64 dk_sn, i64 dv_sb, i64 dv_sh, i64 dv_sn
#define CUFLASH_BWD_DKDV_ARGS                                                          \
    q, k, v, dO, lse, Dvec, dk, dv, Hq, Hkv, Nq, Nk, d, scale,                         \
    q_sb, q_sh, q_sn, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, do_sb, do_sh, do_sn,         \
    dk_sb, dk_sh, dk_sn, dv_sb, dv_sh, dv_sn
#define CUFLASH_BWD_DQ_PARAMS                                                          \
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,         \
    const T* __restrict__ dO, const accum_t<T>* __restrict__ lse,                      \
    const accum_t<T>* __restrict__ Dvec, T* __restrict__ dq,                           \
    int Hq, int Hkv, int Nq, int Nk, int d, accum_t<T> scale,                          \
    i64 q_sb, i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn,                        \
    i64 v_sb, i64 v_sh, i64 v_sn, i64 do_sb, i64 do_sh, i64 do_sn,                     \
    i64 dq_sb, i64 dq_sh, i64 dq_sn
#define CUFLASH_BWD_DQ_ARGS                                                            \
    q, k, v, dO, lse, Dvec, dq, Hq, Hkv, Nq, Nk, d, scale,                             \
    q_sb, q_sh, q_sn, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, do_sb, do_sh, do_sn,         \
    dq_sb, dq_sh, dq_sn

// dK, dV: one K/V block per thread block, Q/dO tiles streamed (shared memory: the kernel's).
template <typename T, int D, int G, int KPG, int NWARPS, int BR, bool CHUNKED>
__device__ __forceinline__ void
flash_bwd_dkdv_body(accum_t<T> (*sQ)[D], accum_t<T> (*sdO)[D], accum_t<T>* sL, accum_t<T>* sD,
                    accum_t<T> (*sS)[NWARPS * (32 / G) * KPG],
                    accum_t<T> (*sdP)[NWARPS * (32 / G) * KPG],
                    CUFLASH_BWD_DKDV_PARAMS,
                    bool causal, int num_d_chunks) {
    using Acc = accum_t<T>;
    static_assert(G >= 1 && G <= 32 && (G & (G - 1)) == 0, "G must be a power of two <= 32");
    static_assert(D % G == 0, "the head-dim bucket D must be a multiple of G");
    constexpr int DPL = D / G;                 // columns per lane
    constexpr int NT = NWARPS * 32;
    constexpr int BC = NWARPS * (32 / G) * KPG;

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int g = lane % G;                              // lane within its group
    const int grp = (tid >> 5) * (32 / G) + lane / G;   // group within the block
    const int own = blockIdx.x % num_d_chunks;           // the chunk of dK, dV this block owns
    const int c0 = (blockIdx.x / num_d_chunks) * BC;     // first key of the block
    const int key0 = c0 + grp * KPG;                     // first key of the group
    const int hkv = blockIdx.y;
    const i64 b = blockIdx.z;
    const int group_size = Hq / Hkv;                     // query heads per K/V head (GQA)
    const int off = Nk - Nq;                             // bottom-right causal alignment
    const Acc scale_log2 = scale * MathConst<Acc>::log2e;

    // ── prologue: K_j, V_j into registers (chunked: per chunk, below); dK_j, dV_j to zero ──
    Acc kr[KPG][DPL], vr[KPG][DPL], dkr[KPG][DPL], dvr[KPG][DPL];
    const T* kb = k + b * k_sb + hkv * k_sh;
    const T* vb = v + b * v_sb + hkv * v_sh;
    if (!CHUNKED) load_rows<KPG, DPL, G>(kr, vr, kb, k_sn, vb, v_sn, key0, Nk, 0, d, g);
    zero_rows(dkr);
    zero_rows(dvr);

    // Causal block skipping: rows i < c0 − off see none of this block's keys.
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
                load_tile<BR, D, NT>(sQ, sdO, qb, q_sn, dob, do_sn, r0, Nq, col0, d, tid);
                if (i == 0)
                    for (int r = tid; r < BR; r += NT)
                        load_row_stats(lseb, Db, r0 + r, Nq, sL[r], sD[r]);
                if (CHUNKED) load_rows<KPG, DPL, G>(kr, vr, kb, k_sn, vb, v_sn, key0, Nk, col0, d, g);
                __syncthreads();

#pragma unroll 1
                for (int r = 0; r < nrows; ++r) {
                    const int row = r0 + r;
                    Acc qv[DPL], dov[DPL];
                    read_smem_row<DPL, G>(qv, dov, sQ[r], sdO[r], g);
                    const Acc Lr = sL[r], Dr = sD[r];
#pragma unroll
                    for (int t = 0; t < KPG; ++t) {
                        const int kc = grp * KPG + t;          // key within the block
                        Acc s, dp, p, ds;
                        score_dots<G>(qv, kr[t], dov, vr[t], s, dp);
                        if (!complete_scores<CHUNKED>(s, dp, sS, sdP, r, kc, i, last, g)) continue;
                        recompute_p_ds(s, dp, scale_log2, Lr, Dr, causal && c0 + kc > row + off, p, ds);
                        axpy(p, dov, dvr[t]);    // dV_j += P_ijᵀ dO_i
                        axpy(ds, qv, dkr[t]);    // dK_j += dS_ijᵀ Q_i
                    }
                }
            }
        }
    }

    // ── epilogue: this block's chunk of dK_j · scale, dV_j → global ──
    store_rows</*SCALED=*/true, KPG, DPL, G>(dk + b * dk_sb + hkv * dk_sh, dk_sn, dkr, scale,
                                             key0, Nk, own * D, d, g);
    store_rows</*SCALED=*/false, KPG, DPL, G>(dv + b * dv_sb + hkv * dv_sh, dv_sn, dvr, scale,
                                              key0, Nk, own * D, d, g);
}

// dQ: one Q block per thread block, K/V tiles streamed (shared memory: the kernel's).
template <typename T, int D, int G, int QPG, int NWARPS, int BC, bool CHUNKED>
__device__ __forceinline__ void
flash_bwd_dq_body(accum_t<T> (*sK)[D], accum_t<T> (*sV)[D],
                  accum_t<T> (*sS)[BC], accum_t<T> (*sdP)[BC],
                  CUFLASH_BWD_DQ_PARAMS,
                  bool causal, int num_d_chunks) {
    using Acc = accum_t<T>;
    static_assert(G >= 1 && G <= 32 && (G & (G - 1)) == 0, "G must be a power of two <= 32");
    static_assert(D % G == 0, "the head-dim bucket D must be a multiple of G");
    constexpr int DPL = D / G;
    constexpr int NT = NWARPS * 32;
    constexpr int BRQ = NWARPS * (32 / G) * QPG;

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int g = lane % G;
    const int grp = (tid >> 5) * (32 / G) + lane / G;
    const int own = blockIdx.x % num_d_chunks;           // the chunk of dQ this block owns
    const int r0 = (blockIdx.x / num_d_chunks) * BRQ;    // first query row of the block
    const int row0 = r0 + grp * QPG;                     // first query row of the group
    const int hq = blockIdx.y;
    const i64 b = blockIdx.z;
    const int hkv = hq / (Hq / Hkv);                     // GQA: the K/V head this head reads
    const int off = Nk - Nq;
    const Acc scale_log2 = scale * MathConst<Acc>::log2e;

    // ── prologue: Q_i, dO_i (chunked: per chunk, below), lse_i, D_i into registers; dQ_i to zero ──
    Acc qr[QPG][DPL], dor[QPG][DPL], dqr[QPG][DPL], Lr[QPG], Dr[QPG];
    const T* qb = q + b * q_sb + hq * q_sh;
    const T* dob = dO + b * do_sb + hq * do_sh;
    const Acc* lseb = lse + (b * Hq + hq) * (i64)Nq;
    const Acc* Db = Dvec + (b * Hq + hq) * (i64)Nq;
    if (!CHUNKED) load_rows<QPG, DPL, G>(qr, dor, qb, q_sn, dob, do_sn, row0, Nq, 0, d, g);
    zero_rows(dqr);
#pragma unroll
    for (int t = 0; t < QPG; ++t) load_row_stats(lseb, Db, row0 + t, Nq, Lr[t], Dr[t]);

    // Causal block skipping: keys j > (last row of the block) + off are masked for all rows.
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
            load_tile<BC, D, NT>(sK, sV, kb, k_sn, vb, v_sn, kc0, Nk, col0, d, tid);
            if (CHUNKED) load_rows<QPG, DPL, G>(qr, dor, qb, q_sn, dob, do_sn, row0, Nq, col0, d, g);
            __syncthreads();

#pragma unroll 1
            for (int c = 0; c < ncols; ++c) {
                const int key = kc0 + c;
                Acc kv[DPL], vv[DPL];
                read_smem_row<DPL, G>(kv, vv, sK[c], sV[c], g);
#pragma unroll
                for (int t = 0; t < QPG; ++t) {
                    const int rq = grp * QPG + t;              // query row within the block
                    Acc s, dp, p, ds;
                    score_dots<G>(qr[t], kv, dor[t], vv, s, dp);
                    if (!complete_scores<CHUNKED>(s, dp, sS, sdP, rq, c, i, last, g)) continue;
                    recompute_p_ds(s, dp, scale_log2, Lr[t], Dr[t], causal && key > r0 + rq + off, p, ds);
                    axpy(ds, kv, dqr[t]);    // dQ_i += dS_ij K_j
                }
            }
        }
    }

    // ── epilogue: this block's chunk of dQ_i · scale → global ──
    store_rows</*SCALED=*/true, QPG, DPL, G>(dq + b * dq_sb + hq * dq_sh, dq_sn, dqr, scale,
                                             row0, Nq, own * D, d, g);
}

// ─────────────────────────────────────────────────────────────────────────────────────
// The kernels: each declares its shared memory and runs its body.
//   T      element type (__half, __nv_bfloat16, float, double)
//   D      head-dim bucket (32, 64, 128, 256), G lanes per row, DPL = D/G columns a lane
//   KPG    keys per lane group (register blocking: each Q/dO value read from shared
//          memory serves KPG keys); BC = NWARPS·(32/G)·KPG keys per dK/dV block
//   QPG    query rows per lane group; BRQ = NWARPS·(32/G)·QPG rows per dQ block
//   NWARPS warps per block
//   BR     query rows per shared-memory tile (dK/dV); BC keys per tile (dQ)
// Shared memory sizes are mirrored in cuflash/tiling.py:bwd_smem_bytes.
// ─────────────────────────────────────────────────────────────────────────────────────

// dK, dV, d ≤ D. Shared memory (static): 2·BR·D + 2·BR accumulators.
template <typename T, int D, int G, int KPG, int NWARPS, int BR, bool CAUSAL>
__global__ void __launch_bounds__(NWARPS * 32)
flash_bwd_dkdv_kernel(CUFLASH_BWD_DKDV_PARAMS) {
    using Acc = accum_t<T>;
    constexpr int BC = NWARPS * (32 / G) * KPG;
    __shared__ Acc sQ[BR][D];    // Q_i  (zero beyond d and Nq)
    __shared__ Acc sdO[BR][D];   // dO_i
    __shared__ Acc sL[BR];       // lse_i · log2(e), +inf for rows that see no key
    __shared__ Acc sD[BR];       // D_i
    flash_bwd_dkdv_body<T, D, G, KPG, NWARPS, BR, /*CHUNKED=*/false>(
        sQ, sdO, sL, sD, static_cast<Acc (*)[BC]>(nullptr), static_cast<Acc (*)[BC]>(nullptr),
        CUFLASH_BWD_DKDV_ARGS, /*causal=*/CAUSAL, /*num_d_chunks=*/1);
}

// dQ, d ≤ D. Shared memory (static): 2·BC·D accumulators.
template <typename T, int D, int G, int QPG, int NWARPS, int BC, bool CAUSAL>
__global__ void __launch_bounds__(NWARPS * 32)
flash_bwd_dq_kernel(CUFLASH_BWD_DQ_PARAMS) {
    using Acc = accum_t<T>;
    __shared__ Acc sK[BC][D];   // K_j (zero beyond d)
    __shared__ Acc sV[BC][D];   // V_j
    flash_bwd_dq_body<T, D, G, QPG, NWARPS, BC, /*CHUNKED=*/false>(
        sK, sV, static_cast<Acc (*)[BC]>(nullptr), static_cast<Acc (*)[BC]>(nullptr),
        CUFLASH_BWD_DQ_ARGS, /*causal=*/CAUSAL, /*num_d_chunks=*/1);
}

// dK, dV for d > D. Shared memory (static): 2·BR·D + 2·BR + 2·BR·BC accumulators.
template <typename T, int D, int G, int KPG, int NWARPS, int BR>
__global__ void __launch_bounds__(NWARPS * 32, 1)
flash_bwd_dkdv_chunked_kernel(CUFLASH_BWD_DKDV_PARAMS, int causal, int num_d_chunks) {
    using Acc = accum_t<T>;
    constexpr int BC = NWARPS * (32 / G) * KPG;
    __shared__ Acc sQ[BR][D];    // Q_i, one chunk (zero beyond d and Nq)
    __shared__ Acc sdO[BR][D];   // dO_i, the same chunk
    __shared__ Acc sL[BR];       // lse_i · log2(e), +inf for rows that see no key
    __shared__ Acc sD[BR];       // D_i
    __shared__ Acc sS[BR][BC];   // Σ over the chunks visited so far of S_ij
    __shared__ Acc sdP[BR][BC];  // … of dP_ij
    flash_bwd_dkdv_body<T, D, G, KPG, NWARPS, BR, /*CHUNKED=*/true>(
        sQ, sdO, sL, sD, sS, sdP, CUFLASH_BWD_DKDV_ARGS, causal != 0, num_d_chunks);
}

// dQ for d > D. Shared memory (static): 2·BC·D + 2·BRQ·BC accumulators.
template <typename T, int D, int G, int QPG, int NWARPS, int BC>
__global__ void __launch_bounds__(NWARPS * 32, 1)
flash_bwd_dq_chunked_kernel(CUFLASH_BWD_DQ_PARAMS, int causal, int num_d_chunks) {
    using Acc = accum_t<T>;
    constexpr int BRQ = NWARPS * (32 / G) * QPG;
    __shared__ Acc sK[BC][D];     // K_j, one chunk (zero beyond d)
    __shared__ Acc sV[BC][D];     // V_j, the same chunk
    __shared__ Acc sS[BRQ][BC];   // Σ over the chunks visited so far of S_ij
    __shared__ Acc sdP[BRQ][BC];  // … of dP_ij
    flash_bwd_dq_body<T, D, G, QPG, NWARPS, BC, /*CHUNKED=*/true>(
        sK, sV, sS, sdP, CUFLASH_BWD_DQ_ARGS, causal != 0, num_d_chunks);
}

#undef CUFLASH_BWD_DKDV_PARAMS
#undef CUFLASH_BWD_DKDV_ARGS
#undef CUFLASH_BWD_DQ_PARAMS
#undef CUFLASH_BWD_DQ_ARGS
