// The aarch64 row kernel of the block products, written once over an integer dot-product policy and
// compiled twice: block_gemm_neon.cpp (ARMv8.0 NEON: widening multiplies, pairwise-added into int32)
// and block_gemm_neon_dotprod.cpp (ARMv8.2's SDOT, under its own target pragma). Each unit includes it
// after <arm_neon.h>; everything here has internal linkage, so no copy compiled for one level can stand
// in for another's.
//
// Weights in the row layout (kernels.h), activations in their natural order. Each block's integer dot
// product stays a vector of 4 partial sums, converted and scaled as a vector (one multiply-add a block
// and row, no horizontal sum until the row ends), as llama.cpp's NEON dot products do. Tiles of 4 output
// features read each activation block once; tiles of 32 features keep their codes in L1 while every
// activation row passes.
#pragma once

#include <cstring>

#include "kernels.h"

namespace keel {

namespace {

template <bool Half>
inline float neon_scale(const void* p, int64_t i) {
  if constexpr (Half) {
    __fp16 value;
    std::memcpy(&value, static_cast<const uint16_t*>(p) + i, sizeof(value));
    return static_cast<float>(value);
  } else {
    return static_cast<const float*>(p)[i];
  }
}

// Block b's 32 weight codes as two vectors of 16 signed values: 4-bit codes (0..15) split from their
// nibbles (values j and j+16 share byte j), 8-bit ones loaded as they lie.
template <int Bits>
inline void block_codes(const uint8_t* row, int64_t b, int8x16_t& lo, int8x16_t& hi) {
  if constexpr (Bits == 4) {
    const uint8x16_t v = vld1q_u8(row + b * (kBlock / 2));
    lo = vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(0x0f)));
    hi = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
  } else {
    const int8_t* c = reinterpret_cast<const int8_t*>(row) + b * kBlock;
    lo = vld1q_s8(c);
    hi = vld1q_s8(c + kBlock / 2);
  }
}

// Output features n..n+NR against activation row m. Half: float16 scales; Min: a min per group;
// Two: the activations' second pass; Halves: a scale per half block (8-bit codes, no mins).
template <typename Dot, int Bits, bool Half, bool Min, bool Two, bool Halves, int NR>
void neon_tile(const BlockWeights& w, int64_t n, const BlockActivations& a, int64_t m, float* out, int64_t ldo) {
  const int64_t blocks = w.blocks, groups = blocks / w.group_blocks;
  const int8_t* aq = a.q + m * a.k;
  const int8_t* aq2 = Two ? a.q2 + m * a.k : nullptr;
  const float* ad = a.d + m * a.blocks;
  const float* ad2 = Two ? a.d2 + m * a.blocks : nullptr;
  const float* as = a.s + m * a.blocks;
  const uint8_t* rows[NR];
  float32x4_t acc[NR];
  float min_acc[NR];
  for (int r = 0; r < NR; ++r) {
    rows[r] = w.codes + (n + r) * w.row_bytes;
    acc[r] = vdupq_n_f32(0.f);
    min_acc[r] = 0.f;
  }
  const int32x4_t zero = vdupq_n_s32(0);
  for (int64_t b = 0; b < blocks; ++b) {
    const int8x16_t a0 = vld1q_s8(aq + b * kBlock), a1 = vld1q_s8(aq + b * kBlock + kBlock / 2);
    int8x16_t b0, b1;
    if constexpr (Two) {
      b0 = vld1q_s8(aq2 + b * kBlock);
      b1 = vld1q_s8(aq2 + b * kBlock + kBlock / 2);
    }
    for (int r = 0; r < NR; ++r) {
      int8x16_t lo, hi;
      block_codes<Bits>(rows[r], b, lo, hi);
      if constexpr (Halves) {
        const int64_t s = (n + r) * 2 * blocks + 2 * b;
        const float d0 = neon_scale<Half>(w.scales, s), d1 = neon_scale<Half>(w.scales, s + 1);
        acc[r] = vfmaq_n_f32(acc[r], vcvtq_f32_s32(Dot::dot(zero, lo, a0)), d0 * ad[b]);
        acc[r] = vfmaq_n_f32(acc[r], vcvtq_f32_s32(Dot::dot(zero, hi, a1)), d1 * ad[b]);
        if constexpr (Two) {
          acc[r] = vfmaq_n_f32(acc[r], vcvtq_f32_s32(Dot::dot(zero, lo, b0)), d0 * ad2[b]);
          acc[r] = vfmaq_n_f32(acc[r], vcvtq_f32_s32(Dot::dot(zero, hi, b1)), d1 * ad2[b]);
        }
      } else {
        const int64_t g = (n + r) * groups + b / w.group_blocks;
        const float d = neon_scale<Half>(w.scales, g);
        acc[r] = vfmaq_n_f32(acc[r], vcvtq_f32_s32(Dot::dot(Dot::dot(zero, lo, a0), hi, a1)), d * ad[b]);
        if constexpr (Two)
          acc[r] = vfmaq_n_f32(acc[r], vcvtq_f32_s32(Dot::dot(Dot::dot(zero, lo, b0), hi, b1)), d * ad2[b]);
        if constexpr (Min) min_acc[r] += neon_scale<Half>(w.mins, g) * as[b];
      }
    }
  }
  for (int r = 0; r < NR; ++r) out[m * ldo + n + r] = vaddvq_f32(acc[r]) + min_acc[r];
}

