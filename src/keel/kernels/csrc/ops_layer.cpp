// keel::decoder_layers: pre-norm decoder layers of a packed serving step, one after another, in one
// operator call (a whole model's stack, or one layer).
//
// Why: at decode sizes a layer's arithmetic is a few hundred microseconds of weight streaming, and the
// ~20 torch calls around it (norms, splits, rotary, K/V writes, residual adds, each through Python
// modules and the dispatcher) cost about as much again (docs/BENCHMARKS.md, "keel's kernels"); even
// one Python call a layer runs on caches the layer's weights have just swept. This operator runs the
// same functions the separate operators run (block_linear or at::linear, rms_norm_rows, rotary_rows,
// paged_attention, silu_mul_rows), in the same order on the same values, so its result is bit for bit
// the modules' (keel.model.fused_layer builds the call; tests compare).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/linear.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "ops.h"

namespace keel {

namespace {

// One projection: float32 weights (bits 0, through at::linear, as nn.Linear) or keel's blocks.
struct Projection {
  at::Tensor weight;  // [N, K] float32, or the block codes
  c10::optional<at::Tensor> scales, mins, bias;
  int64_t bits, passes, panel_rows;

  int64_t out_features() const { return weight.size(0); }
  int64_t in_features() const { return bits == 4 ? weight.size(1) * 2 : weight.size(1); }

  // x [m, K] -> out [m, N], or out = residual + it (residual may be out): the values the separate
  // operators give, and the residual added after, as `x + o_proj(...)` adds it.
  void into(const float* x, int64_t m, float* out, const float* residual) const {
    const int64_t k = in_features(), n = out_features();
    if (bits != 0) {
      block_linear_into(x, m, k, weight, *scales, mins, bits, bias, passes, panel_rows, out, residual);
      return;
    }
    at::Tensor y =
        at::linear(at::from_blob(const_cast<float*>(x), {m, k}, weight.options()), weight, bias).contiguous();
    finish_rows(y.data_ptr<float>(), nullptr, residual, out, m, n);
  }
};

constexpr int64_t kTensors = 20, kInts = 17, kFloats = 5;  // per layer

// One layer's slice of the flat argument lists.
struct LayerArgs {
  const c10::List<c10::optional<at::Tensor>>& tensors;
  int64_t layer;
  const int64_t* ints;
  const double* floats;

