"""GLM-4 (`Glm4ForCausalLM`: GLM-4-0414, GLM-Z1): a norm before and after each sublayer ("sandwich", plain
RMSNorms: its `post_self_attn_layernorm` and `post_mlp_layernorm` are keel's `attn_output_norm` and
`mlp_output_norm`; its `post_attention_layernorm` is the norm before the MLP, as keel's), biased q/k/v, gate and
up stored fused in `mlp.gate_up_proj` (gate rows first), and rotary over the first half of each head on interleaved
pairs: GLM-4-9B's block (keel.families.glm, which reads the rest) with the sandwich norms.
"""

from __future__ import annotations

from typing import Any

from keel.families import glm

FAMILY = "glm4"
HF_ARCHITECTURE = "Glm4ForCausalLM"
# transformers' Glm4Config defaults: GlmConfig's.
DEFAULTS: dict[str, Any] = glm.DEFAULTS


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    return {**glm.config_fields(hf, source), "norm_placement": "sandwich"}


hf_fields = glm.hf_fields


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """GLM-4's (keel.families.glm: gate/up split, q/k rows regrouped) and its output norms under keel's names."""
    layout = glm.checkpoint_layout(config)
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}"
        layout[f"{prefix}.post_self_attn_layernorm.weight"] = {f"{prefix}.attn_output_norm.weight": None}
        layout[f"{prefix}.post_mlp_layernorm.weight"] = {f"{prefix}.mlp_output_norm.weight": None}
    return layout
