"""Ministral 3 (`Ministral3ForCausalLM`, the text model of Mistral 3): Mistral's block with YaRN and Llama 4's
attention temperature: queries at position p are scaled by 1 + beta * log(1 + floor(p / L)), with beta the rope
parameters' `llama_4_scaling_beta` and L their `original_max_position_embeddings` (keel's `query_scale_beta` and
`query_scale_length`), after the rotary embedding.
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError
from keel.families.rope import rope_settings

FAMILY = "ministral3"
HF_ARCHITECTURE = "Ministral3ForCausalLM"
# transformers' Ministral3Config defaults.
DEFAULTS: dict[str, Any] = {
    "head_dim": 128,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1_000_000.0,
    "max_position_embeddings": 262_144,
    "bos_token_id": 1,
    "eos_token_id": [2],
}


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    rope = rope_settings(hf)
    beta = float(rope.get("llama_4_scaling_beta") or 0.0)
    fields: dict[str, Any] = {"query_scale_beta": beta}
    if beta:
        length = rope.get("original_max_position_embeddings")
        if not length:
            raise ConfigError(f"{source}: llama_4_scaling_beta needs rope_parameters.original_max_position_embeddings")
        fields["query_scale_length"] = int(length)
    return fields


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    rope = dict(hf["rope_parameters"])
    if config.query_scale_beta:
        rope.update(llama_4_scaling_beta=config.query_scale_beta)
        rope.setdefault("original_max_position_embeddings", config.query_scale_length)
    return {"rope_parameters": rope, "sliding_window": config.sliding_window}
