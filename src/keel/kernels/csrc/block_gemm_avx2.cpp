// AVX2 + FMA + F16C kernels. This translation unit alone is compiled for that level (the pragma
// below, before any header), so it includes nothing with inline functions of its own that another
// unit could end up sharing: the rest of the library stays runnable on any x86-64 CPU, and the
// dispatcher calls in here only when keel.platform reports AVX2.
#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC target("avx2,fma,f16c")

#include <immintrin.h>

#include "block_gemm_shared.h"

namespace keel {

namespace {

inline float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

inline int hsum_i32(__m256i v) {
  __m128i x = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0x4e));
  x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0xb1));
  return _mm_cvtsi128_si32(x);
}

// 32 weight codes of block b as bytes (4-bit: 0..15, low nibbles are values 0..15).
template <int Bits>
inline __m256i load_codes(const uint8_t* row, int64_t b) {
  if constexpr (Bits == 4) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 16));
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
  } else {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * 32));
  }
}

// The 8 int32 partial sums of a block's integer dot product.
template <int Bits>
inline __m256i block_dot(__m256i w, const int8_t* a) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
  __m256i pairs;
  if constexpr (Bits == 4) {
    pairs = _mm256_maddubs_epi16(w, x);  // unsigned codes times signed activations
  } else {
    // maddubs needs one unsigned operand: |w| times x with w's sign.
    pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
  }
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

// 4-bit blocks b and b+1 in one pass: their 32 code bytes in one load, low and high nibbles against
// the activations' 16-byte halves in pair order (`interleave_pairs_avx2`), the two maddubs results added
// as int16 (|15 * 127 * 2| twice fits) -> int32 lanes 0-3 for block b, 4-7 for block b+1.
inline __m256i pair_dot(const uint8_t* codes, const int8_t* a) {
  const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes));
  const __m256i mask = _mm256_set1_epi8(0x0f);
  const __m256i lo = _mm256_and_si256(packed, mask);
  const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), mask);
  const __m256i sum = _mm256_add_epi16(
      _mm256_maddubs_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
      _mm256_maddubs_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 32))));
  return _mm256_madd_epi16(sum, _mm256_set1_epi16(1));
}

// A block's two half-block scales (Q6_K), each over the 4 lanes of block_dot that its 16 values fill.
template <bool Half>
inline __m256 half_block_scales(const void* p, int64_t i) {
  return _mm256_set_m128(_mm_set1_ps(scale_at<Half>(p, i + 1)), _mm_set1_ps(scale_at<Half>(p, i)));
}

// Scales of blocks 2j and 2j+1 of an 8-block vector, each over 4 lanes (pair_dot's lanes).
inline __m256 pair_scales(__m256 eight, int j) {
  return _mm256_permutevar8x32_ps(eight, _mm256_setr_epi32(2 * j, 2 * j, 2 * j, 2 * j, 2 * j + 1, 2 * j + 1, 2 * j + 1,
                                                           2 * j + 1));
}

// The scales of blocks b..b+7 of one row as floats: 8 converted at once where each block has its
// own (GGUF), else each block's group's scale.
template <bool Half>
inline __m256 eight_scales(const void* p, int64_t row_start, int64_t b, int shift) {
  if (shift == 0) {
    if constexpr (Half) {
      return _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + row_start + b)));
    } else {
      return _mm256_loadu_ps(static_cast<const float*>(p) + row_start + b);
    }
  }
  alignas(32) float v[8];
  for (int j = 0; j < 8; ++j) v[j] = scale_at<Half>(p, row_start + ((b + j) >> shift));
  return _mm256_load_ps(v);
}

