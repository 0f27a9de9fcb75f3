"""The trainer's side of mixture-of-experts: knobs from [moe], per-layer expert load, bias updates.

Each MoE block counts the token-slots it routes to every expert (and drops) during a step. At the
end of the step those counts are summed over the data-parallel ranks (every rank then holds the
global load, so the aux-loss-free bias moves identically everywhere) and, with a pipeline,
gathered from every stage for the metrics line: per layer the tokens per expert, max/mean load
(1.0 = perfect balance) and the dropped fraction.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from keel.errors import ConfigError
from keel.model.moe import MoE, update_routing_bias


def moe_layers(modules: list[nn.Module]) -> dict[int, MoE]:
    """This rank's MoE blocks by global layer index (names keep global indices under a pipeline)."""
    out: dict[int, MoE] = {}
    for module in modules:
        for name, sub in module.named_modules():
            if isinstance(sub, MoE):
                match = re.search(r"layers\.(\d+)\.", name + ".")
                out[int(match.group(1)) if match else len(out)] = sub
    return out


def configure(layers: dict[int, MoE], section: Any) -> None:
    if section.bias_update_rate and any(m.router.e_score_correction_bias is None for m in layers.values()):
        # resolve_layout catches this for inline model configs; a checkpoint source is only known here.
        raise ConfigError("moe: bias_update_rate needs routers with a selection bias (DeepSeek-V3's router_bias)")
    for moe in layers.values():
        moe.aux_loss_coef = section.aux_loss_coef
        moe.z_loss_coef = section.z_loss_coef
        moe.capacity_factor = section.capacity_factor
        moe.track_stats = True
        moe.reset_stats()


def set_aux_grad_scale(layers: dict[int, MoE], scale: float) -> None:
    """The factor the main loss gets before backward (1/accumulation/microbatches, fp16 loss scale)."""
    for moe in layers.values():
        moe.aux_grad_scale = scale


def finish_step(
    layers: dict[int, MoE],
    bias_update_rate: float,
    applied: bool,
    dp_group: dist.ProcessGroup | None,
    pp_group: dist.ProcessGroup | None,
) -> dict[str, Any]:
    """Global expert loads of this step; moves routing biases when the step was applied; returns the
    metrics (identical on every rank) and resets the counters."""
    local: dict[str, Any] = {}
    aux: dict[str, list[float]] = {}
    for index, moe in sorted(layers.items()):
        if moe.routed is None:
            continue
        packed = torch.cat([moe.routed, moe.dropped.reshape(1)])
        if dp_group is not None and dist.get_world_size(dp_group) > 1:
            dist.all_reduce(packed, group=dp_group)
        routed, dropped = packed[:-1], packed[-1].item()
        if applied:
            update_routing_bias(moe.router, routed, bias_update_rate)
        total = routed.sum().item()
        local[str(index)] = {
            "tokens_per_expert": [int(c) for c in routed.tolist()],
            "max_over_mean": (routed.max() / routed.mean()).item() if total else None,
            "dropped_fraction": dropped / total if total else 0.0,
        }
        for key, value in moe.aux_losses.items():
            aux.setdefault(key, []).append(value.item())
        moe.reset_stats()
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        parts: list[Any] = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(parts, (local, aux), group=pp_group)
        local, aux = {}, {}
        for layer_stats, layer_aux in parts:
            local.update(layer_stats)
            for key, values in layer_aux.items():
                aux.setdefault(key, []).extend(values)
    if not local:
        return {}
    record: dict[str, Any] = {"moe": dict(sorted(local.items(), key=lambda kv: int(kv[0])))}
    imbalances = [v["max_over_mean"] for v in local.values() if v["max_over_mean"] is not None]
    if imbalances:
        record["moe_max_over_mean"] = max(imbalances)
    record["moe_dropped_fraction"] = sum(v["dropped_fraction"] for v in local.values()) / len(local)
    for key, values in aux.items():
        record[f"moe_{key}_loss"] = sum(values) / len(values)
    return record
