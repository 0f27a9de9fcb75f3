// The AVX-512 VNNI kernel over weights stored in panels of 16 rows (kernels.h, "the panel layout"), any
// number of activation rows: batch-1 decode, batched decode and prefill chunks alike. Compiled for
// AVX-512 + VNNI alone, as block_gemm_avx512.cpp is, for the same reason.
//
// Why a stored layout: the row kernel (block_gemm_avx512.cpp) reduces each output row's lanes and
// shuffles per-block scales into place on every call, and the many-row kernel
// (block_gemm_packed_avx512.cpp) repacks 16 rows into a panel on every call; here the weights already
// lie as the panel kernel reads them, one contiguous stream per 16 output rows. A panel vector's lane j
// holds 4 values of row j; one vpdpbusd multiplies it by 4 broadcast activation bytes and adds each
// row's 4 products into its lane, so 8 of them make a block's dot products for 16 rows, with no
// horizontal sum, and each row's scale is a lane of one vector load.
//
// vpdpbusd takes one unsigned operand: the weight codes. 4-bit codes are unsigned; 8-bit codes are
// stored offset by 128 (code ^ 0x80), so a dot product carries 128 x the activation block's sum of
// codes, which is subtracted (the activation side: computed once per call, shared by every panel).
// 4-bit codes centred on 8 (Q4_0) are handled the same way, with 8 x that sum, in place of their mins.
#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
// GCC 12's own AVX-512 headers trip these (their _mm512_undefined_* values), not this code.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <immintrin.h>

#include <cstdint>
#include <vector>

#include "block_gemm_stored.h"

namespace keel {

namespace {

// How far ahead one activation row prefetches the panel's stream (a product of one row is paced by
// memory; with more rows the panel stays in cache while they pass). 512 and 2048 bytes measured alike.
constexpr int64_t kAheadBytes = 1024;

inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  __builtin_memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// One activation block (32 signed bytes, natural order) against a block's 8 code vectors: the int32 dot
// products of the 16 rows, over values 0..15 (lo) and 16..31 (hi) apart with Sub, else all in lo. Two
// chains, so vpdpbusd's latency is not the pace.
template <bool Sub>
inline void block_dots(const __m512i c[8], const int8_t* x, __m512i& lo, __m512i& hi) {
  __m512i even = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c[0], broadcast4(x));
  __m512i odd = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c[1], broadcast4(x + 4));
  even = _mm512_dpbusd_epi32(even, c[2], broadcast4(x + 8));
  odd = _mm512_dpbusd_epi32(odd, c[3], broadcast4(x + 12));
  if constexpr (Sub) {
    lo = _mm512_add_epi32(even, odd);
    even = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c[4], broadcast4(x + 16));
    odd = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c[5], broadcast4(x + 20));
  } else {
    even = _mm512_dpbusd_epi32(even, c[4], broadcast4(x + 16));
    odd = _mm512_dpbusd_epi32(odd, c[5], broadcast4(x + 20));
  }
  even = _mm512_dpbusd_epi32(even, c[6], broadcast4(x + 24));
  odd = _mm512_dpbusd_epi32(odd, c[7], broadcast4(x + 28));
  (Sub ? hi : lo) = _mm512_add_epi32(even, odd);
}