  c10::optional<at::Tensor> entry(int64_t i) const {
    const c10::optional<at::Tensor> t = tensors.get(layer * kTensors + i);
    return t.has_value() && t->defined() ? t : c10::nullopt;
  }
};

Projection projection(const LayerArgs& args, int i) {
  const c10::optional<at::Tensor> weight = args.entry(4 * i);
  TORCH_CHECK(weight.has_value(), "keel::decoder_layers: projection ", i, " has no weight");
  Projection p{*weight, args.entry(4 * i + 1), args.entry(4 * i + 2), args.entry(4 * i + 3), args.ints[i],
               args.ints[4 + i], args.ints[8 + i]};
  TORCH_CHECK(p.bits == 0 || p.scales.has_value(), "keel::decoder_layers: block projection ", i, " has no scales");
  TORCH_CHECK(p.bits != 0 || p.weight.scalar_type() == at::kFloat, "keel::decoder_layers: dense weights are float32");
  return p;
}

const float* norm_weight(const c10::optional<at::Tensor>& w, int64_t dim, const char* name) {
  if (!w.has_value()) return nullptr;
  TORCH_CHECK(w->scalar_type() == at::kFloat && w->is_contiguous() && w->numel() == dim, "keel::decoder_layers: ", name,
              " must be a float32 [", dim, "]");
  return w->data_ptr<float>();
}

// Channels [from, from + heads * dim) of each row of `packed` [T, width] -> a contiguous [T, heads, dim].
void heads_of(const float* packed, int64_t tokens, int64_t width, int64_t from, int64_t heads, int64_t dim,
              float* out) {
  for (int64_t t = 0; t < tokens; ++t)
    std::memcpy(out + t * heads * dim, packed + t * width + from, sizeof(float) * heads * dim);
}

// One row x [dim] as keel.serve.kv_quant.quantize_kv stores it, value for value: scale = absmax / 127,
// clamped to [2^-24, float16's max], rounded to float16; codes = x times the stored scale's reciprocal,
// rounded half to even, clamped to +-127. (A row holding NaN stores a NaN scale and zero codes.)
void quantize_row_int8(const float* x, int64_t dim, int8_t* codes, c10::Half* scale) {
  float amax = 0.f;
  bool nan = false;
  for (int64_t i = 0; i < dim; ++i) {
    amax = std::max(amax, std::fabs(x[i]));
    nan = nan || x[i] != x[i];
  }
  if (nan) {
    *scale = c10::Half(std::nanf(""));
    std::memset(codes, 0, static_cast<size_t>(dim));
    return;
  }
  const c10::Half stored(std::min(std::max(amax / 127.f, 0x1p-24f), 65504.f));
  const float inv = 1.f / static_cast<float>(stored);
  for (int64_t i = 0; i < dim; ++i)
    codes[i] = static_cast<int8_t>(std::min(std::max(std::nearbyint(x[i] * inv), -127.f), 127.f));
  *scale = stored;
}

// Rows [T, H_kv, D] float32 (token t's heads at src + t * src_stride) into slots[t] of store [H_kv, slots,
// D]: float32; bfloat16 rounded to nearest even as torch's conversion rounds (NaN to torch's NaN); or
// int8 with a float16 scale a row in `scales` [H_kv, slots, 1] (quantize_row_int8).
void write_rows(at::Tensor& store, const at::Tensor* scales, const float* src, int64_t src_stride, int64_t tokens,
                const int64_t* slots) {
  const int64_t heads = store.size(0), capacity = store.size(1), dim = store.size(2);
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < capacity, "keel::decoder_layers: slot ", slots[t], " outside the store");
  if (store.scalar_type() == at::kChar) {
    int8_t* dst = store.data_ptr<int8_t>();
    c10::Half* scale = scales->data_ptr<c10::Half>();
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t h = 0; h < heads; ++h)
        quantize_row_int8(src + t * src_stride + h * dim, dim, dst + (h * capacity + slots[t]) * dim,
                          scale + h * capacity + slots[t]);
    return;
  }
  if (store.scalar_type() == at::kFloat) {
    float* dst = store.data_ptr<float>();
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t h = 0; h < heads; ++h)
        std::memcpy(dst + (h * capacity + slots[t]) * dim, src + t * src_stride + h * dim, sizeof(float) * dim);
    return;
  }
  // Branch-free rounding (c10::BFloat16's, which tests NaN per value and does not vectorise): this ran
  // alone on one thread inside every layer.
  uint16_t* dst = reinterpret_cast<uint16_t*>(store.data_ptr<c10::BFloat16>());
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      const float* s = src + t * src_stride + h * dim;
      uint16_t* d = dst + (h * capacity + slots[t]) * dim;
      for (int64_t i = 0; i < dim; ++i) {
        uint32_t bits;
        std::memcpy(&bits, s + i, sizeof(bits));
        const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
        d[i] = static_cast<uint16_t>(s[i] != s[i] ? 0x7fc0u : rounded);
      }
    }
}

// The buffers of a call, reused by every layer and kept by the thread for its next calls (an allocation
// a buffer a layer cost about a tenth of a decode step's time outside the products, docs/BENCHMARKS.md,
// seventh part; fresh buffers a call would also be zeroed and page-faulted in at prefill sizes).
struct Workspace {
  std::vector<float> normed, packed, q, k, q_rot, k_rot, attended, gu, act, other;

  // Past this many bytes a call's buffers are given back when it ends (a long prompt's chunk).
  static constexpr size_t kKeptBytes = size_t{256} << 20;

  void trim() {
    size_t bytes = 0;
    for (const auto* b : {&normed, &packed, &q, &k, &q_rot, &k_rot, &attended, &gu, &act, &other})
      bytes += b->capacity() * sizeof(float);
    if (bytes <= kKeptBytes) return;
    for (auto* b : {&normed, &packed, &q, &k, &q_rot, &k_rot, &attended, &gu, &act, &other}) {
      b->clear();
      b->shrink_to_fit();
    }
  }
};

float* sized(std::vector<float>& buffer, int64_t count) {
  buffer.resize(static_cast<size_t>(count));
  return buffer.data();
}

