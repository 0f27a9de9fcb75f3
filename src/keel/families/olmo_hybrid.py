"""OLMo Hybrid (`OlmoHybridForCausalLM`: Olmo-Hybrid-7B): OLMo 3's full-attention layers (keel.families.olmo2: norms
on each sublayer's output, q/k RMSNorms over the whole projections; no sliding window) between Gated DeltaNet layers
(`layer_types` "linear_attention", by default three in four: keel.model.linear_attention) that are normed before
each sublayer as Llama's are (keel's `linear_norm_placement` "pre"), with plain (not 1 + w) RMSNorms.

Its Gated DeltaNet differs from Qwen3.5's in three options: beta times 2 where `linear_allow_neg_eigval` (the
default; keel's `linear_beta_scale`), an output norm of eps 1e-5 whatever `rms_norm_eps` (keel's
`linear_norm_eps`), and separate projections and convolutions: `q_proj`, `k_proj` and `v_proj` are blocks of rows
of keel's `in_proj_qkv` (keel.families.parts.Block), `q_conv1d`, `k_conv1d` and `v_conv1d` of its `conv1d`; `g_proj`,
`b_proj`, `a_proj`, `o_norm` and `o_proj` are keel's `in_proj_z`, `in_proj_b`, `in_proj_a`, `norm` and `out_proj`.
A Gated DeltaNet layer's norms are stored as `attention_layer_norm` and `feedforward_layer_norm` (keel's, and
transformers' in memory, `input_layernorm` and `post_attention_layernorm`), an attention layer's as OLMo 2's
(its output norm of the attention also as `feedforward_layer_norm`, as transformers saves it).

The released checkpoints have no position encoding: a null `rope_theta` (at the top level, or in
`rope_parameters`) turns RoPE off in every layer (keel's `rope_layers`); with a base, the full-attention layers
rotate. The convolution's activation is `hidden_act`'s: another than SiLU is refused by name.
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError
from keel.families import olmo2
from keel.families.layer_kinds import refuse_other_conv_activation
from keel.families.parts import Block

FAMILY = "olmo_hybrid"
HF_ARCHITECTURE = "OlmoHybridForCausalLM"
# transformers' OlmoHybridConfig defaults.
DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 65536,
    "bos_token_id": None,
    "eos_token_id": [100257],
}
FULL_ATTENTION_EVERY = 4  # the default layer_types: every fourth layer full attention
OUTPUT_NORM_EPS = 1e-5  # its Gated DeltaNet's output norm (FLA's FusedRMSNormGated default)
NEG_EIGVAL_BETA_SCALE = 2.0
# Gated DeltaNet tensors keel reads under other names (transformers' under linear_attn., keel's under self_attn.)
LINEAR_RENAMES = {
    "g_proj.weight": "in_proj_z.weight",
    "b_proj.weight": "in_proj_b.weight",
    "a_proj.weight": "in_proj_a.weight",
    "dt_bias": "dt_bias",
    "A_log": "A_log",
    "o_norm.weight": "norm.weight",
    "o_proj.weight": "out_proj.weight",
}


def layer_types(hf: dict[str, Any], source: str) -> list[str]:
    """The file's layer kinds, else transformers' rule: every fourth layer full attention (the last at least)."""
    layers = int(hf["num_hidden_layers"])
    kinds = hf.get("layer_types")
    if kinds is None:
        full = FULL_ATTENTION_EVERY - 1
        kinds = ["full_attention" if i % FULL_ATTENTION_EVERY == full else "linear_attention" for i in range(layers)]
        if "full_attention" not in kinds:
            kinds[-1] = "full_attention"
    if len(kinds) != layers or not set(kinds) <= {"linear_attention", "full_attention"}:
        raise ConfigError(f"{source}: layer_types must list linear_attention or full_attention for each of {layers}")
    return list(kinds)


def _no_rope(hf: dict[str, Any]) -> bool:
    """Whether the config turns RoPE off: a null base in `rope_parameters`, or at the top level without them."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        return params["rope_theta"] is None
    return "rope_theta" in hf and hf["rope_theta"] is None


