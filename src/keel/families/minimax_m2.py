"""MiniMax-M2 (`MiniMaxM2ForCausalLM`): Llama's pre-norm block with RMSNorms over the whole q and k projections
(OLMo 2's, keel's `qk_norm_scope` all), rotary over the first `rotary_dim` channels of each head (`rotary_dim` or
the rope parameters' `partial_rotary_factor`), and a mixture of experts in every layer: DeepSeek-V3's float32
sigmoid router with a selection-only bias (keel's `router_scoring` sigmoid with `router_bias`), the top k
renormalised, no groups, no shared experts. Its checkpoints name the experts as Mixtral's and keep the selection
bias beside the router (`block_sparse_moe.e_score_correction_bias`), read under keel's names and written back.
"""

from __future__ import annotations

from typing import Any

from keel.families.rope import rope_settings

FAMILY = "minimax_m2"
HF_ARCHITECTURE = "MiniMaxM2ForCausalLM"
# transformers' MiniMaxM2Config defaults.
DEFAULTS: dict[str, Any] = {
    "head_dim": 128,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-6,
    "rope_theta": 5_000_000.0,
    "max_position_embeddings": 196608,
    "bos_token_id": 200034,
    "eos_token_id": [200020],
}


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    head_dim = int(hf.get("head_dim") or 128)
    partial = rope_settings(hf).get("partial_rotary_factor")
    if partial is None:
        partial = int(hf["rotary_dim"]) / head_dim if hf.get("rotary_dim") else 1.0
    width = int(hf.get("intermediate_size", 1536))
    layers = int(hf["num_hidden_layers"])
    return {
        # transformers' MiniMaxM2 has no window and no attention biases, whatever the file says of them
        "sliding_window": None,
        "layer_types": ["full_attention"] * layers,
        "qkv_bias": False,
        "o_bias": False,
        "partial_rotary_factor": float(partial),
        "qk_norm": True,
        "qk_norm_scope": "all",
        "num_experts": int(hf.get("num_local_experts", 256)),
        "num_experts_per_tok": int(hf.get("num_experts_per_tok", 8)),
        "moe_intermediate_size": width,
        "intermediate_size": width,
        "router_scoring": "sigmoid",
        "router_bias": True,
        "norm_topk_prob": True,
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {
        "num_local_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "intermediate_size": config.moe_intermediate_size,
        "rotary_dim": config.rotary_dim,
        "rope_parameters": {**hf["rope_parameters"], "partial_rotary_factor": config.partial_rotary_factor},
    }


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """The selection bias, stored beside the router, read as the router's (keel.weights.names: `gate.`)."""
    return {
        f"model.layers.{layer}.block_sparse_moe.e_score_correction_bias": {
            f"model.layers.{layer}.block_sparse_moe.gate.e_score_correction_bias": None
        }
        for layer in range(config.num_layers)
    }
