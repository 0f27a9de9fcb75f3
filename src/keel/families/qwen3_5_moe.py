"""Qwen3.5 MoE (`Qwen3_5MoeForCausalLM`: Qwen3.5-35B-A3B, -397B-A17B; and the released
`Qwen3_5MoeForConditionalGeneration` checkpoints on text): Qwen3.5's hybrid of Gated DeltaNet and gated full-attention
layers (keel.families.qwen3_5) with experts in every layer: a float32 softmax router whose top k are always
renormalised, and Qwen2-MoE's shared expert behind a sigmoid gate (`shared_expert_gate`). Experts are stored per
expert under HF's names.
"""

from __future__ import annotations

from typing import Any

from keel.families import qwen3_5

FAMILY = "qwen3_5_moe"
HF_ARCHITECTURE = "Qwen3_5MoeForCausalLM"
# transformers' Qwen3_5MoeTextConfig defaults.
DEFAULTS: dict[str, Any] = {**qwen3_5.DEFAULTS, "head_dim": 256, "num_key_value_heads": 2}
MOE_KEYS = {
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
}


def moe_fields(hf: dict[str, Any], defaults: dict[str, int]) -> dict[str, Any]:
    """The experts as Qwen2-MoE's: a softmax router, a sigmoid-gated shared expert."""
    return {
        **{key: int(hf.get(key) or default) for key, default in defaults.items()},
        "shared_expert_gated": True,
        "router_scoring": "softmax",
    }


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    moe = moe_fields(hf, MOE_KEYS)
    # every layer sparse, renormalised; the dense width the config does not have is the experts' (unused)
    return {**qwen3_5.config_fields(hf, source), **moe, "norm_topk_prob": True, "intermediate_size": 0}


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    out = {**qwen3_5.hf_fields(config, hf), "model_type": "qwen3_5_moe_text"}
    out.update({key: getattr(config, key) for key in MOE_KEYS})
    for key in ("intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"):
        out.pop(key, None)  # keys Qwen3_5MoeTextConfig does not have
    return out


checkpoint_layout = qwen3_5.checkpoint_layout
