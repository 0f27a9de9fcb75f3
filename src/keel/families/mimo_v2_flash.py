"""MiMo-V2-Flash (`MiMoV2FlashForCausalLM`: Xiaomi's MiMo-V2-Flash): Llama's pre-norm block whose attention has
values narrower than its queries and keys (`v_head_dim` beside `head_dim`: keel's `v_head_dim` without MLA), scaled
as projected (`attention_value_scale`), in sliding-window and full layers (`layer_types`, by default the first and
every sixth full) where the sliding layers have twice the KV heads (keel's `num_kv_heads`, the full layers'
`global_num_kv_heads`) and a learned softmax sink per query head (keel's `attention_sinks` with
`attention_sinks_sliding_only`); every layer rotates its kind's share of each head at its kind's base
(`rope_parameters` per kind: keel's `partial_rotary_factor`, `sliding_partial_rotary_factor`, `sliding_rope_theta`),
and DeepSeek-V3's experts without shared experts where `mlp_layer_types` says sparse (by default all but the first):
a float32 sigmoid router with a selection bias (`mlp.gate.e_score_correction_bias`), group-limited top-k
(`n_group`, `topk_group`), renormalised (`norm_topk_prob`) and times `routed_scaling_factor`.

The multi-token-prediction layers of the release (`model.mtp.*`) are not read, as transformers does not.
Refused by name: `layer_types` other than sliding_attention / full_attention.
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError
from keel.families.layer_kinds import dense_layers, mlp_layer_types
from keel.families.rope import rope_per_kind

FAMILY = "mimo_v2_flash"
HF_ARCHITECTURE = "MiMoV2FlashForCausalLM"
# transformers' MiMoV2FlashConfig defaults.
DEFAULTS: dict[str, Any] = {
    "head_dim": 192,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-5,
    "rope_theta": 5_000_000.0,
    "max_position_embeddings": 131072,
    "bos_token_id": 1,
    "eos_token_id": [],
}
ROTARY_SHARE = 0.334  # the share transformers' MiMo RoPE takes where a kind's parameters give none
# MiMoV2FlashConfig's rope parameters where a file has none.
DEFAULT_ROPE: dict[str, Any] = {
    "full_attention": {"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": ROTARY_SHARE},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": ROTARY_SHARE},
}


def _layer_types(hf: dict[str, Any], source: str) -> list[str]:
    layers = int(hf["num_hidden_layers"])
    default = ["full_attention" if i == 0 or (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
    kinds = list(hf.get("layer_types") or default)
    if len(kinds) != layers or not set(kinds) <= {"full_attention", "sliding_attention"}:
        raise ConfigError(f"{source}: layer_types must give full_attention or sliding_attention for {layers} layers")
    return kinds


def _rope_share(hf: dict[str, Any], kind: str) -> float:
    rope = hf.get("rope_parameters") or DEFAULT_ROPE
    spec = rope.get(kind) if isinstance(rope, dict) and kind in rope else rope
    return float(spec.get("partial_rotary_factor", ROTARY_SHARE)) if isinstance(spec, dict) else ROTARY_SHARE


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    kinds = _layer_types(hf, source)
    sliding, full = "sliding_attention" in kinds, "full_attention" in kinds
    kv_heads = int(hf.get("num_key_value_heads") or DEFAULTS["num_key_value_heads"])
    rope = hf.get("rope_parameters")
    per_kind = isinstance(rope, dict) and "sliding_attention" in rope  # then the common reader reads its own RoPE
    scale = hf.get("attention_value_scale", 0.707)
    bias = bool(hf.get("attention_bias", False))
    return {
        "qkv_bias": bias,
        "o_bias": False,
        "head_dim": int(hf.get("head_dim") or DEFAULTS["head_dim"]),
        "v_head_dim": int(hf.get("v_head_dim", 128)),
        "attention_value_scale": 1.0 if scale is None else float(scale),
        # the sliding layers have twice the KV heads of the full ones
        "num_kv_heads": 2 * kv_heads if sliding else kv_heads,
        "global_num_kv_heads": kv_heads if sliding and full else 0,
        "attention_sinks": sliding,
        "attention_sinks_sliding_only": sliding,
        "sliding_window": int(hf.get("sliding_window") or 129) if sliding else None,
        "layer_types": kinds,
        "partial_rotary_factor": _rope_share(hf, "full_attention"),
        "sliding_partial_rotary_factor": _rope_share(hf, "sliding_attention") if per_kind else None,
        "num_experts": int(hf.get("n_routed_experts", 256)),
        "num_experts_per_tok": int(hf.get("num_experts_per_tok", 8)),
        "moe_intermediate_size": int(hf.get("moe_intermediate_size", 2048)),
        "shared_expert_intermediate_size": 0,
        "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
        "router_scoring": "sigmoid",
        "router_bias": True,
        "n_group": int(hf.get("n_group") or 1),
        "topk_group": int(hf.get("topk_group") or 1),
        "routed_scaling_factor": float(hf.get("routed_scaling_factor") or 1.0),
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense_layers(hf, source, first_dense=1),
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    rope = rope_per_kind(config, hf)
    sliding = "sliding_attention" in config.layer_types
    return {
        "attention_bias": config.qkv_bias,
        "head_dim": config.head_dim,
        "v_head_dim": config.v_head_dim or config.head_dim,
        "attention_value_scale": config.attention_value_scale,
        "num_key_value_heads": config.num_kv_heads // 2 if sliding else config.num_kv_heads,
        "sliding_window": config.sliding_window,
        "layer_types": list(config.layer_types),
        "rope_parameters": rope,
        "mlp_layer_types": mlp_layer_types(config),
        "n_routed_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "moe_intermediate_size": config.moe_intermediate_size,
        "norm_topk_prob": config.norm_topk_prob,
        "n_group": config.n_group,
        "topk_group": config.topk_group,
        "routed_scaling_factor": config.routed_scaling_factor,
    }


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """The sliding layers' sinks, stored as `attention_sink_bias` (transformers renames them on load), under keel's
    name."""
    return {
        f"model.layers.{layer}.self_attn.attention_sink_bias": {f"model.layers.{layer}.self_attn.sinks": None}
        for layer in range(config.num_layers)
        if config.layer_has_sinks(layer)
    }
