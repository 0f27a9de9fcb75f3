// keel::decoder_layer: a whole pre-norm decoder layer of a packed serving step in one operator call.
//
// Why: at decode sizes a layer's arithmetic is a few hundred microseconds of weight streaming, and the
// ~20 torch calls around it (norms, splits, rotary, K/V writes, residual adds, each through Python
// modules and the dispatcher) cost about as much again (docs/BENCHMARKS.md, "keel's kernels"). This
// operator runs the same functions the separate operators run (block_linear or at::linear,
// rms_norm_rows, rotary_rows, paged_attention, silu_mul_rows), in the same order on the same values, so
// its result is bit for bit the modules' (keel.model.fused_layer builds the call; tests compare).
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstring>

#include "ops.h"

namespace keel {

namespace {

// One projection: float32 weights (bits 0, through at::linear, as nn.Linear) or keel's blocks.
struct Projection {
  at::Tensor weight;  // [N, K] float32, or the block codes
  c10::optional<at::Tensor> scales, mins, bias;
  int64_t bits, passes;

  at::Tensor operator()(const at::Tensor& x) const {
    if (bits == 0) return at::linear(x, weight, bias);
    return block_linear(x, weight, *scales, mins, bits, bias, passes);
  }
};

c10::optional<at::Tensor> entry(const c10::List<c10::optional<at::Tensor>>& tensors, size_t i) {
  const c10::optional<at::Tensor> t = tensors.get(i);
  return t.has_value() && t->defined() ? t : c10::nullopt;
}

Projection projection(const c10::List<c10::optional<at::Tensor>>& tensors, const std::vector<int64_t>& ints, int i) {
  const c10::optional<at::Tensor> weight = entry(tensors, 4 * i);
  TORCH_CHECK(weight.has_value(), "keel::decoder_layer: projection ", i, " has no weight");
  Projection p{*weight, entry(tensors, 4 * i + 1), entry(tensors, 4 * i + 2), entry(tensors, 4 * i + 3), ints[i],
               ints[4 + i]};
  TORCH_CHECK(p.bits == 0 || p.scales.has_value(), "keel::decoder_layer: block projection ", i, " has no scales");
  TORCH_CHECK(p.bits != 0 || p.weight.scalar_type() == at::kFloat, "keel::decoder_layer: dense weights are float32");
  return p;
}

const float* norm_weight(const c10::optional<at::Tensor>& w, int64_t dim, const char* name) {
  if (!w.has_value()) return nullptr;
  TORCH_CHECK(w->scalar_type() == at::kFloat && w->is_contiguous() && w->numel() == dim, "keel::decoder_layer: ", name,
              " must be a float32 [", dim, "]");
  return w->data_ptr<float>();
}

// Channels [from, from + heads * dim) of each row of `packed` [T, width] -> a contiguous [T, heads, dim].
at::Tensor heads_of(const at::Tensor& packed, int64_t from, int64_t heads, int64_t dim) {
  const int64_t tokens = packed.size(0), width = packed.size(1);
  at::Tensor out = at::empty({tokens, heads, dim}, packed.options());
  const float* src = packed.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  for (int64_t t = 0; t < tokens; ++t)
    std::memcpy(dst + t * heads * dim, src + t * width + from, sizeof(float) * heads * dim);
  return out;
}

// rows [T, H_kv, D] float32 into slots[t] of store [H_kv, slots, D] (float32, or bfloat16 rounded to
// nearest even as torch's conversion rounds).
void write_rows(at::Tensor& store, const at::Tensor& rows, const int64_t* slots) {
  const int64_t tokens = rows.size(0), heads = rows.size(1), dim = rows.size(2), capacity = store.size(1);
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < capacity, "keel::decoder_layer: slot ", slots[t], " outside the store");
  const float* src = rows.data_ptr<float>();
  if (store.scalar_type() == at::kFloat) {
    float* dst = store.data_ptr<float>();
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t h = 0; h < heads; ++h)
        std::memcpy(dst + (h * capacity + slots[t]) * dim, src + (t * heads + h) * dim, sizeof(float) * dim);
    return;
  }
  c10::BFloat16* dst = store.data_ptr<c10::BFloat16>();
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      const float* s = src + (t * heads + h) * dim;
      c10::BFloat16* d = dst + (h * capacity + slots[t]) * dim;
      for (int64_t i = 0; i < dim; ++i) d[i] = c10::BFloat16(s[i]);
    }
}

