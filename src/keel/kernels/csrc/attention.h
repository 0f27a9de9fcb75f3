// Paged decode attention over keel's KV store, as plain pointers (see ops_attention.cpp).
#pragma once

#include <cmath>
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

// The first position a query at `pos` sees: window > 0, a sliding window of that many positions; window < 0,
// the query's own chunk of -window positions (Llama 4's chunked attention); 0, position 0.
inline int64_t first_visible(int64_t pos, int64_t window) {
  if (window > 0) return pos - window + 1 > 0 ? pos - window + 1 : 0;
  if (window < 0) return pos - pos % -window;
  return 0;
}

// Queries q [R, H, D] float32, each at positions[r] of the sequence whose block table is
// tables[table_of[r]] ([T, table_width] int32), attend causally (from first_visible(positions[r], window)) over
// the rows stored for positions 0..positions[r], scores soft-capped where softcap > 0, beside each head's
// sink logit where there are sinks, each score biased by its head's ALiBi slope times the distance where there
// are slopes. out [R, H, v_dim] float32.
struct PagedQuery {
  const float* q;
  int64_t heads;
  const int32_t* tables;
  int64_t table_width;
  const int64_t* table_of;  // may be null: row r uses table r
  const int64_t* positions;
  int64_t window;
  float scale;
  float softcap;  // > 0: each scaled score becomes softcap * tanh(score / softcap) (Gemma 2's soft-capping)
  // May be null: else [heads] float32 logits (GPT-OSS's attention sinks), one per query head, that join each
  // head's softmax (unscaled, uncapped, never masked) and weigh no value: its online softmax starts from the
  // sink (running maximum s, total exp(s - s) = 1) instead of from nothing.
  const float* sinks;
  // May be null: else [heads] float32 ALiBi slopes (Bloom, MPT, Falcon-RW), one per query head: each scaled (and
  // capped) score gains slope * (key position - query position) before the softmax.
  const float* alibi;
  float* out;
};

// One work item: KV head `kv_head` (its group of H / H_kv query heads shares every K/V read) for rows
// row0..row0+rows-1. A decode row is an item alone; a prefill chunk's consecutive rows (one table, one
// position after another) are cut into tiles of tile_rows(group) rows, which convert and locate each
// block's keys and values once for all their rows (each row's arithmetic stays the row body's).
struct PagedItem {
  int64_t row0;
  int64_t rows;
  int64_t kv_head;
};

constexpr int64_t kTileVectors = 48;  // query vectors (rows x query heads) of one tile
constexpr int64_t kMaxTileRows = 16;
constexpr int64_t kTileDim = 256;     // the largest head dim the tile body takes (others: row by row)

inline int64_t tile_rows(int64_t group) {
  const int64_t heads = group < 16 ? group : 16;  // the heads attended together (a group is cut in 16s)
  const int64_t rows = kTileVectors / heads;
  return rows < 1 ? 1 : rows > kMaxTileRows ? kMaxTileRows : rows;
}

void paged_attention_scalar(const PagedStore& s, const PagedQuery& q, const PagedItem* items, int64_t count);
void paged_attention_avx2(const PagedStore& s, const PagedQuery& q, const PagedItem* items, int64_t count);
void paged_attention_avx512(const PagedStore& s, const PagedQuery& q, const PagedItem* items, int64_t count);
void paged_attention_neon(const PagedStore& s, const PagedQuery& q, const PagedItem* items, int64_t count);

// silu(gate) * up over n values (ops_small.cpp's silu_mul_rows), on the attention units' vector
// exponential (silu_vec.h).
void silu_mul_row_avx2(const float* gate, const float* up, float* out, int64_t n);
void silu_mul_row_avx512(const float* gate, const float* up, float* out, int64_t n);
void silu_mul_row_neon(const float* gate, const float* up, float* out, int64_t n);

// keel::sample_rows' pass over one row of `vocab` logits (sample_vec.h; the portable one in ops_sample.cpp):
// x = logits / temperature; e = exp(x - max x), 0 where x - max < -87 or (min_p > 0) where e < min_p; per chunk
// of kSampleChunk values (the last may be short) the largest x and the sum of e. Returns max x.
constexpr int64_t kSampleChunk = 64;
struct SamplePass {
  const float* logits;
  int64_t vocab;
  float temperature;
  float min_p;
  float* x;          // [vocab]
  float* e;          // [vocab]
  float* chunk_max;  // [chunks]
  double* chunk_sum; // [chunks]
};
// One value's weight in that pass, in scalar code (the portable pass and the vector passes' short last chunk).
inline float sample_weight(float x, float top, float min_p) {
  const float d = x - top;
  const float e = d + 87.f < 0.f ? 0.f : std::exp(d);
  return min_p > 0.f && e < min_p ? 0.f : e;
}
float sample_pass_avx2(const SamplePass& p);
float sample_pass_avx512(const SamplePass& p);
float sample_pass_neon(const SamplePass& p);

}  // namespace keel
