"""BitNet b1.58's linear layers (config.json `quantization_config`, quant_method "bitnet"), as transformers runs them.

Its weights are ternary: stored packed, four values -1/0/1 to a uint8 (each as 0..2 in two bits; the value of row
r in byte row r mod R at bits 2 (r div R), R the stored rows), with a `weight_scale` per layer. Its activations are
quantized per token inside every layer, to int8 by their absolute maximum, and the product is taken of the
quantized values. Dropping that step would run another model than the one trained, so keel runs it too; the
weights are unpacked to float at load (each value exact), and the products are float products of integers
(transformers' numbers, op for op).

Two layer classes, as `linear_class` says (transformers.integrations.bitnet):
- bitlinear (BitLinear): packed weights always; y = (round(x s).clamp(-128, 127) W^T) / (weight_scale s) + b,
  s = 127 / max|x| per token, in the compute dtype;
- autobitlinear (AutoBitLinear): x' = round(x s).clamp(-128, 127) / s in float32, y = (x' W^T + b) * weight_scale
  in "offline" mode (W packed or plain); in "online" mode W is the float master weight, ternarized by its mean
  absolute value (round(W t).clamp(-1, 1) / t, t = 1 / mean|W|) and no weight_scale: done once at load, as the
  weights do not change at inference.
The layers transformers leaves in float (`modules_to_not_convert`, by default the head) stay keel's nn.Linear.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from keel.errors import WeightsError
from keel.quant.apply import replace_module
from keel.weights.checkpoint import Checkpoint
from keel.weights.names import hf_source

VALUES_PER_BYTE = 4
ACT_MAX = 127  # int8's symmetric range; the clamp's low end is -128, as transformers clamps
DEFAULT_SKIP = ("lm_head",)  # transformers' default: the output embedding (and the last parameter, the same)


def unpack_ternary(packed: Tensor, dtype: torch.dtype) -> Tensor:
    """uint8 [R, K] -> [4R, K] values -1/0/1 in `dtype` (transformers' unpack_weights)."""
    parts = [((packed >> (2 * i)) & 3) for i in range(VALUES_PER_BYTE)]
    return torch.cat(parts).to(dtype) - 1


def ternarize(weight: Tensor) -> Tensor:
    """A master weight as AutoBitLinear's online mode ternarizes it: round(W t).clamp(-1, 1) / t, t = 1 / mean|W|."""
    w = weight.float()
    scale = 1.0 / w.abs().mean().clamp(min=1e-5)
    return ((w * scale).round().clamp(-1, 1) / scale).to(weight.dtype)


class BitNetLinear(nn.Module):
    """One BitNet linear layer: ternary weights (unpacked) and int8 activations per token (the module docstring)."""

    def __init__(self, weight: Tensor, weight_scale: Tensor | None, bias: Tensor | None, linear_class: str) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.linear_class = linear_class
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = None if weight_scale is None else nn.Parameter(weight_scale, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        if self.linear_class == "bitlinear":
            scale = ACT_MAX / x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-5)
            q = (x * scale).round().clamp(-ACT_MAX - 1, ACT_MAX)
            y = F.linear(q, self.weight) / (self.weight_scale * scale)
            return y if self.bias is None else y + self.bias
        f = x.float()
        scale = ACT_MAX / f.abs().amax(dim=-1, keepdim=True).clamp(min=1e-5)
        q = ((f * scale).round().clamp(-ACT_MAX - 1, ACT_MAX) / scale).to(x.dtype)
        y = F.linear(q, self.weight, self.bias)
        return y if self.weight_scale is None else y * self.weight_scale

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, {self.linear_class}"


def _converted(hf_module: str, patterns: list[str]) -> bool:
    """transformers' should_convert_module: a pattern skips a module from the start to a module boundary (also
    as a regex), or as a suffix."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return not any(re.match(rf"(?:{key}){boundary}", hf_module) or hf_module.endswith(key) for key in patterns)


@torch.no_grad()
def load_bitnet_layers(
    net: nn.Module, checkpoint: Checkpoint, quant: dict[str, Any], dtype: torch.dtype, device: str | torch.device
) -> int:
    """Replace the meta-built `net`'s linear layers that transformers converts by BitNetLinear layers read from the
    checkpoint (on `device`, in `dtype`); returns how many. `load_weights` then fills the rest."""
    config, reader = checkpoint.config, checkpoint.reader
    available = reader.names()
    skip = quant["modules_to_not_convert"] or list(DEFAULT_SKIP)
    linear_class, online = quant["linear_class"], quant["quantization_mode"] == "online"
    count = 0
    for name, module in list(net.named_modules()):
        if type(module) is not nn.Linear:
            continue
        stored = hf_source(config, f"{name}.weight", available).names
        if len(stored) != 1 or not _converted(stored[0].removesuffix(".weight"), skip):
            continue
        base = stored[0].removesuffix(".weight")
        if stored[0] not in available:
            raise WeightsError(f"{checkpoint.path}: tensor {stored[0]!r} is missing (needed for {name}.weight)")
        raw = reader.get(stored[0])
        out_features, in_features = module.out_features, module.in_features
        packed = raw.dtype == torch.uint8 and tuple(raw.shape) == (out_features // VALUES_PER_BYTE, in_features)
        if packed and out_features % VALUES_PER_BYTE == 0:
            weight = unpack_ternary(raw, dtype)
        elif linear_class == "autobitlinear" and tuple(raw.shape) == (out_features, in_features):
            weight = raw.to(dtype)
        else:
            layout = "uint8 [out/4, in]" if linear_class == "bitlinear" else "uint8 [out/4, in] or [out, in]"
            raise WeightsError(
                f"{checkpoint.path}: {linear_class} tensor {stored[0]} has shape {list(raw.shape)} ({raw.dtype}), "
                f"expected {layout} of [{out_features}, {in_features}]"
            )
        scale = None
        if online and linear_class == "autobitlinear":
            weight = ternarize(weight)
        else:
            if f"{base}.weight_scale" not in available:
                raise WeightsError(f"{checkpoint.path}: tensor {base + '.weight_scale'!r} is missing ({linear_class})")
            scale = reader.get(f"{base}.weight_scale").to(dtype).reshape(-1)
            if scale.numel() != 1:
                raise WeightsError(f"{checkpoint.path}: {base}.weight_scale has {scale.numel()} values, expected 1")
        bias = None
        if module.bias is not None:
            bias = reader.get(f"{base}.bias").to(dtype).to(device)
        layer = BitNetLinear(weight.to(device), None if scale is None else scale.to(device), bias, linear_class)
        replace_module(net, name, layer)
        count += 1
    return count
