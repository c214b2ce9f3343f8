// The FA2 forward on the CPU, float32: Q tiles outer, K/V tiles inner, the running
// max m_i, one final rescale per row — the loop of cuflash.reference.fa2_attention,
// with its names (m_i, l_i, acc; init / update / finalize), fused so that a score
// tile never leaves the core's caches.
//
// Layouts (all contiguous, float32; panels and rows as in cpu_simd.h):
//   q, o   (G, Nq, d)   the G query heads of one K/V head
//   lse    (G, Nq)
//   Kp     K's panels,  Vp  V's rows
// Scores are taken in base 2: Q is scaled by c = scale·log2(e) as it is copied into the
// tile, so that exp(S − m) = 2^(S₂ − m₂) and lse = (m₂ + log2 ℓ)·ln 2.
#include "cpu_simd.h"

namespace {

using namespace cuflash_cpu;

constexpr int kBr = 96;   // rows of a Q tile
constexpr int kBc = 512;  // keys of a K/V tile (a multiple of kPanel): 512 took 3–4% less
                          // than 256 at N = 4096, as much as 1024

// One Q tile's state, in the thread's arena.
struct Scratch {
  float *Q, *S, *acc, *m, *l;
  Arena arena;
  void fit(int d, int dp) {
    const size_t q = size_t(kBr) * d, s = size_t(kBr) * kBc, a = size_t(kBr) * dp;
    arena.fit(Arena::room(q) + Arena::room(s) + Arena::room(a) + 2 * Arena::room(kBr));
    Q = arena.take(q), S = arena.take(s), acc = arena.take(a);
    m = arena.take(kBr), l = arena.take(kBr);
  }
};

// One Q tile: rows [r0, r0 + br) of one query head, br ≤ kBr. Row r sees keys
// j < limit(r) (keys_seen, diag = Nk − Nq).
// Returns the number of rows whose o or lse came out NaN or +inf.
int tile(const float* q, const float* Kp, const float* Vp, float* o, float* lse, int Nk,
         int d, int dp, int r0, int br, float c, bool causal, long diag, Scratch& w) {
  const int brp = (br + kMr - 1) / kMr * kMr;  // rows padded to whole micro-tiles
  // -- prologue: Q_i scaled by c (rows past br zero); init m_i = −inf, ℓ_i = 0, acc = 0 --
  for (int i = 0; i < brp; ++i)
    for (int t = 0; t < d; ++t) w.Q[i * d + t] = i < br ? c * q[size_t(r0 + i) * d + t] : 0.0f;
  std::memset(w.acc, 0, sizeof(float) * size_t(brp) * dp);
  for (int i = 0; i < brp; ++i) w.m[i] = kNegInf, w.l[i] = 0.0f;
  auto limit = [&](long r) { return keys_seen(r, Nk, diag, causal); };
  const long last = limit(r0 + br - 1);  // the tile's last row sees the most keys
  for (long c0 = 0; c0 < last; c0 += kBc) {
    const int bc = int(std::min<long>(kBc, last - c0));
    const int bcp = (bc + kPanel - 1) / kPanel * kPanel;
    // keys of this tile that micro-tile i's rows see: none of its rows sees a key past
    // that, so its scores there are not computed (the mask below overwrites them) and
    // its P̃ there (0) is not multiplied
    auto seen_by = [&](int i) {
      return int(std::clamp<long>(limit(r0 + std::min(i + kMr, br) - 1) - c0, 0, bc));
    };
    // -- compute qk: S₂ = (c·Q_i) K_jᵀ --
    for (int p = 0; p < bcp; p += kPanel)
      for (int i = 0; i < brp; i += kMr)
        if (p < seen_by(i))
          gemm_rows<false>(w.Q + i * d, d, 1, Kp + (c0 + p) * d, kPanel, d, w.S + i * kBc + p,
                           kBc, kPanel);
    // -- update m_i and ℓ_i; P̃ = 2^(S₂ − m_i) in place; acc *= 2^(m_old − m_new) --
    for (int i = 0; i < br; ++i) {
      float* s = w.S + i * kBc;
      const long seen = std::min<long>(bc, limit(r0 + i) - c0);  // keys of this row here
      for (long j = std::max<long>(seen, 0); j < bcp; ++j) s[j] = kNegInf;
      vec mx = vset(kNegInf);
      for (int j = 0; j < bcp; j += W) mx = vmax(mx, vload(s + j));
      const float m_new = std::max(w.m[i], vhmax(mx));
      // a row that has seen only −inf subtracts 0: 2^(−inf − 0) = 0, not NaN
      const float m_sub = m_new == kNegInf ? 0.0f : m_new;
      const vec vm = vset(m_sub);
      vec sum = vset(0.0f);
      for (int j = 0; j < bcp; j += W) {
        const vec p = exp2v(vsub(vload(s + j), vm));
        vstore(s + j, p);
        sum = vadd(sum, p);
      }
      const float alpha = std::exp2(w.m[i] - m_sub);
      w.l[i] = alpha * w.l[i] + vsum(sum);
      w.m[i] = m_new;
      if (alpha != 1.0f) {
        float* a = w.acc + size_t(i) * dp;
        for (int t = 0; t < dp; t += W) vstore(a + t, vmul(vset(alpha), vload(a + t)));
      }
    }
    for (int i = br; i < brp; ++i) std::memset(w.S + i * kBc, 0, sizeof(float) * bcp);
    // -- acc += P̃ V_j --
    for (int i = 0; i < brp; i += kMr)
      gemm_rows<true>(w.S + i * kBc, kBc, 1, Vp + size_t(c0) * dp, dp, seen_by(i),
                      w.acc + size_t(i) * dp, dp, dp);
  }
  // -- epilogue (finalize): O_i = acc / ℓ_i, lse_i = (m_i + log2 ℓ_i)·ln 2; no key: 0, −inf --
  int bad = 0;
  for (int i = 0; i < br; ++i) {
    float* out = o + size_t(r0 + i) * d;
    const float* a = w.acc + size_t(i) * dp;
    const float l = w.l[i], inv_l = l > 0.0f ? 1.0f / l : 0.0f;
    float finite = 0.0f;  // stays 0 unless an output is NaN or ±inf (0·inf = NaN)
    for (int t = 0; t < d; ++t) out[t] = a[t] * inv_l, finite += 0.0f * out[t];
    lse[r0 + i] = l > 0.0f ? (w.m[i] + std::log2(l)) * 0.69314718055994531f : kNegInf;
    bad += !(finite == 0.0f && l >= 0.0f && l < INFINITY);
  }
  return bad;
}

}  // namespace

