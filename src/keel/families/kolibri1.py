"""Kolibri 1 (`Kolibri1ForCausalLM`: Aleph-Alpha's Kolibri-1): EXAONE 4's attention (q/k RMSNorms per head; with a
`sliding_window`, the sliding layers of `layer_types` rotate and the global ones use no position encoding; by
default every fifth layer global) in GLM-4's sandwich block (a norm before and after each sublayer; its
`post_attn_norm` and `post_ffn_norm` are keel's `attn_output_norm` and `mlp_output_norm`), and experts in every
layer: a float32 sigmoid router that chooses the top k of logits + `e_score_correction_bias` (keel's
`router_bias_on_logits`, stored as `moe.router.expert_bias`) and weights them by the sigmoids of their logits
(renormalised where `norm_topk_prob`; no routed scaling), beside one ungated shared SwiGLU expert of
`shared_expert_intermediate_size`.
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError
from keel.families.windows import sliding_layer_types

FAMILY = "kolibri1"
HF_ARCHITECTURE = "Kolibri1ForCausalLM"
# transformers' Kolibri1Config defaults (Qwen3MoeConfig's where it keeps them).
DEFAULTS: dict[str, Any] = {
    "head_dim": 128,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 262144,
    "bos_token_id": None,
    "eos_token_id": [],
}
SLIDING_WINDOW = 513
GLOBAL_EVERY = 5  # the default layer_types: every fifth layer global


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    layers = int(hf["num_hidden_layers"])
    window = hf.get("sliding_window", SLIDING_WINDOW)
    kinds = sliding_layer_types(hf, GLOBAL_EVERY)
    if len(kinds) != layers:
        raise ConfigError(f"{source}: layer_types has {len(kinds)} entries for {layers} layers")
    if "sliding_attention" in kinds and not window:
        raise ConfigError(f"{source}: sliding layers need a positive sliding_window, got {window!r}")
    return {
        "norm_placement": "sandwich",
        "qk_norm": True,
        "sliding_window": window,
        "layer_types": kinds,
        # transformers' Kolibri rotates every layer without a window, else only the sliding ones
        "rope_layers": [window is None or kind == "sliding_attention" for kind in kinds],
        # transformers saves its num_experts as num_local_experts (the attribute map it keeps from Qwen3-MoE)
        "num_experts": int(hf.get("num_experts", hf.get("num_local_experts", 384))),
        "num_experts_per_tok": int(hf.get("num_experts_per_tok", 6)),
        "moe_intermediate_size": int(hf.get("moe_intermediate_size", 512)),
        "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
        "shared_expert_intermediate_size": int(hf.get("shared_expert_intermediate_size", 512)),
        "shared_expert_gated": False,
        "router_scoring": "sigmoid",
        "router_bias": True,
        "router_bias_on_logits": True,
        # transformers' model has no attention biases, whatever an attention_bias key says
        "qkv_bias": False,
        "o_bias": False,
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {
        "sliding_window": config.sliding_window,
        "layer_types": list(config.layer_types),
        "num_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "moe_intermediate_size": config.moe_intermediate_size,
        "norm_topk_prob": config.norm_topk_prob,
        "shared_expert_intermediate_size": config.shared_expert_intermediate_size,
    }


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """The output norms and the selection bias under keel's names (renames only)."""
    layout: dict[str, dict[str, list[tuple[int, int]] | None]] = {}
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}"
        layout[f"{p}.post_attn_norm.weight"] = {f"{p}.attn_output_norm.weight": None}
        layout[f"{p}.post_ffn_norm.weight"] = {f"{p}.mlp_output_norm.weight": None}
        layout[f"{p}.moe.router.expert_bias"] = {f"{p}.mlp.gate.e_score_correction_bias": None}
    return layout