// One layer: src [T, hidden] -> dst [T, hidden] (dst is not src).
void layer_forward(const float* src, float* dst, int64_t tokens, int64_t hidden, const LayerArgs& args,
                   const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_store, at::Tensor& v_store,
                   const at::Tensor* k_scales, const at::Tensor* v_scales, const at::Tensor& slots,
                   const at::Tensor& tables, const at::Tensor& table_of, const at::Tensor& positions, Workspace& ws) {
  const int64_t* ints = args.ints;
  const double* floats = args.floats;
  const int64_t heads = ints[12], kv_heads = ints[13], dim = ints[14], block_size = ints[15], window = ints[16];
  const at::ScalarType store_type = k_store.scalar_type();
  TORCH_CHECK(v_store.scalar_type() == store_type &&
                  (store_type == at::kFloat || store_type == at::kBFloat16 || store_type == at::kChar) &&
                  k_store.is_contiguous() && v_store.is_contiguous() && k_store.dim() == 3 &&
                  k_store.size(0) == kv_heads && k_store.size(2) == dim && v_store.sizes() == k_store.sizes(),
              "keel::decoder_layers: the K/V stores must be contiguous float32, bfloat16 or int8 [", kv_heads,
              ", slots, ", dim, "]");
  const bool int8 = store_type == at::kChar;
  TORCH_CHECK((k_scales != nullptr && v_scales != nullptr) == int8, "keel::decoder_layers: int8 stores, and only they, ",
              "take scales");
  for (const at::Tensor* s : {k_scales, v_scales})
    TORCH_CHECK(!int8 || (s->scalar_type() == at::kHalf && s->is_contiguous() && s->dim() == 3 &&
                          s->size(0) == kv_heads && s->size(1) == k_store.size(1) && s->size(2) == 1),
                "keel::decoder_layers: int8 stores' scales must be contiguous float16 [", kv_heads, ", slots, 1]");
  TORCH_CHECK(cos.numel() == tokens * dim && sin.numel() == tokens * dim,
              "keel::decoder_layers: cos/sin must have a head-dim row per token");
  const Projection qkv = projection(args, 0), out_proj = projection(args, 1), gate_up = projection(args, 2),
                   down = projection(args, 3);
  const int64_t width = (heads + 2 * kv_heads) * dim, inter = gate_up.out_features() / 2;
  TORCH_CHECK(qkv.in_features() == hidden && qkv.out_features() == width, "keel::decoder_layers: the q/k/v projection is ",
              qkv.out_features(), " x ", qkv.in_features(), " for ", heads, " + 2 x ", kv_heads, " heads of ", dim,
              " over ", hidden);
  TORCH_CHECK(out_proj.in_features() == heads * dim && out_proj.out_features() == hidden,
              "keel::decoder_layers: the output projection does not map ", heads * dim, " to ", hidden);
  TORCH_CHECK(gate_up.in_features() == hidden && gate_up.out_features() % 2 == 0 && down.in_features() == inter &&
                  down.out_features() == hidden,
              "keel::decoder_layers: the MLP projections do not fit ", hidden, " and ", inter);
  const float* input_norm = norm_weight(args.entry(16), hidden, "the input norm");
  const float* post_norm = norm_weight(args.entry(17), hidden, "the post-attention norm");
  const float* q_norm = norm_weight(args.entry(18), dim, "the q norm");
  const float* k_norm = norm_weight(args.entry(19), dim, "the k norm");
  TORCH_CHECK(input_norm != nullptr && post_norm != nullptr, "keel::decoder_layers: both layer norms are required");

  // Attention: norm, q/k/v, per-head norms, rotary, K/V into their slots, attention over the blocks.
  float* normed = sized(ws.normed, tokens * hidden);
  rms_norm_rows(src, input_norm, normed, tokens, hidden, static_cast<float>(floats[0]));
  float* packed = sized(ws.packed, tokens * width);
  qkv.into(normed, tokens, packed, nullptr);
  // q and k are rotated, and v written, where they lie in the packed rows; per-head norms first copy
  // q and k out (their rows must be contiguous to be normalised in place).
  // The `count` heads from channel `from` of each packed row, for rotary: (rows, token stride).
  auto heads_for_rotary = [&](int64_t from, int64_t count, const float* norm, double eps,
                              std::vector<float>& buffer) -> std::pair<const float*, int64_t> {
    if (norm == nullptr) return {packed + from, width};
    float* copied = sized(buffer, tokens * count * dim);
    heads_of(packed, tokens, width, from, count, dim, copied);
    rms_norm_rows(copied, norm, copied, tokens * count, dim, static_cast<float>(eps));
    return {copied, count * dim};
  };
  const auto [q, q_stride] = heads_for_rotary(0, heads, q_norm, floats[2], ws.q);
  const auto [k, k_stride] = heads_for_rotary(heads * dim, kv_heads, k_norm, floats[3], ws.k);
  float* q_rot = sized(ws.q_rot, tokens * heads * dim);
  float* k_rot = sized(ws.k_rot, tokens * kv_heads * dim);
  rotary_rows(q, q_stride, cos.data_ptr<float>(), sin.data_ptr<float>(), q_rot, tokens, heads, dim);
  rotary_rows(k, k_stride, cos.data_ptr<float>(), sin.data_ptr<float>(), k_rot, tokens, kv_heads, dim);
  write_rows(k_store, k_scales, k_rot, kv_heads * dim, tokens, slots.data_ptr<int64_t>());
  write_rows(v_store, v_scales, packed + (heads + kv_heads) * dim, width, tokens, slots.data_ptr<int64_t>());
  float* attended = sized(ws.attended, tokens * heads * dim);
  const c10::optional<at::Tensor> key_scales = int8 ? c10::optional<at::Tensor>(*k_scales) : c10::nullopt;
  const c10::optional<at::Tensor> value_scales = int8 ? c10::optional<at::Tensor>(*v_scales) : c10::nullopt;
  paged_attention_into(q_rot, tokens, heads, dim, k_store, v_store, key_scales, value_scales, tables, table_of,
                       positions, block_size, window, floats[4], dim, /*softcap=*/0.0, /*sinks=*/nullptr,
                       attended);

  // The residual, then the MLP: norm, gate/up, SiLU-and-multiply, down, the residual.
  out_proj.into(attended, tokens, dst, src);
  rms_norm_rows(dst, post_norm, normed, tokens, hidden, static_cast<float>(floats[1]));
  float* gu = sized(ws.gu, tokens * 2 * inter);
  gate_up.into(normed, tokens, gu, nullptr);
  float* act = sized(ws.act, tokens * inter);
  silu_mul_rows(gu, 2 * inter, gu + inter, 2 * inter, act, tokens, inter);
  down.into(act, tokens, dst, dst);
}

