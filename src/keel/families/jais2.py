"""Jais 2 (`Jais2ForCausalLM`: inceptionai/Jais-2-8B-Chat): Llama's attention with LayerNorms (with biases, eps
`layer_norm_eps`) and an ungated MLP (`up_proj`, `down_proj`) whose activation is ReLU squared by default, biases
on every projection where `attention_bias` / `mlp_bias` (both on by default).
"""

from __future__ import annotations

from typing import Any

FAMILY = "jais2"
HF_ARCHITECTURE = "Jais2ForCausalLM"
# transformers' Jais2Config defaults (its layer_norm_eps is keel's rms_norm_eps: the norms' eps).
DEFAULTS: dict[str, Any] = {
    "hidden_act": "relu2",
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 8192,
    "bos_token_id": 0,
    "eos_token_id": [150024],
}


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    bias = bool(hf.get("attention_bias", True))
    eps = hf.get("layer_norm_eps")
    return {
        "norm_type": "layer",
        "norm_bias": True,
        "rms_norm_eps": float(DEFAULTS["rms_norm_eps"] if eps is None else eps),
        "mlp_gated": False,
        "qkv_bias": bias,
        "o_bias": bias,
        "mlp_bias": bool(hf.get("mlp_bias", True)),
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {"layer_norm_eps": config.rms_norm_eps, "attention_bias": config.qkv_bias, "mlp_bias": config.mlp_bias}
