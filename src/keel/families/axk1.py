"""A.X-K1 (`AXK1ForCausalLM`: SK Telecom's A.X K1): DeepSeek-V3's block (multi-head latent attention, always with the
low-rank query, rotary on interleaved pairs by default; DeepSeek-V3's experts: a float32 sigmoid router with a
selection bias and expert groups, scaled weights, shared experts) with one change: the MoE block's output is RMS-normed
by a norm of its own (keel's `moe_output_norm`; stored at the layer, `post_mlp_layernorm`) in the sparse layers.
Its dense and sparse layers are listed by `mlp_layer_types`, else derived from `first_k_dense_replace` and
`moe_layer_freq` as its config class derives them. keel.config reads the latent attention and the experts as
DeepSeek-V3's. The releases store no selection bias (transformers leaves it at zero: so does keel) and a
`post_mlp_layernorm` in the dense layers too, which neither model reads.
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError
from keel.families.layer_kinds import mlp_layer_types

FAMILY = "axk1"
HF_ARCHITECTURE = "AXK1ForCausalLM"
# transformers' AXK1Config defaults (the MoE and MLA ones are read by keel.config's DeepSeek-style readers).
DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": 64,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 32768,
    "bos_token_id": 163691,
    "eos_token_id": [163691],
    "intermediate_size": 18432,
    "num_experts": 192,  # HF: n_routed_experts
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 2048,
    "norm_topk_prob": True,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "rope_interleave": True,
}
ATTRIBUTE_MAP = {"num_local_experts": "n_routed_experts"}
# The router's selection bias, which the releases do not store.
ZERO_WHEN_ABSENT = ("e_score_correction_bias",)


def dense_layers(hf: dict[str, Any], source: str) -> list[int]:
    layers = int(hf["num_hidden_layers"])
    kinds = hf.get("mlp_layer_types")
    if kinds is None:  # the config class's rule from DeepSeek's keys
        first = int(hf.get("first_k_dense_replace", 1))
        every = int(hf.get("moe_layer_freq", 1))
        kinds = ["sparse" if i >= first and i % every == 0 else "dense" for i in range(layers)]
    if len(kinds) != layers or not set(kinds) <= {"dense", "sparse"}:
        raise ConfigError(f"{source}: mlp_layer_types must give dense or sparse for each of the {layers} layers")
    return [i for i, kind in enumerate(kinds) if kind == "dense"]


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    if "q_lora_rank" in hf and hf["q_lora_rank"] is None:
        raise ConfigError(f"{source}: q_lora_rank null (a full-rank q_proj) is not supported (A.X-K1's is low-rank)")
    return {
        "mlp_only_layers": dense_layers(hf, source),
        # DeepSeek-V3's attention_bias: q_a_proj, kv_a_proj_with_mqa and o_proj
        "o_bias": bool(hf.get("attention_bias", False)),
        "moe_output_norm": True,
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {
        "mlp_layer_types": mlp_layer_types(config),
        "attention_bias": config.o_bias,
    }


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """The MoE block's output norm, stored at the layer (transformers moves it into the block on load)."""
    return {
        f"model.layers.{layer}.post_mlp_layernorm.weight": {f"model.layers.{layer}.mlp.output_norm.weight": None}
        for layer in range(config.num_layers)
        if config.is_moe_layer(layer)
    }
