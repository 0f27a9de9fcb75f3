// The AMX kernel over weights stored in panels (kernels.h, "the panel layout"), for products of many
// activation rows (prefill chunks, wide decode batches) on CPUs with AMX-INT8. Compiled for AMX alone
// (the pragma below), called only at the `amx` kernel level, whose permission the operator layer has
// asked the kernel for (`amx_ready`).
//
// Why: from a few rows the VNNI panel kernel is paced by vpdpbusd (64 multiply-adds an instruction). A
// tile multiply (tdpbsud) does 16 x 16 outputs' 32-value dot products in one instruction: 16
// activation rows (the A tile: one block of each, 16 rows x 32 bytes) against one panel block (the B
// tile: 8 rows of 64 bytes, which is exactly a panel block's 8 vectors, row j's 4 values in lane j). Each
// block has its own scales, so each block's int32 tile is stored and scaled into float32 accumulators
// (one vector a row), as the VNNI kernel does with its dot products.
#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,amx-tile,amx-int8")
// GCC 12's own AVX-512 headers trip these (their _mm512_undefined_* values), not this code.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "block_gemm_stored.h"

namespace keel {

namespace {

// Tiles: 0 and 1 the int32 products, 2 and 3 the activation blocks, 4 and 5 the panel blocks: with one
// activation pass, blocks alternate between (0, 2, 4) and (1, 3, 5), so that one block's tile product
// runs while the previous block's products are scaled; with two, (0, 2) and (1, 3) are the passes'.
//
// Half-block scales (Q6_K: a scale per 16 values) take a configuration of their own, since a block's two
// halves must be multiplied apart: 2 and 3 the activation halves (16 rows x 16 bytes), 4 and 5 the panel
// halves (4 rows of 64 bytes: a panel block's first and last 4 vectors), 0 and 1 their products, and 6
// and 7 the second pass's.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

TileConfig tile_config(bool halves) {
  const int span = halves ? kBlock / 2 : kBlock;  // activation bytes a product reads from each row
  TileConfig config;
  for (int t : {0, 1, 6, 7}) {
    if (t >= 6 && !halves) continue;
    config.rows[t] = kAmxRows;
    config.colsb[t] = kRows * 4;
  }
  for (int t : {2, 3}) {
    config.rows[t] = kAmxRows;
    config.colsb[t] = span;
  }
  for (int t : {4, 5}) {
    config.rows[t] = span / 4;
    config.colsb[t] = kRows * 4;
  }
  return config;
}

// From a static: GCC 12 drops stores into a local configuration as dead (it does not see ldtilecfg
// read them), which leaves tiles unconfigured and ldtilecfg faulting.
void configure_tiles(bool halves) {
  static const TileConfig blocks = tile_config(false), half_blocks = tile_config(true);
  _tile_loadconfig(halves ? &half_blocks : &blocks);
}

// One pass's int32 products (16 activation rows x the panel's 16 outputs) scaled into acc.
template <bool Offset, bool Min>
inline void scale_tile(const int32_t* products, __m512 scale, __m512 min, const float* d, const float* s,
                       const int32_t* offsets, int64_t blocks, __m512 acc[kAmxRows]) {
  for (int r = 0; r < kAmxRows; ++r) {
    __m512i dot = _mm512_load_si512(products + r * kRows);
    if constexpr (Offset) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(offsets[2 * r * blocks]));
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(scale, _mm512_set1_ps(d[r * blocks])), acc[r]);
    if constexpr (Min) acc[r] = _mm512_fmadd_ps(min, _mm512_set1_ps(s[r * blocks]), acc[r]);
  }
}

// Block b's tile product into tile C (A and B its operands' tiles): starts it, nothing waits for it. A
// macro: GCC's tile intrinsics paste their tile numbers into the instruction's text, so they must be
// literals.
#define KEEL_START_BLOCK(C, A, B, q, k, e, b)                   \
  do {                                                          \
    _tile_loadd(B, (e).codes + (b) * (e).block_bytes, kRows * 4); \
    _tile_loadd(A, (q) + (b) * kBlock, k);                      \
    _tile_zero(C);                                              \
    _tile_dpbsud(C, A, B);                                      \
  } while (0)

