"""Sarvam-M MoE (`SarvamMoEForCausalLM`, model_type sarvam_moe: sarvamai/sarvam-30b): GLM-4.5's model, which
transformers runs it on (keel.families.glm4_moe: DeepSeek-V3's experts, q/k RMSNorms per head), rotating every
channel of each head, under tensor names of its own: `model.word_embeddings`, `attention.query_key_value` (q, k and v
rows in one tensor, read as keel's three), `attention.dense`, `attention.query_layernorm` / `key_layernorm` and the
router's selection bias `mlp.gate.expert_bias`; written back under them. Known by its model_type: transformers saves
it with `Glm4MoeForCausalLM` in `architectures`. Its multi-token-prediction layers (`num_mtp_layers`; the releases
store none) are not read.
"""

from __future__ import annotations

from typing import Any

from keel.families import glm4_moe
from keel.families.rope import partial_rotary_factor

FAMILY = "sarvam_moe"
HF_ARCHITECTURE = "SarvamMoEForCausalLM"
MODEL_TYPE = "sarvam_moe"
# SarvamMoEConfig's attribute_map (the names of sarvam-30b's own config.json).
ATTRIBUTE_MAP = {
    "num_local_experts": "n_routed_experts",
    "num_experts": "n_routed_experts",
    "num_shared_experts": "n_shared_experts",
    "num_mtp_layers": "num_nextn_predict_layers",
    "use_qkv_bias": "attention_bias",
}
# transformers' SarvamMoEConfig defaults (Glm4MoeConfig's where it sets none).
DEFAULTS: dict[str, Any] = {
    **glm4_moe.DEFAULTS,
    "head_dim": 64,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-6,
    "rope_theta": 8_000_000.0,
    "eos_token_id": [1],
    "moe_intermediate_size": 1024,
    "num_experts_per_tok": 6,
    "routed_scaling_factor": 2.5,
}


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    return {
        **glm4_moe.config_fields({"use_qk_norm": True, **hf}, source),
        "partial_rotary_factor": partial_rotary_factor(hf, 1.0),
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return glm4_moe.hf_fields(config, hf)


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """Sarvam's names -> keel's: the embedding, each layer's attention (q/k/v by rows) and the router's bias."""
    q, kv = config.q_size, config.kv_size
    layout: dict[str, dict[str, list[tuple[int, int]] | None]] = {
        "model.word_embeddings.weight": {"model.embed_tokens.weight": None}
    }
    for layer in range(config.num_layers):
        stored, attn = f"model.layers.{layer}.attention", f"model.layers.{layer}.self_attn"
        for kind in ("weight", "bias"):
            layout[f"{stored}.query_key_value.{kind}"] = {
                f"{attn}.q_proj.{kind}": [(0, q)],
                f"{attn}.k_proj.{kind}": [(q, q + kv)],
                f"{attn}.v_proj.{kind}": [(q + kv, q + 2 * kv)],
            }
        layout[f"{stored}.dense.weight"] = {f"{attn}.o_proj.weight": None}
        layout[f"{stored}.query_layernorm.weight"] = {f"{attn}.q_norm.weight": None}
        layout[f"{stored}.key_layernorm.weight"] = {f"{attn}.k_norm.weight": None}
        gate = f"model.layers.{layer}.mlp.gate"
        layout[f"{gate}.expert_bias"] = {f"{gate}.e_score_correction_bias": None}
    return layout
