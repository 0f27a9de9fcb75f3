"""EXAONE 4.0 (`Exaone4ForCausalLM`): norms on each sublayer's output (x + norm(attn(x)), then x + norm(mlp(x)):
its `post_attention_layernorm` and `post_feedforward_layernorm` are keel's `attn_output_norm` and
`mlp_output_norm`, as OLMo 2's), q/k RMSNorms per head, and hybrid attention: with a `sliding_window`, the
sliding layers of `layer_types` rotate q and k and the global ones use no position encoding (keel's
`rope_layers`); without one, every layer is global and rotates.
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError
from keel.families import olmo2
from keel.families.windows import sliding_layer_types

FAMILY = "exaone4"
HF_ARCHITECTURE = "Exaone4ForCausalLM"
# transformers' Exaone4Config defaults.
DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": 32,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "bos_token_id": 0,
    "eos_token_id": [2],
}
SLIDING_WINDOW = 4096
PATTERN = 4  # the default layer_types: every fourth layer global


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    layers = int(hf["num_hidden_layers"])
    window = hf.get("sliding_window", SLIDING_WINDOW)
    if window is None:
        layer_types = ["full_attention"] * layers
    else:
        pattern = hf.get("sliding_window_pattern", PATTERN)
        if isinstance(pattern, str):  # "LLLG": the pattern of layers from layer 0, repeated
            pattern = len(pattern)
        # A null pattern beside the file's own layer_types: those decide (transformers' config reads nothing else).
        layer_types = sliding_layer_types(hf, int(pattern or PATTERN))
    if len(layer_types) != layers:
        raise ConfigError(f"{source}: layer_types has {len(layer_types)} entries for {layers} layers")
    return {
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "norm_placement": "post",
        "qk_norm": True,
        "sliding_window": window,
        "layer_types": list(layer_types),
        "rope_layers": [window is None or kind == "sliding_attention" for kind in layer_types],
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {"sliding_window": config.sliding_window, "layer_types": list(config.layer_types)}


checkpoint_layout = olmo2.checkpoint_layout