def linear_geometry(hf: dict[str, Any]) -> dict[str, int]:
    """The Gated DeltaNet's heads and widths, transformers' defaults where the file has none."""
    heads = int(hf["num_attention_heads"])
    key_heads = int(hf.get("linear_num_key_heads") or heads)
    key_dim = int(hf.get("linear_key_head_dim") or int(0.75 * int(hf["hidden_size"]) / key_heads))
    return {
        "linear_num_key_heads": key_heads,
        "linear_num_value_heads": int(hf.get("linear_num_value_heads") or heads),
        "linear_key_head_dim": key_dim,
        "linear_value_head_dim": int(hf.get("linear_value_head_dim") or 2 * key_dim),
        "linear_conv_kernel_dim": int(hf.get("linear_conv_kernel_dim") or 4),
    }


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    refuse_other_conv_activation(hf, source)
    kinds = layer_types(hf, source)
    return {
        **olmo2.config_fields(hf, source),
        "layer_types": kinds,
        "sliding_window": None,
        **linear_geometry(hf),
        "linear_beta_scale": NEG_EIGVAL_BETA_SCALE if hf.get("linear_allow_neg_eigval", True) else 1.0,
        "linear_norm_eps": OUTPUT_NORM_EPS,
        "linear_norm_placement": "pre",
        "rope_layers": [False] * len(kinds) if _no_rope(hf) else [],
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    keys = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
    out = {
        **olmo2.hf_fields(config, hf),
        "layer_types": list(config.layer_types),
        **{key: getattr(config, key) for key in (*keys, "linear_conv_kernel_dim")},
        "linear_allow_neg_eigval": config.linear_beta_scale == NEG_EIGVAL_BETA_SCALE,
    }
    if config.rope_layers and not any(config.rope_layers):
        out["rope_parameters"] = {**hf["rope_parameters"], "rope_theta": None}
    return out


def checkpoint_layout(config: Any) -> dict[str, dict[str, Any]]:
    """OLMo 2's output norms in the attention layers; the Gated DeltaNet's tensors under keel's names, its q/k/v
    projections as blocks of in_proj_qkv's rows (the module docstring)."""
    layout: dict[str, dict[str, Any]] = {}
    keys = config.linear_num_key_heads * config.linear_key_head_dim
    values = config.linear_num_value_heads * config.linear_value_head_dim
    blocks = {"q": Block(0, keys), "k": Block(1, keys), "v": Block(2, values)}
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}"
        if config.layer_types[layer] != "linear_attention":
            # transformers saves the attention's output norm as feedforward_layer_norm (its renaming of the Gated
            # DeltaNet layers' norms, undone on every layer) and reads either name: so does keel, and writes the
            # one transformers writes (the last listed is export's)
            layout[f"{p}.post_attention_layernorm.weight"] = {f"{p}.attn_output_norm.weight": None}
            layout[f"{p}.feedforward_layer_norm.weight"] = {f"{p}.attn_output_norm.weight": None}
            layout[f"{p}.post_feedforward_layernorm.weight"] = {f"{p}.mlp_output_norm.weight": None}
            continue
        layout[f"{p}.attention_layer_norm.weight"] = {f"{p}.input_layernorm.weight": None}
        layout[f"{p}.feedforward_layer_norm.weight"] = {f"{p}.post_attention_layernorm.weight": None}
        for part, block in blocks.items():
            layout[f"{p}.linear_attn.{part}_proj.weight"] = {f"{p}.self_attn.in_proj_qkv.weight": block}
            layout[f"{p}.linear_attn.{part}_conv1d.weight"] = {f"{p}.self_attn.conv1d.weight": block}
        for name, ours in LINEAR_RENAMES.items():
            layout[f"{p}.linear_attn.{name}"] = {f"{p}.self_attn.{ours}": None}
    return layout
