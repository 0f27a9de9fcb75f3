"""ERNIE 4.5 MoE (`Ernie4_5_MoeForCausalLM`: ERNIE-4.5-21B-A3B, 300B-A47B): ERNIE 4.5's dense block
(keel.families.ernie4_5: biases where `use_bias`, a tied head by default, rotary on interleaved pairs) with experts
in the layers `moe_layer_start_index`..`moe_layer_end_index` every `moe_layer_interval`: a float32 softmax router
whose top-k is chosen with a selection-only bias (`moe_statics.e_score_correction_bias`, stored [1, E]) and whose
weights are renormalised, plus ungated shared experts (`mlp.shared_experts`).
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError
from keel.families import ernie4_5

FAMILY = "ernie4_5_moe"
HF_ARCHITECTURE = "Ernie4_5_MoeForCausalLM"
# transformers' Ernie4_5_MoeConfig defaults.
DEFAULTS: dict[str, Any] = {
    **ernie4_5.DEFAULTS,
    "head_dim": None,
    "num_key_value_heads": 4,
}  # its head_dim: hidden / heads


def _moe_layers(hf: dict[str, Any], layers: int) -> list[bool]:
    """transformers' rule: a layer has experts when (i + 1) % interval == 0 and start <= i <= end (-1: the last)."""
    start, interval = int(hf.get("moe_layer_start_index", 1)), int(hf.get("moe_layer_interval", 1))
    end = int(hf.get("moe_layer_end_index", -1))
    end = layers - 1 if end == -1 else end
    return [(i + 1) % interval == 0 and start <= i <= end for i in range(layers)]


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    width = int(hf.get("moe_intermediate_size", 1536))
    moe = _moe_layers(hf, int(hf["num_hidden_layers"]))
    return {
        **ernie4_5.config_fields(hf, source),
        "num_experts": int(hf.get("moe_num_experts", 64)),
        "num_experts_per_tok": int(hf.get("moe_k", 6)),
        "moe_intermediate_size": width,
        "shared_expert_intermediate_size": width * int(hf.get("moe_num_shared_experts", 2)),
        "shared_expert_gated": False,
        "mlp_only_layers": [i for i, sparse in enumerate(moe) if not sparse],
        "router_bias": True,
        "norm_topk_prob": True,
        # transformers' Ernie4_5_MoeForCausalLM gives its head a bias where `use_bias` (the dense model's has none)
        "lm_head_bias": bool(hf.get("use_bias", False)),
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    sparse = [config.is_moe_layer(i) for i in range(config.num_layers)]
    first = sparse.index(True) if any(sparse) else config.num_layers
    last = config.num_layers - 1 - sparse[::-1].index(True) if any(sparse) else -1
    if sparse != [first <= i <= last for i in range(config.num_layers)]:
        raise ConfigError(f"ernie4_5_moe: the expert layers {sparse} are not one run (moe_layer_start/end_index)")
    width = config.moe_intermediate_size
    return {
        **ernie4_5.hf_fields(config, hf),
        "moe_num_experts": config.num_experts,
        "moe_k": config.num_experts_per_tok,
        "moe_intermediate_size": width,
        "moe_num_shared_experts": config.shared_expert_intermediate_size // width if width else 0,
        "moe_layer_start_index": first,
        "moe_layer_end_index": last,
        "moe_layer_interval": 1,
    }


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """ERNIE 4.5's q/k rows regrouped for keel's rotary, and the selection bias under the router's name."""
    layout = ernie4_5.checkpoint_layout(config)
    for layer in range(config.num_layers):
        if config.is_moe_layer(layer):
            stored = f"model.layers.{layer}.mlp.moe_statics.e_score_correction_bias"
            layout[stored] = {f"model.layers.{layer}.mlp.gate.e_score_correction_bias": None}
    return layout


def stored_tensor(name: str, tensor: Any) -> Any:
    """A tensor as the family's checkpoints store it: the selection bias [E] as [1, E] (one group of experts)."""
    return tensor.reshape(1, -1) if name.endswith("moe_statics.e_score_correction_bias") else tensor
