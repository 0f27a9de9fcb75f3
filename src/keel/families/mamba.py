"""Mamba (`MambaForCausalLM`: state-spaces/mamba-130m-hf … 2.8b-hf): every layer a Mamba 1 mixer (`layer_types`
"mamba1": keel.model.mamba1) after an RMS norm, with a residual and no feed-forward sublayer (`mlp_layers`
all False), a tied head by default; no attention layer, so serving keeps a state per sequence and no KV cache
(keel.serve.hybrid). Its `layer_norm_epsilon` is every norm's.

Checkpoint names (Mamba 2's too, keel.families.mamba2): `backbone.embeddings`, `backbone.layers.N.norm` (keel's
input_layernorm), `backbone.layers.N.mixer.*` (keel's self_attn.*), `backbone.norm_f` (keel's norm). transformers keeps
the residual stream in float32 (`residual_in_fp32`); keel keeps it in the model's dtype (the same numbers in float32).
"""

from __future__ import annotations

import math
from typing import Any

from keel.families.layer_kinds import refuse_other_conv_activation

FAMILY = "mamba"
HF_ARCHITECTURE = "MambaForCausalLM"
# transformers' MambaConfig defaults. It has no attention heads (keel's attention fields are placeholders) and no
# context limit: a state has no positions, so keel's default max_model_len is its own choice.
DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 1_048_576,
    "bos_token_id": 0,
    "eos_token_id": [0],
    "num_attention_heads": 1,
}
MIXER_TENSORS = ("in_proj", "conv1d", "x_proj", "dt_proj", "out_proj")


def attention_free(hf: dict[str, Any]) -> dict[str, Any]:
    """The fields of a model whose every layer is its mixer alone: the norms' eps and placeholder attention sizes."""
    layers = int(hf["num_hidden_layers"])
    eps = hf.get("layer_norm_epsilon")
    return {
        "mlp_layers": [False] * layers,
        "rms_norm_eps": float(DEFAULTS["rms_norm_eps"] if eps is None else eps),
        "num_heads": 1,
        "num_kv_heads": 1,
        "head_dim": 2,
        "intermediate_size": 0,
    }


def mamba1_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """A Mamba 1 mixer's fields from Mamba's and Falcon Mamba's keys."""
    refuse_other_conv_activation(hf, source)
    hidden = int(hf["hidden_size"])
    rank = hf.get("time_step_rank", "auto")
    return {
        "mamba_d_inner": int(hf.get("expand", 2) * hidden),
        "mamba_dt_rank": math.ceil(hidden / 16) if rank in (None, "auto") else int(rank),
        "mamba_d_state": int(hf.get("state_size") or 16),
        "mamba_d_conv": int(hf.get("conv_kernel") or 4),
        "mamba_conv_bias": bool(hf.get("use_conv_bias", True)),
        "mamba_proj_bias": bool(hf.get("use_bias", False)),
        "mamba_out_bias": bool(hf.get("use_bias", False)),  # one key for both projections
    }


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    return {
        **attention_free(hf),
        **mamba1_fields(hf, source),
        "layer_types": ["mamba1"] * int(hf["num_hidden_layers"]),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {
        "expand": config.mamba_d_inner // config.hidden_size,
        "intermediate_size": config.mamba_d_inner,
        "time_step_rank": config.mamba_dt_rank,
        "state_size": config.mamba_d_state,
        "conv_kernel": config.mamba_d_conv,
        "use_conv_bias": config.mamba_conv_bias,
        "use_bias": config.mamba_proj_bias,
        "layer_norm_epsilon": config.rms_norm_eps,
    }


def backbone_layout(config: Any, mixer: dict[int, list[str]]) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """`backbone.*` under keel's names, each layer's `mixer.<name>` for the names `mixer` lists under it."""
    layout: dict[str, dict[str, list[tuple[int, int]] | None]] = {
        "backbone.embeddings.weight": {"model.embed_tokens.weight": None},
        "backbone.norm_f.weight": {"model.norm.weight": None},
    }
    for layer in range(config.num_layers):
        p, ours = f"backbone.layers.{layer}", f"model.layers.{layer}"
        layout[f"{p}.norm.weight"] = {f"{ours}.input_layernorm.weight": None}
        for name in mixer[layer]:
            layout[f"{p}.mixer.{name}"] = {f"{ours}.self_attn.{name}": None}
    return layout


def mamba1_tensors(config: Any) -> list[str]:
    """A Mamba 1 mixer's tensor names (the step/B/C norms' weights where they have them)."""
    names = ["A_log", "D", "dt_proj.bias", *(f"{m}.weight" for m in MIXER_TENSORS)]
    if config.mamba_conv_bias:
        names.append("conv1d.bias")
    if config.mamba_proj_bias:
        names.append("in_proj.bias")
    if config.mamba_out_bias:
        names.append("out_proj.bias")
    if config.mamba_dt_bc_norm == "rms":
        names += [f"{n}_layernorm.weight" for n in ("dt", "b", "c")]
    return names


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """Mamba's names under keel's (module doc)."""
    return backbone_layout(config, {layer: mamba1_tensors(config) for layer in range(config.num_layers)})
