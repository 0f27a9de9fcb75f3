"""Cohere Command R7B and Command A (`Cohere2ForCausalLM`): Command R's block (keel.families.cohere) with
sliding-window layers (`layer_types`; three in four by default) that rotate, and global layers without
position encoding (keel's `rope_layers`).
"""

from __future__ import annotations

from typing import Any

from keel.families import cohere
from keel.families.windows import sliding_layer_types

FAMILY = "cohere2"
HF_ARCHITECTURE = "Cohere2ForCausalLM"
# transformers' Cohere2Config defaults.
DEFAULTS: dict[str, Any] = {**cohere.DEFAULTS, "rope_theta": 10_000.0}
SLIDING_WINDOW = 4096
PATTERN = 4  # the default layer_types: every fourth layer global


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    layers = int(hf["num_hidden_layers"])
    window = hf.get("sliding_window", SLIDING_WINDOW)
    pattern = int(hf.get("sliding_window_pattern") or PATTERN)
    layer_types = sliding_layer_types(hf, pattern)
    if window is None:
        layer_types = ["full_attention"] * layers
    return {
        **cohere.config_fields(hf, source),
        "sliding_window": window,
        "layer_types": list(layer_types),
        # transformers' Cohere2 rotates only where a layer slides
        "rope_layers": [kind == "sliding_attention" for kind in layer_types],
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {
        **cohere.hf_fields(config, hf),
        "sliding_window": config.sliding_window,
        "layer_types": list(config.layer_types),
    }


checkpoint_layout = cohere.checkpoint_layout
