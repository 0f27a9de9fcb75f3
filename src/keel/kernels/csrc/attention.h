// Paged decode attention over keel's KV store, as plain pointers (see ops_attention.cpp).
#pragma once

#include <cstdint>

namespace keel {

// One layer's paged store: rows [H_kv, slots, D] (slot = block * block_size + offset), float32, bf16
// or int8 (then one float16 scale per (head, slot)). Without a value store the value of a row is its
// first v_dim channels (multi-head latent attention's latent).
struct PagedStore {
  int dtype;  // 0 float32, 1 bfloat16, 2 int8
  const void* keys;
  const void* values;  // may be null
  const uint16_t* key_scales;  // int8 only: float16 [H_kv, slots]
  const uint16_t* value_scales;
  int64_t slots;
  int64_t kv_heads;
  int64_t head_dim;
  int64_t v_dim;
  int64_t block_size;
};

// Queries q [R, H, D] float32, each at positions[r] of the sequence whose block table is
// tables[table_of[r]] ([T, table_width] int32), attend causally (within `window` tokens when > 0) over
// the rows stored for positions 0..positions[r]. out [R, H, v_dim] float32. Work item i covers row
// i / H_kv and KV head i % H_kv (its group of H / H_kv query heads shares every K/V read).
struct PagedQuery {
  const float* q;
  int64_t heads;
  const int32_t* tables;
  int64_t table_width;
  const int64_t* table_of;  // may be null: row r uses table r
  const int64_t* positions;
  int64_t window;
  float scale;
  float* out;
};

void paged_attention_scalar(const PagedStore& s, const PagedQuery& q, int64_t item0, int64_t item1);
void paged_attention_avx2(const PagedStore& s, const PagedQuery& q, int64_t item0, int64_t item1);
void paged_attention_avx512(const PagedStore& s, const PagedQuery& q, int64_t item0, int64_t item1);

// silu(gate) * up over n values (ops_small.cpp's silu_mul_rows), on the attention units' vector
// exponential (silu_vec.h).
void silu_mul_row_avx2(const float* gate, const float* up, float* out, int64_t n);
void silu_mul_row_avx512(const float* gate, const float* up, float* out, int64_t n);

}  // namespace keel