// For L layers, each layer's arguments in turn:
// tensors (20 a layer): the q/k/v, output, gate/up and down projections' [weight or codes, scales, mins,
// bias], then [input norm, post-attention norm, q norm, k norm] (None where absent).
// ints (17 a layer): [bits x 4, activation passes x 4, panel rows x 4 (kernels.h's panel layout, 0: rows),
// query heads, KV heads, head dim, block size, window (0: none)]. floats (5 a layer): [eps of each norm x 4, attention scale].
// k_stores, v_stores: each layer's; k_scales, v_scales: each layer's float16 scales where the stores are
// int8 (keel.serve.kv_quant), else empty. cos/sin, slots and the paged rows are the step's, shared by all.
at::Tensor decoder_layers(const at::Tensor& x_in, const c10::List<c10::optional<at::Tensor>>& tensors,
                          at::IntArrayRef ints, at::ArrayRef<double> floats, const at::Tensor& cos,
                          const at::Tensor& sin, at::TensorList k_stores, at::TensorList v_stores,
                          at::TensorList k_scales, at::TensorList v_scales, const at::Tensor& slots,
                          const at::Tensor& tables, const at::Tensor& table_of, const at::Tensor& positions) {
  const int64_t layers = static_cast<int64_t>(k_stores.size());
  const bool scaled = !k_scales.empty();
  TORCH_CHECK(static_cast<int64_t>(v_scales.size()) == static_cast<int64_t>(k_scales.size()) &&
                  (!scaled || static_cast<int64_t>(k_scales.size()) == layers),
              "keel::decoder_layers: K and V scales for every layer, or none");
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(v_stores.size()) == layers &&
                  static_cast<int64_t>(tensors.size()) == kTensors * layers &&
                  static_cast<int64_t>(ints.size()) == kInts * layers &&
                  static_cast<int64_t>(floats.size()) == kFloats * layers,
              "keel::decoder_layers: per layer 20 tensors, 17 ints, 5 floats and a K and a V store");
  TORCH_CHECK(x_in.dim() >= 2 && x_in.scalar_type() == at::kFloat && x_in.is_contiguous(),
              "keel::decoder_layers: x must be a contiguous float32 [..., T, hidden]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous(),
              "keel::decoder_layers: cos/sin must be contiguous float32");
  // The step's tokens as rows (the model's packed [1, T, hidden]); the result takes x's shape.
  at::Tensor x = x_in.view({-1, x_in.size(-1)});
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == x.size(0),
              "keel::decoder_layers: slots must be int64 [T]");
  const int64_t tokens = x.size(0), hidden = x.size(1);
  // Layers alternate between `out` and a second buffer so that the last one writes `out`; x is only read.
  at::Tensor out = at::empty_like(x);
  thread_local Workspace ws;
  float* other = sized(ws.other, layers > 1 ? tokens * hidden : 0);
  const float* src = x.data_ptr<float>();
  for (int64_t l = 0; l < layers; ++l) {
    const LayerArgs args{tensors, l, ints.data() + l * kInts, floats.data() + l * kFloats};
    // The stores are mutable views; TensorList hands out const references to the list's tensors.
    at::Tensor k_store = k_stores[l], v_store = v_stores[l];
    float* dst = (layers - 1 - l) % 2 == 0 ? out.data_ptr<float>() : other;
    const at::Tensor* k_scale = scaled ? &k_scales[l] : nullptr;
    const at::Tensor* v_scale = scaled ? &v_scales[l] : nullptr;
    layer_forward(src, dst, tokens, hidden, args, cos, sin, k_store, v_store, k_scale, v_scale, slots, tables,
                  table_of, positions, ws);
    src = dst;
  }
  ws.trim();
  return out.view(x_in.sizes());
}

