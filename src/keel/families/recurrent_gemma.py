"""RecurrentGemma (`RecurrentGemmaForCausalLM`, model_type recurrent_gemma: Griffin, recurrentgemma-2b/9b): layers
cycling through `block_types`, "recurrent" (keel's "rglru" layers: Griffin's recurrent block with its Real-Gated
Linear Recurrent Unit, keel.model.rglru) and "attention" (keel's "sliding_attention": local multi-query attention
over the last `attention_window_size` positions, rotary over the first `partial_rotary_factor` of each head, biased
o_proj, q/k/v biased where `attention_bias`), each followed by a GELU-gated MLP with biases of
`intermediate_size` / 2 (transformers halves it). Gemma's conventions: RMSNorms scale by (1 + weight) in float32, the
head is tied, the logits soft-capped at `logits_soft_cap`. The embedding is scaled by sqrt(hidden_size) rounded to
bfloat16, as transformers' `normalizer` buffer holds it (50.5 for 2560, not 50.596) whatever the model's dtype.

Checkpoint names: `temporal_pre_norm` / `channel_pre_norm` (keel's input_layernorm / post_attention_layernorm),
`temporal_block.*` (keel's self_attn.*, the recurrent block's tensors as transformers names them), `mlp_block.*`
(keel's mlp.*), `model.final_norm` (keel's model.norm). The layers' state (the convolution's last inputs and the LRU's
[lru_width] float32 state) is served as the other recurrent kinds' (keel.serve.hybrid: no tensor or pipeline
parallelism, compiled decode, prefix caching, speculative decoding or int8 KV cache).

transformers' config class has no context length (local attention and a recurrence): keel takes 8192, the releases'
training length, as its default `max_position_embeddings`. Unread: the init variances (w_init_variance_scale,
final_w_init_variance_scale: training initialisation only). Refused by name: `embeddings_scale_by_sqrt_dim` false
(transformers scales the embedding regardless), a rope type other than "default" (transformers refuses it too),
block types other than "recurrent" and "attention", a null `logits_soft_cap`.
"""

from __future__ import annotations

import struct
from typing import Any

from keel.errors import ConfigError
from keel.families.gemma import gemma2_activation, gemma2_activation_to_hf
from keel.families.rope import partial_rotary_factor, rope_settings

FAMILY = "recurrent_gemma"
HF_ARCHITECTURE = "RecurrentGemmaForCausalLM"
# transformers' RecurrentGemmaConfig defaults (max_position_embeddings: keel's, module doc).
DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-6,
    "rope_theta": 10_000.0,
    "max_position_embeddings": 8192,
    "bos_token_id": 2,
    "eos_token_id": [1],
}
# transformers' RecurrentGemmaConfig.attribute_map: the aliases a file may use.
ATTRIBUTE_MAP = {"sliding_window": "attention_window_size"}
KINDS = {"recurrent": "rglru", "attention": "sliding_attention"}


def _bfloat16(value: float) -> float:
    """`value` rounded to bfloat16 (to nearest, ties to even) without torch: keel.families stays torch-free, so that
    `keel train --nproc N` validates a run before its ranks import torch."""
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    if hf.get("embeddings_scale_by_sqrt_dim") is False:
        raise ConfigError(f"{source}: embeddings_scale_by_sqrt_dim false is not supported (transformers scales)")
    rope_type = rope_settings(hf).get("rope_type", rope_settings(hf).get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"{source}: RecurrentGemma rope_type {rope_type!r} is not supported (default)")
    if "logits_soft_cap" in hf and hf["logits_soft_cap"] is None:
        raise ConfigError(f"{source}: logits_soft_cap null is not supported (transformers divides by it)")
    blocks = list(hf.get("block_types") or ("recurrent", "recurrent", "attention"))
    unknown = set(blocks) - set(KINDS)
    if unknown:
        raise ConfigError(
            f"{source}: RecurrentGemma block_types {sorted(unknown)} are not supported (recurrent, attention)"
        )
    layers, hidden, heads = int(hf["num_hidden_layers"]), int(hf["hidden_size"]), int(hf["num_attention_heads"])
    kinds = [KINDS[blocks[i % len(blocks)]] for i in range(layers)]  # transformers' cycle of block_types
    return {
        "layer_types": kinds,
        "sliding_window": int(hf.get("attention_window_size", 2048)),
        "head_dim": hidden // heads,  # transformers computes it whatever the file says
        "partial_rotary_factor": partial_rotary_factor(hf, 0.5),
        "intermediate_size": int(hf.get("intermediate_size", 3 * 2560)) // 2,
        "hidden_act": gemma2_activation(hf, source),
        "mlp_bias": True,
        "qkv_bias": bool(hf.get("attention_bias", False)),
        "o_bias": True,
        "norm_weight_offset": 1.0,
        "embedding_multiplier": _bfloat16(hidden**0.5),
        "final_logit_softcapping": float(hf.get("logits_soft_cap", 30.0)),
        "lru_width": int(hf.get("lru_width") or hidden),
        "lru_conv_kernel": int(hf.get("conv1d_width", 4)),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    rope = dict(hf["rope_parameters"])
    rope["partial_rotary_factor"] = config.partial_rotary_factor
    return {
        # the whole list: transformers cycles it over the layers, so every layer keeps its kind
        "block_types": ["recurrent" if kind == "rglru" else "attention" for kind in config.layer_types],
        "attention_window_size": config.sliding_window,
        "intermediate_size": 2 * config.intermediate_size,
        "hidden_activation": gemma2_activation_to_hf(config),
        "attention_bias": config.qkv_bias,
        "logits_soft_cap": config.final_logit_softcapping,
        "lru_width": config.lru_width,
        "conv1d_width": config.lru_conv_kernel,
        "rope_parameters": rope,
    }


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """RecurrentGemma's names under keel's (module doc)."""
    layout: dict[str, dict[str, list[tuple[int, int]] | None]] = {
        "model.final_norm.weight": {"model.norm.weight": None}
    }
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}"
        renames = {
            "temporal_pre_norm.weight": "input_layernorm.weight",
            "channel_pre_norm.weight": "post_attention_layernorm.weight",
        }
        for proj in ("gate_proj", "up_proj", "down_proj"):
            for kind in ("weight", "bias"):
                renames[f"mlp_block.{proj}.{kind}"] = f"mlp.{proj}.{kind}"
        if config.layer_types[layer] == "rglru":
            mixer = [f"{m}.{k}" for m in ("linear_x", "linear_y", "linear_out", "conv_1d") for k in ("weight", "bias")]
            mixer += [f"rg_lru.{n}" for n in ("recurrent_param", "input_gate_weight", "input_gate_bias")]
            mixer += ["rg_lru.recurrent_gate_weight", "rg_lru.recurrent_gate_bias"]
        else:
            mixer = [f"{m}.weight" for m in ("q_proj", "k_proj", "v_proj", "o_proj")] + ["o_proj.bias"]
            if config.qkv_bias:
                mixer += [f"{m}.bias" for m in ("q_proj", "k_proj", "v_proj")]
        renames.update({f"temporal_block.{name}": f"self_attn.{name}" for name in mixer})
        for stored, ours in renames.items():
            layout[f"{p}.{stored}"] = {f"{p}.{ours}": None}
    return layout
