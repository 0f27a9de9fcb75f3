"""OPT (`OPTForCausalLM`: facebook/opt-125m, 1.3b ... 66b, and their fine-tunes): learned absolute positions whose
table starts at row 2 (`embed_positions` of max_position_embeddings + 2 rows: keel's position_offset 2), LayerNorms
(eps 1e-5, torch's default: OPT has no key for it) before each sublayer with weights and biases unless
`layer_norm_elementwise_affine` is false (keel's norm_affine off), a ReLU MLP `fc1` / `fc2`, biases on q/k/v,
`out_proj`, fc1 and fc2 where `enable_bias`, and an unbiased LM head tied by default.

Refused by name: `do_layer_norm_before` false (OPT-350m's post-norm block, x = norm(x + sublayer(x)), and no final
norm; keel's `post` placement norms the sublayer's output instead), `word_embed_proj_dim` other than hidden_size
(OPT-350m's project_in / project_out) and `_remove_final_layer_norm` (no final norm). Hub checkpoints saved from
OPTModel name their tensors without the `model.` prefix (`decoder.layers.0...`); both are read.
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError

FAMILY = "opt"
HF_ARCHITECTURE = "OPTForCausalLM"
# OPTConfig's keys for the common ones keel reads.
ATTRIBUTE_MAP = {"ffn_dim": "intermediate_size", "activation_function": "hidden_act"}
# transformers' OPTConfig defaults.
DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 2048,
    "hidden_act": "relu",
    "bos_token_id": 2,
    "eos_token_id": [2],
}
# the offset of OPTLearnedPositionalEmbedding: rows 0 and 1 of its table are never read
_POSITION_OFFSET = 2
_LAYER_NORM_EPS = 1e-5  # torch's nn.LayerNorm default, which OPT's norms keep


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    if not hf.get("do_layer_norm_before", True):
        raise ConfigError(f"{source}: do_layer_norm_before false (OPT-350m's post-norm block) is not supported")
    if hf.get("word_embed_proj_dim") not in (None, hidden):
        raise ConfigError(
            f"{source}: word_embed_proj_dim {hf['word_embed_proj_dim']} other than hidden_size {hidden} "
            "(project_in / project_out) is not supported"
        )
    if hf.get("_remove_final_layer_norm", False):
        raise ConfigError(f"{source}: _remove_final_layer_norm (no final norm) is not supported")
    bias = bool(hf.get("enable_bias", True))
    affine = bool(hf.get("layer_norm_elementwise_affine", True))
    return {
        "head_dim": hidden // heads,
        "num_kv_heads": heads,  # multi-head attention only
        "position_embedding": "learned",
        "position_offset": _POSITION_OFFSET,
        "norm_type": "layer",
        "norm_affine": affine,
        "norm_bias": affine,
        "rms_norm_eps": _LAYER_NORM_EPS,
        "qkv_bias": bias,
        "o_bias": bias,
        "mlp_bias": bias,
        "mlp_gated": False,
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    if config.num_kv_heads != config.num_heads or config.head_dim * config.num_heads != config.hidden_size:
        raise ConfigError(f"{config.architecture}: OPT has multi-head attention of hidden_size / heads wide heads")
    if not (config.qkv_bias == config.o_bias == config.mlp_bias) or config.norm_bias != config.norm_affine:
        raise ConfigError(f"{config.architecture}: OPT's enable_bias covers every projection, its norms' affine both")
    if config.rms_norm_eps != _LAYER_NORM_EPS or config.position_offset != _POSITION_OFFSET:
        raise ConfigError(f"{config.architecture}: OPT's norms have eps 1e-5 and its position table offset 2")
    return {
        "ffn_dim": config.intermediate_size,
        "activation_function": {"gelu_tanh": "gelu_new"}.get(config.hidden_act, config.hidden_act),
        "do_layer_norm_before": True,
        "_remove_final_layer_norm": False,
        "word_embed_proj_dim": config.hidden_size,
        "enable_bias": config.qkv_bias,
        "layer_norm_elementwise_affine": config.norm_affine,
    }


# OPT's names inside each decoder layer -> keel's (Llama's)
_LAYER_NAMES = {
    "self_attn_layer_norm": "input_layernorm",
    "final_layer_norm": "post_attention_layernorm",
    "self_attn.q_proj": "self_attn.q_proj",
    "self_attn.k_proj": "self_attn.k_proj",
    "self_attn.v_proj": "self_attn.v_proj",
    "self_attn.out_proj": "self_attn.o_proj",
    "fc1": "mlp.up_proj",
    "fc2": "mlp.down_proj",
}


def _layout(config: Any, prefix: str) -> dict[str, dict[str, None]]:
    layout: dict[str, dict[str, None]] = {
        f"{prefix}decoder.embed_tokens.weight": {"model.embed_tokens.weight": None},
        f"{prefix}decoder.embed_positions.weight": {"model.embed_positions.weight": None},
    }
    for kind in ("weight", "bias"):
        layout[f"{prefix}decoder.final_layer_norm.{kind}"] = {f"model.norm.{kind}": None}
        for layer in range(config.num_layers):
            src, dst = f"{prefix}decoder.layers.{layer}", f"model.layers.{layer}"
            for stored, name in _LAYER_NAMES.items():
                layout[f"{src}.{stored}.{kind}"] = {f"{dst}.{name}.{kind}": None}
    return layout


def checkpoint_layout(config: Any) -> dict[str, dict[str, None]]:
    """OPT's stored names -> keel's (Llama's): OPTModel's bare names first, so that an export writes
    OPTForCausalLM's `model.` ones."""
    return {**_layout(config, ""), **_layout(config, "model.")}
