"""Llama 4's text model (`Llama4ForCausalLM`: the decoder of Llama 4 Scout and Maverick, run text-only).

Llama's pre-norm block with:
- layers without position encoding (`no_rope_layers`: 0 = NoPE, by default every fourth; keel's `rope_layers`),
  whose queries take the attention temperature 1 + attn_scale * log(1 + floor((p + 1) / floor_scale)) where
  `attn_temperature_tuning` is on (keel's `query_scale_*`, the NoPE layers only);
- in the rotating layers, chunked attention (`attention_chunk_size`: a query sees its own chunk only;
  `layer_types` "chunked_attention") and, where `use_qk_norm`, q and k divided by their root mean square over
  each head, with no weight (keel's `qk_l2_norm`);
- rotary embeddings over interleaved pairs (transformers' complex form): q/k rows regrouped at load, as GLM-4's;
- a mixture of experts in the `moe_layers` (by default every `interleave_moe_layer_step`-th layer; the others
  dense, of `intermediate_size_mlp`): the best of the router's logits picks one expert, its sigmoid scales the
  expert's *input* (keel's `router_scales_input`), and an ungated shared expert of the experts' width is added.

Its checkpoints name the MLP `feed_forward` (the router `feed_forward.router`), renamed to keel's `mlp` here, and
store the experts stacked and transposed ([E, H, 2I] gate columns first, [E, I, H]), read through
keel.weights.gpt_oss's reader and written back so.
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError
from keel.families.layer_kinds import rotating_layers
from keel.families.rope import interleaved_qk_layout

FAMILY = "llama4"
HF_ARCHITECTURE = "Llama4ForCausalLM"
# transformers' Llama4TextConfig defaults.
DEFAULTS: dict[str, Any] = {
    "head_dim": 128,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 131072,
    "bos_token_id": 1,
    "eos_token_id": [2],
}
NO_ROPE_LAYER_INTERVAL = 4
CHUNK = 8192
FLOOR_SCALE = 8192
ATTN_SCALE = 0.1


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    layers = int(hf["num_hidden_layers"])
    rotates = rotating_layers(hf, source, NO_ROPE_LAYER_INTERVAL)
    chunk = hf.get("attention_chunk_size", CHUNK)
    layer_types = hf.get("layer_types") or [
        "chunked_attention" if rotates[i] and chunk is not None else "full_attention" for i in range(layers)
    ]
    step = int(hf.get("interleave_moe_layer_step") or 1)
    moe_layers = hf.get("moe_layers")
    moe_layers = list(range(step - 1, layers, step)) if moe_layers is None else [int(i) for i in moe_layers]
    top_k = int(hf.get("num_experts_per_tok", 1))
    if top_k != 1:
        raise ConfigError(f"{source}: num_experts_per_tok {top_k}: Llama 4's router scales one expert's input (1)")
    width = int(hf.get("intermediate_size", 8192))
    tuning = hf.get("attn_temperature_tuning", True)
    bias = bool(hf.get("attention_bias", False))
    return {
        "intermediate_size": int(hf.get("intermediate_size_mlp", 16384)),
        "rope_layers": rotates,
        "layer_types": list(layer_types),
        "attention_chunk_size": int(chunk) if chunk is not None else None,
        "qk_l2_norm": bool(hf.get("use_qk_norm", True)),
        "query_scale_beta": float(hf.get("attn_scale", ATTN_SCALE)) if tuning else 0.0,
        "query_scale_length": int(hf.get("floor_scale", FLOOR_SCALE)),
        "query_scale_offset": 1,
        "query_scale_nope_only": True,
        "qkv_bias": bias,
        "o_bias": bias,
        "num_experts": int(hf.get("num_local_experts", 16)),
        "num_experts_per_tok": 1,
        "moe_intermediate_size": width,
        "mlp_only_layers": [i for i in range(layers) if i not in moe_layers],
        "router_scoring": "topk_sigmoid",
        "norm_topk_prob": False,
        "router_scales_input": True,
        "shared_expert_intermediate_size": width,
        "shared_expert_gated": False,
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {
        "model_type": "llama4_text",
        "intermediate_size": config.moe_intermediate_size,
        "intermediate_size_mlp": config.intermediate_size,
        "no_rope_layers": [int(config.layer_rotates(i)) for i in range(config.num_layers)],
        "layer_types": list(config.layer_types),
        "attention_chunk_size": config.attention_chunk_size,
        "use_qk_norm": config.qk_l2_norm,
        "attn_temperature_tuning": bool(config.query_scale_beta),
        "attn_scale": config.query_scale_beta,
        "floor_scale": config.query_scale_length,
        "attention_bias": config.qkv_bias,
        "num_local_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "moe_layers": [i for i in range(config.num_layers) if config.is_moe_layer(i)],
        "interleave_moe_layer_step": 1,
    }


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """q and k rows regrouped for keel's rotary pairs; `feed_forward` renamed to keel's `mlp` (its router `gate`
    under MoE layers is read as keel's router by keel.weights.names), every tensor of every layer."""
    layout = interleaved_qk_layout(config)
    for layer in range(config.num_layers):
        stored, keel = f"model.layers.{layer}.feed_forward", f"model.layers.{layer}.mlp"
        if config.is_moe_layer(layer):
            names = ["router.weight", "experts.gate_up_proj", "experts.down_proj"]
            names += [f"shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")]
        else:
            names = [f"{p}_proj.weight" for p in ("gate", "up", "down")]
        for name in names:
            layout[f"{stored}.{name}"] = {f"{keel}.{name}": None}
    return layout
