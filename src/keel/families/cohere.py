"""Cohere Command R (`CohereForCausalLM`): one LayerNorm without a bias feeding both sublayers of a parallel residual
(x + attn(norm(x)) + mlp(norm(x))), logits multiplied by `logit_scale` (keel divides by `logits_scaling`, its
inverse), a tied head, and rotary on interleaved pairs over each whole head, served by keel's rotate-half rotary
through q/k rows regrouped at load and interleaved again on export (keel.families.rope.interleaved_qk_layout).
Not read: the per-head LayerNorms of `use_qk_norm` (Command R+), refused by name.
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError
from keel.families.rope import interleaved_qk_layout

FAMILY = "cohere"
HF_ARCHITECTURE = "CohereForCausalLM"
# transformers' CohereConfig defaults (its layer_norm_eps is keel's rms_norm_eps: the norms' eps).
DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-5,
    "rope_theta": 500_000.0,
    "max_position_embeddings": 8192,
    "bos_token_id": 5,
    "eos_token_id": [255001],
}
LOGIT_SCALE = 0.0625


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    if hf.get("use_qk_norm"):
        raise ConfigError(f"{source}: use_qk_norm {hf['use_qk_norm']!r} (per-head LayerNorms) is not supported")
    eps = hf.get("layer_norm_eps")
    bias = bool(hf.get("attention_bias", False))
    return {
        "norm_type": "layer",
        "norm_bias": False,
        "rms_norm_eps": float(DEFAULTS["rms_norm_eps"] if eps is None else eps),
        "parallel_residual": True,
        "post_attention_norm": False,
        "logits_scaling": 1.0 / float(hf.get("logit_scale", LOGIT_SCALE)),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
        "qkv_bias": bias,
        "o_bias": bias,
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {
        "layer_norm_eps": config.rms_norm_eps,
        "logit_scale": 1.0 / config.logits_scaling,
        "attention_bias": config.qkv_bias,
        "use_qk_norm": False,
    }


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    return interleaved_qk_layout(config)
