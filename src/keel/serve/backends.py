"""The start-up log line that names what a served model runs on: the host as keel.platform sees it,
the compute dtype and why, and the backend of every kind of linear layer (counted)."""

from __future__ import annotations

from collections import Counter

from torch import nn

from keel.platform import Platform, dense_linear_backend, host


def linear_backends(model: nn.Module, platform: Platform | None = None) -> str:
    """'N x backend' for each distinct backend of the model's linear layers, most common first.

    A layer names its own backend (`backend`: pre-packed and quantized layers); a plain `nn.Linear`
    gets the platform's dense backend for its dtype."""
    counts: Counter[str] = Counter()
    for module in model.modules():
        label = getattr(module, "backend", None)
        if isinstance(label, str):
            counts[f"{module.scheme} {label}" if hasattr(module, "scheme") else label] += 1
        elif type(module) is nn.Linear:
            dtype = str(module.weight.dtype).removeprefix("torch.")
            counts[f"{dtype} {dense_linear_backend(module.weight.dtype, module.weight.device.type, platform)}"] += 1
    return ", ".join(f"{n} x {label}" for label, n in counts.most_common()) or "none"


def describe_backends(model: nn.Module, dtype_reason: str, kv_cache: str, decode: str, workers: bool = False) -> str:
    """One line: platform; compute dtype (why); linear backends; KV cache; decode step. With `workers`
    the weights live in worker processes (the model here is on the meta device): they name their own."""
    p = host()
    dtype = str(model.dtype).removeprefix("torch.")  # Transformer.dtype (a fully quantized model has no parameter)
    linear = "in the worker processes" if workers else linear_backends(model, p)
    return (
        f"platform {p.describe()}; compute {dtype} ({dtype_reason}); linear: {linear}; KV cache {kv_cache}; "
        f"decode {decode}"
    )
