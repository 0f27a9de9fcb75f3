"""BioGPT (`BioGptForCausalLM`: microsoft/biogpt, BioGPT-Large): fairseq's decoder with learned absolute positions
whose table starts at row 2 (`embed_positions` of max_position_embeddings + 2 rows: keel's position_offset 2), the
token embedding times sqrt(hidden_size) where `scale_embedding` (keel's embedding_multiplier), biased LayerNorms
before each sublayer and a final one, multi-head attention with biases on q/k/v and `out_proj`, an ungated biased
MLP `fc1` / `fc2` (`hidden_act`, GELU by default) and an unbiased head `output_projection`, tied by default.
The norms' eps is torch's default 1e-5 whatever `layer_norm_eps` says: BioGptConfig has the key, but its model
builds its LayerNorms without it (read as transformers runs it: ignored).
"""

from __future__ import annotations

import math
from typing import Any

from keel.errors import ConfigError

FAMILY = "biogpt"
HF_ARCHITECTURE = "BioGptForCausalLM"
# transformers' BioGptConfig defaults.
DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 1024,
    "hidden_act": "gelu",
    "bos_token_id": 0,
    "eos_token_id": [2],
    "pad_token_id": 1,
}
# the offset of BioGptLearnedPositionalEmbedding: rows 0 and 1 of its table are never read
_POSITION_OFFSET = 2
_LAYER_NORM_EPS = 1e-5  # torch's nn.LayerNorm default, which BioGPT's norms keep


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    return {
        "head_dim": hidden // heads,
        "num_kv_heads": heads,  # multi-head attention only
        "position_embedding": "learned",
        "position_offset": _POSITION_OFFSET,
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
        raise ConfigError(f"{config.architecture}: BioGPT has multi-head attention of hidden_size / heads wide heads")
    if not (config.qkv_bias and config.o_bias and config.mlp_bias and config.norm_bias):
        raise ConfigError(f"{config.architecture}: BioGPT has biases on every projection and norm")
    if config.rms_norm_eps != _LAYER_NORM_EPS or config.position_offset != _POSITION_OFFSET:
        raise ConfigError(f"{config.architecture}: BioGPT's norms have eps 1e-5 and its position table offset 2")
    scaled = config.embedding_multiplier == math.sqrt(config.hidden_size)
    if not scaled and config.embedding_multiplier != 1.0:
        raise ConfigError(f"{config.architecture}: BioGPT's embedding_multiplier is sqrt(hidden_size) or 1")
    return {"scale_embedding": scaled, "layer_norm_eps": _LAYER_NORM_EPS}


# BioGPT's names inside each decoder layer -> keel's (Llama's)
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
    """BioGPT's stored names -> keel's (Llama's)."""
    layout: dict[str, dict[str, None]] = {
        "biogpt.embed_tokens.weight": {"model.embed_tokens.weight": None},
        "biogpt.embed_positions.weight": {"model.embed_positions.weight": None},
        "output_projection.weight": {"lm_head.weight": None},
    }
    for kind in ("weight", "bias"):
        layout[f"biogpt.layer_norm.{kind}"] = {f"model.norm.{kind}": None}
        for layer in range(config.num_layers):
            src, dst = f"biogpt.layers.{layer}", f"model.layers.{layer}"
            for stored, name in _LAYER_NAMES.items():
                layout[f"{src}.{stored}.{kind}"] = {f"{dst}.{name}.{kind}": None}
    return layout
