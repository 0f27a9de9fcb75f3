"""Qwen3-Next (`Qwen3NextForCausalLM`: Qwen3-Next-80B-A3B): Qwen3.5's hybrid block (keel.families.qwen3_5: Gated
DeltaNet and gated full-attention layers, (1 + w) RMSNorms) with Qwen2-MoE's experts (softmax router renormalised
where `norm_topk_prob`, a sigmoid-gated shared expert; dense layers by `mlp_only_layers` and `decoder_sparse_step`,
`intermediate_size` wide).

Its Gated DeltaNet layers store their input projections fused and grouped by key head: `in_proj_qkvz` holds, for
each key head, its query and key, then the value and z rows of the value heads it serves; `in_proj_ba` holds, per
key head, its value heads' b rows then their a rows. They are read into keel's (Qwen3.5's) `in_proj_qkv`,
`in_proj_z`, `in_proj_b` and `in_proj_a` by rows, and written back grouped on export.
"""

from __future__ import annotations

from typing import Any

from keel.families import qwen3_5, qwen3_5_moe

FAMILY = "qwen3_next"
HF_ARCHITECTURE = "Qwen3NextForCausalLM"
# transformers' Qwen3NextConfig defaults.
DEFAULTS: dict[str, Any] = {**qwen3_5.DEFAULTS, "head_dim": 256, "num_key_value_heads": 2}
MOE_KEYS = {
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
}
INTERMEDIATE_SIZE = 5632


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    return {
        **qwen3_5.config_fields(hf, source),
        **qwen3_5_moe.moe_fields(hf, MOE_KEYS),
        "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
        "intermediate_size": int(hf.get("intermediate_size") or INTERMEDIATE_SIZE),
        "decoder_sparse_step": int(hf.get("decoder_sparse_step") or 1),
        "mlp_only_layers": list(hf.get("mlp_only_layers") or []),
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {
        **qwen3_5.hf_fields(config, hf),
        "model_type": "qwen3_next",
        **{key: getattr(config, key) for key in MOE_KEYS},
        "norm_topk_prob": config.norm_topk_prob,
        "decoder_sparse_step": config.decoder_sparse_step,
        "mlp_only_layers": list(config.mlp_only_layers),
    }


def _grouped_rows(config: Any) -> tuple[dict[str, list[tuple[int, int]]], dict[str, list[tuple[int, int]]]]:
    """Where keel's in_proj_qkv / in_proj_z rows lie in in_proj_qkvz, and in_proj_b / in_proj_a rows in in_proj_ba."""
    key_heads, dk, dv = config.linear_num_key_heads, config.linear_key_head_dim, config.linear_value_head_dim
    served = config.linear_num_value_heads // key_heads  # value heads per key head
    group = 2 * dk + 2 * served * dv
    q = [(h * group, h * group + dk) for h in range(key_heads)]
    k = [(h * group + dk, h * group + 2 * dk) for h in range(key_heads)]
    v = [(h * group + 2 * dk, h * group + 2 * dk + served * dv) for h in range(key_heads)]
    z = [(h * group + 2 * dk + served * dv, (h + 1) * group) for h in range(key_heads)]
    b = [(h * 2 * served, h * 2 * served + served) for h in range(key_heads)]
    a = [(h * 2 * served + served, (h + 1) * 2 * served) for h in range(key_heads)]
    return {"in_proj_qkv": q + k + v, "in_proj_z": z}, {"in_proj_b": b, "in_proj_a": a}


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """Qwen3.5's renames, with the fused, grouped projections of the Gated DeltaNet layers read by rows."""
    layout = qwen3_5.checkpoint_layout(config)
    qkvz, ba = _grouped_rows(config)
    for layer in range(config.num_layers):
        if config.layer_types[layer] != "linear_attention":
            continue
        p = f"model.layers.{layer}"
        for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"):
            del layout[f"{p}.linear_attn.{name}.weight"]
        layout[f"{p}.linear_attn.in_proj_qkvz.weight"] = {f"{p}.self_attn.{n}.weight": r for n, r in qkvz.items()}
        layout[f"{p}.linear_attn.in_proj_ba.weight"] = {f"{p}.self_attn.{n}.weight": r for n, r in ba.items()}
    return layout
