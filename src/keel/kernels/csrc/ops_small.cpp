// The small operators of a decode step, fused: each is a few microseconds of arithmetic that torch
// runs as several dispatched ops (RMSNorm alone is ~6 of them). Portable loops, one pass over the
// row: at decode sizes (one row of a few thousand values) the call, not the arithmetic, is the cost.
// Arithmetic follows the torch formulas they replace (keel.model.layers), in float32 (bf16 models keep
// torch's ops, whose roundings transformers' bf16 reference shares).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "attention.h"
#include "isa.h"
#include "ops.h"

namespace keel {

// RMSNorm over the last dimension: x * rsqrt(mean(x^2) + eps) * w. The sum of squares runs in 16
// partial sums (a vector's worth, which the compiler keeps in registers), added in a fixed order, so
// the result does not depend on the machine; a single running sum could not be vectorised and made
// this a serial stretch of every decode step. 16 rows a task: at decode sizes a step's rows split
// across the threads rather than running on one.
void rms_norm_rows(const float* x, const float* w, float* out, int64_t rows, int64_t dim, float eps) {
  constexpr int64_t kLanes = 16;
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * dim;
      float* o = out + r * dim;
      float lanes[kLanes] = {};
      int64_t d = 0;
      for (; d + kLanes <= dim; d += kLanes)
        for (int64_t j = 0; j < kLanes; ++j) lanes[j] += xr[d + j] * xr[d + j];
      for (int64_t j = 0; d < dim; ++d, ++j) lanes[j] += xr[d] * xr[d];
      for (int64_t width = kLanes / 2; width > 0; width /= 2)
        for (int64_t j = 0; j < width; ++j) lanes[j] += lanes[j + width];
      const float inverse = 1.f / std::sqrt(lanes[0] / static_cast<float>(dim) + eps);
      for (d = 0; d < dim; ++d) {
        const float normed = xr[d] * inverse;
        o[d] = w != nullptr ? normed * w[d] : normed;
      }
    }
  });
}

at::Tensor fused_rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "keel::fused_rms_norm: float32 only");
  const at::Tensor xc = x.is_contiguous() ? x : x.contiguous();
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  at::Tensor out = at::empty(xc.sizes(), xc.options());
  at::Tensor w;
  if (weight.has_value()) {
    TORCH_CHECK(weight->numel() == dim, "keel::fused_rms_norm: weight of ", weight->numel(), " for ", dim);
    w = weight->scalar_type() == x.scalar_type() && weight->is_contiguous() ? *weight
                                                                             : weight->to(x.scalar_type()).contiguous();
  }
  rms_norm_rows(xc.data_ptr<float>(), w.defined() ? w.data_ptr<float>() : nullptr, out.data_ptr<float>(),
                       rows, dim, static_cast<float>(eps));
  return out;
}

// Rotate-half rotary embedding, keel.model.layers.apply_rotary: x * cos + roll(x, D/2) * signed_sin,
// x [..., S, H, D] with cos/sin [..., S, 1, D] (one row per token, shared by its heads). Token t's heads
// start at x + t * x_stride (H * D when x is contiguous; a fused q/k/v row's width when x is its q or k
// part, read in place); out is contiguous [S, H, D].
void rotary_rows(const float* x, int64_t x_stride, const float* cos, const float* sin, float* out, int64_t tokens,
                 int64_t heads, int64_t dim) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* c = cos + t * dim;
      const float* s = sin + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        const float* xr = x + t * x_stride + h * dim;
        float* o = out + (t * heads + h) * dim;
        for (int64_t d = 0; d < dim; ++d) o[d] = xr[d] * c[d] + xr[d < half ? d + half : d - half] * s[d];
      }
    }
  });
}

at::Tensor fused_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 4, "keel::fused_rotary: x must be [B, S, H, D]");
  const int64_t b = x.size(0), s = x.size(1), heads = x.size(2), dim = x.size(3);
  TORCH_CHECK(dim % 2 == 0 && cos.numel() == b * s * dim && sin.numel() == b * s * dim,
              "keel::fused_rotary: cos/sin must be [B, S, 1, D]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "keel::fused_rotary: float32 only");
  const at::Tensor xc = x.contiguous(), cc = cos.contiguous(), sc = sin.contiguous();
  at::Tensor out = at::empty_like(xc);
  rotary_rows(xc.data_ptr<float>(), heads * dim, cc.data_ptr<float>(), sc.data_ptr<float>(), out.data_ptr<float>(),
              b * s, heads, dim);
  return out;
}

// silu(gate) * up, gate and up [..., I] (rows may be strided: the halves of a fused gate_up output).
void silu_mul_rows(const float* gate, int64_t gate_stride, const float* up, int64_t up_stride, float* out,
                   int64_t rows, int64_t inter) {
  const Isa isa = current_isa();
  at::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* g = gate + r * gate_stride;
      const float* u = up + r * up_stride;
      float* o = out + r * inter;
#if defined(__x86_64__) || defined(_M_X64)
      if (isa >= kAvx512Vnni) {
        silu_mul_row_avx512(g, u, o, inter);
        continue;
      }
      if (isa >= kAvx2) {
        silu_mul_row_avx2(g, u, o, inter);
        continue;
      }
#elif defined(__aarch64__)
      if (isa >= kNeon) {
        silu_mul_row_neon(g, u, o, inter);
        continue;
      }
#endif
      for (int64_t i = 0; i < inter; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
}

at::Tensor fused_silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.sizes() == up.sizes() && gate.scalar_type() == up.scalar_type(),
              "keel::fused_silu_mul: gate and up must match");
  TORCH_CHECK(gate.scalar_type() == at::kFloat, "keel::fused_silu_mul: float32 only");
  const int64_t inter = gate.size(-1), rows = gate.numel() / inter;
  const at::Tensor g = gate.reshape({rows, inter}), u = up.reshape({rows, inter});
  TORCH_CHECK(g.stride(1) == 1 && u.stride(1) == 1, "keel::fused_silu_mul: the last dimension must be contiguous");
  at::Tensor out = at::empty(gate.sizes(), gate.options());
  silu_mul_rows(g.data_ptr<float>(), g.stride(0), u.data_ptr<float>(), u.stride(0), out.data_ptr<float>(),
                       rows, inter);
  return out;
}

}  // namespace keel

TORCH_LIBRARY_FRAGMENT(keel, m) {
  m.def("fused_rms_norm(Tensor x, Tensor? weight, float eps) -> Tensor");
  m.def("fused_rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("fused_silu_mul(Tensor gate, Tensor up) -> Tensor");
}

TORCH_LIBRARY_IMPL(keel, CPU, m) {
  m.impl("fused_rms_norm", &keel::fused_rms_norm);
  m.impl("fused_rotary", &keel::fused_rotary);
  m.impl("fused_silu_mul", &keel::fused_silu_mul);
}
