"""Granite 3.x MoE (`GraniteMoeForCausalLM`: granite-3.1-1b-a400m, 3b-a800m): Granite's block (its four scalars:
embedding, residual and softmax multipliers, logits divided) with a mixture of experts in every layer: top-k of
the router's logits, then their softmax (keel's `router_scoring` topk_softmax), no shared expert. Its checkpoints
keep the experts stacked under names of their own (`block_sparse_moe.input_linear`: [E, 2I, H], gate rows
first; `output_linear`: [E, H, I]; the router `block_sparse_moe.router.layer`), read as keel's and written back.
"""

from __future__ import annotations

from typing import Any

FAMILY = "granitemoe"
HF_ARCHITECTURE = "GraniteMoeForCausalLM"
# transformers' GraniteMoeConfig defaults.
DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "bos_token_id": 1,
    "eos_token_id": [2],
}
# Stored names (under model.layers.N.block_sparse_moe) -> the HF-style names keel reads (under model.layers.N.mlp).
_STORED = {
    "input_linear.weight": "experts.gate_up_proj",
    "output_linear.weight": "experts.down_proj",
    "router.layer.weight": "gate.weight",
}


def granite_block(hf: dict[str, Any]) -> dict[str, Any]:
    """Granite's attention biases and four scalars (1.0 where absent, as transformers' Granite configs), shared by
    the Granite families with a family file."""

    def scalar(key: str) -> float:
        return float(hf[key]) if hf.get(key) is not None else 1.0

    bias = bool(hf.get("attention_bias", False))
    return {
        "qkv_bias": bias,
        "o_bias": bias,
        "embedding_multiplier": scalar("embedding_multiplier"),
        "residual_multiplier": scalar("residual_multiplier"),
        "attention_scale": scalar("attention_multiplier"),
        "logits_scaling": scalar("logits_scaling"),
    }


def granite_block_to_hf(config: Any) -> dict[str, Any]:
    return {
        "attention_bias": config.qkv_bias,
        "embedding_multiplier": config.embedding_multiplier,
        "residual_multiplier": config.residual_multiplier,
        "attention_multiplier": config.attention_scale,
        "logits_scaling": config.logits_scaling,
    }


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    width = int(hf.get("intermediate_size", 11008))
    return {
        **granite_block(hf),
        "num_experts": int(hf.get("num_local_experts", 8)),
        "num_experts_per_tok": int(hf.get("num_experts_per_tok", 2)),
        "moe_intermediate_size": width,
        "intermediate_size": width,
        "router_scoring": "topk_softmax",
        "norm_topk_prob": True,
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {
        **granite_block_to_hf(config),
        "num_local_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "intermediate_size": config.moe_intermediate_size,
    }


def expert_layout(config: Any, stored_names: dict[str, str]) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """The experts and the router, stored under `block_sparse_moe.` by `stored_names`, under keel's names (renames
    only)."""
    layout: dict[str, dict[str, list[tuple[int, int]] | None]] = {}
    for layer in range(config.num_layers):
        for stored, name in stored_names.items():
            layout[f"model.layers.{layer}.block_sparse_moe.{stored}"] = {f"model.layers.{layer}.mlp.{name}": None}
    return layout


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    return expert_layout(config, _STORED)
