"""ERNIE 4.5 dense (`Ernie4_5ForCausalLM`): Llama's block with biases on every projection where `use_bias` is set,
a tied head by default, and rotary on interleaved pairs over each whole head, served by keel's rotate-half
rotary through q/k rows regrouped at load and interleaved again on export
(keel.families.rope.interleaved_qk_layout).
"""

from __future__ import annotations

from typing import Any

from keel.families.rope import interleaved_qk_layout

FAMILY = "ernie4_5"
HF_ARCHITECTURE = "Ernie4_5ForCausalLM"
# transformers' Ernie4_5Config defaults.
DEFAULTS: dict[str, Any] = {
    "head_dim": 128,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500_000.0,
    "max_position_embeddings": 131_072,
    "bos_token_id": 1,
    "eos_token_id": [2],
}


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    bias = bool(hf.get("use_bias", False))
    return {
        "qkv_bias": bias,
        "o_bias": bias,
        "mlp_bias": bias,
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {"use_bias": config.qkv_bias}


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    return interleaved_qk_layout(config)
