"""GPT-OSS (`GptOssForCausalLM`: gpt-oss-20b, gpt-oss-120b): Llama's pre-norm block with biased q/k/v/o, a learned
softmax sink per query head (keel's `attention_sinks`), sliding-window and global layers alternating (`layer_types`,
by default the even layers slide), YaRN, and a mixture of experts in every layer whose router has a bias and
whose experts have biases and a clamped SwiGLU (keel's `expert_activation` swiglu_clamped).

Its checkpoints store experts stacked and transposed against keel's layout (`experts.gate_up_proj` [E, H, 2I] with
gate and up columns interleaved, `experts.down_proj` [E, I, H]), and OpenAI's release stores them in MXFP4
(`*_blocks` and `*_scales`): keel.weights.gpt_oss reads both as keel's [E, 2I, H] / [E, H, I], dequantized.
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError
from keel.families.windows import sliding_layer_types

FAMILY = "gpt_oss"
HF_ARCHITECTURE = "GptOssForCausalLM"
# transformers' GptOssConfig defaults.
DEFAULTS: dict[str, Any] = {
    "head_dim": 64,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 150000.0,
    "max_position_embeddings": 131072,
    "bos_token_id": None,
    "eos_token_id": [],
}
SLIDING_WINDOW = 128
GLOBAL_EVERY = 2  # the default layer_types: every second layer global


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    quant = hf.get("quantization_config")
    if quant and not (isinstance(quant, dict) and quant.get("quant_method") == "mxfp4"):
        method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else "unknown"
        raise ConfigError(f"{source}: GPT-OSS quantization {method!r} is not supported (mxfp4 or none)")
    layers = int(hf["num_hidden_layers"])
    window = hf.get("sliding_window", SLIDING_WINDOW)
    bias = bool(hf.get("attention_bias", True))
    width = int(hf.get("intermediate_size", 2880))
    return {
        "attention_sinks": True,
        "qkv_bias": bias,
        "o_bias": bias,
        "sliding_window": window,
        "layer_types": sliding_layer_types(hf, GLOBAL_EVERY) if window else ["full_attention"] * layers,
        "num_experts": int(hf.get("num_local_experts", hf.get("num_experts", 128))),
        "num_experts_per_tok": int(hf.get("num_experts_per_tok", hf.get("experts_per_token", 4))),
        "moe_intermediate_size": width,
        "intermediate_size": width,
        "router_scoring": "topk_softmax",
        "norm_topk_prob": True,
        "router_linear_bias": True,
        "expert_bias": True,
        "expert_activation": "swiglu_clamped",
        "swiglu_alpha": float(hf.get("swiglu_alpha", 1.702)),
        "swiglu_limit": float(hf.get("swiglu_limit", 7.0)),
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {
        "attention_bias": config.qkv_bias,
        "sliding_window": config.sliding_window,
        "layer_types": list(config.layer_types),
        "num_local_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "intermediate_size": config.moe_intermediate_size,
        "swiglu_alpha": config.swiglu_alpha,
        "swiglu_limit": config.swiglu_limit,
    }
