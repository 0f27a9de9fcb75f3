// The AVX-512 VNNI kernel for many activation rows (batched decode, prefill chunks), 4-bit and 8-bit
// codes. Compiled for AVX-512 + VNNI alone, as block_gemm_avx512.cpp is, for the same reason.
//
// The AVX2 panel kernel's idea (block_gemm_packed_avx2.cpp) at twice the width and a quarter of the
// instructions: 16 output rows are repacked into a panel (4 consecutive values of each row side by side
// in one 32-bit lane per row), and one vpdpbusd multiplies a panel vector by 4 broadcast activation bytes
// and adds each row's 4 products into its lane: 8 of them make a block's dot products for 16 outputs,
// with no int16 stage and no horizontal sum. vpdpbusd takes one unsigned operand: 4-bit codes are
// unsigned; for 8-bit codes the activations are made unsigned instead (x + 128, one pass over the rows
// per call) and 128 times each row's sum of codes, kept in the panel, is subtracted from the dot.
#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
// GCC 12's own AVX-512 headers trip these (their _mm512_undefined_* values), not this code.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <immintrin.h>

#include <cstdint>
#include <vector>

#include "block_gemm_shared.h"

namespace keel {

namespace {

constexpr int kRows = 16;

// A block of the panel: 8 vectors (values 4g..4g+3 of each of the 16 rows, lane j = row j), then the
// rows' per-lane numbers (the `Meta` entries below).
enum Meta { kScale = 0, kMin = 1, kOffset = 2, kScaleHi = 3, kOffsetHi = 4, kMetas = 5 };

// Entries first + j * stride (j < rows) of a float16 or float32 array of at least `total` entries, as 16
// float lanes (zeros past `rows`). A float16 entry is gathered as the 32 bits from it, which take the next
// entry too: entry total - 1, possibly the array's last, is read on its own.
inline __m512 gather_scales(const BlockWeights& w, const void* p, int64_t first, int64_t stride, int rows,
                            int64_t total) {
  __mmask16 mask = static_cast<__mmask16>((1u << rows) - 1);
  const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32(static_cast<int32_t>(stride)));
  if (!w.scale_half)
    return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mask, idx, static_cast<const float*>(p) + first, 4);
  const bool last = first + (rows - 1) * stride == total - 1;
  if (last) mask &= static_cast<__mmask16>(~(1u << (rows - 1)));
  const __m512i words = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, idx,
                                                    static_cast<const uint16_t*>(p) + first, 2);
  __m512 out = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(words));  // each lane's low 16 bits
  if (last) {
    alignas(64) float lanes[kRows];
    _mm512_store_ps(lanes, out);
    lanes[rows - 1] = scale_of(w, p, total - 1);
    out = _mm512_load_ps(lanes);
  }
  return out;
}

// Rows n..n+rows (rows <= 16; missing rows are zeros) into the panel: codes [blocks * 8], meta
// [blocks * kMetas]. A panel vector's lane j is 4 bytes of row j: one gather per 4 bytes of a block (for
// 4-bit codes, whose byte i holds values i and i + 16, one gather gives two vectors: the low nibbles
// and the high ones), no transposes.
void pack_panel(const BlockWeights& w, int64_t n, int rows, __m512i* codes, __m512* meta) {
  const int64_t groups = w.blocks / w.group_blocks;
  const int64_t block_bytes = w.bits == 4 ? 16 : 32;
  const __m512i ones = _mm512_set1_epi8(1), nibble = _mm512_set1_epi8(0x0f);
  const __mmask16 mask = static_cast<__mmask16>((1u << rows) - 1);
  const __m512i row_offsets = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(static_cast<int32_t>(w.row_bytes)));
  // The scale entries of the rows up to this panel's last: the array may end there (the last panel's last
  // entry is then read on its own; other panels' last entries too, which costs a scalar load).
  const int64_t total = (w.half_block_scales ? 2 * w.blocks : groups) * (n + rows);
  for (int64_t b = 0; b < w.blocks; ++b) {
    const uint8_t* base = w.codes + n * w.row_bytes + b * block_bytes;
    __m512i* c = codes + b * 8;
    if (w.bits == 4) {
      for (int q = 0; q < 4; ++q) {
        const __m512i packed = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, row_offsets, base + 4 * q, 1);
        c[q] = _mm512_and_si512(packed, nibble);
        c[q + 4] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
      }
    } else {
      for (int g = 0; g < 8; ++g)
        c[g] = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, row_offsets, base + 4 * g, 1);
    }
    __m512* m = meta + b * kMetas;
    if (w.half_block_scales) {
      m[kScale] = gather_scales(w, w.scales, 2 * (n * w.blocks + b), 2 * w.blocks, rows, total);
      m[kScaleHi] = gather_scales(w, w.scales, 2 * (n * w.blocks + b) + 1, 2 * w.blocks, rows, total);
      m[kMin] = _mm512_setzero_ps();
    } else {
      const int64_t g = b / w.group_blocks;
      m[kScale] = gather_scales(w, w.scales, n * groups + g, groups, rows, total);
      m[kScaleHi] = _mm512_setzero_ps();
      m[kMin] = w.mins != nullptr ? gather_scales(w, w.mins, n * groups + g, groups, rows, total) : _mm512_setzero_ps();
    }
    if (w.bits == 8) {  // 128 x each row's sum of codes (over each half under half-block scales)
      __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
      for (int q = 0; q < 4; ++q) lo = _mm512_dpbusd_epi32(lo, ones, c[q]);
      for (int q = 4; q < 8; ++q) hi = _mm512_dpbusd_epi32(hi, ones, c[q]);
      if (!w.half_block_scales) {
        lo = _mm512_add_epi32(lo, hi);
        hi = _mm512_setzero_si512();
      }
      m[kOffset] = _mm512_castsi512_ps(_mm512_slli_epi32(lo, 7));
      m[kOffsetHi] = _mm512_castsi512_ps(_mm512_slli_epi32(hi, 7));
    }
  }
}

