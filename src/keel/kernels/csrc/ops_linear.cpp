// Block-quantized linear layers and embedding lookups as torch operators (keel::block_linear,
// keel::block_embedding, keel::block_dequantize), and the panel layout's conversions (keel::block_panels,
// keel::block_rows).
#include <ATen/core/Tensor.h>
#include <ATen/ops/bitwise_xor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "isa.h"
#include "ops.h"

namespace keel {

namespace {

std::atomic<int> g_isa{kScalar};

// A row block's quantized activations, in one caller's buffer (quantized_bytes; at decode sizes each
// allocation is a measurable share of the product).
struct Quantized {
  int8_t *q, *q2;
  float *d, *s, *d2;
};

// K of block codes [N, *]: two values a byte for 4-bit codes.
int64_t in_features_of(const at::Tensor& codes, int64_t bits) {
  return bits == 4 ? codes.size(1) * 2 : codes.size(1);
}

BlockWeights weights_of(const at::Tensor& codes, const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                        int64_t bits, int64_t k, int64_t panel_rows) {
  TORCH_CHECK(bits == 4 || bits == 8, "keel block weights: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(panel_rows == 0 || panel_rows == kPanelRows, "keel block weights: panel_rows must be 0 (rows) or ",
              kPanelRows, ", got ", panel_rows);
  TORCH_CHECK(k % kBlock == 0, "keel block weights: in_features ", k, " is not a multiple of ", kBlock);
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous(), "keel block weights: codes must be a contiguous [N, *] tensor");
  TORCH_CHECK(codes.scalar_type() == (bits == 4 ? at::kByte : at::kChar), "keel block weights: ", bits,
              "-bit codes must be ", bits == 4 ? "uint8" : "int8");
  const int64_t n = codes.size(0);
  TORCH_CHECK(codes.size(1) == (bits == 4 ? k / 2 : k), "keel block weights: codes of width ", codes.size(1),
              " for in_features ", k);
  const bool half_blocks = bits == 8 && scales.dim() == 2 && scales.size(1) == 2 * (k / kBlock);
  TORCH_CHECK(scales.is_contiguous() && scales.dim() == 2 && scales.size(0) == n && scales.size(1) > 0 &&
                  (half_blocks || (k / kBlock) % scales.size(1) == 0),
              "keel block weights: scales must be [", n, ", G] with G dividing ", k / kBlock, " (blocks of ", kBlock,
              "), or G = ", 2 * (k / kBlock), " for 8-bit codes (half blocks)");
  TORCH_CHECK(!(half_blocks && mins.has_value()), "keel block weights: half-block scales take no mins");
  const int64_t group_blocks = half_blocks ? 1 : (k / kBlock) / scales.size(1);
  TORCH_CHECK((group_blocks & (group_blocks - 1)) == 0 || scales.size(1) == 1,
              "keel block weights: a scale covers a power of two of blocks, or the whole row");
  const bool half = scales.scalar_type() == at::kHalf;
  TORCH_CHECK(half || scales.scalar_type() == at::kFloat, "keel block weights: scales must be float16 or float32");
  const void* min_ptr = nullptr;
  if (mins.has_value()) {
    TORCH_CHECK(mins->scalar_type() == scales.scalar_type() && mins->is_contiguous() && mins->numel() == scales.numel(),
                "keel block weights: mins must match the scales");
    min_ptr = mins->data_ptr();
  }
  return BlockWeights{static_cast<int>(bits), static_cast<const uint8_t*>(codes.data_ptr()), codes.size(1),
                      scales.data_ptr(), min_ptr, half, k / kBlock, group_blocks, half_blocks, n,
                      static_cast<int>(panel_rows)};
}

// Each panel's [rows_p, units] slice of t [N, units] transposed (to_panels), or back: kernels.h's panel
// layout, for any unit (4 bytes of codes, a float16 or float32 scale).
at::Tensor transpose_panels(const at::Tensor& t, bool to_panels) {
  const int64_t n = t.size(0), units = t.size(1);
  at::Tensor out = at::empty_like(t);
  for (int64_t p0 = 0; p0 < n; p0 += kPanelRows) {
    const int64_t rows = std::min<int64_t>(kPanelRows, n - p0);
    if (to_panels) {
      out.narrow(0, p0, rows).view({units, rows}).copy_(t.narrow(0, p0, rows).t());
    } else {
      out.narrow(0, p0, rows).copy_(t.narrow(0, p0, rows).view({units, rows}).t());
    }
  }
  return out;
}

// 8-bit codes with the panel layout's +128 turned on, or off (the XOR is its own inverse); 4-bit codes
// as they are.
at::Tensor toggle_code_offset(const at::Tensor& codes, int64_t bits) {
  return bits == 8 ? at::bitwise_xor(codes.view(at::kByte), 0x80).view(at::kChar) : codes;
}

// Codes, scales and mins moved into the panel layout (to_panels) or back to rows: [codes, scales, mins?].
// Codes move as 4-byte units; the +128 is a byte-wise XOR, so it commutes with the move.
std::vector<at::Tensor> transposed_blocks(const at::Tensor& codes, const at::Tensor& scales,
                                          const c10::optional<at::Tensor>& mins, int64_t bits, bool to_panels) {
  const at::Tensor moved = transpose_panels(codes.view(at::kInt), to_panels).view(codes.scalar_type());
  std::vector<at::Tensor> out{toggle_code_offset(moved, bits), transpose_panels(scales, to_panels)};
  if (mins.has_value()) out.push_back(transpose_panels(*mins, to_panels));
  return out;
}

// The row layout of weights in either layout: [codes, scales, mins?].
std::vector<at::Tensor> rows_of(const at::Tensor& codes, const at::Tensor& scales,
                                const c10::optional<at::Tensor>& mins, int64_t bits, int64_t panel_rows) {
  if (panel_rows != 0) return transposed_blocks(codes, scales, mins, bits, false);
  std::vector<at::Tensor> out{codes, scales};
  if (mins.has_value()) out.push_back(*mins);
  return out;
}

c10::optional<at::Tensor> mins_in(const std::vector<at::Tensor>& tensors) {
  return tensors.size() > 2 ? c10::optional<at::Tensor>(tensors[2]) : c10::nullopt;
}

// The order the chosen kernel reads a row's activation codes in (kernels.h).
enum class Order { kNatural, kPairs, kQuads };

// Bytes of one product's quantized activations (m rows of k): scales and sums, then the codes.
int64_t quantized_bytes(int64_t m, int64_t k, bool two_passes) {
  const int64_t blocks = m * (k / kBlock);
  return blocks * (two_passes ? 3 : 2) * static_cast<int64_t>(sizeof(float)) + m * k * (two_passes ? 2 : 1);
}

// Where a product wants each activation block's sum of codes (the stored-panel kernel's `offsets`,
// kernels.h): out [passes, m, blocks, 2], each sum times `unit`, the block's two halves apart with
// `halves` (else the whole block's sum first and the second half's after it); out null: none.
struct CodeSums {
  int32_t* out = nullptr;
  int32_t unit = 0;
  bool halves = false;
};

// One row's blocks of codes q [blocks * 32] into o [blocks, 2] (CodeSums).
void code_sums_of_row(const int8_t* q, int64_t blocks, const CodeSums& sums, int32_t* o) {
  for (int64_t b = 0; b < blocks; ++b) {
    int32_t lo = 0, hi = 0;
    for (int j = 0; j < kBlock / 2; ++j) {
      lo += q[b * kBlock + j];
      hi += q[b * kBlock + kBlock / 2 + j];
    }
    o[2 * b] = sums.unit * (sums.halves ? lo : lo + hi);
    o[2 * b + 1] = sums.unit * hi;
  }
}

// x [m, k] float32 quantized into `storage` (quantized_bytes of it, float-aligned); with sums.out, the
// codes' sums too (natural order only), each row's while it is in cache on its thread.
Quantized quantize_activations_into(const float* x, int64_t m, int64_t k, bool two_passes, Order order,
                                    uint8_t* storage, const CodeSums& sums = {}) {
  const int64_t blocks = m * (k / kBlock);
  const int64_t floats = blocks * (two_passes ? 3 : 2);
  Quantized out;
  float* base = reinterpret_cast<float*>(storage);  // floats first: aligned
  out.d = base;
  out.s = base + blocks;
  out.d2 = two_passes ? base + 2 * blocks : nullptr;
  out.q = reinterpret_cast<int8_t*>(base + floats);
  out.q2 = two_passes ? out.q + m * k : nullptr;
  int8_t *q = out.q, *q2 = out.q2;
  float *d = out.d, *s = out.s, *d2 = out.d2;
  [[maybe_unused]] const Isa isa = current_isa();  // the portable loop alone off x86-64
  TORCH_CHECK(sums.out == nullptr || order == Order::kNatural, "keel: code sums are of natural-order rows");
  const int64_t row_blocks = k / kBlock;
  auto sum_row = [&](int64_t r) {
    if (sums.out == nullptr) return;
    code_sums_of_row(q + r * k, row_blocks, sums, sums.out + 2 * r * row_blocks);
    if (q2 != nullptr) code_sums_of_row(q2 + r * k, row_blocks, sums, sums.out + 2 * (m + r) * row_blocks);
  };
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t qo = r * k, so = r * (k / kBlock);
#if defined(__x86_64__) || defined(_M_X64)
      if (isa >= kAvx2) {
        quantize_row_avx2(x + qo, k, q + qo, d + so, s + so, q2 ? q2 + qo : nullptr, d2 ? d2 + so : nullptr);
        if (order == Order::kPairs) {
          interleave_pairs_avx2(q + qo, k);
          if (q2) interleave_pairs_avx2(q2 + qo, k);
        } else if (order == Order::kQuads) {
          interleave_quads_avx512(q + qo, k);
          if (q2) interleave_quads_avx512(q2 + qo, k);
        }
        sum_row(r);
        continue;
      }
#endif
      quantize_row_scalar(x + qo, k, q + qo, d + so, s + so, q2 ? q2 + qo : nullptr, d2 ? d2 + so : nullptr);
      sum_row(r);
    }
  });
  return out;
}


