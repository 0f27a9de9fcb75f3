// The panel layout's arithmetic (kernels.h, "the panel layout") that every stored-panel kernel shares and
// no instruction set changes: where a panel's codes and groups of scales lie, which group a block reads,
// the walk over whole and partial panels, and the dispatch of an entry point over the code forms.
// Included by each stored-panel unit (block_gemm_stored_avx2.cpp, and block_gemm_stored.h for the
// AVX-512 ones) under its own target pragma: everything here has internal linkage.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kernels.h"

namespace keel {

namespace {

constexpr int kRows = kPanelRows;

// Scale entries a row: two a block (half-block scales), else one a group.
inline int64_t groups_of(const BlockWeights& w) {
  return w.half_block_scales ? 2 * w.blocks : w.blocks / w.group_blocks;
}

// Blocks per scale as a shift: a power of two, or -1 for one scale a row.
inline int shift_of(const BlockWeights& w) {
  if (w.group_blocks == w.blocks) return -1;
  int shift = 0;
  while ((int64_t{1} << shift) < w.group_blocks) ++shift;
  return shift;
}

// The group of block b: its own (Sub: 2b, then 2b + 1 for values 16..31), one per 2^shift blocks, or
// the row's one (shift < 0).
template <bool Sub>
inline int64_t group_of(int64_t b, int shift) {
  if constexpr (Sub) return 2 * b;
  return shift < 0 ? 0 : b >> shift;
}

// One panel as the kernels read it: its codes (block by block, `block_bytes` apart), and its scales and
// mins (group by group, `group_stride` entries apart, 16 lanes from each group's first entry).
struct PanelView {
  const uint8_t* codes;
  int64_t block_bytes;
  const void* scales;
  const void* mins;
  int64_t group_stride;
};

// Panel p (of `rows` rows) of weights in the panel layout.
inline PanelView view_of(const BlockWeights& w, int64_t p, int rows) {
  const int64_t first = p * kRows, entry = w.scale_half ? 2 : 4;  // the panel's first row
  const char* scales = static_cast<const char*>(w.scales) + first * groups_of(w) * entry;
  const char* mins = w.mins == nullptr ? nullptr : static_cast<const char*>(w.mins) + first * groups_of(w) * entry;
  return PanelView{w.codes + first * w.row_bytes, rows * (w.bits == 4 ? 16 : 32), scales, mins, rows};
}

// f(p, rows, std::true_type{}) for each whole panel of [p0, p1), f(p, rows, std::false_type{}) for a last
// partial one (its rows fewer than kRows): the kernels' Full template argument.
template <typename F>
inline void for_each_panel(const BlockWeights& w, int64_t p0, int64_t p1, F&& f) {
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t left = w.rows - p * kRows;
    if (left >= kRows) {
      f(p, kRows, std::true_type{});
    } else {
      f(p, static_cast<int>(left), std::false_type{});
    }
  }
}

// f(std::integral_constant<int, Bits>, std::bool_constant<Sub>) for the weights' form: 4-bit codes, 8-bit
// codes with half-block scales (Sub), or 8-bit codes with one scale a group.
template <typename F>
inline void for_form(const BlockWeights& w, F&& f) {
  if (w.bits == 4) {
    f(std::integral_constant<int, 4>{}, std::false_type{});
  } else if (w.half_block_scales) {
    f(std::integral_constant<int, 8>{}, std::true_type{});
  } else {
    f(std::integral_constant<int, 8>{}, std::false_type{});
  }
}

}  // namespace

}  // namespace keel
