// Paged decode attention for AVX2 + FMA (this unit alone is compiled for that level; the dispatcher
// calls it only when keel.platform reports AVX2). Head dims that are multiples of 8 take the loops
// below, written with intrinsics; others take attention_impl.h's portable loops, vectorised here by
// the compiler.
//
// Why intrinsics: the portable loops reduce every (key, head) dot product horizontally and keep the
// output accumulator in memory across keys, ~150 cycles per (key, query head) measured
// (docs/BENCHMARKS.md, "Decode attention alone"). Here 8 keys' dot products are reduced together
// (one hadd tree for 8 scores), their exponentials are one vector, and each query head's output
// stays in registers while it runs over the block's values.
#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC target("avx2,fma,f16c")

#include <immintrin.h>

#include "attention_impl.h"

namespace {

// [sum(v0), ..., sum(v7)] of 8 vectors.
inline __m256 sums_of_eight(const __m256 v[8]) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// exp(x) for x <= 0, 8 lanes: the polynomial of exp_parts (attention_impl.h), 2^k by the exponent bits.
inline __m256 exp8_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_add_ps(_mm256_sub_ps(x, _mm256_mul_ps(k, _mm256_set1_ps(0.693359375f))),
                                 _mm256_mul_ps(k, _mm256_set1_ps(2.12194440e-4f)));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// scores[j] = q . key[j] for j < n (q and keys of dim channels, a multiple of 8).
inline void block_scores(const float* q, const float* const* key, int64_t n, int64_t dim, float* scores) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 acc[8];
    for (int t = 0; t < 8; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d);
      for (int t = 0; t < 8; ++t) acc[t] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(key[j + t] + d), acc[t]);
    }
    _mm256_storeu_ps(scores + j, sums_of_eight(acc));
  }
  if (j < n) {  // the block's last keys: as many accumulators, the others summed as zeros
    __m256 acc[8];
    for (int t = 0; t < 8; ++t) acc[t] = _mm256_setzero_ps();
    const int64_t left = n - j;
    for (int64_t d = 0; d < dim; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d);
      for (int t = 0; t < left; ++t) acc[t] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(key[j + t] + d), acc[t]);
    }
    alignas(32) float all[8];
    _mm256_store_ps(all, sums_of_eight(acc));
    for (int t = 0; t < left; ++t) scores[j + t] = all[t];
  }
}

// v[j] = exp(v[j] - shift) for j < n; returns their sum.
inline float exp_block(float* v, int64_t n, float shift) {
  const __m256 s = _mm256_set1_ps(shift);
  __m256 total = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp8_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(v + j), s));
    _mm256_storeu_ps(v + j, e);
    total = _mm256_add_ps(total, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, total);
  float sum = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
  for (; j < n; ++j) {
    v[j] = exp_nonpositive(v[j] - shift);
    sum += v[j];
  }
  return sum;
}

// acc[0..C) = acc * correction + sum over j of p[j] * value[j][0..C), C = 8 * Chunks channels in registers.
template <int Chunks>
inline void accumulate_chunk(float* acc, __m256 correction, const float* p, const float* const* value, int64_t n,
                             int64_t offset) {
  __m256 a[Chunks];
  for (int i = 0; i < Chunks; ++i) a[i] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * i), correction);
  for (int64_t j = 0; j < n; ++j) {
    const __m256 pj = _mm256_set1_ps(p[j]);
    const float* v = value[j] + offset;
    for (int i = 0; i < Chunks; ++i) a[i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 8 * i), a[i]);
  }
  for (int i = 0; i < Chunks; ++i) _mm256_storeu_ps(acc + 8 * i, a[i]);
}

// acc[0..vdim) = acc * correction + sum over j of p[j] * value[j], 64 channels at a time in registers.
inline void accumulate_values(float* acc, float correction, const float* p, const float* const* value, int64_t n,
                              int64_t vdim) {
  const __m256 c = _mm256_set1_ps(correction);
  int64_t d0 = 0;
  for (; d0 + 64 <= vdim; d0 += 64) accumulate_chunk<8>(acc + d0, c, p, value, n, d0);
  for (; d0 < vdim; d0 += 8) accumulate_chunk<1>(acc + d0, c, p, value, n, d0);
}

template <int Dtype>
constexpr int64_t kElementBytes = Dtype == 0 ? 4 : Dtype == 1 ? 2 : 1;

// The vectorised block body of walk_heads (attention_impl.h): the same walk, online softmax per block.
template <int Dtype>
void attend_heads_vectorised(const keel::PagedStore& s, const keel::PagedQuery& q, int64_t r, int64_t h, int64_t g0,
                             int64_t gn) {
  const int64_t dim = s.head_dim, vdim = s.v_dim, bs = s.block_size;
  alignas(64) float key_buf[kMaxBlock][kMaxDim];
  alignas(64) float value_buf[kMaxBlock][kMaxDim];
  const float* key[kMaxBlock];
  const float* value[kMaxBlock];
  alignas(32) float scores[kMaxBlock];
  walk_heads(s, q, r, h, g0, gn, [&](HeadsWalk& w, int64_t start, int64_t slot0, int64_t n) {
    // The next blocks lie elsewhere in the store (tables are scattered), where the hardware prefetcher
    // cannot guess: fetch the rows two blocks ahead (and, at the first block, the next one too).
    for (int64_t ahead = start == w.first - w.first % bs ? 1 : 2; ahead <= 2; ++ahead) {
      if (start + ahead * bs > w.pos) break;
      const int64_t next = (w.row_base + w.table[start / bs + ahead] * bs) * dim * kElementBytes<Dtype>;
      const int64_t bytes = bs * dim * kElementBytes<Dtype>;
      for (int64_t b = 0; b < bytes; b += 64) {
        _mm_prefetch(static_cast<const char*>(s.keys) + next + b, _MM_HINT_T0);
        if (s.values != nullptr) _mm_prefetch(static_cast<const char*>(s.values) + next + b, _MM_HINT_T0);
      }
    }
    for (int64_t j = 0; j < n; ++j) {
      key[j] = row_at<Dtype>(s.keys, s.key_scales, slot0 + j, dim, dim, key_buf[j]);
      // Without a value store the latent is both key and value.
      value[j] = s.values != nullptr ? row_at<Dtype>(s.values, s.value_scales, slot0 + j, dim, vdim, value_buf[j])
                                     : key[j];
    }
    for (int64_t g = 0; g < gn; ++g) {
      block_scores(w.qs[g], key, n, dim, scores);
      float block_max = w.running_max[g];
      for (int64_t j = 0; j < n; ++j) block_max = scores[j] > block_max ? scores[j] : block_max;
      // Online softmax: what was summed under the old maximum is rescaled to the new one.
      const float correction = exp_nonpositive(w.running_max[g] - block_max);
      w.running_max[g] = block_max;
      w.total[g] = w.total[g] * correction + exp_block(scores, n, block_max);
      accumulate_values(w.acc[g], correction, scores, value, n, vdim);
    }
  });
}

}  // namespace

namespace keel {

void paged_attention_avx2(const PagedStore& s, const PagedQuery& q, int64_t item0, int64_t item1) {
  if (s.head_dim % 8 != 0 || s.v_dim % 8 != 0) {
    attend_items(s, q, item0, item1);
    return;
  }
  for_each_item(s, q, item0, item1, [&](auto dtype, int64_t r, int64_t h, int64_t g0, int64_t gn) {
    attend_heads_vectorised<decltype(dtype)::value>(s, q, r, h, g0, gn);
  });
}

}  // namespace keel
#endif
