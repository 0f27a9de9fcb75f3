"""Mellum 2 (`MellumForCausalLM`: JetBrains/Mellum2-12B-A2.5B): Qwen3-MoE's attention (per-head q/k RMSNorms, biases
on q/k/v and o where `attention_bias`) in sliding-window or global layers by `layer_types`, each kind rotating by
its own rope parameters (transformers' per-kind `rope_parameters`, read as Gemma 3's), and Qwen3-MoE's experts (a
float32 softmax router, the top `num_experts_per_tok` renormalised where `norm_topk_prob`, no shared expert) where
`mlp_layer_types` says sparse, a dense SwiGLU elsewhere. Its multi-token-prediction layer (`mtp.*`) is not read.
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError
from keel.families.layer_kinds import dense_layers, mlp_layer_types

FAMILY = "mellum"
HF_ARCHITECTURE = "MellumForCausalLM"
# MellumConfig's attribute_map.
ATTRIBUTE_MAP = {"num_experts": "num_local_experts", "num_mtp_layers": "num_nextn_predict_layers"}
# transformers' MellumConfig defaults (Qwen3MoeConfig's where it sets none).
DEFAULTS: dict[str, Any] = {
    "head_dim": 128,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-6,
    "rope_theta": 500_000.0,
    "max_position_embeddings": 131072,
    "bos_token_id": None,
    "eos_token_id": [],
}
# MellumConfig's rope parameters where a file has none: a base of its own for each layer kind.
DEFAULT_ROPE: dict[str, Any] = {
    "full_attention": {"rope_type": "default", "rope_theta": 500_000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
}


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    bias = bool(hf.get("attention_bias", False))
    return {
        "qk_norm": True,
        "qkv_bias": bias,
        "o_bias": bias,
        "partial_rotary_factor": _partial_rotary(hf, source),
        "num_experts": int(hf.get("num_local_experts", 64)),
        "num_experts_per_tok": int(hf.get("num_experts_per_tok", 8)),
        "moe_intermediate_size": int(hf.get("moe_intermediate_size", 896)),
        "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
        "mlp_only_layers": dense_layers(hf, source, 0),
    }


def _partial_rotary(hf: dict[str, Any], source: str) -> float:
    """The share of each head that rotates: Mellum's rotary embedding takes it per layer kind, keel one for all."""
    params = hf.get("rope_parameters") or {}
    kinds = params.values() if isinstance(params.get("full_attention"), dict) else [params]
    shares = {float(kind.get("partial_rotary_factor", 1.0)) for kind in kinds}
    if len(shares) > 1:
        raise ConfigError(f"{source}: rope_parameters with a partial_rotary_factor per layer kind is not supported")
    return shares.pop() if shares else 1.0


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    rope = hf["rope_parameters"]
    kinds = rope.values() if isinstance(rope.get("full_attention"), dict) else [rope]
    for kind in kinds:
        kind["partial_rotary_factor"] = config.partial_rotary_factor
    return {
        "attention_bias": config.qkv_bias,
        "num_local_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "moe_intermediate_size": config.moe_intermediate_size,
        "norm_topk_prob": config.norm_topk_prob,
        "mlp_layer_types": mlp_layer_types(config),
        "layer_types": list(config.layer_types),
        "sliding_window": config.sliding_window,
    }
