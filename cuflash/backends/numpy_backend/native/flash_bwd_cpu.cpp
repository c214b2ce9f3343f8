// The FA2 backward on the CPU, float32: K/V tiles outer (dK_j, dV_j accumulated in the
// task), Q rows inner, the seed equations with their names:
//   P_ij = exp(S_ij − L_i)          recomputed from the stored lse
//   dV_j += P_ijᵀ dO_i
//   dP_ij = dO_i V_jᵀ
//   dS_ij = P_ij ∘ (dP_ij − D_i),   D_i = rowsum(dO_i ∘ O_i)
//   dQ_i += dS_ij K_j · scale
//   dK_j += dS_ijᵀ Q_i · scale
// fused so that the tiles P and dS never leave the core's caches.
//
// Layouts (all contiguous, float32; panels and rows as in cpu_simd.h):
//   q, dO      (G, Nq, d)   the G query heads of one K/V head
//   L2, D      (G, Nq)      L2 = lse·log2(e) (+inf where lse = −inf: P = 0), D as above
//   Kp, Vt     K's and V's panels;  Kr  K's rows
//   dq         (G, Nq, d)   added to (the caller's lane's sum: see native.backward)
//   dk, dv     (Nk, d)      rows [c0, c1) written
#include "cpu_simd.h"

namespace {

using namespace cuflash_cpu;

constexpr int kBr = 96;   // rows of a Q tile
constexpr int kBc = 384;  // keys of a K/V tile: a multiple of kPanel (dP, S) and of kMr
                          // (dK, dV: the keys are their products' rows); 384 took 8% less
                          // than 192 at N = 1024–4096, and than 576 causal

// A task's tiles, in the thread's arena.
struct Scratch {
  float *Q, *dO, *P, *dS, *dQ, *dK, *dV;
  Arena arena;
  void fit(int dp) {
    const size_t rows = size_t(kBr) * dp, tile = size_t(kBr) * kBc, keys = size_t(kBc) * dp;
    arena.fit(3 * Arena::room(rows) + 2 * Arena::room(tile) + 2 * Arena::room(keys));
    Q = arena.take(rows), dO = arena.take(rows), dQ = arena.take(rows);
    P = arena.take(tile), dS = arena.take(tile);
    dK = arena.take(keys), dV = arena.take(keys);
  }
};

// Rows [r0, r0 + br) of one query head against the task's keys [c0, c0 + bc).
// Row r sees key j when j < limit(r) (keys_seen).
void step(const float* q, const float* dO, const float* L2, const float* D, const float* Kp,
          const float* Vt, const float* Kr, float* dq, int Nk, int d, int dp, int r0, int br,
          long c0, int bc, float c, bool causal, long diag, Scratch& w) {
  const int brp = (br + kMr - 1) / kMr * kMr, bcp = (bc + kPanel - 1) / kPanel * kPanel;
  const int bcm = (bcp + kMr - 1) / kMr * kMr;  // ≤ kBc: the keys dK_j and dV_j take
  auto limit = [&](long r) { return keys_seen(r, Nk, diag, causal); };
  // Q_i and dO_i with their rows padded to dp (rows past br zero): A of S and dP, B of
  // dK_j and dV_j
  for (int i = 0; i < brp; ++i)
    for (int t = 0; t < dp; ++t) {
      const bool in = i < br && t < d;
      w.Q[i * dp + t] = in ? q[size_t(r0 + i) * d + t] : 0.0f;
      w.dO[i * dp + t] = in ? dO[size_t(r0 + i) * d + t] : 0.0f;
    }
  // Causal: keys micro-tile i's rows see (none past it), and the first of the rows
  // [r0, r0 + brp) that sees key c0 + j. Products skip the rest: their P and dS are 0.
  auto seen_by = [&](int i) {
    return int(std::clamp<long>(limit(r0 + std::min(i + kMr, br) - 1) - c0, 0, bc));
  };
  auto first_seeing = [&](int j) {
    return causal ? int(std::clamp<long>(c0 + j - diag - r0, 0, brp)) : 0;
  };
  // -- S_ij = Q_i K_jᵀ (into P), dP_ij = dO_i V_jᵀ (into dS) --
  for (int p = 0; p < bcp; p += kPanel)
    for (int i = 0; i < brp; i += kMr) {
      if (p >= seen_by(i)) continue;  // the mask below writes these
      gemm_rows<false>(w.Q + i * dp, dp, 1, Kp + (c0 + p) * d, kPanel, d, w.P + i * kBc + p, kBc,
                       kPanel);
      gemm_rows<false>(w.dO + i * dp, dp, 1, Vt + (c0 + p) * d, kPanel, d, w.dS + i * kBc + p,
                       kBc, kPanel);
    }
  // -- P_ij = 2^(c·S_ij − L2_i), 0 where hidden; dS_ij = P_ij ∘ (dP_ij − D_i) --
  for (int i = 0; i < brp; ++i) {
    float* s = w.P + i * kBc;
    float* ds = w.dS + i * kBc;
    const long seen = i < br ? std::clamp<long>(limit(r0 + i) - c0, 0, bc) : 0;
    const vec vc = vset(c), vl = vset(i < br ? L2[r0 + i] : 0.0f), vd = vset(i < br ? D[r0 + i] : 0.0f);
    for (int j = 0; j < bcp; j += W) {
      const vec p = exp2v(vsub(vmul(vc, vload(s + j)), vl));
      vstore(s + j, p);
      vstore(ds + j, vmul(p, vsub(vload(ds + j), vd)));
    }
    for (long j = seen; j < bcm; ++j) s[j] = 0.0f, ds[j] = 0.0f;
  }
  // -- dV_j += P_ijᵀ dO_i, dK_j += dS_ijᵀ Q_i (scale applied at the end) --
  for (int j = 0; j < bcm; j += kMr) {
    const int t0 = first_seeing(j);
    gemm_rows<true>(w.P + j + size_t(t0) * kBc, 1, kBc, w.dO + size_t(t0) * dp, dp, brp - t0,
                    w.dV + size_t(j) * dp, dp, dp);
    gemm_rows<true>(w.dS + j + size_t(t0) * kBc, 1, kBc, w.Q + size_t(t0) * dp, dp, brp - t0,
                    w.dK + size_t(j) * dp, dp, dp);
  }
  // -- dQ_i += dS_ij K_j (scale applied by the caller, once) --
  for (int i = 0; i < brp; i += kMr)
    gemm_rows<false>(w.dS + i * kBc, kBc, 1, Kr + size_t(c0) * dp, dp, seen_by(i),
                     w.dQ + size_t(i) * dp, dp, dp);
  for (int i = 0; i < br; ++i)
    for (int t = 0; t < d; ++t) dq[size_t(r0 + i) * d + t] += w.dQ[size_t(i) * dp + t];
}

}  // namespace

