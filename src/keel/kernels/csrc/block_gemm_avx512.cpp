// AVX-512 VNNI kernels for block-quantized products of a few activation rows (decode). This unit alone
// is compiled for AVX-512 F/BW/VL/DQ + VNNI (the pragma below, before any header), for the reason
// block_gemm_avx2.cpp gives; the dispatcher calls in here only when keel.platform reports avx512_vnni
// or above.
//
// What VNNI changes against the AVX2 loop: one vpdpbusd multiplies 64 unsigned bytes by 64 signed
// bytes and adds each 4 products into an int32 lane, where AVX2 spends maddubs + madd on 32. A 512-bit
// vector holds four 4-bit blocks' codes (their low nibbles, then their high nibbles, in one load), so
// the activations of each 4 blocks are stored in quad order (`interleave_quads_avx512`): the 4 blocks' first
// 16 values, then their last 16. 8-bit codes are signed: |w| against the activations with w's sign
// (a masked negation; the activations lie in -127..127, so negating never overflows).
#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
// GCC 12's own AVX-512 headers trip these (their _mm512_undefined_* values), not this code.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <immintrin.h>

#include <type_traits>

#include "block_gemm_shared.h"

namespace keel {

namespace {

// Per-lane scales of `count` (<= 16) consecutive blocks from b of the row starting at row_start: one masked load where each entry is its
// own (GGUF blocks, half-block scales), else each block's group's scale (keel's int4 groups).
template <bool Half>
inline __m512 sixteen(const void* p, int64_t row_start, int64_t b, int shift, int count) {
  const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
  if (shift == 0) {
    if constexpr (Half) {
      return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(p) + row_start + b));
    } else {
      return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(p) + row_start + b);
    }
  }
  alignas(64) float v[16] = {};
  for (int j = 0; j < count; ++j) v[j] = scale_at<Half>(p, row_start + ((b + j) >> shift));
  return _mm512_load_ps(v);
}

// Lane l of the result = lane idx[l] of v: spreads 4 (or 2) consecutive per-block products over the
// lanes that vpdpbusd fills for those blocks.
inline __m512 spread(__m512 v, __m512i idx) { return _mm512_permutexvar_ps(idx, v); }

// Lanes 4t..4t+3 <- entry 4j+t (four entries over four lanes each).
inline __m512i quad_index(int j) {
  return _mm512_add_epi32(_mm512_set1_epi32(4 * j),
                          _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3));
}

// Lanes 8t..8t+7 <- entry 2j+t (two entries over eight lanes each).
inline __m512i pair_index(int j) {
  return _mm512_add_epi32(_mm512_set1_epi32(2 * j),
                          _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
}

// Bytes 0..n-1 of a vector (a partial last vector of a row: fewer blocks than the vector holds).
inline __mmask64 first_bytes(int n) { return n >= 64 ? ~__mmask64{0} : (__mmask64{1} << n) - 1; }

template <bool Partial>
inline __m512i load_bytes(const void* p, __mmask64 mask) {
  if constexpr (Partial) {
    return _mm512_maskz_loadu_epi8(mask, p);
  } else {
    return _mm512_loadu_si512(p);
  }
}

// The int32 lanes of `t` 4-bit blocks (t <= 4; lanes 4s..4s+3 hold block s) against activations in quad
// order: low nibbles against the blocks' first 16 values, high nibbles against their last 16.
template <bool Partial>
inline __m512i nibble_dot(__m512i lo, __m512i hi, const int8_t* a, int t) {
  const __mmask64 mask = first_bytes(16 * t);
  const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, load_bytes<Partial>(a, mask));
  return _mm512_dpbusd_epi32(dot, hi, load_bytes<Partial>(a + 16 * t, mask));
}