// Output features n..n+NR over activation rows m..m+MR: NR x MR independent accumulators, so the
// multiply-adds of consecutive blocks do not wait on each other, and each activation block is loaded
// once for NR weight rows. Blocks go 8 at a time: their scales are converted and multiplied by the
// activations' in one vector each, and the mins' term is one multiply-add per 8 blocks.
template <int Bits, bool Half, bool Min, bool Two, bool Sub, int NR, int MR>
void gemm_tile(const BlockWeights& w, int64_t n, const BlockActivations& a, int64_t m, float* out, int64_t ldo) {
  const int64_t groups = w.blocks / w.group_blocks;
  const int shift = group_shift(w);
  const uint8_t* rows[NR];
  int64_t sb[NR];
  for (int i = 0; i < NR; ++i) {
    rows[i] = w.codes + (n + i) * w.row_bytes;
    sb[i] = (n + i) * groups;
  }
  __m256 acc[NR][MR];
  __m256 odd[NR][MR];  // the 8-bit loop's odd blocks
  __m256 min_acc[NR][MR];
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < MR; ++r) {
      acc[i][r] = _mm256_setzero_ps();
      odd[i][r] = _mm256_setzero_ps();
      min_acc[i][r] = _mm256_setzero_ps();
    }
  int64_t b = 0;
  for (; b + 8 <= w.blocks; b += 8) {
    __m256 da[MR], sa[MR];
    for (int r = 0; r < MR; ++r) {
      da[r] = _mm256_loadu_ps(a.d + (m + r) * a.blocks + b);
      if constexpr (Min) sa[r] = _mm256_loadu_ps(a.s + (m + r) * a.blocks + b);
    }
    for (int i = 0; i < NR; ++i) {
      // The same 8 blocks kPrefetchRows rows ahead: every cache line of them (2 for 4-bit, 4 for 8-bit).
      const char* ahead = reinterpret_cast<const char*>(rows[i] + kPrefetchRows * w.row_bytes + b * (Bits * kBlock / 8));
      for (int line = 0; line < Bits * kBlock / 8 * 8; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
      if constexpr (Sub) {  // 8-bit codes, two scales a block, no mins
        for (int j = 0; j < 8; ++j) {
          const __m256 ws = half_block_scales<Half>(w.scales, 2 * (sb[i] + b + j));
          const __m256i codes = load_codes<Bits>(rows[i], b + j);
          for (int r = 0; r < MR; ++r) {
            const int64_t mb = (m + r) * a.blocks + b + j;
            const __m256i dot = block_dot<Bits>(codes, a.q + (m + r) * a.k + (b + j) * kBlock);
            acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(ws, _mm256_set1_ps(a.d[mb])), acc[i][r]);
            if constexpr (Two) {
              const __m256i dot2 = block_dot<Bits>(codes, a.q2 + (m + r) * a.k + (b + j) * kBlock);
              acc[i][r] =
                  _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot2), _mm256_mul_ps(ws, _mm256_set1_ps(a.d2[mb])), acc[i][r]);
            }
          }
        }
        continue;
      }
      const __m256 dw = eight_scales<Half>(w.scales, sb[i], b, shift);
      if constexpr (Min) {
        const __m256 mw = eight_scales<Half>(w.mins, sb[i], b, shift);
        for (int r = 0; r < MR; ++r) min_acc[i][r] = _mm256_fmadd_ps(mw, sa[r], min_acc[i][r]);
      }
      if constexpr (Bits == 4) {
        for (int r = 0; r < MR; ++r) {
          const __m256 scale = _mm256_mul_ps(dw, da[r]);
          const int8_t* q = a.q + (m + r) * a.k + b * kBlock;
          for (int j = 0; j < 4; ++j)
            acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pair_dot(rows[i] + (b + 2 * j) * 16, q + 64 * j)),
                                        pair_scales(scale, j), acc[i][r]);
          if constexpr (Two) {
            const __m256 scale2 = _mm256_mul_ps(dw, _mm256_loadu_ps(a.d2 + (m + r) * a.blocks + b));
            const int8_t* q2 = a.q2 + (m + r) * a.k + b * kBlock;
            for (int j = 0; j < 4; ++j)
              acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pair_dot(rows[i] + (b + 2 * j) * 16, q2 + 64 * j)),
                                          pair_scales(scale2, j), acc[i][r]);
          }
        }
        continue;
      }
      alignas(32) float scale[MR][8];
      alignas(32) float scale2[MR][8];
      for (int r = 0; r < MR; ++r) {
        _mm256_store_ps(scale[r], _mm256_mul_ps(dw, da[r]));
        if constexpr (Two) _mm256_store_ps(scale2[r], _mm256_mul_ps(dw, _mm256_loadu_ps(a.d2 + (m + r) * a.blocks + b)));
      }
      for (int j = 0; j < 8; ++j) {
        const __m256i codes = load_codes<Bits>(rows[i], b + j);
        for (int r = 0; r < MR; ++r) {
          // Odd blocks into a second accumulator: two multiply-add chains a row instead of one.
          __m256& sum = (j & 1) ? odd[i][r] : acc[i][r];
          const __m256i dot = block_dot<Bits>(codes, a.q + (m + r) * a.k + (b + j) * kBlock);
          sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_broadcast_ss(&scale[r][j]), sum);
          if constexpr (Two) {
            const __m256i dot2 = block_dot<Bits>(codes, a.q2 + (m + r) * a.k + (b + j) * kBlock);
            sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot2), _mm256_broadcast_ss(&scale2[r][j]), sum);
          }
        }
      }
    }
  }
  float tail[NR][MR] = {};
  if constexpr (Bits == 4) {  // whole pairs left: their activations are in pair order too
    for (; b + 2 <= w.blocks; b += 2) {
      const int64_t g0 = b >> shift, g1 = (b + 1) >> shift;
      for (int i = 0; i < NR; ++i) {
        const float d0 = scale_at<Half>(w.scales, sb[i] + g0), d1 = scale_at<Half>(w.scales, sb[i] + g1);
        for (int r = 0; r < MR; ++r) {
          const int64_t mb = (m + r) * a.blocks + b;
          const int64_t qo = (m + r) * a.k + b * kBlock;
          const __m256 scale = _mm256_setr_ps(d0 * a.d[mb], d0 * a.d[mb], d0 * a.d[mb], d0 * a.d[mb], d1 * a.d[mb + 1],
                                              d1 * a.d[mb + 1], d1 * a.d[mb + 1], d1 * a.d[mb + 1]);
          acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pair_dot(rows[i] + b * 16, a.q + qo)), scale, acc[i][r]);
          if constexpr (Two) {
            const __m256 scale2 = _mm256_setr_ps(d0 * a.d2[mb], d0 * a.d2[mb], d0 * a.d2[mb], d0 * a.d2[mb],
                                                 d1 * a.d2[mb + 1], d1 * a.d2[mb + 1], d1 * a.d2[mb + 1],
                                                 d1 * a.d2[mb + 1]);
            acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pair_dot(rows[i] + b * 16, a.q2 + qo)), scale2, acc[i][r]);
          }
          if constexpr (Min)
            tail[i][r] += scale_at<Half>(w.mins, sb[i] + g0) * a.s[mb] + scale_at<Half>(w.mins, sb[i] + g1) * a.s[mb + 1];
        }
      }
    }
  }
  for (; b < w.blocks; ++b) {
    const int64_t g = b >> shift;
    for (int i = 0; i < NR; ++i) {
      const __m256i codes = load_codes<Bits>(rows[i], b);
      const __m256 dw = Sub ? half_block_scales<Half>(w.scales, 2 * (sb[i] + b))
                            : _mm256_set1_ps(scale_at<Half>(w.scales, sb[i] + g));
      const float mw = Min ? scale_at<Half>(w.mins, sb[i] + g) : 0.f;
      for (int r = 0; r < MR; ++r) {
        const int64_t mb = (m + r) * a.blocks + b;
        const __m256i dot = block_dot<Bits>(codes, a.q + (m + r) * a.k + b * kBlock);
        acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dw, _mm256_set1_ps(a.d[mb])), acc[i][r]);
        if constexpr (Two) {
          const __m256i dot2 = block_dot<Bits>(codes, a.q2 + (m + r) * a.k + b * kBlock);
          acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot2), _mm256_mul_ps(dw, _mm256_set1_ps(a.d2[mb])), acc[i][r]);
        }
        if constexpr (Min) tail[i][r] += mw * a.s[mb];
      }
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < MR; ++r)
      out[(m + r) * ldo + n + i] =
          hsum(Bits == 8 ? _mm256_add_ps(acc[i][r], odd[i][r]) : acc[i][r]) + (Min ? hsum(min_acc[i][r]) + tail[i][r] : 0.f);
}

}  // namespace

