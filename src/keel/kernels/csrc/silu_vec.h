// SiLU(gate) * up over one row, on a vector traits type (attention_avx2.cpp's Lanes8, attention_avx512.cpp's
// Lanes16, attention_neon.cpp's Lanes4), with attention_vec.h's exponential of a nonpositive argument.
// Included after the traits, inside each unit.
//
// Why: the scalar loop called libm's expf once a value, ~5% of an offline-throughput run's time
// (docs/BENCHMARKS.md, seventh part). The exponential is taken of -|g| only, where the polynomial holds:
// silu(g) = g / (1 + e) for g >= 0 and g e / (1 + e) below, e = exp(-|g|).
#pragma once

#include <cmath>
#include <cstdint>

#include "attention_vec.h"

namespace {

template <typename V>
void silu_mul_vectorised(const float* gate, const float* up, float* out, int64_t n) {
  constexpr int L = V::kLanes;
  const typename V::F zero = V::zero(), one = V::set1(1.f);
  int64_t i = 0;
  for (; i + L <= n; i += L) {
    const typename V::F g = V::load(gate + i);
    const typename V::F e = exp_nonpositive_lanes<V>(V::sub(zero, V::max(g, V::sub(zero, g))));
    const typename V::F share = V::div(V::select_negative(g, e, one), V::add(one, e));
    V::store(out + i, V::mul(V::mul(g, share), V::load(up + i)));
  }
  for (; i < n; ++i) {  // the row's tail: the same formula in scalar code
    const float g = gate[i], e = std::exp(-std::fabs(g));
    out[i] = g * ((std::signbit(g) ? e : 1.f) / (1.f + e)) * up[i];
  }
}

}  // namespace
