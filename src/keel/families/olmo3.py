"""OLMo 3 (`Olmo3ForCausalLM`): OLMo 2's block (keel.families.olmo2: norms on each sublayer's output, q/k
RMSNorms over the whole projections) with sliding-window layers (`layer_types`; by default three in four, every
fourth global) whose RoPE may differ from the global layers' (`rope_parameters` by layer kind, read for every
family by keel.config).
"""

from __future__ import annotations

from typing import Any

from keel.families import olmo2
from keel.families.windows import sliding_layer_types

FAMILY = "olmo3"
HF_ARCHITECTURE = "Olmo3ForCausalLM"
# transformers' Olmo3Config defaults.
DEFAULTS: dict[str, Any] = {**olmo2.DEFAULTS, "rope_theta": 500_000.0, "max_position_embeddings": 2048}
SLIDING_WINDOW = 4096
GLOBAL_EVERY = 4  # the default layer_types: every fourth layer global


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    layers = int(hf["num_hidden_layers"])
    window = hf.get("sliding_window", SLIDING_WINDOW)
    layer_types = sliding_layer_types(hf, GLOBAL_EVERY)
    return {
        **olmo2.config_fields(hf, source),
        "sliding_window": window,
        "layer_types": list(layer_types) if window else ["full_attention"] * layers,
        **_legacy_rope(hf),
    }


def _legacy_rope(hf: dict[str, Any]) -> dict[str, Any]:
    """An older config's `rope_scaling` (beside a top-level `rope_theta`, no `rope_parameters`): transformers'
    Olmo3Config gives it to the global layers only, and the sliding layers rotate plainly at its default base
    (the top-level base goes to the global layers alone), so keel's sliding layers get a RoPE of their own."""
    scaling = hf.get("rope_scaling")
    if hf.get("rope_parameters") or not isinstance(scaling, dict):
        return {}
    if scaling.get("rope_type", scaling.get("type", "default")) in (None, "default"):
        return {}
    return {"sliding_rope_theta": DEFAULTS["rope_theta"]}


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {
        **olmo2.hf_fields(config, hf),
        "sliding_window": config.sliding_window,
        "layer_types": list(config.layer_types),
    }


checkpoint_layout = olmo2.checkpoint_layout
