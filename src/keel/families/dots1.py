"""dots.llm1 (`Dots1ForCausalLM`, rednote): Qwen3's attention (per-head q/k RMSNorms; q/k/v and o biases where
`attention_bias`; sliding layers from `max_window_layers` on, as Qwen2's rule) and DeepSeek-V3's mixture of experts
(sigmoid router with a selection bias and groups, scaled weights, ungated shared experts, the first
`first_k_dense_replace` layers dense), read by keel.config as DeepSeek-V3's, under DeepSeek's tensor names.
"""

from __future__ import annotations

from typing import Any

FAMILY = "dots1"
HF_ARCHITECTURE = "Dots1ForCausalLM"
# transformers' Dots1Config defaults, and dots.llm1's own expert counts where the class leaves them None.
DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": 32,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "bos_token_id": None,
    "eos_token_id": [],
    "num_experts": 128,  # HF: n_routed_experts
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 1408,
    "norm_topk_prob": False,
    "n_shared_experts": 2,
    "first_k_dense_replace": 0,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
}


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    layers = int(hf["num_hidden_layers"])
    window = hf.get("sliding_window")
    layer_types = hf.get("layer_types") or [
        "sliding_attention"
        if window is not None and i >= int(hf.get("max_window_layers", layers))
        else "full_attention"
        for i in range(layers)
    ]
    bias = bool(hf.get("attention_bias", False))
    return {
        "qk_norm": True,
        "qkv_bias": bias,
        "o_bias": bias,
        "sliding_window": window if "sliding_attention" in layer_types else None,
        "layer_types": list(layer_types),
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    """The attention's keys (keel.config writes the experts' as DeepSeek-V3's)."""
    return {
        "attention_bias": config.qkv_bias,
        "sliding_window": config.sliding_window,
        "layer_types": list(config.layer_types),
    }
