// The portable kernels: any CPU, and the reference the ISA kernels are tested against.
#include <cmath>
#include <cstring>

#include "kernels.h"

namespace keel {

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exponent = (h >> 10) & 0x1f;
  uint32_t mantissa = h & 0x3ff;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000 | (mantissa << 13);  // inf, nan
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exponent = 113;
    while ((mantissa & 0x400) == 0) {
      mantissa <<= 1;
      exponent--;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3ff) << 13);
  }
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

namespace {

// One block of 32 values times `inverse`, rounded and clamped to +-127 -> int8 codes; returns their sum.
int codes_of_block(const float* x, float inverse, int8_t* q) {
  int sum = 0;
  for (int i = 0; i < kBlock; ++i) {
    const int v = static_cast<int>(std::fmin(127.f, std::fmax(-127.f, std::nearbyint(x[i] * inverse))));
    q[i] = static_cast<int8_t>(v);
    sum += v;
  }
  return sum;
}

// One block of 32 values -> int8 codes and their scale; returns the sum of the codes.
int quantize_block(const float* x, int8_t* q, float* d) {
  float amax = 0.f;
  for (int i = 0; i < kBlock; ++i) amax = std::fmax(amax, std::fabs(x[i]));
  *d = amax / 127.f;
  return codes_of_block(x, *d != 0.f ? 127.f / amax : 0.f, q);
}

}  // namespace

void quantize_row_scalar(const float* x, int64_t k, int8_t* q, float* d, float* s, int8_t* q2, float* d2) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const int sum = quantize_block(x + b * kBlock, q + b * kBlock, d + b);
    s[b] = d[b] * static_cast<float>(sum);
    if (q2 != nullptr) {
      float residual[kBlock];
      for (int i = 0; i < kBlock; ++i) residual[i] = x[b * kBlock + i] - static_cast<float>(q[b * kBlock + i]) * d[b];
      d2[b] = d[b] / kResidualSteps;
      const int sum2 = codes_of_block(residual, residual_inverse(d[b]), q2 + b * kBlock);
      s[b] += d2[b] * static_cast<float>(sum2);
    }
  }
}

namespace {

inline float load_scale(const void* p, int64_t i, bool half) {
  return half ? half_to_float(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}

// The integer dot product of values [j0, j1) of block b (4-bit: the whole block only).
inline int32_t dot_block(const BlockWeights& w, const uint8_t* row, int64_t b, const int8_t* a, int j0 = 0,
                         int j1 = kBlock) {
  int32_t sum = 0;
  if (w.bits == 4) {
    const uint8_t* codes = row + b * (kBlock / 2);
    for (int j = 0; j < kBlock / 2; ++j) {
      sum += static_cast<int32_t>(codes[j] & 0x0f) * a[j];
      sum += static_cast<int32_t>(codes[j] >> 4) * a[j + kBlock / 2];
    }
  } else {
    const int8_t* codes = reinterpret_cast<const int8_t*>(row) + b * kBlock;
    for (int j = j0; j < j1; ++j) sum += static_cast<int32_t>(codes[j]) * a[j];
  }
  return sum;
}

}  // namespace

void block_gemm_scalar(const BlockWeights& w, int64_t n0, int64_t n1, const BlockActivations& a, int64_t m0,
                       int64_t m1, float* out, int64_t ldo) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w.codes + n * w.row_bytes;
    const int64_t sb = n * (w.blocks / w.group_blocks);
    for (int64_t m = m0; m < m1; ++m) {
      const int8_t* aq = a.q + m * a.k;
      const float* ad = a.d + m * a.blocks;
      const float* as = a.s + m * a.blocks;
      float acc = 0.f;
      if (w.half_block_scales) {
        for (int64_t b = 0; b < w.blocks; ++b)
          for (int h = 0; h < 2; ++h) {
            const float dw = load_scale(w.scales, n * 2 * w.blocks + 2 * b + h, w.scale_half);
            const int j0 = h * kBlock / 2, j1 = j0 + kBlock / 2;
            acc += dw * ad[b] * static_cast<float>(dot_block(w, row, b, aq + b * kBlock, j0, j1));
            if (a.q2 != nullptr)
              acc += dw * a.d2[m * a.blocks + b] *
                     static_cast<float>(dot_block(w, row, b, a.q2 + m * a.k + b * kBlock, j0, j1));
          }
        out[m * ldo + n] = acc;
        continue;
      }
      for (int64_t b = 0; b < w.blocks; ++b) {
        const float dot = static_cast<float>(dot_block(w, row, b, aq + b * kBlock));
        const int64_t g = sb + b / w.group_blocks;
        acc += load_scale(w.scales, g, w.scale_half) * ad[b] * dot;
        if (a.q2 != nullptr) {
          const float dot2 = static_cast<float>(dot_block(w, row, b, a.q2 + m * a.k + b * kBlock));
          acc += load_scale(w.scales, g, w.scale_half) * a.d2[m * a.blocks + b] * dot2;
        }
        if (w.mins != nullptr) acc += load_scale(w.mins, g, w.scale_half) * as[b];
      }
      out[m * ldo + n] = acc;
    }
  }
}

}  // namespace keel
