// The block products for aarch64 CPUs with ARMv8.2's dot-product instructions (SDOT: four 4-byte dot
// products a instruction, accumulated in int32; Cortex-A55/A76 on, Neoverse, Apple): block_gemm_neon.h's
// row kernel. This unit alone is compiled for that extension; the dispatcher calls it only when the
// kernel level is `neon_dotprod` (the CPU reports asimddp). The target names ARMv8.2, the first
// architecture with SDOT (optional there), so a CPU with SDOT has everything else it allows.
#if defined(__aarch64__)
#pragma GCC target("arch=armv8.2-a+dotprod")

#include <arm_neon.h>

#include "block_gemm_neon.h"

namespace {

struct Sdot {
  static int32x4_t dot(int32x4_t acc, int8x16_t a, int8x16_t b) { return vdotq_s32(acc, a, b); }
};

}  // namespace

namespace keel {

void block_gemm_neon_dotprod(const BlockWeights& w, int64_t n0, int64_t n1, const BlockActivations& a, int64_t m0,
                             int64_t m1, float* out, int64_t ldo) {
  neon_products<Sdot>(w, n0, n1, a, m0, m1, out, ldo);
}

}  // namespace keel
#endif
