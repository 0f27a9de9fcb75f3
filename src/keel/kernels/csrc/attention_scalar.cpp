// Paged decode attention, portable build of attention_impl.h.
#include "attention_impl.h"

namespace keel {

void paged_attention_scalar(const PagedStore& s, const PagedQuery& q, int64_t item0, int64_t item1) {
  attend_items(s, q, item0, item1);
}

}  // namespace keel
