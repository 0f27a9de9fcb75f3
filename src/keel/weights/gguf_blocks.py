"""GGUF block tensors as integer codes and scales, the form keel's integer kernels run
(keel.quant.block_layout; `GGUFTensorReader.get_blocks`, `--quantize gguf`).

Every type decodes, vectorised over its raw bytes, to values q [..., rows, K] with scales (and mins)
[..., rows, G], w = q * scale + min per group of K/G inputs; no value is rounded on the way:
- Q4_0: fp16 d + 16 bytes of nibbles per 32 values: q 0..15, scale d, min -8 d.
- Q4_1: fp16 d, fp16 m + 16 bytes of nibbles: q 0..15, scale d, min m.
- Q8_0: fp16 d + 32 int8: q -128..127, scale d.
- Q4_K: super-blocks of 256 values: fp16 d and dmin, 12 bytes packing 6-bit scales and mins of its
  eight sub-blocks of 32, 128 bytes of nibbles (each 32 bytes holding two sub-blocks: low nibbles, then
  high): q 0..15, scale d * sc and min -dmin * m per 32.
- Q5_K: Q4_K's fields plus 32 bytes of fifth bits (bit i of byte l: sub-block i, value l): q 0..31.
- Q6_K: 128 bytes of low nibbles, 64 bytes of high bit pairs, 16 int8 scales, fp16 d: q - 32 in
  -32..31, scale d * sc per 16 values.
- MXFP4 (GPT-OSS's experts): an e8m0 exponent e + 16 bytes of nibbles per 32 values, each nibble an FP4 (e2m1)
  value: q twice that value, an integer in -12..12, scale 2^(e - 128) (float32 holds every such power).

In a nibble block of 32 (Q4_0/Q4_1), byte j holds value j (low nibble) and value j + 16 (high one).
The K-quants' scales are products of an fp16 and an integer of at most 8 bits: exact in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import Q4_K
from torch import Tensor

_T = GGMLQuantizationType


@dataclass(frozen=True)
class BlockType:
    """How a ggml type's values run on the integer kernels."""

    kind: str  # "int4": 4-bit codes 0..15; "int8": 8-bit codes
    group: int  # values per scale
    has_mins: bool
    block_bytes: int

    @property
    def form(self) -> tuple[str, int, bool]:
        """Types of one form decode to codes and scales that can be concatenated (Q4_0 beside Q4_K)."""
        return self.kind, self.group, self.has_mins


BLOCK_TYPES = {
    _T.Q4_0: BlockType("int4", 32, True, 18),
    _T.Q4_1: BlockType("int4", 32, True, 20),
    _T.Q8_0: BlockType("int8", 32, False, 34),
    _T.Q4_K: BlockType("int4", 32, True, 144),
    _T.Q5_K: BlockType("int8", 32, True, 176),
    _T.Q6_K: BlockType("int8", 16, False, 210),
    _T.MXFP4: BlockType("int8", 32, False, 17),
}
# Twice each FP4 (e2m1) value, by its 4-bit code (sign in the top bit): integers, so int8 codes hold them exactly.
_MXFP4_DOUBLED = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)


@dataclass
class QuantBlocks:
    """One HF tensor's GGUF blocks as integer codes and group scales, in HF layout.

    kind "int4": codes uint8 0..15; kind "int8": codes int8. w = codes * scale (+ min) per group of
    `group` values along K. scales/mins: float32 [..., rows, K / group] (mins None for Q8_0 and Q6_K).
    """

    kind: str
    group: int
    types: tuple[str, ...]
    codes: Tensor
    scales: Tensor
    mins: Tensor | None

    @property
    def form(self) -> tuple[str, int, bool]:
        """As `BlockType.form`: blocks of one form concatenate (a fused q/k/v of Q4_0 and Q4_K parts)."""
        return self.kind, self.group, self.mins is not None


def _f16(raw: np.ndarray) -> np.ndarray:
    """Columns of two bytes -> float32 [blocks, 1]."""
    return raw.copy().view(np.float16).astype(np.float32)