// Activation rows m..m+MR against one panel: out[(m + r) * ldo + n + j] for the panel's rows j. Load:
// 4 for packed nibbles, 8 for a byte per value (8-bit codes, or 4-bit ones `expand`ed); Offset: 8-bit
// codes stored + 128, whose activation sums `offsets` are subtracted.
template <int Load, bool Offset, bool Half, bool Min, bool Two, bool Sub, bool Full, int MR>
void panel_rows(const PanelView& v, int64_t blocks, int shift, int rows, const BlockActivations& a,
                const int32_t* offsets, int64_t m, int64_t n, float* out, int64_t ldo) {
  const __mmask16 mask = static_cast<__mmask16>((1u << rows) - 1);
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i c[8];
    const uint8_t* block = v.codes + b * v.block_bytes;
    if constexpr (MR == 1) {
      for (int line = 0; line < Load; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(block + kAheadBytes + 64 * line), _MM_HINT_T0);
    }
    load_block<Load, Full>(block, rows, mask, c);
    const int64_t g = group_of<Sub>(b, shift);
    const __m512 scale = lanes_of<Half>(v.scales, g * v.group_stride, mask);
    __m512 scale_hi;
    if constexpr (Sub) scale_hi = lanes_of<Half>(v.scales, (g + 1) * v.group_stride, mask);
    __m512 min;
    if constexpr (Min) min = lanes_of<Half>(v.mins, g * v.group_stride, mask);
    for (int r = 0; r < MR; ++r) {
      const int64_t mb = (m + r) * a.blocks + b;
      const int64_t at = (m + r) * a.k + b * kBlock;
      __m512i lo, hi;
      block_dots<Sub>(c, a.q + at, lo, hi);
      float d = a.d[mb];
      if constexpr (Two) {
        // The residual's scale is d / 2^kResidualShift (kernels.h): both passes add in int32, scaled once.
        // At most 32 x 255 x 127 x 2^8 + 32 x 255 x 127 < 2^31 (8-bit codes; 4-bit ones far less).
        __m512i lo2, hi2;
        block_dots<Sub>(c, a.q2 + at, lo2, hi2);
        lo = _mm512_add_epi32(_mm512_slli_epi32(lo, kResidualShift), lo2);
        if constexpr (Sub) hi = _mm512_add_epi32(_mm512_slli_epi32(hi, kResidualShift), hi2);
        d = a.d2[mb];
      }
      if constexpr (Offset) {  // the codes' +128, times the activations' sums (each half apart with Sub)
        const int32_t* o = offsets + 2 * ((m + r) * a.blocks + b);
        int32_t lo_offset = o[0], hi_offset = o[1];
        if constexpr (Two) {
          const int32_t* o2 = offsets + 2 * ((a.m + m + r) * a.blocks + b);
          lo_offset = lo_offset * (1 << kResidualShift) + o2[0];
          hi_offset = hi_offset * (1 << kResidualShift) + o2[1];
        }
        lo = _mm512_sub_epi32(lo, _mm512_set1_epi32(lo_offset));
        if constexpr (Sub) hi = _mm512_sub_epi32(hi, _mm512_set1_epi32(hi_offset));
      }
      const __m512 da = _mm512_set1_ps(d);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_mul_ps(scale, da), acc[r]);
      if constexpr (Sub) acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_mul_ps(scale_hi, da), acc[r]);
      if constexpr (Min) acc[r] = _mm512_fmadd_ps(min, _mm512_set1_ps(a.s[mb]), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(out + (m + r) * ldo + n, mask, acc[r]);
}

template <int Load, bool Offset, bool Half, bool Min, bool Two, bool Sub, bool Full>
void rows_against(const PanelView& v, int64_t blocks, int shift, int rows, const BlockActivations& a,
                  const int32_t* offsets, int64_t m0, int64_t m1, int64_t n, float* out, int64_t ldo) {
  int64_t m = m0;
  for (; m + 4 <= m1; m += 4)
    panel_rows<Load, Offset, Half, Min, Two, Sub, Full, 4>(v, blocks, shift, rows, a, offsets, m, n, out, ldo);
  switch (m1 - m) {
    case 3:
      panel_rows<Load, Offset, Half, Min, Two, Sub, Full, 3>(v, blocks, shift, rows, a, offsets, m, n, out, ldo);
      break;
    case 2:
      panel_rows<Load, Offset, Half, Min, Two, Sub, Full, 2>(v, blocks, shift, rows, a, offsets, m, n, out, ldo);
      break;
    case 1:
      panel_rows<Load, Offset, Half, Min, Two, Sub, Full, 1>(v, blocks, shift, rows, a, offsets, m, n, out, ldo);
      break;
    default:
      break;
  }
}

