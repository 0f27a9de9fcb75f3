"""Where families' config.json files keep their rotary settings: transformers 5 moved them into
`rope_parameters` (older files: `rope_scaling` or the top level), so each is looked up in that order."""

from __future__ import annotations

from typing import Any


def rope_settings(hf: dict[str, Any]) -> dict[str, Any]:
    """The file's rope parameters (transformers 5's `rope_parameters`, else `rope_scaling`), {} if none."""
    return hf.get("rope_parameters") or hf.get("rope_scaling") or {}


def partial_rotary_factor(hf: dict[str, Any], default: float, *legacy_keys: str) -> float:
    """The share of each head that rotates: from the rope parameters, the top level, then each older key
    a family used for it (GPT-NeoX's `rotary_pct`), else `default`."""
    for source, key in ((rope_settings(hf), "partial_rotary_factor"), (hf, "partial_rotary_factor")):
        if source.get(key) is not None:
            return float(source[key])
    for key in legacy_keys:
        if hf.get(key) is not None:
            return float(hf[key])
    return float(default)


def interleaved_rotary_rows(heads: int, head_dim: int, rotary: int) -> list[tuple[int, int]]:
    """For families that rotate interleaved pairs (channels 2i and 2i + 1 at frequency i: GLM-4, Cohere): the
    stored rows of q or k in the order keel's rotary pairs them (channel i with i + rotary / 2), per head its even
    rotary channels, then its odd ones, then the rest. The same permutation of q's and k's rows keeps every
    attention score; a checkpoint layout reads q and k through it and export writes them back interleaved."""
    rows: list[tuple[int, int]] = []
    for h in range(heads):
        base = h * head_dim
        rows += [(base + c, base + c + 1) for c in range(0, rotary, 2)]
        rows += [(base + c, base + c + 1) for c in range(1, rotary, 2)]
        if rotary < head_dim:
            rows.append((base + rotary, base + head_dim))
    return rows


def interleaved_qk_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """Every layer's q and k (weights, and biases where the config has them) read through
    `interleaved_rotary_rows` (a keel.weights.parts layout)."""
    d, rotary = config.head_dim, config.rotary_dim
    q_rows = interleaved_rotary_rows(config.num_heads, d, rotary)
    k_rows = interleaved_rotary_rows(config.num_kv_heads, d, rotary)
    kinds = ("weight", "bias") if config.qkv_bias else ("weight",)
    layout: dict[str, dict[str, list[tuple[int, int]] | None]] = {}
    for layer in range(config.num_layers):
        attn = f"model.layers.{layer}.self_attn"
        for kind in kinds:
            layout[f"{attn}.q_proj.{kind}"] = {f"{attn}.q_proj.{kind}": q_rows}
            layout[f"{attn}.k_proj.{kind}"] = {f"{attn}.k_proj.{kind}": k_rows}
    return layout


def rope_per_kind(config: Any, hf: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The `rope_parameters` keyed by layer kind as Laguna's and MiMo-V2-Flash's config classes write them, each kind
    with its rotary share (`partial_rotary_factor`; the sliding layers' `sliding_partial_rotary_factor`), given the
    common export's `hf`."""
    rope = hf["rope_parameters"]
    if config.sliding_rope_theta is None:  # every layer full: one kind, written per kind as the config class does
        rope = {"full_attention": rope}
    rope = {kind: dict(spec) for kind, spec in rope.items()}
    rope["full_attention"]["partial_rotary_factor"] = config.partial_rotary_factor
    if "sliding_attention" in rope:
        rope["sliding_attention"]["partial_rotary_factor"] = config.sliding_partial_rotary_factor
    return rope
