"""Mistral 4 (`Mistral4ForCausalLM`): DeepSeek-V3's block with Mistral's pieces: multi-head latent attention
(rotary on interleaved pairs by default) whose queries take Llama 4's temperature by position (the rope
parameters' `llama_4_scaling_beta` over their `original_max_position_embeddings`, as Ministral 3's; keel's
`query_scale_*`), and DeepSeek's experts behind a softmax router (groups scored by their top two experts' scores,
no selection bias; renormalised and scaled weights). keel.config reads the latent attention and the experts as
DeepSeek-V3's; this file sets the router and the temperature.
"""

from __future__ import annotations

from typing import Any

from keel.families.rope import rope_settings

FAMILY = "mistral4"
HF_ARCHITECTURE = "Mistral4ForCausalLM"
# transformers' Mistral4Config defaults (the MoE and MLA ones are read by keel.config's DeepSeek-style readers).
DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": 32,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 1048576,
    "bos_token_id": 1,
    "eos_token_id": [2],
    "intermediate_size": 12288,
    "num_experts": 128,  # HF: n_routed_experts
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 2048,
    "norm_topk_prob": True,
    "n_shared_experts": 1,
    "first_k_dense_replace": 0,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "q_lora_rank": 1024,
    "kv_lora_rank": 256,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "rope_interleave": True,
}


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    rope = rope_settings(hf)
    beta = float(rope.get("llama_4_scaling_beta") or 0.0)
    temperature = {"query_scale_beta": beta}
    if beta:
        temperature["query_scale_length"] = int(rope.get("original_max_position_embeddings") or 8192)
    return {
        "router_scoring": "softmax",
        "router_bias": False,
        "router_group_score": "top2_sum",
        # DeepSeek-V3's attention_bias: q_a_proj, kv_a_proj_with_mqa and o_proj
        "o_bias": bool(hf.get("attention_bias", False)),
        **temperature,
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    rope = dict(hf.get("rope_parameters") or {})
    if config.query_scale_beta:
        rope.update(llama_4_scaling_beta=config.query_scale_beta)
        rope.setdefault("original_max_position_embeddings", config.query_scale_length)
    # Its head_dim is the whole query/key width (DeepSeek's is the rotary one), the rotary share by the rope
    # parameters' partial_rotary_factor.
    rope.setdefault("partial_rotary_factor", config.qk_rope_head_dim / config.head_dim)
    return {"rope_parameters": rope, "attention_bias": config.o_bias, "head_dim": config.head_dim}
