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
