"""Cohere Command R (`CohereForCausalLM`): one LayerNorm without a bias feeding both sublayers of a parallel residual
(x + attn(norm(x)) + mlp(norm(x))), logits multiplied by `logit_scale` (keel divides by `logits_scaling`, its
inverse), a tied head, and rotary on interleaved pairs over each whole head, served by keel's rotate-half rotary
through q/k rows regrouped at load and interleaved again on export (keel.families.rope.interleaved_qk_layout).
Command R+ (`use_qk_norm`): q and k each through a LayerNorm without a bias over each head with a weight of its own
per head (CohereLayerNorm [heads, head_dim], keel's `qk_norm_scope` each_head, `qk_norm_type` layer), before the
rotary embedding; its weights' channels regrouped at load as q's and k's rows are (keel.families.parts.Columns).
"""

from __future__ import annotations

from typing import Any

from keel.families.parts import Columns
from keel.families.rope import interleaved_qk_layout, interleaved_rotary_rows

FAMILY = "cohere"
HF_ARCHITECTURE = "CohereForCausalLM"
# transformers' CohereConfig defaults (its layer_norm_eps is keel's rms_norm_eps: the norms' eps).
DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-5,
    "rope_theta": 500_000.0,
    "max_position_embeddings": 8192,
    "bos_token_id": 5,
    "eos_token_id": [255001],
}
LOGIT_SCALE = 0.0625


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    qk_norm = bool(hf.get("use_qk_norm", False))
    eps = hf.get("layer_norm_eps")
    bias = bool(hf.get("attention_bias", False))
    return {
        "norm_type": "layer",
        "norm_bias": False,
        "rms_norm_eps": float(DEFAULTS["rms_norm_eps"] if eps is None else eps),
        "parallel_residual": True,
        "post_attention_norm": False,
        "logits_scaling": 1.0 / float(hf.get("logit_scale", LOGIT_SCALE)),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
        "qkv_bias": bias,
        "o_bias": bias,
        "qk_norm": qk_norm,
        "qk_norm_scope": "each_head",
        "qk_norm_type": "layer",
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {
        "layer_norm_eps": config.rms_norm_eps,
        "logit_scale": 1.0 / config.logits_scaling,
        "attention_bias": config.qkv_bias,
        "use_qk_norm": config.qk_norm,
    }


def checkpoint_layout(config: Any) -> dict[str, Any]:
    """q's and k's rows regrouped for keel's rotary; with q/k norms, their weights' columns the same way."""
    layout: dict[str, Any] = interleaved_qk_layout(config)
    if config.qk_norm:
        rows = interleaved_rotary_rows(1, config.head_dim, config.rotary_dim)
        order = Columns(tuple(c for a, b in rows for c in range(a, b)))
        for layer in range(config.num_layers):
            attn = f"model.layers.{layer}.self_attn"
            for norm in ("q_norm", "k_norm"):
                layout[f"{attn}.{norm}.weight"] = {f"{attn}.{norm}.weight": order}
    return layout
