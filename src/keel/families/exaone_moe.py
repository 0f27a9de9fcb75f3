"""K-EXAONE (`ExaoneMoeForCausalLM`: K-EXAONE-236B-A23B): EXAONE 4.0's attention (q/k RMSNorms per head; with a
`sliding_window`, sliding layers that rotate and global ones without position encoding, keel.families.exaone4) in
Llama's pre-norm block (OLMoE's: norms before each sublayer, not after), and DeepSeek-V3's experts (keel.config's
DeepSeek-style reader: a float32 sigmoid router with a selection-only bias, groups, renormalised and scaled weights,
ungated shared experts) under EXAONE's keys: `num_experts`, `num_shared_experts`, and the dense and sparse layers by
`mlp_layer_types` (else the first `first_k_dense_replace` dense). Its checkpoints keep the selection bias beside the
router (`mlp.e_score_correction_bias`), read under keel's name and written back; the multi-token-prediction module
(`mtp.*`) is not read.
"""

from __future__ import annotations

from typing import Any

from keel.families import exaone4
from keel.families.layer_kinds import dense_layers, mlp_layer_types

FAMILY = "exaone_moe"
HF_ARCHITECTURE = "ExaoneMoeForCausalLM"
# transformers' ExaoneMoeConfig defaults (the MoE ones under keel.config's DeepSeek-style names).
DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": 32,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "bos_token_id": 1,
    "eos_token_id": [53],
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 1024,
    "norm_topk_prob": True,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
}


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    first_dense = int(hf.get("first_k_dense_replace", DEFAULTS["first_k_dense_replace"]))
    width = int(hf.get("moe_intermediate_size", DEFAULTS["moe_intermediate_size"]))
    return {
        **exaone4.config_fields(hf, source),
        "norm_placement": "pre",
        "num_experts": int(hf.get("num_experts", DEFAULTS["num_experts"])),
        "shared_expert_intermediate_size": width * int(hf.get("num_shared_experts", DEFAULTS["n_shared_experts"])),
        "mlp_only_layers": dense_layers(hf, source, first_dense),
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    width = config.moe_intermediate_size
    return {
        **exaone4.hf_fields(config, hf),
        "num_experts": config.num_experts,
        "num_shared_experts": config.shared_expert_intermediate_size // width if width else 0,
        "mlp_layer_types": mlp_layer_types(config),
    }


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """The selection bias, stored beside the router, read as the router's (keel.weights.names: `gate.`)."""
    return {
        f"model.layers.{layer}.mlp.e_score_correction_bias": {
            f"model.layers.{layer}.mlp.gate.e_score_correction_bias": None
        }
        for layer in range(config.num_layers)
        if config.is_moe_layer(layer)
    }
