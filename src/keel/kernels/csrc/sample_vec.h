// keel::sample_rows' pass over a row (ops_sample.cpp), on a vector traits type (attention_avx2.cpp's Lanes8,
// attention_avx512.cpp's Lanes16, attention_neon.cpp's Lanes4), with attention_vec.h's exponential.
// Included after the traits, inside each unit.
//
// Why: libm's expf once a value, a scalar maximum and a dependent double sum a value made a 49k-vocabulary
// row cost ~0.25 ms, a 64-row step's draw longer than a third of its forward (docs/BENCHMARKS.md).
#pragma once

#include <cmath>
#include <cstdint>

#include "attention.h"
#include "attention_vec.h"

namespace {

// x = logits / temperature over one whole chunk; returns the chunk's lane maxima.
template <typename V>
typename V::F scaled_chunk(const float* logits, typename V::F temperature, float* x) {
  constexpr int L = V::kLanes;
  typename V::F chunk_max = V::set1(-INFINITY);
  for (int i = 0; i < keel::kSampleChunk; i += L) {
    const typename V::F v = V::div(V::load(logits + i), temperature);
    V::store(x + i, v);
    chunk_max = V::max(chunk_max, v);
  }
  return chunk_max;
}

template <typename V>
float sample_pass_vectorised(const keel::SamplePass& p) {
  constexpr int L = V::kLanes;
  static_assert(keel::kSampleChunk % L == 0, "a chunk is whole vectors");
  const int64_t whole = p.vocab / keel::kSampleChunk, tail = whole * keel::kSampleChunk;
  const typename V::F t = V::set1(p.temperature);
  typename V::F all = V::set1(-INFINITY);
  for (int64_t c = 0; c < whole; ++c) {
    const int64_t at = c * keel::kSampleChunk;
    const typename V::F m = scaled_chunk<V>(p.logits + at, t, p.x + at);
    p.chunk_max[c] = V::reduce_max(m);
    all = V::max(all, m);
  }
  float top = whole > 0 ? V::reduce_max(all) : -INFINITY;
  float tail_max = -INFINITY;
  for (int64_t i = tail; i < p.vocab; ++i) {
    p.x[i] = p.logits[i] / p.temperature;
    tail_max = p.x[i] > tail_max ? p.x[i] : tail_max;
  }
  if (tail < p.vocab) {
    p.chunk_max[whole] = tail_max;
    top = tail_max > top ? tail_max : top;
  }
  // e = exp(x - top): zero below exp's range (-87: the polynomial's clamp, where a masked -inf logit lands)
  // and, for a draw over the whole vocabulary, below min_p.
  const typename V::F zero = V::zero(), shift = V::set1(top), floor = V::set1(87.f), min_p = V::set1(p.min_p);
  alignas(64) float lanes[L];
  for (int64_t c = 0; c < whole; ++c) {
    typename V::F sum = zero;
    for (int64_t i = c * keel::kSampleChunk; i < (c + 1) * keel::kSampleChunk; i += L) {
      const typename V::F d = V::sub(V::load(p.x + i), shift);
      typename V::F e = V::select_negative(V::add(d, floor), zero, exp_nonpositive_lanes<V>(d));
      if (p.min_p > 0.f) e = V::select_negative(V::sub(e, min_p), zero, e);
      V::store(p.e + i, e);
      sum = V::add(sum, e);
    }
    V::store(lanes, sum);
    double s = 0;
    for (int j = 0; j < L; ++j) s += lanes[j];
    p.chunk_sum[c] = s;
  }
  if (tail < p.vocab) {
    double s = 0;
    for (int64_t i = tail; i < p.vocab; ++i) {
      p.e[i] = keel::sample_weight(p.x[i], top, p.min_p);
      s += p.e[i];
    }
    p.chunk_sum[whole] = s;
  }
  return top;
}

}  // namespace