template <int Bits, bool Half, bool Min, bool Two, bool Full>
void panel(const BlockWeights& w, int64_t p, int rows, const BlockActivations& a, const int32_t* offsets,
           int64_t m0, int64_t m1, float* out, int64_t ldo, std::vector<uint8_t>& storage) {
  const PanelView e = expand<Bits, Half, Min, Full, true>(view_of(w, p, rows), w.blocks, groups_of(w), rows, storage);
  const int shift = shift_of(w);
  const __mmask16 mask = static_cast<__mmask16>((1u << rows) - 1);
  alignas(64) int32_t products[2][kAmxRows * kRows];
  for (int64_t m = m0; m < m1; m += kAmxRows) {
    __m512 acc[kAmxRows];
    for (int r = 0; r < kAmxRows; ++r) acc[r] = _mm512_setzero_ps();
    const int8_t* q = a.q + m * a.k;
    // Block b's products (of pass `pass`, in products[slot]) scaled into acc.
    auto scale_block = [&](int64_t b, int pass, int slot) {
      const int64_t g = group_of<false>(b, shift), mb = m * a.blocks + b;
      const __m512 scale = _mm512_load_ps(static_cast<const float*>(e.scales) + g * 16);
      const __m512 min = Min ? _mm512_load_ps(static_cast<const float*>(e.mins) + g * 16) : _mm512_setzero_ps();
      if (pass == 0) {
        scale_tile<Bits == 8, Min>(products[slot], scale, min, a.d + mb, a.s + mb, offsets + 2 * mb, a.blocks, acc);
      } else {
        scale_tile<Bits == 8, false>(products[slot], scale, min, a.d2 + mb, a.s + mb,
                                     offsets + 2 * (a.m * a.blocks + mb), a.blocks, acc);
      }
    };
    if constexpr (Two) {
      const int8_t* q2 = a.q2 + m * a.k;
      for (int64_t b = 0; b < w.blocks; ++b) {
        KEEL_START_BLOCK(0, 2, 4, q, a.k, e, b);
        _tile_loadd(3, q2 + b * kBlock, a.k);
        _tile_zero(1);
        _tile_dpbsud(1, 3, 4);
        _tile_stored(0, products[0], kRows * 4);
        scale_block(b, 0, 0);
        _tile_stored(1, products[1], kRows * 4);
        scale_block(b, 1, 1);
      }
    } else {
      KEEL_START_BLOCK(0, 2, 4, q, a.k, e, 0);
      for (int64_t b = 0; b < w.blocks; b += 2) {  // even blocks in tile 0, odd ones in tile 1
        if (b + 1 < w.blocks) KEEL_START_BLOCK(1, 3, 5, q, a.k, e, b + 1);
        _tile_stored(0, products[0], kRows * 4);
        scale_block(b, 0, 0);
        if (b + 1 >= w.blocks) break;
        if (b + 2 < w.blocks) KEEL_START_BLOCK(0, 2, 4, q, a.k, e, b + 2);
        _tile_stored(1, products[1], kRows * 4);
        scale_block(b + 1, 0, 1);
      }
    }
    for (int r = 0; r < kAmxRows; ++r) _mm512_mask_storeu_ps(out + (m + r) * ldo + p * kRows, mask, acc[r]);
  }
}

// Block b's two half products into tiles C0 (values 0..15) and C1 (16..31): the panel block's halves
// loaded into tiles 4 and 5 (unless Codes is false: already there), the activation rows q's halves into
// 2 and 3; signed by signed (tdpbssd), the codes made signed again when the panel is expanded.
#define KEEL_START_HALVES(C0, C1, q, k, e, b, Codes)                           \
  do {                                                                         \
    if (Codes) {                                                               \
      _tile_loadd(4, (e).codes + (b) * (e).block_bytes, kRows * 4);            \
      _tile_loadd(5, (e).codes + (b) * (e).block_bytes + 4 * kRows * 4, kRows * 4); \
    }                                                                          \
    _tile_loadd(2, (q) + (b) * kBlock, k);                                     \
    _tile_loadd(3, (q) + (b) * kBlock + 16, k);                                \
    _tile_zero(C0);                                                            \
    _tile_zero(C1);                                                            \
    _tile_dpbssd(C0, 2, 4);                                                    \
    _tile_dpbssd(C1, 3, 5);                                                    \
  } while (0)

