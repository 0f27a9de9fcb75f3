"""Granite MoE SWA (`GraniteMoeSWAForCausalLM`: granite-swash MoE): Granite MoE with its optional ungated shared
expert (keel.families.granitemoeshared; a `shared_intermediate_size` of 0, the default, means none) and Granite
SWA's attention (keel.families.granite_swa: sliding and global layers by `layer_types`, softmax sinks, a RoPE base
per layer, 0 for none). Its checkpoints keep the experts stacked under `block_sparse_moe.experts` and the router as
`block_sparse_moe.router`, read as keel's and written back.
"""

from __future__ import annotations

from typing import Any

from keel.families import granite_swa, granitemoe, granitemoeshared

FAMILY = "granitemoe_swa"
HF_ARCHITECTURE = "GraniteMoeSWAForCausalLM"
DEFAULTS: dict[str, Any] = dict(granitemoeshared.DEFAULTS)  # transformers' GraniteMoeSWAConfig's are the same
# Stored names (under model.layers.N.block_sparse_moe) -> the HF-style names keel reads (under model.layers.N.mlp).
_STORED = {
    "experts.gate_up_proj": "experts.gate_up_proj",
    "experts.down_proj": "experts.down_proj",
    "router.weight": "gate.weight",
}


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    return {
        **granitemoeshared.config_fields(hf, source),
        **granite_swa.swa_fields(hf, source, DEFAULTS["rope_theta"]),
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {**granitemoeshared.hf_fields(config, hf), **granite_swa.swa_hf_fields(config, hf)}


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """The experts under transformers' own names (no conversion renames them, unlike Granite MoE's
    `input_linear`), and Granite MoE shared's shared MLP."""
    return {**granitemoe.expert_layout(config, _STORED), **granitemoeshared.shared_mlp_layout(config)}
