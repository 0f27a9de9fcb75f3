"""Mamba 2 (`Mamba2ForCausalLM`: mistralai/Mamba-Codestral-7B-v0.1, state-spaces/mamba2-*): every layer a Mamba 2
mixer (keel.model.mamba, as Granite 4.0-H's) after an RMS norm, with a residual and no feed-forward sublayer
(`mlp_layers` all False); no attention layer, so serving keeps a state per sequence and no KV cache
(keel.serve.hybrid). Its `layer_norm_epsilon` is every norm's, the gated one's too.

Checkpoint names: `backbone.embeddings`, `backbone.layers.N.norm` (keel's input_layernorm), `backbone.layers.N.mixer.*`
(keel's self_attn.*), `backbone.norm_f` (keel's norm). transformers keeps the residual stream in float32
(`residual_in_fp32`); keel keeps it in the model's dtype (the same numbers in float32).
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError
from keel.families.granitemoehybrid import float_json, mamba2_tensors, mamba_time_step_limit
from keel.families.layer_kinds import refuse_other_conv_activation
from keel.families.mamba import attention_free, backbone_layout

FAMILY = "mamba2"
HF_ARCHITECTURE = "Mamba2ForCausalLM"
# transformers' Mamba2Config defaults. It has no attention heads (keel's attention fields are placeholders) and no
# context limit: a state has no positions, so keel's default max_model_len is its own choice.
DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 1_048_576,
    "bos_token_id": 0,
    "eos_token_id": [2],
    "num_attention_heads": 1,
    "head_dim": 64,  # Mamba2Config's: its mixer heads' width (MAMBA2_DEFAULTS); keel's attention sizes are placeholders
}
MAMBA2_DEFAULTS = {"num_heads": 128, "head_dim": 64, "state_size": 128, "n_groups": 8, "conv_kernel": 4, "expand": 2}


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    refuse_other_conv_activation(hf, source)
    get = {key: int(hf.get(key) or default) for key, default in MAMBA2_DEFAULTS.items()}
    if get["num_heads"] * get["head_dim"] != get["expand"] * int(hf["hidden_size"]):
        raise ConfigError(f"{source}: num_heads x head_dim must be expand x hidden_size")
    return {
        **attention_free(hf),
        "layer_types": ["mamba"] * int(hf["num_hidden_layers"]),
        "mamba_n_heads": get["num_heads"],
        "mamba_d_head": get["head_dim"],
        "mamba_n_groups": get["n_groups"],
        "mamba_d_state": get["state_size"],
        "mamba_d_conv": get["conv_kernel"],
        "mamba_conv_bias": bool(hf.get("use_conv_bias", True)),
        "mamba_proj_bias": bool(hf.get("use_bias", False)),
        "mamba_out_bias": bool(hf.get("use_bias", False)),  # one key for both projections
        "mamba_dt_limit": mamba_time_step_limit(hf),
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {
        "num_heads": config.mamba_n_heads,
        "head_dim": config.mamba_d_head,
        "expand": config.mamba_n_heads * config.mamba_d_head // config.hidden_size,
        "n_groups": config.mamba_n_groups,
        "state_size": config.mamba_d_state,
        "conv_kernel": config.mamba_d_conv,
        "use_conv_bias": config.mamba_conv_bias,
        "use_bias": config.mamba_proj_bias,
        "time_step_limit": [float_json(x) for x in config.mamba_dt_limit],
        "layer_norm_epsilon": config.rms_norm_eps,
    }


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """Mamba 2's names under keel's (module doc): Granite 4.0-H's mixer tensors under `mixer.`."""
    return backbone_layout(config, {layer: mamba2_tensors(config) for layer in range(config.num_layers)})
