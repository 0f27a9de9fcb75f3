"""Arcee AFM (`ArceeForCausalLM`): Llama's block with an ungated MLP, down(relu(up(x))^2) (`hidden_act` relu2;
keel's `mlp_gated` false).
"""

from __future__ import annotations

from typing import Any

from keel.families.llama_biases import bias_fields, bias_keys

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
    return {"mlp_gated": False, **bias_fields(hf)}


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return bias_keys(config)
