"""SmolLM3 (`SmolLM3ForCausalLM`): Llama's block where some layers use no position encoding at all ("NoPE"):
`no_rope_layers[i]` is 1 where layer i rotates q and k, 0 where it does not (by default every
`no_rope_layer_interval`-th layer, the fourth), read as keel's `rope_layers`. Biases on q/k/v and o
(`attention_bias`) and on the MLP (`mlp_bias`). With `use_sliding_window` the NoPE layers may attend within a
sliding window (`layer_types`, as transformers' config builds it).
"""

from __future__ import annotations

from typing import Any

from keel.families.layer_kinds import rotating_layers

FAMILY = "smollm3"
HF_ARCHITECTURE = "SmolLM3ForCausalLM"
# transformers' SmolLM3Config defaults.
DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-6,
    "rope_theta": 2_000_000.0,
    "max_position_embeddings": 32768,
    "bos_token_id": 128000,
    "eos_token_id": [128001],
}
NO_ROPE_LAYER_INTERVAL = 4


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    layers = int(hf["num_hidden_layers"])
    rotates = rotating_layers(hf, source, NO_ROPE_LAYER_INTERVAL)
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    layer_types = hf.get("layer_types") or [
        "sliding_attention" if window is not None and not rotates[i] else "full_attention" for i in range(layers)
    ]
    bias = bool(hf.get("attention_bias", False))
    return {
        "rope_layers": rotates,
        "sliding_window": window,
        "layer_types": list(layer_types) if window is not None else ["full_attention"] * layers,
        "qkv_bias": bias,
        "o_bias": bias,
        "mlp_bias": bool(hf.get("mlp_bias", False)),
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {
        "no_rope_layers": [int(config.layer_rotates(i)) for i in range(config.num_layers)],
        "use_sliding_window": config.sliding_window is not None,
        "sliding_window": config.sliding_window,
        "layer_types": list(config.layer_types),
        "attention_bias": config.qkv_bias,
        "mlp_bias": config.mlp_bias,
    }
