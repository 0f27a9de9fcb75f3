"""Nemotron (`NemotronForCausalLM`: Nemotron-4 Minitron, Nemotron-Mini): Llama's attention with rotary over the
first half of each head (`partial_rotary_factor`, 0.5 by default), LayerNorms with biases that scale by
(1 + weight) (its LayerNorm1P: keel's `norm_weight_offset` on a LayerNorm; eps `norm_eps`), and an ungated MLP
(`up_proj`, `down_proj`) of ReLU squared by default; biases on q/k/v/o where `attention_bias`, on the MLP where
`mlp_bias`.
"""

from __future__ import annotations

from typing import Any

from keel.families.rope import partial_rotary_factor

FAMILY = "nemotron"
HF_ARCHITECTURE = "NemotronForCausalLM"
# transformers' NemotronConfig defaults (its norm_eps is keel's rms_norm_eps: the norms' eps).
DEFAULTS: dict[str, Any] = {
    "hidden_act": "relu2",
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "bos_token_id": 2,
    "eos_token_id": [3],
}


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    bias = bool(hf.get("attention_bias", False))
    eps = hf.get("norm_eps")
    return {
        "norm_type": "layer",
        "norm_bias": True,
        "norm_weight_offset": 1.0,
        "rms_norm_eps": float(DEFAULTS["rms_norm_eps"] if eps is None else eps),
        "partial_rotary_factor": partial_rotary_factor(hf, 0.5),
        "mlp_gated": False,
        "qkv_bias": bias,
        "o_bias": bias,
        "mlp_bias": bool(hf.get("mlp_bias", False)),
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {
        "norm_eps": config.rms_norm_eps,
        "attention_bias": config.qkv_bias,
        "mlp_bias": config.mlp_bias,
        "rope_parameters": {**hf["rope_parameters"], "partial_rotary_factor": config.partial_rotary_factor},
    }
