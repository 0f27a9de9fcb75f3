"""Granite SWA (`GraniteSWAForCausalLM`: granite-swash): Granite's block (its four scalars: embedding, residual and
softmax multipliers, logits divided; attention and MLP biases) with sliding-window and global layers by
`layer_types` (by default every fourth layer global, from layer 0), a learned softmax sink per query head (keel's
`attention_sinks`, as GPT-OSS's) and a RoPE base per layer (`layer_rope_theta`; 0: that layer has no position
encoding, keel's `rope_layers`).

keel rotates the global layers by one base and the sliding layers by one base of their own
(`sliding_rope_theta`), so a `layer_rope_theta` with more bases than that is refused by name, as is a second base
beside a scaled RoPE (transformers scales each base alike; keel's sliding layers' RoPE is unscaled).
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError
from keel.families.granitemoe import granite_block, granite_block_to_hf
from keel.families.rope import rope_settings

FAMILY = "granite_swa"
HF_ARCHITECTURE = "GraniteSWAForCausalLM"
# transformers' GraniteSWAConfig defaults.
DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 8192,
    "bos_token_id": 100257,
    "eos_token_id": [100257],
}
SLIDING_WINDOW = 128
GLOBAL_EVERY = 4  # the default layer_types: layers 0, 4, 8, ... global


def swa_fields(hf: dict[str, Any], source: str, default_theta: float) -> dict[str, Any]:
    """The sliding layers, the sinks and the per-layer RoPE bases of Granite SWA and Granite MoE SWA as keel's
    fields."""
    layers = int(hf["num_hidden_layers"])
    window = hf.get("sliding_window", SLIDING_WINDOW)
    kinds = hf.get("layer_types") or [
        "full_attention" if i % GLOBAL_EVERY == 0 else "sliding_attention" for i in range(layers)
    ]
    if len(kinds) != layers:
        raise ConfigError(f"{source}: layer_types has {len(kinds)} entries for {layers} layers")
    if window is None and "sliding_attention" in kinds:
        raise ConfigError(f"{source}: layer_types has sliding layers but sliding_window is null")
    rope = rope_settings(hf)
    base = float(rope.get("rope_theta", hf.get("rope_theta", default_theta)))
    thetas = hf.get("layer_rope_theta") or [base] * layers
    if len(thetas) != layers:
        raise ConfigError(f"{source}: layer_rope_theta has {len(thetas)} entries for {layers} layers")
    # The bases of the rotating layers of each kind (0: no position encoding).
    full, sliding = (
        {float(t) for t, k in zip(thetas, kinds, strict=True) if t and k == kind}
        for kind in ("full_attention", "sliding_attention")
    )
    if len(full) > 1 or len(sliding) > 1:
        raise ConfigError(
            f"{source}: layer_rope_theta {list(thetas)} is not supported (one base for the global layers and one for "
            "the sliding layers)"
        )
    theta = next(iter(full or sliding), base)
    local = next(iter(sliding), theta)
    if local != theta and rope.get("rope_type", rope.get("type", "default")) not in (None, "default"):
        raise ConfigError(f"{source}: layer_rope_theta with two bases beside a scaled RoPE is not supported")
    return {
        "sliding_window": window,
        "layer_types": list(kinds),
        "attention_sinks": True,
        "rope_layers": [bool(t) for t in thetas],
        "rope_theta": theta,
        "sliding_rope_theta": local if local != theta else None,
    }


def swa_hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    """Granite SWA's own keys: transformers' config takes one flat `rope_parameters` (the global layers') and the
    bases per layer."""
    rope = hf["rope_parameters"]
    thetas = [
        (config.sliding_rope_theta or config.rope_theta) if kind == "sliding_attention" else config.rope_theta
        for kind in config.layer_types
    ]
    return {
        "sliding_window": config.sliding_window,
        "layer_types": list(config.layer_types),
        "rope_parameters": rope.get("full_attention", rope),
        "layer_rope_theta": [t if config.layer_rotates(i) else 0 for i, t in enumerate(thetas)],
    }


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    return {
        **granite_block(hf),
        "mlp_bias": bool(hf.get("mlp_bias", False)),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
        **swa_fields(hf, source, DEFAULTS["rope_theta"]),
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {**granite_block_to_hf(config), "mlp_bias": config.mlp_bias, **swa_hf_fields(config, hf)}
