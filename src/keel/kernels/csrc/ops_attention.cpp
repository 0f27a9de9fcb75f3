// keel::paged_attention: attention of query rows over the paged KV store, reading each sequence's
// blocks where they lie (no gather). Work items (attention.h's PagedItem): a decode row and KV head, or
// a tile of a prefill chunk's rows and a KV head, handed to the threads largest first.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <numeric>
#include <vector>

#include "attention.h"
#include "isa.h"
#include "ops.h"

namespace keel {

namespace {

int store_dtype(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return 0;
    case at::kBFloat16: return 1;
    case at::kChar: return 2;
    default: TORCH_CHECK(false, "keel::paged_attention: the KV store must be float32, bfloat16 or int8, got ",
                         t.scalar_type());
  }
}

const uint16_t* scales_of(const c10::optional<at::Tensor>& scales, const at::Tensor& store) {
  if (store.scalar_type() != at::kChar) return nullptr;
  TORCH_CHECK(scales.has_value() && scales->scalar_type() == at::kHalf && scales->is_contiguous() &&
                  scales->numel() == store.size(0) * store.size(1),
              "keel::paged_attention: an int8 store needs float16 scales [H_kv, slots, 1]");
  return static_cast<const uint16_t*>(scales->data_ptr());
}

}  // namespace

