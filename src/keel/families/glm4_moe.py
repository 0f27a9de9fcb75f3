"""GLM-4.5 / GLM-4.6 (`Glm4MoeForCausalLM`): Llama's pre-norm block with biased q/k/v (`attention_bias`, never o),
optional q/k RMSNorms per head (`use_qk_norm`), rotary over the first half of each head (`partial_rotary_factor`,
rotate-half pairs as keel's), and DeepSeek-V3's mixture of experts: a float32 sigmoid router with a selection-only
bias (`e_score_correction_bias`) and group-limited top-k, renormalised and scaled weights, ungated shared experts,
dense MLPs in the first `first_k_dense_replace` layers (keel.config reads these as for DeepSeek-V3). Its
checkpoints name the router `mlp.gate` and the shared experts `mlp.shared_experts`, as DeepSeek's. The
multi-token-prediction layers after the last (`num_nextn_predict_layers`) are not read.
"""

from __future__ import annotations

from typing import Any

from keel.families.rope import partial_rotary_factor

FAMILY = "glm4_moe"
HF_ARCHITECTURE = "Glm4MoeForCausalLM"
# transformers' Glm4MoeConfig defaults (the MoE ones are read by keel.config's DeepSeek-style reader).
DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 131072,
    "bos_token_id": None,
    "eos_token_id": [],
    "num_experts": 128,  # HF: n_routed_experts
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 1408,
    "norm_topk_prob": True,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
}


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    return {
        "partial_rotary_factor": partial_rotary_factor(hf, 0.5),
        "qk_norm": bool(hf.get("use_qk_norm", False)),
        "qkv_bias": bool(hf.get("attention_bias", False)),
        "o_bias": False,
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    """The attention's keys (keel.config writes the experts' as DeepSeek-V3's)."""
    return {
        "attention_bias": config.qkv_bias,
        "use_qk_norm": config.qk_norm,
        "rope_parameters": {**hf["rope_parameters"], "partial_rotary_factor": config.partial_rotary_factor},
    }
