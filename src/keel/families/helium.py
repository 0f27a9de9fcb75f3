"""Helium (`HeliumForCausalLM`: kyutai/helium-1-2b): Llama's block with rotary on interleaved pairs over the whole
head (q's and k's rows read regrouped, as GLM-4's are: keel.families.rope), biases on q/k/v only where
`attention_bias` (never on o_proj), and RMSNorms of eps 1e-8 by default.
"""

from __future__ import annotations

from typing import Any

from keel.families.rope import interleaved_qk_layout

FAMILY = "helium"
HF_ARCHITECTURE = "HeliumForCausalLM"
# transformers' HeliumConfig defaults.
DEFAULTS: dict[str, Any] = {
    "head_dim": 128,
    "num_key_value_heads": 20,
    "rms_norm_eps": 1e-8,
    "rope_theta": 100000.0,
    "max_position_embeddings": 4096,
    "bos_token_id": 1,
    "eos_token_id": [2],
}


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    return {"qkv_bias": bool(hf.get("attention_bias", False)), "o_bias": False, "mlp_bias": bool(hf.get("mlp_bias"))}


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {"attention_bias": config.qkv_bias, "mlp_bias": config.mlp_bias}


checkpoint_layout = interleaved_qk_layout
