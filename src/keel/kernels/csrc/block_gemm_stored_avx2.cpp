// The AVX2 kernel over weights stored in panels of 16 rows (kernels.h, "the panel layout"), any number
// of activation rows: batch-1 decode, batched decode and prefill chunks alike. Compiled for AVX2 + FMA +
// F16C alone, as block_gemm_avx2.cpp is, for the same reason.
//
// Why: the AVX2 many-row kernel (block_gemm_packed_avx2.cpp) repacks 8 rows into a panel on every call
// and reads the mins of every block; the panel layout is already what a broadcast multiply wants, one
// contiguous stream per 16 output rows. A 16-row panel vector is two AVX2 vectors of 8 rows (lane j: 4
// values of row j), so one broadcast of 4 activation bytes serves both halves. 4-bit codes are unsigned:
// `maddubs` takes them against the signed activations, 8 of them summed as int16 (15 x 127 x 2 x 8
// fits) before one `madd` to int32. 8-bit codes (stored + 128) are made signed again and multiplied as
// |w| times x with w's sign, the sign step block_gemm_avx2.cpp takes (exact for a code of -128 too), each
// pair sum widened at once (two would not fit int16). Q4_0 panels (every min exactly -8 x its scale)
// subtract 8 x the activation block's code sum as an integer, as the VNNI kernel does, in place of a
// float multiply-add a block and row.
//
// From kExpandRows rows each panel is first expanded once per call (codes as bytes, 8 vectors of 16 rows
// a block; 8-bit codes as their magnitudes, then signed; scales and mins as float32), which every group
// of rows then reads; below that the rows read the stored panel and split or sign its codes in registers.
// A panel short of 16 rows is always expanded, padded with zero rows: no masked loads anywhere.
#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC target("avx2,fma,f16c")
// four_bit_dots' sums are set at g = 0, which GCC does not follow through the unrolled loop (writing them
// before the loop instead compiled to a schedule 25% slower).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "panel_layout.h"

namespace keel {

namespace {

// The per-block helpers must inline into the block loop: called, GCC spills every accumulator around the
// call and clears the upper halves (vzeroupper) on each one.
#define KEEL_ALWAYS_INLINE inline __attribute__((always_inline))

// How far ahead a product of a few rows prefetches the panel's stream (the VNNI kernel's distance).
constexpr int64_t kAheadBytes = 1024;
constexpr int64_t kVectorBytes = 4 * kRows;  // one code vector of a panel: 4 bytes of each of 16 rows
// An expanded block: 8 vectors (values 4g..4g+3); for 8-bit codes their magnitudes, then 8 of the codes.
template <int Bits>
constexpr int64_t kBlockBytes = (Bits == 4 ? 8 : 16) * kVectorBytes;

// Block b of a stored panel of `rows` rows into `out` (kBlockBytes, 32-byte aligned): vector g (values
// 4g..4g+3) at g * 64, row j's 4 bytes at 4j (8-bit codes: |code| there, the signed code 8 vectors on);
// rows past the panel's zero.
template <int Bits>
inline void expand_block(const PanelView& v, int rows, int64_t b, uint8_t* out) {
  const uint8_t* src = v.codes + b * v.block_bytes;
  constexpr int kStored = Bits == 4 ? 4 : 8;  // stored vectors a block
  if (rows == kRows) {
    for (int s = 0; s < kStored; ++s) {
      for (int h = 0; h < 2; ++h) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + s * kVectorBytes + 32 * h));
        if constexpr (Bits == 4) {
          const __m256i nibble = _mm256_set1_epi8(0x0f);
          _mm256_store_si256(reinterpret_cast<__m256i*>(out + s * kVectorBytes + 32 * h), _mm256_and_si256(x, nibble));
          _mm256_store_si256(reinterpret_cast<__m256i*>(out + (s + 4) * kVectorBytes + 32 * h),
                             _mm256_and_si256(_mm256_srli_epi16(x, 4), nibble));
        } else {
          const __m256i code = _mm256_xor_si256(x, _mm256_set1_epi8(static_cast<char>(0x80)));
          _mm256_store_si256(reinterpret_cast<__m256i*>(out + s * kVectorBytes + 32 * h), _mm256_abs_epi8(code));
          _mm256_store_si256(reinterpret_cast<__m256i*>(out + (s + 8) * kVectorBytes + 32 * h), code);
        }
      }
    }
    return;
  }
  std::memset(out, 0, kBlockBytes<Bits>);  // a short panel: row by row, the missing rows zero
  for (int s = 0; s < kStored; ++s) {
    for (int j = 0; j < rows; ++j) {
      for (int i = 0; i < 4; ++i) {
        const uint8_t byte = src[s * 4 * rows + 4 * j + i];
        if constexpr (Bits == 4) {
          out[s * kVectorBytes + 4 * j + i] = byte & 0x0f;
          out[(s + 4) * kVectorBytes + 4 * j + i] = byte >> 4;
        } else {
          const int code = static_cast<int8_t>(byte ^ 0x80);
          out[s * kVectorBytes + 4 * j + i] = static_cast<uint8_t>(code < 0 ? -code : code);
          out[(s + 8) * kVectorBytes + 4 * j + i] = static_cast<uint8_t>(code);
        }
      }
    }
  }
}

