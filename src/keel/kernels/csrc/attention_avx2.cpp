// Paged decode attention, attention_impl.h vectorised for AVX2 + FMA (this unit alone is compiled for
// that level; the dispatcher calls it only when keel.platform reports AVX2).
#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC target("avx2,fma,f16c")

#include "attention_impl.h"

namespace keel {

void paged_attention_avx2(const PagedStore& s, const PagedQuery& q, int64_t item0, int64_t item1) {
  attend_items(s, q, item0, item1);
}

}  // namespace keel
#endif
