// AVX2 + F16C dequantization of block weights to float32 (prefill-sized products dequantize slices of
// the weights for BLAS; the embedding looks rows up). Compiled for that level alone, as the other
// AVX2 units are. Multiply then add, no fused multiply-add: the values equal the portable loop's bit
// for bit (and the float load's: q * scale + min in float32).
#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC target("avx2,f16c")

#include <immintrin.h>

#include "kernels.h"

namespace keel {

namespace {

inline float scale_at(const BlockWeights& w, const void* p, int64_t i) {
  return w.scale_half ? _cvtsh_ss(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}

// 8 int8 codes -> floats.
inline __m256 floats_of(__m128i eight_bytes_low, bool is_unsigned) {
  return _mm256_cvtepi32_ps(is_unsigned ? _mm256_cvtepu8_epi32(eight_bytes_low) : _mm256_cvtepi8_epi32(eight_bytes_low));
}

}  // namespace

void dequantize_row_avx2(const BlockWeights& w, int64_t r, float* dst) {
  const uint8_t* row = w.codes + r * w.row_bytes;
  const int64_t groups = w.blocks / w.group_blocks;
  for (int64_t b = 0; b < w.blocks; ++b) {
    float* out = dst + b * kBlock;
    __m128i bytes[2];  // the block's 32 values as bytes, in order
    if (w.bits == 4) {
      const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 16));
      const __m128i mask = _mm_set1_epi8(0x0f);
      bytes[0] = _mm_and_si128(packed, mask);
      bytes[1] = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
    } else {
      bytes[0] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 32));
      bytes[1] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 32 + 16));
    }
    __m256 scale[2], min = _mm256_setzero_ps();
    if (w.half_block_scales) {
      scale[0] = _mm256_set1_ps(scale_at(w, w.scales, r * 2 * w.blocks + 2 * b));
      scale[1] = _mm256_set1_ps(scale_at(w, w.scales, r * 2 * w.blocks + 2 * b + 1));
    } else {
      const int64_t g = r * groups + b / w.group_blocks;
      scale[0] = scale[1] = _mm256_set1_ps(scale_at(w, w.scales, g));
      if (w.mins != nullptr) min = _mm256_set1_ps(scale_at(w, w.mins, g));
    }
    for (int half = 0; half < 2; ++half) {
      const __m128i v = bytes[half];
      const __m256 lo = floats_of(v, w.bits == 4), hi = floats_of(_mm_srli_si128(v, 8), w.bits == 4);
      __m256 a = _mm256_mul_ps(lo, scale[half]), c = _mm256_mul_ps(hi, scale[half]);
      if (w.mins != nullptr) {
        a = _mm256_add_ps(a, min);
        c = _mm256_add_ps(c, min);
      }
      _mm256_storeu_ps(out + 16 * half, a);
      _mm256_storeu_ps(out + 16 * half + 8, c);
    }
  }
}

}  // namespace keel
#endif
