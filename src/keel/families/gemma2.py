"""Gemma 2 (`Gemma2ForCausalLM`, model_type gemma2): Gemma 3's elder, the same block without q/k norms
and with one RoPE for every layer. A norm before and after each sublayer ("sandwich"), every RMSNorm
scaling by (1 + weight) in float32, the embedding multiplied by sqrt(hidden_size), the softmax scale
query_pre_attn_scalar^-1/2, a GELU-gated MLP (tanh approximation), sliding-window and global layers
alternating (`layer_types`, else transformers' rule: even layers slide, odd ones are global), the final
logits soft-capped (`final_logit_softcapping`, 30 by default) and so are the attention scores
(`attn_logit_softcapping`, 50 by default: each score, after the scale, becomes cap * tanh(score / cap)
before the mask and the softmax). The norms take keel's names as Gemma 3's do: `post_attention_layernorm`
is the attention's output norm (keel's `attn_output_norm`), `pre_feedforward_layernorm` the norm before
the MLP (`post_attention_layernorm`), `post_feedforward_layernorm` the MLP's output norm (`mlp_output_norm`).

Not read: the bidirectional attention of `use_bidirectional_attention`, refused by name.
"""

from __future__ import annotations

from typing import Any

from keel.families import gemma3
from keel.families.gemma import gemma2_activation, gemma2_activation_to_hf, refuse_bidirectional

FAMILY = "gemma2"
HF_ARCHITECTURE = "Gemma2ForCausalLM"
# transformers' Gemma2Config defaults.
DEFAULTS: dict[str, Any] = {
    "head_dim": 256,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10_000.0,
    "max_position_embeddings": 8192,
    "bos_token_id": 2,
    "eos_token_id": [1],
}
FINAL_LOGIT_SOFTCAPPING = 30.0
ATTN_LOGIT_SOFTCAPPING = 50.0


def _cap(hf: dict[str, Any], key: str, default: float) -> float | None:
    """A soft-cap: transformers' default where the key is absent, none where it is null."""
    cap = hf.get(key, default)
    return None if cap is None else float(cap)


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    refuse_bidirectional(hf, source)
    layers = int(hf["num_hidden_layers"])
    layer_types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)
    ]
    window = hf.get("sliding_window", 4096)
    return {
        "norm_placement": "sandwich",
        "norm_weight_offset": 1.0,
        "embedding_multiplier": float(hf["hidden_size"]) ** 0.5,
        "attention_scale": float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        "hidden_act": gemma2_activation(hf, source),
        "final_logit_softcapping": _cap(hf, "final_logit_softcapping", FINAL_LOGIT_SOFTCAPPING),
        "attn_logit_softcapping": _cap(hf, "attn_logit_softcapping", ATTN_LOGIT_SOFTCAPPING),
        "sliding_window": window,
        "layer_types": list(layer_types) if window else ["full_attention"] * layers,
        "qkv_bias": bool(hf.get("attention_bias", False)),
        "o_bias": bool(hf.get("attention_bias", False)),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {
        "model_type": "gemma2",
        "hidden_activation": gemma2_activation_to_hf(config),
        "query_pre_attn_scalar": round(config.attention_scale**-2),  # an int in transformers
        "final_logit_softcapping": config.final_logit_softcapping,
        "attn_logit_softcapping": config.attn_logit_softcapping,
        "sliding_window": config.sliding_window,
        "layer_types": list(config.layer_types),
        "attention_bias": config.qkv_bias,
    }


# Gemma 3's four block norms under keel's names: the same checkpoint names.
checkpoint_layout = gemma3.checkpoint_layout
