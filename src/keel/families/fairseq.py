"""fairseq's decoder as XGLM and BioGPT keep it (not a family): absolute positions from row 2 of their table, the
token embedding times sqrt(hidden_size) where `scale_embedding`, biased LayerNorms of eps 1e-5 (torch's default:
neither model reads a key for it) before each sublayer and a final one, multi-head attention with biases on q/k/v
and `out_proj`, an ungated biased MLP `fc1` / `fc2`, a head tied by default; what the two families share of their
translation (OPT's layers carry the same names)."""

from __future__ import annotations

import math
from typing import Any

from keel.errors import ConfigError

POSITION_OFFSET = 2  # position p reads row p + 2 of the table
LAYER_NORM_EPS = 1e-5
# the names inside each decoder layer -> keel's (Llama's)
LAYER_NAMES = {
    "self_attn_layer_norm": "input_layernorm",
    "final_layer_norm": "post_attention_layernorm",
    "self_attn.q_proj": "self_attn.q_proj",
    "self_attn.k_proj": "self_attn.k_proj",
    "self_attn.v_proj": "self_attn.v_proj",
    "self_attn.out_proj": "self_attn.o_proj",
    "fc1": "mlp.up_proj",
    "fc2": "mlp.down_proj",
}


def block_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """keel's fields of the fairseq block, beyond the kind of positions."""
    hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    return {
        "head_dim": hidden // heads,
        "num_kv_heads": heads,  # multi-head attention only
        "position_offset": POSITION_OFFSET,
        "embedding_multiplier": math.sqrt(hidden) if hf.get("scale_embedding", True) else 1.0,
        "norm_type": "layer",
        "norm_bias": True,
        "rms_norm_eps": LAYER_NORM_EPS,
        "qkv_bias": True,
        "o_bias": True,
        "mlp_bias": True,
        "mlp_gated": False,
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
    }


def scale_embedding(config: Any, name: str) -> bool:
    """The `scale_embedding` key of a config that is the fairseq block; a ConfigError naming `name` where it is not."""
    where = config.architecture
    if config.num_kv_heads != config.num_heads or config.head_dim * config.num_heads != config.hidden_size:
        raise ConfigError(f"{where}: {name} has multi-head attention of hidden_size / heads wide heads")
    if not (config.qkv_bias and config.o_bias and config.mlp_bias and config.norm_bias):
        raise ConfigError(f"{where}: {name} has biases on every projection and norm")
    if config.rms_norm_eps != LAYER_NORM_EPS or config.position_offset != POSITION_OFFSET:
        raise ConfigError(f"{where}: {name}'s norms have eps 1e-5 and its position table offset 2")
    scaled = config.embedding_multiplier == math.sqrt(config.hidden_size)
    if not scaled and config.embedding_multiplier != 1.0:
        raise ConfigError(f"{where}: {name}'s embedding_multiplier is sqrt(hidden_size) or 1")
    return scaled


def layer_layout(config: Any, prefix: str, final_norm: str = "layer_norm") -> dict[str, dict[str, None]]:
    """The stored names of the layers and the final norm (`final_norm`: OPT's is `final_layer_norm`) under `prefix`
    (`model`, `biogpt`, OPT's `decoder`) -> keel's."""
    layout: dict[str, dict[str, None]] = {}
    for kind in ("weight", "bias"):
        layout[f"{prefix}.{final_norm}.{kind}"] = {f"model.norm.{kind}": None}
        for layer in range(config.num_layers):
            src, dst = f"{prefix}.layers.{layer}", f"model.layers.{layer}"
            for stored, name in LAYER_NAMES.items():
                layout[f"{src}.{stored}.{kind}"] = {f"{dst}.{name}.{kind}": None}
    return layout
