// keel::sample_rows: one token per row of float32 logits, temperature, top-k, top-p and min-p applied
// as keel.serve.sampling.apply_filters defines them, and the draw, in one pass per row.
//
// Why: torch's path sorts every row's whole vocabulary (for top-k/top-p), materialises softmax, and
// draws V exponentials a row for the race; at 64 rows of a 49k vocabulary that is ~0.5 s of CPU per
// step, longer than the model's step. Here one vector pass a row (sample_vec.h) scales the logits and
// takes their exponentials, with each chunk's maximum and sum; top-k/top-p candidates are the values in
// the chunks whose maxima can hold them, selected (nth_element) on the order the stable sort defines
// (value descending, then index), and only they are sorted; the draw inverts the kept distribution's CDF
// with one uniform number per row (given by the caller, so that seeded rows draw from their own
// generators), over chunk sums first where it runs in vocabulary order.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

#include "attention.h"
#include "isa.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace keel {

namespace {

struct Candidate {
  float value;
  int64_t index;
};

// The stable descending sort's order: larger values first, equal values by index.
inline bool before_in_order(const Candidate& a, const Candidate& b) {
  return a.value > b.value || (a.value == b.value && a.index < b.index);
}

// The first index of the row's largest value (a NaN first value stays the answer, as a scan keeping
// the best so far by `>` leaves it). Two passes over whole vectors: the maximum in independent lanes,
// then the first vector that holds it. (A scan comparing each value with the best so far is a
// dependent chain a value; the compiler does not vectorise `x > m ? x : m` on floats itself.)
int64_t greedy_row(const float* x, int64_t vocab) {
  float top = x[0];
  int64_t i = 0, from = 0;
#if defined(__SSE2__)
  // _mm_max_ps(a, b) is a > b ? a : b lane by lane, NaNs included: the scalar rule below.
  __m128 lanes[4] = {_mm_set1_ps(top), _mm_set1_ps(top), _mm_set1_ps(top), _mm_set1_ps(top)};
  for (; i + 16 <= vocab; i += 16)
    for (int j = 0; j < 4; ++j) lanes[j] = _mm_max_ps(_mm_loadu_ps(x + i + 4 * j), lanes[j]);
  alignas(16) float kept[16];
  for (int j = 0; j < 4; ++j) _mm_store_ps(kept + 4 * j, lanes[j]);
  for (const float v : kept) top = v > top ? v : top;
#endif
  for (; i < vocab; ++i) top = x[i] > top ? x[i] : top;
  if (top != top) return 0;  // x[0] is NaN: nothing compares greater
#if defined(__SSE2__)
  const __m128 wanted = _mm_set1_ps(top);
  for (; from + 4 <= vocab; from += 4)
    if (_mm_movemask_ps(_mm_cmpeq_ps(_mm_loadu_ps(x + from), wanted)) != 0) break;
#endif
  for (int64_t k = from; k < vocab; ++k)
    if (x[k] == top) return k;
  return 0;
}

// The first `count` candidates of the row in sorted order.
void top_candidates(std::vector<Candidate>& all, int64_t count) {
  if (count < static_cast<int64_t>(all.size()))
    std::nth_element(all.begin(), all.begin() + count, all.end(), before_in_order);
  std::sort(all.begin(), all.begin() + count, before_in_order);
}

// A row's scratch, kept across the rows of one thread.
struct Scratch {
  std::vector<float> x, e, chunk_max, maxima;
  std::vector<double> chunk_sum;
  std::vector<Candidate> all, boundary;
  std::vector<uint16_t> bucket;
};

float sample_pass_portable(const SamplePass& p) {
  float top = -INFINITY;
  for (int64_t i = 0; i < p.vocab; ++i) {
    p.x[i] = p.logits[i] / p.temperature;
    const int64_t c = i / kSampleChunk;
    if (i % kSampleChunk == 0) p.chunk_max[c] = -INFINITY;
    p.chunk_max[c] = p.x[i] > p.chunk_max[c] ? p.x[i] : p.chunk_max[c];
    top = p.x[i] > top ? p.x[i] : top;
  }
  for (int64_t i = 0; i < p.vocab; ++i) {
    const int64_t c = i / kSampleChunk;
    if (i % kSampleChunk == 0) p.chunk_sum[c] = 0;
    p.e[i] = sample_weight(p.x[i], top, p.min_p);
    p.chunk_sum[c] += p.e[i];
  }
  return top;
}

float sample_pass(Isa isa, const SamplePass& p) {
#if defined(__x86_64__) || defined(_M_X64)
  if (isa >= kAvx512Vnni) return sample_pass_avx512(p);
  if (isa >= kAvx2) return sample_pass_avx2(p);
#elif defined(__aarch64__)
  if (isa >= kNeon) return sample_pass_neon(p);
#endif
  return sample_pass_portable(p);
}

// s.all = candidates that hold the row's first `count` values in the stable sort's order: the values not below
// the count-th largest chunk maximum (the count largest chunk maxima are count values at least that large, so
// the count-th largest value is too), found in the chunks whose maximum reaches it. Every value when count
// exceeds the chunks.
void every_value(Scratch& s, int64_t vocab) {
  s.all.clear();
  for (int64_t i = 0; i < vocab; ++i) s.all.push_back(Candidate{s.x[i], i});
}

void collect_candidates(Scratch& s, int64_t vocab, int64_t count) {
  const int64_t chunks = static_cast<int64_t>(s.chunk_max.size());
  if (count >= chunks) return every_value(s, vocab);
  s.all.clear();
  s.maxima.assign(s.chunk_max.begin(), s.chunk_max.end());
  std::nth_element(s.maxima.begin(), s.maxima.begin() + (count - 1), s.maxima.end(), std::greater<float>());
  const float floor = s.maxima[count - 1];
  for (int64_t c = 0; c < chunks; ++c) {
    if (!(s.chunk_max[c] >= floor)) continue;
    const int64_t end = std::min(vocab, (c + 1) * kSampleChunk);
    for (int64_t i = c * kSampleChunk; i < end; ++i)
      if (s.x[i] >= floor) s.all.push_back(Candidate{s.x[i], i});
  }
  if (static_cast<int64_t>(s.all.size()) < count) every_value(s, vocab);  // only where NaNs broke the maxima' order
}

// The tokens top-p can keep when the first 256 did not hold top_p of the mass: s.all = every value of the buckets
// (of x's distance from the maximum, finer than a chunk's spread) whose mass sums below `needed`, in vocabulary
// order, then the bucket that reaches it, sorted in the stable order. The top-p cut over them keeps what a
// sorted prefix keeps: every token before the bucket has less than `needed` before it. Returns the count.
int64_t nucleus_by_buckets(Scratch& s, int64_t vocab, float top, double needed) {
  constexpr int kBuckets = 1024;
  constexpr float kScale = kBuckets / 88.f;  // exp's zero lies past 87 below the maximum
  s.bucket.resize(vocab);
  double mass[kBuckets] = {};
  for (int64_t i = 0; i < vocab; ++i) {
    const float d = (top - s.x[i]) * kScale;
    // Monotone in x: a larger value never lands in a later bucket (zeros and NaNs in the last).
    const int b = s.e[i] == 0 || !(d >= 0.f) ? kBuckets - 1 : std::min(kBuckets - 1, static_cast<int>(d));
    s.bucket[i] = static_cast<uint16_t>(b);
    mass[b] += s.e[i];
  }
  int crossing = kBuckets - 1;
  double before = 0;
  for (int b = 0; b < kBuckets; ++b) {
    if (before + mass[b] >= needed) {
      crossing = b;
      break;
    }
    before += mass[b];
  }
  s.all.clear();
  s.boundary.clear();
  for (int64_t i = 0; i < vocab; ++i) {
    if (s.bucket[i] < crossing) s.all.push_back(Candidate{s.x[i], i});
    else if (s.bucket[i] == crossing) s.boundary.push_back(Candidate{s.x[i], i});
  }
  std::sort(s.boundary.begin(), s.boundary.end(), before_in_order);
  s.all.insert(s.all.end(), s.boundary.begin(), s.boundary.end());
  return static_cast<int64_t>(s.all.size());
}

// A draw over the whole vocabulary in its order: the chunk whose running sum passes u * total, then the value.
int64_t draw_in_vocabulary_order(const Scratch& s, int64_t vocab, double u) {
  const int64_t chunks = static_cast<int64_t>(s.chunk_sum.size());
  double total = 0;
  for (int64_t c = 0; c < chunks; ++c) total += s.chunk_sum[c];
  const double target = u * total;
  double acc = 0;
  int64_t last = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    if (s.chunk_sum[c] == 0) continue;
    const int64_t end = std::min(vocab, (c + 1) * kSampleChunk);
    if (acc + s.chunk_sum[c] <= target) {
      acc += s.chunk_sum[c];
      for (int64_t i = end - 1; i >= c * kSampleChunk; --i)
        if (s.e[i] != 0) {
          last = i;
          break;
        }
      continue;
    }
    for (int64_t i = c * kSampleChunk; i < end; ++i) {  // the chunk's own sum rounds apart from this one
      if (s.e[i] == 0) continue;
      acc += s.e[i];
      last = i;
      if (acc > target) return i;
    }
  }
  return last;
}