// Group g's 16 entries of scales (or mins) as float32 into `out`, rows past the panel's zero.
template <bool Half>
inline void expand_group(const void* entries, int64_t g, int rows, float* out) {
  if (rows == kRows) {
    if constexpr (Half) {
      const uint16_t* p = static_cast<const uint16_t*>(entries) + g * kRows;
      _mm256_store_ps(out, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
      _mm256_store_ps(out + 8, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8))));
    } else {
      std::memcpy(out, static_cast<const float*>(entries) + g * kRows, sizeof(float) * kRows);
    }
    return;
  }
  for (int j = 0; j < kRows; ++j) {
    if (j >= rows) {
      out[j] = 0.f;
    } else if constexpr (Half) {
      out[j] = _cvtsh_ss(static_cast<const uint16_t*>(entries)[g * rows + j]);
    } else {
      out[j] = static_cast<const float*>(entries)[g * rows + j];
    }
  }
}

// An expanded panel: codes kBlockBytes a block, float32 scales and mins 16 a group.
struct Expanded {
  const uint8_t* codes;
  const float* scales;
  const float* mins;  // null without mins
};

// The whole panel expanded into `storage`; with mins, *centered tells whether each is -8 x its scale.
template <int Bits, bool Half, bool Min>
Expanded expand_panel(const PanelView& v, int rows, int64_t blocks, int64_t groups,
                      std::vector<uint8_t>& storage, bool* centered) {
  storage.resize(blocks * kBlockBytes<Bits> + (Min ? 2 : 1) * groups * kRows * sizeof(float) + 32);
  uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(storage.data()) + 31) & ~uintptr_t{31});
  for (int64_t b = 0; b < blocks; ++b) expand_block<Bits>(v, rows, b, base + b * kBlockBytes<Bits>);
  float* scales = reinterpret_cast<float*>(base + blocks * kBlockBytes<Bits>);
  float* mins = scales + groups * kRows;
  bool all_centred = Min;
  for (int64_t g = 0; g < groups; ++g) {
    expand_group<Half>(v.scales, g, rows, scales + g * kRows);
    if constexpr (Min) {
      expand_group<Half>(v.mins, g, rows, mins + g * kRows);
      for (int j = 0; j < kRows; ++j)
        all_centred = all_centred && mins[g * kRows + j] == -8.f * scales[g * kRows + j];
    }
  }
  *centered = all_centred;
  return Expanded{base, scales, Min ? mins : nullptr};
}

KEEL_ALWAYS_INLINE __m256i broadcast4(const int8_t* p) {
  int32_t v;
  __builtin_memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// A block's code vectors as the dot products read them: vector g (values 4g..4g+3), half h (rows 8h..8h+7);
// 8-bit codes as their magnitudes and signed. From an expanded block (expand_block's layout) ...
struct ExpandedCodes {
  const uint8_t* p;
  KEEL_ALWAYS_INLINE __m256i load(int v, int h) const {
    return _mm256_load_si256(reinterpret_cast<const __m256i*>(p + v * kVectorBytes + 32 * h));
  }
  KEEL_ALWAYS_INLINE __m256i code(int g, int h) const { return load(g, h); }
  KEEL_ALWAYS_INLINE __m256i magnitude(int g, int h) const { return load(g, h); }
  KEEL_ALWAYS_INLINE __m256i signed_code(int g, int h) const { return load(8 + g, h); }
};

// ... or straight from a whole stored panel's block, split (4-bit) or made signed (8-bit) in registers:
// for a few activation rows, where expanding first would store and reload every vector for one use.
struct StoredCodes {
  const uint8_t* p;
  KEEL_ALWAYS_INLINE __m256i load(int v, int h) const {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + v * kVectorBytes + 32 * h));
  }
  KEEL_ALWAYS_INLINE __m256i code(int g, int h) const {  // byte i of stored vector g % 4: values g and g + 16
    const __m256i packed = load(g & 3, h), nibble = _mm256_set1_epi8(0x0f);
    return _mm256_and_si256(g < 4 ? packed : _mm256_srli_epi16(packed, 4), nibble);
  }
  KEEL_ALWAYS_INLINE __m256i signed_code(int g, int h) const {
    return _mm256_xor_si256(load(g, h), _mm256_set1_epi8(static_cast<char>(0x80)));
  }
  KEEL_ALWAYS_INLINE __m256i magnitude(int g, int h) const { return _mm256_abs_epi8(signed_code(g, h)); }
};