extern "C" {

// W (floats a vector) and P (rows a panel) of this build: the packed layouts' sizes.
void cuflash_layout(int* width, int* panel) { *width = W, *panel = kPanel; }

// The packed layouts (cpu_simd.h) of x (N, d).
void cuflash_pack_panels(const float* x, int N, int d, float* out) { pack_panels(x, N, d, out); }
void cuflash_pack_rows(const float* x, int N, int d, float* out) { pack_rows(x, N, d, out); }

// Rows [r0, r1) of the G query heads of one K/V head: o, lse (layouts above).
// diag = Nk − Nq: causal row r sees keys j ≤ r + diag. Returns the number of rows whose
// o or lse is NaN or +inf (inputs that are not finite, or a score or P̃ V that overflowed).
int cuflash_forward_rows(const float* q, const float* Kp, const float* Vp, float* o, float* lse,
                         int G, int Nq, int Nk, int d, int r0, int r1, float c, int causal) {
  thread_local Scratch w;
  const int dp = (d + W - 1) / W * W;
  w.fit(d, dp);
  int bad = 0;
  for (int g = 0; g < G; ++g)
    for (int r = r0; r < r1; r += kBr)
      bad += tile(q + size_t(g) * Nq * d, Kp, Vp, o + size_t(g) * Nq * d, lse + size_t(g) * Nq,
                  Nk, d, dp, r, std::min(kBr, r1 - r), c, causal != 0, long(Nk) - Nq, w);
  return bad;
}

}  // extern "C"