// tensors: for the q/k/v, output, gate/up and down projections in turn [weight or codes, scales, mins,
// bias], then [input norm, post-attention norm, q norm, k norm] (None where absent).
// ints: [bits x 4, activation passes x 4, query heads, KV heads, head dim, block size, window (0: none)].
// floats: [eps of each norm x 4, attention scale].
at::Tensor decoder_layer(const at::Tensor& x_in, const c10::List<c10::optional<at::Tensor>>& tensors,
                         at::IntArrayRef int_args, at::ArrayRef<double> float_args, const at::Tensor& cos,
                         const at::Tensor& sin, at::Tensor& k_store, at::Tensor& v_store, const at::Tensor& slots,
                         const at::Tensor& tables, const at::Tensor& table_of, const at::Tensor& positions) {
  TORCH_CHECK(tensors.size() == 20 && int_args.size() == 13 && float_args.size() == 5,
              "keel::decoder_layer: 20 tensors, 13 ints and 5 floats");
  TORCH_CHECK(x_in.dim() >= 2 && x_in.scalar_type() == at::kFloat && x_in.is_contiguous(),
              "keel::decoder_layer: x must be a contiguous float32 [..., T, hidden]");
  // The step's tokens as rows (the model's packed [1, T, hidden]); the result takes x's shape.
  const at::Tensor x = x_in.view({-1, x_in.size(-1)});
  const std::vector<int64_t> ints(int_args.begin(), int_args.end());
  const int64_t tokens = x.size(0), hidden = x.size(1);
  const int64_t heads = ints[8], kv_heads = ints[9], dim = ints[10], block_size = ints[11], window = ints[12];
  TORCH_CHECK(k_store.scalar_type() == v_store.scalar_type() &&
                  (k_store.scalar_type() == at::kFloat || k_store.scalar_type() == at::kBFloat16) &&
                  k_store.is_contiguous() && v_store.is_contiguous() && k_store.dim() == 3 &&
                  k_store.size(0) == kv_heads && k_store.size(2) == dim && v_store.sizes() == k_store.sizes(),
              "keel::decoder_layer: the K/V stores must be contiguous float32 or bfloat16 [", kv_heads, ", slots, ", dim,
              "]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.numel() == tokens * dim && sin.numel() == tokens * dim,
              "keel::decoder_layer: cos/sin must be contiguous float32 with a head-dim row per token");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == tokens,
              "keel::decoder_layer: slots must be int64 [T]");
  const Projection qkv = projection(tensors, ints, 0), out_proj = projection(tensors, ints, 1),
                   gate_up = projection(tensors, ints, 2), down = projection(tensors, ints, 3);
  const float* input_norm = norm_weight(entry(tensors, 16), hidden, "the input norm");
  const float* post_norm = norm_weight(entry(tensors, 17), hidden, "the post-attention norm");
  const float* q_norm = norm_weight(entry(tensors, 18), dim, "the q norm");
  const float* k_norm = norm_weight(entry(tensors, 19), dim, "the k norm");
  TORCH_CHECK(input_norm != nullptr && post_norm != nullptr, "keel::decoder_layer: both layer norms are required");

  // Attention: norm, q/k/v, per-head norms, rotary, K/V into their slots, attention over the blocks.
  at::Tensor normed = at::empty_like(x);
  rms_norm_rows(x.data_ptr<float>(), input_norm, normed.data_ptr<float>(), tokens, hidden,
                static_cast<float>(float_args[0]));
  const at::Tensor packed = qkv(normed);
  TORCH_CHECK(packed.size(1) == (heads + 2 * kv_heads) * dim, "keel::decoder_layer: the q/k/v projection gives ",
              packed.size(1), " channels for ", heads, " + 2 x ", kv_heads, " heads of ", dim);
  at::Tensor q = heads_of(packed, 0, heads, dim);
  at::Tensor k = heads_of(packed, heads * dim, kv_heads, dim);
  const at::Tensor v = heads_of(packed, (heads + kv_heads) * dim, kv_heads, dim);
  if (q_norm != nullptr)
    rms_norm_rows(q.data_ptr<float>(), q_norm, q.data_ptr<float>(), tokens * heads, dim,
                  static_cast<float>(float_args[2]));
  if (k_norm != nullptr)
    rms_norm_rows(k.data_ptr<float>(), k_norm, k.data_ptr<float>(), tokens * kv_heads, dim,
                  static_cast<float>(float_args[3]));
  at::Tensor q_rot = at::empty_like(q), k_rot = at::empty_like(k);
  rotary_rows(q.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), q_rot.data_ptr<float>(), tokens,
              heads, dim);
  rotary_rows(k.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), k_rot.data_ptr<float>(), tokens,
              kv_heads, dim);
  write_rows(k_store, k_rot, slots.data_ptr<int64_t>());
  write_rows(v_store, v, slots.data_ptr<int64_t>());
  const at::Tensor attended = paged_attention(q_rot, k_store, v_store, c10::nullopt, c10::nullopt, tables, table_of,
                                              positions, block_size, window, float_args[4], dim);

  // The residual, then the MLP: norm, gate/up, SiLU-and-multiply, down, the residual.
  at::Tensor h = x + out_proj(attended.view({tokens, heads * dim}));
  rms_norm_rows(h.data_ptr<float>(), post_norm, normed.data_ptr<float>(), tokens, hidden,
                static_cast<float>(float_args[1]));
  const at::Tensor gu = gate_up(normed);
  const int64_t inter = gu.size(1) / 2;
  at::Tensor act = at::empty({tokens, inter}, x.options());
  silu_mul_rows(gu.data_ptr<float>(), gu.size(1), gu.data_ptr<float>() + inter, gu.size(1), act.data_ptr<float>(),
                tokens, inter);
  return h.add_(down(act)).view(x_in.sizes());
}

}  // namespace

}  // namespace keel

TORCH_LIBRARY_FRAGMENT(keel, m) {
  m.def(
      "decoder_layer(Tensor x, Tensor?[] tensors, int[] ints, float[] floats, Tensor cos, Tensor sin, "
      "Tensor(a!) k_store, Tensor(b!) v_store, Tensor slots, Tensor tables, Tensor table_of, Tensor positions) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(keel, CPU, m) { m.impl("decoder_layer", &keel::decoder_layer); }
