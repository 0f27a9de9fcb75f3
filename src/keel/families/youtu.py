"""Youtu-LLM (`YoutuForCausalLM`: tencent/Youtu-LLM-2B): DeepSeek-V3's multi-head latent attention (keel.config
reads it as DeepSeek's: rotary on interleaved pairs by default, `rope_interleave`; `attention_bias` on q_a_proj,
kv_a_proj_with_mqa and o_proj) in Llama's pre-norm block with a dense SwiGLU MLP in every layer, and the LM head
tied to the embedding by default.
"""

from __future__ import annotations

from typing import Any

FAMILY = "youtu"
HF_ARCHITECTURE = "YoutuForCausalLM"
# transformers' YoutuConfig defaults (the latent attention's are DeepseekV3Config's).
DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": 16,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 131072,
    "bos_token_id": 128000,
    "eos_token_id": [128001],
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "rope_interleave": True,
}


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    bias = bool(hf.get("attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias, "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True))}


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {"attention_bias": config.qkv_bias}
