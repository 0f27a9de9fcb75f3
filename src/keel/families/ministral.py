"""Ministral (`MinistralForCausalLM`: Ministral-8B-Instruct-2410): Mistral's block whose layers are sliding-window
or global by `layer_types` (every layer sliding where a window is set and the file lists no kinds). Ministral 3 is
keel.families.ministral3.
"""

from __future__ import annotations

from typing import Any

FAMILY = "ministral"
HF_ARCHITECTURE = "MinistralForCausalLM"
# transformers' MinistralConfig defaults (MistralConfig's).
DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 131072,
    "bos_token_id": 1,
    "eos_token_id": [2],
}
SLIDING_WINDOW = 4096


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    layers = int(hf["num_hidden_layers"])
    window = hf.get("sliding_window", SLIDING_WINDOW)
    kinds = hf.get("layer_types") or ["sliding_attention" if window is not None else "full_attention"] * layers
    return {"sliding_window": window, "layer_types": list(kinds) if window else ["full_attention"] * layers}


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {"sliding_window": config.sliding_window, "layer_types": list(config.layer_types)}
