// What the CPU kernels share: the vector of the instruction set the library is built
// for (-DCUFLASH_AVX512: 16 floats, 32 registers; -DCUFLASH_AVX2: 8 floats, 16), 2^x,
// the register-blocked product behind every matmul, and the packed layouts of K and V:
//   panels  (NP / P, d, P)   x (N, d) transposed in panels of P = kNv·W rows
//   rows    (NP, dp)         x with its rows padded to dp = d rounded up to W
// with NP = N rounded up to P, padding zero.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

namespace cuflash_cpu {

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
inline vec vmin(vec a, vec b) { return _mm512_min_ps(a, b); }  // b if either is NaN
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
inline vec vmin(vec a, vec b) { return _mm256_min_ps(a, b); }  // b if either is NaN
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
inline vec vscale2(vec p, vec n) {  // p·2^n for −127 ≤ n ≤ 128: n + 127 in the exponent bits
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
constexpr float kExpMin = -127.0f;  // 2^-127 has exponent bits 0: the product is 0
#else
#error "build with -DCUFLASH_AVX512 or -DCUFLASH_AVX2"
#endif

constexpr int kPanel = kNv * W;  // keys per Kᵀ panel: the S micro-tile's width
constexpr int kMr = 6;           // rows of a micro-tile
constexpr float kNegInf = -INFINITY;

// 2^x, to about 1 ulp: x = n + f with f in [−½, ½], 2^f by its Taylor series to f⁷
// (the next term is below 2^-27), 2^n into the exponent. NaN stays NaN; weights below
// 2^kExpMin are 0 (next to ℓ ≥ 1 they are below rounding), x ≥ 128 gives +inf.
inline vec exp2v(vec x) {
  x = vmin(vset(128.0f), vmax(vset(kExpMin), x));  // NaN passes: each returns its second
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

// The register-blocked product of every matmul: C[kMr][NV·W] = A[kMr][n] · B[n][NV·W]
// (Add: C +=), A's element (i, t) at A[i·sai + t·sat] broadcast against row t of B —
// so A may be a matrix or its transpose at no cost (P̃ or Pᵀ alike).
template <int NV, bool Add>
inline void micro(const float* A, long sai, long sat, const float* B, long ldb, int n, float* C,
                  long ldc) {
  vec acc[kMr][NV];
  for (int i = 0; i < kMr; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = Add ? vload(C + i * ldc + W * j) : vset(0.0f);
  for (int t = 0; t < n; ++t) {
    vec b[NV];
    for (int j = 0; j < NV; ++j) b[j] = vload(B + t * ldb + W * j);
    for (int i = 0; i < kMr; ++i) {
      const vec a = vset(A[i * sai + t * sat]);
      for (int j = 0; j < NV; ++j) acc[i][j] = vfma(a, b[j], acc[i][j]);
    }
  }
  for (int i = 0; i < kMr; ++i)
    for (int j = 0; j < NV; ++j) vstore(C + i * ldc + W * j, acc[i][j]);
}

template <int NV, bool Add>
inline void micro_chunk(int nv, const float* A, long sai, long sat, const float* B, long ldb,
                        int n, float* C, long ldc) {
  if constexpr (NV > 1)
    if (nv < NV) return micro_chunk<NV - 1, Add>(nv, A, sai, sat, B, ldb, n, C, ldc);
  micro<NV, Add>(A, sai, sat, B, ldb, n, C, ldc);
}

// The kMr rows of C[·][cols] (+)= A · B[n][cols], cols a multiple of W: in chunks of kNv
// vectors, then fewer.
template <bool Add>
inline void gemm_rows(const float* A, long sai, long sat, const float* B, long ldb, int n,
                      float* C, long ldc, int cols) {
  for (int c = 0; c < cols; c += kPanel)
    micro_chunk<kNv, Add>((cols - c) / W, A, sai, sat, B + c, ldb, n, C + c, ldc);
}

// A thread's scratch: 64-byte-aligned floats kept between calls (fresh pages cost a
// fault each), grown when a call needs more. take(n) hands out the next n floats of
// what fit() made room for, each block starting on a 64-byte boundary.
class Arena {
 public:
  void fit(size_t n) {
    if (n > size_) {
      std::free(mem_);
      mem_ = static_cast<float*>(std::aligned_alloc(64, n * sizeof(float)));
      size_ = n;
    }
    used_ = 0;
  }
  float* take(size_t n) {
    float* p = mem_ + used_;
    used_ += (n + 15) / 16 * 16;
    return p;
  }
  static size_t room(size_t n) { return (n + 15) / 16 * 16; }  // what take(n) uses
  ~Arena() { std::free(mem_); }

 private:
  float* mem_ = nullptr;
  size_t size_ = 0, used_ = 0;
};

// Keys [0, keys_seen(r)) are the ones row r sees: all Nk, or causally (bottom-right
// aligned, diag = Nk − Nq) those up to r + diag; ≤ 0 when it sees none.
inline long keys_seen(long r, long Nk, long diag, bool causal) {
  return causal ? std::min(Nk, r + 1 + diag) : Nk;
}

// x (N, d) as panels of kPanel rows, transposed: out[p / kPanel][t][j] = x[p + j][t],
// rows ≥ N zero: B of a product over t < d whose columns are x's rows (S = Q Kᵀ).
inline void pack_panels(const float* x, int N, int d, float* out) {
  const int np = (N + kPanel - 1) / kPanel * kPanel;
  for (int p = 0; p < np; p += kPanel)
    for (int t = 0; t < d; ++t)
      for (int j = 0; j < kPanel; ++j)
        out[size_t(p) * d + t * kPanel + j] = p + j < N ? x[size_t(p + j) * d + t] : 0.0f;
}

// x (N, d) with its rows padded to dp = d rounded up to W, N to kPanel, with zeros: B of
// a product over x's rows (P̃ V).
inline void pack_rows(const float* x, int N, int d, float* out) {
  const int dp = (d + W - 1) / W * W, np = (N + kPanel - 1) / kPanel * kPanel;
  for (int j = 0; j < np; ++j)
    for (int t = 0; t < dp; ++t) out[size_t(j) * dp + t] = j < N && t < d ? x[size_t(j) * d + t] : 0.0f;
}

}  // namespace cuflash_cpu
