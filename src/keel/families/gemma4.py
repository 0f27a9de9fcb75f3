"""Gemma 4, text (`Gemma4ForCausalLM`, model_type gemma4_text; and the released `Gemma4ForConditionalGeneration`
checkpoints on text: the decoder under `model.language_model.`, the vision and audio towers unread). Gemma 3's block
(sandwich norms, q/k norms per head, the embedding times sqrt(hidden_size), a GELU-gated MLP, sliding layers with a
RoPE of their own, a final soft-cap) with:

- plain RMSNorm scales (weight, not 1 + weight) and a softmax scale of 1;
- full-attention layers of their own geometry: `global_head_dim` wide heads, `num_global_key_value_heads` KV heads
  where `attention_k_eq_v` (transformers' `per_layer_config`, which its saved configs hold instead), and with
  `attention_k_eq_v` no v_proj: their values are the keys' projection (keel's global_head_dim, global_num_kv_heads,
  attention_k_eq_v);
- values normed per head without a weight (`v_norm`); each layer's output times its stored `layer_scalar`;
- "proportional" RoPE in the full-attention layers: a quarter (partial_rotary_factor) of the frequencies over the
  whole head turn, the rest are 0 (RopeScaling.rotated_share);
- with `enable_moe_block`, every layer's MLP beside routed experts (keel's MoE with the dense MLP as its ungated
  shared expert, `moe_branch_norms`): each branch has a norm before and after it, the router reads the un-normed
  residual through a weightless RMSNorm times `router.scale` and hidden_size^-1/2, a float32 softmax whose top k are
  renormalised and multiplied by `router.per_expert_scale`; experts stored stacked (`experts.gate_up_proj`).

E2B/E4B's per-layer input embeddings (`hidden_size_per_layer_input`: `embed_tokens_per_layer` and
`per_layer_model_projection`, and in each layer a gated branch after the MLP) are keel's per_layer_input_size.

Their KV sharing (`num_kv_shared_layers`: the last layers attend over the keys and values of the last earlier layer
of their type, computing none) is keel's kv_shared_layers; a shared layer's k_proj, v_proj and k_norm, which
transformers ignores where a checkpoint holds them, are not read.

`use_double_wide_mlp` makes the shared layers' MLPs twice as wide (keel's kv_shared_mlp_factor 2).

Refused by name: `use_double_wide_mlp` in an MoE model's shared layers, bidirectional attention
(`use_bidirectional_attention`), and a `per_layer_config` other than transformers' own (one head width and KV-head
count for the full-attention layers).
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError
from keel.families.gemma import gemma2_activation, gemma2_activation_to_hf, refuse_bidirectional
from keel.families.windows import sliding_layer_types

FAMILY = "gemma4"
HF_ARCHITECTURE = "Gemma4ForCausalLM"
# transformers' Gemma4TextConfig defaults.
DEFAULTS: dict[str, Any] = {
    "head_dim": 256,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10_000.0,
    "max_position_embeddings": 131_072,
    "bos_token_id": 2,
    "eos_token_id": [1],
}
# Gemma4TextConfig's rope parameters where a config has none.
DEFAULT_ROPE: dict[str, Any] = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
SLIDING_WINDOW_PATTERN = 6  # every sixth layer global
GLOBAL_HEAD_DIM = 512
PLE_WIDTH = 256  # hidden_size_per_layer_input's default: per-layer input embeddings unless a config says 0
PLE_VOCAB = 262_144  # vocab_size_per_layer_input's default


def _refuse(hf: dict[str, Any], source: str) -> None:
    refuse_bidirectional(hf, source)
    if hf.get("enable_moe_block") and hf.get("num_kv_shared_layers") and hf.get("use_double_wide_mlp"):
        raise ConfigError(
            f"{source}: use_double_wide_mlp: wider MoE-block MLPs in the KV-sharing layers are not supported"
        )


def _layer_types(hf: dict[str, Any]) -> list[str]:
    """transformers' rule: given or five sliding layers in six, the last layer always full attention."""
    kinds = sliding_layer_types(hf, SLIDING_WINDOW_PATTERN)
    return [*kinds[:-1], "full_attention"]


def _global_geometry(hf: dict[str, Any], layer_types: list[str], source: str) -> tuple[int, int]:
    """(global_head_dim, global_num_kv_heads) of the full-attention layers: from `per_layer_config` where the config
    has it (transformers' saved form), else from `global_head_dim` and, with attention_k_eq_v, from
    `num_global_key_value_heads` (Google's); 0 where they are the other layers'."""
    head_dim = int(hf.get("head_dim") or DEFAULTS["head_dim"])
    kv_heads = int(hf.get("num_key_value_heads") or DEFAULTS["num_key_value_heads"])
    per_layer = hf.get("per_layer_config")
    if per_layer is None:
        width = int(hf.get("global_head_dim") or GLOBAL_HEAD_DIM)
        heads = hf.get("num_global_key_value_heads") if hf.get("attention_k_eq_v") else None
        per_layer = {
            i: {"head_dim": width, **({} if heads is None else {"num_key_value_heads": heads})}
            for i, kind in enumerate(layer_types)
            if kind == "full_attention"
        }
    overrides = {int(i): dict(v) for i, v in per_layer.items()}
    full = [i for i, kind in enumerate(layer_types) if kind == "full_attention"]
    shapes = {(v.pop("head_dim", head_dim), v.pop("num_key_value_heads", kv_heads)) for v in overrides.values()}
    if sorted(overrides) != full or len(shapes) != 1 or any(overrides.values()):
        raise ConfigError(
            f"{source}: per_layer_config: only one head_dim / num_key_value_heads for the full-attention layers is "
            "supported"
        )
    width, heads = shapes.pop()
    return (0 if width == head_dim else int(width)), (0 if heads == kv_heads else int(heads))


