"""Falcon-H1 (`FalconH1ForCausalLM`: tiiuae/Falcon-H1-0.5B ... 34B, Falcon-H1R, Falcon-H1-Tiny): every layer is
"hybrid", attention and a Mamba 2 mixer (keel.model.mamba, `mamba.*` as transformers names it) side by side on the
same normed input, their outputs summed, then Llama's MLP under Bamba's names (keel.families.bamba's layout). Its muP
multipliers are keel config scalars, not folded into the weights (an export writes the checkpoint's tensors back bit
for bit): the embedding's (`embedding_multiplier`), the LM head's (1 / `logits_scaling`), the key's (a softmax scale
of key_multiplier / sqrt(head_dim): k's only use is its dot product with q), each branch's input and output
(attention_in/out, ssm_in/out), the mixer's in-projection by segment (ssm_multipliers: z, x, B, C, the steps) and the
MLP's gate and output (mlp_multipliers). The mixer's output meets its gate with a grouped RMS norm before or after
the gate (mamba_rms_norm, mamba_norm_before_gate) or with none; its in_proj's bias is mamba_proj_bias, its out_proj's
projectors_bias. `mamba_chunk_size` only tiles transformers' scan: keel's chunked scan computes the same recurrence.
"""

from __future__ import annotations

import math
from typing import Any

from keel.errors import ConfigError
from keel.families import bamba, granitemoehybrid
from keel.families.layer_kinds import refuse_other_conv_activation

FAMILY = "falcon_h1"
HF_ARCHITECTURE = "FalconH1ForCausalLM"
# transformers' FalconH1Config defaults.
DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 8192,
    "bos_token_id": 1,
    "eos_token_id": [2],
    "pad_token_id": 0,
    "num_key_value_heads": 8,
}
SEGMENTS = 5  # ssm_multipliers: z, x, B, C, the steps


def _multiplier(hf: dict[str, Any], key: str) -> float:
    value = hf.get(key)
    return 1.0 if value is None else float(value)


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    refuse_other_conv_activation(hf, source)
    if hf.get("mamba_use_mlp") is False:  # transformers' FalconH1 always runs the MLP
        raise ConfigError(f"{source}: mamba_use_mlp false (layers without their MLP) is not supported")
    hidden, layers = int(hf["hidden_size"]), int(hf["num_hidden_layers"])
    d_ssm = hf.get("mamba_d_ssm", 1024)  # absent: the config class's 1024; null: mamba_expand x hidden_size
    mlp = hf.get("mlp_multipliers") or [1.0, 1.0]
    ssm = [float(m) for m in hf.get("ssm_multipliers") or [1.0] * SEGMENTS]
    if len(mlp) != 2 or len(ssm) != SEGMENTS:
        raise ConfigError(f"{source}: mlp_multipliers needs 2 values and ssm_multipliers {SEGMENTS}")
    head_dim = int(hf.get("head_dim") or hidden // int(hf["num_attention_heads"]))
    key = _multiplier(hf, "key_multiplier")
    if hf.get("mamba_rms_norm", False):
        norm = "norm_gate" if hf.get("mamba_norm_before_gate", True) else "gate_norm"
    else:
        norm = "gate"
    attention_bias = bool(hf.get("attention_bias", False))
    return {
        **granitemoehybrid.mamba_fields(hf, source, None if d_ssm is None else int(d_ssm)),
        "mamba_out_bias": bool(hf.get("projectors_bias", False)),
        "mamba_norm": norm,
        "mamba_norm_float32": True,
        "mamba_proj_multipliers": () if all(m == 1.0 for m in ssm) else tuple(ssm),
        "layer_types": ["hybrid"] * layers,
        "qkv_bias": attention_bias,
        "o_bias": attention_bias,
        "mlp_bias": bool(hf.get("mlp_bias", False)),
        "embedding_multiplier": _multiplier(hf, "embedding_multiplier"),
        "logits_scaling": 1.0 / _multiplier(hf, "lm_head_multiplier"),
        "attention_scale": None if key == 1.0 else key / math.sqrt(head_dim),
        "attention_in_multiplier": _multiplier(hf, "attention_in_multiplier"),
        "attention_out_multiplier": _multiplier(hf, "attention_out_multiplier"),
        "mamba_in_multiplier": _multiplier(hf, "ssm_in_multiplier"),
        "mamba_out_multiplier": _multiplier(hf, "ssm_out_multiplier"),
        "mlp_gate_multiplier": float(mlp[0]),
        "mlp_down_multiplier": float(mlp[1]),
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    scale = config.attention_scale
    return {
        **granitemoehybrid.mamba_hf_fields(config),
        "mamba_d_ssm": config.mamba_n_heads * config.mamba_d_head,
        "mamba_rms_norm": config.mamba_norm != "gate",
        "mamba_norm_before_gate": config.mamba_norm == "norm_gate",
        "projectors_bias": config.mamba_out_bias,
        "attention_bias": config.qkv_bias,
        "mlp_bias": config.mlp_bias,
        "embedding_multiplier": config.embedding_multiplier,
        "lm_head_multiplier": 1.0 / config.logits_scaling,
        "key_multiplier": 1.0 if scale is None else scale * math.sqrt(config.head_dim),
        "attention_in_multiplier": config.attention_in_multiplier,
        "attention_out_multiplier": config.attention_out_multiplier,
        "ssm_in_multiplier": config.mamba_in_multiplier,
        "ssm_out_multiplier": config.mamba_out_multiplier,
        "ssm_multipliers": list(config.mamba_proj_multipliers or [1.0] * SEGMENTS),
        "mlp_multipliers": [config.mlp_gate_multiplier, config.mlp_down_multiplier],
    }


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """Bamba's names: the MLP (`feed_forward`), its norm (`pre_ff_layernorm`) and `final_layernorm`; the mixers'
    `mamba.*` are keel's own names."""
    return bamba.checkpoint_layout(config)
