"""Apertus (`ApertusForCausalLM`: swiss-ai/Apertus-8B, -70B): Llama's attention with per-head q/k RMSNorms before
the rotary embedding (Qwen3's), Llama 3's rotary scaling by default, and an ungated MLP (`up_proj`, `down_proj`)
whose xIELU activation has learned parameters of its own in every layer (`mlp.act_fn.alpha_p` / `alpha_n`, with its
`beta` and `eps`: keel.model.layers.XIELU). Its block norms are named `attention_layernorm` and
`feedforward_layernorm` (keel's `input_layernorm` and `post_attention_layernorm`).
"""

from __future__ import annotations

from typing import Any

FAMILY = "apertus"
HF_ARCHITECTURE = "ApertusForCausalLM"
# transformers' ApertusConfig defaults.
DEFAULTS: dict[str, Any] = {
    "hidden_act": "xielu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 12_000_000.0,
    "max_position_embeddings": 65536,
    "bos_token_id": 1,
    "eos_token_id": [2],
}
# ApertusConfig's rope parameters where a file names neither rope_parameters nor rope_scaling (keel.config reads them).
DEFAULT_ROPE: dict[str, Any] = {
    "rope_type": "llama3",
    "rope_theta": 12_000_000.0,
    "factor": 8.0,
    "original_max_position_embeddings": 8192,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
}


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    bias = bool(hf.get("attention_bias", False))
    return {"qk_norm": True, "mlp_gated": False, "qkv_bias": bias, "o_bias": bias, "mlp_bias": False}


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {"attention_bias": config.qkv_bias}


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """The block norms under keel's names."""
    layout: dict[str, dict[str, list[tuple[int, int]] | None]] = {}
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}"
        layout[f"{p}.attention_layernorm.weight"] = {f"{p}.input_layernorm.weight": None}
        layout[f"{p}.feedforward_layernorm.weight"] = {f"{p}.post_attention_layernorm.weight": None}
    return layout