// 8-bit codes against one activation block x (32 signed bytes, natural order): the int32 dot products of
// rows 0..7 (d[0]) and 8..15 (d[1]), values 0..15 and 16..31 apart with Sub (d[2], d[3] the second
// halves), else whole in d[0], d[1].
template <bool Sub, typename Codes>
KEEL_ALWAYS_INLINE void eight_bit_dots(const Codes& c, const int8_t* x, __m256i d[4]) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
  for (int g = 0; g < 8; ++g) {
    const __m256i a = broadcast4(x + 4 * g);
    const int part = Sub && g >= 4 ? 2 : 0;
    for (int h = 0; h < 2; ++h) {  // |w| times x with w's sign
      const __m256i pairs = _mm256_maddubs_epi16(c.magnitude(g, h), _mm256_sign_epi8(a, c.signed_code(g, h)));
      acc[part + h] = _mm256_add_epi32(acc[part + h], _mm256_madd_epi16(pairs, ones));
    }
  }
  for (int i = 0; i < (Sub ? 4 : 2); ++i) d[i] = acc[i];
}

// 4-bit codes against MR activation rows at once (x[r]: row r's block): each code vector is loaded
// once for all the rows, d[r][0] and d[r][1] the int32 dot products of rows 0..7 and 8..15 (8 maddubs
// summed as int16: 15 x 127 x 2 x 8 fits).
template <int MR, typename Codes>
KEEL_ALWAYS_INLINE void four_bit_dots(const Codes& c, const int8_t* const x[MR], __m256i d[MR][2]) {
  __m256i s[MR][2];
  for (int g = 0; g < 8; ++g) {
    const __m256i c0 = c.code(g, 0), c1 = c.code(g, 1);
    for (int r = 0; r < MR; ++r) {
      const __m256i a = broadcast4(x[r] + 4 * g);
      const __m256i p0 = _mm256_maddubs_epi16(c0, a), p1 = _mm256_maddubs_epi16(c1, a);
      s[r][0] = g == 0 ? p0 : _mm256_add_epi16(s[r][0], p0);
      s[r][1] = g == 0 ? p1 : _mm256_add_epi16(s[r][1], p1);
    }
  }
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < MR; ++r) {
    d[r][0] = _mm256_madd_epi16(s[r][0], ones);
    d[r][1] = _mm256_madd_epi16(s[r][1], ones);
  }
}

KEEL_ALWAYS_INLINE __m256 lanes(const float* p, int h) { return _mm256_load_ps(p + 8 * h); }

// The accumulators of MR activation rows, two halves of 8 output rows each.
template <int MR>
struct Accumulators {
  __m256 v[MR][2];
};

