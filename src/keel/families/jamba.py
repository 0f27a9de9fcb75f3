"""Jamba (`JambaForCausalLM`: ai21labs/Jamba-v0.1, AI21-Jamba-*-1.5/1.6/1.7): attention in every
`attn_layer_period`-th layer from `attn_layer_offset` (no position encoding: `rope_layers` all False), Mamba 1 mixers
elsewhere (`layer_types` "mamba1": keel.model.mamba1) with RMS norms of their step, B and C (`mamba_dt_bc_norm`
"rms": `dt_layernorm`, `b_layernorm`, `c_layernorm`, eps `rms_norm_eps`), and after every mixer a feed-forward
sublayer: experts in every `expert_layer_period`-th layer from `expert_layer_offset` (the softmax's top k, not
renormalised; as wide as the dense MLP, `intermediate_size`), Llama's MLP in the others.

Checkpoint names: a mamba layer's `mamba.*` is keel's `self_attn.*`; `feed_forward.*` keel's `mlp.*` (each expert's
gate/up/down, `feed_forward.router` keel's router); `pre_ff_layernorm` the norm before it; `final_layernorm` keel's
`norm`.
"""

from __future__ import annotations

import math
from typing import Any

from keel.errors import ConfigError
from keel.families.layer_kinds import refuse_other_conv_activation
from keel.families.mamba import mamba1_tensors

FAMILY = "jamba"
HF_ARCHITECTURE = "JambaForCausalLM"
# transformers' JambaConfig defaults.
DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 262144,
    "bos_token_id": 1,
    "eos_token_id": [2],
    "num_key_value_heads": 8,
}


def _every(hf: dict[str, Any], name: str, period: int, offset: int, source: str) -> list[bool]:
    """Whether each layer is one of every `<name>_layer_period`-th from `<name>_layer_offset`."""
    period, offset = int(hf.get(f"{name}_layer_period", period)), int(hf.get(f"{name}_layer_offset", offset))
    if not 0 <= offset < period:
        raise ConfigError(f"{source}: {name}_layer_offset {offset} must be in [0, {name}_layer_period {period})")
    return [i % period == offset for i in range(int(hf["num_hidden_layers"]))]


def _period(flags: list[bool]) -> tuple[int, int]:
    """(period, offset) that give these per-layer flags, for export."""
    n = len(flags)
    for period in range(1, n + 2):
        for offset in range(period):
            if [i % period == offset for i in range(n)] == flags:
                return period, offset
    raise ConfigError(f"layers {[i for i, f in enumerate(flags) if f]} are not every k-th from an offset")


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    refuse_other_conv_activation(hf, source)  # the mixers' convolution runs hidden_act too
    attention = _every(hf, "attn", 8, 4, source)
    experts = int(hf.get("num_experts", 16) or 1)
    moe = _every(hf, "expert", 2, 1, source) if experts > 1 else [False] * len(attention)
    hidden, width = int(hf["hidden_size"]), int(hf.get("intermediate_size", 14336))
    rank = hf.get("mamba_dt_rank", "auto")
    eps = float(hf.get("rms_norm_eps") or DEFAULTS["rms_norm_eps"])
    return {
        "layer_types": ["full_attention" if a else "mamba1" for a in attention],
        "rope_layers": [False] * len(attention),
        "num_experts": experts if any(moe) else 0,
        "num_experts_per_tok": int(hf.get("num_experts_per_tok", 2)) if any(moe) else 0,
        "moe_intermediate_size": width if any(moe) else 0,
        "mlp_only_layers": [i for i, m in enumerate(moe) if not m],
        "norm_topk_prob": False,
        "intermediate_size": width,
        "mamba_d_inner": int(hf.get("mamba_expand", 2)) * hidden,
        "mamba_dt_rank": math.ceil(hidden / 16) if rank in (None, "auto") else int(rank),
        "mamba_d_state": int(hf.get("mamba_d_state", 16)),
        "mamba_d_conv": int(hf.get("mamba_d_conv", 4)),
        "mamba_conv_bias": bool(hf.get("mamba_conv_bias", True)),
        "mamba_proj_bias": bool(hf.get("mamba_proj_bias", False)),
        "mamba_out_bias": bool(hf.get("mamba_proj_bias", False)),  # one key for both projections
        "mamba_dt_bc_norm": "rms",
        "mamba_dt_bc_norm_eps": eps,
        "qkv_bias": False,
        "o_bias": False,
        "mlp_bias": False,
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    attn_period, attn_offset = _period([kind != "mamba1" for kind in config.layer_types])
    moe = [config.is_moe_layer(i) for i in range(config.num_layers)]
    expert_period, expert_offset = _period(moe) if any(moe) else (2, 1)
    return {
        "attn_layer_period": attn_period,
        "attn_layer_offset": attn_offset,
        "expert_layer_period": expert_period,
        "expert_layer_offset": expert_offset,
        "num_experts": config.num_experts if any(moe) else 1,
        "num_experts_per_tok": config.num_experts_per_tok if any(moe) else 2,
        "mamba_expand": config.mamba_d_inner // config.hidden_size,
        "mamba_dt_rank": config.mamba_dt_rank,
        "mamba_d_state": config.mamba_d_state,
        "mamba_d_conv": config.mamba_d_conv,
        "mamba_conv_bias": config.mamba_conv_bias,
        "mamba_proj_bias": config.mamba_proj_bias,
    }


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """Jamba's names under keel's (module doc)."""
    layout: dict[str, dict[str, list[tuple[int, int]] | None]] = {
        "model.final_layernorm.weight": {"model.norm.weight": None}
    }
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}"
        renames = {"pre_ff_layernorm.weight": "post_attention_layernorm.weight"}
        mlp = ("gate_proj", "up_proj", "down_proj")
        if config.is_moe_layer(layer):  # each expert's, and the router, under the HF-style names keel reads
            experts = [f"experts.{e}.{m}.weight" for e in range(config.num_experts) for m in mlp]
            renames |= {f"feed_forward.{name}": f"mlp.{name}" for name in experts}
            renames["feed_forward.router.weight"] = "mlp.gate.weight"
        else:
            renames |= {f"feed_forward.{m}.weight": f"mlp.{m}.weight" for m in mlp}
        if config.layer_types[layer] == "mamba1":
            renames |= {f"mamba.{name}": f"self_attn.{name}" for name in mamba1_tensors(config)}
        for stored, ours in renames.items():
            layout[f"{p}.{stored}"] = {f"{p}.{ours}": None}
    return layout
