"""GLM-4 (`GlmForCausalLM`: THUDM/glm-4-9b, glm-4-9b-chat): Llama's pre-norm block with biased q/k/v (`attention_bias`,
never on o_proj), gate and up stored fused in `mlp.gate_up_proj` (gate rows first), and rotary over the first half
of each head (`partial_rotary_factor`, 0.5 by default) on interleaved pairs: channels (2i, 2i + 1) rotate together at
frequency i. keel's rotary pairs channel i with i + rotary / 2, so q's and k's rotary rows (and biases) are read
with each head's even rotary channels first, then its odd ones, and written back interleaved on export: the same
permutation of q and k leaves every score as it was. GLM-4-0414 (keel.families.glm4) is this block with sandwich
norms.
"""

from __future__ import annotations

from typing import Any

from keel.families.rope import interleaved_qk_layout, partial_rotary_factor

FAMILY = "glm"
HF_ARCHITECTURE = "GlmForCausalLM"
# transformers' GlmConfig defaults.
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
    return {
        "partial_rotary_factor": partial_rotary_factor(hf, 0.5),
        "qkv_bias": bool(hf.get("attention_bias", True)),
        "o_bias": False,
        "mlp_bias": False,
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {
        "attention_bias": config.qkv_bias,
        "rope_parameters": {**hf["rope_parameters"], "partial_rotary_factor": config.partial_rotary_factor},
    }


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """gate/up split by rows, q/k's rotary channels regrouped (the module doc)."""
    inter = config.intermediate_size
    layout = interleaved_qk_layout(config)
    for layer in range(config.num_layers):
        mlp = f"model.layers.{layer}.mlp"
        layout[f"{mlp}.gate_up_proj.weight"] = {
            f"{mlp}.gate_proj.weight": [(0, inter)],
            f"{mlp}.up_proj.weight": [(inter, 2 * inter)],
        }
    return layout
