"""Flint (`FlintForCausalLM`: Recursive's Flint): Qwen3-MoE's block (per-head q/k RMSNorms before the rotary
embedding, `attention_bias` on q/k/v/o) with GPT-OSS's learned softmax sink per query head (keel's
`attention_sinks`), sliding-window layers that rotate and full-attention ones with no position encoding (by
default the first two, every fourth from layer 1 and the last are full), and Qwen2-MoE's experts after the dense
layers of `mlp_only_layers` (by default the first two): a float32 sigmoid router without a selection bias (the top k
of the sigmoids, renormalised where `norm_topk_prob`) and a shared expert added ungated, in full.
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError

FAMILY = "flint"
HF_ARCHITECTURE = "FlintForCausalLM"
# transformers' FlintConfig defaults.
DEFAULTS: dict[str, Any] = {
    "head_dim": 128,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 262144,
    "bos_token_id": None,
    "eos_token_id": [],
}


def _layer_types(layers: int) -> list[str]:
    """FlintConfig's default: full attention in the first two layers, every fourth from layer 1 and the last."""
    return ["full_attention" if i < 2 or i % 4 == 1 or i == layers - 1 else "sliding_attention" for i in range(layers)]


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    layers = int(hf["num_hidden_layers"])
    kinds = list(hf.get("layer_types") or _layer_types(layers))
    if len(kinds) != layers or not set(kinds) <= {"full_attention", "sliding_attention"}:
        raise ConfigError(f"{source}: layer_types must give full_attention or sliding_attention for {layers} layers")
    dense = hf.get("mlp_only_layers")
    bias = bool(hf.get("attention_bias", False))
    return {
        "qk_norm": True,
        "qkv_bias": bias,
        "o_bias": bias,
        "attention_sinks": True,
        "sliding_window": int(hf.get("sliding_window") or 513),
        "layer_types": kinds,
        "rope_layers": [kind == "sliding_attention" for kind in kinds],
        "num_experts": int(hf.get("num_experts", 256)),
        "num_experts_per_tok": int(hf.get("num_experts_per_tok", 6)),
        "moe_intermediate_size": int(hf.get("moe_intermediate_size", 512)),
        "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
        "shared_expert_intermediate_size": int(hf.get("shared_expert_intermediate_size", 1024)),
        "shared_expert_gated": False,
        "router_scoring": "sigmoid",
        "decoder_sparse_step": int(hf.get("decoder_sparse_step") or 1),
        "mlp_only_layers": [0, 1] if dense is None else [int(i) for i in dense],
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {
        "attention_bias": config.qkv_bias,
        "sliding_window": config.sliding_window,
        "layer_types": list(config.layer_types),
        "shared_expert_intermediate_size": config.shared_expert_intermediate_size,
    }


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """The sinks, stored as `softmax_offset` (transformers renames them on load), under keel's name."""
    return {
        f"model.layers.{layer}.self_attn.softmax_offset": {f"model.layers.{layer}.self_attn.sinks": None}
        for layer in range(config.num_layers)
    }
