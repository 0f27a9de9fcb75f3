"""Weight-only quantized linear layers: int8 per output channel, int4 group-wise asymmetric.

Decode streams every weight once per token, so bytes per weight set its speed: int8 halves bf16's,
int4 quarters it. Activations stay in the model's float dtype; the kernels dequantize on the fly:
- int8: `torch.ops.aten._weight_int8pack_mm(x, w_int8 [N, K], scales [N])` (symmetric, one scale per
  output channel: w = q * s, q in -127..127);
- int4: `_weight_int4pack_mm_for_cpu(x, packed, group, scales_and_zeros [K/g, N, 2])` on CPU and
  `_weight_int4pack_mm` on CUDA (asymmetric per group of `group` input channels:
  w = (q - 8) * s + z with q in 0..15, i.e. min + q * s) - the layout gpt-fast and torchao use.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

SCHEMES = ("int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128, 256)


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """[N, K] float -> (int8 [N, K], float32 scales [N]); symmetric per output channel."""
    w = weight.float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(q: Tensor, scales: Tensor) -> Tensor:
    return q.float() * scales[:, None]


def quantize_int4(weight: Tensor, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """[N, K] float -> (int32 values 0..15 [N, K], float32 scales [N, K/g], float32 mins [N, K/g])."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of the int4 group size {group_size}")
    w = weight.float().reshape(n, k // group_size, group_size)
    low, high = w.amin(dim=-1), w.amax(dim=-1)
    scales = ((high - low) / 15.0).clamp(min=1e-12)
    q = torch.round((w - low[..., None]) / scales[..., None]).clamp(0, 15).to(torch.int32)
    return q.reshape(n, k), scales, low


def dequantize_int4(q: Tensor, scales: Tensor, mins: Tensor) -> Tensor:
    n, k = q.shape
    groups = scales.shape[1]
    return (q.reshape(n, groups, -1).float() * scales[..., None] + mins[..., None]).reshape(n, k)


class QuantizedLinear(nn.Module):
    """Drop-in for nn.Linear holding int8 or packed int4 weights (buffers: they are not trained)."""

    def __init__(self, linear: nn.Linear, scheme: str, group_size: int = 128) -> None:
        super().__init__()
        if scheme not in SCHEMES:
            raise ValueError(f"unknown quantization {scheme!r}; choose from {', '.join(SCHEMES)}")
        self.scheme = scheme
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.compute_dtype = linear.weight.dtype
        weight = linear.weight.detach()
        device = weight.device
        if scheme == "int8":
            q, scales = quantize_int8(weight)
            self.register_buffer("qweight", q)
            self.register_buffer("scales", scales.to(self.compute_dtype))
            self.group_size = 0
        else:
            if group_size not in INT4_GROUP_SIZES:
                raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
            self.group_size = group_size
            q, scales, mins = quantize_int4(weight, group_size)
            zeros = mins + 8.0 * scales  # the kernels' zero point: w = (q - 8) * s + z
            packed = _pack_int4(q, device)
            self.register_buffer("qweight", packed)
            self.register_buffer(
                "scales_and_zeros", torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(
                    self.compute_dtype
                ),
            )  # fmt: skip
        self.bias: Tensor | None
        if linear.bias is not None:
            self.register_buffer("bias", linear.bias.detach().clone())
        else:
            self.bias = None

    @property
    def weight_bytes(self) -> int:
        total = self.qweight.numel() * self.qweight.element_size()
        for name in ("scales", "scales_and_zeros"):
            if hasattr(self, name):
                t = getattr(self, name)
                total += t.numel() * t.element_size()
        return total

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.dtype != self.compute_dtype:
            x2 = x2.to(self.compute_dtype)
        if self.scheme == "int8":
            out = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), self.qweight, self.scales)
        elif x2.device.type == "cpu":
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2.contiguous(), self.qweight, self.group_size, self.scales_and_zeros
            )
        else:
            out = torch.ops.aten._weight_int4pack_mm(
                x2.contiguous(), self.qweight, self.group_size, self.scales_and_zeros
            )
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.scheme == "int4" else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.scheme}{group}"


def _pack_int4(q: Tensor, device: torch.device) -> Tensor:
    if device.type == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    # CUDA's layout packs two values per byte first (uint8 [N, K/2]), then tiles them.
    packed = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
    return torch.ops.aten._convert_weight_to_int4pack(packed.to(device), 8)