// The bias, then the input's dtype and leading shape.
at::Tensor finish_linear(at::Tensor& out, const at::Tensor& x, const c10::optional<at::Tensor>& bias, int64_t n) {
  if (bias.has_value()) out.add_(*bias);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return out.to(x.scalar_type()).view(shape);
}

}  // namespace

#if defined(__x86_64__) || defined(_M_X64)  // the panel kernels are x86-64 kernels
namespace {

// Weights in the panel layout, from the AVX2 level: every row count through a stored-panel kernel.
// x [m, k] float32 -> out [m, n] (the product, no bias); the activations are quantized into `scratch`.
void stored_panel_product(const float* x, int64_t m, int64_t k, const BlockWeights& w, int64_t passes, float* out,
                          std::vector<uint8_t>& scratch) {
  const int64_t n = w.rows, blocks = k / kBlock;
  scratch.resize(static_cast<size_t>(quantized_bytes(m, k, passes == 2)));
  // 8-bit codes at the VNNI level: 128 x each activation block's sum of codes, per half; 4-bit codes with
  // mins over expanded panels: 8 x it, for the panels centred on 8 (kernels.h). Summed as each row is
  // quantized.
  const bool vnni = current_isa() >= kAvx512Vnni;
  const bool centring = w.bits == 4 && w.mins != nullptr && m >= kExpandRows;
  std::vector<int32_t> offsets((w.bits == 8 && vnni) || centring ? static_cast<size_t>(2 * passes * m * blocks) : 0);
  int32_t* const sums = offsets.empty() ? nullptr : offsets.data();
  const Quantized qa = quantize_activations_into(x, m, k, passes == 2, Order::kNatural, scratch.data(),
                                                 CodeSums{sums, w.bits == 8 ? 128 : 8, w.half_block_scales});
  BlockActivations a{qa.q, qa.d, qa.s, k, blocks, qa.q2, qa.d2};
  a.m = m;
  // AMX tiles take whole tiles of activation rows, the VNNI kernel the rest.
  const bool tiles = current_isa() >= kAmx;
  const int64_t tiled = tiles ? m / kAmxRows * kAmxRows : 0;
  at::parallel_for(0, (n + kPanelRows - 1) / kPanelRows, 1, [&](int64_t p0, int64_t p1) {
    if (!vnni) {
      block_gemm_stored_avx2(w, p0, p1, a, sums, 0, m, out, n);
      return;
    }
    if (tiled > 0) block_gemm_stored_amx(w, p0, p1, a, sums, 0, tiled, out, n);
    if (tiled < m) block_gemm_stored_avx512(w, p0, p1, a, sums, tiled, m, out, n);
  });
}

at::Tensor stored_panel_linear(const at::Tensor& x, const at::Tensor& x2, const BlockWeights& w,
                               const c10::optional<at::Tensor>& bias, int64_t passes) {
  const int64_t m = x2.size(0), k = x2.size(1);
  at::Tensor out = at::empty({m, w.rows}, x2.options());
  std::vector<uint8_t> scratch;
  stored_panel_product(x2.data_ptr<float>(), m, k, w, passes, out.data_ptr<float>(), scratch);
  return finish_linear(out, x, bias, w.rows);
}

}  // namespace
#endif

