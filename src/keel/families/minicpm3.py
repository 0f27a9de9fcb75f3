"""MiniCPM3 (`MiniCPM3ForCausalLM`: openbmb/MiniCPM3-4B): DeepSeek-V2's multi-head latent attention (low-rank
queries by default) rotating its rope channels as halves (keel's `rope_interleave` false), in Llama's block with
muP's three scalars: the embedding times `scale_emb`, each sublayer's output times `scale_depth / sqrt(layers)`
(keel's `residual_multiplier`) and the final hidden state divided by `hidden_size / dim_model_base` (keel's
`logits_scaling`). The LM head tied by default. Its releases scale rope by LongRoPE over the rope channels.
"""

from __future__ import annotations

import math
from typing import Any

FAMILY = "minicpm3"
HF_ARCHITECTURE = "MiniCPM3ForCausalLM"
# transformers' MiniCPM3Config defaults (v_head_dim: hidden_size // num_attention_heads where absent, set below).
DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": 40,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 32768,
    "bos_token_id": 1,
    "eos_token_id": [2],
    "q_lora_rank": 768,
    "kv_lora_rank": 256,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 32,
    "v_head_dim": 0,
    "rope_interleave": False,
}


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    hidden, layers = int(hf["hidden_size"]), int(hf["num_hidden_layers"])
    depth = hf.get("scale_depth", 1.4)
    base = hf.get("dim_model_base", 256)
    return {
        "v_head_dim": int(hf.get("v_head_dim") or hidden // int(hf["num_attention_heads"])),
        "rope_interleave": False,
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
        "embedding_multiplier": float(hf.get("scale_emb", 12)),
        # None: sqrt(layers), no scaling; dim_model_base None: hidden_size, none either
        "residual_multiplier": 1.0 if depth is None else float(depth) / math.sqrt(layers),
        "logits_scaling": 1.0 if base is None else hidden / float(base),
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {
        "scale_emb": config.embedding_multiplier,
        "scale_depth": config.residual_multiplier * math.sqrt(config.num_layers),
        "dim_model_base": round(config.hidden_size / config.logits_scaling),  # an int, as its config class declares
    }
