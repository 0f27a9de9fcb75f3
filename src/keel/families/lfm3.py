"""LFM3 (`Lfm3ForCausalLM`: LiquidAI's LFM3): LFM2's hybrid of gated short convolutions ("conv" layers) and
attention, with sliding-window attention layers besides the full ones (`layer_types`; by default layer 2 of every
four full, layer 0 of every four after the first sliding, the rest convolutions), a rope per attention kind (by
default the sliding layers' plain RoPE at theta 1e4, the full layers' "proportional" RoPE at 1e6 turning half of the
frequencies: keel's `sliding_rope_theta` and `rotated_share`), Qwen3's attention (per-head q/k RMSNorms,
`attention_bias` on q/k/v/o) whose output is gated per query head by the sigmoid of `g_proj` (keel's
`attention_output_gate` with `attention_gate_per_head`; stored as `gate_proj`) where `use_attention_gate`, OLMo 3's
sandwich norms on each sublayer's output (`post_operator_norm`, `post_ffn_norm`) where `use_sandwich_norm`, and
LFM2-MoE's SwiGLU of `intermediate_size` as it is (no width adjustment).

Checkpoint names are LFM2's (keel.families.lfm2), but attention keeps Qwen3's (`o_proj`, `q_norm`, `k_norm`).
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError
from keel.families import lfm2

FAMILY = "lfm3"
HF_ARCHITECTURE = "Lfm3ForCausalLM"
# transformers' Lfm3Config defaults (its norm_eps is keel's rms_norm_eps).
DEFAULTS: dict[str, Any] = {
    "head_dim": 128,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1_000_000.0,
    "max_position_embeddings": 128_000,
    "bos_token_id": 124_894,
    "eos_token_id": [124_900],
}
# Lfm3Config's rope parameters where a file has none.
DEFAULT_ROPE: dict[str, Any] = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.5},
}
KINDS = {"conv", "full_attention", "sliding_attention"}


def _layer_types(hf: dict[str, Any], source: str) -> list[str]:
    layers = int(hf["num_hidden_layers"])
    kinds = hf.get("layer_types") or [
        "full_attention" if i % 4 == 2 else "sliding_attention" if i % 4 == 0 and i > 0 else "conv"
        for i in range(layers)
    ]
    if len(kinds) != layers or not set(kinds) <= KINDS:
        raise ConfigError(f"{source}: layer_types must list {', '.join(sorted(KINDS))} for each of {layers} layers")
    return list(kinds)


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    kinds = _layer_types(hf, source)
    if "sliding_attention" in kinds and "full_attention" not in kinds:
        # keel reads a per-kind rope's full-attention entry as its own; transformers' config class always writes one
        raise ConfigError(f"{source}: layer_types with sliding_attention layers need a full_attention one (LFM3)")
    eps = hf.get("norm_eps")
    bias = bool(hf.get("attention_bias", False))
    gate = bool(hf.get("use_attention_gate", True))
    return {
        "layer_types": kinds,
        "rms_norm_eps": float(DEFAULTS["rms_norm_eps"] if eps is None else eps),
        "intermediate_size": int(hf.get("intermediate_size") or 7680),
        "qk_norm": True,
        "qkv_bias": bias,
        "o_bias": bias,
        "attention_output_gate": gate,
        "attention_gate_per_head": gate,
        "norm_placement": "sandwich" if hf.get("use_sandwich_norm", True) else "pre",
        "sliding_window": int(hf.get("sliding_window") or 256) if "sliding_attention" in kinds else None,
        "short_conv_kernel": int(hf.get("conv_L_cache") or 7),
        "short_conv_bias": bool(hf.get("conv_bias", False)),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", hf.get("tie_embedding", True))),
        "mlp_bias": False,
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {
        "layer_types": list(config.layer_types),
        "norm_eps": config.rms_norm_eps,
        "attention_bias": config.qkv_bias,
        "use_attention_gate": config.attention_output_gate,
        "use_sandwich_norm": config.norm_placement == "sandwich",
        "sliding_window": config.sliding_window,
        "conv_L_cache": config.short_conv_kernel,
        "conv_bias": config.short_conv_bias,
    }


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """LFM2's names, attention's own (Qwen3's) kept, the gate as `gate_proj` and the sandwich norms."""
    layout = {
        stored: names
        for stored, names in lfm2.checkpoint_layout(config).items()
        if not any(f".self_attn.{n}." in stored for n in ("out_proj", "q_layernorm", "k_layernorm"))
    }
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}"
        if config.norm_placement == "sandwich":
            layout[f"{p}.post_operator_norm.weight"] = {f"{p}.attn_output_norm.weight": None}
            layout[f"{p}.post_ffn_norm.weight"] = {f"{p}.mlp_output_norm.weight": None}
        if config.layer_types[layer] != "conv" and config.attention_output_gate:
            layout[f"{p}.self_attn.gate_proj.weight"] = {f"{p}.self_attn.output_gate.weight": None}
    return layout
