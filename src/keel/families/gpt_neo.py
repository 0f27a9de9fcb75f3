"""GPT-Neo (`GPTNeoForCausalLM`: EleutherAI/gpt-neo-125m, 1.3B, 2.7B): GPT-2's block with learned absolute positions
(`wpe`), biased LayerNorms before each sublayer and an ungated MLP `c_fc` / `c_proj` with biases (`gelu_new`, the
tanh approximation), here plain Linear layers with q, k and v apart and unbiased, `out_proj` biased, and no softmax
scaling (q.k as is: keel's attention_scale 1). Layers alternate global and local attention as `attention_types`
lists them ([[kinds, repeats], ...], expanded as transformers' expand_attention_types_params): a local layer attends
to the last `window_size` positions, itself included (keel's sliding window). The head is tied by default.
The causal-mask buffers older files hold (`attn.attention.bias`, `attn.attention.masked_bias`) are left unread.
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError

FAMILY = "gpt_neo"
HF_ARCHITECTURE = "GPTNeoForCausalLM"
# GPTNeoConfig's attribute_map, and its keys for the common ones keel reads.
ATTRIBUTE_MAP = {
    "num_heads": "num_attention_heads",
    "num_layers": "num_hidden_layers",
    "activation_function": "hidden_act",
    "layer_norm_epsilon": "rms_norm_eps",
}
# transformers' GPTNeoConfig defaults (its layer_norm_epsilon is keel's rms_norm_eps: the norms' eps).
DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 2048,
    "hidden_act": "gelu_new",
    "bos_token_id": 50256,
    "eos_token_id": [50256],
}
_ATTENTION_TYPES = [[["global", "local"], 12]]  # GPTNeoConfig's default (24 layers)
_WINDOW_SIZE = 256
_KINDS = {"global": "full_attention", "local": "sliding_attention"}


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    kinds = [kind for group, repeats in hf.get("attention_types") or _ATTENTION_TYPES for kind in group * repeats]
    if any(kind not in _KINDS for kind in kinds) or len(kinds) != int(hf["num_hidden_layers"]):
        raise ConfigError(f"{source}: attention_types {kinds} is not one of global / local per layer")
    return {
        "position_embedding": "learned",
        "head_dim": hidden // heads,
        "num_kv_heads": heads,  # multi-head attention only
        "norm_type": "layer",
        "norm_bias": True,
        "qkv_bias": False,
        "o_bias": True,
        "mlp_bias": True,
        "mlp_gated": False,
        "intermediate_size": int(hf.get("intermediate_size") or 4 * hidden),
        "attention_scale": 1.0,
        "layer_types": [_KINDS[kind] for kind in kinds],
        "sliding_window": int(hf.get("window_size", _WINDOW_SIZE)) if "local" in kinds else None,
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    if config.num_kv_heads != config.num_heads or config.head_dim * config.num_heads != config.hidden_size:
        raise ConfigError(f"{config.architecture}: GPT-Neo has multi-head attention of hidden_size / heads wide heads")
    if config.attention_scale != 1.0 or config.qkv_bias or not (config.o_bias and config.mlp_bias):
        raise ConfigError(f"{config.architecture}: GPT-Neo's softmax scale is 1, its biases on out_proj and the MLP")
    kinds = {kind: name for name, kind in _KINDS.items()}
    if any(kind not in kinds for kind in config.layer_types):
        raise ConfigError(f"{config.architecture}: GPT-Neo's layers are global or local only")
    return {
        # one group of every layer's kind, once
        "attention_types": [[[kinds[kind] for kind in config.layer_types], 1]],
        "window_size": config.sliding_window or _WINDOW_SIZE,
        "activation_function": {"gelu_tanh": "gelu_new"}.get(config.hidden_act, config.hidden_act),
        "layer_norm_epsilon": config.rms_norm_eps,
    }


# GPT-Neo's names inside each block -> keel's (Llama's), and whether each has a bias
_LAYER_NAMES = {
    "ln_1": ("input_layernorm", True),
    "ln_2": ("post_attention_layernorm", True),
    "attn.attention.q_proj": ("self_attn.q_proj", False),
    "attn.attention.k_proj": ("self_attn.k_proj", False),
    "attn.attention.v_proj": ("self_attn.v_proj", False),
    "attn.attention.out_proj": ("self_attn.o_proj", True),
    "mlp.c_fc": ("mlp.up_proj", True),
    "mlp.c_proj": ("mlp.down_proj", True),
}


def checkpoint_layout(config: Any) -> dict[str, dict[str, None]]:
    """GPT-Neo's stored names -> keel's (Llama's)."""
    layout: dict[str, dict[str, None]] = {
        "transformer.wte.weight": {"model.embed_tokens.weight": None},
        "transformer.wpe.weight": {"model.embed_positions.weight": None},
        "transformer.ln_f.weight": {"model.norm.weight": None},
        "transformer.ln_f.bias": {"model.norm.bias": None},
    }
    for layer in range(config.num_layers):
        src, dst = f"transformer.h.{layer}", f"model.layers.{layer}"
        for stored, (name, bias) in _LAYER_NAMES.items():
            layout[f"{src}.{stored}.weight"] = {f"{dst}.{name}.weight": None}
            if bias:
                layout[f"{src}.{stored}.bias"] = {f"{dst}.{name}.bias": None}
    return layout
