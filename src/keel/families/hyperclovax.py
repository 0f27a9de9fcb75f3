"""HyperCLOVA X (`HyperCLOVAXForCausalLM`: HyperCLOVAX-SEED-Think and kin): Granite's block and scalars (the
embedding, each sublayer's output and the softmax scale multiplied: `embedding_multiplier`, `residual_multiplier`,
`attention_multiplier`, head_dim^-1/2 where null) with an RMSNorm on each sublayer's output before it is scaled and
added where `use_post_norm` (its `post_norm1` and `post_norm2`: keel's `attn_output_norm` and `mlp_output_norm`),
and the logits *multiplied* by `logits_scaling` (Granite divides: keel's field is its inverse).
"""

from __future__ import annotations

from typing import Any

FAMILY = "hyperclovax"
HF_ARCHITECTURE = "HyperCLOVAXForCausalLM"
# transformers' HyperCLOVAXConfig defaults (GraniteConfig's).
DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "bos_token_id": 1,
    "eos_token_id": [2],
}


def _scalar(hf: dict[str, Any], key: str, default: float) -> float:
    return float(default if hf.get(key) is None else hf[key])


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // int(hf["num_attention_heads"]))
    bias = bool(hf.get("attention_bias", False))
    return {
        "norm_placement": "sandwich" if hf.get("use_post_norm", True) else "pre",
        "embedding_multiplier": _scalar(hf, "embedding_multiplier", 1.0),
        "residual_multiplier": _scalar(hf, "residual_multiplier", 1.0),
        "attention_scale": _scalar(hf, "attention_multiplier", head_dim**-0.5),
        "logits_scaling": 1.0 / _scalar(hf, "logits_scaling", 1.0),
        "qkv_bias": bias,
        "o_bias": bias,
        "mlp_bias": bool(hf.get("mlp_bias", False)),
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {
        "use_post_norm": config.norm_placement == "sandwich",
        "embedding_multiplier": config.embedding_multiplier,
        "residual_multiplier": config.residual_multiplier,
        "attention_multiplier": config.attention_scale,
        "logits_scaling": 1.0 / config.logits_scaling,
        "attention_bias": config.qkv_bias,
        "mlp_bias": config.mlp_bias,
    }


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """The output norms under keel's names."""
    layout: dict[str, dict[str, list[tuple[int, int]] | None]] = {}
    if config.norm_placement != "sandwich":
        return layout
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}"
        layout[f"{p}.post_norm1.weight"] = {f"{p}.attn_output_norm.weight": None}
        layout[f"{p}.post_norm2.weight"] = {f"{p}.mlp_output_norm.weight": None}
    return layout