namespace {

// 32 values in 4 vectors times `inverse`, rounded and clamped to +-127 -> int8 codes, and the codes as
// floats (for the residual); returns the codes' sum.
inline int codes_of_block(const __m256 v[4], float scale_inverse, int8_t* q, __m256 rounded[4]) {
  const __m256 inverse = _mm256_set1_ps(scale_inverse);
  const __m256 top = _mm256_set1_ps(127.f), bottom = _mm256_set1_ps(-127.f);
  __m256i ints[4];
  for (int i = 0; i < 4; ++i) {
    rounded[i] = _mm256_round_ps(_mm256_mul_ps(v[i], inverse), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    rounded[i] = _mm256_min_ps(top, _mm256_max_ps(bottom, rounded[i]));
    ints[i] = _mm256_cvtps_epi32(rounded[i]);
  }
  const __m256i total = _mm256_add_epi32(_mm256_add_epi32(ints[0], ints[1]), _mm256_add_epi32(ints[2], ints[3]));
  const __m256i p01 = _mm256_packs_epi32(ints[0], ints[1]);
  const __m256i p23 = _mm256_packs_epi32(ints[2], ints[3]);
  const __m256i bytes =
      _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), bytes);
  return hsum_i32(total);
}

// 32 values in 4 vectors -> int8 codes, their scale, and the codes as floats (for the residual).
inline int quantize_block(const __m256 v[4], int8_t* q, float* d, __m256 rounded[4]) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], abs_mask));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float top = _mm_cvtss_f32(m4);
  *d = top / 127.f;
  return codes_of_block(v, *d != 0.f ? 127.f / top : 0.f, q, rounded);
}

}  // namespace

