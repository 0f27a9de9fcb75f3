"""The layout keel's C++ kernels run integer weights in (keel.kernels, `torch.ops.keel.block_linear`).

Blocks of 32 input features, as GGUF stores them, so that a GGUF file's own blocks run without any
conversion of their numbers:
- 4 bits: codes uint8 [N, K/2]; block b of a row is bytes 16b..16b+15, byte j holding value j of the
  block in its low nibble and value j+16 in its high one (GGUF's Q4_0/Q4_1 order); w = q * scale + min.
- 8 bits: codes int8 [N, K]; w = q * scale (+ min, when there are mins).
- scales (and mins) [N, G], float16 or float32, one per group of K/G inputs: GGUF's blocks (G = K/32,
  float16, exactly as stored; the K-quants' float32 sub-block scales, G = K/16 for Q6_K's 8-bit codes,
  which take no mins), keel's int4 groups of 32-256 and int8 per output channel (G = 1), float32.

From the AVX2 kernel level the serving engine re-stores them in panels of PANEL_ROWS output rows
(keel.quant.panels: the same tensors in another order, kernels.h's "panel layout"), which the stored-panel
kernels stream with no per-call repacking; `panel_rows` on a layer says which layout it holds.

The kernels quantize each activation row to int8 blocks of 32 on the fly (one scale per block,
absmax / 127, as llama.cpp's Q8_0 activations) and accumulate integer dot products in float32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

BLOCK = 32
PANEL_ROWS = 16  # kPanelRows in csrc/kernels.h


def nibble_blocks(values: Tensor) -> Tensor:
    """Values 0..15 [..., K] (any integer dtype) -> uint8 [..., K/2] in the block layout above."""
    *lead, k = values.shape
    v = values.to(torch.uint8).reshape(*lead, k // BLOCK, 2, BLOCK // 2)
    return (v[..., 0, :] | (v[..., 1, :] << 4)).reshape(*lead, k // 2)


def values_of_nibble_blocks(codes: Tensor) -> Tensor:
    """uint8 [..., K/2] in the block layout -> uint8 values 0..15 [..., K] (inverse of `nibble_blocks`)."""
    *lead, half = codes.shape
    c = codes.reshape(*lead, half // (BLOCK // 2), 1, BLOCK // 2)
    return torch.cat([c & 15, c >> 4], dim=-2).reshape(*lead, half * 2)


def blocks_fit(in_features: int) -> bool:
    return in_features % BLOCK == 0


def apply_keeping_scales(
    module: nn.Module, fn: Callable[[Tensor], Tensor], recurse: bool, device: torch.device
) -> None:
    """`nn.Module._apply` for a block-layout module whose float `scales` and `mins` buffers stay as stored
    (the kernels read float16 and float32 scales whatever the activations): a dtype move leaves them,
    a move to `device` (CPU or meta) takes them along."""
    kept = {name: module._buffers.pop(name) for name in ("scales", "mins")}
    nn.Module._apply(module, fn, recurse)
    for name, tensor in kept.items():
        module._buffers[name] = None if tensor is None else tensor.to(device)
