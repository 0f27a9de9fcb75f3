"""GLM-4.7-Flash and kin (`Glm4MoeLiteForCausalLM`): DeepSeek-V3's block under another config: multi-head latent
attention (rotary on interleaved pairs by default, `rope_interleave`) and GLM-4.5's DeepSeek-style experts, whose
dense and sparse layers are listed by `mlp_layer_types` (by default the first dense, the rest sparse) rather than
DeepSeek's `first_k_dense_replace`. keel.config reads the latent attention and the experts as DeepSeek-V3's; the
multi-token-prediction layer after the last is not read.
"""

from __future__ import annotations

from typing import Any

from keel.families.layer_kinds import dense_layers, mlp_layer_types

FAMILY = "glm4_moe_lite"
HF_ARCHITECTURE = "Glm4MoeLiteForCausalLM"
# transformers' Glm4MoeLiteConfig defaults (the MoE and MLA ones are read by keel.config's DeepSeek-style readers).
DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": 20,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 202752,
    "bos_token_id": 0,
    "eos_token_id": [1],
    "intermediate_size": 10240,
    "num_experts": 64,  # HF: n_routed_experts
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 1536,
    "norm_topk_prob": True,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.8,
    "q_lora_rank": 768,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "rope_interleave": True,
}


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    return {
        "mlp_only_layers": dense_layers(hf, source, first_dense=1),
        # DeepSeek-V3's attention_bias: q_a_proj, kv_a_proj_with_mqa and o_proj
        "o_bias": bool(hf.get("attention_bias", False)),
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {
        "mlp_layer_types": mlp_layer_types(config),
        "attention_bias": config.o_bias,
    }
