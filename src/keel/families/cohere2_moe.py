"""Cohere 2 MoE (`Cohere2MoeForCausalLM`): Command A's block (keel.families.cohere2: one norm feeding a parallel
residual, logits times `logit_scale`, rotary on interleaved pairs in the sliding layers only) with a mixture of
experts. Its norms are RMSNorms where `rms_norm_eps` is set, else bias-free LayerNorms (`layer_norm_eps`). The
router takes the top k of its logits, then their softmax (`expert_selection_fn` softmax: keel's topk_softmax) or
their sigmoid, renormalised where `norm_topk_prob` (sigmoid: keel's topk_sigmoid); `num_shared_experts` experts
of `intermediate_size` form one shared SwiGLU MLP (no gate on its output), added to the routed output
(`shared_expert_combination_strategy` sum) or averaged with it (average, the default). Dense layers by
`mlp_layer_types` (or the first `first_k_dense_replace`) are `prefix_dense_intermediate_size` wide, and with
`prefix_dense_sliding_window_pattern` 1 they rotate whatever their attention kind.
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError
from keel.families import cohere
from keel.families.layer_kinds import dense_layers, mlp_layer_types

FAMILY = "cohere2_moe"
HF_ARCHITECTURE = "Cohere2MoeForCausalLM"
# transformers' Cohere2MoeConfig defaults.
DEFAULTS: dict[str, Any] = {**cohere.DEFAULTS, "rope_theta": 10_000.0, "num_experts_per_tok": 2, "head_dim": 128}
SLIDING_WINDOW = 4096
PATTERN = 4  # the default layer_types: every fourth layer global (counted from the first sparse layer)
ROUTERS = {"softmax": "topk_softmax", "sigmoid": "topk_sigmoid"}
COMBINATIONS = ("sum", "average")


def _layer_types(hf: dict[str, Any], first_dense: int) -> list[str]:
    """config.json's layer_types, else transformers' rule: the first k (dense) layers by their own pattern, the
    others by `sliding_window_pattern` (the last of each group global)."""
    if hf.get("layer_types"):
        return list(hf["layer_types"])
    layers = int(hf["num_hidden_layers"])
    prefix = int(hf.get("prefix_dense_sliding_window_pattern", 1))
    pattern = int(hf.get("sliding_window_pattern") or PATTERN)
    kinds = [(i + 1) % prefix != 0 for i in range(first_dense)]
    kinds += [(i + 1) % pattern != 0 for i in range(layers - first_dense)]
    return ["sliding_attention" if sliding else "full_attention" for sliding in kinds]


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    layers = int(hf["num_hidden_layers"])
    selection = hf.get("expert_selection_fn", "softmax")
    if selection not in ROUTERS:
        raise ConfigError(f"{source}: expert_selection_fn {selection!r} is not supported (softmax, sigmoid)")
    combination = hf.get("shared_expert_combination_strategy", "average")
    if combination not in COMBINATIONS:
        raise ConfigError(
            f"{source}: shared_expert_combination_strategy {combination!r} is not supported (sum, average)"
        )
    first_dense = int(hf.get("first_k_dense_replace") or 0)
    dense = dense_layers(hf, source, first_dense)
    window = hf.get("sliding_window", SLIDING_WINDOW)
    kinds = _layer_types(hf, first_dense) if window is not None else ["full_attention"] * layers
    if len(kinds) != layers:
        raise ConfigError(f"{source}: layer_types has {len(kinds)} entries for {layers} layers")
    # transformers' Cohere 2 rotates where a layer slides; the dense layers too under a prefix pattern of 1.
    force = int(hf.get("prefix_dense_sliding_window_pattern", 1)) == 1
    width = int(hf.get("intermediate_size", 22528))
    rms_eps = hf.get("rms_norm_eps")
    return {
        **cohere.config_fields(hf, source),
        **({"norm_type": "rms", "rms_norm_eps": float(rms_eps)} if rms_eps is not None else {}),
        "sliding_window": window,
        "layer_types": kinds,
        "rope_layers": [kind == "sliding_attention" or (force and i in dense) for i, kind in enumerate(kinds)],
        "num_experts": int(hf.get("num_experts", 8)),
        "num_experts_per_tok": int(hf.get("num_experts_per_tok", 2)),
        "moe_intermediate_size": width,
        "intermediate_size": int(hf.get("prefix_dense_intermediate_size") or width),
        "mlp_only_layers": dense,
        "router_scoring": ROUTERS[selection],
        # transformers' softmax over the top k sums to one whatever norm_topk_prob says
        "norm_topk_prob": selection == "softmax" or bool(hf.get("norm_topk_prob", True)),
        "shared_expert_intermediate_size": width * int(hf.get("num_shared_experts") or 0),
        "shared_expert_gated": False,
        "shared_expert_combination": combination,
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    moe_width = config.moe_intermediate_size
    if config.shared_expert_intermediate_size % moe_width:
        raise ConfigError(
            f"cohere2_moe: shared expert width {config.shared_expert_intermediate_size} is not a multiple of "
            f"{moe_width}"
        )
    dense = set(config.mlp_only_layers)
    # Whether the dense layers rotate whatever their kind (only a global dense layer tells; 1 where none is).
    forced = all(config.layer_rotates(i) for i in dense if config.layer_types[i] == "full_attention")
    return {
        **cohere.hf_fields(config, hf),
        "sliding_window": config.sliding_window,
        "layer_types": list(config.layer_types),
        "mlp_layer_types": mlp_layer_types(config),
        "prefix_dense_sliding_window_pattern": 1 if forced else 2,
        "num_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "intermediate_size": moe_width,
        "prefix_dense_intermediate_size": config.intermediate_size,
        "expert_selection_fn": "softmax" if config.router_scoring == "topk_softmax" else "sigmoid",
        "norm_topk_prob": config.norm_topk_prob,
        "num_shared_experts": config.shared_expert_intermediate_size // moe_width,
        "shared_expert_combination_strategy": config.shared_expert_combination,
        # null: LayerNorms (transformers' Cohere2Moe chooses the norm by this key)
        "rms_norm_eps": config.rms_norm_eps if config.norm_type == "rms" else None,
    }


checkpoint_layout = cohere.checkpoint_layout
