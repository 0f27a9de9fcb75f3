// Helpers of the kernels over weights stored in panels (kernels.h, "the panel layout"):
// block_gemm_stored_avx512.cpp (VNNI) and block_gemm_stored_amx.cpp (AMX tiles). Each unit includes it
// after <immintrin.h> under its own target pragma, so each compiles its own copy: everything here has
// internal linkage.
#pragma once

#include <cstdint>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "panel_layout.h"

namespace keel {

namespace {

// 16 lanes of scales (float16 or float32) from p, `mask` selecting the panel's rows.
template <bool Half>
inline __m512 lanes_of(const void* p, int64_t at, __mmask16 mask) {
  if constexpr (Half) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(p) + at));
  } else {
    return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(p) + at);
  }
}

// A block's code vectors: 8 of them, vector g holding values 4g..4g+3 of each row (values 16.. from g = 4).
template <int Bits, bool Full>
inline void load_block(const uint8_t* p, int rows, __mmask16 mask, __m512i c[8]) {
  const int64_t stride = 4 * rows;  // bytes of one vector in this panel
  auto load = [&](int v) {
    if constexpr (Full) {
      return _mm512_loadu_si512(p + v * 64);
    } else {
      return _mm512_maskz_loadu_epi32(mask, p + v * stride);
    }
  };
  if constexpr (Bits == 4) {  // byte i of a block holds values i and i + 16 (low and high nibble)
    const __m512i nibble = _mm512_set1_epi8(0x0f);
    for (int v = 0; v < 4; ++v) {
      const __m512i packed = load(v);
      c[v] = _mm512_and_si512(packed, nibble);
      c[v + 4] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
    }
  } else {
    for (int v = 0; v < 8; ++v) c[v] = load(v);
  }
}

// A panel expanded into `storage`: 4-bit codes as 8 full vectors a block (missing rows zero; 8-bit codes
// stay where they are unless CopyCodes, then copied the same way, made signed again with Signed), float32
// scales and mins, 16 a group. With Min, *centered tells whether every min is exactly -8 x its scale
// (kernels.h, `offsets`).
template <int Bits, bool Half, bool Min, bool Full, bool CopyCodes = false, bool Signed = false>
PanelView expand(const PanelView& v, int64_t blocks, int64_t groups, int rows, std::vector<uint8_t>& storage,
                 bool* centered = nullptr) {
  const __mmask16 mask = static_cast<__mmask16>((1u << rows) - 1);
  const int64_t code_bytes = Bits == 4 || CopyCodes ? blocks * 8 * 64 : 0, scale_bytes = groups * 64;
  storage.resize(code_bytes + (Min ? 2 : 1) * scale_bytes + 64);
  uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t{63});
  if constexpr (Bits == 4 || CopyCodes) {
    for (int64_t b = 0; b < blocks; ++b) {
      __m512i c[8];
      load_block<Bits, Full>(v.codes + b * v.block_bytes, rows, mask, c);
      if constexpr (Bits == 8 && Signed) {  // stored + 128 (code ^ 0x80): back to the signed code
        for (int i = 0; i < 8; ++i) c[i] = _mm512_xor_si512(c[i], _mm512_set1_epi8(static_cast<char>(0x80)));
      }
      for (int i = 0; i < 8; ++i) _mm512_store_si512(base + (b * 8 + i) * 64, c[i]);
    }
  }
  float* scales = reinterpret_cast<float*>(base + code_bytes);
  float* mins = scales + groups * 16;
  __mmask16 off_centre = 0;
  const __m512 minus8 = _mm512_set1_ps(-8.f);
  for (int64_t g = 0; g < groups; ++g) {
    const __m512 scale = lanes_of<Half>(v.scales, g * v.group_stride, mask);
    _mm512_store_ps(scales + g * 16, scale);
    if constexpr (Min) {
      const __m512 min = lanes_of<Half>(v.mins, g * v.group_stride, mask);
      _mm512_store_ps(mins + g * 16, min);
      off_centre |= _mm512_cmp_ps_mask(min, _mm512_mul_ps(scale, minus8), _CMP_NEQ_UQ);
    }
  }
  if (centered != nullptr) *centered = Min && off_centre == 0;
  if constexpr (Bits == 4 || CopyCodes) return PanelView{base, 8 * 64, scales, Min ? mins : nullptr, 16};
  return PanelView{v.codes, v.block_bytes, scales, Min ? mins : nullptr, 16};
}

}  // namespace

}  // namespace keel
