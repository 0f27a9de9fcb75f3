// The small operators of a decode step, fused: each is a few microseconds of arithmetic that torch
// runs as several dispatched ops (RMSNorm alone is ~6 of them). Portable loops, one pass over the
// row: at decode sizes (one row of a few thousand values) the call, not the arithmetic, is the cost.
// Arithmetic follows the torch formulas they replace (keel.model.layers): float32 statistics, bf16
// results rounded where torch rounds them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>

namespace keel {

namespace {

template <typename T>
inline float to_float(T v) {
  return static_cast<float>(v);
}

inline float round_bf16(float v) { return static_cast<float>(c10::BFloat16(v)); }

// RMSNorm over the last dimension: float32 input: x * rsqrt(mean(x^2) + eps) * w; bf16 input (the
// HF formula): normalise in float32, round to bf16, then multiply by the bf16 weight.
template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * dim;
      T* o = out + r * dim;
      float sum = 0.f;
      for (int64_t d = 0; d < dim; ++d) {
        const float v = to_float(xr[d]);
        sum += v * v;
      }
      const float inverse = 1.f / std::sqrt(sum / static_cast<float>(dim) + eps);
      for (int64_t d = 0; d < dim; ++d) {
        const float normed = to_float(xr[d]) * inverse;
        if constexpr (std::is_same_v<T, float>) {
          o[d] = w != nullptr ? normed * w[d] : normed;
        } else {
          const float rounded = round_bf16(normed);
          o[d] = static_cast<T>(w != nullptr ? rounded * to_float(w[d]) : rounded);
        }
      }
    }
  });
}

at::Tensor fused_rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& weight, double eps) {
  const at::Tensor xc = x.is_contiguous() ? x : x.contiguous();
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  at::Tensor out = at::empty(xc.sizes(), xc.options());
  at::Tensor w;
  if (weight.has_value()) {
    TORCH_CHECK(weight->numel() == dim, "keel::fused_rms_norm: weight of ", weight->numel(), " for ", dim);
    w = weight->scalar_type() == x.scalar_type() && weight->is_contiguous() ? *weight
                                                                             : weight->to(x.scalar_type()).contiguous();
  }
  if (x.scalar_type() == at::kFloat) {
    rms_norm_rows<float>(xc.data_ptr<float>(), w.defined() ? w.data_ptr<float>() : nullptr, out.data_ptr<float>(),
                         rows, dim, static_cast<float>(eps));
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "keel::fused_rms_norm: float32 or bfloat16 only");
    using B = c10::BFloat16;
    rms_norm_rows<B>(xc.data_ptr<B>(), w.defined() ? w.data_ptr<B>() : nullptr, out.data_ptr<B>(), rows, dim,
                     static_cast<float>(eps));
  }
  return out;
}

// Rotate-half rotary embedding, keel.model.layers.apply_rotary: x * cos + roll(x, D/2) * signed_sin,
// x [..., S, H, D] with cos/sin [..., S, 1, D] (one row per token, shared by its heads).
template <typename T>
void rotary_rows(const T* x, const T* cos, const T* sin, T* out, int64_t tokens, int64_t heads, int64_t dim) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const T* c = cos + t * dim;
      const T* s = sin + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xr = x + (t * heads + h) * dim;
        T* o = out + (t * heads + h) * dim;
        for (int64_t d = 0; d < dim; ++d) {
          const float rolled = to_float(xr[d < half ? d + half : d - half]);
          if constexpr (std::is_same_v<T, float>) {
            o[d] = xr[d] * c[d] + rolled * s[d];
          } else {  // bf16 ops round each product and the sum
            o[d] = static_cast<T>(round_bf16(to_float(xr[d]) * to_float(c[d])) +
                                  round_bf16(rolled * to_float(s[d])));
          }
        }
      }
    }
  });
}

at::Tensor fused_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 4, "keel::fused_rotary: x must be [B, S, H, D]");
  const int64_t b = x.size(0), s = x.size(1), heads = x.size(2), dim = x.size(3);
  TORCH_CHECK(dim % 2 == 0 && cos.numel() == b * s * dim && sin.numel() == b * s * dim,
              "keel::fused_rotary: cos/sin must be [B, S, 1, D]");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "keel::fused_rotary: cos/sin must be in x's dtype");
  const at::Tensor xc = x.contiguous(), cc = cos.contiguous(), sc = sin.contiguous();
  at::Tensor out = at::empty_like(xc);
  if (x.scalar_type() == at::kFloat) {
    rotary_rows<float>(xc.data_ptr<float>(), cc.data_ptr<float>(), sc.data_ptr<float>(), out.data_ptr<float>(),
                       b * s, heads, dim);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "keel::fused_rotary: float32 or bfloat16 only");
    using B = c10::BFloat16;
    rotary_rows<B>(xc.data_ptr<B>(), cc.data_ptr<B>(), sc.data_ptr<B>(), out.data_ptr<B>(), b * s, heads, dim);
  }
  return out;
}

// silu(gate) * up of a fused gate_up projection's output [..., 2I] -> [..., I].
template <typename T>
void silu_mul_rows(const T* x, T* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = x + r * 2 * inter;
      const T* u = g + inter;
      T* o = out + r * inter;
      for (int64_t i = 0; i < inter; ++i) {
        const float gv = to_float(g[i]);
        const float silu = gv / (1.f + std::exp(-gv));
        if constexpr (std::is_same_v<T, float>) {
          o[i] = silu * u[i];
        } else {
          o[i] = static_cast<T>(round_bf16(silu) * to_float(u[i]));
        }
      }
    }
  });
}

at::Tensor fused_silu_mul(const at::Tensor& gate_up) {
  const int64_t two = gate_up.size(-1), rows = gate_up.numel() / two;
  TORCH_CHECK(two % 2 == 0, "keel::fused_silu_mul: the last dimension must be gate then up");
  const at::Tensor xc = gate_up.contiguous();
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = two / 2;
  at::Tensor out = at::empty(shape, xc.options());
  if (xc.scalar_type() == at::kFloat) {
    silu_mul_rows<float>(xc.data_ptr<float>(), out.data_ptr<float>(), rows, two / 2);
  } else {
    TORCH_CHECK(xc.scalar_type() == at::kBFloat16, "keel::fused_silu_mul: float32 or bfloat16 only");
    using B = c10::BFloat16;
    silu_mul_rows<B>(xc.data_ptr<B>(), out.data_ptr<B>(), rows, two / 2);
  }
  return out;
}

}  // namespace

}  // namespace keel

TORCH_LIBRARY_FRAGMENT(keel, m) {
  m.def("fused_rms_norm(Tensor x, Tensor? weight, float eps) -> Tensor");
  m.def("fused_rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("fused_silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(keel, CPU, m) {
  m.impl("fused_rms_norm", &keel::fused_rms_norm);
  m.impl("fused_rotary", &keel::fused_rotary);
  m.impl("fused_silu_mul", &keel::fused_silu_mul);
}
