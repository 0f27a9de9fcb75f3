// Paged decode attention, portable build of attention_impl.h.
#include "attention_impl.h"

namespace keel {

void paged_attention_scalar(const PagedStore& s, const PagedQuery& q, const PagedItem* items, int64_t count) {
  attend_items(s, q, items, count);
}

}  // namespace keel
