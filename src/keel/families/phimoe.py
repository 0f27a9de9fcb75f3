"""Phi-3.5-MoE (`PhimoeForCausalLM`): Mixtral's block with LayerNorms with biases (eps `rms_norm_eps`), biases on
q/k/v and o where `attention_bias`, an LM head with a bias where `lm_head_bias`, a sliding window where set (every
layer, as Mixtral's), and Mixtral's experts (`intermediate_size` wide, named as Mixtral's) behind the SparseMixer
router (keel's `router_scoring` sparsemixer, keel.model.moe.sparsemixer: two experts a token, each weighted by a
softmax over the logits within `router_jitter_noise` of its own). `input_jitter_noise` scales the experts' input
by noise in transformers' training only: keel's training routes as it serves.

LongRoPE with PhiMoE's factor on cos/sin (`short_mscale` / `long_mscale`, which must agree:
`rope_attention_factor`). Past the pre-training context keel takes the long factors, as Microsoft's reference code
does (and transformers' other LongRoPE models); transformers 5's Phimoe keeps the short ones there (its rotary
recomputes the frequencies without the sequence length), so the two agree within `original_max_position_embeddings`
only.
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError

FAMILY = "phimoe"
HF_ARCHITECTURE = "PhimoeForCausalLM"
# transformers' PhimoeConfig defaults.
DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1e6,
    "max_position_embeddings": 4096 * 32,
    "bos_token_id": 1,
    "eos_token_id": [2],
}


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    top_k = int(hf.get("num_experts_per_tok", 2))
    if top_k != 2:  # transformers' SparseMixer routes two experts a token whatever the config says
        raise ConfigError(f"{source}: num_experts_per_tok {top_k} is not supported (SparseMixer routes 2)")
    width = int(hf.get("intermediate_size", 6400))
    bias = bool(hf.get("attention_bias", False))
    jitter = hf.get("router_jitter_noise")
    return {
        "norm_type": "layer",
        "norm_bias": True,
        "qkv_bias": bias,
        "o_bias": bias,
        "lm_head_bias": bool(hf.get("lm_head_bias", False)),
        "num_experts": int(hf.get("num_local_experts", 16)),
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": width,
        "intermediate_size": width,
        "router_scoring": "sparsemixer",
        "router_jitter_eps": 0.01 if jitter is None else float(jitter),
    }


def rope_attention_factor(rope_type: str, spec: dict[str, Any], source: str) -> float:
    """The factor on cos/sin under LongRoPE or YaRN (keel.config reads it in place of the type's own: transformers'
    Phimoe reads no `attention_factor` and replaces the type's): `short_mscale` for a forward within the
    pre-training context, `long_mscale` beyond it; keel's one factor takes them equal, as the released model has
    them. Other rope types are refused."""
    if rope_type not in ("yarn", "longrope"):
        raise ConfigError(f"{source}: Phimoe's rope_type {rope_type!r} is not supported (longrope, yarn)")
    short, long = spec.get("short_mscale"), spec.get("long_mscale")
    if not isinstance(short, int | float) or not isinstance(long, int | float):
        raise ConfigError(f"{source}: Phimoe's rope scaling needs numbers short_mscale and long_mscale")
    if short != long:
        raise ConfigError(f"{source}: Phimoe's short_mscale {short} and long_mscale {long} differ (not supported)")
    return float(short)


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    rope = hf["rope_parameters"]
    if config.rope_scaling.type in ("longrope", "yarn"):
        # PhiMoE's names of LongRoPE's factor on cos/sin (keel.config reads them into attention_factor)
        rope = {**rope, "short_mscale": config.rope_scaling.attention_factor}
        rope["long_mscale"] = rope["short_mscale"]
    return {
        "num_local_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "intermediate_size": config.moe_intermediate_size,
        "attention_bias": config.qkv_bias,
        "lm_head_bias": config.lm_head_bias,
        "router_jitter_noise": config.router_jitter_eps,
        "sliding_window": config.sliding_window,
        "rope_parameters": rope,
    }
