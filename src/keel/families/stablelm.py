"""StableLM 2 (`StableLmForCausalLM`): LayerNorm with a bias for every norm, rotary over the first quarter
of each head (`partial_rotary_factor`), optional q/k/v bias and, as an option, the parallel residual
(x + attn(ln(x)) + mlp(ln(x)): one norm for both sublayers). Llama's tensor names.

StableLM 2 12B (`qk_layernorm`): q and k each through a LayerNorm without a bias per head (StableLmLayerNormPerHead,
`q_layernorm.norms.{i}.weight`), keel's `qk_norm_scope` each_head with `qk_norm_type` layer: the heads' weights
stacked into one [heads, head_dim] weight at load (keel.families.parts.Stacked) and split again on export.
"""

from __future__ import annotations

from typing import Any

from keel.families.parts import Stacked
from keel.families.rope import partial_rotary_factor

FAMILY = "stablelm"
HF_ARCHITECTURE = "StableLmForCausalLM"
# transformers' StableLmConfig defaults (its layer_norm_eps is keel's rms_norm_eps: the norms' eps).
DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": 32,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "bos_token_id": 0,
    "eos_token_id": [0],
}
DEFAULT_PARTIAL_ROTARY = 0.25


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    parallel = bool(hf.get("use_parallel_residual", False))
    eps = hf.get("layer_norm_eps")
    return {
        "norm_type": "layer",
        "norm_bias": True,
        "rms_norm_eps": float(DEFAULTS["rms_norm_eps"] if eps is None else eps),
        "partial_rotary_factor": partial_rotary_factor(hf, DEFAULT_PARTIAL_ROTARY),
        "qkv_bias": bool(hf.get("use_qkv_bias", False)),
        "o_bias": False,
        "mlp_bias": False,
        "parallel_residual": parallel,
        "post_attention_norm": not parallel,
        "qk_norm": bool(hf.get("qk_layernorm", False)),
        "qk_norm_scope": "each_head",
        "qk_norm_type": "layer",
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {
        "layer_norm_eps": config.rms_norm_eps,
        "use_qkv_bias": config.qkv_bias,
        "qk_layernorm": config.qk_norm,
        "use_parallel_residual": config.parallel_residual,
        "partial_rotary_factor": config.partial_rotary_factor,
        "rope_parameters": {**hf["rope_parameters"], "partial_rotary_factor": config.partial_rotary_factor},
    }


def checkpoint_layout(config: Any) -> dict[str, Any]:
    """With `qk_layernorm`: each head's q/k LayerNorm weight, a row of keel's [heads, head_dim] q/k norm weight."""
    if not config.qk_norm:
        return {}
    layout: dict[str, Any] = {}
    for layer in range(config.num_layers):
        attn = f"model.layers.{layer}.self_attn"
        for hf_norm, norm, heads in (
            ("q_layernorm", "q_norm", config.num_heads),
            ("k_layernorm", "k_norm", config.num_kv_heads),
        ):
            for head in range(heads):
                layout[f"{attn}.{hf_norm}.norms.{head}.weight"] = {f"{attn}.{norm}.weight": Stacked(head)}
    return layout
