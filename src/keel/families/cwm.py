"""Code World Model (`CwmForCausalLM`: facebook/cwm): Llama's block whose layers attend globally or within a sliding
window by `layer_types` (transformers' default where the file lists none: every fourth layer global, from the first),
with Llama 3's rotary scaling by default.
"""

from __future__ import annotations

from typing import Any

FAMILY = "cwm"
HF_ARCHITECTURE = "CwmForCausalLM"
# transformers' CwmConfig defaults.
DEFAULTS: dict[str, Any] = {
    "head_dim": 128,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1_000_000.0,
    "max_position_embeddings": 131072,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}
SLIDING_WINDOW = 8192
WINDOW_PATTERN = 4
# CwmConfig's rope parameters where a file names neither rope_parameters nor rope_scaling (keel.config reads them).
DEFAULT_ROPE: dict[str, Any] = {
    "rope_type": "llama3",
    "rope_theta": 1_000_000.0,
    "factor": 16.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
}


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    layers = int(hf["num_hidden_layers"])
    window = hf.get("sliding_window", SLIDING_WINDOW)
    kinds = hf.get("layer_types") or [
        "full_attention" if i % WINDOW_PATTERN == 0 else "sliding_attention" for i in range(layers)
    ]
    return {
        "sliding_window": int(window) if window else None,
        "layer_types": list(kinds) if window else ["full_attention"] * layers,
        "mlp_bias": bool(hf.get("mlp_bias", False)),
        # transformers' model has no attention biases, whatever an attention_bias key says
        "qkv_bias": False,
        "o_bias": False,
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {
        "sliding_window": config.sliding_window,
        "layer_types": list(config.layer_types),
        "mlp_bias": config.mlp_bias,
    }
