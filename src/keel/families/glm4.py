"""GLM-4 (`Glm4ForCausalLM`: GLM-4-0414, GLM-Z1): a norm before and after each sublayer ("sandwich", plain
RMSNorms: its `post_self_attn_layernorm` and `post_mlp_layernorm` are keel's `attn_output_norm` and
`mlp_output_norm`; its `post_attention_layernorm` is the norm before the MLP, as keel's), biased q/k/v, gate and
up stored fused in `mlp.gate_up_proj` (gate rows first), and rotary over the first half of each head
(`partial_rotary_factor`) on interleaved pairs: channels (2i, 2i + 1) rotate together at frequency i. keel's
rotary pairs channel i with i + rotary / 2, so q's and k's rotary rows (and biases) are read with each head's
even rotary channels first, then its odd ones, and written back interleaved on export: the same permutation of
q and k leaves every score as it was.
"""

from __future__ import annotations

from typing import Any

from keel.families.rope import interleaved_qk_layout, partial_rotary_factor

FAMILY = "glm4"
HF_ARCHITECTURE = "Glm4ForCausalLM"
# transformers' Glm4Config defaults.
DEFAULTS: dict[str, Any] = {
    "head_dim": 128,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1.5625e-07,
    "rope_theta": 10000.0,
    "max_position_embeddings": 131072,
    "bos_token_id": None,
    "eos_token_id": [151329, 151336, 151338],
}


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    bias = bool(hf.get("attention_bias", True))
    return {
        "norm_placement": "sandwich",
        "partial_rotary_factor": partial_rotary_factor(hf, 0.5),
        "qkv_bias": bias,
        "o_bias": False,
        "mlp_bias": False,
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {
        "attention_bias": config.qkv_bias,
        "rope_parameters": {**hf["rope_parameters"], "partial_rotary_factor": config.partial_rotary_factor},
    }


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """GLM-4's norms under keel's names, gate/up split by rows, q/k's rotary channels regrouped (module doc)."""
    inter = config.intermediate_size
    layout = interleaved_qk_layout(config)
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}"
        mlp = f"{prefix}.mlp"
        layout[f"{prefix}.post_self_attn_layernorm.weight"] = {f"{prefix}.attn_output_norm.weight": None}
        layout[f"{prefix}.post_mlp_layernorm.weight"] = {f"{prefix}.mlp_output_norm.weight": None}
        layout[f"{mlp}.gate_up_proj.weight"] = {
            f"{mlp}.gate_proj.weight": [(0, inter)],
            f"{mlp}.up_proj.weight": [(inter, 2 * inter)],
        }
    return layout
