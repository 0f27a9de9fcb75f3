// The vectorised block body of paged decode attention, written once over a vector traits type V and
// compiled per ISA level: included by attention_avx2.cpp (V = 8 float lanes) and attention_avx512.cpp
// (16 lanes), each under its own target pragma, after defining its traits. Everything here has internal
// linkage, so no copy compiled for one level can stand in for another's.
//
// Why not the portable loops (attention_impl.h): they reduce every (key, head) dot product
// horizontally and keep the output accumulator in memory across keys, ~150 cycles per (key, query
// head) measured (docs/BENCHMARKS.md, "Decode attention alone"). Here V::kLanes keys' dot products are
// reduced together (one tree for as many scores), their exponentials are one vector, and each query
// head's output stays in registers while it runs over the block's values.
//
// V provides: F (a vector of kLanes floats), zero, load, store, set1, add, sub, mul, max, fmadd,
// sums (kLanes vectors -> the vector of their lane sums), reduce_max (the largest lane), round_nearest (to
// an integral float, ties to even), pow2 (2^k of integral floats k, by the exponent bits), prefetch,
// from_i8 (kLanes int8 values as floats) and half (a float16 scale as a float).
//
// int8 rows are converted without their scales: a key's scale multiplies its score, a value's scale
// its probability, one multiply a row instead of one a channel.
#pragma once

#include "attention_impl.h"

