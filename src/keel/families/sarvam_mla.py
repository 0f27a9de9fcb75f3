"""Sarvam MLA (`SarvamMLAForCausalLM`, model_type sarvam_mla: sarvamai/sarvam-105b): DeepSeek-V3's model, which
transformers runs it on (multi-head latent attention, without the low-rank query by default; DeepSeek-V3's experts,
routed over one group), under DeepSeek-V3's tensor names. Known by its model_type: transformers saves it with
`DeepseekV3ForCausalLM` in `architectures`. The releases' own config format is read as transformers rewrites it:
expert counts under their aliases, `head_dim` / `q_head_dim` (derived) dropped, rope type `deepseek_yarn` as YaRN.
Its multi-token-prediction layers (`num_mtp_layers`; the releases store none) are not read.
"""

from __future__ import annotations

from typing import Any

FAMILY = "sarvam_mla"
HF_ARCHITECTURE = "SarvamMLAForCausalLM"
MODEL_TYPE = "sarvam_mla"
# SarvamMLAConfig's attribute_map.
ATTRIBUTE_MAP = {
    "num_local_experts": "n_routed_experts",
    "num_experts": "n_routed_experts",
    "num_shared_experts": "n_shared_experts",
    "num_mtp_layers": "num_nextn_predict_layers",
}
# transformers' SarvamMLAConfig defaults (DeepseekV3Config's where it sets none).
DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "bos_token_id": 0,
    "eos_token_id": [1],
    "num_experts": 128,  # HF: n_routed_experts
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 2048,
    "norm_topk_prob": True,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "rope_interleave": True,
}


def upgrade_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The releases' format as SarvamMLAConfig rewrites it (its __post_init__)."""
    hf = {key: value for key, value in hf.items() if key not in ("head_dim", "q_head_dim")}
    scaling = hf.get("rope_scaling") or {}
    if "deepseek_yarn" in (scaling.get("type"), scaling.get("rope_type")):
        hf["rope_scaling"] = {key: value for key, value in scaling.items() if key != "type"} | {"rope_type": "yarn"}
    return hf


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    return {}


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {}
