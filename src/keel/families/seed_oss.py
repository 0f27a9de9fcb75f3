"""Seed-OSS (`SeedOssForCausalLM`): Llama's block with its own bias switches: q/k/v (`attention_bias`), the
attention's output (`attention_out_bias`) and the MLP (`mlp_bias`).
"""

from __future__ import annotations

from typing import Any

FAMILY = "seed_oss"
HF_ARCHITECTURE = "SeedOssForCausalLM"
# transformers' SeedOssConfig defaults.
DEFAULTS: dict[str, Any] = {
    "head_dim": 128,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 524_288,
    "bos_token_id": 0,
    "eos_token_id": [2],
}


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    return {
        "qkv_bias": bool(hf.get("attention_bias", True)),
        "o_bias": bool(hf.get("attention_out_bias", False)),
        "mlp_bias": bool(hf.get("mlp_bias", False)),
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {"attention_bias": config.qkv_bias, "attention_out_bias": config.o_bias, "mlp_bias": config.mlp_bias}