namespace {

// Weights in the row layout, at any level: x [m, k] float32 -> out [m, n] (the product, no bias); the
// activations are quantized into `scratch`.
void row_layout_product(const float* x, int64_t m, int64_t k, const BlockWeights& w, int64_t passes, float* out,
                        std::vector<uint8_t>& scratch) {
  const int64_t n = w.rows;
  const Isa isa = current_isa();
  // Many rows: the panel kernels (4-bit from AVX2, 8-bit too from VNNI); a few: the row kernels.
  const bool panels = m >= kPanelMinRows && (isa >= kAvx512Vnni || (isa >= kAvx2 && w.bits == 4));
  const bool vnni = isa >= kAvx512Vnni;
  Order order = Order::kNatural;  // the panels and 8-bit codes read it; 4-bit row kernels read it reordered
  if (w.bits == 4 && !panels && isa >= kAvx2) order = vnni ? Order::kQuads : Order::kPairs;
  scratch.resize(static_cast<size_t>(quantized_bytes(m, k, passes == 2)));
  const Quantized qa = quantize_activations_into(x, m, k, passes == 2, order, scratch.data());
  const BlockActivations a{qa.q, qa.d, qa.s, k, k / kBlock, qa.q2, qa.d2};
  float* o = out;
#if defined(__x86_64__) || defined(_M_X64)
  if (panels) {
    // Split the output features by panels (8 rows at AVX2, 16 at VNNI): each thread packs and streams its own.
    const int64_t rows = vnni ? 16 : 8;
    at::parallel_for(0, (n + rows - 1) / rows, 1, [&](int64_t t0, int64_t t1) {
      if (vnni) {
        block_gemm_panels_avx512(w, t0 * rows, std::min(n, t1 * rows), a, 0, m, o, n);
      } else {
        block_gemm_panels_avx2(w, t0 * rows, std::min(n, t1 * rows), a, 0, m, o, n);
      }
    });
    return;
  }
#endif
  // Split the output features: each thread streams its own rows of the weights once.
  at::parallel_for(0, n, 16, [&](int64_t n0, int64_t n1) {
#if defined(__x86_64__) || defined(_M_X64)
    if (vnni) {
      block_gemm_avx512(w, n0, n1, a, 0, m, o, n);
      return;
    }
    if (isa >= kAvx2) {
      block_gemm_avx2(w, n0, n1, a, 0, m, o, n);
      return;
    }
#elif defined(__aarch64__)
    if (isa >= kNeonDot) {
      block_gemm_neon_dotprod(w, n0, n1, a, 0, m, o, n);
      return;
    }
    if (isa >= kNeon) {
      block_gemm_neon(w, n0, n1, a, 0, m, o, n);
      return;
    }
#endif
    block_gemm_scalar(w, n0, n1, a, 0, m, o, n);
  });
}

}  // namespace