// Activation rows m..m+MR against block b (its codes expanded or as stored), its scales (16 lanes; Sub: 32,
// the second 16 for values 16..31) and mins. Centred: the block's codes are centred on 8 (Q4_0), their
// mins stood in for by `offsets` (kernels.h).
template <int Bits, bool Min, bool Two, bool Sub, bool Centred, int MR, typename Codes>
KEEL_ALWAYS_INLINE void rows_block(const Codes& block, const float* scale, const float* min,
                                   const BlockActivations& a, const int32_t* offsets, int64_t m, int64_t b,
                                   Accumulators<MR>& acc) {
  for (int pass = 0; pass < (Two ? 2 : 1); ++pass) {
    const int8_t* q = (pass == 0 ? a.q : a.q2) + m * a.k + b * kBlock;
    __m256i d[MR][4];
    if constexpr (Bits == 4) {
      const int8_t* x[MR];
      for (int r = 0; r < MR; ++r) x[r] = q + r * a.k;
      __m256i dots[MR][2];
      four_bit_dots<MR>(block, x, dots);
      for (int r = 0; r < MR; ++r) d[r][0] = dots[r][0], d[r][1] = dots[r][1];
    } else {
      for (int r = 0; r < MR; ++r) eight_bit_dots<Sub>(block, q + r * a.k, d[r]);
    }
    for (int r = 0; r < MR; ++r) {
      const int64_t mb = (m + r) * a.blocks + b;
      if constexpr (Centred) {
        const __m256i o = _mm256_set1_epi32(offsets[2 * ((pass * a.m + m + r) * a.blocks + b)]);
        d[r][0] = _mm256_sub_epi32(d[r][0], o);
        d[r][1] = _mm256_sub_epi32(d[r][1], o);
      }
      const __m256 da = _mm256_set1_ps(pass == 0 ? a.d[mb] : a.d2[mb]);
      for (int h = 0; h < 2; ++h) {
        acc.v[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d[r][h]), _mm256_mul_ps(lanes(scale, h), da), acc.v[r][h]);
        if constexpr (Sub)
          acc.v[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d[r][2 + h]), _mm256_mul_ps(lanes(scale + kRows, h), da),
                                        acc.v[r][h]);
      }
    }
  }
  if constexpr (Min) {
    for (int r = 0; r < MR; ++r) {
      const __m256 s = _mm256_set1_ps(a.s[(m + r) * a.blocks + b]);
      for (int h = 0; h < 2; ++h) acc.v[r][h] = _mm256_fmadd_ps(lanes(min, h), s, acc.v[r][h]);
    }
  }
}

template <int MR>
inline void store_rows(const Accumulators<MR>& acc, int rows, int64_t m, int64_t n, float* out, int64_t ldo) {
  for (int r = 0; r < MR; ++r) {
    float* o = out + (m + r) * ldo + n;
    if (rows == kRows) {
      _mm256_storeu_ps(o, acc.v[r][0]);
      _mm256_storeu_ps(o + 8, acc.v[r][1]);
    } else {
      alignas(32) float v[kRows];
      _mm256_store_ps(v, acc.v[r][0]);
      _mm256_store_ps(v + 8, acc.v[r][1]);
      for (int j = 0; j < rows; ++j) o[j] = v[j];
    }
  }
}

template <int MR>
inline void zero(Accumulators<MR>& acc) {
  for (int r = 0; r < MR; ++r) acc.v[r][0] = acc.v[r][1] = _mm256_setzero_ps();
}

// MR rows against an expanded panel.
template <int Bits, bool Min, bool Two, bool Sub, bool Centred, int MR>
void rows_expanded(const Expanded& e, int64_t blocks, int shift, int rows, const BlockActivations& a,
                   const int32_t* offsets, int64_t m, int64_t n, float* out, int64_t ldo) {
  Accumulators<MR> acc;
  zero(acc);
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t g = group_of<Sub>(b, shift);
    rows_block<Bits, Min, Two, Sub, Centred, MR>(ExpandedCodes{e.codes + b * kBlockBytes<Bits>}, e.scales + g * kRows,
                                                 Min ? e.mins + g * kRows : nullptr, a, offsets, m, b, acc);
  }
  store_rows(acc, rows, m, n, out, ldo);
}

// MR rows against a whole stored panel read as it lies (a few rows: StoredCodes).
template <int Bits, bool Half, bool Min, bool Two, bool Sub, int MR>
void rows_stored(const PanelView& v, int64_t blocks, int shift, const BlockActivations& a, int64_t m, int64_t n,
                 float* out, int64_t ldo) {
  alignas(32) float scale[2 * kRows] = {}, min[kRows] = {};
  Accumulators<MR> acc;
  zero(acc);
  int64_t loaded = -1;  // the group whose scales (and mins) are in `scale` (and `min`)
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = v.codes + b * v.block_bytes;
    // One row's product is paced by memory: the stream fetched a fixed distance ahead, every line of it.
    for (int64_t line = 0; line < v.block_bytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(block + kAheadBytes + line), _MM_HINT_T0);
    const int64_t g = group_of<Sub>(b, shift);
    if (g != loaded) {
      expand_group<Half>(v.scales, g, kRows, scale);
      if constexpr (Sub) expand_group<Half>(v.scales, g + 1, kRows, scale + kRows);
      if constexpr (Min) expand_group<Half>(v.mins, g, kRows, min);
      loaded = g;
    }
    rows_block<Bits, Min, Two, Sub, false, MR>(StoredCodes{block}, scale, min, a, nullptr, m, b, acc);
  }
  store_rows(acc, kRows, m, n, out, ldo);
}

