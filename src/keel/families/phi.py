"""Phi (`PhiForCausalLM`: phi-1, phi-1.5, phi-2): one LayerNorm with a bias feeding a parallel residual
(x + attn(norm(x)) + mlp(norm(x))), rotary over the first `partial_rotary_factor` of each head (0.5 by default;
phi-2: 0.4), biased q/k/v and output projections, an ungated GELU MLP (tanh approximation, `gelu_new`) with biases,
and an LM head with a bias (keel's `lm_head_bias`). Its own tensor names: `self_attn.dense` (keel's `o_proj`),
`mlp.fc1` / `mlp.fc2` (`up_proj` / `down_proj`) and `model.final_layernorm` (`norm`), read under keel's names and
written back under Phi's on export. With `qk_layernorm`: q and k each through a LayerNorm with a bias over each
head, one weight for all heads (keel's `qk_norm_type` layer, `qk_norm_bias`), before the rotary embedding; stored as
`self_attn.q_layernorm` / `k_layernorm`, read as keel's `q_norm` / `k_norm`.
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError
from keel.families.rope import partial_rotary_factor

FAMILY = "phi"
HF_ARCHITECTURE = "PhiForCausalLM"
# transformers' PhiConfig defaults (its layer_norm_eps is keel's rms_norm_eps: the norms' eps).
DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "bos_token_id": 1,
    "eos_token_id": [2],
}
_TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    activation = hf.get("hidden_act", "gelu_new")
    if activation not in _TANH_GELU:
        raise ConfigError(f"{source}: hidden_act {activation!r} is not supported (gelu_new)")
    eps = hf.get("layer_norm_eps")
    return {
        "norm_type": "layer",
        "norm_bias": True,
        "rms_norm_eps": float(DEFAULTS["rms_norm_eps"] if eps is None else eps),
        "partial_rotary_factor": partial_rotary_factor(hf, 0.5),
        "hidden_act": "gelu_tanh",
        "mlp_gated": False,
        "qkv_bias": True,
        "o_bias": True,
        "mlp_bias": True,
        "lm_head_bias": True,
        "parallel_residual": True,
        "post_attention_norm": False,
        "qk_norm": bool(hf.get("qk_layernorm", False)),
        "qk_norm_type": "layer",
        "qk_norm_bias": True,
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {
        "layer_norm_eps": config.rms_norm_eps,
        "hidden_act": "gelu_new",
        "qk_layernorm": config.qk_norm,
        "partial_rotary_factor": config.partial_rotary_factor,
        "rope_parameters": {**hf["rope_parameters"], "partial_rotary_factor": config.partial_rotary_factor},
    }


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """Phi's own names -> keel's (the output projection, the MLP, the final norm and the q/k norms)."""
    layout: dict[str, dict[str, list[tuple[int, int]] | None]] = {}
    for kind in ("weight", "bias"):
        layout[f"model.final_layernorm.{kind}"] = {f"model.norm.{kind}": None}
        for layer in range(config.num_layers):
            prefix = f"model.layers.{layer}"
            layout[f"{prefix}.self_attn.dense.{kind}"] = {f"{prefix}.self_attn.o_proj.{kind}": None}
            layout[f"{prefix}.mlp.fc1.{kind}"] = {f"{prefix}.mlp.up_proj.{kind}": None}
            layout[f"{prefix}.mlp.fc2.{kind}"] = {f"{prefix}.mlp.down_proj.{kind}": None}
            if config.qk_norm:
                for norm in ("q", "k"):
                    layout[f"{prefix}.self_attn.{norm}_layernorm.{kind}"] = {
                        f"{prefix}.self_attn.{norm}_norm.{kind}": None
                    }
    return layout
