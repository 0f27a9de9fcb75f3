"""OPT (`OPTForCausalLM`: facebook/opt-125m, 1.3b ... 66b, and their fine-tunes): learned absolute positions whose
table starts at row 2 (`embed_positions` of max_position_embeddings + 2 rows: keel's position_offset 2), LayerNorms
(eps 1e-5, torch's default: OPT has no key for it) before each sublayer with weights and biases unless
`layer_norm_elementwise_affine` is false (keel's norm_affine off), a ReLU MLP `fc1` / `fc2`, biases on q/k/v,
`out_proj`, fc1 and fc2 where `enable_bias`, and an unbiased LM head tied by default.

OPT-350m's block: `do_layer_norm_before` false puts each norm after its residual add, x = norm(x + sublayer(x))
(keel's norm_placement post_residual, not its `post`, which norms the sublayer's output before the add), and leaves
no final norm (keel's final_norm off, as `_remove_final_layer_norm` does for the pre-norm block); a
`word_embed_proj_dim` other than hidden_size gives the embedding and the tied head that width, with `project_in` /
`project_out` (unbiased) between them and the model (keel's embedding_size). Hub checkpoints saved from OPTModel name
their tensors without the `model.` prefix (`decoder.layers.0...`); both are read.
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError
from keel.families import fairseq

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
    pre_norm = bool(hf.get("do_layer_norm_before", True))
    embedding = int(hf.get("word_embed_proj_dim") or hidden)
    bias = bool(hf.get("enable_bias", True))
    affine = bool(hf.get("layer_norm_elementwise_affine", True))
    return {
        "head_dim": hidden // heads,
        "num_kv_heads": heads,  # multi-head attention only
        "position_embedding": "learned",
        "position_offset": _POSITION_OFFSET,
        "norm_type": "layer",
        "norm_placement": "pre" if pre_norm else "post_residual",
        # OPTDecoder's final norm: the pre-norm block's, unless removed
        "final_norm": pre_norm and not bool(hf.get("_remove_final_layer_norm", False)),
        "embedding_size": 0 if embedding == hidden else embedding,
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
    pre_norm = config.norm_placement == "pre"
    if config.norm_placement not in ("pre", "post_residual") or (not pre_norm and config.final_norm):
        raise ConfigError(f"{config.architecture}: OPT's norms come before each sublayer, or after each residual add")
    return {
        "ffn_dim": config.intermediate_size,
        "activation_function": {"gelu_tanh": "gelu_new"}.get(config.hidden_act, config.hidden_act),
        "do_layer_norm_before": pre_norm,
        "_remove_final_layer_norm": pre_norm and not config.final_norm,
        "word_embed_proj_dim": config.embedding_size or config.hidden_size,
        "enable_bias": config.qkv_bias,
        "layer_norm_elementwise_affine": config.norm_affine,
    }


def _layout(config: Any, prefix: str) -> dict[str, dict[str, None]]:
    layout: dict[str, dict[str, None]] = {
        f"{prefix}decoder.embed_tokens.weight": {"model.embed_tokens.weight": None},
        f"{prefix}decoder.embed_positions.weight": {"model.embed_positions.weight": None},
        f"{prefix}decoder.project_in.weight": {"model.project_in.weight": None},
        f"{prefix}decoder.project_out.weight": {"model.project_out.weight": None},
    }
    layout.update(fairseq.layer_layout(config, f"{prefix}decoder", final_norm="final_layer_norm"))
    return layout


def checkpoint_layout(config: Any) -> dict[str, dict[str, None]]:
    """OPT's stored names -> keel's (Llama's): OPTModel's bare names first, so that an export writes
    OPTForCausalLM's `model.` ones."""
    return {**_layout(config, ""), **_layout(config, "model.")}
