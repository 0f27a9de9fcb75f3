"""Gemma 4 unified, text (`Gemma4UnifiedForCausalLM`, model_type gemma4_unified_text; and the released
`Gemma4UnifiedForConditionalGeneration` checkpoints on text: the decoder under `model.language_model.`, the vision and
audio embedders unread): Gemma 4's decoder (keel.families.gemma4: sandwich norms, q/k and v norms, layer scalars,
full-attention layers of their own geometry with k = v, proportional RoPE) without per-layer input embeddings or the
MoE block, a window of 1024 by default.

Its `use_bidirectional_attention` is "vision" by default: image tokens attend both ways, text causally, so on text
the model is causal and keel reads it so; "all" (every token both ways) is refused by name.
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError
from keel.families import gemma4

FAMILY = "gemma4_unified"
HF_ARCHITECTURE = "Gemma4UnifiedForCausalLM"
# transformers' Gemma4UnifiedTextConfig defaults: Gemma4TextConfig's, a longer context.
DEFAULTS: dict[str, Any] = {**gemma4.DEFAULTS, "max_position_embeddings": 262_144}
DEFAULT_ROPE = gemma4.DEFAULT_ROPE
SLIDING_WINDOW = 1024
# Gemma4TextConfig's keys the unified config class does not have (its per-layer inputs and MoE block)
ABSENT_KEYS = (
    "hidden_size_per_layer_input",
    "vocab_size_per_layer_input",
    "enable_moe_block",
    "num_experts",
    "top_k_experts",
    "moe_intermediate_size",
)


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    mode = hf.get("use_bidirectional_attention", "vision")
    if mode not in (None, "vision"):
        raise ConfigError(f"{source}: use_bidirectional_attention {mode!r} is not supported (None or 'vision')")
    text = {k: v for k, v in hf.items() if k not in (*ABSENT_KEYS, "use_bidirectional_attention")}
    text["hidden_size_per_layer_input"] = 0  # none: Gemma 4's default is 256
    text["sliding_window"] = hf.get("sliding_window") or SLIDING_WINDOW
    return gemma4.config_fields(text, source)


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in gemma4.hf_fields(config, hf).items() if k not in ABSENT_KEYS}
    return {**out, "model_type": "gemma4_unified_text", "use_bidirectional_attention": "vision"}


checkpoint_layout = gemma4.checkpoint_layout