def _moe_fields(hf: dict[str, Any]) -> dict[str, Any]:
    if not hf.get("enable_moe_block"):
        return {}
    return {
        "num_experts": int(hf["num_experts"]),
        "num_experts_per_tok": int(hf["top_k_experts"]),
        "moe_intermediate_size": int(hf["moe_intermediate_size"]),
        "norm_topk_prob": True,
        "router_scoring": "softmax",
        "router_input_norm": True,
        "router_expert_scale": True,
        # the layer's dense MLP, beside the experts
        "shared_expert_intermediate_size": int(hf["intermediate_size"]),
        "shared_expert_gated": False,
        "moe_branch_norms": True,
    }


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    _refuse(hf, source)
    layer_types = _layer_types(hf)
    global_head_dim, global_kv_heads = _global_geometry(hf, layer_types, source)
    cap = hf.get("final_logit_softcapping")
    return {
        "norm_placement": "sandwich",
        "qk_norm": True,
        "v_norm": True,
        "layer_scalar": True,
        "attention_k_eq_v": bool(hf.get("attention_k_eq_v", False)),
        "global_head_dim": global_head_dim,
        "global_num_kv_heads": global_kv_heads,
        "embedding_multiplier": float(hf["hidden_size"]) ** 0.5,
        "attention_scale": 1.0,
        "hidden_act": gemma2_activation(hf, source),
        "final_logit_softcapping": None if cap is None else float(cap),
        "sliding_window": int(hf.get("sliding_window") or 512),
        "layer_types": layer_types,
        "qkv_bias": bool(hf.get("attention_bias", False)),
        "o_bias": bool(hf.get("attention_bias", False)),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
        "per_layer_input_size": int(hf.get("hidden_size_per_layer_input", PLE_WIDTH) or 0),
        "per_layer_input_vocab_size": int(hf.get("vocab_size_per_layer_input", PLE_VOCAB)),
        "kv_shared_layers": int(hf.get("num_kv_shared_layers") or 0),
        "kv_shared_mlp_factor": 2 if hf.get("use_double_wide_mlp") else 1,
        **_moe_fields(hf),
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    full = [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"]
    geometry = {"head_dim": config.layer_head_dim(full[0]), "num_key_value_heads": config.layer_num_kv_heads(full[0])}
    out = {
        "model_type": "gemma4_text",
        "hidden_activation": gemma2_activation_to_hf(config),
        "final_logit_softcapping": config.final_logit_softcapping,
        "sliding_window": config.sliding_window,
        "layer_types": list(config.layer_types),
        "attention_bias": config.qkv_bias,
        "attention_k_eq_v": config.attention_k_eq_v,
        "global_head_dim": geometry["head_dim"],  # Google's form; transformers reads per_layer_config first
        "per_layer_config": {str(i): dict(geometry) for i in full},
        "hidden_size_per_layer_input": config.per_layer_input_size,
        "vocab_size_per_layer_input": config.ple_vocab_size,
        "num_kv_shared_layers": config.kv_shared_layers,
        "use_double_wide_mlp": config.kv_shared_mlp_factor == 2,
        "enable_moe_block": config.is_moe,
    }
    if config.attention_k_eq_v:
        out["num_global_key_value_heads"] = geometry["num_key_value_heads"]
    if config.is_moe:
        out.update(
            num_experts=config.num_experts,
            top_k_experts=config.num_experts_per_tok,
            moe_intermediate_size=config.moe_intermediate_size,
            intermediate_size=config.shared_expert_intermediate_size,
        )
    return out


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """Gemma's block norms under keel's names (keel.families.gemma3), and in MoE layers the dense MLP as the shared
    expert, the branches' norms, the router and the stacked experts under keel's MoE names."""
    layout: dict[str, dict[str, list[tuple[int, int]] | None]] = {}
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}"
        moe = config.is_moe_layer(layer)
        renames = {
            "post_attention_layernorm.weight": "attn_output_norm.weight",
            "pre_feedforward_layernorm.weight": "mlp.shared_input_norm.weight"
            if moe
            else "post_attention_layernorm.weight",
            "post_feedforward_layernorm.weight": "mlp_output_norm.weight",
        }
        if moe:
            renames |= {
                f"mlp.{proj}.weight": f"mlp.shared_expert.{proj}.weight"
                for proj in ("gate_proj", "up_proj", "down_proj")
            }
            renames |= {
                "post_feedforward_layernorm_1.weight": "mlp.shared_output_norm.weight",
                "pre_feedforward_layernorm_2.weight": "mlp.expert_input_norm.weight",
                "post_feedforward_layernorm_2.weight": "mlp.expert_output_norm.weight",
                "router.proj.weight": "mlp.gate.weight",
                "router.scale": "mlp.gate.input_scale",
                "router.per_expert_scale": "mlp.gate.expert_scale",
                "experts.gate_up_proj": "mlp.experts.gate_up_proj",
                "experts.down_proj": "mlp.experts.down_proj",
            }
        layout.update({f"{p}.{stored}": {f"{p}.{keel}": None} for stored, keel in renames.items()})
    return layout