at::Tensor block_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& mins, int64_t bits, const c10::optional<at::Tensor>& bias,
                        int64_t passes, int64_t panel_rows) {
  TORCH_CHECK(passes == 1 || passes == 2, "keel::block_linear: activations take 1 or 2 passes, got ", passes);
  const int64_t k = x.size(-1);
  const BlockWeights w = weights_of(codes, scales, mins, bits, k, panel_rows);
  const int64_t n = codes.size(0);
  at::Tensor x2 = x.reshape({-1, k}).to(at::kFloat).contiguous();
  const int64_t m = x2.size(0);
  if (panel_rows != 0) {
#if defined(__x86_64__) || defined(_M_X64)
    if (current_isa() >= kAvx2) return stored_panel_linear(x, x2, w, bias, passes);
#endif
    // The portable level (tests running every level on one model): the row layout, converted per call.
    const std::vector<at::Tensor> rows = rows_of(codes, scales, mins, bits, panel_rows);
    return block_linear(x, rows[0], rows[1], mins_in(rows), bits, bias, passes, 0);
  }
  at::Tensor out = at::empty({m, n}, x2.options());
  std::vector<uint8_t> scratch;
  row_layout_product(x2.data_ptr<float>(), m, k, w, passes, out.data_ptr<float>(), scratch);
  return finish_linear(out, x, bias, n);
}

