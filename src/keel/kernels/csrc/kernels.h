// The raw kernels behind keel's torch operators: plain pointers in, no torch types, so that the
// per-ISA translation units (compiled for their instruction set) include nothing but this header
// and <immintrin.h>. The operator layer (ops_*.cpp) checks tensors, splits the work with
// at::parallel_for and picks the ISA level that keel.platform reports.
#pragma once

#include <cstdint>

namespace keel {

// The instruction-set levels with their own kernels, lowest first within an architecture (x86-64: scalar,
// AVX2, VNNI, AMX; aarch64: scalar, NEON, NEON with SDOT). A level runs its own kernels where it has them
// and the highest lower level's elsewhere (AVX-512 without VNNI runs AVX2's; so do BF16 and AMX machines
// outside the VNNI kernels); AMX adds tile products of many rows to the VNNI level's kernels. Only the
// scalar level and the levels of the architecture compiled for can be set (set_kernel_isa).
enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512Vnni = 2, kAmx = 3, kNeon = 4, kNeonDot = 5 };

// Weights in blocks of 32 along K, a row of K/32 blocks per output feature:
// bits 4: codes uint8 [N, K/2], block b of a row in bytes 16b..16b+15, byte j holding value j in its
//         low nibble and value j+16 in its high one (GGUF's layout); w = q * scale + min, q in 0..15.
// bits 8: codes int8 [N, K]; w = q * scale (+ min when mins is not null).
// scales and mins: [N, G], float16 (scale_half) or float32, one per group of K/G inputs: a group is
// `group_blocks` blocks (G = K/32 for GGUF's blocks, fewer for keel's int4 groups of 64-256, 1 for
// int8 per output channel), or, for 8-bit codes without mins, half a block (G = K/16: GGUF's Q6_K,
// `half_block_scales`).
struct BlockWeights {
  int bits;
  const uint8_t* codes;
  int64_t row_bytes;  // bytes of codes per output row
  const void* scales;
  const void* mins;  // may be null
  bool scale_half;
  int64_t blocks;  // K / 32
  int64_t group_blocks;  // blocks per scale (1 with half_block_scales)
  bool half_block_scales;  // two scales per block: values 0..15 and 16..31
  int64_t rows;  // N
  int panel_rows;  // 0: the row layout above; kPanelRows: the panel layout below
};

// The panel layout (what keel::block_panels makes of the row layout; the stored-panel kernel reads it):
// the same tensors, shapes and bytes, in another order. Rows go in panels of kPanelRows (the last one
// may hold fewer, `rows_p`); a panel's codes are one contiguous run: block by block, each block as
// vectors of 4 bytes per row (row j's 4 bytes at 4j), 4 such vectors a block for 4-bit codes (bytes
// 4v..4v+3 of each row's block) and 8 for 8-bit ones, whose bytes are stored offset by 128 (code ^ 0x80:
// unsigned, as vpdpbusd reads them). Scales (and mins) likewise: a panel's entries group by group, each
// group's rows_p entries side by side. In both, a panel is the [rows_p, units] slice of the row layout
// transposed (a unit: 4 bytes of codes, or one scale).
constexpr int kPanelRows = 16;

// Activations quantized to int8 blocks of 32: q [M, K], d [M, K/32] (x ~ q * d), and
// s [M, K/32] = the block's sum as quantized (what a weight block's min multiplies). With a second
// pass, the residual x - q * d (|.| <= d / 2) is quantized on a fixed finer grid: d2 = d / kResidualSteps,
// q2 = round((x - q * d) / d2) clamped to +-127 (x ~ q * d + q2 * d2, about 15 bits): for inputs whose
// blocks hold outliers (after SiLU-and-multiply) and for the LM head. Every kernel reads d2 as given; the
// VNNI panel kernel relies on the power of two to add both passes' dot products in int32 (dot1 << 8 + dot2),
// one conversion and one multiply-add a block instead of two.
constexpr int kResidualShift = 8;
constexpr float kResidualSteps = 1 << kResidualShift;
// The residual's codes per unit for a block of scale d (0 for an all-zero block).
inline float residual_inverse(float d) { return d != 0.f ? kResidualSteps / d : 0.f; }
struct BlockActivations {
  const int8_t* q;
  const float* d;
  const float* s;
  int64_t k;
  int64_t blocks;
  const int8_t* q2;  // null: one pass
  const float* d2;
  int64_t m = 0;  // rows (the stride of `offsets` between passes, for the stored-panel kernel)
};

constexpr int kBlock = 32;

// One row x [K] -> int8 blocks (round to nearest, scale = absmax / 127 per block); with q2 (and d2)
// not null, the residual's blocks too.
void quantize_row_scalar(const float* x, int64_t k, int8_t* q, float* d, float* s, int8_t* q2, float* d2);
void quantize_row_avx2(const float* x, int64_t k, int8_t* q, float* d, float* s, int8_t* q2, float* d2);
// The AVX2 4-bit kernel reads a row's activation codes in pair order: each whole pair of blocks
// (2p, 2p+1) as [2p's first 16, 2p+1's first 16, 2p's last 16, 2p+1's last 16]; an odd last block as is.
void interleave_pairs_avx2(int8_t* q, int64_t k);

