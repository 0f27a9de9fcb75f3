// Paged decode attention for AVX-512 (this unit alone is compiled for that level; the dispatcher calls it
// only when keel.platform reports avx512_vnni or above): attention_vec.h's block body over 16 float lanes,
// half the instructions of the AVX2 body per key and channel.
#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")
// GCC 12's own AVX-512 headers trip these (their _mm512_undefined_* values), not this code.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <immintrin.h>

#include "attention_vec.h"
#include "sample_vec.h"
#include "silu_vec.h"

namespace {

struct Lanes16 {
  using F = __m512;
  static constexpr int kLanes = 16;
  static F zero() { return _mm512_setzero_ps(); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F select_negative(F x, F a, F b) {  // x < 0 (sign bit): a
    return _mm512_mask_blend_ps(_mm512_movepi32_mask(_mm512_castps_si512(x)), b, a);
  }
  static float reduce_max(F v) { return _mm512_reduce_max_ps(v); }
  // Into L2: the next blocks' lines requested into L1 held its fill buffers, and the prefetches stalled
  // behind them once the cache no longer fits in L2 (docs/BENCHMARKS.md, sixth part).
  static void prefetch(const char* p) { _mm_prefetch(p, _MM_HINT_T1); }
  static F from_i8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static float half(uint16_t h) { return _cvtsh_ss(h); }

  // [sum(v0), ..., sum(v15)] of 16 vectors: pairs interleaved and added within 128-bit lanes, then the
  // 128-bit lanes of four and of eight vectors exchanged and added; lane i ends with vector i's sum.
  static F sums(const F v[16]) {
    F s[8], t[4], u[2];
    for (int i = 0; i < 8; ++i)
      s[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i)
      t[i] = _mm512_add_ps(_mm512_shuffle_ps(s[2 * i], s[2 * i + 1], 0x44), _mm512_shuffle_ps(s[2 * i], s[2 * i + 1], 0xee));
    for (int i = 0; i < 2; ++i)
      u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                           _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xdd));
  }

  static F round_nearest(F x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static F pow2(F k) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23));
  }
};

}  // namespace

namespace keel {

void paged_attention_avx512(const PagedStore& s, const PagedQuery& q, const PagedItem* items, int64_t count) {
  attend_items_vectorised<Lanes16>(s, q, items, count);
}

void silu_mul_row_avx512(const float* gate, const float* up, float* out, int64_t n) {
  silu_mul_vectorised<Lanes16>(gate, up, out, n);
}

float sample_pass_avx512(const SamplePass& p) { return sample_pass_vectorised<Lanes16>(p); }

}  // namespace keel
#endif
