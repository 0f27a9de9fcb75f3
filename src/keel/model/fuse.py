"""Fused projections for serving: q, k and v as one matmul, gate and up as one.

Why: at decode every projection is a matrix-vector product whose cost on CPUs is mostly per call;
one product over the concatenated weights reads the same bytes in fewer, larger calls (timings in
docs/BENCHMARKS.md, "Fused projections"), and the outputs are bit-identical: each output is the
same row's dot product. Done at load by the serving engine, where all the parts are plain float
`nn.Linear`s or layers that fuse themselves (`fused_with`: keel's block-quantized layers, whose int8
activations are quantized once for the fused product, as they would be for each part); training
keeps the separate projections (its tensor-parallel plans and checkpoints name them). The separate
modules are removed, so the fused weights take no extra memory.
"""

from __future__ import annotations

import torch
from torch import nn

from keel.model.attention import Attention
from keel.model.layers import SwiGLU


def _concat(parts: list[nn.Module]) -> nn.Module | None:
    fused_with = getattr(parts[0], "fused_with", None)
    if callable(fused_with):
        return fused_with(parts[1:])
    if any(type(p) is not nn.Linear for p in parts):
        return None
    first = parts[0]
    if any(p.weight.dtype != first.weight.dtype or p.weight.device != first.weight.device for p in parts):
        return None
    if any((p.bias is None) != (first.bias is None) for p in parts):
        return None
    out = sum(p.out_features for p in parts)
    fused = nn.Linear(first.in_features, out, bias=first.bias is not None, device="meta")
    fused.weight = nn.Parameter(torch.cat([p.weight.data for p in parts]), requires_grad=False)
    if first.bias is not None:
        fused.bias = nn.Parameter(torch.cat([p.bias.data for p in parts]), requires_grad=False)
    return fused


@torch.no_grad()
def fuse_projections(model: nn.Module) -> int:
    """Fuse every attention's q/k/v and every dense MLP's gate/up in place; the number fused."""
    fused = 0
    for module in model.modules():
        # (no q_proj: JetMoE's attention experts project the queries, keel.model.moa)
        if (
            isinstance(module, Attention)
            and module.qkv_proj is None
            and module.q_proj is not None
            and module.kv_source == module.layer
        ):
            parts = [p for p in (module.q_proj, module.k_proj, module.v_proj) if p is not None]  # k = v: no v_proj
            qkv = _concat(parts)
            if qkv is not None:
                module.qkv_sizes = [p.out_features for p in parts]
                module.qkv_proj = qkv
                del module.q_proj, module.k_proj, module.v_proj
                fused += 1
        elif isinstance(module, SwiGLU) and module.gate_up_proj is None and module.gate_proj is not None:
            gate_up = _concat([module.gate_proj, module.up_proj])
            if gate_up is not None:
                module.gate_up_proj = gate_up
                del module.gate_proj, module.up_proj
                fused += 1
    return fused
