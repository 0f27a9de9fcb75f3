"""The dtype a checkpoint's model computes in: the one asked for, or `--dtype auto`'s choice."""

from __future__ import annotations

import torch

from keel import kernels
from keel.dtypes import DTYPES, parse_dtype
from keel.platform import auto_dtype
from keel.weights.checkpoint import Checkpoint


def choose_dtype(
    checkpoint: Checkpoint, dtype: str | torch.dtype, device: str | torch.device = "cpu", quantize: str | None = None
) -> tuple[torch.dtype, str]:
    """The dtype a model is loaded in, and why. "auto": keel.platform's choice for this host from the
    checkpoint's own float dtype (GGUF: block-quantized, none) and whether it is quantized."""
    if dtype != "auto":
        return (parse_dtype(dtype) if isinstance(dtype, str) else dtype), "requested"
    quantized = quantize is not None or checkpoint.quantization is not None
    if quantized and kernels.enabled(torch.device(device).type):
        # keel's block kernels multiply float32 activations whatever the model's dtype, and their fused
        # layers and small ops run in float32 only: float32 on every CPU (on AMX, SmolLM2's Q4_1 file
        # decodes 1.5x faster in float32 than in bf16, a float32 kept head included: docs/BENCHMARKS.md).
        return torch.float32, "auto: keel's block kernels compute in float32"
    # torch's integer kernels want bf16 activations (keel.platform.auto_dtype).
    stored = None if checkpoint.format == "gguf" else checkpoint.config.dtype
    stored = stored if stored in DTYPES or stored is None else "float32"
    name, why = auto_dtype(stored, str(device), quantized=quantized)
    return parse_dtype(name), f"auto: {why}"


def resolve_dtype(
    checkpoint: Checkpoint, dtype: str | torch.dtype, device: str | torch.device = "cpu", quantize: str | None = None
) -> torch.dtype:
    """The dtype a model is loaded in (see `choose_dtype`)."""
    return choose_dtype(checkpoint, dtype, device, quantize)[0]
