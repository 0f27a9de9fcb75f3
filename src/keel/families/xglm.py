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

from typing import Any

from keel.errors import ConfigError
from keel.families import fairseq

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
_PAD_TOKEN_ID = 1  # XGLMConfig's default pad_token_id, the table's padding row


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    if hf.get("add_cross_attention"):
        raise ConfigError(f"{source}: add_cross_attention (cross-attention over an encoder) is not supported")
    pad = hf.get("pad_token_id", _PAD_TOKEN_ID)
    return {
        **fairseq.block_fields(hf),
        "position_embedding": "sinusoidal",  # fairseq's padding_idx: the table's row pad_token_id is zeros
        "position_padding_idx": None if pad is None else int(pad),
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    scaled = fairseq.scale_embedding(config, "XGLM")
    if config.position_padding_idx != config.pad_token_id:
        raise ConfigError(f"{config.architecture}: XGLM's position_padding_idx is its pad_token_id")
    return {
        "ffn_dim": config.intermediate_size,
        "activation_function": {"gelu_tanh": "gelu_new"}.get(config.hidden_act, config.hidden_act),
        "scale_embedding": scaled,
    }


def checkpoint_layout(config: Any) -> dict[str, dict[str, None]]:
    """XGLM's stored names -> keel's (Llama's)."""
    return fairseq.layer_layout(config, "model")