int64_t sample_row(const float* logits, int64_t vocab, float temperature, int64_t top_k, float top_p, float min_p,
                   double u, Isa isa, Scratch& s) {
  const bool use_k = top_k > 0 && top_k < vocab, use_p = top_p < 1.f;
  const int64_t chunks = (vocab + kSampleChunk - 1) / kSampleChunk;
  s.x.resize(vocab);
  s.e.resize(vocab);
  s.chunk_max.resize(chunks);
  s.chunk_sum.resize(chunks);
  // Unnormalised probabilities e_i = exp(x_i - max): min-p keeps e_i >= min_p (p_i >= min_p * p_max), applied
  // in the pass for a draw over the whole vocabulary, after top-k/top-p otherwise. The order stays the
  // logits' (exp could round two of them equal).
  const float top = sample_pass(isa, SamplePass{logits, vocab, temperature, use_k || use_p ? 0.f : min_p, s.x.data(), s.e.data(),
                              s.chunk_max.data(), s.chunk_sum.data()});
  if (!use_k && !use_p) return draw_in_vocabulary_order(s, vocab, u);
  auto weight = [&](int64_t i) { return static_cast<double>(s.e[i]); };
  std::vector<Candidate>& all = s.all;
  int64_t count;
  double mass;  // the sum the top-p masses are fractions of
  if (use_k) {
    // top-k by threshold: every token at least the k-th largest value stays (ties included); each such value
    // is a candidate, so they are counted there.
    collect_candidates(s, vocab, top_k);
    std::nth_element(all.begin(), all.begin() + (top_k - 1), all.end(), before_in_order);
    const float kth = all[top_k - 1].value;
    count = 0;
    for (const Candidate& c : all) count += c.value >= kth;
    top_candidates(all, count);
    mass = 0;
    for (int64_t j = 0; j < count; ++j) mass += weight(all[j].index);
  } else {
    // top-p alone: grow the sorted prefix until it holds top_p of the whole mass.
    mass = 0;
    for (const double c : s.chunk_sum) mass += c;
    count = std::min<int64_t>(vocab, 256);
    collect_candidates(s, vocab, count);
    top_candidates(all, count);
    double prefix = 0;
    for (int64_t j = 0; j < count; ++j) prefix += weight(all[j].index);
    if (prefix < top_p * mass && count < vocab) count = nucleus_by_buckets(s, vocab, top, top_p * mass);
  }
  // top-p: drop a token once the mass before it reaches top_p (the first always stays); then min-p.
  int64_t kept = count;
  if (use_p) {
    double before_mass = 0;
    for (int64_t j = 0; j < count; ++j) {
      if (j > 0 && before_mass >= top_p * mass) {
        kept = j;
        break;
      }
      before_mass += weight(all[j].index);
    }
  }
  double total = 0;
  for (int64_t j = 0; j < kept; ++j) {
    const double e = weight(all[j].index);
    if (min_p <= 0.f || e >= min_p) total += e;
  }
  const double target = u * total;
  double acc = 0;
  int64_t last = all[0].index;
  for (int64_t j = 0; j < kept; ++j) {
    const double e = weight(all[j].index);
    if (min_p > 0.f && e < min_p) continue;
    acc += e;
    last = all[j].index;
    if (acc > target) return last;
  }
  return last;
}

}  // namespace

