// The block products for ARMv8.0 NEON (every aarch64 CPU): block_gemm_neon.h's row kernel with each
// 16-byte dot product as widening multiplies (8-bit x 8-bit -> 16-bit products, which cannot overflow)
// pairwise-added into 4 int32 sums. CPUs with ARMv8.2's SDOT run block_gemm_neon_dotprod.cpp instead.
#if defined(__aarch64__)

#include <arm_neon.h>
#include <sys/auxv.h>

#include "block_gemm_neon.h"

#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif

namespace {

struct WideningDot {
  static int32x4_t dot(int32x4_t acc, int8x16_t a, int8x16_t b) {
    acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(a), vget_low_s8(b)));
    return vpadalq_s16(acc, vmull_high_s8(a, b));
  }
};

}  // namespace

namespace keel {

void block_gemm_neon(const BlockWeights& w, int64_t n0, int64_t n1, const BlockActivations& a, int64_t m0,
                     int64_t m1, float* out, int64_t ldo) {
  neon_products<WideningDot>(w, n0, n1, a, m0, m1, out, ldo);
}

bool neon_dotprod_supported() { return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0; }

}  // namespace keel
#endif
