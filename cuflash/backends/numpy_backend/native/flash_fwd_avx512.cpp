// The FA2 forward on the CPU, float32, AVX-512: Q tiles outer, K/V tiles inner, the
// running max m_i, one final rescale per row — the loop of
// cuflash.reference.fa2_attention, with its names (m_i, l_i, acc; init / update /
// finalize), fused so that a score tile never leaves the core's caches.
//
// Layouts (all contiguous, float32):
//   q, o   (G, Nq, d)   the G query heads of one K/V head
//   k, v   (Nk, d)
//   lse    (G, Nq)
//   Kp     (Nk64 / 64, d, 64)   Kᵀ in panels of 64 keys, keys ≥ Nk zero (pack_kv)
//   Vp     (Nk64, dp)           V with its rows padded to dp = d rounded up to 16
// Scores are taken in base 2: Q is scaled by c = scale·log2(e) as it is copied into the
// tile, so that exp(S − m) = 2^(S₂ − m₂) and lse = (m₂ + log2 ℓ)·ln 2.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace {

constexpr int kPanel = 64;  // keys per Kᵀ panel: the S micro-tile's width (4 vectors)
constexpr int kMr = 6;      // rows of a micro-tile: 6 × 4 accumulators of 32 registers
constexpr int kBr = 96;     // rows of a Q tile
constexpr int kBc = 256;    // keys of a K/V tile (a multiple of kPanel)
constexpr float kNegInf = -INFINITY;

