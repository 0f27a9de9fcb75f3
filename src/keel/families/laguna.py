"""Laguna (`LagunaForCausalLM`: poolside's Laguna): AFMoE's attention (per-head q/k RMSNorms before the rotary
embedding, `attention_bias` on q/k/v/o) in sliding-window or full layers (`layer_types`, by default all full), every
layer rotating over its kind's share of each head with its kind's base (by default the full layers half of each head
at theta 5e5, the sliding ones all of it at 1e4: keel's `partial_rotary_factor`, `sliding_partial_rotary_factor` and
`sliding_rope_theta`), the output gated by the softplus of `g_proj` (keel's `attention_gate_activation` softplus),
one gate per head (`gating` true or "per-head": `attention_gate_per_head`) or per channel, and Qwen3-MoE's experts
where `mlp_layer_types` says sparse (by default all but the first): a sigmoid router with a selection bias
(`mlp.experts.e_score_correction_bias`), its logits capped at `moe_router_logit_softcapping` where positive, the top k
always renormalised, the routed output times `moe_routed_scaling_factor`, plus an ungated shared expert.

Refused by name: a head count per layer (`num_attention_heads_per_layer` other than `num_attention_heads` in every
layer) and `moe_apply_router_weight_on_input` (neither does transformers run it).
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError
from keel.families.layer_kinds import dense_layers, mlp_layer_types
from keel.families.rope import rope_per_kind

FAMILY = "laguna"
HF_ARCHITECTURE = "LagunaForCausalLM"
# transformers' LagunaConfig defaults.
DEFAULTS: dict[str, Any] = {
    "head_dim": 128,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-6,
    "rope_theta": 500000.0,
    "max_position_embeddings": 131072,
    "bos_token_id": None,
    "eos_token_id": [],
}
# LagunaConfig's rope parameters where a file has none.
DEFAULT_ROPE: dict[str, Any] = {
    "full_attention": {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
}


def _refuse(hf: dict[str, Any], source: str) -> None:
    heads = hf.get("num_attention_heads_per_layer")
    if heads is not None and any(int(h) != int(hf["num_attention_heads"]) for h in heads):
        raise ConfigError(f"{source}: num_attention_heads_per_layer {heads} is not supported (one head count)")
    if hf.get("moe_apply_router_weight_on_input"):
        raise ConfigError(f"{source}: moe_apply_router_weight_on_input true is not supported (Laguna)")


def _rope_share(hf: dict[str, Any], kind: str) -> float:
    rope = hf.get("rope_parameters") or DEFAULT_ROPE
    spec = rope.get(kind) if isinstance(rope, dict) and kind in rope else rope
    return float(spec.get("partial_rotary_factor", 1.0)) if isinstance(spec, dict) else 1.0


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    _refuse(hf, source)
    layers = int(hf["num_hidden_layers"])
    kinds = list(hf.get("layer_types") or ["full_attention"] * layers)
    if len(kinds) != layers or not set(kinds) <= {"full_attention", "sliding_attention"}:
        raise ConfigError(f"{source}: layer_types must give full_attention or sliding_attention for {layers} layers")
    bias = bool(hf.get("attention_bias", False))
    gating = hf.get("gating", True)
    cap = float(hf.get("moe_router_logit_softcapping") or 0.0)
    sliding = "sliding_attention" in kinds
    rope = hf.get("rope_parameters")
    per_kind = isinstance(rope, dict) and "sliding_attention" in rope  # then the common reader reads its own RoPE
    return {
        "qk_norm": True,
        "qkv_bias": bias,
        "o_bias": bias,
        "attention_output_gate": True,
        "attention_gate_per_head": gating is True or gating == "per-head",
        "attention_gate_activation": "softplus",
        "sliding_window": int(hf.get("sliding_window") or 512) if sliding else None,
        "layer_types": kinds,
        "partial_rotary_factor": _rope_share(hf, "full_attention"),
        # the sliding layers' own RoPE (sliding_rope_theta, read by keel.config) and its share
        "sliding_partial_rotary_factor": _rope_share(hf, "sliding_attention") if per_kind else None,
        "num_experts": int(hf.get("num_experts", 256)),
        "num_experts_per_tok": int(hf.get("num_experts_per_tok", 8)),
        "moe_intermediate_size": int(hf.get("moe_intermediate_size", 512)),
        "shared_expert_intermediate_size": int(hf.get("shared_expert_intermediate_size", 512)),
        "shared_expert_gated": False,
        "norm_topk_prob": True,
        "router_scoring": "sigmoid",
        "router_bias": True,
        "router_logit_softcapping": cap if cap > 0 else None,
        "routed_scaling_factor": float(hf.get("moe_routed_scaling_factor", 1.0)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense_layers(hf, source, first_dense=1),
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    rope = rope_per_kind(config, hf)
    return {
        "attention_bias": config.qkv_bias,
        "gating": True if config.attention_gate_per_head else "per-element",
        "sliding_window": config.sliding_window,
        "layer_types": list(config.layer_types),
        "rope_parameters": rope,
        "mlp_layer_types": mlp_layer_types(config),
        "shared_expert_intermediate_size": config.shared_expert_intermediate_size,
        "moe_routed_scaling_factor": config.routed_scaling_factor,
        "moe_router_logit_softcapping": config.router_logit_softcapping or 0.0,
    }


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """The output gate (`g_proj`) and the selection bias (kept beside the experts) under keel's names."""
    layout: dict[str, dict[str, list[tuple[int, int]] | None]] = {}
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}"
        layout[f"{p}.self_attn.g_proj.weight"] = {f"{p}.self_attn.output_gate.weight": None}
        if config.is_moe_layer(layer):
            layout[f"{p}.mlp.experts.e_score_correction_bias"] = {f"{p}.mlp.gate.e_score_correction_bias": None}
    return layout
