"""VaultGemma (`VaultGemmaForCausalLM`: google/vaultgemma-1b): Gemma 2's block (keel.families.gemma2: (1 + weight)
RMSNorms, scaled embedding, query_pre_attn_scalar, sliding and global layers, soft-capped scores and logits) with
a norm before each sublayer only: no norms on the sublayers' outputs. Its `pre_feedforward_layernorm` is keel's
norm before the MLP (`post_attention_layernorm`).
"""

from __future__ import annotations

from typing import Any

from keel.families import gemma2

FAMILY = "vaultgemma"
HF_ARCHITECTURE = "VaultGemmaForCausalLM"
# transformers' VaultGemmaConfig defaults (Gemma2Config's).
DEFAULTS: dict[str, Any] = gemma2.DEFAULTS


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    return {**gemma2.config_fields(hf, source), "norm_placement": "pre"}


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {**gemma2.hf_fields(config, hf), "model_type": "vaultgemma"}


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """The norm before the MLP under keel's name."""
    layout: dict[str, dict[str, list[tuple[int, int]] | None]] = {}
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}"
        layout[f"{p}.pre_feedforward_layernorm.weight"] = {f"{p}.post_attention_layernorm.weight": None}
    return layout
