// keel::sample_rows: one token per row of float32 logits, temperature, top-k, top-p and min-p applied
// as keel.serve.sampling.apply_filters defines them, and the draw, in one pass per row.
//
// Why: torch's path sorts every row's whole vocabulary (for top-k/top-p), materialises softmax, and
// draws V exponentials a row for the race; at 64 rows of a 49k vocabulary that is ~0.5 s of CPU per
// step, longer than the model's step. Here a row's candidates are found by selection (nth_element)
// on the order the stable sort defines (value descending, then index), only they are sorted, and the
// draw inverts the kept distribution's CDF with one uniform number per row (given by the caller, so
// that seeded rows draw from their own generators).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

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
inline bool before(const Candidate& a, const Candidate& b) {
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
  if (count < static_cast<int64_t>(all.size())) std::nth_element(all.begin(), all.begin() + count, all.end(), before);
  std::sort(all.begin(), all.begin() + count, before);
}

int64_t sample_row(const float* logits, int64_t vocab, float temperature, int64_t top_k, float top_p, float min_p,
                   double u, std::vector<float>& x, std::vector<float>& e, std::vector<Candidate>& all) {
  for (int64_t i = 0; i < vocab; ++i) x[i] = logits[i] / temperature;
  const float top = *std::max_element(x.begin(), x.begin() + vocab);
  const bool use_k = top_k > 0 && top_k < vocab, use_p = top_p < 1.f;
  // Unnormalised probabilities e_i = exp(x_i - max) (sums in double): min-p keeps e_i >= min_p
  // (p_i >= min_p * p_max). The order stays the logits' (exp could round two of them equal).
  for (int64_t i = 0; i < vocab; ++i) e[i] = std::exp(x[i] - top);
  auto weight = [&](int64_t i) { return static_cast<double>(e[i]); };
  if (!use_k && !use_p) {  // the whole vocabulary (min-p aside), drawn in vocabulary order
    double total = 0;
    for (int64_t i = 0; i < vocab; ++i) {
      if (min_p > 0.f && e[i] < min_p) e[i] = 0;
      total += e[i];
    }
    const double target = u * total;
    double acc = 0;
    int64_t last = 0;
    for (int64_t i = 0; i < vocab; ++i) {
      if (e[i] == 0) continue;
      acc += e[i];
      last = i;
      if (acc > target) return i;
    }
    return last;
  }
  all.resize(vocab);
  for (int64_t i = 0; i < vocab; ++i) all[i] = Candidate{x[i], i};
  int64_t count;
  double mass;  // the sum the top-p masses are fractions of
  if (use_k) {
    // top-k by threshold: every token at least the k-th largest value stays (ties included).
    std::nth_element(all.begin(), all.begin() + (top_k - 1), all.end(), before);
    const float kth = all[top_k - 1].value;
    count = 0;
    for (int64_t i = 0; i < vocab; ++i) count += x[i] >= kth;
    top_candidates(all, count);
    mass = 0;
    for (int64_t j = 0; j < count; ++j) mass += weight(all[j].index);
  } else {
    // top-p alone: grow the sorted prefix until it holds top_p of the whole mass.
    mass = 0;
    for (int64_t i = 0; i < vocab; ++i) mass += weight(i);
    count = std::min<int64_t>(vocab, 256);
    for (;;) {
      top_candidates(all, count);
      double prefix = 0;
      for (int64_t j = 0; j < count; ++j) prefix += weight(all[j].index);
      if (prefix >= top_p * mass || count == vocab) break;
      count = std::min<int64_t>(vocab, count * 4);
    }
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
  at::parallel_for(0, n, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> row, weights;
    std::vector<Candidate> all;
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * vocab;
      if (tp[r] == 0.f) {
        o[r] = greedy_row(xr, vocab);
        continue;
      }
      row.resize(vocab);
      weights.resize(vocab);
      o[r] = sample_row(xr, vocab, tp[r], kp[r], pp[r], mp[r], up[r], row, weights, all);
    }
  });
  return out;
}

}  // namespace keel

TORCH_LIBRARY_FRAGMENT(keel, m) {
  m.def("sample_rows(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor min_p, Tensor uniform) -> Tensor");
}

TORCH_LIBRARY_IMPL(keel, CPU, m) { m.impl("sample_rows", &keel::sample_rows); }
