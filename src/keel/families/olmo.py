"""OLMo (`OlmoForCausalLM`: OLMo 1 and 1.7): Llama's block with LayerNorms that have neither weight nor bias (keel's
`norm_type` layer with `norm_affine` False: no norm tensors in its checkpoints), their eps fixed at 1e-5 whatever
the config says (transformers' OlmoLayerNorm), and q, k and v clamped to +-`clip_qkv` after their projections.
"""

from __future__ import annotations

from typing import Any

FAMILY = "olmo"
HF_ARCHITECTURE = "OlmoForCausalLM"
# transformers' OlmoConfig defaults (it has no norm eps: OlmoLayerNorm's is 1e-5).
DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "bos_token_id": None,
    "eos_token_id": [50279],
}


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    bias = bool(hf.get("attention_bias", False))
    clip = hf.get("clip_qkv")
    return {
        "norm_type": "layer",
        "norm_affine": False,
        "rms_norm_eps": 1e-5,  # OlmoLayerNorm's own: a config's rms_norm_eps is not read
        "clip_qkv": None if clip is None else float(clip),
        "qkv_bias": bias,
        "o_bias": bias,
        "mlp_bias": False,
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {"attention_bias": config.qkv_bias, "clip_qkv": config.clip_qkv}