// Rows [m0, m1) in groups of 4 (then the 1-3 left): f(std::integral_constant<int, MR>{}, first row).
template <typename F>
inline void row_groups(int64_t m0, int64_t m1, F&& f) {
  int64_t m = m0;
  for (; m + 4 <= m1; m += 4) f(std::integral_constant<int, 4>{}, m);
  switch (m1 - m) {
    case 3: f(std::integral_constant<int, 3>{}, m); break;
    case 2: f(std::integral_constant<int, 2>{}, m); break;
    case 1: f(std::integral_constant<int, 1>{}, m); break;
    default: break;
  }
}

template <int Bits, bool Half, bool Min, bool Two, bool Sub>
void panels(const BlockWeights& w, int64_t p0, int64_t p1, const BlockActivations& a, const int32_t* offsets,
            int64_t m0, int64_t m1, float* out, int64_t ldo) {
  const int64_t groups = groups_of(w);
  const int shift = shift_of(w);
  std::vector<uint8_t> storage;  // an expanded panel's (one at a time)
  for_each_panel(w, p0, p1, [&](int64_t p, int rows, auto) {
    const PanelView v = view_of(w, p, rows);
    const int64_t n = p * kRows;
    if (m1 - m0 < kExpandRows && rows == kRows) {
      row_groups(m0, m1, [&](auto mr, int64_t m) {
        rows_stored<Bits, Half, Min, Two, Sub, decltype(mr)::value>(v, w.blocks, shift, a, m, n, out, ldo);
      });
      return;
    }
    bool centered = false;
    const Expanded e = expand_panel<Bits, Half, Min>(v, rows, w.blocks, groups, storage, &centered);
    if constexpr (Bits == 4 && Min) {
      if (centered && offsets != nullptr) {  // Q4_0: its mins as the integer offsets (kernels.h)
        row_groups(m0, m1, [&](auto mr, int64_t m) {
          rows_expanded<Bits, false, Two, Sub, true, decltype(mr)::value>(e, w.blocks, shift, rows, a, offsets, m, n,
                                                                            out, ldo);
        });
        return;
      }
    }
    row_groups(m0, m1, [&](auto mr, int64_t m) {
      rows_expanded<Bits, Min, Two, Sub, false, decltype(mr)::value>(e, w.blocks, shift, rows, a, nullptr, m, n, out,
                                                                      ldo);
    });
  });
}

template <int Bits, bool Sub>
void forms(const BlockWeights& w, int64_t p0, int64_t p1, const BlockActivations& a, const int32_t* offsets,
           int64_t m0, int64_t m1, float* out, int64_t ldo) {
  const bool min = w.mins != nullptr && !Sub, two = a.q2 != nullptr;
  auto run = [&](auto half, auto with_min) {
    constexpr bool H = decltype(half)::value, M = decltype(with_min)::value && !Sub;
    two ? panels<Bits, H, M, true, Sub>(w, p0, p1, a, offsets, m0, m1, out, ldo)
        : panels<Bits, H, M, false, Sub>(w, p0, p1, a, offsets, m0, m1, out, ldo);
  };
  if (w.scale_half) {
    min ? run(std::true_type{}, std::true_type{}) : run(std::true_type{}, std::false_type{});
  } else {
    min ? run(std::false_type{}, std::true_type{}) : run(std::false_type{}, std::false_type{});
  }
}

}  // namespace

void block_gemm_stored_avx2(const BlockWeights& w, int64_t p0, int64_t p1, const BlockActivations& a,
                            const int32_t* offsets, int64_t m0, int64_t m1, float* out, int64_t ldo) {
  for_form(w, [&](auto bits, auto sub) {
    forms<decltype(bits)::value, decltype(sub)::value>(w, p0, p1, a, offsets, m0, m1, out, ldo);
  });
}

}  // namespace keel
#endif