namespace {

// exp(x) for x <= 0, kLanes at a time: exp_parts' polynomial (attention_impl.h) with the traits'
// rounding and exponent-bit scale, the one vector exponential of every level (silu_vec.h's too).
template <typename V>
inline typename V::F exp_nonpositive_lanes(typename V::F x) {
  x = V::max(x, V::set1(-87.f));
  const typename V::F k = V::round_nearest(V::mul(x, V::set1(1.44269504f)));
  const typename V::F r = V::add(V::sub(x, V::mul(k, V::set1(0.693359375f))), V::mul(k, V::set1(2.12194440e-4f)));
  typename V::F p = V::set1(1.9875691500e-4f);
  p = V::fmadd(p, r, V::set1(1.3981999507e-3f));
  p = V::fmadd(p, r, V::set1(8.3334519073e-3f));
  p = V::fmadd(p, r, V::set1(4.1665795894e-2f));
  p = V::fmadd(p, r, V::set1(1.6666665459e-1f));
  p = V::fmadd(p, r, V::set1(5.0000001201e-1f));
  p = V::add(V::fmadd(V::mul(p, r), r, r), V::set1(1.f));
  return V::mul(p, V::pow2(k));
}

// scores[j] = q . key[j] for j < n (q and keys of dim channels, a multiple of V::kLanes).
template <typename V>
inline void block_scores(const float* q, const float* const* key, int64_t n, int64_t dim, float* scores) {
  constexpr int L = V::kLanes;
  int64_t j = 0;
  for (; j + L <= n; j += L) {
    typename V::F acc[L];
    for (int t = 0; t < L; ++t) acc[t] = V::zero();
    for (int64_t d = 0; d < dim; d += L) {
      const typename V::F qv = V::load(q + d);
      for (int t = 0; t < L; ++t) acc[t] = V::fmadd(qv, V::load(key[j + t] + d), acc[t]);
    }
    V::store(scores + j, V::sums(acc));
  }
  if (j < n) {  // the block's last keys: as many accumulators, the others summed as zeros
    typename V::F acc[L];
    for (int t = 0; t < L; ++t) acc[t] = V::zero();
    const int64_t left = n - j;
    for (int64_t d = 0; d < dim; d += L) {
      const typename V::F qv = V::load(q + d);
      for (int t = 0; t < left; ++t) acc[t] = V::fmadd(qv, V::load(key[j + t] + d), acc[t]);
    }
    alignas(64) float all[L];
    V::store(all, V::sums(acc));
    for (int t = 0; t < left; ++t) scores[j + t] = all[t];
  }
}

// v[j] = cap * tanh(v[j] / cap) for j < n (attention-score soft-capping), tanh(a) = (1 - e) / (1 + e) with
// e = exp(-2 |a|) <= 1, the sign restored. The block's last values go through the same vector code (a
// padded copy), so a score's capped value does not depend on where it lies in the block: a tile's rows stay
// bit for bit the rows walked alone.
template <typename V>
inline void cap_scores(float* v, int64_t n, float cap) {
  constexpr int L = V::kLanes;
  const typename V::F zero = V::zero(), one = V::set1(1.f), c = V::set1(cap), slope = V::set1(-2.f / cap);
  auto capped = [&](typename V::F x) {
    const typename V::F e = exp_nonpositive_lanes<V>(V::mul(V::max(x, V::sub(zero, x)), slope));
    const typename V::F t = V::mul(c, V::div(V::sub(one, e), V::add(one, e)));
    return V::select_negative(x, V::sub(zero, t), t);
  };
  int64_t j = 0;
  for (; j + L <= n; j += L) V::store(v + j, capped(V::load(v + j)));
  if (j < n) {
    alignas(64) float tail[L] = {};
    for (int64_t i = j; i < n; ++i) tail[i - j] = v[i];
    V::store(tail, capped(V::load(tail)));
    for (int64_t i = j; i < n; ++i) v[i] = tail[i - j];
  }
}

// The largest of v[0..n) and `floor`: a vector maximum (a scalar loop's compare-and-select chain was a
// tenth of the block body).
template <typename V>
inline float max_of(const float* v, int64_t n, float floor) {
  constexpr int L = V::kLanes;
  typename V::F m = V::set1(floor);
  int64_t j = 0;
  for (; j + L <= n; j += L) m = V::max(m, V::load(v + j));
  float out = V::reduce_max(m);
  for (; j < n; ++j) out = v[j] > out ? v[j] : out;
  return out;
}

// v[j] = exp(v[j] - shift) for j < n; returns their sum.
template <typename V>
inline float exp_block(float* v, int64_t n, float shift) {
  constexpr int L = V::kLanes;
  const typename V::F s = V::set1(shift);
  typename V::F total = V::zero();
  int64_t j = 0;
  for (; j + L <= n; j += L) {
    const typename V::F e = exp_nonpositive_lanes<V>(V::sub(V::load(v + j), s));
    V::store(v + j, e);
    total = V::add(total, e);
  }
  alignas(64) float lanes[L];
  V::store(lanes, total);
  for (int width = L; width > 4; width /= 2)  // halves folded onto each other down to 4 partial sums
    for (int i = 0; i < width / 2; ++i) lanes[i] += lanes[i + width / 2];
  float sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  for (; j < n; ++j) {
    v[j] = exp_nonpositive(v[j] - shift);
    sum += v[j];
  }
  return sum;
}

// For G query heads at once: acc_g[offset..offset+C) = acc_g * correction_g + sum over j of p_g[j] *
// value[j][offset..offset+C), C = kLanes * Chunks channels in registers. Each value row is loaded once
// for the G heads, and the G x Chunks sums are independent chains (one head's Chunks alone would wait
// on the multiply-add latency at every row).
template <typename V, int Chunks, int G>
inline void accumulate_chunk(float* const* acc, const float* correction, const float* const* p,
                             const float* const* value, int64_t n, int64_t offset) {
  constexpr int L = V::kLanes;
  typename V::F a[G][Chunks];
  for (int g = 0; g < G; ++g) {
    const typename V::F c = V::set1(correction[g]);
    for (int i = 0; i < Chunks; ++i) a[g][i] = V::mul(V::load(acc[g] + offset + L * i), c);
  }
  for (int64_t j = 0; j < n; ++j) {
    const float* v = value[j] + offset;
    typename V::F row[Chunks];
    for (int i = 0; i < Chunks; ++i) row[i] = V::load(v + L * i);
    for (int g = 0; g < G; ++g) {
      const typename V::F pj = V::set1(p[g][j]);
      for (int i = 0; i < Chunks; ++i) a[g][i] = V::fmadd(pj, row[i], a[g][i]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < Chunks; ++i) V::store(acc[g] + offset + L * i, a[g][i]);
}

// accumulate_chunk over all vdim channels, 64 at a time in registers, for G heads.
template <typename V, int G>
inline void accumulate_values(float* const* acc, const float* correction, const float* const* p,
                              const float* const* value, int64_t n, int64_t vdim) {
  constexpr int L = V::kLanes;
  int64_t d0 = 0;
  for (; d0 + 64 <= vdim; d0 += 64) accumulate_chunk<V, 64 / L, G>(acc, correction, p, value, n, d0);
  for (; d0 < vdim; d0 += L) accumulate_chunk<V, 1, G>(acc, correction, p, value, n, d0);
}

// Heads taken together by accumulate_values: as many as keep 64 channels' sums of each, the value row
// and the weights in registers (32 of 16 lanes; 16 of 8 lanes hold one head's).
template <typename V>
constexpr int kHeadsTogether = V::kLanes == 16 ? 3 : 1;

// An int8 row of `dim` channels (a multiple of V::kLanes) as floats, unscaled, into buf.
template <typename V>
inline const float* int8_row(const void* base, int64_t index, int64_t stride, int64_t dim, float* buf) {
  const int8_t* src = static_cast<const int8_t*>(base) + index * stride;
  for (int64_t d = 0; d < dim; d += V::kLanes) V::store(buf + d, V::from_i8(src + d));
  return buf;
}

template <int Dtype>
constexpr int64_t kElementBytes = Dtype == 0 ? 4 : Dtype == 1 ? 2 : 1;

// The vectorised block body of walk_heads (attention_impl.h): the same walk, online softmax per block.
template <typename V, int Dtype>
void attend_heads_vectorised(const keel::PagedStore& s, const keel::PagedQuery& q, int64_t r, int64_t h, int64_t g0,
                             int64_t gn) {
  const int64_t dim = s.head_dim, vdim = s.v_dim, bs = s.block_size;
  alignas(64) float key_buf[kMaxBlock][kMaxDim];
  alignas(64) float value_buf[kMaxBlock][kMaxDim];
  const float* key[kMaxBlock];
  const float* value[kMaxBlock];
  alignas(64) float scores[kMaxGroup][kMaxBlock];  // each query head's, then its weights
  float key_scale[kMaxBlock], value_scale[kMaxBlock];  // int8 rows' scales
  float correction[kMaxGroup];
  float* acc[kMaxGroup];
  const float* weights[kMaxGroup];
  walk_heads(s, q, r, h, g0, gn, [&](HeadsWalk& w, int64_t start, int64_t slot0, int64_t n) {
    // The next blocks lie elsewhere in the store (tables are scattered), where the hardware prefetcher
    // cannot guess: fetch the rows two blocks ahead (and, at the first block, the next one too).
    for (int64_t ahead = start == w.first - w.first % bs ? 1 : 2; ahead <= 2; ++ahead) {
      if (start + ahead * bs > w.pos) break;
      const int64_t next = (w.row_base + w.table[start / bs + ahead] * bs) * dim * kElementBytes<Dtype>;
      const int64_t bytes = bs * dim * kElementBytes<Dtype>;
      for (int64_t b = 0; b < bytes; b += 64) {
        V::prefetch(static_cast<const char*>(s.keys) + next + b);
        if (s.values != nullptr) V::prefetch(static_cast<const char*>(s.values) + next + b);
      }
    }
    for (int64_t j = 0; j < n; ++j) {
      // Without a value store the latent is both key and value.
      if constexpr (Dtype == 2) {
        key[j] = int8_row<V>(s.keys, slot0 + j, dim, dim, key_buf[j]);
        key_scale[j] = V::half(s.key_scales[slot0 + j]);
        value[j] = s.values != nullptr ? int8_row<V>(s.values, slot0 + j, dim, vdim, value_buf[j]) : key[j];
        value_scale[j] = s.values != nullptr ? V::half(s.value_scales[slot0 + j]) : key_scale[j];
      } else {
        key[j] = row_at<Dtype>(s.keys, s.key_scales, slot0 + j, dim, dim, key_buf[j]);
        value[j] = s.values != nullptr ? row_at<Dtype>(s.values, s.value_scales, slot0 + j, dim, vdim, value_buf[j])
                                       : key[j];
      }
    }
    for (int64_t g = 0; g < gn; ++g) {
      float* p = scores[g];
      block_scores<V>(w.qs[g], key, n, dim, p);
      if constexpr (Dtype == 2)
        for (int64_t j = 0; j < n; ++j) p[j] *= key_scale[j];
      if (q.softcap > 0.f) cap_scores<V>(p, n, q.softcap);
      if (q.alibi != nullptr) {  // the head's slope times each key's distance back from the query
        const float slope = q.alibi[h * (q.heads / s.kv_heads) + g0 + g];
        const int64_t lo = start < w.first ? w.first : start;
        for (int64_t j = 0; j < n; ++j) p[j] += slope * static_cast<float>(lo + j - w.pos);
      }
      const float block_max = max_of<V>(p, n, w.running_max[g]);
      // Online softmax: what was summed under the old maximum is rescaled to the new one.
      correction[g] = exp_nonpositive(w.running_max[g] - block_max);
      w.running_max[g] = block_max;
      w.total[g] = w.total[g] * correction[g] + exp_block<V>(p, n, block_max);
      if constexpr (Dtype == 2)
        for (int64_t j = 0; j < n; ++j) p[j] *= value_scale[j];  // each value row's scale, on its weight
      acc[g] = w.acc[g];
      weights[g] = p;
    }
    constexpr int G = kHeadsTogether<V>;
    int64_t g = 0;
    for (; g + G <= gn; g += G) accumulate_values<V, G>(acc + g, correction + g, weights + g, value, n, vdim);
    if constexpr (G == 3) {
      if (gn - g == 2) accumulate_values<V, 2>(acc + g, correction + g, weights + g, value, n, vdim);
      if (gn - g == 1) accumulate_values<V, 1>(acc + g, correction + g, weights + g, value, n, vdim);
    }
  });
}

// A tile: rows r0..r0+rows-1 of one sequence (one table) and query heads g0..g0+gn of KV head h, walked
// over their blocks once: each block's rows are converted (bf16) and located once for the tile, then each
// row runs the row body's arithmetic over the keys its position sees (causal, window), so a tile's
// outputs are bit for bit those of its rows walked alone. (A variant scoring the tile as one matrix
// product against transposed keys was ~10% faster on a 192-row chunk but changed the rounding: a bf16
// model's near-tie greedy tokens moved with it; docs/BENCHMARKS.md, issue 22 ninth part.)
// float32 and bf16 stores with head dims of whole vectors up to kTileDim (the caller checks).
template <typename V, int Dtype>
void attend_tile_vectorised(const keel::PagedStore& s, const keel::PagedQuery& q, int64_t r0, int64_t rows,
                            int64_t h, int64_t g0, int64_t gn) {
  constexpr int64_t kVectors = keel::kTileVectors, kDim = keel::kTileDim;
  const int64_t group = q.heads / s.kv_heads;
  const int64_t dim = s.head_dim, vdim = s.v_dim, bs = s.block_size;
  const int64_t count = rows * gn;  // query vectors: vector m is row m / gn, head m % gn
  alignas(64) float qs[kVectors * kDim];
  alignas(64) float acc_store[kVectors * kDim];
  alignas(64) float key_buf[kMaxBlock][kDim];
  alignas(64) float value_buf[kMaxBlock][kDim];
  alignas(64) float scores[kVectors * kMaxBlock];  // each vector's scores, then its weights
  float running_max[kVectors], total[kVectors], correction[kVectors];
  float* acc[kVectors];
  const float* weights[kVectors];
  const float* value[kMaxBlock];
  int64_t first[keel::kMaxTileRows], last[keel::kMaxTileRows];  // each row's visible positions
  const int32_t* table = q.tables + (q.table_of ? q.table_of[r0] : r0) * q.table_width;
  int64_t lo = -1, hi = -1;
  for (int64_t t = 0; t < rows; ++t) {
    last[t] = q.positions[r0 + t];
    first[t] = keel::first_visible(last[t], q.window);
    lo = lo < 0 || first[t] < lo ? first[t] : lo;
    hi = last[t] > hi ? last[t] : hi;
  }
  const float* sink = q.sinks != nullptr ? q.sinks + h * group + g0 : nullptr;
  for (int64_t m = 0; m < count; ++m) {
    const float* src = q.q + ((r0 + m / gn) * q.heads + h * group + g0 + m % gn) * dim;
    for (int64_t d = 0; d < dim; ++d) qs[m * dim + d] = src[d] * q.scale;
    acc[m] = acc_store + m * vdim;
    for (int64_t d = 0; d < vdim; ++d) acc[m][d] = 0.f;
    // As walk_heads starts a row: from its head's sink where there is one.
    running_max[m] = sink != nullptr ? sink[m % gn] : -1e30f;
    total[m] = sink != nullptr ? 1.f : 0.f;
  }
  const int64_t row_base = h * s.slots;
  for (int64_t start = lo - lo % bs; start <= hi; start += bs) {
    const int64_t n = start + bs - 1 < hi ? bs : hi - start + 1;  // the block's keys some row sees
    const int64_t slot0 = row_base + table[start / bs] * bs;
    const float* key[kMaxBlock];
    for (int64_t j = 0; j < n; ++j) {
      key[j] = row_at<Dtype>(s.keys, s.key_scales, slot0 + j, dim, dim, key_buf[j]);
      // Without a value store the latent is both key and value (row_at returns the store's row or key_buf).
      value[j] = s.values != nullptr ? row_at<Dtype>(s.values, s.value_scales, slot0 + j, dim, vdim, value_buf[j])
                                     : key[j];
    }
    // Each row over the keys its position sees, [j0, j1) of the block, with the arithmetic of the row
    // body (attend_heads_vectorised) in the same order: a tile's outputs are bit for bit its rows'.
    for (int64_t t = 0; t < rows; ++t) {
      const int64_t j0 = first[t] > start ? first[t] - start : 0;
      const int64_t j1 = last[t] - start + 1 < n ? last[t] - start + 1 : n;
      if (j1 <= j0) continue;  // none in this block: the row's sums stand
      const int64_t seen = j1 - j0;
      for (int64_t m = t * gn; m < (t + 1) * gn; ++m) {
        float* p = scores + m * kMaxBlock;
        block_scores<V>(qs + m * dim, key + j0, seen, dim, p);
        if (q.softcap > 0.f) cap_scores<V>(p, seen, q.softcap);
        if (q.alibi != nullptr) {  // as the row body: the head's slope times each key's distance
          const float slope = q.alibi[h * group + g0 + m % gn];
          for (int64_t j = 0; j < seen; ++j) p[j] += slope * static_cast<float>(start + j0 + j - last[t]);
        }
        const float block_max = max_of<V>(p, seen, running_max[m]);
        // Online softmax: what was summed under the old maximum is rescaled to the new one.
        correction[m] = exp_nonpositive(running_max[m] - block_max);
        running_max[m] = block_max;
        total[m] = total[m] * correction[m] + exp_block<V>(p, seen, block_max);
        weights[m] = p;
      }
      constexpr int G = kHeadsTogether<V>;
      int64_t m = t * gn;
      for (; m + G <= (t + 1) * gn; m += G)
        accumulate_values<V, G>(acc + m, correction + m, weights + m, value + j0, seen, vdim);
      for (; m < (t + 1) * gn; ++m)
        accumulate_values<V, 1>(acc + m, correction + m, weights + m, value + j0, seen, vdim);
    }
  }
  for (int64_t m = 0; m < count; ++m) {
    float* dst = q.out + ((r0 + m / gn) * q.heads + h * group + g0 + m % gn) * vdim;
    const float inverse = 1.f / total[m];
    for (int64_t d = 0; d < vdim; ++d) dst[d] = acc[m][d] * inverse;
  }
}

// The items of a paged attention call: the vectorised bodies where the head dims are whole vectors (a
// tile of rows through attend_tile_vectorised where its store and dims allow, else row by row), the
// portable loops (vectorised by the compiler for this unit's level) otherwise.
template <typename V>
void attend_items_vectorised(const keel::PagedStore& s, const keel::PagedQuery& q, const keel::PagedItem* items,
                             int64_t count) {
  if (s.head_dim % V::kLanes != 0 || s.v_dim % V::kLanes != 0) {
    attend_items(s, q, items, count);
    return;
  }
  const bool tiles = s.dtype != 2 && s.head_dim <= keel::kTileDim;
  for_each_item(s, q, items, count, [&](auto dtype, int64_t r0, int64_t rows, int64_t h, int64_t g0, int64_t gn) {
    constexpr int Dtype = decltype(dtype)::value;
    if constexpr (Dtype != 2) {
      if (tiles && rows > 1) {
        attend_tile_vectorised<V, Dtype>(s, q, r0, rows, h, g0, gn);
        return;
      }
    }
    for (int64_t r = r0; r < r0 + rows; ++r) attend_heads_vectorised<V, Dtype>(s, q, r, h, g0, gn);
  });
}

}  // namespace