// logits [N, V] float32; temperature, top_p, min_p [N] float32 (temperature 0: greedy, the first
// largest logit); top_k [N] int64 (<= 0 or >= V: off); uniform [N] float64 in [0, 1). -> int64 [N].
at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                       const at::Tensor& top_p, const at::Tensor& min_p, const at::Tensor& uniform) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "keel::sample_rows: float32 logits [N, V]");
  const int64_t n = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab > 0, "keel::sample_rows: an empty vocabulary");
  auto check = [&](const at::Tensor& t, at::ScalarType type, const char* name) {
    TORCH_CHECK(t.dim() == 1 && t.size(0) == n && t.scalar_type() == type, "keel::sample_rows: ", name, " must be [",
                n, "] ", c10::toString(type));
    return t.contiguous();
  };
  const at::Tensor x = logits.contiguous();
  const at::Tensor t = check(temperature, at::kFloat, "temperature"), k = check(top_k, at::kLong, "top_k");
  const at::Tensor p = check(top_p, at::kFloat, "top_p"), m = check(min_p, at::kFloat, "min_p");
  const at::Tensor u = check(uniform, at::kDouble, "uniform");
  at::Tensor out = at::empty({n}, logits.options().dtype(at::kLong));
  const float *xp = x.data_ptr<float>(), *tp = t.data_ptr<float>(), *pp = p.data_ptr<float>(), *mp = m.data_ptr<float>();
  const int64_t* kp = k.data_ptr<int64_t>();
  const double* up = u.data_ptr<double>();
  int64_t* o = out.data_ptr<int64_t>();
  const Isa isa = current_isa();
  at::parallel_for(0, n, 1, [&](int64_t r0, int64_t r1) {
    Scratch scratch;
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * vocab;
      o[r] = tp[r] == 0.f ? greedy_row(xr, vocab) : sample_row(xr, vocab, tp[r], kp[r], pp[r], mp[r], up[r], isa, scratch);
    }
  });
  return out;
}

}  // namespace keel

TORCH_LIBRARY_FRAGMENT(keel, m) {
  m.def("sample_rows(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor min_p, Tensor uniform) -> Tensor");
}

TORCH_LIBRARY_IMPL(keel, CPU, m) { m.impl("sample_rows", &keel::sample_rows); }
