// The tensor-level functions behind keel's operators, for the operators that compose them
// (keel::decoder_layers calls the same code the separate operators run, so both paths agree bit for bit).
#pragma once

#include <ATen/core/Tensor.h>

namespace keel {

at::Tensor block_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& mins, int64_t bits, const c10::optional<at::Tensor>& bias,
                        int64_t passes, int64_t panel_rows);

// block_linear on x [m, k] float32 into out [m, N], or out = residual + it (the bias added to it first;
// residual may be out), with no tensor allocated where the weights' layout runs at this level (rows;
// panels from the AVX2 level); the same values as block_linear and the residual added after it.
void block_linear_into(const float* x, int64_t m, int64_t k, const at::Tensor& codes, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& mins, int64_t bits, const c10::optional<at::Tensor>& bias,
                       int64_t passes, int64_t panel_rows, float* out, const float* residual);

// out = residual + (y + bias), or y + bias (copied into out where y is not out), rows in parallel.
void finish_rows(float* y, const float* bias, const float* residual, float* out, int64_t m, int64_t n);

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& keys, const c10::optional<at::Tensor>& values,
                           const c10::optional<at::Tensor>& key_scales, const c10::optional<at::Tensor>& value_scales,
                           const at::Tensor& tables, const c10::optional<at::Tensor>& table_of,
                           const at::Tensor& positions, int64_t block_size, int64_t window, double scale,
                           int64_t v_dim, double softcap, const c10::optional<at::Tensor>& sinks,
                           const c10::optional<at::Tensor>& alibi);

// paged_attention on q [rows, heads, dim] float32 into out [rows, heads, v_dim] (no tensor allocated); sinks and
// alibi (slopes): null or [heads] float32 (the caller checks them).
void paged_attention_into(const float* q, int64_t rows, int64_t heads, int64_t dim, const at::Tensor& keys,
                          const c10::optional<at::Tensor>& values, const c10::optional<at::Tensor>& key_scales,
                          const c10::optional<at::Tensor>& value_scales, const at::Tensor& tables,
                          const c10::optional<at::Tensor>& table_of, const at::Tensor& positions, int64_t block_size,
                          int64_t window, double scale, int64_t v_dim, double softcap, const float* sinks,
                          float* out, const float* alibi = nullptr);

// Row loops of the fused small operators (ops_small.cpp), float32, parallel over rows.
void rms_norm_rows(const float* x, const float* w, float* out, int64_t rows, int64_t dim, float eps);
void rotary_rows(const float* x, int64_t x_stride, const float* cos, const float* sin, float* out, int64_t tokens,
                 int64_t heads, int64_t dim);
void silu_mul_rows(const float* gate, int64_t gate_stride, const float* up, int64_t up_stride, float* out,
                   int64_t rows, int64_t inter);

}  // namespace keel
