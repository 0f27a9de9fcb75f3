// The body of paged decode attention, compiled once per ISA level: included by attention_scalar.cpp
// and, through attention_vec.h, by attention_avx2.cpp and attention_avx512.cpp (under their target
// pragmas), so the same loops are vectorised for each level by the compiler. Everything here has internal linkage: no copy compiled for one level can
// stand in for another's.
#include <cmath>
#include <cstring>
#include <type_traits>

#include "attention.h"
#include "kernels.h"

namespace {

constexpr int kMaxGroup = 16;  // query heads per KV head
constexpr int kMaxDim = 576;   // head (or latent + rope) dimension
constexpr int kMaxBlock = 64;  // tokens per block

// exp(x) for x <= 0 (scores minus their running max) as 2^k * p(r), |r| <= ln2 / 2: returns p and
// sets k. No libm call, integer rounding: the loops calling it vectorise.
inline float exp_parts(float x, int32_t* k) {
  x = x < -87.f ? -87.f : x;
  *k = -static_cast<int32_t>(0.5f - x * 1.44269504f);  // round to nearest (x <= 0)
  const float kf = static_cast<float>(*k);
  const float r = x - kf * 0.693359375f + kf * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.f;
}

inline float exp_nonpositive(float x) {
  int32_t k;
  const float p = exp_parts(x, &k);
  const int32_t bits = (k + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// v[i] = exp(v[i] - shift) for i < n (n <= kMaxBlock), vectorised (the bit casts go by array).
inline void exp_shifted(float* v, int64_t n, float shift) {
  int32_t bits[kMaxBlock];
  float poly[kMaxBlock];
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    int32_t k;
    poly[i] = exp_parts(v[i] - shift, &k);
    bits[i] = (k + 127) << 23;
  }
  float scale[kMaxBlock];
  std::memcpy(scale, bits, n * sizeof(float));
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) v[i] = poly[i] * scale[i];
}

// sum(a[d] * b[d]): eight partial sums (one vector register where the unit has them) so that the
// compiler vectorises it without reassociating a single sum; the tail of dim % 8 after them.
inline float dot_product(const float* a, const float* b, int64_t dim) {
  float part[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  const int64_t main = dim - dim % 8;
  for (int64_t d = 0; d < main; d += 8)
    for (int l = 0; l < 8; ++l) part[l] += a[d + l] * b[d + l];
  float sum = ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
  for (int64_t d = main; d < dim; ++d) sum += a[d] * b[d];
  return sum;
}

// One stored row of `dim` channels as float32: float32 rows are read where they lie, bf16 and int8
// rows (times their scale) are converted into `buf`.
template <int Dtype>
inline const float* row_at(const void* base, const uint16_t* scales, int64_t index, int64_t stride, int64_t dim,
                           float* buf) {
  if constexpr (Dtype == 0) {
    return static_cast<const float*>(base) + index * stride;
  } else if constexpr (Dtype == 1) {
    const uint16_t* src = static_cast<const uint16_t*>(base) + index * stride;
    uint32_t* bits = reinterpret_cast<uint32_t*>(buf);
    for (int64_t d = 0; d < dim; ++d) bits[d] = static_cast<uint32_t>(src[d]) << 16;
    return buf;
  } else {
    const int8_t* src = static_cast<const int8_t*>(base) + index * stride;
    const float s = keel::half_to_float(scales[index]);  // the portable unit's
    for (int64_t d = 0; d < dim; ++d) buf[d] = static_cast<float>(src[d]) * s;
    return buf;
  }
}

// One walk of row r's blocks for query heads g0..g0+gn of KV head h: the scaled queries, the online
// softmax's running maxima and totals and the output accumulators. `walk_heads` sets it up, calls the
// block body once per block and writes the outputs; the portable body is below, the vectorised one in
// attention_avx2.cpp.
struct HeadsWalk {
  alignas(64) float qs[kMaxGroup][kMaxDim];
  alignas(64) float acc[kMaxGroup][kMaxDim];
  float running_max[kMaxGroup], total[kMaxGroup];
  int64_t gn;
  int64_t pos, first;  // the query's position and the first one it sees (its window)
  int64_t row_base;    // KV head h's first slot
  const int32_t* table;
};

// block(walk, start, slot0, n) for each block: its first position `start`, and the n visible keys from
// slot slot0 of the store.
template <class Block>
inline void walk_heads(const keel::PagedStore& s, const keel::PagedQuery& q, int64_t r, int64_t h, int64_t g0,
                       int64_t gn, Block&& block) {
  const int64_t group = q.heads / s.kv_heads;
  const int64_t dim = s.head_dim, vdim = s.v_dim, bs = s.block_size;
  HeadsWalk w;
  w.gn = gn;
  w.pos = q.positions[r];
  w.table = q.tables + (q.table_of ? q.table_of[r] : r) * q.table_width;
  w.first = keel::first_visible(w.pos, q.window);
  w.row_base = h * s.slots;
  const float* sink = q.sinks != nullptr ? q.sinks + h * group + g0 : nullptr;
  for (int64_t g = 0; g < gn; ++g) {
    const float* src = q.q + (r * q.heads + h * group + g0 + g) * dim;
    for (int64_t d = 0; d < dim; ++d) w.qs[g][d] = src[d] * q.scale;
    for (int64_t d = 0; d < vdim; ++d) w.acc[g][d] = 0.f;
    // A sink is a logit already summed (exp(s - s) = 1) that the blocks' corrections rescale like any other.
    w.running_max[g] = sink != nullptr ? sink[g] : -1e30f;
    w.total[g] = sink != nullptr ? 1.f : 0.f;
  }
  for (int64_t start = w.first - w.first % bs; start <= w.pos; start += bs) {
    const int64_t lo = start < w.first ? w.first : start;
    const int64_t hi = start + bs - 1 < w.pos ? start + bs - 1 : w.pos;
    block(w, start, w.row_base + w.table[start / bs] * bs + (lo - start), hi - lo + 1);
  }
  for (int64_t g = 0; g < gn; ++g) {
    float* dst = q.out + (r * q.heads + h * group + g0 + g) * vdim;
    const float inverse = 1.f / w.total[g];
    for (int64_t d = 0; d < vdim; ++d) dst[d] = w.acc[g][d] * inverse;
  }
}

// The portable block body: each (key, head) dot product on its own, values accumulated in memory.
template <int Dtype>
inline void attend_heads(const keel::PagedStore& s, const keel::PagedQuery& q, int64_t r, int64_t h, int64_t g0,
                         int64_t gn) {
  const int64_t dim = s.head_dim, vdim = s.v_dim;
  alignas(64) float key_buf[kMaxBlock][kMaxDim];
  alignas(64) float val[kMaxDim];
  const float* key[kMaxBlock];
  float scores[kMaxGroup][kMaxBlock];
  const int64_t group = q.heads / s.kv_heads;
  walk_heads(s, q, r, h, g0, gn, [&](HeadsWalk& w, int64_t start, int64_t slot0, int64_t n) {
    for (int64_t j = 0; j < n; ++j) key[j] = row_at<Dtype>(s.keys, s.key_scales, slot0 + j, dim, dim, key_buf[j]);
    const int64_t lo = start < w.first ? w.first : start;  // the block's first visible key's position
    for (int64_t g = 0; g < gn; ++g) {
      float block_max = w.running_max[g];
      const float slope = q.alibi != nullptr ? q.alibi[h * group + g0 + g] : 0.f;
      for (int64_t j = 0; j < n; ++j) {
        float dot = dot_product(w.qs[g], key[j], dim);
        if (q.softcap > 0.f) dot = q.softcap * std::tanh(dot / q.softcap);
        if (q.alibi != nullptr) dot += slope * static_cast<float>(lo + j - w.pos);
        scores[g][j] = dot;
        block_max = dot > block_max ? dot : block_max;
      }
      // Online softmax: what was summed under the old maximum is rescaled to the new one.
      const float correction = exp_nonpositive(w.running_max[g] - block_max);
      w.running_max[g] = block_max;
      exp_shifted(scores[g], n, block_max);
      float sum = 0.f;
      for (int64_t j = 0; j < n; ++j) sum += scores[g][j];
      w.total[g] = w.total[g] * correction + sum;
      if (correction != 1.f)
        for (int64_t d = 0; d < vdim; ++d) w.acc[g][d] *= correction;
    }
    for (int64_t j = 0; j < n; ++j) {
      // Without a value store the latent is both key and value.
      const float* v = s.values != nullptr ? row_at<Dtype>(s.values, s.value_scales, slot0 + j, dim, vdim, val) : key[j];
      for (int64_t g = 0; g < gn; ++g) {
        const float p = scores[g][j];
        for (int64_t d = 0; d < vdim; ++d) w.acc[g][d] += p * v[d];
      }
    }
  });
}

// The work items, in slices of at most kMaxGroup query heads: heads(dtype, row0, rows, h, g0, gn) with
// the store's dtype as a compile-time constant.
template <class Heads>
inline void for_each_item(const keel::PagedStore& s, const keel::PagedQuery& q, const keel::PagedItem* items,
                          int64_t count, Heads&& heads) {
  const int64_t group = q.heads / s.kv_heads;
  for (int64_t i = 0; i < count; ++i) {
    const keel::PagedItem& item = items[i];
    for (int64_t g0 = 0; g0 < group; g0 += kMaxGroup) {
      const int64_t gn = group - g0 < kMaxGroup ? group - g0 : kMaxGroup;
      if (s.dtype == 0) {
        heads(std::integral_constant<int, 0>{}, item.row0, item.rows, item.kv_head, g0, gn);
      } else if (s.dtype == 1) {
        heads(std::integral_constant<int, 1>{}, item.row0, item.rows, item.kv_head, g0, gn);
      } else {
        heads(std::integral_constant<int, 2>{}, item.row0, item.rows, item.kv_head, g0, gn);
      }
    }
  }
}

// The portable loops: a tile row by row.
inline void attend_items(const keel::PagedStore& s, const keel::PagedQuery& q, const keel::PagedItem* items,
                         int64_t count) {
  for_each_item(s, q, items, count, [&](auto dtype, int64_t r0, int64_t rows, int64_t h, int64_t g0, int64_t gn) {
    for (int64_t r = r0; r < r0 + rows; ++r) attend_heads<decltype(dtype)::value>(s, q, r, h, g0, gn);
  });
}

}  // namespace
