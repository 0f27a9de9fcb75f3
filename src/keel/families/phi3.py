"""Phi-3 (`Phi3ForCausalLM`): Llama's block, with q, k and v stored as one `qkv_proj` tensor and the
MLP's gate and up as one `gate_up_proj` (gate first), both split into keel's projections at load
and fused again on export. Sliding windows as Mistral's (every layer, when `sliding_window` is set).

Rotary over the first `partial_rotary_factor` of each head where the file sets it (Phi-4-mini's 0.75), with
LongRoPE where `rope_scaling` says so (Phi-3 128k, Phi-3.5, Phi-4-mini; "su" and "yarn" are its older names,
read by keel.config), its pre-training context at the config's top level (`original_max_position_embeddings`).
"""

from __future__ import annotations

from typing import Any

from keel.families.rope import partial_rotary_factor

FAMILY = "phi3"
HF_ARCHITECTURE = "Phi3ForCausalLM"
# transformers' Phi3Config defaults.
DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "bos_token_id": 1,
    "eos_token_id": [32000],
}


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """Phi-3's own config.json keys as keel fields (the rotary share, Phi-4-mini's 0.75)."""
    return {"partial_rotary_factor": partial_rotary_factor(hf, 1.0)}


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    """config.json keys of the family, given the common ones keel writes for every family (`hf`)."""
    return {
        "sliding_window": config.sliding_window,
        # (keel.config reads this key before rope_parameters' own: every scaling with a pre-training context keeps it)
        "original_max_position_embeddings": config.rope_scaling.original_max_position_embeddings
        if config.rope_scaling.type != "default"
        else config.max_position_embeddings,
        "partial_rotary_factor": config.partial_rotary_factor,
    }


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """Stored tensor -> {the HF-style name keel reads: its rows of it}, every layer (keel.weights.parts)."""
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    layout: dict[str, dict[str, list[tuple[int, int]] | None]] = {}
    for layer in range(config.num_layers):
        attn, mlp = f"model.layers.{layer}.self_attn", f"model.layers.{layer}.mlp"
        layout[f"{attn}.qkv_proj.weight"] = {
            f"{attn}.q_proj.weight": [(0, q)],
            f"{attn}.k_proj.weight": [(q, q + kv)],
            f"{attn}.v_proj.weight": [(q + kv, q + 2 * kv)],
        }
        layout[f"{mlp}.gate_up_proj.weight"] = {
            f"{mlp}.gate_proj.weight": [(0, inter)],
            f"{mlp}.up_proj.weight": [(inter, 2 * inter)],
        }
    return layout