// 2^x, to about 1 ulp: x = n + f with f in [−½, ½], 2^f by its Taylor series to f⁷
// (the next term is below 2^-27), 2^n by scalef. NaN stays NaN; x ≤ −160 gives 0.
inline __m512 exp2_ps(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-160.0f), x);  // max(a, NaN) is NaN: NaN passes
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.5252733804059840e-05f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381606e-04f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// S[kMr][kPanel] = Q[kMr][d] · Kpᵀ, one panel of 64 keys.
inline void qk_micro(const float* Q, const float* Kp, int d, float* S, int lds) {
  __m512 acc[kMr][4];
  for (int i = 0; i < kMr; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int t = 0; t < d; ++t) {
    const float* kt = Kp + t * kPanel;
    const __m512 b0 = _mm512_loadu_ps(kt), b1 = _mm512_loadu_ps(kt + 16),
                 b2 = _mm512_loadu_ps(kt + 32), b3 = _mm512_loadu_ps(kt + 48);
    for (int i = 0; i < kMr; ++i) {
      const __m512 a = _mm512_set1_ps(Q[i * d + t]);
      acc[i][0] = _mm512_fmadd_ps(a, b0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(a, b1, acc[i][1]);
      acc[i][2] = _mm512_fmadd_ps(a, b2, acc[i][2]);
      acc[i][3] = _mm512_fmadd_ps(a, b3, acc[i][3]);
    }
  }
  for (int i = 0; i < kMr; ++i)
    for (int j = 0; j < 4; ++j) _mm512_store_ps(S + i * lds + 16 * j, acc[i][j]);
}

// acc[kMr][NV·16] += P[kMr][nk] · Vp[nk][NV·16] (columns c0… of Vp and acc).
template <int NV>
inline void pv_micro(const float* P, int ldp, const float* V, int ldv, int nk, float* A, int lda) {
  __m512 acc[kMr][NV];
  for (int i = 0; i < kMr; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_load_ps(A + i * lda + 16 * j);
  for (int t = 0; t < nk; ++t) {
    __m512 b[NV];
    for (int j = 0; j < NV; ++j) b[j] = _mm512_loadu_ps(V + t * ldv + 16 * j);
    for (int i = 0; i < kMr; ++i) {
      const __m512 a = _mm512_set1_ps(P[i * ldp + t]);
      for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_fmadd_ps(a, b[j], acc[i][j]);
    }
  }
  for (int i = 0; i < kMr; ++i)
    for (int j = 0; j < NV; ++j) _mm512_store_ps(A + i * lda + 16 * j, acc[i][j]);
}

inline void pv_rows(const float* P, int ldp, const float* V, int dp, int nk, float* A) {
  for (int c = 0; c < dp; c += 64) {
    switch ((dp - c) >= 64 ? 4 : (dp - c) / 16) {
      case 4: pv_micro<4>(P, ldp, V + c, dp, nk, A + c, dp); break;
      case 3: pv_micro<3>(P, ldp, V + c, dp, nk, A + c, dp); break;
      case 2: pv_micro<2>(P, ldp, V + c, dp, nk, A + c, dp); break;
      default: pv_micro<1>(P, ldp, V + c, dp, nk, A + c, dp); break;
    }
  }
}

// One Q tile's state, 64-byte aligned: kept per thread between calls (fresh pages
// cost a fault each), grown when a call needs more.
struct Scratch {
  float *Q, *S, *acc, *m, *l;
  void* mem = nullptr;
  size_t size = 0;
  void fit(int d, int dp) {
    const size_t q = (size_t(kBr) * d + 15) / 16 * 16, s = size_t(kBr) * kBc,
                 a = size_t(kBr) * dp, n = q + s + a + 2 * kBr;
    if (n > size) {
      std::free(mem);
      mem = std::aligned_alloc(64, n * sizeof(float));
      size = n;
    }
    Q = static_cast<float*>(mem);
    S = Q + q;
    acc = S + s;
    m = acc + a;
    l = m + kBr;
  }
  ~Scratch() { std::free(mem); }
};

// One Q tile: rows [r0, r0 + br) of one query head, br ≤ kBr. Row r sees keys
// j < limit(r) = min(Nk, r + 1 + diag) when causal (diag = Nk − Nq), else all Nk.
// Returns the number of rows whose o or lse came out NaN or +inf.
int tile(const float* q, const float* Kp, const float* Vp, float* o, float* lse, int Nk,
          int d, int dp, int r0, int br, float c, bool causal, long diag, Scratch& w) {
  const int brp = (br + kMr - 1) / kMr * kMr;  // rows padded to whole micro-tiles
  // -- prologue: Q_i scaled by c (rows past br zero); init m_i = −inf, ℓ_i = 0, acc = 0 --
  for (int i = 0; i < brp; ++i)
    for (int t = 0; t < d; ++t) w.Q[i * d + t] = i < br ? c * q[size_t(r0 + i) * d + t] : 0.0f;
  std::memset(w.acc, 0, sizeof(float) * size_t(brp) * dp);
  for (int i = 0; i < brp; ++i) w.m[i] = kNegInf, w.l[i] = 0.0f;
  auto limit = [&](long r) { return causal ? std::min<long>(Nk, r + 1 + diag) : long(Nk); };
  const long last = limit(r0 + br - 1);  // the tile's last row sees the most keys
  for (long c0 = 0; c0 < last; c0 += kBc) {
    const int bc = int(std::min<long>(kBc, last - c0));
    const int bcp = (bc + kPanel - 1) / kPanel * kPanel;
    // -- compute qk: S₂ = (c·Q_i) K_jᵀ --
    for (int p = 0; p < bcp; p += kPanel)
      for (int i = 0; i < brp; i += kMr)
        qk_micro(w.Q + i * d, Kp + (c0 + p) * d, d, w.S + i * kBc + p, kBc);
    // -- update m_i and ℓ_i; P̃ = 2^(S₂ − m_i) in place; acc *= 2^(m_old − m_new) --
    for (int i = 0; i < br; ++i) {
      float* s = w.S + i * kBc;
      const long seen = std::min<long>(bc, limit(r0 + i) - c0);  // keys of this row here
      for (long j = std::max<long>(seen, 0); j < bcp; ++j) s[j] = kNegInf;
      __m512 mx = _mm512_set1_ps(kNegInf);
      for (int j = 0; j < bcp; j += 16) mx = _mm512_max_ps(mx, _mm512_load_ps(s + j));
      const float m_new = std::max(w.m[i], _mm512_reduce_max_ps(mx));
      // a row that has seen only −inf subtracts 0: 2^(−inf − 0) = 0, not NaN
      const float m_sub = m_new == kNegInf ? 0.0f : m_new;
      const __m512 vm = _mm512_set1_ps(m_sub);
      __m512 sum = _mm512_setzero_ps();
      for (int j = 0; j < bcp; j += 16) {
        const __m512 p = exp2_ps(_mm512_sub_ps(_mm512_load_ps(s + j), vm));
        _mm512_store_ps(s + j, p);
        sum = _mm512_add_ps(sum, p);
      }
      const float alpha = std::exp2(w.m[i] - m_sub);
      w.l[i] = alpha * w.l[i] + _mm512_reduce_add_ps(sum);
      w.m[i] = m_new;
      if (alpha != 1.0f) {
        const __m512 va = _mm512_set1_ps(alpha);
        float* a = w.acc + size_t(i) * dp;
        for (int t = 0; t < dp; t += 16) _mm512_store_ps(a + t, _mm512_mul_ps(va, _mm512_load_ps(a + t)));
      }
    }
    for (int i = br; i < brp; ++i) std::memset(w.S + i * kBc, 0, sizeof(float) * bcp);
    // -- acc += P̃ V_j --
    for (int i = 0; i < brp; i += kMr)
      pv_rows(w.S + i * kBc, kBc, Vp + size_t(c0) * dp, dp, bcp, w.acc + size_t(i) * dp);
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

// Kp, Vp (layouts above) from k, v (Nk, d).
void cuflash_pack_kv(const float* k, const float* v, int Nk, int d, float* Kp, float* Vp) {
  const int dp = (d + 15) / 16 * 16, nk64 = (Nk + kPanel - 1) / kPanel * kPanel;
  for (int p = 0; p < nk64; p += kPanel)
    for (int t = 0; t < d; ++t)
      for (int j = 0; j < kPanel; ++j)
        Kp[size_t(p) * d + t * kPanel + j] = p + j < Nk ? k[size_t(p + j) * d + t] : 0.0f;
  for (int j = 0; j < nk64; ++j)
    for (int t = 0; t < dp; ++t)
      Vp[size_t(j) * dp + t] = j < Nk && t < d ? v[size_t(j) * d + t] : 0.0f;
}

// Rows [r0, r1) of the G query heads of one K/V head: o, lse (layouts above).
// diag = Nk − Nq: causal row r sees keys j ≤ r + diag. Returns the number of rows whose
// o or lse is NaN or +inf (inputs that are not finite, or a score or P̃ V that overflowed).
int cuflash_forward_rows(const float* q, const float* Kp, const float* Vp, float* o, float* lse,
                         int G, int Nq, int Nk, int d, int r0, int r1, float c, int causal) {
  thread_local Scratch w;
  const int dp = (d + 15) / 16 * 16;
  w.fit(d, dp);
  int bad = 0;
  for (int g = 0; g < G; ++g)
    for (int r = r0; r < r1; r += kBr)
      bad += tile(q + size_t(g) * Nq * d, Kp, Vp, o + size_t(g) * Nq * d, lse + size_t(g) * Nq,
                  Nk, d, dp, r, std::min(kBr, r1 - r), c, causal != 0, long(Nk) - Nq, w);
  return bad;
}

}  // extern "C"
