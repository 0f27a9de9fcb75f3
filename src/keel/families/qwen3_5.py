"""Qwen3.5 (`Qwen3_5ForCausalLM`, and the released `Qwen3_5ForConditionalGeneration` checkpoints on text): a hybrid
of Gated DeltaNet layers (`layer_types` "linear_attention": keel.model.linear_attention; by default three in every
four) and full-attention layers whose output is gated (`attention_output_gate`), with per-head q/k norms, rotary
over a quarter of each head (`partial_rotary_factor`), and (1 + weight) RMSNorms throughout (the Gated DeltaNet's
own output norm excepted).

Checkpoint names: a Gated DeltaNet layer's `linear_attn.*` are keel's `self_attn.*`; a full-attention layer's
`q_proj` holds each head's queries, then its output gate (keel's `self_attn.output_gate`), split at load and fused
again on export. The vision tower of the multimodal checkpoints is not read, nor its multi-token-prediction layer
(`mtp.*`); images are not supported. Positions are text's: the three rotary sections of its mRoPE see one position.
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError
from keel.families.layer_kinds import refuse_other_conv_activation
from keel.families.rope import partial_rotary_factor

FAMILY = "qwen3_5"
HF_ARCHITECTURE = "Qwen3_5ForCausalLM"
# transformers' Qwen3_5TextConfig defaults.
DEFAULTS: dict[str, Any] = {
    "head_dim": 256,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 32768,
    "bos_token_id": None,
    "eos_token_id": [],
}
FULL_ATTENTION_INTERVAL = 4
LINEAR_KEYS = {
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
}
# A Gated DeltaNet layer's tensors (transformers' names, under linear_attn.; keel's under self_attn.)
LINEAR_TENSORS = (
    "in_proj_qkv.weight",
    "in_proj_z.weight",
    "in_proj_b.weight",
    "in_proj_a.weight",
    "conv1d.weight",
    "dt_bias",
    "A_log",
    "norm.weight",
    "out_proj.weight",
)


def layer_types(hf: dict[str, Any], source: str) -> list[str]:
    """The file's layer kinds, else transformers' rule: every `full_attention_interval`-th layer full, the rest
    linear."""
    layers = int(hf["num_hidden_layers"])
    kinds = hf.get("layer_types")
    if kinds is None:
        interval = int(hf.get("full_attention_interval") or FULL_ATTENTION_INTERVAL)
        return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    if len(kinds) != layers or not set(kinds) <= {"linear_attention", "full_attention"}:
        raise ConfigError(f"{source}: layer_types must list linear_attention or full_attention for each of {layers}")
    return list(kinds)


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    refuse_other_conv_activation(hf, source)
    bias = bool(hf.get("attention_bias", False))
    return {
        "layer_types": layer_types(hf, source),
        **{key: int(hf.get(key) or default) for key, default in LINEAR_KEYS.items()},
        "attention_output_gate": True,
        "qk_norm": True,
        "norm_weight_offset": 1.0,
        "partial_rotary_factor": partial_rotary_factor(hf, 0.25),
        "qkv_bias": bias,
        "o_bias": bias,
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {
        "model_type": "qwen3_5_text",
        "layer_types": list(config.layer_types),
        **{key: getattr(config, key) for key in LINEAR_KEYS},
        "attention_bias": config.qkv_bias,
        "rope_parameters": {**hf["rope_parameters"], "partial_rotary_factor": config.partial_rotary_factor},
    }


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """Gated DeltaNet tensors under keel's self_attn., each full-attention q_proj split into queries and gate."""
    d, heads = config.head_dim, config.num_heads
    queries = [(2 * h * d, (2 * h + 1) * d) for h in range(heads)]
    gates = [((2 * h + 1) * d, (2 * h + 2) * d) for h in range(heads)]
    kinds = ("weight", "bias") if config.qkv_bias else ("weight",)
    layout: dict[str, dict[str, list[tuple[int, int]] | None]] = {}
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}"
        if config.layer_types[layer] == "linear_attention":
            for name in LINEAR_TENSORS:
                layout[f"{p}.linear_attn.{name}"] = {f"{p}.self_attn.{name}": None}
            continue
        for kind in kinds:
            layout[f"{p}.self_attn.q_proj.{kind}"] = {
                f"{p}.self_attn.q_proj.{kind}": queries,
                f"{p}.self_attn.output_gate.{kind}": gates,
            }
    return layout
