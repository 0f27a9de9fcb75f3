"""MiniMax-Text-01 and MiniMax-M1 (`MiniMaxForCausalLM`): lightning-attention layers (transformers'
"linear_attention", keel's "lightning": keel.model.lightning, a linear attention with a fixed decay per head) between
full softmax-attention layers (Mixtral's: grouped keys and values, rotary), Mixtral's experts in every layer (the
softmax's top k renormalised, `intermediate_size` wide), and MiniMax's residuals: each sublayer's residual is its
normed input, scaled (keel's `normed_residual`, x = alpha norm(x) + beta sublayer(norm(x)), with the file's
full_attn_/linear_attn_/mlp_ alpha and beta factors). Rotary covers the first `rotary_dim` channels of each head
where the file says so (the original release's key; the rope parameters' `partial_rotary_factor` too), else all.

Refused by name: a `sliding_window` (transformers' MiniMax windows its full-attention layers then; keel's windows
are per layer kind). Serving refuses what no recurrent model runs (tensor or pipeline parallelism, compiled decode,
prefix caching: keel.serve.hybrid).
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError
from keel.families.rope import rope_settings

FAMILY = "minimax"
HF_ARCHITECTURE = "MiniMaxForCausalLM"
# transformers' MiniMaxConfig defaults.
DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-5,
    "rope_theta": 1_000_000.0,
    "max_position_embeddings": 4096 * 32,
    "num_key_value_heads": 8,
    "bos_token_id": 1,
    "eos_token_id": [2],
}
# (keel's sublayer, transformers' factor prefix)
FACTORS = (("attn", "full_attn"), ("lightning", "linear_attn"), ("mlp", "mlp"))
KINDS = {"full_attention": "full_attention", "linear_attention": "lightning"}


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    if hf.get("sliding_window") is not None:
        raise ConfigError(f"{source}: MiniMax sliding_window {hf['sliding_window']} is not supported")
    layers = int(hf["num_hidden_layers"])
    kinds = hf.get("layer_types") or [
        "full_attention" if (i + 1) % 2 else "linear_attention" for i in range(layers)
    ]  # transformers' default: alternating, full attention first
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise ConfigError(f"{source}: MiniMax layer_types {sorted(unknown)} are not supported")
    heads = int(hf["num_attention_heads"])
    head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // heads)
    partial = rope_settings(hf).get("partial_rotary_factor")
    if partial is None:
        partial = int(hf["rotary_dim"]) / head_dim if hf.get("rotary_dim") else 1.0
    width = int(hf.get("intermediate_size", 14336))
    scales = {}
    for keel_name, hf_name in FACTORS:
        scales[f"{keel_name}_residual_alpha"] = float(hf.get(f"{hf_name}_alpha_factor", 1))
        scales[f"{keel_name}_residual_beta"] = float(hf.get(f"{hf_name}_beta_factor", 1))
    return {
        "layer_types": [KINDS[kind] for kind in kinds],
        "head_dim": head_dim,
        "sliding_window": None,
        "qkv_bias": False,
        "o_bias": False,
        "partial_rotary_factor": float(partial),
        "num_experts": int(hf.get("num_local_experts", hf.get("num_experts", 8))),
        "num_experts_per_tok": int(hf.get("num_experts_per_tok", 2)),
        "moe_intermediate_size": width,
        "intermediate_size": width,
        "norm_topk_prob": True,
        "normed_residual": True,
        **scales,
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "layer_types": ["linear_attention" if kind == "lightning" else kind for kind in config.layer_types],
        "num_local_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "intermediate_size": config.moe_intermediate_size,
        "head_dim": config.head_dim,
    }
    if config.partial_rotary_factor != 1.0:
        out["rotary_dim"] = int(config.head_dim * config.partial_rotary_factor)
    for keel_name, hf_name in FACTORS:
        out[f"{hf_name}_alpha_factor"] = getattr(config, f"{keel_name}_residual_alpha")
        out[f"{hf_name}_beta_factor"] = getattr(config, f"{keel_name}_residual_beta")
    return out
