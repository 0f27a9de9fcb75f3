"""Granite MoE with a shared expert (`GraniteMoeSharedForCausalLM`: the Granite 4.0 tiny previews' dense-attention
kin): Granite MoE (keel.families.granitemoe) plus, beside the routed experts, one ungated SwiGLU MLP of
`shared_intermediate_size` added as it is (keel's `shared_expert`, as DeepSeek's). Its checkpoints store that MLP's
gate and up rows in one `shared_mlp.input_linear` (gate first) and its down projection as `shared_mlp.output_linear`,
read as keel's and written back. A width of 0 means no shared expert: the model is Granite MoE's.
"""

from __future__ import annotations

from typing import Any

from keel.families import granitemoe

FAMILY = "granitemoeshared"
HF_ARCHITECTURE = "GraniteMoeSharedForCausalLM"
DEFAULTS: dict[str, Any] = dict(granitemoe.DEFAULTS)


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    return {
        **granitemoe.config_fields(hf, source),
        "shared_expert_intermediate_size": int(hf.get("shared_intermediate_size") or 0),
        "shared_expert_gated": False,
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {**granitemoe.hf_fields(config, hf), "shared_intermediate_size": config.shared_expert_intermediate_size}


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """Granite MoE's renames, and the shared MLP's."""
    return {**granitemoe.checkpoint_layout(config), **shared_mlp_layout(config)}


def shared_mlp_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """The shared MLP's fused gate/up rows split into keel's two projections, its down projection renamed."""
    layout: dict[str, dict[str, list[tuple[int, int]] | None]] = {}
    width = config.shared_expert_intermediate_size
    for layer in range(config.num_layers if width else 0):
        stored, shared = f"model.layers.{layer}.shared_mlp", f"model.layers.{layer}.mlp.shared_expert"
        layout[f"{stored}.input_linear.weight"] = {
            f"{shared}.gate_proj.weight": [(0, width)],
            f"{shared}.up_proj.weight": [(width, 2 * width)],
        }
        layout[f"{stored}.output_linear.weight"] = {f"{shared}.down_proj.weight": None}
    return layout
