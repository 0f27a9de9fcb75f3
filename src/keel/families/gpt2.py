"""GPT-2 (`GPT2LMHeadModel`: gpt2, distilgpt2, DialoGPT, and their fine-tunes): GPT-BigCode's block (learned
positions, biased LayerNorms, an ungated GELU MLP, biases everywhere, a tied head; keel.families.gpt_bigcode) with
multi-head attention whose q, k and v are c_attn's consecutive thirds, and its weights HF Conv1D's, stored
transposed ([in, out]): read through their transpose (keel.families.parts.Transposed) and written back as stored.
`scale_attn_by_inverse_layer_idx` divides layer i's softmax scale by i + 1 (keel's attention_scale_by_layer);
`reorder_and_upcast_attn` only reorders transformers' eager float16 arithmetic (its SDPA path ignores it), so it
is read and written back and changes nothing. Hub checkpoints saved from GPT2Model name their tensors without the
`transformer.` prefix (`h.0.attn.c_attn.weight`); both are read, and the causal-mask buffers older files hold
(`attn.bias`, `attn.masked_bias`) are left unread.
"""

from __future__ import annotations

from typing import Any

from keel.families.gpt_bigcode import ATTRIBUTE_MAP as ATTRIBUTE_MAP
from keel.families.gpt_bigcode import Layout, gpt2_block, gpt2_block_hf, gpt2_layout

FAMILY = "gpt2"
HF_ARCHITECTURE = "GPT2LMHeadModel"
# transformers' GPT2Config defaults (its layer_norm_epsilon is keel's rms_norm_eps: the norms' eps).
DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 1024,
    "hidden_act": "gelu_new",
    "bos_token_id": 50256,
    "eos_token_id": [50256],
}


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    return {
        **gpt2_block(hf, source),
        "num_kv_heads": int(hf["num_attention_heads"]),  # multi-head attention only
        "attention_scale_by_layer": bool(hf.get("scale_attn_by_inverse_layer_idx", False)),
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {**gpt2_block_hf(config), "scale_attn_by_inverse_layer_idx": config.attention_scale_by_layer}


def checkpoint_layout(config: Any) -> Layout:
    """Stored tensor -> {the HF-style (Llama) name keel reads: its rows (of its transpose, for a Conv1D weight)}:
    GPT2Model's bare names first, so that an export writes GPT2LMHeadModel's `transformer.` ones."""
    q = config.num_heads * config.head_dim
    rows = {"q_proj": [(0, q)], "k_proj": [(q, 2 * q)], "v_proj": [(2 * q, 3 * q)]}
    return {**gpt2_layout(config, rows, conv1d=True, prefix=""), **gpt2_layout(config, rows, conv1d=True)}
