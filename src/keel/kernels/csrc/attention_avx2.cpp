// Paged decode attention for AVX2 + FMA (this unit alone is compiled for that level; the dispatcher
// calls it only when keel.platform reports AVX2): attention_vec.h's block body over 8 float lanes.
#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC target("avx2,fma,f16c")

#include <immintrin.h>

#include "attention_vec.h"
#include "sample_vec.h"
#include "silu_vec.h"

namespace {

struct Lanes8 {
  using F = __m256;
  static constexpr int kLanes = 8;
  static F zero() { return _mm256_setzero_ps(); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F select_negative(F x, F a, F b) { return _mm256_blendv_ps(b, a, x); }  // x < 0 (sign bit): a
  static float reduce_max(F v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  }
  // Into L2, as at the AVX-512 level: requested into L1, the next blocks' lines held its fill buffers and
  // the prefetch instructions themselves stalled (perf: a quarter of the block body's samples).
  static void prefetch(const char* p) { _mm_prefetch(p, _MM_HINT_T1); }
  static F from_i8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static float half(uint16_t h) { return _cvtsh_ss(h); }

  // [sum(v0), ..., sum(v7)] of 8 vectors.
  static F sums(const F v[8]) {
    const F t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    const F t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    const F u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
  }

  static F round_nearest(F x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static F pow2(F k) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23));
  }
};

}  // namespace

namespace keel {

void paged_attention_avx2(const PagedStore& s, const PagedQuery& q, const PagedItem* items, int64_t count) {
  attend_items_vectorised<Lanes8>(s, q, items, count);
}

void silu_mul_row_avx2(const float* gate, const float* up, float* out, int64_t n) {
  silu_mul_vectorised<Lanes8>(gate, up, out, n);
}

float sample_pass_avx2(const SamplePass& p) { return sample_pass_vectorised<Lanes8>(p); }

}  // namespace keel
#endif
