// The FA2 forward on the CPU, float32: Q tiles outer, K/V tiles inner, the running
// max m_i, one final rescale per row — the loop of cuflash.reference.fa2_attention,
// with its names (m_i, l_i, acc; init / update / finalize), fused so that a score
// tile never leaves the core's caches. Built once per instruction set: -DCUFLASH_AVX512
// (16 floats a vector, 32 registers) or -DCUFLASH_AVX2 (8 floats, 16 registers).
//
// Layouts (all contiguous, float32; W floats a vector, P = kNv·W keys a panel):
//   q, o   (G, Nq, d)   the G query heads of one K/V head
//   k, v   (Nk, d)
//   lse    (G, Nq)
//   Kp     (NkP / P, d, P)   Kᵀ in panels of P keys, keys ≥ Nk zero (pack_kv)
//   Vp     (NkP, dp)         V with its rows padded to dp = d rounded up to W
// with NkP = Nk rounded up to P (cuflash_layout gives W and P).
// Scores are taken in base 2: Q is scaled by c = scale·log2(e) as it is copied into the
// tile, so that exp(S − m) = 2^(S₂ − m₂) and lse = (m₂ + log2 ℓ)·ln 2.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

namespace {

// -- the vector: W floats, and the few operations the loop needs --
#if defined(CUFLASH_AVX512)
using vec = __m512;
constexpr int W = 16;
constexpr int kNv = 4;  // vectors across a micro-tile: 6 × 4 accumulators of 32 registers
inline vec vset(float x) { return _mm512_set1_ps(x); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vec x) { _mm512_storeu_ps(p, x); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }  // b if either is NaN
inline float vsum(vec x) { return _mm512_reduce_add_ps(x); }
inline float vhmax(vec x) { return _mm512_reduce_max_ps(x); }
inline vec vround(vec x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vec vscale2(vec p, vec n) { return _mm512_scalef_ps(p, n); }  // p·2^n
constexpr float kExpMin = -160.0f;  // scalef gives 0 below 2^-149
#elif defined(CUFLASH_AVX2)
using vec = __m256;
constexpr int W = 8;
constexpr int kNv = 2;  // 6 × 2 accumulators of 16 registers
inline vec vset(float x) { return _mm256_set1_ps(x); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vec x) { _mm256_storeu_ps(p, x); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }  // b if either is NaN
inline float vsum(vec x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float vhmax(vec x) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
inline vec vround(vec x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vec vscale2(vec p, vec n) {  // p·2^n for n ≥ −127, by n + 127 in the exponent bits
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
constexpr float kExpMin = -127.0f;  // 2^-127 has exponent bits 0: the product is 0
#else
#error "build with -DCUFLASH_AVX512 or -DCUFLASH_AVX2"
#endif

constexpr int kPanel = kNv * W;  // keys per Kᵀ panel: the S micro-tile's width
constexpr int kMr = 6;           // rows of a micro-tile
constexpr int kBr = 96;          // rows of a Q tile
constexpr int kBc = 512;         // keys of a K/V tile (a multiple of kPanel): 512 took
                                 // 3–4% less than 256 at N = 4096, as much as 1024
constexpr float kNegInf = -INFINITY;

// 2^x, to about 1 ulp: x = n + f with f in [−½, ½], 2^f by its Taylor series to f⁷
// (the next term is below 2^-27), 2^n into the exponent. NaN stays NaN; weights below
// 2^kExpMin are 0 (next to ℓ ≥ 1 they are below rounding).
inline vec exp2v(vec x) {
  x = vmax(vset(kExpMin), x);  // NaN passes: vmax returns its second operand
  const vec n = vround(x), f = vsub(x, n);
  vec p = vset(1.5252733804059840e-05f);
  p = vfma(p, f, vset(1.5403530393381606e-04f));
  p = vfma(p, f, vset(1.3333558146428443e-03f));
  p = vfma(p, f, vset(9.6181291076284772e-03f));
  p = vfma(p, f, vset(5.5504108664821580e-02f));
  p = vfma(p, f, vset(2.4022650695910071e-01f));
  p = vfma(p, f, vset(6.9314718055994531e-01f));
  p = vfma(p, f, vset(1.0f));
  return vscale2(p, n);
}

// The register-blocked product of both matmuls: C[kMr][NV·W] = A[kMr][n] · B[n][NV·W]
// (Add: C +=), rows of A broadcast one element at a time against rows of B.
// S = Q Kᵀ takes B from a Kᵀ panel, acc += P̃ V from V.
template <int NV, bool Add>
inline void micro(const float* A, int lda, const float* B, int ldb, int n, float* C, int ldc) {
  vec acc[kMr][NV];
  for (int i = 0; i < kMr; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = Add ? vload(C + i * ldc + W * j) : vset(0.0f);
  for (int t = 0; t < n; ++t) {
    vec b[NV];
    for (int j = 0; j < NV; ++j) b[j] = vload(B + t * ldb + W * j);
    for (int i = 0; i < kMr; ++i) {
      const vec a = vset(A[i * lda + t]);
      for (int j = 0; j < NV; ++j) acc[i][j] = vfma(a, b[j], acc[i][j]);
    }
  }
  for (int i = 0; i < kMr; ++i)
    for (int j = 0; j < NV; ++j) vstore(C + i * ldc + W * j, acc[i][j]);
}

// S[kMr][kPanel] = Q[kMr][d] · Kpᵀ, one panel of keys.
inline void qk_micro(const float* Q, const float* Kp, int d, float* S, int lds) {
  micro<kNv, false>(Q, d, Kp, kPanel, d, S, lds);
}

// The kMr rows of acc (dp columns) += P̃ · V, in chunks of kNv vectors, then fewer.
template <int NV>
inline void pv_chunk(int nv, const float* P, int ldp, const float* V, int dp, int nk, float* A) {
  if constexpr (NV > 1)
    if (nv < NV) return pv_chunk<NV - 1>(nv, P, ldp, V, dp, nk, A);
  micro<NV, true>(P, ldp, V, dp, nk, A, dp);
}

inline void pv_rows(const float* P, int ldp, const float* V, int dp, int nk, float* A) {
  for (int c = 0; c < dp; c += kPanel)
    pv_chunk<kNv>((dp - c) / W, P, ldp, V + c, dp, nk, A + c);
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
      mem = std::aligned_alloc(64, (n + 15) / 16 * 16 * sizeof(float));
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
    // keys of this tile that micro-tile i's rows see: none of its rows sees a key past
    // that, so its scores there are not computed (the mask below overwrites them) and
    // its P̃ there (0) is not multiplied
    auto seen_by = [&](int i) {
      return int(std::clamp<long>(limit(r0 + std::min(i + kMr, br) - 1) - c0, 0, bc));
    };
    // -- compute qk: S₂ = (c·Q_i) K_jᵀ --
    for (int p = 0; p < bcp; p += kPanel)
      for (int i = 0; i < brp; i += kMr)
        if (p < seen_by(i)) qk_micro(w.Q + i * d, Kp + (c0 + p) * d, d, w.S + i * kBc + p, kBc);
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
      pv_rows(w.S + i * kBc, kBc, Vp + size_t(c0) * dp, dp, seen_by(i), w.acc + size_t(i) * dp);
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

// W (floats a vector) and P (keys a Kᵀ panel) of this build: the packed layouts' sizes.
void cuflash_layout(int* width, int* panel) { *width = W, *panel = kPanel; }

// Kp, Vp (layouts above) from k, v (Nk, d).
void cuflash_pack_kv(const float* k, const float* v, int Nk, int d, float* Kp, float* Vp) {
  const int dp = (d + W - 1) / W * W, nkp = (Nk + kPanel - 1) / kPanel * kPanel;
  for (int p = 0; p < nkp; p += kPanel)
    for (int t = 0; t < d; ++t)
      for (int j = 0; j < kPanel; ++j)
        Kp[size_t(p) * d + t * kPanel + j] = p + j < Nk ? k[size_t(p + j) * d + t] : 0.0f;
  for (int j = 0; j < nkp; ++j)
    for (int t = 0; t < dp; ++t)
      Vp[size_t(j) * dp + t] = j < Nk && t < d ? v[size_t(j) * d + t] : 0.0f;
}

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
