"""LFM2 (`Lfm2ForCausalLM`: LiquidAI's LFM2-350M … 2.6B): a hybrid of gated short convolutions (`layer_types`
"conv": keel.model.short_conv, a state per sequence of the last `conv_L_cache` - 1 inputs) and attention layers
(`full_attn_idxs`, else `layer_types`) with per-head q/k RMSNorms, a SwiGLU MLP whose width LFM2 adjusts from
`intermediate_size` (`block_auto_adjust_ff_dim`: two thirds, times `block_ffn_dim_multiplier`, rounded up to
`block_multiple_of`; written back adjusted), and a tied head.

Checkpoint names: a conv layer's `conv.*` are keel's `self_attn.*`; attention's `out_proj`, `q_layernorm` and
`k_layernorm` are `o_proj`, `q_norm`, `k_norm`; `operator_norm` / `ffn_norm` the norms before the mixer and the MLP;
`feed_forward.w1/w3/w2` the MLP's gate/up/down; `embedding_norm` is the final norm (after the last layer).
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError

FAMILY = "lfm2"
HF_ARCHITECTURE = "Lfm2ForCausalLM"
# transformers' Lfm2Config defaults (its norm_eps is keel's rms_norm_eps).
DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-5,
    "rope_theta": 1_000_000.0,
    "max_position_embeddings": 128_000,
    "bos_token_id": 1,
    "eos_token_id": [2],
    "num_key_value_heads": 8,
}
CONV_KERNEL = 3


def mlp_width(hf: dict[str, Any]) -> int:
    """The MLP's width as transformers' Lfm2MLP computes it."""
    width = int(hf.get("intermediate_size") or hf.get("block_ff_dim") or 12288)
    if not hf.get("block_auto_adjust_ff_dim", True):
        return width
    width = int(2 * width / 3)
    multiplier = hf.get("block_ffn_dim_multiplier", 1.0)
    if multiplier is not None:
        multiple = int(hf.get("block_multiple_of") or 256)
        width = int(multiplier * width)
        width = multiple * ((width + multiple - 1) // multiple)
    return width


def layer_types(hf: dict[str, Any], source: str) -> list[str]:
    layers = int(hf["num_hidden_layers"])
    kinds = hf.get("layer_types")
    if kinds is None:
        full = hf.get("full_attn_idxs")
        full = range(layers) if full is None else set(full)
        return ["full_attention" if i in full else "conv" for i in range(layers)]
    if len(kinds) != layers or not set(kinds) <= {"conv", "full_attention"}:
        raise ConfigError(f"{source}: layer_types must list conv or full_attention for each of {layers} layers")
    return list(kinds)


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    eps = hf.get("norm_eps")
    return {
        "layer_types": layer_types(hf, source),
        "rms_norm_eps": float(DEFAULTS["rms_norm_eps"] if eps is None else eps),
        "intermediate_size": mlp_width(hf),
        "qk_norm": True,
        "short_conv_kernel": int(hf.get("conv_L_cache") or CONV_KERNEL),
        "short_conv_bias": bool(hf.get("conv_bias", False)),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", hf.get("tie_embedding", True))),
        "qkv_bias": False,
        "o_bias": False,
        "mlp_bias": False,
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {
        "layer_types": list(config.layer_types),
        "norm_eps": config.rms_norm_eps,
        "block_auto_adjust_ff_dim": False,  # the width written is the one the MLP has
        "conv_L_cache": config.short_conv_kernel,
        "conv_bias": config.short_conv_bias,
    }


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """LFM2's names under keel's (module doc)."""
    layout: dict[str, dict[str, list[tuple[int, int]] | None]] = {
        "model.embedding_norm.weight": {"model.norm.weight": None}
    }
    conv_kinds = ("weight", "bias") if config.short_conv_bias else ("weight",)
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}"
        renames = {
            "operator_norm.weight": "input_layernorm.weight",
            "ffn_norm.weight": "post_attention_layernorm.weight",
            "feed_forward.w1.weight": "mlp.gate_proj.weight",
            "feed_forward.w3.weight": "mlp.up_proj.weight",
            "feed_forward.w2.weight": "mlp.down_proj.weight",
        }
        if config.layer_types[layer] == "conv":
            renames.update(
                {f"conv.{m}.{k}": f"self_attn.{m}.{k}" for m in ("in_proj", "conv", "out_proj") for k in conv_kinds}
            )
        else:
            renames.update(
                {
                    "self_attn.out_proj.weight": "self_attn.o_proj.weight",
                    "self_attn.q_layernorm.weight": "self_attn.q_norm.weight",
                    "self_attn.k_layernorm.weight": "self_attn.k_norm.weight",
                }
            )
        for stored, ours in renames.items():
            layout[f"{p}.{stored}"] = {f"{p}.{ours}": None}
    return layout