extern "C" {

// Keys per task at most (the tiles' size).
int cuflash_backward_task_keys() { return kBc; }

// The keys [c0, c1) of one K/V head (c1 − c0 ≤ cuflash_backward_task_keys()): their dK and
// dV rows, whole, and their terms of dQ for the G query heads, added to dq in row order.
// diag = Nk − Nq; c = scale·log2(e). Only rows that see one of the keys are visited.
void cuflash_backward_keys(const float* q, const float* dO, const float* L2, const float* D,
                           const float* Kp, const float* Vt, const float* Kr, float* dq, float* dk,
                           float* dv, int G, int Nq, int Nk, int d, int c0, int c1, float c,
                           float scale, int causal) {
  thread_local Scratch w;
  const int dp = (d + W - 1) / W * W, bc = c1 - c0;
  w.fit(dp);
  std::memset(w.dK, 0, sizeof(float) * size_t(kBc) * dp);
  std::memset(w.dV, 0, sizeof(float) * size_t(kBc) * dp);
  const long diag = long(Nk) - Nq;
  // causal: row r sees key c0 from r = c0 − diag on
  const int first = causal ? int(std::clamp<long>(c0 - diag, 0, Nq)) : 0;
  for (int g = 0; g < G; ++g)
    for (int r = first; r < Nq; r += kBr)
      step(q + size_t(g) * Nq * d, dO + size_t(g) * Nq * d, L2 + size_t(g) * Nq, D + size_t(g) * Nq,
           Kp, Vt, Kr, dq + size_t(g) * Nq * d, Nk, d, dp, r, std::min(kBr, Nq - r), c0, bc, c,
           causal != 0, diag, w);
  for (int j = 0; j < bc; ++j)
    for (int t = 0; t < d; ++t) {
      dk[size_t(c0 + j) * d + t] = scale * w.dK[size_t(j) * dp + t];
      dv[size_t(c0 + j) * d + t] = w.dV[size_t(j) * dp + t];
    }
}

}  // extern "C"
