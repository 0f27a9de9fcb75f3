"""Hunyuan dense (`HunYuanDenseV1ForCausalLM`: Hunyuan-0.5B ... 7B): Llama's block with biases on q/k/v/o where
`attention_bias`, and RMSNorms per head on q and k applied after the rotary embedding (keel's
`qk_norm_after_rope`; its checkpoints call them `query_layernorm` / `key_layernorm`, read as keel's q/k norms and
written back). Its NTK scaling by a fixed `alpha` (rope type "dynamic" with `alpha`) stretches the RoPE base alone:
keel.config reads it as that base.
"""

from __future__ import annotations

from typing import Any

FAMILY = "hunyuan_v1_dense"
HF_ARCHITECTURE = "HunYuanDenseV1ForCausalLM"
# transformers' HunYuanDenseV1Config defaults.
DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "bos_token_id": 1,
    "eos_token_id": [2],
}


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    bias = bool(hf.get("attention_bias", False))
    return {"qk_norm": True, "qk_norm_after_rope": True, "qkv_bias": bias, "o_bias": bias}


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {"attention_bias": config.qkv_bias}


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """The per-head norms under HunYuan's names, read as keel's `q_norm` / `k_norm`."""
    layout: dict[str, dict[str, list[tuple[int, int]] | None]] = {}
    for layer in range(config.num_layers):
        attn = f"model.layers.{layer}.self_attn"
        layout[f"{attn}.query_layernorm.weight"] = {f"{attn}.q_norm.weight": None}
        layout[f"{attn}.key_layernorm.weight"] = {f"{attn}.k_norm.weight": None}
    return layout
