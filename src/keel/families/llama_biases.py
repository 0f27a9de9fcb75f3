"""Llama's bias keys, which the families transformers runs on Llama's model read as Llama does: `attention_bias` on
q, k, v and o, `mlp_bias` on the MLP."""

from __future__ import annotations

from typing import Any


def bias_fields(hf: dict[str, Any]) -> dict[str, bool]:
    """qkv_bias, o_bias and mlp_bias from config.json."""
    attention = bool(hf.get("attention_bias", False))
    return {"qkv_bias": attention, "o_bias": attention, "mlp_bias": bool(hf.get("mlp_bias", False))}


def bias_keys(config: Any) -> dict[str, bool]:
    """The two keys again, on export."""
    return {"attention_bias": config.qkv_bias, "mlp_bias": config.mlp_bias}
