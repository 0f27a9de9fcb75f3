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
    stored = None if checkpoint.format == "gguf" else checkpoint.config.dtype
    # torch's integer kernels want bf16 activations; keel's (keel.kernels) take any, so a quantized model
    # there computes in what the rest of the model runs fastest in, as a float one does.
    quantized = quantize is not None or checkpoint.quantization is not None
    name, why = auto_dtype(
        stored if stored in DTYPES or stored is None else "float32",
        str(device),
        quantized=quantized and not kernels.enabled(torch.device(device).type),
    )
    return parse_dtype(name), f"auto: {why}"


def resolve_dtype(
    checkpoint: Checkpoint, dtype: str | torch.dtype, device: str | torch.device = "cpu", quantize: str | None = None
) -> torch.dtype:
    """The dtype a model is loaded in (see `choose_dtype`)."""
    return choose_dtype(checkpoint, dtype, device, quantize)[0]
