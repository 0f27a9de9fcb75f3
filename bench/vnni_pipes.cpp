// Which instructions share vpdpbusd's execution ports on this CPU (docs/BENCHMARKS.md, issue 22, tenth
// part): 16 independent vpdpbusd zmm a loop, alone and with float multiplies, multiply-adds, integer adds
// or int-to-float conversions beside them, in G int8 multiply-adds/s on one core. An instruction that
// lowers the figure takes a vpdpbusd slot (the stored-panel kernel's per-block float work is budgeted so).
//
//     g++ -O2 -mavx512f -mavx512vnni bench/vnni_pipes.cpp -o /tmp/vnni_pipes && /tmp/vnni_pipes
#include <chrono>
#include <cstdio>
#define DP(r) "vpdpbusd %%zmm0, %%zmm1, %%zmm" #r "\n\t"
#define FM(r) "vfmadd231ps %%zmm2, %%zmm3, %%zmm" #r "\n\t"
#define MU(r) "vmulps %%zmm2, %%zmm3, %%zmm" #r "\n\t"
#define AD(r) "vpaddd %%zmm0, %%zmm1, %%zmm" #r "\n\t"
#define CV(r) "vcvtdq2ps %%zmm0, %%zmm" #r "\n\t"
#define D16 DP(4) DP(5) DP(6) DP(7) DP(8) DP(9) DP(10) DP(11) DP(12) DP(13) DP(14) DP(15) DP(16) DP(17) DP(18) DP(19)
template <int V> double run(long n) {
  auto t = std::chrono::steady_clock::now();
  for (long i = 0; i < n; ++i) {
    if constexpr (V == 0) asm volatile(D16 ::: "memory");
    if constexpr (V == 1) asm volatile(D16 FM(20) FM(21) ::: "memory");
    if constexpr (V == 2) asm volatile(D16 FM(20) FM(21) FM(22) FM(23) ::: "memory");
    if constexpr (V == 3) asm volatile(D16 MU(20) MU(21) FM(22) FM(23) ::: "memory");
    if constexpr (V == 4) asm volatile(D16 AD(20) AD(21) AD(22) AD(23) ::: "memory");
    if constexpr (V == 5) asm volatile(D16 CV(20) CV(21) CV(22) CV(23) ::: "memory");
    if constexpr (V == 6) asm volatile(D16 FM(20) FM(21) FM(22) FM(23) AD(24) AD(25) CV(26) CV(27)::: "memory");
  }
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  return n * 16 * 64 / s / 1e9;
}
int main() {
  long n = 20000000;
  printf("16 dp: %.1f GMAC/s\n", run<0>(n));
  printf("16 dp + 2 fma: %.1f\n", run<1>(n));
  printf("16 dp + 4 fma: %.1f\n", run<2>(n));
  printf("16 dp + 2 mul + 2 fma: %.1f\n", run<3>(n));
  printf("16 dp + 4 vpaddd: %.1f\n", run<4>(n));
  printf("16 dp + 4 cvt: %.1f\n", run<5>(n));
  printf("16 dp + 4 fma + 2 add + 2 cvt: %.1f\n", run<6>(n));
}