def _nibble_pairs(qs: np.ndarray) -> np.ndarray:
    """K-quant nibbles [blocks, 128]: each 32 bytes carry a sub-block of 32 in the low nibbles and the
    next one in the high nibbles -> values [blocks, 8, 32]."""
    chunks = qs.reshape(len(qs), 4, 1, 32)
    return (np.concatenate([chunks & 0x0F, chunks >> 4], axis=2)).reshape(len(qs), 8, 32)


def _k_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's per-32 scale and min (float32 [blocks, 8]): d * sc and -dmin * m."""
    sc, m = Q4_K.get_scale_min(raw[:, 4:16])
    return _f16(raw[:, 0:2]) * sc.astype(np.float32), -(_f16(raw[:, 2:4]) * m.astype(np.float32))


def _decode(t: _T, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Raw blocks [blocks, bytes] -> (values [blocks, values], scales, mins [blocks, groups])."""
    if t == _T.Q8_0:
        return raw[:, 2:].copy().view(np.int8), _f16(raw[:, 0:2]), None
    if t in (_T.Q4_0, _T.Q4_1):
        start = 2 if t == _T.Q4_0 else 4
        packed = raw[:, start : start + 16]
        d = _f16(raw[:, 0:2])
        mins = -8.0 * d if t == _T.Q4_0 else _f16(raw[:, 2:4])
        return np.concatenate([packed & 0x0F, packed >> 4], axis=1), d, mins
    if t == _T.Q4_K:
        scales, mins = _k_scales(raw)
        return _nibble_pairs(raw[:, 16:144]).reshape(len(raw), 256), scales, mins
    if t == _T.Q5_K:
        scales, mins = _k_scales(raw)
        high = (raw[:, 16:48, None] >> np.arange(8, dtype=np.uint8)) & 1  # [blocks, value l, sub-block i]
        values = _nibble_pairs(raw[:, 48:176]) | (high.transpose(0, 2, 1) << 4)
        return values.reshape(len(raw), 256).astype(np.int8), scales, mins
    if t == _T.Q6_K:
        # Each half of 128 values: 64 bytes of low nibbles (values l and l + 32 in the low nibbles of
        # bytes l and l + 32, values l + 64 and l + 96 in their high ones) and 32 bytes of bit pairs
        # (byte l: values l, l + 32, l + 64, l + 96 from the low pair up).
        low = raw[:, 0:128].reshape(len(raw), 2, 1, 64)
        low = np.concatenate([low & 0x0F, low >> 4], axis=2).reshape(len(raw), 2, 4, 32)
        pairs = raw[:, 128:192].reshape(len(raw), 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]
        values = (low | ((pairs & 3) << 4)).astype(np.int16) - 32
        scales = _f16(raw[:, 208:210]) * raw[:, 192:208].copy().view(np.int8).astype(np.float32)
        return values.reshape(len(raw), 256).astype(np.int8), scales, None
    if t == _T.MXFP4:
        packed = raw[:, 1:17]
        codes = _MXFP4_DOUBLED[np.concatenate([packed & 0x0F, packed >> 4], axis=1)]
        return codes, np.ldexp(np.float32(1), raw[:, 0:1].astype(np.int32) - 128).astype(np.float32), None
    raise ValueError(f"no integer blocks for {t.name}")


def decode_blocks(t_type: _T, data: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, ...]:
    """(codes, scales, mins) of a tensor of `t_type` whose raw bytes are `data`, in HF shape
    [..., rows, K] / [..., rows, K / group]; mins None where the type has none."""
    spec = BLOCK_TYPES[t_type]
    values, scales, mins = _decode(t_type, np.asarray(data).reshape(-1, spec.block_bytes))
    groups = (*shape[:-1], shape[-1] // spec.group)
    return values.reshape(shape), scales.reshape(groups), None if mins is None else mins.reshape(groups)
