"""OLMoE (`OlmoeForCausalLM`): Llama's pre-norm block with RMSNorms over the whole q and k projections (keel's
`qk_norm_scope` all, as OLMo 2's) and a mixture of experts in every layer: a softmax router, the top
`num_experts_per_tok` of `num_experts` (renormalised where `norm_topk_prob`), experts `intermediate_size` wide;
q, k and v clamped to +-`clip_qkv` after the projections and q/k norms (keel's `clip_qkv`).
"""

from __future__ import annotations

from typing import Any

FAMILY = "olmoe"
HF_ARCHITECTURE = "OlmoeForCausalLM"
# transformers' OlmoeConfig defaults.
DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "bos_token_id": None,
    "eos_token_id": [50279],
}


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    clip = hf.get("clip_qkv")
    return {**moe_fields(hf, experts=64, per_token=8, width=2048), "clip_qkv": None if clip is None else float(clip)}


def moe_fields(hf: dict[str, Any], experts: int, per_token: int, width: int) -> dict[str, Any]:
    """OLMoE's whole-projection q/k norms and experts, with the config class's defaults of the expert counts and
    width (FlexOlmo's differ)."""
    width = int(hf.get("intermediate_size", width))
    bias = bool(hf.get("attention_bias", False))
    return {
        "qk_norm": True,
        "qk_norm_scope": "all",
        "qkv_bias": bias,
        "o_bias": bias,
        "num_experts": int(hf.get("num_experts", hf.get("num_local_experts", experts))),  # transformers' alias
        "num_experts_per_tok": int(hf.get("num_experts_per_tok", per_token)),
        "moe_intermediate_size": width,
        "intermediate_size": width,
        "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {**moe_hf_fields(config), "clip_qkv": config.clip_qkv}


def moe_hf_fields(config: Any) -> dict[str, Any]:
    return {
        "attention_bias": config.qkv_bias,
        "num_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "intermediate_size": config.moe_intermediate_size,
        "norm_topk_prob": config.norm_topk_prob,
    }