template <typename Dot, int Bits, bool Half, bool Min, bool Two, bool Halves>
void neon_gemm(const BlockWeights& w, int64_t n0, int64_t n1, const BlockActivations& a, int64_t m0, int64_t m1,
               float* out, int64_t ldo) {
  constexpr int64_t kTile = 32;
  for (int64_t t = n0; t < n1; t += kTile) {
    const int64_t te = t + kTile < n1 ? t + kTile : n1;
    for (int64_t m = m0; m < m1; ++m) {
      int64_t n = t;
      for (; n + 4 <= te; n += 4) neon_tile<Dot, Bits, Half, Min, Two, Halves, 4>(w, n, a, m, out, ldo);
      for (; n < te; ++n) neon_tile<Dot, Bits, Half, Min, Two, Halves, 1>(w, n, a, m, out, ldo);
    }
  }
}

template <typename Dot, int Bits, bool Two>
void neon_gemm_forms(const BlockWeights& w, int64_t n0, int64_t n1, const BlockActivations& a, int64_t m0,
                     int64_t m1, float* out, int64_t ldo) {
  const bool min = w.mins != nullptr;
  if constexpr (Bits == 8) {
    if (w.half_block_scales) {
      w.scale_half ? neon_gemm<Dot, 8, true, false, Two, true>(w, n0, n1, a, m0, m1, out, ldo)
                   : neon_gemm<Dot, 8, false, false, Two, true>(w, n0, n1, a, m0, m1, out, ldo);
      return;
    }
  }
  if (w.scale_half) {
    min ? neon_gemm<Dot, Bits, true, true, Two, false>(w, n0, n1, a, m0, m1, out, ldo)
        : neon_gemm<Dot, Bits, true, false, Two, false>(w, n0, n1, a, m0, m1, out, ldo);
  } else {
    min ? neon_gemm<Dot, Bits, false, true, Two, false>(w, n0, n1, a, m0, m1, out, ldo)
        : neon_gemm<Dot, Bits, false, false, Two, false>(w, n0, n1, a, m0, m1, out, ldo);
  }
}

// The row kernel over output features [n0, n1) and activation rows [m0, m1), any form.
template <typename Dot>
void neon_products(const BlockWeights& w, int64_t n0, int64_t n1, const BlockActivations& a, int64_t m0,
                   int64_t m1, float* out, int64_t ldo) {
  const bool two = a.q2 != nullptr;
  if (w.bits == 4) {
    two ? neon_gemm_forms<Dot, 4, true>(w, n0, n1, a, m0, m1, out, ldo)
        : neon_gemm_forms<Dot, 4, false>(w, n0, n1, a, m0, m1, out, ldo);
  } else {
    two ? neon_gemm_forms<Dot, 8, true>(w, n0, n1, a, m0, m1, out, ldo)
        : neon_gemm_forms<Dot, 8, false>(w, n0, n1, a, m0, m1, out, ldo);
  }
}

}  // namespace

}  // namespace keel
