// Helpers and the row kernels' dispatch shared by the x86 block-product units (block_gemm_avx2.cpp,
// block_gemm_avx512.cpp, block_gemm_packed_avx2.cpp, block_gemm_packed_avx512.cpp). Each unit includes
// it after <immintrin.h> under its own target pragma, so each compiles its own copy: everything here
// has internal linkage, and no copy compiled for one level can stand in for another's. A row kernel
// unit defines `gemm_tile` (declared below) and calls `row_products`.
#pragma once

#include "kernels.h"

namespace keel {

namespace {

template <bool Half>
inline float scale_at(const void* p, int64_t i) {
  if constexpr (Half) {
    return _cvtsh_ss(static_cast<const uint16_t*>(p)[i]);
  } else {
    return static_cast<const float*>(p)[i];
  }
}

// Blocks per scale as a shift: a power of two, or the whole row (shift past every block index).
inline int group_shift(const BlockWeights& w) {
  if (w.group_blocks == w.blocks) return 62;
  int shift = 0;
  while ((int64_t{1} << shift) < w.group_blocks) ++shift;
  return shift;
}

inline float scale_of(const BlockWeights& w, const void* p, int64_t i) {
  return w.scale_half ? _cvtsh_ss(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}

// Transposes 8 vectors of 8 int32 lanes: out[g] lane j = in[j] lane g.
inline void transpose8(__m256i v[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(v[i], v[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(v[i], v[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
    v[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
  }
}

// How far ahead the row kernels prefetch the next rows' codes: the next tile (the distance the
// measurements settled on).
constexpr int64_t kPrefetchRows = 4;

// Output features n..n+NR over activation rows m..m+MR: each row kernel unit's own tile.
template <int Bits, bool Half, bool Min, bool Two, bool Sub, int NR, int MR>
void gemm_tile(const BlockWeights& w, int64_t n, const BlockActivations& a, int64_t m, float* out, int64_t ldo);

template <int Bits, bool Half, bool Min, bool Two, bool Sub, int MR>
void gemm_rows(const BlockWeights& w, int64_t n0, int64_t n1, const BlockActivations& a, int64_t m, float* out,
               int64_t ldo) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) gemm_tile<Bits, Half, Min, Two, Sub, 4, MR>(w, n, a, m, out, ldo);
  for (; n < n1; ++n) gemm_tile<Bits, Half, Min, Two, Sub, 1, MR>(w, n, a, m, out, ldo);
}

template <int Bits, bool Half, bool Min, bool Two, bool Sub = false>
void gemm(const BlockWeights& w, int64_t n0, int64_t n1, const BlockActivations& a, int64_t m0, int64_t m1,
          float* out, int64_t ldo) {
  // Tiles of output features whose codes stay in L1 while every pair of activation rows passes.
  constexpr int64_t kTile = 32;
  for (int64_t t = n0; t < n1; t += kTile) {
    const int64_t te = t + kTile < n1 ? t + kTile : n1;
    int64_t m = m0;
    for (; m + 2 <= m1; m += 2) gemm_rows<Bits, Half, Min, Two, Sub, 2>(w, t, te, a, m, out, ldo);
    for (; m < m1; ++m) gemm_rows<Bits, Half, Min, Two, Sub, 1>(w, t, te, a, m, out, ldo);
  }
}

template <int Bits, bool Two>
void gemm_passes(const BlockWeights& w, int64_t n0, int64_t n1, const BlockActivations& a, int64_t m0, int64_t m1,
                 float* out, int64_t ldo) {
  const bool min = w.mins != nullptr;
  if constexpr (Bits == 8) {
    if (w.half_block_scales) {  // weights_of: no mins
      w.scale_half ? gemm<8, true, false, Two, true>(w, n0, n1, a, m0, m1, out, ldo)
                   : gemm<8, false, false, Two, true>(w, n0, n1, a, m0, m1, out, ldo);
      return;
    }
  }
  if (w.scale_half) {
    min ? gemm<Bits, true, true, Two>(w, n0, n1, a, m0, m1, out, ldo)
        : gemm<Bits, true, false, Two>(w, n0, n1, a, m0, m1, out, ldo);
  } else {
    min ? gemm<Bits, false, true, Two>(w, n0, n1, a, m0, m1, out, ldo)
        : gemm<Bits, false, false, Two>(w, n0, n1, a, m0, m1, out, ldo);
  }
}

template <int Bits>
void gemm_bits(const BlockWeights& w, int64_t n0, int64_t n1, const BlockActivations& a, int64_t m0, int64_t m1,
               float* out, int64_t ldo) {
  a.q2 != nullptr ? gemm_passes<Bits, true>(w, n0, n1, a, m0, m1, out, ldo)
                  : gemm_passes<Bits, false>(w, n0, n1, a, m0, m1, out, ldo);
}

// The row kernel over output features [n0, n1) and activation rows [m0, m1), any form.
inline void row_products(const BlockWeights& w, int64_t n0, int64_t n1, const BlockActivations& a, int64_t m0,
                         int64_t m1, float* out, int64_t ldo) {
  w.bits == 4 ? gemm_bits<4>(w, n0, n1, a, m0, m1, out, ldo) : gemm_bits<8>(w, n0, n1, a, m0, m1, out, ldo);
}

}  // namespace

}  // namespace keel
