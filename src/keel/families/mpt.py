"""MPT (`MptForCausalLM`: mosaicml/mpt-7b, mpt-30b and their fine-tunes): ALiBi in place of any position embedding
(keel's position_embedding "alibi", with MPT's `alibi_bias_max`: its slopes are Bloom's for 8), LayerNorms without
bias (MPT's low_precision_layernorm) before sequential sublayers, multi-head attention without biases whose q, k and
v are the consecutive thirds of one `Wqkv` (clamped to +-`clip_qkv` where set: keel's clip_qkv, elementwise like
MPT's clamp of the fused output), `softmax_scale` (keel's attention_scale), an ungated exact-GELU MLP
`expansion_ratio` x d_model wide without biases, and the head tied to the embedding. transformers' MPT runs only
that: the attention options it ignores are refused by name where they would change the model (`alibi` false: learned
positions; `qk_ln`; `attn_type` multiquery_attention; `prefix_lm`; `attn_uses_sequence_id`), as are `no_bias` false
(biases transformers would not load) and a `logit_scale`. transformers also builds its ALiBi with alibi_bias_max 8
whatever the config says; keel reads the config's (every MPT release has 8).
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError

FAMILY = "mpt"
HF_ARCHITECTURE = "MptForCausalLM"
# MptConfig's attribute_map and its keys for the common ones keel reads.
ATTRIBUTE_MAP = {
    "d_model": "hidden_size",
    "n_heads": "num_attention_heads",
    "n_layers": "num_hidden_layers",
    "max_seq_len": "max_position_embeddings",
    "layer_norm_epsilon": "rms_norm_eps",
}
# transformers' MptConfig defaults (its layer_norm_epsilon is keel's rms_norm_eps: the norms' eps).
DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 2048,
    "hidden_act": "gelu",
}
# MptAttentionConfig's defaults
_ATTENTION = {
    "attn_type": "multihead_attention",
    "clip_qkv": None,
    "softmax_scale": None,
    "prefix_lm": False,
    "qk_ln": False,
    "attn_uses_sequence_id": False,
    "alibi": True,
    "alibi_bias_max": 8,
}


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    attn = {**_ATTENTION, **(hf.get("attn_config") or {})}
    if not attn["alibi"]:
        raise ConfigError(f"{source}: MPT's attn_config.alibi false (learned positions) is not supported")
    for key in ("qk_ln", "prefix_lm", "attn_uses_sequence_id"):
        if attn[key]:
            raise ConfigError(f"{source}: MPT's attn_config.{key} is not supported")
    if attn["attn_type"] != "multihead_attention":
        raise ConfigError(f"{source}: MPT's attn_config.attn_type {attn['attn_type']!r} is not supported")
    if not hf.get("no_bias", True):
        raise ConfigError(f"{source}: MPT's no_bias false (biased projections and norms) is not supported")
    if hf.get("logit_scale") is not None:
        raise ConfigError(f"{source}: MPT's logit_scale is not supported")
    clip = attn["clip_qkv"]
    scale = attn["softmax_scale"]
    return {
        "position_embedding": "alibi",
        "alibi_bias_max": float(attn["alibi_bias_max"]),
        "norm_type": "layer",
        "norm_bias": False,
        "num_kv_heads": int(hf["num_attention_heads"]),  # multi-head attention only
        "intermediate_size": int(hf.get("expansion_ratio", 4)) * int(hf["hidden_size"]),
        "hidden_act": "gelu",
        "mlp_gated": False,
        "clip_qkv": None if not clip else float(clip),
        "attention_scale": None if scale is None else float(scale),
        "tie_word_embeddings": True,  # MptForCausalLM always ties its head
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    arch = config.architecture
    if config.num_kv_heads != config.num_heads or config.intermediate_size % config.hidden_size:
        raise ConfigError(f"{arch}: MPT has multi-head attention and an MLP a whole multiple of d_model wide")
    if config.qkv_bias or config.o_bias or config.mlp_bias or config.norm_bias or not config.tie_word_embeddings:
        raise ConfigError(f"{arch}: MPT has no biases and a tied head")
    if config.position_embedding != "alibi" or config.alibi_scale != 1:
        raise ConfigError(f"{arch}: MPT's positions are ALiBi, unscaled")
    return {
        "expansion_ratio": config.intermediate_size // config.hidden_size,
        "max_seq_len": config.max_position_embeddings,
        "layer_norm_epsilon": config.rms_norm_eps,
        "no_bias": True,
        "attn_config": {
            "alibi": True,
            "alibi_bias_max": int(config.alibi_bias_max)
            if float(config.alibi_bias_max).is_integer()
            else config.alibi_bias_max,
            "clip_qkv": config.clip_qkv,
            "softmax_scale": config.attention_scale,
        },
    }


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """Stored tensor -> {the HF-style (Llama) name keel reads: its rows of it, or None: all of it}."""
    q = config.num_heads * config.head_dim
    rows = {"q_proj": [(0, q)], "k_proj": [(q, 2 * q)], "v_proj": [(2 * q, 3 * q)]}
    layout: dict[str, dict[str, list[tuple[int, int]] | None]] = {
        "transformer.wte.weight": {"model.embed_tokens.weight": None},
        "transformer.norm_f.weight": {"model.norm.weight": None},
    }
    for layer in range(config.num_layers):
        src, dst = f"transformer.blocks.{layer}", f"model.layers.{layer}"
        layout[f"{src}.norm_1.weight"] = {f"{dst}.input_layernorm.weight": None}
        layout[f"{src}.norm_2.weight"] = {f"{dst}.post_attention_layernorm.weight": None}
        layout[f"{src}.attn.Wqkv.weight"] = {f"{dst}.self_attn.{name}.weight": r for name, r in rows.items()}
        layout[f"{src}.attn.out_proj.weight"] = {f"{dst}.self_attn.o_proj.weight": None}
        layout[f"{src}.ffn.up_proj.weight"] = {f"{dst}.mlp.up_proj.weight": None}
        layout[f"{src}.ffn.down_proj.weight"] = {f"{dst}.mlp.down_proj.weight": None}
    return layout