template <int Bits, bool Half, bool Min, bool Two, bool Sub, bool Full>
void panel(const BlockWeights& w, int64_t p, int rows, const BlockActivations& a, const int32_t* offsets,
           int64_t m0, int64_t m1, float* out, int64_t ldo, std::vector<uint8_t>& storage) {
  const int64_t groups = groups_of(w), first = p * kRows;
  const PanelView v = view_of(w, p, rows);
  const int shift = shift_of(w);
  if (m1 - m0 >= kExpandRows) {
    bool centered = false;
    const PanelView e = expand<Bits, Half, Min, Full>(v, w.blocks, groups, rows, storage, &centered);
    if constexpr (Bits == 4 && Min) {
      if (centered && offsets != nullptr) {  // Q4_0: its mins as the integer offsets (kernels.h)
        rows_against<8, true, false, false, Two, Sub, true>(e, w.blocks, shift, rows, a, offsets, m0, m1, first, out,
                                                            ldo);
        return;
      }
    }
    rows_against<8, Bits == 8, false, Min, Two, Sub, Bits == 4 || Full>(e, w.blocks, shift, rows, a, offsets, m0, m1,
                                                                         first, out, ldo);
    return;
  }
  rows_against<Bits, Bits == 8, Half, Min, Two, Sub, Full>(v, w.blocks, shift, rows, a, offsets, m0, m1, first, out,
                                                            ldo);
}

template <int Bits, bool Half, bool Min, bool Two, bool Sub>
void panels(const BlockWeights& w, int64_t p0, int64_t p1, const BlockActivations& a, const int32_t* offsets,
            int64_t m0, int64_t m1, float* out, int64_t ldo) {
  std::vector<uint8_t> storage;  // an expanded panel's (one at a time)
  for_each_panel(w, p0, p1, [&](int64_t p, int rows, auto full) {
    panel<Bits, Half, Min, Two, Sub, decltype(full)::value>(w, p, rows, a, offsets, m0, m1, out, ldo, storage);
  });
}

template <int Bits, bool Sub>
void forms(const BlockWeights& w, int64_t p0, int64_t p1, const BlockActivations& a, const int32_t* offsets,
           int64_t m0, int64_t m1, float* out, int64_t ldo) {
  const bool min = w.mins != nullptr, two = a.q2 != nullptr;
  if constexpr (Sub) {  // half-block scales: 8-bit codes, no mins
    if (w.scale_half) {
      two ? panels<Bits, true, false, true, true>(w, p0, p1, a, offsets, m0, m1, out, ldo)
          : panels<Bits, true, false, false, true>(w, p0, p1, a, offsets, m0, m1, out, ldo);
    } else {
      two ? panels<Bits, false, false, true, true>(w, p0, p1, a, offsets, m0, m1, out, ldo)
          : panels<Bits, false, false, false, true>(w, p0, p1, a, offsets, m0, m1, out, ldo);
    }
    return;
  }
  if (w.scale_half) {
    if (min) {
      two ? panels<Bits, true, true, true, false>(w, p0, p1, a, offsets, m0, m1, out, ldo)
          : panels<Bits, true, true, false, false>(w, p0, p1, a, offsets, m0, m1, out, ldo);
    } else {
      two ? panels<Bits, true, false, true, false>(w, p0, p1, a, offsets, m0, m1, out, ldo)
          : panels<Bits, true, false, false, false>(w, p0, p1, a, offsets, m0, m1, out, ldo);
    }
  } else if (min) {
    two ? panels<Bits, false, true, true, false>(w, p0, p1, a, offsets, m0, m1, out, ldo)
        : panels<Bits, false, true, false, false>(w, p0, p1, a, offsets, m0, m1, out, ldo);
  } else {
    two ? panels<Bits, false, false, true, false>(w, p0, p1, a, offsets, m0, m1, out, ldo)
        : panels<Bits, false, false, false, false>(w, p0, p1, a, offsets, m0, m1, out, ldo);
  }
}

}  // namespace

void block_gemm_stored_avx512(const BlockWeights& w, int64_t p0, int64_t p1, const BlockActivations& a,
                              const int32_t* offsets, int64_t m0, int64_t m1, float* out, int64_t ldo) {
  for_form(w, [&](auto bits, auto sub) {
    forms<decltype(bits)::value, decltype(sub)::value>(w, p0, p1, a, offsets, m0, m1, out, ldo);
  });
}

}  // namespace keel
#endif
