"""StarCoder2 (`Starcoder2ForCausalLM`): LayerNorms with biases (eps `norm_epsilon`), an ungated GELU MLP (tanh
approximation) named `mlp.c_fc` / `mlp.c_proj`, biases on every projection (`use_bias`), and a sliding window on
every layer where `sliding_window` is set. The MLP's tensors are read under keel's names (`up_proj`,
`down_proj`) and written back under StarCoder2's on export.
"""

from __future__ import annotations

from typing import Any

FAMILY = "starcoder2"
HF_ARCHITECTURE = "Starcoder2ForCausalLM"
# transformers' Starcoder2Config defaults (its norm_epsilon is keel's rms_norm_eps: the norms' eps).
DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "bos_token_id": 50256,
    "eos_token_id": [50256],
    "hidden_act": "gelu_pytorch_tanh",
}


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    bias = bool(hf.get("use_bias", True))
    eps = hf.get("norm_epsilon")
    window = hf.get("sliding_window")
    layers = int(hf["num_hidden_layers"])
    return {
        "norm_type": "layer",
        "norm_bias": True,
        "rms_norm_eps": float(DEFAULTS["rms_norm_eps"] if eps is None else eps),
        "mlp_gated": False,
        "qkv_bias": bias,
        "o_bias": bias,
        "mlp_bias": bias,
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
        "sliding_window": window,
        "layer_types": ["sliding_attention" if window else "full_attention"] * layers,
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {
        "norm_epsilon": config.rms_norm_eps,
        "use_bias": config.qkv_bias,
        "sliding_window": config.sliding_window,
    }


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """The MLP's tensors under keel's names."""
    layout: dict[str, dict[str, list[tuple[int, int]] | None]] = {}
    kinds = ("weight", "bias") if config.mlp_bias else ("weight",)
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}.mlp"
        for kind in kinds:
            layout[f"{prefix}.c_fc.{kind}"] = {f"{prefix}.up_proj.{kind}": None}
            layout[f"{prefix}.c_proj.{kind}"] = {f"{prefix}.down_proj.{kind}": None}
    return layout