void paged_attention_into(const float* q, int64_t rows, int64_t heads, int64_t dim, const at::Tensor& keys,
                          const c10::optional<at::Tensor>& values, const c10::optional<at::Tensor>& key_scales,
                          const c10::optional<at::Tensor>& value_scales, const at::Tensor& tables,
                          const c10::optional<at::Tensor>& table_of, const at::Tensor& positions, int64_t block_size,
                          int64_t window, double scale, int64_t v_dim, double softcap, const float* sinks,
                          float* out, const float* alibi) {
  TORCH_CHECK(keys.dim() == 3 && keys.is_contiguous(), "keel::paged_attention: keys must be a contiguous [H_kv, slots, D]");
  const int64_t kv_heads = keys.size(0);
  TORCH_CHECK(keys.size(2) == dim, "keel::paged_attention: q has ", dim, " channels, the keys ", keys.size(2));
  TORCH_CHECK(heads % kv_heads == 0, "keel::paged_attention: ", heads, " query heads over ", kv_heads, " KV heads");
  TORCH_CHECK(dim <= 576 && v_dim <= dim && block_size <= 64 && block_size > 0,
              "keel::paged_attention: head dim <= 576 and block size <= 64 only");
  TORCH_CHECK(keys.size(1) % block_size == 0, "keel::paged_attention: slots not a multiple of the block size");
  TORCH_CHECK(softcap >= 0, "keel::paged_attention: softcap must be >= 0 (0: none), got ", softcap);
  TORCH_CHECK(tables.scalar_type() == at::kInt && tables.dim() == 2 && tables.is_contiguous(),
              "keel::paged_attention: tables must be a contiguous int32 [T, width]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == rows && positions.is_contiguous(),
              "keel::paged_attention: positions must be int64 [R]");
  const int dtype = store_dtype(keys);
  if (values.has_value()) {
    TORCH_CHECK(values->sizes() == keys.sizes() && values->scalar_type() == keys.scalar_type() &&
                    values->is_contiguous(),
                "keel::paged_attention: values must match the keys");
  }
  const int64_t* table_index = nullptr;
  if (table_of.has_value()) {
    TORCH_CHECK(table_of->scalar_type() == at::kLong && table_of->numel() == rows && table_of->is_contiguous(),
                "keel::paged_attention: table_of must be int64 [R]");
    table_index = table_of->data_ptr<int64_t>();
  } else {
    TORCH_CHECK(tables.size(0) == rows, "keel::paged_attention: one table per row without table_of");
  }
  // Every row's keys must lie inside its table and the store: checked here, once, not per read.
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int32_t* tab = tables.data_ptr<int32_t>();
  const int64_t blocks = keys.size(1) / block_size, width = tables.size(1);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = table_index ? table_index[r] : r;
    TORCH_CHECK(t >= 0 && t < tables.size(0), "keel::paged_attention: row ", r, " names table ", t);
    TORCH_CHECK(pos[r] >= 0 && pos[r] / block_size < width, "keel::paged_attention: position ", pos[r],
                " outside a table of ", width, " blocks");
    const int64_t first = first_visible(pos[r], window);
    for (int64_t b = first / block_size; b <= pos[r] / block_size; ++b)
      TORCH_CHECK(tab[t * width + b] >= 0 && tab[t * width + b] < blocks, "keel::paged_attention: block ",
                  tab[t * width + b], " outside the store");
  }
  const PagedStore store{dtype,
                         keys.data_ptr(),
                         values.has_value() ? values->data_ptr() : nullptr,
                         scales_of(key_scales, keys),
                         values.has_value() ? scales_of(value_scales, *values) : nullptr,
                         keys.size(1),
                         kv_heads,
                         dim,
                         v_dim,
                         block_size};
  const PagedQuery query{q, heads, tab, width, table_index, pos, window, static_cast<float>(scale),
                         static_cast<float>(softcap), sinks, alibi, out};
  // Runs of rows of one table at consecutive positions (a prefill chunk's) cut into tiles; each tile or
  // lone row is an item per KV head, costed by the rows times the keys they walk.
  const int64_t tile = tile_rows(heads / kv_heads);
  std::vector<PagedItem> items;
  std::vector<int64_t> cost;
  items.reserve(rows * kv_heads);
  cost.reserve(rows * kv_heads);
  for (int64_t r = 0; r < rows;) {
    const int64_t t = table_index ? table_index[r] : r;
    int64_t n = 1;
    while (n < tile && r + n < rows && table_index && table_index[r + n] == t && pos[r + n] == pos[r] + n) ++n;
    const int64_t first = first_visible(pos[r], window);
    for (int64_t h = 0; h < kv_heads; ++h) {
      items.push_back({r, n, h});
      cost.push_back(n * (pos[r + n - 1] - first + 1 + block_size));
    }
    r += n;
  }
  const int64_t count = static_cast<int64_t>(items.size());
  std::vector<int64_t> order(count);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  const Isa isa = current_isa();
  auto run = [&](const PagedItem* item) {
#if defined(__x86_64__) || defined(_M_X64)
    if (isa >= kAvx512Vnni && dim % 16 == 0 && v_dim % 16 == 0) {  // head dims of whole 16-lane vectors
      paged_attention_avx512(store, query, item, 1);
      return;
    }
    if (isa >= kAvx2) {
      paged_attention_avx2(store, query, item, 1);
      return;
    }
#elif defined(__aarch64__)
    if (isa >= kNeon) {
      paged_attention_neon(store, query, item, 1);
      return;
    }
#endif
    paged_attention_scalar(store, query, item, 1);
  };
  // Items differ in cost by orders of magnitude (a decode row against a tile of a long chunk): each
  // thread takes the next largest until none is left, not a fixed share of the list.
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), count);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1); i < count; i = next.fetch_add(1)) run(&items[order[i]]);
  });
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& keys, const c10::optional<at::Tensor>& values,
                           const c10::optional<at::Tensor>& key_scales, const c10::optional<at::Tensor>& value_scales,
                           const at::Tensor& tables, const c10::optional<at::Tensor>& table_of,
                           const at::Tensor& positions, int64_t block_size, int64_t window, double scale,
                           int64_t v_dim, double softcap, const c10::optional<at::Tensor>& sinks,
                           const c10::optional<at::Tensor>& alibi) {
  TORCH_CHECK(q.dim() == 3, "keel::paged_attention: q must be [R, H, D]");
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2);
  // sinks and alibi: each None or float32 [H] on the CPU, one per query head
  auto per_head = [heads](const c10::optional<at::Tensor>& t, const char* name) -> const float* {
    if (!t.has_value()) return nullptr;
    TORCH_CHECK(t->scalar_type() == at::kFloat, "keel::paged_attention: ", name, " must be float32, got ",
                t->scalar_type());
    TORCH_CHECK(t->dim() == 1 && t->size(0) == heads, "keel::paged_attention: ", name, " must be [H] = [", heads,
                "] (one per query head), got ", t->sizes());
    TORCH_CHECK(t->device().is_cpu(), "keel::paged_attention: ", name, " must be on the CPU, got ", t->device());
    TORCH_CHECK(t->is_contiguous(), "keel::paged_attention: ", name, " must be contiguous");
    return t->data_ptr<float>();
  };
  const float* sink_logits = per_head(sinks, "sinks");
  const float* slopes = per_head(alibi, "alibi");
  const at::Tensor qf = q.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({rows, heads, v_dim}, qf.options());
  paged_attention_into(qf.data_ptr<float>(), rows, heads, dim, keys, values, key_scales, value_scales, tables,
                       table_of, positions, block_size, window, scale, v_dim, softcap, sink_logits,
                       out.data_ptr<float>(), slopes);
  return out.to(q.scalar_type());
}


}  // namespace keel

TORCH_LIBRARY_FRAGMENT(keel, m) {
  m.def(
      "paged_attention(Tensor q, Tensor keys, Tensor? values, Tensor? key_scales, Tensor? value_scales, "
      "Tensor tables, Tensor? table_of, Tensor positions, int block_size, int window, float scale, int v_dim, "
      "float softcap=0.0, Tensor? sinks=None, Tensor? alibi=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(keel, CPU, m) { m.impl("paged_attention", &keel::paged_attention); }
