"""OLMo 2 (`Olmo2ForCausalLM`): Llama's block with its norms after each sublayer, on the sublayer's
output (x + norm(attn(x)), then x + norm(mlp(x))), and RMSNorms over the whole q and k projections
before the rotary embedding. Its `post_attention_layernorm` is that output norm of the attention (keel's
`attn_output_norm`; keel's own `post_attention_layernorm` is the norm before the MLP, which OLMo 2 does
not have) and `post_feedforward_layernorm` the MLP's (keel's `mlp_output_norm`).
"""

from __future__ import annotations

from typing import Any

FAMILY = "olmo2"
HF_ARCHITECTURE = "Olmo2ForCausalLM"
# transformers' Olmo2Config defaults.
DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "bos_token_id": None,
    "eos_token_id": [50279],
}


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    bias = bool(hf.get("attention_bias", False))
    return {
        "norm_placement": "post",
        "qk_norm": True,
        "qk_norm_scope": "all",
        "qkv_bias": bias,
        "o_bias": bias,
        "mlp_bias": False,
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {"attention_bias": config.qkv_bias}


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """OLMo 2's output norms under keel's names (the module docstring)."""
    layout: dict[str, dict[str, list[tuple[int, int]] | None]] = {}
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}"
        layout[f"{prefix}.post_attention_layernorm.weight"] = {f"{prefix}.attn_output_norm.weight": None}
        layout[f"{prefix}.post_feedforward_layernorm.weight"] = {f"{prefix}.mlp_output_norm.weight": None}
    return layout