inline __m512i broadcast4(const uint8_t* p) {
  int32_t v;
  __builtin_memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// One activation block against one panel block: the int32 dot products of the 16 rows (with Sub, of
// the block's two halves apart). Two chains of 4 vpdpbusd, so their latency is not the pace.
template <int Bits, bool Sub>
inline void block_dots(const __m512i* c, const void* act, __m512i& lo, __m512i& hi) {
  const uint8_t* x = static_cast<const uint8_t*>(act);
  __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
  for (int g = 0; g < 8; g += 2) {
    if constexpr (Bits == 4) {  // unsigned codes, signed activations
      even = _mm512_dpbusd_epi32(even, c[g], broadcast4(x + 4 * g));
      odd = _mm512_dpbusd_epi32(odd, c[g + 1], broadcast4(x + 4 * g + 4));
    } else {  // unsigned activations (x + 128), signed codes
      even = _mm512_dpbusd_epi32(even, broadcast4(x + 4 * g), c[g]);
      odd = _mm512_dpbusd_epi32(odd, broadcast4(x + 4 * g + 4), c[g + 1]);
    }
    if constexpr (Sub) {
      if (g == 2) {  // values 0..15 done
        lo = _mm512_add_epi32(even, odd);
        even = odd = _mm512_setzero_si512();
      }
    }
  }
  if constexpr (Sub) {
    hi = _mm512_add_epi32(even, odd);
  } else {
    lo = _mm512_add_epi32(even, odd);
  }
}

// MR activation rows from m against the panel: out[(m + r) * ldo + n + j] for j < rows. `q` and `q2` are
// the activation codes as the kernel reads them (8-bit: the unsigned copy), row r at r * k.
template <int Bits, bool Min, bool Two, bool Sub, int MR>
void panel_rows(const __m512i* codes, const __m512* meta, int64_t blocks, const BlockActivations& a,
                const void* q, const void* q2, int64_t m, int64_t n, int rows, float* out, int64_t ldo) {
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const __m512i* c = codes + b * 8;
    const __m512* mt = meta + b * kMetas;
    for (int r = 0; r < MR; ++r) {
      const int64_t mb = (m + r) * a.blocks + b;
      const int64_t at = r * a.k + b * kBlock;
      for (int pass = 0; pass < (Two ? 2 : 1); ++pass) {
        __m512i lo, hi;
        block_dots<Bits, Sub>(c, static_cast<const int8_t*>(pass == 0 ? q : q2) + at, lo, hi);
        const __m512 da = _mm512_set1_ps(pass == 0 ? a.d[mb] : a.d2[mb]);
        if constexpr (Bits == 8) lo = _mm512_sub_epi32(lo, _mm512_castps_si512(mt[kOffset]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_mul_ps(mt[kScale], da), acc[r]);
        if constexpr (Sub) {
          hi = _mm512_sub_epi32(hi, _mm512_castps_si512(mt[kOffsetHi]));
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_mul_ps(mt[kScaleHi], da), acc[r]);
        }
      }
      if constexpr (Min) acc[r] = _mm512_fmadd_ps(mt[kMin], _mm512_set1_ps(a.s[mb]), acc[r]);
    }
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << rows) - 1);
  for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(out + (m + r) * ldo + n, mask, acc[r]);
}