// out = residual + (y + bias), or y + bias (copied into out where y is not out), rows split among threads
// for prefill-sized products (one thread would make these passes a tenth of a large step).
void finish_rows(float* y, const float* bias, const float* residual, float* out, int64_t m, int64_t n) {
  if (bias == nullptr && residual == nullptr && y == out) return;
  at::parallel_for(0, m, std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(n, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* yr = y + r * n;
      if (bias != nullptr)
        for (int64_t j = 0; j < n; ++j) yr[j] += bias[j];
      if (residual != nullptr) {
        for (int64_t j = 0; j < n; ++j) out[r * n + j] = residual[r * n + j] + yr[j];
      } else if (y != out) {
        std::memcpy(out + r * n, yr, sizeof(float) * n);
      }
    }
  });
}

void block_linear_into(const float* x, int64_t m, int64_t k, const at::Tensor& codes, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& mins, int64_t bits, const c10::optional<at::Tensor>& bias,
                       int64_t passes, int64_t panel_rows, float* out, const float* residual) {
  TORCH_CHECK(passes == 1 || passes == 2, "keel::block_linear: activations take 1 or 2 passes, got ", passes);
  const BlockWeights w = weights_of(codes, scales, mins, bits, k, panel_rows);
  const int64_t n = w.rows;
  const bool float_bias = bias.has_value() && bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                          bias->numel() == n;
  bool stored = false;  // the panel layout's kernel reads these weights as they lie
#if defined(__x86_64__) || defined(_M_X64)
  stored = panel_rows != 0 && current_isa() >= kAvx2;
#endif
  if ((panel_rows == 0 || stored) && (!bias.has_value() || float_bias)) {
    // The product into `out` itself, or beside it when a residual is added; the bias first, as
    // block_linear adds it.
    thread_local std::vector<uint8_t> scratch;
    thread_local std::vector<float> product;
    float* y = out;
    if (residual != nullptr) {
      product.resize(static_cast<size_t>(m * n));
      y = product.data();
    }
#if defined(__x86_64__) || defined(_M_X64)
    if (stored) stored_panel_product(x, m, k, w, passes, y, scratch);
#endif
    if (!stored) row_layout_product(x, m, k, w, passes, y, scratch);
    finish_rows(y, float_bias ? bias->data_ptr<float>() : nullptr, residual, out, m, n);
    return;
  }
  // Panels at the portable level (converted to rows per call), or a bias of another dtype: the operator's
  // own path, its result copied or added.
  const at::Tensor x2 = at::from_blob(const_cast<float*>(x), {m, k}, at::TensorOptions().dtype(at::kFloat));
  at::Tensor y = block_linear(x2, codes, scales, mins, bits, bias, passes, panel_rows).contiguous();
  finish_rows(y.data_ptr<float>(), nullptr, residual, out, m, n);
}