// out[m * ldo + n] = sum over k of w[n, k] * a[m, k] for n in [n0, n1), m in [m0, m1).
void block_gemm_scalar(const BlockWeights& w, int64_t n0, int64_t n1, const BlockActivations& a, int64_t m0,
                       int64_t m1, float* out, int64_t ldo);
void block_gemm_avx2(const BlockWeights& w, int64_t n0, int64_t n1, const BlockActivations& a, int64_t m0,
                     int64_t m1, float* out, int64_t ldo);

// The AVX2 4-bit kernel for many activation rows (from kPanelMinRows): 8 output rows at a time repacked
// into a panel that every activation row reads; activations in their natural order (not pair order).
constexpr int64_t kPanelMinRows = 4;
void block_gemm_panels_avx2(const BlockWeights& w, int64_t n0, int64_t n1, const BlockActivations& a, int64_t m0,
                            int64_t m1, float* out, int64_t ldo);

// The AVX-512 VNNI kernel for a few activation rows (4-bit and 8-bit codes). 4-bit activations in quad
// order: each quad of blocks (4p..4p+3) as [each block's first 16 values, then each one's last 16], and
// the last 1-3 blocks of a row the same way among themselves.
void interleave_quads_avx512(int8_t* q, int64_t k);
void block_gemm_avx512(const BlockWeights& w, int64_t n0, int64_t n1, const BlockActivations& a, int64_t m0,
                       int64_t m1, float* out, int64_t ldo);

// The AVX-512 VNNI kernel for many activation rows (from kPanelMinRows too), 4-bit and 8-bit codes: 16 output
// rows at a time repacked into a panel; activations in their natural order.
void block_gemm_panels_avx512(const BlockWeights& w, int64_t n0, int64_t n1, const BlockActivations& a, int64_t m0,
                              int64_t m1, float* out, int64_t ldo);

// From this many activation rows the stored-panel kernel expands each panel once before the rows pass
// (4-bit codes to a byte per value, scales and mins to float32): each group of 4 rows would otherwise
// split the nibbles and convert the scales again.
constexpr int64_t kExpandRows = 8;

// The AVX-512 VNNI kernel over weights in the panel layout, panels [p0, p1), activations in their natural
// order, any number of rows. `offsets` [passes, m, blocks, 2]: for 8-bit codes, 128 x each activation
// block's sum of codes (its two halves apart where the weights have half-block scales, else the whole
// block's in the first entry), subtracted from the dot products of the codes' +128; for 4-bit codes with
// mins, from kExpandRows rows (else null), 8 x each block's sum, which stands in for the mins of a panel
// whose every min is -8 x its scale (GGUF Q4_0, w = (q - 8) d): subtracted as an integer from each dot
// product, where the min would cost a float multiply-add a block and row, the VNNI units' own port.
void block_gemm_stored_avx512(const BlockWeights& w, int64_t p0, int64_t p1, const BlockActivations& a,
                              const int32_t* offsets, int64_t m0, int64_t m1, float* out, int64_t ldo);

// The AVX2 kernel over weights in the panel layout, panels [p0, p1), activations in their natural order,
// any number of rows. `offsets` as above for 4-bit codes with mins from kExpandRows rows (else null); none
// for 8-bit codes (multiplied signed: no +128 to take off).
void block_gemm_stored_avx2(const BlockWeights& w, int64_t p0, int64_t p1, const BlockActivations& a,
                            const int32_t* offsets, int64_t m0, int64_t m1, float* out, int64_t ldo);

// The AMX kernel over weights in the panel layout (half-block scales too), panels [p0, p1), activation
// rows [m0, m1) in whole tiles of kAmxRows; `offsets` as above. Runs only where `amx_permitted()`.
constexpr int64_t kAmxRows = 16;
void block_gemm_stored_amx(const BlockWeights& w, int64_t p0, int64_t p1, const BlockActivations& a,
                           const int32_t* offsets, int64_t m0, int64_t m1, float* out, int64_t ldo);
// Asks Linux for this process's AMX tile state; whether it is granted.
bool amx_permitted();

// The aarch64 row kernels (block_gemm_neon.h): weights in the row layout, activations in their natural
// order, any number of rows; without and with ARMv8.2's SDOT.
void block_gemm_neon(const BlockWeights& w, int64_t n0, int64_t n1, const BlockActivations& a, int64_t m0,
                     int64_t m1, float* out, int64_t ldo);
void block_gemm_neon_dotprod(const BlockWeights& w, int64_t n0, int64_t n1, const BlockActivations& a, int64_t m0,
                             int64_t m1, float* out, int64_t ldo);
// Whether this CPU has SDOT (the kernel level `neon_dotprod`): Linux's hardware-capability bits, which
// user-mode emulators report too (/proc/cpuinfo they do not).
bool neon_dotprod_supported();

// Row r of the weights as float32 [K]: q * scale (+ min), each rounded as the portable loop rounds it.
void dequantize_row_avx2(const BlockWeights& w, int64_t r, float* dst);

float half_to_float(uint16_t h);

}  // namespace keel