// A stack's per-layer arguments held on the C++ side, for one call a step with the step's tensors only.
//
// Why: handing keel::decoder_layers its 20 tensors a layer from Python converts each list entry on
// every call (~0.25 us an entry: ~170 us a step for a 30-layer model, docs/BENCHMARKS.md); the stack's
// weights, norms and K/V stores do not change between steps, so they are converted once, here.
struct DecoderStack : torch::CustomClassHolder {
  c10::List<c10::optional<at::Tensor>> tensors;
  std::vector<int64_t> ints;
  std::vector<double> floats;
  std::vector<at::Tensor> k_stores, v_stores, k_scales, v_scales;

  DecoderStack(c10::List<c10::optional<at::Tensor>> tensors_, std::vector<int64_t> ints_, std::vector<double> floats_,
               std::vector<at::Tensor> k_stores_, std::vector<at::Tensor> v_stores_, std::vector<at::Tensor> k_scales_,
               std::vector<at::Tensor> v_scales_)
      : tensors(std::move(tensors_)),
        ints(std::move(ints_)),
        floats(std::move(floats_)),
        k_stores(std::move(k_stores_)),
        v_stores(std::move(v_stores_)),
        k_scales(std::move(k_scales_)),
        v_scales(std::move(v_scales_)) {}

  at::Tensor run(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                 const at::Tensor& tables, const at::Tensor& table_of, const at::Tensor& positions) {
    return decoder_layers(x, tensors, ints, floats, cos, sin, k_stores, v_stores, k_scales, v_scales, slots, tables,
                          table_of, positions);
  }
};

}  // namespace

}  // namespace keel

TORCH_LIBRARY_FRAGMENT(keel, m) {
  m.class_<keel::DecoderStack>("DecoderStack")
      .def(torch::init<c10::List<c10::optional<at::Tensor>>, std::vector<int64_t>, std::vector<double>,
                       std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>>())
      .def("run", &keel::DecoderStack::run);
  m.def(
      "decoder_layers(Tensor x, Tensor?[] tensors, int[] ints, float[] floats, Tensor cos, Tensor sin, "
      "Tensor(a!)[] k_stores, Tensor(b!)[] v_stores, Tensor(c!)[] k_scales, Tensor(d!)[] v_scales, Tensor slots, "
      "Tensor tables, Tensor table_of, Tensor positions) -> Tensor");
}

TORCH_LIBRARY_IMPL(keel, CPU, m) { m.impl("decoder_layers", &keel::decoder_layers); }