namespace {

template <typename Scale>
void dequantize_rows(const BlockWeights& w, const int64_t* rows, int64_t count, float* out, int64_t k) {
  const Scale* sc = static_cast<const Scale*>(w.scales);
  const Scale* mn = static_cast<const Scale*>(w.mins);
  [[maybe_unused]] const Isa isa = current_isa();  // the portable loop alone off x86-64
  at::parallel_for(0, count, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = rows == nullptr ? i : rows[i];
      const uint8_t* row = w.codes + r * w.row_bytes;
      float* dst = out + i * k;
#if defined(__x86_64__) || defined(_M_X64)
      if (isa >= kAvx2) {
        dequantize_row_avx2(w, r, dst);
        continue;
      }
#endif
      for (int64_t b = 0; b < w.blocks; ++b) {
        float* db = dst + b * kBlock;
        if (w.half_block_scales) {  // 8-bit codes, no mins
          const int8_t* c = reinterpret_cast<const int8_t*>(row) + b * kBlock;
          const float d0 = static_cast<float>(sc[r * 2 * w.blocks + 2 * b]);
          const float d1 = static_cast<float>(sc[r * 2 * w.blocks + 2 * b + 1]);
          for (int j = 0; j < kBlock; ++j) db[j] = static_cast<float>(c[j]) * (j < kBlock / 2 ? d0 : d1);
          continue;
        }
        const int64_t g = r * (w.blocks / w.group_blocks) + b / w.group_blocks;
        const float d = static_cast<float>(sc[g]);
        const float mv = mn != nullptr ? static_cast<float>(mn[g]) : 0.f;
        if (w.bits == 4) {
          const uint8_t* c = row + b * (kBlock / 2);
          for (int j = 0; j < kBlock / 2; ++j) {
            db[j] = static_cast<float>(c[j] & 0x0f) * d + mv;
            db[j + kBlock / 2] = static_cast<float>(c[j] >> 4) * d + mv;
          }
        } else {
          const int8_t* c = reinterpret_cast<const int8_t*>(row) + b * kBlock;
          for (int j = 0; j < kBlock; ++j) db[j] = static_cast<float>(c[j]) * d + mv;
        }
      }
    }
  });
}

at::Tensor dequantize_selected(const at::Tensor& codes, const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                               int64_t bits, const int64_t* rows, int64_t count) {
  const int64_t k = in_features_of(codes, bits);
  const BlockWeights w = weights_of(codes, scales, mins, bits, k, 0);
  at::Tensor out = at::empty({count, k}, scales.options().dtype(at::kFloat));
  if (w.scale_half) {
    dequantize_rows<c10::Half>(w, rows, count, out.data_ptr<float>(), k);
  } else {
    dequantize_rows<float>(w, rows, count, out.data_ptr<float>(), k);
  }
  return out;
}

// Rows `ids` of t [N, units] in the panel layout, in the row layout [count, units].
at::Tensor rows_from_panels(const at::Tensor& t, const at::Tensor& ids) {
  const int64_t n = t.size(0), units = t.size(1), count = ids.numel(), size = t.element_size();
  at::Tensor out = at::empty({count, units}, t.options());
  const char* src = static_cast<const char*>(t.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  const int64_t* rows = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) {
    const int64_t p = rows[i] / kPanelRows, j = rows[i] % kPanelRows;
    const int64_t rows_p = std::min<int64_t>(kPanelRows, n - p * kPanelRows);
    const char* panel = src + p * kPanelRows * units * size;
    for (int64_t u = 0; u < units; ++u) std::memcpy(dst + (i * units + u) * size, panel + (u * rows_p + j) * size, size);
  }
  return out;
}

at::Tensor block_dequantize(const at::Tensor& codes, const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                            int64_t bits, int64_t panel_rows) {
  const std::vector<at::Tensor> rows = rows_of(codes, scales, mins, bits, panel_rows);
  return dequantize_selected(rows[0], rows[1], mins_in(rows), bits, nullptr, codes.size(0));
}

at::Tensor block_embedding(const at::Tensor& ids, const at::Tensor& codes, const at::Tensor& scales,
                           const c10::optional<at::Tensor>& mins, int64_t bits, at::ScalarType dtype,
                           int64_t panel_rows) {
  const at::Tensor flat = ids.reshape({-1}).to(at::kLong).contiguous();
  const int64_t* rows = flat.data_ptr<int64_t>();
  const int64_t vocab = codes.size(0);
  for (int64_t i = 0; i < flat.numel(); ++i)
    TORCH_CHECK(rows[i] >= 0 && rows[i] < vocab, "keel::block_embedding: token id ", rows[i], " outside 0..",
                vocab - 1);
  at::Tensor out;
  if (panel_rows == 0) {
    out = dequantize_selected(codes, scales, mins, bits, rows, flat.numel());
  } else {  // the step's rows gathered into the row layout, then dequantized as rows 0..count-1
    TORCH_CHECK(panel_rows == kPanelRows, "keel::block_embedding: panel_rows must be 0 or ", kPanelRows);
    const at::Tensor c = rows_from_panels(codes.view(at::kInt), flat).view(codes.scalar_type());
    if (bits == 8) {  // the panel layout's +128 off, in place on the gathered rows (toggle_code_offset's XOR)
      uint8_t* byte = static_cast<uint8_t*>(c.data_ptr());
      for (int64_t i = 0; i < c.numel(); ++i) byte[i] ^= 0x80;
    }
    c10::optional<at::Tensor> m;
    if (mins.has_value()) m = rows_from_panels(*mins, flat);
    out = dequantize_selected(c, rows_from_panels(scales, flat), m, bits, nullptr, flat.numel());
  }
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(out.size(1));
  return out.to(dtype).view(shape);
}

}  // namespace