// |w| against the activations with w's sign (vpdpbusd takes one unsigned operand) for `t` 8-bit blocks
// (t <= 2; lanes 8s..8s+7 hold block s).
template <bool Partial>
inline __m512i signed_dot(__m512i w, const int8_t* a, int t) {
  const __m512i x = load_bytes<Partial>(a, first_bytes(32 * t));
  const __mmask64 negative = _mm512_movepi8_mask(w);
  const __m512i xs = _mm512_mask_sub_epi8(x, negative, _mm512_setzero_si512(), x);
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(w), xs);
}

// The lane sums of four vectors, [sum a, sum b, sum c, sum d]: their horizontal sums in one tree.
inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  // a0 b0 a1 b1 per lane
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xee));  // a b c d
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

// Output features n..n+NR over activation rows m..m+MR (NR x MR independent accumulators, each activation
// vector loaded once for NR weight rows). Blocks go by chunks of up to 16: their scales are converted and
// multiplied by the activations' in one vector each, and the mins' term is one multiply-add a chunk. A
// row's last vector may hold fewer blocks (masked loads): no block is left to a scalar tail.
template <int Bits, bool Half, bool Min, bool Two, bool Sub, int NR, int MR>
void gemm_tile(const BlockWeights& w, int64_t n, const BlockActivations& a, int64_t m, float* out, int64_t ldo) {
  const int64_t groups = w.blocks / w.group_blocks;
  const int shift = group_shift(w);
  // Blocks a vector holds (4-bit: 4, in quad order; 8-bit: 2), and blocks a chunk's scale vector covers
  // (half-block scales: 2 lanes a block).
  constexpr int kPer = Bits == 4 ? 4 : 2;
  constexpr int kChunk = Sub ? 8 : 16;
  constexpr int kCodeBytes = Bits * kBlock / 8;  // a block's codes
  const uint8_t* rows[NR];
  int64_t sb[NR];
  for (int i = 0; i < NR; ++i) {
    rows[i] = w.codes + (n + i) * w.row_bytes;
    sb[i] = (n + i) * groups;
  }
  __m512 acc[NR][MR];
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < MR; ++r) acc[i][r] = _mm512_setzero_ps();
  const __m512i mask4 = _mm512_set1_epi8(0x0f);
  const __m512i halves = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  for (int64_t b = 0; b < w.blocks; b += kChunk) {
    const int count = static_cast<int>(w.blocks - b < kChunk ? w.blocks - b : kChunk);
    const __mmask16 cmask = static_cast<__mmask16>((1u << count) - 1);
    __m512 da[MR], da2[MR], sa[MR];
    for (int r = 0; r < MR; ++r) {
      const int64_t mb = (m + r) * a.blocks + b;
      da[r] = _mm512_maskz_loadu_ps(cmask, a.d + mb);
      if constexpr (Two) da2[r] = _mm512_maskz_loadu_ps(cmask, a.d2 + mb);
      if constexpr (Min) sa[r] = _mm512_maskz_loadu_ps(cmask, a.s + mb);
      if constexpr (Sub) {  // one activation scale over both halves of its block
        da[r] = spread(da[r], halves);
        if constexpr (Two) da2[r] = spread(da2[r], halves);
      }
    }
#pragma GCC unroll 4
    for (int i = 0; i < NR; ++i) {
      const char* ahead = reinterpret_cast<const char*>(rows[i] + kPrefetchRows * w.row_bytes + b * kCodeBytes);
      for (int line = 0; line < count * kCodeBytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
      const __m512 dw = Sub ? sixteen<Half>(w.scales, 2 * sb[i], 2 * b, 0, 2 * count)
                            : sixteen<Half>(w.scales, sb[i], b, shift, count);
      __m512 scale[MR], scale2[MR];
      for (int r = 0; r < MR; ++r) {
        scale[r] = _mm512_mul_ps(dw, da[r]);
        if constexpr (Two) scale2[r] = _mm512_mul_ps(dw, da2[r]);
      }
      if constexpr (Min) {  // the mins' term joins the first accumulator: one sum at the end
        const __m512 mw = sixteen<Half>(w.mins, sb[i], b, shift, count);
        for (int r = 0; r < MR; ++r) acc[i][r] = _mm512_fmadd_ps(mw, sa[r], acc[i][r]);
      }
      // One vector of kPer blocks (t of them in a row's partial last vector).
      auto step = [&](int j, auto partial) {
        constexpr bool kPartial = decltype(partial)::value;
        const int t = kPartial ? count - kPer * j : kPer;
        const int8_t* at = a.q + m * a.k + (b + kPer * j) * kBlock;
        const int8_t* at2 = Two ? a.q2 + m * a.k + (b + kPer * j) * kBlock : nullptr;
        // Which scale lanes each int32 lane takes: 4-bit blocks and half-block scales 4 lanes an entry,
        // 8-bit blocks 8 lanes an entry.
        const __m512i idx = (Bits == 4 || Sub) ? quad_index(j) : pair_index(j);
        const __m512i codes = load_bytes<kPartial>(rows[i] + (b + kPer * j) * kCodeBytes, first_bytes(t * kCodeBytes));
        if constexpr (Bits == 4) {
          const __m512i lo = _mm512_and_si512(codes, mask4);
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(codes, 4), mask4);
          for (int r = 0; r < MR; ++r) {
            const __m512i dot = nibble_dot<kPartial>(lo, hi, at + r * a.k, t);
            acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), spread(scale[r], idx), acc[i][r]);
            if constexpr (Two) {
              const __m512i dot2 = nibble_dot<kPartial>(lo, hi, at2 + r * a.k, t);
              acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot2), spread(scale2[r], idx), acc[i][r]);
            }
          }
        } else {
          for (int r = 0; r < MR; ++r) {
            const __m512i dot = signed_dot<kPartial>(codes, at + r * a.k, t);
            acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), spread(scale[r], idx), acc[i][r]);
            if constexpr (Two) {
              const __m512i dot2 = signed_dot<kPartial>(codes, at2 + r * a.k, t);
              acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot2), spread(scale2[r], idx), acc[i][r]);
            }
          }
        }
      };
      // Whole chunks unrolled (constant scale indices, accumulators kept in registers), the rest as it comes.
      if (count == kChunk) {
#pragma GCC unroll 8
        for (int j = 0; j < kChunk / kPer; ++j) step(j, std::false_type{});
      } else {
        const int whole = count / kPer;
        for (int j = 0; j < whole; ++j) step(j, std::false_type{});
        if (count % kPer != 0) step(whole, std::true_type{});
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    if constexpr (NR == 4) {
      _mm_storeu_ps(out + (m + r) * ldo + n, sum4(acc[0][r], acc[1][r], acc[2][r], acc[3][r]));
    } else {
      for (int i = 0; i < NR; ++i) out[(m + r) * ldo + n + i] = _mm512_reduce_add_ps(acc[i][r]);
    }
  }
}

}  // namespace

void interleave_quads_avx512(int8_t* q, int64_t k) {
  // Blocks 4p..4p+3 as [each one's first 16 values, then each one's last 16] (gemm_tile's 4-bit order);
  // the last 1-3 blocks the same way among themselves.
  const int64_t blocks = k / kBlock;
  for (int64_t b = 0; b < blocks; b += 4) {
    const int t = static_cast<int>(blocks - b < 4 ? blocks - b : 4);
    __m128i* c = reinterpret_cast<__m128i*>(q + b * kBlock);
    __m128i v[8];
    for (int i = 0; i < 2 * t; ++i) v[i] = _mm_loadu_si128(c + i);
    for (int s = 0; s < t; ++s) {
      _mm_storeu_si128(c + s, v[2 * s]);
      _mm_storeu_si128(c + t + s, v[2 * s + 1]);
    }
  }
}

void block_gemm_avx512(const BlockWeights& w, int64_t n0, int64_t n1, const BlockActivations& a, int64_t m0,
                       int64_t m1, float* out, int64_t ldo) {
  row_products(w, n0, n1, a, m0, m1, out, ldo);
}

}  // namespace keel
#endif
