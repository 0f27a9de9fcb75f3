// Paged decode attention and SiLU-and-multiply for aarch64 NEON (baseline on every aarch64 CPU, so this
// unit needs no target pragma): attention_vec.h's block body over 4 float lanes. The dispatcher calls it
// from keel.platform's `neon` level; elsewhere the unit compiles to nothing.
#if defined(__aarch64__)

#include <arm_neon.h>

#include <cstring>

#include "attention_vec.h"
#include "sample_vec.h"
#include "silu_vec.h"

namespace {

struct Lanes4 {
  using F = float32x4_t;
  static constexpr int kLanes = 4;
  static F zero() { return vdupq_n_f32(0.f); }
  static F load(const float* p) { return vld1q_f32(p); }
  static void store(float* p, F v) { vst1q_f32(p, v); }
  static F set1(float x) { return vdupq_n_f32(x); }
  static F add(F a, F b) { return vaddq_f32(a, b); }
  static F sub(F a, F b) { return vsubq_f32(a, b); }
  static F mul(F a, F b) { return vmulq_f32(a, b); }
  static F fmadd(F a, F b, F c) { return vfmaq_f32(c, a, b); }
  static F max(F a, F b) { return vmaxq_f32(a, b); }
  static F div(F a, F b) { return vdivq_f32(a, b); }
  static F select_negative(F x, F a, F b) {  // the sign bit set (as x86's blendv reads it, -0 included): a
    const uint32x4_t negative = vreinterpretq_u32_s32(vshrq_n_s32(vreinterpretq_s32_f32(x), 31));
    return vbslq_f32(negative, a, b);
  }
  static float reduce_max(F v) { return vmaxvq_f32(v); }
  static void prefetch(const char* p) { __builtin_prefetch(p, 0, 2); }
  static F from_i8(const int8_t* p) {  // exactly 4 bytes read: a row's last ones may end an allocation
    int32_t word;
    std::memcpy(&word, p, sizeof(word));
    const int16x8_t wide = vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(word)));
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(wide)));
  }
  static float half(uint16_t h) {
    __fp16 value;
    std::memcpy(&value, &h, sizeof(value));
    return static_cast<float>(value);
  }

  // [sum(v0), sum(v1), sum(v2), sum(v3)] of 4 vectors: two rounds of pairwise adds.
  static F sums(const F v[4]) { return vpaddq_f32(vpaddq_f32(v[0], v[1]), vpaddq_f32(v[2], v[3])); }

  static F round_nearest(F x) { return vrndnq_f32(x); }
  static F pow2(F k) { return vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(k), vdupq_n_s32(127)), 23)); }
};

}  // namespace

namespace keel {

void paged_attention_neon(const PagedStore& s, const PagedQuery& q, const PagedItem* items, int64_t count) {
  attend_items_vectorised<Lanes4>(s, q, items, count);
}

void silu_mul_row_neon(const float* gate, const float* up, float* out, int64_t n) {
  silu_mul_vectorised<Lanes4>(gate, up, out, n);
}

float sample_pass_neon(const SamplePass& p) { return sample_pass_vectorised<Lanes4>(p); }

}  // namespace keel
#endif
