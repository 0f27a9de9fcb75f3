"""Nemotron-H (`NemotronHForCausalLM`: Nemotron-H 8B/47B/56B, Nemotron Nano 2, Nemotron 3 Nano): every layer is one
block, a norm, then ONE sublayer and its residual, chosen per layer by `layers_block_type` (older configs:
`hybrid_override_pattern`, one character a layer): "M" / "linear_attention" a Mamba 2 mixer (keel.model.mamba, as
Granite 4.0-H's), "*" / "full_attention" attention without position encoding, "-" / "mlp" an ungated MLP
(down(act(up(x))), `mlp_hidden_act` relu2), "E" / "moe" a mixture of ungated experts routed as DeepSeek-V3 routes
(sigmoid, selection bias, groups, `routed_scaling_factor`) plus an ungated shared expert. keel's layers: a mixer alone
(`mlp_layers` False) or an MLP alone (`layer_types` "mlp"), the block's `norm` the norm before its one sublayer.

As transformers reads them: the Mamba step is clamped below at `time_step_min` (its `time_step_limit` is unread;
keel clamps at decode too), the head is never tied to the embedding (`tie_word_embeddings` notwithstanding),
`residual_in_fp32`, `n_shared_experts` and `chunk_size` change nothing, and the
multi-token-prediction layers (`mtp.*`) are not loaded. Refused by name: latent MoE projections (`moe_latent_size`),
attention biases (transformers builds none), another Mamba activation than SiLU.
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError
from keel.families.experts import sigmoid_experts
from keel.families.granitemoehybrid import float_json

FAMILY = "nemotron_h"
HF_ARCHITECTURE = "NemotronHForCausalLM"
# transformers' NemotronHConfig defaults.
DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "bos_token_id": 1,
    "eos_token_id": [2],
    "num_key_value_heads": 8,
    "head_dim": 128,
}
# The block kinds of `layers_block_type` (transformers' legacy "mamba" / "attention" too) and of the pattern.
KINDS = {
    "linear_attention": "M",
    "mamba": "M",
    "full_attention": "*",
    "attention": "*",
    "mlp": "-",
    "moe": "E",
}
PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
# keel's layer_types and whether the layer has its MLP, by pattern character.
LAYERS = {"M": ("mamba", False), "*": ("full_attention", False), "-": ("mlp", True), "E": ("mlp", True)}
# transformers' MLP activations under keel's names.
ACTIVATIONS = {"relu2": "relu2", "relu": "relu", "silu": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}
# NemotronHConfig's own keys, then the older names its __post_init__ still reads.
MAMBA_KEYS = {
    "n_groups": ("mamba_n_groups", 8),
    "conv_kernel": ("mamba_d_conv", 4),
    "use_conv_bias": ("mamba_conv_bias", True),
    "time_step_min": ("mamba_dt_min", 0.001),
}


def pattern(hf: dict[str, Any], source: str) -> str:
    """The layers' kinds as pattern characters (M, *, -, E)."""
    listed = hf.get("layers_block_type") or hf.get("layer_types")
    if listed:
        if not set(listed) <= set(KINDS):
            raise ConfigError(f"{source}: layers_block_type must list {', '.join(PATTERN.values())} layers")
        return "".join(KINDS[kind] for kind in listed)
    chars = hf.get("hybrid_override_pattern") or "ME*-"  # transformers' default layers
    if not set(chars) <= set(PATTERN):
        raise ConfigError(f"{source}: hybrid_override_pattern {chars!r} must be of M, *, - and E")
    return chars


