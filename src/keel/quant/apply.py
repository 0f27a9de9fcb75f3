"""Replace a model's linear layers with quantized ones, in place."""

from __future__ import annotations

from torch import nn

from keel.errors import KeelError
from keel.quant.linear import INT4_GROUP_SIZES, SCHEMES, QuantizedLinear


def quantize_model(
    model: nn.Module, scheme: str, group_size: int = 128, keep: set[str] | None = None
) -> dict[str, int]:
    """Quantize every nn.Linear of `model` except those named in `keep` (a mixed-precision plan) and
    except layers whose width the kernels cannot take (int4: in_features divisible by the group).
    Returns {"quantized": n, "kept": m, "bytes_before": b0, "bytes_after": b1}.

    Not quantized (yet): stacked MoE expert weights, embeddings. The lm_head is a linear layer and
    is quantized unless kept; with tied embeddings it becomes its own (quantized) copy.
    """
    if scheme not in SCHEMES:
        raise KeelError(f"--quantize: unknown scheme {scheme!r}; choose from {', '.join(SCHEMES)}")
    if scheme == "int4" and group_size not in INT4_GROUP_SIZES:
        raise KeelError(f"--quant-group-size: int4 groups of {', '.join(map(str, INT4_GROUP_SIZES))}, not {group_size}")
    keep = keep or set()
    stats = {"quantized": 0, "kept": 0, "bytes_before": 0, "bytes_after": 0}
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for name, linear in targets:
        before = linear.weight.numel() * linear.weight.element_size()
        if name in keep or (scheme == "int4" and linear.in_features % group_size):
            stats["kept"] += 1
            stats["bytes_before"] += before
            stats["bytes_after"] += before
            continue
        quantized = QuantizedLinear(linear, scheme, group_size)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, quantized)
        stats["quantized"] += 1
        stats["bytes_before"] += before
        stats["bytes_after"] += quantized.weight_bytes
    return stats