// One pass's two half products of a block (16 activation rows x the panel's 16 outputs each) scaled
// into acc: each half by its own weight scales, then the pair by the row's activation scale.
inline void scale_halves(const int32_t* lo_products, const int32_t* hi_products, __m512 lo, __m512 hi,
                         const float* d, int64_t blocks, __m512 acc[kAmxRows]) {
  for (int r = 0; r < kAmxRows; ++r) {
    __m512 sum = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(lo_products + r * kRows)), lo);
    sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(hi_products + r * kRows)), hi, sum);
    acc[r] = _mm512_fmadd_ps(sum, _mm512_set1_ps(d[r * blocks]), acc[r]);
  }
}

// Weights with half-block scales (8-bit codes, no mins): each block's halves multiplied apart and scaled
// by their own scales. The codes are signed again in the expanded panel, so no activation sums are
// subtracted (the scaling, not the tile multiply, sets this kernel's pace).
template <bool Half, bool Two, bool Full>
void panel_halves(const BlockWeights& w, int64_t p, int rows, const BlockActivations& a, int64_t m0, int64_t m1,
                  float* out, int64_t ldo, std::vector<uint8_t>& storage) {
  const PanelView e =
      expand<8, Half, false, Full, true, true>(view_of(w, p, rows), w.blocks, groups_of(w), rows, storage);
  const __mmask16 mask = static_cast<__mmask16>((1u << rows) - 1);
  const float* scales = static_cast<const float*>(e.scales);
  alignas(64) int32_t products[4][kAmxRows * kRows];
  for (int64_t m = m0; m < m1; m += kAmxRows) {
    __m512 acc[kAmxRows];
    for (int r = 0; r < kAmxRows; ++r) acc[r] = _mm512_setzero_ps();
    const int8_t* q = a.q + m * a.k;
    // Block b's products (of pass `pass`, in products[slot] and products[slot + 1]) scaled into acc.
    auto scale_block = [&](int64_t b, int pass, int slot) {
      const int64_t g = group_of<true>(b, 0), mb = m * a.blocks + b;
      scale_halves(products[slot], products[slot + 1], _mm512_load_ps(scales + g * 16),
                   _mm512_load_ps(scales + (g + 1) * 16), (pass == 0 ? a.d : a.d2) + mb, a.blocks, acc);
    };
    if constexpr (Two) {
      const int8_t* q2 = a.q2 + m * a.k;
      for (int64_t b = 0; b < w.blocks; ++b) {
        KEEL_START_HALVES(0, 1, q, a.k, e, b, true);
        KEEL_START_HALVES(6, 7, q2, a.k, e, b, false);
        _tile_stored(0, products[0], kRows * 4);
        _tile_stored(1, products[1], kRows * 4);
        scale_block(b, 0, 0);
        _tile_stored(6, products[2], kRows * 4);
        _tile_stored(7, products[3], kRows * 4);
        scale_block(b, 1, 2);
      }
    } else {  // even blocks in tiles 0 and 1, odd ones in 6 and 7: the next block multiplies while one is scaled
      KEEL_START_HALVES(0, 1, q, a.k, e, 0, true);
      for (int64_t b = 0; b < w.blocks; b += 2) {
        if (b + 1 < w.blocks) KEEL_START_HALVES(6, 7, q, a.k, e, b + 1, true);
        _tile_stored(0, products[0], kRows * 4);
        _tile_stored(1, products[1], kRows * 4);
        scale_block(b, 0, 0);
        if (b + 1 >= w.blocks) break;
        if (b + 2 < w.blocks) KEEL_START_HALVES(0, 1, q, a.k, e, b + 2, true);
        _tile_stored(6, products[2], kRows * 4);
        _tile_stored(7, products[3], kRows * 4);
        scale_block(b + 1, 0, 2);
      }
    }
    for (int r = 0; r < kAmxRows; ++r) _mm512_mask_storeu_ps(out + (m + r) * ldo + p * kRows, mask, acc[r]);
  }
}