void interleave_pairs_avx2(int8_t* q, int64_t k) {
  // Blocks 2p and 2p+1 as [2p low half, 2p+1 low half, 2p high half, 2p+1 high half] (pair_dot's order).
  for (int64_t b = 0; b + 2 <= k / kBlock; b += 2) {
    __m128i* c = reinterpret_cast<__m128i*>(q + b * kBlock);
    const __m128i c1 = _mm_loadu_si128(c + 1), c2 = _mm_loadu_si128(c + 2);
    _mm_storeu_si128(c + 1, c2);
    _mm_storeu_si128(c + 2, c1);
  }
}

void quantize_row_avx2(const float* x, int64_t k, int8_t* q, float* d, float* s, int8_t* q2, float* d2) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    __m256 v[4], rounded[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + b * kBlock + 8 * i);
    const int sum = quantize_block(v, q + b * kBlock, d + b, rounded);
    s[b] = d[b] * static_cast<float>(sum);
    if (q2 != nullptr) {
      // The residual, exactly as the scalar path computes it: x - q * d (no fused multiply-add).
      const __m256 scale = _mm256_set1_ps(d[b]);
      __m256 residual[4], unused[4];
      for (int i = 0; i < 4; ++i) residual[i] = _mm256_sub_ps(v[i], _mm256_mul_ps(rounded[i], scale));
      d2[b] = d[b] / kResidualSteps;
      const int sum2 = codes_of_block(residual, residual_inverse(d[b]), q2 + b * kBlock, unused);
      s[b] += d2[b] * static_cast<float>(sum2);
    }
  }
}

void block_gemm_avx2(const BlockWeights& w, int64_t n0, int64_t n1, const BlockActivations& a, int64_t m0,
                     int64_t m1, float* out, int64_t ldo) {
  row_products(w, n0, n1, a, m0, m1, out, ldo);
}

}  // namespace keel
#endif
