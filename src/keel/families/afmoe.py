"""AFMoE (`AfmoeForCausalLM`: Arcee's Trinity Nano / Mini / Large): Gemma 2's sandwich block (a norm before and after
each sublayer; its `post_attention_layernorm` is keel's `attn_output_norm`, `pre_mlp_layernorm` keel's
`post_attention_layernorm`, `post_mlp_layernorm` keel's `mlp_output_norm`), attention with per-head q/k RMSNorms and
its output gated by the sigmoid of a projection per query channel (keel's `attention_output_gate`; its `gate_proj`),
sliding-window layers that rotate and global ones (every `global_attn_every_n_layers`-th by default) with no position
encoding, and DeepSeek-V3's kind of experts after `num_dense_layers` dense layers: a sigmoid router with a selection
bias (`mlp.expert_bias`), the top k renormalised and scaled by `route_scale`, and `num_shared_experts` shared
experts acting as one SwiGLU (`mlp.shared_experts`). `mup_enabled` scales the embedding by sqrt(hidden_size).
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError
from keel.families.experts import sigmoid_experts
from keel.families.windows import sliding_layer_types

FAMILY = "afmoe"
HF_ARCHITECTURE = "AfmoeForCausalLM"
# transformers' AfmoeConfig defaults.
DEFAULTS: dict[str, Any] = {
    "head_dim": 128,
    "num_key_value_heads": None,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 16384,
    "bos_token_id": None,
    "eos_token_id": [],
}
GLOBAL_EVERY = 4  # global_attn_every_n_layers' default


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    layers = int(hf["num_hidden_layers"])
    every = int(hf.get("global_attn_every_n_layers") or GLOBAL_EVERY)
    kinds = sliding_layer_types(hf, every)
    if len(kinds) != layers:
        raise ConfigError(f"{source}: layer_types has {len(kinds)} entries for {layers} layers")
    width = int(hf.get("moe_intermediate_size", 1408))
    if hf.get("attention_bias"):  # its gate projection has none, keel's output gate would
        raise ConfigError(f"{source}: attention_bias {hf['attention_bias']!r} is not supported (AFMoE)")
    return {
        "norm_placement": "sandwich",
        "qk_norm": True,
        "attention_output_gate": True,
        "qkv_bias": False,
        "o_bias": False,
        "sliding_window": hf.get("sliding_window", 1024),
        "layer_types": kinds,
        "rope_layers": [kind == "sliding_attention" for kind in kinds],
        "embedding_multiplier": float(hf["hidden_size"]) ** 0.5 if hf.get("mup_enabled") else 1.0,
        **sigmoid_experts(
            int(hf.get("num_experts", 64)),
            int(hf.get("num_experts_per_tok", 6)),
            width,
            width * int(hf.get("num_shared_experts", 2)),
            float(hf.get("route_scale", 1.0)),
        ),
        "mlp_only_layers": list(range(min(int(hf.get("num_dense_layers", 1)), layers))),
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {
        "sliding_window": config.sliding_window,
        "layer_types": list(config.layer_types),
        "mup_enabled": config.embedding_multiplier != 1.0,
        "num_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "moe_intermediate_size": config.moe_intermediate_size,
        "num_shared_experts": config.shared_expert_intermediate_size // config.moe_intermediate_size,
        "route_scale": config.routed_scaling_factor,
        "num_dense_layers": len(config.mlp_only_layers),
    }


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """The four block norms, the output gate, the router, its bias and the shared experts under keel's names."""
    layout: dict[str, dict[str, list[tuple[int, int]] | None]] = {}
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}"
        layout[f"{p}.post_attention_layernorm.weight"] = {f"{p}.attn_output_norm.weight": None}
        layout[f"{p}.pre_mlp_layernorm.weight"] = {f"{p}.post_attention_layernorm.weight": None}
        layout[f"{p}.post_mlp_layernorm.weight"] = {f"{p}.mlp_output_norm.weight": None}
        layout[f"{p}.self_attn.gate_proj.weight"] = {f"{p}.self_attn.output_gate.weight": None}
        layout[f"{p}.mlp.router.gate.weight"] = {f"{p}.mlp.gate.weight": None}
        layout[f"{p}.mlp.expert_bias"] = {f"{p}.mlp.gate.e_score_correction_bias": None}
        for proj in ("gate_proj", "up_proj", "down_proj"):
            layout[f"{p}.mlp.shared_experts.{proj}.weight"] = {f"{p}.mlp.shared_expert.{proj}.weight": None}
    return layout