def _mamba(hf: dict[str, Any], key: str) -> Any:
    legacy, default = MAMBA_KEYS[key]
    value = hf.get(key, hf.get(legacy))
    return default if value is None else value


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    if hf.get("moe_latent_size") is not None:
        raise ConfigError(f"{source}: moe_latent_size (latent MoE projections) is not supported")
    if hf.get("attention_bias"):
        raise ConfigError(f"{source}: attention_bias true is not supported (transformers' NemotronH has no biases)")
    if (hf.get("mamba_hidden_act") or "silu") not in ("silu", "swish"):
        raise ConfigError(f"{source}: mamba_hidden_act {hf['mamba_hidden_act']!r} is not supported (silu)")
    act = hf.get("mlp_hidden_act") or "relu2"
    if act not in ACTIVATIONS:
        raise ConfigError(f"{source}: mlp_hidden_act {act!r} is not supported ({', '.join(ACTIVATIONS)})")
    chars = pattern(hf, source)
    hidden = int(hf["hidden_size"])
    heads = int(hf.get("mamba_num_heads") or 128)
    expand = hf.get("expand", hf.get("mamba_expand"))
    head_dim = int(hf.get("mamba_head_dim") or (int(expand or 2) * hidden // heads))
    moe: dict[str, Any] = {"num_experts": 0}
    if "E" in chars:
        moe = {
            **sigmoid_experts(
                int(hf.get("n_routed_experts") or 8),
                int(hf.get("num_experts_per_tok") or 2),
                int(hf.get("moe_intermediate_size") or 7688),
                int(hf.get("moe_shared_expert_intermediate_size") or 7688),
                float(hf.get("routed_scaling_factor") or 1.0),
                bool(hf.get("norm_topk_prob", True)),
            ),
            "n_group": int(hf.get("n_group") or 1),
            "topk_group": int(hf.get("topk_group") or 1),
            "mlp_only_layers": [i for i, c in enumerate(chars) if c == "-"],
        }
    return {
        **moe,
        "num_layers": len(chars),
        "layer_types": [LAYERS[c][0] for c in chars],
        "mlp_layers": [LAYERS[c][1] for c in chars],
        "tie_word_embeddings": False,  # transformers' NemotronH never ties its head (no _tied_weights_keys)
        "sliding_window": None,  # transformers' NemotronH attends causally whatever `sliding_window` says
        "rope_layers": [False] * len(chars),
        "rms_norm_eps": float(hf.get("layer_norm_epsilon") or DEFAULTS["rms_norm_eps"]),
        "intermediate_size": int(hf.get("intermediate_size") or 21504),
        "hidden_act": ACTIVATIONS[act],
        "mlp_gated": False,
        "mlp_bias": bool(hf.get("mlp_bias", False)),
        "qkv_bias": False,
        "o_bias": False,
        "mamba_n_heads": heads,
        "mamba_d_head": head_dim,
        "mamba_n_groups": int(_mamba(hf, "n_groups")),
        "mamba_d_state": int(hf.get("ssm_state_size") or 128),
        "mamba_d_conv": int(_mamba(hf, "conv_kernel")),
        "mamba_conv_bias": bool(_mamba(hf, "use_conv_bias")),
        "mamba_proj_bias": bool(hf.get("use_bias", False)),
        "mamba_out_bias": bool(hf.get("use_bias", False)),  # use_bias covers both projections
        "mamba_dt_limit": (float(_mamba(hf, "time_step_min")), float("inf")),
    }


def _chars(config: Any) -> str:
    return "".join(
        ("E" if config.is_moe_layer(i) else "-") if kind == "mlp" else ("M" if kind == "mamba" else "*")
        for i, kind in enumerate(config.layer_types)
    )


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    out = {
        "layers_block_type": [PATTERN[c] for c in _chars(config)],
        "layer_norm_epsilon": config.rms_norm_eps,
        "mlp_hidden_act": {"gelu_tanh": "gelu_pytorch_tanh"}.get(config.hidden_act, config.hidden_act),
        "mlp_bias": config.mlp_bias,
        "attention_bias": False,
        "mamba_num_heads": config.mamba_n_heads,
        "mamba_head_dim": config.mamba_d_head,
        "n_groups": config.mamba_n_groups,
        "ssm_state_size": config.mamba_d_state,
        "conv_kernel": config.mamba_d_conv,
        "use_conv_bias": config.mamba_conv_bias,
        "use_bias": config.mamba_proj_bias,
        "time_step_min": config.mamba_dt_limit[0],
        "time_step_limit": [0.0, float_json(float("inf"))],
    }
    if config.is_moe:
        out.update(
            n_routed_experts=config.num_experts,
            num_experts_per_tok=config.num_experts_per_tok,
            moe_intermediate_size=config.moe_intermediate_size,
            moe_shared_expert_intermediate_size=config.shared_expert_intermediate_size,
            norm_topk_prob=config.norm_topk_prob,
            n_group=config.n_group,
            topk_group=config.topk_group,
            routed_scaling_factor=config.routed_scaling_factor,
        )
    return out


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """`backbone.` for keel's `model.`; each layer's `norm` as the norm before its one sublayer and its `mixer` as
    keel's `self_attn` or `mlp` (the router `mlp.gate` and the experts one by one as keel.weights.names reads them;
    the shared expert as keel's `shared_expert`)."""
    layout: dict[str, dict[str, list[tuple[int, int]] | None]] = {
        "backbone.embeddings.weight": {"model.embed_tokens.weight": None},
        "backbone.norm_f.weight": {"model.norm.weight": None},
    }
    mlp_kinds = ("weight", "bias") if config.mlp_bias else ("weight",)
    for layer, char in enumerate(_chars(config)):
        stored, keel = f"backbone.layers.{layer}", f"model.layers.{layer}"
        norm = "input_layernorm" if char in "M*" else "post_attention_layernorm"
        names: dict[str, str] = {"norm.weight": norm + ".weight"}
        if char == "M":
            mamba = ["dt_bias", "A_log", "D", "norm.weight", "in_proj.weight", "conv1d.weight", "out_proj.weight"]
            mamba += ["conv1d.bias"] if config.mamba_conv_bias else []
            mamba += ["in_proj.bias"] if config.mamba_proj_bias else []
            mamba += ["out_proj.bias"] if config.mamba_out_bias else []
            names |= {f"mixer.{n}": f"self_attn.{n}" for n in mamba}
        elif char == "*":
            names |= {f"mixer.{p}.weight": f"self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
        elif char == "-":
            names |= {f"mixer.{p}.{k}": f"mlp.{p}.{k}" for p in ("up_proj", "down_proj") for k in mlp_kinds}
        else:
            shared = {
                f"shared_experts.{p}.{k}": f"shared_expert.{p}.{k}" for p in ("up_proj", "down_proj") for k in mlp_kinds
            }
            router = {f"gate.{k}": f"gate.{k}" for k in ("weight", "e_score_correction_bias")}
            experts = {
                f"experts.{e}.{p}.weight": f"experts.{e}.{p}.weight"
                for e in range(config.num_experts)
                for p in ("up_proj", "down_proj")
            }
            names |= {f"mixer.{n}": f"mlp.{k}" for n, k in (shared | router | experts).items()}
        layout.update({f"{stored}.{n}": {f"{keel}.{k}": None} for n, k in names.items()})
    return layout
