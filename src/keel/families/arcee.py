"""Arcee AFM (`ArceeForCausalLM`): Llama's block with an ungated MLP, down(relu(up(x))^2) (`hidden_act` relu2;
keel's `mlp_gated` false).
"""

from __future__ import annotations

from typing import Any

FAMILY = "arcee"
HF_ARCHITECTURE = "ArceeForCausalLM"
# transformers' ArceeConfig defaults.
DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "bos_token_id": 128000,
    "eos_token_id": [128001],
    "hidden_act": "relu2",
}


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    return {
        "mlp_gated": False,
        "qkv_bias": bool(hf.get("attention_bias", False)),
        "o_bias": bool(hf.get("attention_bias", False)),
        "mlp_bias": bool(hf.get("mlp_bias", False)),
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {"attention_bias": config.qkv_bias, "mlp_bias": config.mlp_bias}
