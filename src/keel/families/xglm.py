"""XGLM (`XGLMForCausalLM`: facebook/xglm-564M, 1.7B, 2.9B, 4.5B, 7.5B): fairseq's decoder, with fixed sinusoidal
absolute positions (keel's position_embedding "sinusoidal", computed, never stored) indexed from row 2 (keel's
position_offset 2) whose row `pad_token_id` is zeros (fairseq's padding_idx: keel's position_padding_idx), the token
embedding times sqrt(d_model) where `scale_embedding` (keel's embedding_multiplier), biased LayerNorms (eps 1e-5,
torch's default: XGLM has no key for it) before each sublayer and a final one, multi-head attention with biases on
q/k/v and `out_proj`, an ungated biased MLP `fc1` / `fc2` (`activation_function`, GELU by default) and an unbiased
head tied by default.

Refused by name: `add_cross_attention` (cross-attention over an encoder's states: keel has no encoder).
"""

from __future__ import annotations

import math
from typing import Any

from keel.errors import ConfigError

FAMILY = "xglm"
HF_ARCHITECTURE = "XGLMForCausalLM"
# XGLMConfig's attribute_map, and its keys for the common ones keel reads.
ATTRIBUTE_MAP = {
    "d_model": "hidden_size",
    "attention_heads": "num_attention_heads",
    "num_layers": "num_hidden_layers",
    "ffn_dim": "intermediate_size",
    "activation_function": "hidden_act",
}
# transformers' XGLMConfig defaults.
DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 2048,
    "hidden_act": "gelu",
    "bos_token_id": 0,
    "eos_token_id": [2],
    "pad_token_id": 1,
}
# the offset of XGLMSinusoidalPositionalEmbedding: position p reads row p + 2
_POSITION_OFFSET = 2
_LAYER_NORM_EPS = 1e-5  # torch's nn.LayerNorm default, which XGLM's norms keep
_PAD_TOKEN_ID = 1  # XGLMConfig's default pad_token_id, the table's padding row


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    if hf.get("add_cross_attention"):
        raise ConfigError(f"{source}: add_cross_attention (cross-attention over an encoder) is not supported")
    hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    pad = hf.get("pad_token_id", _PAD_TOKEN_ID)
    return {
        "head_dim": hidden // heads,
        "num_kv_heads": heads,  # multi-head attention only
        "position_embedding": "sinusoidal",
        "position_offset": _POSITION_OFFSET,
        "position_padding_idx": None if pad is None else int(pad),
        "embedding_multiplier": math.sqrt(hidden) if hf.get("scale_embedding", True) else 1.0,
        "norm_type": "layer",
        "norm_bias": True,
        "rms_norm_eps": _LAYER_NORM_EPS,
        "qkv_bias": True,
        "o_bias": True,
        "mlp_bias": True,
        "mlp_gated": False,
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    if config.num_kv_heads != config.num_heads or config.head_dim * config.num_heads != config.hidden_size:
        raise ConfigError(f"{config.architecture}: XGLM has multi-head attention of hidden_size / heads wide heads")
    if not (config.qkv_bias and config.o_bias and config.mlp_bias and config.norm_bias):
        raise ConfigError(f"{config.architecture}: XGLM has biases on every projection and norm")
    if config.rms_norm_eps != _LAYER_NORM_EPS or config.position_offset != _POSITION_OFFSET:
        raise ConfigError(f"{config.architecture}: XGLM's norms have eps 1e-5 and its position table offset 2")
    if config.position_padding_idx != config.pad_token_id:
        raise ConfigError(f"{config.architecture}: XGLM's position_padding_idx is its pad_token_id")
    scaled = config.embedding_multiplier == math.sqrt(config.hidden_size)
    if not scaled and config.embedding_multiplier != 1.0:
        raise ConfigError(f"{config.architecture}: XGLM's embedding_multiplier is sqrt(hidden_size) or 1")
    return {
        "ffn_dim": config.intermediate_size,
        "activation_function": {"gelu_tanh": "gelu_new"}.get(config.hidden_act, config.hidden_act),
        "scale_embedding": scaled,
    }


# XGLM's names inside each decoder layer -> keel's (Llama's)
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


def checkpoint_layout(config: Any) -> dict[str, dict[str, None]]:
    """XGLM's stored names -> keel's (Llama's)."""
    layout: dict[str, dict[str, None]] = {}
    for kind in ("weight", "bias"):
        layout[f"model.layer_norm.{kind}"] = {f"model.norm.{kind}": None}
        for layer in range(config.num_layers):
            src, dst = f"model.layers.{layer}", f"model.layers.{layer}"
            for stored, name in _LAYER_NAMES.items():
                layout[f"{src}.{stored}.{kind}"] = {f"{dst}.{name}.{kind}": None}
    return layout
