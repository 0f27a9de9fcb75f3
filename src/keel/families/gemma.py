"""Gemma (`GemmaForCausalLM`, model_type gemma): Gemma 2's elder, Llama's block with Gemma's conventions. Every
RMSNorm scales by (1 + weight) in float32, the embedding is multiplied by sqrt(hidden_size), the MLP is GELU-gated
(tanh approximation: the released configs' `hidden_act` "gelu" means it, as transformers reads it), the head is
tied; no sandwich norms, no soft-capping, no sliding window. Checkpoint names are Llama's.

Not read: the bidirectional attention of `use_bidirectional_attention`, refused by name.
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError

FAMILY = "gemma"
HF_ARCHITECTURE = "GemmaForCausalLM"
# transformers' GemmaConfig defaults.
DEFAULTS: dict[str, Any] = {
    "head_dim": 256,
    "num_key_value_heads": 16,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10_000.0,
    "max_position_embeddings": 8192,
    "bos_token_id": 2,
    "eos_token_id": [1],
}
_TANH_GELU = ("gelu", "gelu_pytorch_tanh", "gelu_new")


def refuse_bidirectional(hf: dict[str, Any], source: str) -> None:
    """Every Gemma config may ask for bidirectional attention (an encoder's), which keel does not run."""
    if hf.get("use_bidirectional_attention"):
        raise ConfigError(
            f"{source}: use_bidirectional_attention {hf['use_bidirectional_attention']!r} is not supported"
        )


# Gemma 2 and 3 read `hidden_activation` as transformers' ACT2FN does (Gemma 1 reads every GELU as the tanh one).
_GEMMA2_ACTIVATIONS = {
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu": "gelu",
}


def gemma2_activation(hf: dict[str, Any], source: str) -> str:
    """Gemma 2's and 3's MLP activation under keel's name (`hidden_activation`, else `hidden_act`)."""
    activation = hf.get("hidden_activation", hf.get("hidden_act", "gelu_pytorch_tanh"))
    if activation not in _GEMMA2_ACTIVATIONS:
        raise ConfigError(
            f"{source}: hidden_activation {activation!r} is not supported ({', '.join(_GEMMA2_ACTIVATIONS)})"
        )
    return _GEMMA2_ACTIVATIONS[activation]


def gemma2_activation_to_hf(config: Any) -> str:
    return {"gelu_tanh": "gelu_pytorch_tanh"}.get(config.hidden_act, config.hidden_act)


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    refuse_bidirectional(hf, source)
    activation = hf.get("hidden_activation") or hf.get("hidden_act", "gelu_pytorch_tanh")
    if activation not in _TANH_GELU:
        raise ConfigError(f"{source}: hidden_act {activation!r} is not supported (gelu_pytorch_tanh)")
    return {
        "norm_weight_offset": 1.0,
        "embedding_multiplier": float(hf["hidden_size"]) ** 0.5,
        "hidden_act": "gelu_tanh",
        "qkv_bias": bool(hf.get("attention_bias", False)),
        "o_bias": bool(hf.get("attention_bias", False)),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {"model_type": "gemma", "hidden_act": "gelu_pytorch_tanh", "attention_bias": config.qkv_bias}
