"""Bamba (`BambaForCausalLM`: ibm-ai-platform/Bamba-9B): Mamba 2 mixers (keel.model.mamba, as Granite 4.0-H's:
keel.families.granitemoehybrid reads their keys) with attention in the layers `attn_layer_indices` lists (rotary
over half of each head: transformers fixes `partial_rotary_factor` at 0.5), Llama's MLP (`feed_forward.*`) and
norms (`input_layernorm`, `pre_ff_layernorm`: keel's norm before the MLP; `final_layernorm`: keel's `norm`).
"""

from __future__ import annotations

from typing import Any

from keel.families import granitemoehybrid
from keel.families.layer_kinds import refuse_other_conv_activation

FAMILY = "bamba"
HF_ARCHITECTURE = "BambaForCausalLM"
# transformers' BambaConfig defaults.
DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 262144,
    "bos_token_id": 1,
    "eos_token_id": [2],
    "num_key_value_heads": 8,
}


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    refuse_other_conv_activation(hf, source)
    attention = set(hf.get("attn_layer_indices") or [])
    layers = int(hf["num_hidden_layers"])
    return {
        **granitemoehybrid.mamba_fields(hf, source),
        "layer_types": ["full_attention" if i in attention else "mamba" for i in range(layers)],
        "partial_rotary_factor": 0.5,
        "qkv_bias": bool(hf.get("attention_bias", False)),
        "o_bias": bool(hf.get("attention_bias", False)),
        "mlp_bias": bool(hf.get("mlp_bias", False)),
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {
        **granitemoehybrid.mamba_hf_fields(config),
        "attn_layer_indices": [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"],
        "attention_bias": config.qkv_bias,
        "mlp_bias": config.mlp_bias,
    }


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """The mamba mixers under keel's self_attn., the MLP and its norm under keel's names."""
    layout: dict[str, dict[str, list[tuple[int, int]] | None]] = {
        "model.final_layernorm.weight": {"model.norm.weight": None}
    }
    kinds = ("weight", "bias") if config.mlp_bias else ("weight",)
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}"
        layout[f"{p}.pre_ff_layernorm.weight"] = {f"{p}.post_attention_layernorm.weight": None}
        for proj in ("gate_proj", "up_proj", "down_proj"):
            for kind in kinds:
                layout[f"{p}.feed_forward.{proj}.{kind}"] = {f"{p}.mlp.{proj}.{kind}": None}
        if config.layer_types[layer] == "mamba":
            layout.update(granitemoehybrid.mamba_layout(config, layer))
    return layout