template <int Bits, bool Min, bool Two, bool Sub>
void panel_gemm(const BlockWeights& w, int64_t n0, int64_t n1, const BlockActivations& a, int64_t m0, int64_t m1,
                float* out, int64_t ldo) {
  // 8-bit codes read the activations as unsigned bytes: x + 128 (x ^ 0x80), once per call.
  std::vector<uint8_t> unsigned_q, unsigned_q2;
  const void* q = a.q + m0 * a.k;
  const void* q2 = Two ? a.q2 + m0 * a.k : nullptr;
  if constexpr (Bits == 8) {
    const int64_t bytes = (m1 - m0) * a.k;  // a multiple of 32
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    auto shifted = [&](const int8_t* src, std::vector<uint8_t>& dst) {
      dst.resize(bytes);
      for (int64_t i = 0; i < bytes; i += 32)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst.data() + i),
                            _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)), flip));
    };
    shifted(a.q + m0 * a.k, unsigned_q);
    q = unsigned_q.data();
    if constexpr (Two) {
      shifted(a.q2 + m0 * a.k, unsigned_q2);
      q2 = unsigned_q2.data();
    }
  }
  // The panel: std::vector would drop __m512i's alignment (a template argument loses its attributes).
  std::vector<uint8_t> storage(w.blocks * (8 + kMetas) * 64 + 64);
  const uintptr_t base = (reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t{63};
  __m512i* codes = reinterpret_cast<__m512i*>(base);
  __m512* meta = reinterpret_cast<__m512*>(codes + w.blocks * 8);
  for (int64_t n = n0; n < n1; n += kRows) {
    const int rows = n1 - n < kRows ? static_cast<int>(n1 - n) : kRows;
    pack_panel(w, n, rows, codes, meta);
    auto at = [&](const void* p, int64_t m) {
      return p == nullptr ? nullptr : static_cast<const int8_t*>(p) + (m - m0) * a.k;
    };
    int64_t m = m0;
    for (; m + 4 <= m1; m += 4)
      panel_rows<Bits, Min, Two, Sub, 4>(codes, meta, w.blocks, a, at(q, m), at(q2, m), m, n, rows, out,
                                         ldo);
    switch (m1 - m) {
      case 3:
        panel_rows<Bits, Min, Two, Sub, 3>(codes, meta, w.blocks, a, at(q, m), at(q2, m), m, n, rows,
                                           out, ldo);
        break;
      case 2:
        panel_rows<Bits, Min, Two, Sub, 2>(codes, meta, w.blocks, a, at(q, m), at(q2, m), m, n, rows,
                                           out, ldo);
        break;
      case 1:
        panel_rows<Bits, Min, Two, Sub, 1>(codes, meta, w.blocks, a, at(q, m), at(q2, m), m, n, rows,
                                           out, ldo);
        break;
      default:
        break;
    }
  }
}

template <int Bits, bool Sub>
void panel_gemm_forms(const BlockWeights& w, int64_t n0, int64_t n1, const BlockActivations& a, int64_t m0,
                      int64_t m1, float* out, int64_t ldo) {
  const bool min = w.mins != nullptr, two = a.q2 != nullptr;
  if (min) {
    two ? panel_gemm<Bits, true, true, Sub>(w, n0, n1, a, m0, m1, out, ldo)
        : panel_gemm<Bits, true, false, Sub>(w, n0, n1, a, m0, m1, out, ldo);
  } else {
    two ? panel_gemm<Bits, false, true, Sub>(w, n0, n1, a, m0, m1, out, ldo)
        : panel_gemm<Bits, false, false, Sub>(w, n0, n1, a, m0, m1, out, ldo);
  }
}

}  // namespace

void block_gemm_panels_avx512(const BlockWeights& w, int64_t n0, int64_t n1, const BlockActivations& a, int64_t m0,
                              int64_t m1, float* out, int64_t ldo) {
  if (w.bits == 4) {
    panel_gemm_forms<4, false>(w, n0, n1, a, m0, m1, out, ldo);
  } else if (w.half_block_scales) {
    panel_gemm_forms<8, true>(w, n0, n1, a, m0, m1, out, ldo);
  } else {
    panel_gemm_forms<8, false>(w, n0, n1, a, m0, m1, out, ldo);
  }
}

}  // namespace keel
#endif
