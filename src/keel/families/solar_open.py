"""Solar Open (`SolarOpenForCausalLM`: Solar-Open-100B): Llama's attention (q/k/v biased where `attention_bias`,
never o; rotary over whole heads, no q/k norms) with GLM-4.5's mixture of experts in every layer (keel.config reads
its DeepSeek-V3 keys: a float32 sigmoid router with a selection-only bias, renormalised and scaled weights, ungated
shared experts; no dense first layers).
"""

from __future__ import annotations

from typing import Any

FAMILY = "solar_open"
HF_ARCHITECTURE = "SolarOpenForCausalLM"
# transformers' SolarOpenConfig defaults (the MoE ones are read by keel.config's DeepSeek-style reader).
DEFAULTS: dict[str, Any] = {
    "head_dim": 128,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1_000_000.0,
    "max_position_embeddings": 131072,
    "bos_token_id": None,
    "eos_token_id": [],
    "num_experts": 128,  # HF: n_routed_experts
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 1280,
    "norm_topk_prob": True,
    "n_shared_experts": 1,
    "first_k_dense_replace": 0,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
}


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    return {"qkv_bias": bool(hf.get("attention_bias", False)), "o_bias": False}


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {"attention_bias": config.qkv_bias}