std::vector<at::Tensor> block_panels(const at::Tensor& codes, const at::Tensor& scales,
                                     const c10::optional<at::Tensor>& mins, int64_t bits) {
  const int64_t k = in_features_of(codes, bits);
  weights_of(codes, scales, mins, bits, k, 0);  // the checks
  return transposed_blocks(codes, scales, mins, bits, true);
}

std::vector<at::Tensor> block_rows(const at::Tensor& codes, const at::Tensor& scales,
                                   const c10::optional<at::Tensor>& mins, int64_t bits) {
  const int64_t k = in_features_of(codes, bits);
  weights_of(codes, scales, mins, bits, k, kPanelRows);
  return rows_of(codes, scales, mins, bits, kPanelRows);
}

bool amx_ready() {
#if defined(__x86_64__) || defined(_M_X64)
  static const bool permitted = amx_permitted();
  return permitted;
#else
  return false;
#endif
}

Isa current_isa() { return static_cast<Isa>(g_isa.load(std::memory_order_relaxed)); }

bool neon_dotprod_ready() {
#if defined(__aarch64__)
  static const bool supported = neon_dotprod_supported();
  return supported;
#else
  return false;
#endif
}

int64_t set_kernel_isa(int64_t level) {
  TORCH_CHECK(level >= kScalar && level <= kNeonDot, "keel::set_kernel_isa: unknown level ", level);
#if defined(__x86_64__) || defined(_M_X64)
  TORCH_CHECK(level <= kAmx, "keel::set_kernel_isa: level ", level, " is not an x86-64 level");
  TORCH_CHECK(level < kAmx || amx_ready(), "keel::set_kernel_isa: this process was not granted the AMX tile state");
#elif defined(__aarch64__)
  TORCH_CHECK(level == kScalar || level >= kNeon, "keel::set_kernel_isa: level ", level, " is not an aarch64 level");
  TORCH_CHECK(level < kNeonDot || neon_dotprod_ready(), "keel::set_kernel_isa: this CPU has no SDOT (asimddp)");
#else
  TORCH_CHECK(level == kScalar, "keel::set_kernel_isa: only the portable level exists on this architecture");
#endif
  return g_isa.exchange(static_cast<int>(level));
}

}  // namespace keel

TORCH_LIBRARY_FRAGMENT(keel, m) {
  m.def("set_kernel_isa(int level) -> int", &keel::set_kernel_isa);
  m.def("amx_ready() -> bool", &keel::amx_ready);
  m.def("neon_dotprod_ready() -> bool", &keel::neon_dotprod_ready);
  m.def(
      "block_linear(Tensor x, Tensor codes, Tensor scales, Tensor? mins, int bits, Tensor? bias, int passes=1, "
      "int panel_rows=0) -> Tensor");
  m.def("block_dequantize(Tensor codes, Tensor scales, Tensor? mins, int bits, int panel_rows=0) -> Tensor");
  m.def(
      "block_embedding(Tensor ids, Tensor codes, Tensor scales, Tensor? mins, int bits, ScalarType dtype, "
      "int panel_rows=0) -> Tensor");
  m.def("block_panels(Tensor codes, Tensor scales, Tensor? mins, int bits) -> Tensor[]");
  m.def("block_rows(Tensor codes, Tensor scales, Tensor? mins, int bits) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(keel, CPU, m) {
  m.impl("block_linear", &keel::block_linear);
  m.impl("block_dequantize", &keel::block_dequantize);
  m.impl("block_embedding", &keel::block_embedding);
  m.impl("block_panels", &keel::block_panels);
  m.impl("block_rows", &keel::block_rows);
}
