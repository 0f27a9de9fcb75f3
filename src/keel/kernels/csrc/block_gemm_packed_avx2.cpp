// The AVX2 4-bit kernel for several activation rows at once (batched decode, prefill chunks). Compiled
// for AVX2 + FMA + F16C alone, as block_gemm_avx2.cpp is, for the same reason.
//
// Why a second 4-bit kernel: the row-at-a-time kernel finishes every (output, activation row) pair
// with a horizontal sum and spends a permute and a conversion per pair of blocks on every pair, which
// at many rows costs more than the multiplies. Here 8 output rows are first repacked into a panel
// (their codes as bytes, 4 consecutive values of each row side by side in one 32-bit lane per row,
// their scales and mins as float32), so one vector holds the partial sums of 8 outputs: a block is 8
// maddubs of a panel vector with 4 broadcast activation bytes, summed as int16 (|15 x 127 x 2| x 8
// fits), one madd, one conversion and one multiply-add with the 8 rows' scales times the activation
// block's scale; the result is stored as 8 outputs with no horizontal sum. The panel is built once per
// 8 rows and read by every activation row, so its cost shrinks with the rows.
#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC target("avx2,fma,f16c")

#include <immintrin.h>

#include <vector>

#include "block_gemm_shared.h"

namespace keel {

namespace {

constexpr int kPanelRows = 8;

// A block of the panel: 8 vectors (values 4g..4g+3 of each of the 8 rows, lane j = row j), then the
// 8 rows' scales and mins.
struct PanelBlock {
  __m256i codes[8];
  __m256 scales;
  __m256 mins;
};

// Rows n..n+rows (rows <= 8; missing rows are zeros) of 4-bit weights into the panel.
void pack_panel(const BlockWeights& w, int64_t n, int rows, PanelBlock* panel) {
  const int64_t groups = w.blocks / w.group_blocks;
  const __m256i mask = _mm256_set1_epi8(0x0f);
  for (int64_t b = 0; b < w.blocks; ++b) {
    PanelBlock& p = panel[b];
    __m256i v[8];
    alignas(32) float sc[8] = {}, mn[8] = {};
    const int64_t g = b / w.group_blocks;
    for (int j = 0; j < kPanelRows; ++j) {
      if (j >= rows) {
        v[j] = _mm256_setzero_si256();
        continue;
      }
      // Values 0..15 are the block's low nibbles, 16..31 its high ones: 32 values as bytes, in order.
      const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.codes + (n + j) * w.row_bytes + b * 16));
      v[j] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), mask);
      sc[j] = scale_of(w, w.scales, (n + j) * groups + g);
      if (w.mins != nullptr) mn[j] = scale_of(w, w.mins, (n + j) * groups + g);
    }
    transpose8(v);
    for (int i = 0; i < 8; ++i) p.codes[i] = v[i];
    p.scales = _mm256_load_ps(sc);
    p.mins = _mm256_load_ps(mn);
  }
}

inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  __builtin_memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// The int16 pair sums of one panel block with one activation block (lane j = row j). An empty asm
// after each add keeps the adds a chain: reassociated into a tree, the 8 products of every row would
// be live at once and spill.
inline __m256i panel_sum(const PanelBlock& p, const int8_t* a) {
  __m256i sum = _mm256_maddubs_epi16(p.codes[0], broadcast4(a));
  for (int g = 1; g < 8; ++g) {
    sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(p.codes[g], broadcast4(a + 4 * g)));
    asm("" : "+x"(sum));
  }
  return sum;
}

// MR activation rows from m against the panel: out[(m + r) * ldo + n + j] for j < rows.
template <bool Min, bool Two, int MR>
void panel_rows(const PanelBlock* panel, int64_t blocks, const BlockActivations& a, int64_t m, int64_t n, int rows,
                float* out, int64_t ldo) {
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const PanelBlock& p = panel[b];
    __m256i sum[MR], sum2[MR];
    for (int r = 0; r < MR; ++r) {
      sum[r] = panel_sum(p, a.q + (m + r) * a.k + b * kBlock);
      if constexpr (Two) sum2[r] = panel_sum(p, a.q2 + (m + r) * a.k + b * kBlock);
    }
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < MR; ++r) {
      const int64_t mb = (m + r) * a.blocks + b;
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum[r], ones));
      acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(p.scales, _mm256_broadcast_ss(a.d + mb)), acc[r]);
      if constexpr (Two) {
        const __m256 dot2 = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum2[r], ones));
        acc[r] = _mm256_fmadd_ps(dot2, _mm256_mul_ps(p.scales, _mm256_broadcast_ss(a.d2 + mb)), acc[r]);
      }
      if constexpr (Min) acc[r] = _mm256_fmadd_ps(p.mins, _mm256_broadcast_ss(a.s + mb), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    float* o = out + (m + r) * ldo + n;
    if (rows == kPanelRows) {
      _mm256_storeu_ps(o, acc[r]);
    } else {
      alignas(32) float v[8];
      _mm256_store_ps(v, acc[r]);
      for (int j = 0; j < rows; ++j) o[j] = v[j];
    }
  }
}

template <bool Min, bool Two>
void panel_gemm(const BlockWeights& w, int64_t n0, int64_t n1, const BlockActivations& a, int64_t m0, int64_t m1,
                float* out, int64_t ldo) {
  std::vector<PanelBlock> panel(w.blocks);
  for (int64_t n = n0; n < n1; n += kPanelRows) {
    const int rows = n1 - n < kPanelRows ? static_cast<int>(n1 - n) : kPanelRows;
    pack_panel(w, n, rows, panel.data());
    int64_t m = m0;
    for (; m + 4 <= m1; m += 4) panel_rows<Min, Two, 4>(panel.data(), w.blocks, a, m, n, rows, out, ldo);
    switch (m1 - m) {
      case 3: panel_rows<Min, Two, 3>(panel.data(), w.blocks, a, m, n, rows, out, ldo); break;
      case 2: panel_rows<Min, Two, 2>(panel.data(), w.blocks, a, m, n, rows, out, ldo); break;
      case 1: panel_rows<Min, Two, 1>(panel.data(), w.blocks, a, m, n, rows, out, ldo); break;
      default: break;
    }
  }
}

}  // namespace

void block_gemm_panels_avx2(const BlockWeights& w, int64_t n0, int64_t n1, const BlockActivations& a, int64_t m0,
                            int64_t m1, float* out, int64_t ldo) {
  const bool min = w.mins != nullptr, two = a.q2 != nullptr;
  if (min) {
    two ? panel_gemm<true, true>(w, n0, n1, a, m0, m1, out, ldo) : panel_gemm<true, false>(w, n0, n1, a, m0, m1, out, ldo);
  } else {
    two ? panel_gemm<false, true>(w, n0, n1, a, m0, m1, out, ldo)
        : panel_gemm<false, false>(w, n0, n1, a, m0, m1, out, ldo);
  }
}

}  // namespace keel
#endif
