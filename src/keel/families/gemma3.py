"""Gemma 3, text only (`Gemma3ForCausalLM`, model_type gemma3_text): a norm before and after each sublayer
("sandwich"), every RMSNorm scaling by (1 + weight) in float32, q/k norms per head, the embedding
multiplied by sqrt(hidden_size), the softmax scale query_pre_attn_scalar^-1/2, a GELU-gated MLP (tanh
approximation), and sliding-window layers (five in six by default) whose RoPE has its own base
(`rope_local_base_freq`, or `rope_parameters["sliding_attention"]`) while the global layers take
`rope_theta` and its scaling. Gemma's `post_attention_layernorm` is the attention's output norm
(keel's `attn_output_norm`), `pre_feedforward_layernorm` the norm before the MLP (keel's
`post_attention_layernorm`), `post_feedforward_layernorm` the MLP's output norm (`mlp_output_norm`).
`attn_logit_softcapping` (Gemma 2's attention-score soft-capping; None in Gemma 3) is read where set.

Not read: the bidirectional attention of `use_bidirectional_attention`, refused by name.

The releases are `Gemma3ForConditionalGeneration` (4B / 12B / 27B), read on text (keel.config.TEXT_MODEL_OF): their
sparse `text_config` completed by Gemma3TextConfig's defaults (DEFAULTS), the decoder under `language_model.model.`
(or `model.language_model.`), the SigLIP tower and projector unread. transformers' multimodal class applies no
`final_logit_softcapping`; the releases set none, and where one is set keel caps as the text model (and vLLM) do.
"""

from __future__ import annotations

from typing import Any

from keel.families.gemma import gemma2_activation, gemma2_activation_to_hf, refuse_bidirectional
from keel.families.windows import sliding_layer_types

FAMILY = "gemma3"
HF_ARCHITECTURE = "Gemma3ForCausalLM"
# transformers' Gemma3TextConfig defaults.
DEFAULTS: dict[str, Any] = {
    # the multimodal releases' text_config leaves these out (keel.config.TEXT_MODEL_OF)
    "vocab_size": 262_208,
    "num_attention_heads": 8,
    "head_dim": 256,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "max_position_embeddings": 131_072,
    "bos_token_id": 2,
    "eos_token_id": [1],
}
LOCAL_ROPE_THETA = 10_000.0
SLIDING_WINDOW_PATTERN = 6  # every sixth layer global


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    refuse_bidirectional(hf, source)
    layers = int(hf["num_hidden_layers"])
    pattern = int(hf.get("sliding_window_pattern", SLIDING_WINDOW_PATTERN))
    layer_types = sliding_layer_types(hf, pattern)
    window = hf.get("sliding_window", 4096)
    cap, attn_cap = hf.get("final_logit_softcapping"), hf.get("attn_logit_softcapping")
    return {
        "norm_placement": "sandwich",
        "norm_weight_offset": 1.0,
        "qk_norm": True,
        "embedding_multiplier": float(hf["hidden_size"]) ** 0.5,
        "attention_scale": float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        "hidden_act": gemma2_activation(hf, source),
        "final_logit_softcapping": None if cap is None else float(cap),
        "attn_logit_softcapping": None if attn_cap is None else float(attn_cap),
        "sliding_window": window,
        "layer_types": list(layer_types) if window else ["full_attention"] * layers,
        "sliding_rope_theta": float(hf.get("rope_local_base_freq", LOCAL_ROPE_THETA)),
        "qkv_bias": bool(hf.get("attention_bias", False)),
        "o_bias": bool(hf.get("attention_bias", False)),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {
        "model_type": "gemma3_text",
        "hidden_activation": gemma2_activation_to_hf(config),
        "query_pre_attn_scalar": round(config.attention_scale**-2),  # an int in transformers
        "final_logit_softcapping": config.final_logit_softcapping,
        "attn_logit_softcapping": config.attn_logit_softcapping,
        "sliding_window": config.sliding_window,
        "layer_types": list(config.layer_types),
        "attention_bias": config.qkv_bias,
    }


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """Gemma's four block norms under keel's names (the module docstring)."""
    layout: dict[str, dict[str, list[tuple[int, int]] | None]] = {}
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}"
        layout[f"{p}.post_attention_layernorm.weight"] = {f"{p}.attn_output_norm.weight": None}
        layout[f"{p}.pre_feedforward_layernorm.weight"] = {f"{p}.post_attention_layernorm.weight": None}
        layout[f"{p}.post_feedforward_layernorm.weight"] = {f"{p}.mlp_output_norm.weight": None}
    return layout