template <bool Half, bool Two>
void halves_panels(const BlockWeights& w, int64_t p0, int64_t p1, const BlockActivations& a, int64_t m0, int64_t m1,
                   float* out, int64_t ldo) {
  std::vector<uint8_t> storage;  // an expanded panel's (one at a time)
  for_each_panel(w, p0, p1, [&](int64_t p, int rows, auto full) {
    panel_halves<Half, Two, decltype(full)::value>(w, p, rows, a, m0, m1, out, ldo, storage);
  });
}

template <int Bits, bool Half, bool Min, bool Two>
void panels(const BlockWeights& w, int64_t p0, int64_t p1, const BlockActivations& a, const int32_t* offsets,
            int64_t m0, int64_t m1, float* out, int64_t ldo) {
  std::vector<uint8_t> storage;  // an expanded panel's (one at a time)
  for_each_panel(w, p0, p1, [&](int64_t p, int rows, auto full) {
    panel<Bits, Half, Min, Two, decltype(full)::value>(w, p, rows, a, offsets, m0, m1, out, ldo, storage);
  });
}

template <int Bits>
void forms(const BlockWeights& w, int64_t p0, int64_t p1, const BlockActivations& a, const int32_t* offsets,
           int64_t m0, int64_t m1, float* out, int64_t ldo) {
  const bool min = w.mins != nullptr, two = a.q2 != nullptr;
  if (w.scale_half) {
    if (min) {
      two ? panels<Bits, true, true, true>(w, p0, p1, a, offsets, m0, m1, out, ldo)
          : panels<Bits, true, true, false>(w, p0, p1, a, offsets, m0, m1, out, ldo);
    } else {
      two ? panels<Bits, true, false, true>(w, p0, p1, a, offsets, m0, m1, out, ldo)
          : panels<Bits, true, false, false>(w, p0, p1, a, offsets, m0, m1, out, ldo);
    }
  } else if (min) {
    two ? panels<Bits, false, true, true>(w, p0, p1, a, offsets, m0, m1, out, ldo)
        : panels<Bits, false, true, false>(w, p0, p1, a, offsets, m0, m1, out, ldo);
  } else {
    two ? panels<Bits, false, false, true>(w, p0, p1, a, offsets, m0, m1, out, ldo)
        : panels<Bits, false, false, false>(w, p0, p1, a, offsets, m0, m1, out, ldo);
  }
}

}  // namespace

bool amx_permitted() {
  // Linux hands out the AMX tile state only to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM for
  // XFEATURE_XTILEDATA); asking again is harmless (oneDNN asks the same way).
  constexpr int kRequestPermission = 0x1023, kTileData = 18;
  return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
}

void block_gemm_stored_amx(const BlockWeights& w, int64_t p0, int64_t p1, const BlockActivations& a,
                           const int32_t* offsets, int64_t m0, int64_t m1, float* out, int64_t ldo) {
  configure_tiles(w.half_block_scales);
  if (w.half_block_scales) {
    const bool two = a.q2 != nullptr;
    if (w.scale_half) {
      two ? halves_panels<true, true>(w, p0, p1, a, m0, m1, out, ldo)
          : halves_panels<true, false>(w, p0, p1, a, m0, m1, out, ldo);
    } else {
      two ? halves_panels<false, true>(w, p0, p1, a, m0, m1, out, ldo)
          : halves_panels<false, false>(w, p0, p1, a, m0, m1, out, ldo);
    }
  } else {
    w.bits == 4 ? forms<4>(w, p0, p1, a, offsets, m0, m1, out, ldo) : forms<8>(w, p0, p1, a, offsets, m0, m1, out, ldo);
  }
  _tile_release();
}

}  // namespace keel
#endif
