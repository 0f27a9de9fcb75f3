"""One matmul for all experts: rows sorted by expert, each segment times its own weight matrix.

`torch._grouped_mm` does this in one call (CUTLASS on Hopper GPUs, a native kernel on CPU); it has
autograd. Where it is missing or refuses the inputs (older torch, a GPU before sm90, float32 on
CUDA) the segments are computed one by one: the same arithmetic, one small matmul per expert.
"""

from __future__ import annotations

import torch
from torch import Tensor

_HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")


def _compute_dtype(x: Tensor) -> torch.dtype:
    # Autocast has no rule for _grouped_mm: apply its lower precision by hand, as it would for a matmul.
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def use_grouped_mm(x: Tensor, weight: Tensor) -> bool:
    if not _HAS_GROUPED_MM:
        return False
    # The kernels need 16-byte aligned rows in every operand (true for real model widths).
    if any(n * x.element_size() % 16 for n in (x.shape[-1], weight.shape[-2], weight.shape[-1])):
        return False
    if x.device.type == "cpu":
        return True
    if x.device.type == "cuda":
        return _compute_dtype(x) == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    return False


def grouped_matmul(x: Tensor, weight: Tensor, offsets: Tensor) -> Tensor:
    """x [N, K] rows grouped by expert; weight [E, K, M]; offsets [E] int32 cumulative row counts
    (segment e is rows offsets[e-1]:offsets[e]) -> [N, M]."""
    dtype = _compute_dtype(x)
    x, weight = x.to(dtype), weight.to(dtype)
    if use_grouped_mm(x, weight):
        out = torch._grouped_mm(x, weight, offs=offsets)
        if out.requires_grad:
            # Its backward rejects gradients with zero strides (e.g. from a .sum()): hand it a dense one.
            out.register_hook(lambda g: g.contiguous())
        return out
    return segmented_matmul(x, weight, offsets)


def segmented_matmul(x: Tensor, weight: Tensor, offsets: Tensor) -> Tensor:
    """The reference loop: one matmul per non-empty segment (also the benchmark's baseline)."""
    ends = offsets.tolist()
    outs, start = [], 0
    for expert, end in enumerate(ends):
        if end > start:
            outs.append(x[start:end] @ weight[expert])
        start = end
    if not outs:
        return x.new_zeros(x.shape[0], weight.shape[-1])
    return torch.cat(outs, dim=0)
