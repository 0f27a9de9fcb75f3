"""DBRX (`DbrxForCausalLM`: databricks/dbrx-base, dbrx-instruct): a pre-norm block of LayerNorms without bias
(`norm_1`, `norm_2`, `norm_f`), q/k/v fused in `Wqkv` and clamped to +-`clip_qkv` before the rotary embedding, a
mixture of experts in every layer (softmax over the router's logits, the top k, their weights divided by their sum
where `moe_normalize_expert_weights` is 1), gated experts of `ffn_act_fn` (SiLU), an untied head.

Its config.json nests keys of its own: `attn_config` (kv_n_heads, clip_qkv, rope_theta) and `ffn_config`
(ffn_hidden_size, moe_num_experts, moe_top_k, moe_normalize_expert_weights, ffn_act_fn), beside Mosaic's names for
the common ones (d_model, n_heads, n_layers, max_seq_len). The released files give the RoPE base as
`attn_config.rope_theta` (500000); transformers 5 reads a top-level `rope_parameters` instead, which it fills with its
default 10000 where a file has none, so keel takes `attn_config.rope_theta` where present (writing both, equal).
The router's training-time jitter (`moe_jitter_eps`: its input times uniform noise in training mode) and the
dropouts are not applied by keel; inference is the same.

Refused by name: `moe_normalize_expert_weights` other than 1 or null (a p-norm of the top-k weights for p != 1),
`ffn_act_fn` with arguments beyond its name, `tie_word_embeddings` (which transformers refuses too).

Its checkpoints store each layer's experts fused by rows: `ffn.experts.mlp.w1` (gate) and `v1` (up), each
[E * I, H] (expert e's [I, H] in rows e*I .. (e+1)*I), and `w2` [E * I, H], expert e's rows being the transpose of
its down projection [H, I] (DbrxExpertGLU computes `x @ w2`); read as keel's per-expert weights and written back.
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError
from keel.families.parts import RowsTransposed

FAMILY = "dbrx"
HF_ARCHITECTURE = "DbrxForCausalLM"
# DbrxConfig's attribute_map: its keys for the common ones keel reads.
ATTRIBUTE_MAP = {
    "d_model": "hidden_size",
    "n_heads": "num_attention_heads",
    "n_layers": "num_hidden_layers",
    "max_seq_len": "max_position_embeddings",
}
# transformers' DbrxConfig defaults (its norms are torch's LayerNorm, eps 1e-5).
DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "bos_token_id": None,
    "eos_token_id": [],
}
# DbrxAttentionConfig's and DbrxFFNConfig's defaults.
_KV_HEADS, _FFN_WIDTH, _EXPERTS, _TOP_K = 1, 3584, 4, 1
_NORMALIZE = 1.0
_LAYER_NORM_EPS = 1e-5


def upgrade_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The nested keys DbrxConfig reads in place of common ones, under those: the KV heads, the experts' width and
    activation (DbrxConfig sets num_key_value_heads from kv_n_heads whatever a file says), and the RoPE base."""
    attn, ffn = hf.get("attn_config") or {}, hf.get("ffn_config") or {}
    act = ffn.get("ffn_act_fn") or {"name": "silu"}
    out = {
        **hf,
        "num_key_value_heads": int(attn.get("kv_n_heads", _KV_HEADS)),
        "intermediate_size": int(ffn.get("ffn_hidden_size", _FFN_WIDTH)),
        "hidden_act": act.get("name", "silu") if isinstance(act, dict) else act,
    }
    if attn.get("rope_theta") is not None:
        params = hf.get("rope_parameters") or {"rope_type": "default"}
        out["rope_parameters"] = {**params, "rope_theta": float(attn["rope_theta"])}
    return out


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    attn, ffn = hf.get("attn_config") or {}, hf.get("ffn_config") or {}
    act = ffn.get("ffn_act_fn") or {"name": "silu"}
    if not isinstance(act, dict) or set(act) - {"name"}:
        raise ConfigError(f"{source}: ffn_act_fn {act!r} with arguments beyond its name is not supported")
    normalize = ffn.get("moe_normalize_expert_weights", _NORMALIZE)
    if normalize not in (None, 1, 1.0):
        raise ConfigError(
            f"{source}: moe_normalize_expert_weights {normalize} is not supported (1: the top-k weights divided by "
            "their sum, or null)"
        )
    if hf.get("tie_word_embeddings", False):
        raise ConfigError(f"{source}: tie_word_embeddings is not supported for DBRX (nor by transformers)")
    width = int(ffn.get("ffn_hidden_size", _FFN_WIDTH))
    clip = attn.get("clip_qkv")
    return {
        "norm_type": "layer",
        "norm_bias": False,
        "rms_norm_eps": _LAYER_NORM_EPS,
        "clip_qkv": None if clip is None else float(clip),
        "num_experts": int(ffn.get("moe_num_experts", _EXPERTS)),
        "num_experts_per_tok": int(ffn.get("moe_top_k", _TOP_K)),
        "moe_intermediate_size": width,
        "intermediate_size": width,
        "router_scoring": "softmax",
        "norm_topk_prob": normalize is not None,
        "tie_word_embeddings": False,
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    if config.norm_type != "layer" or config.norm_bias or config.rms_norm_eps != _LAYER_NORM_EPS:
        raise ConfigError(f"{config.architecture}: DBRX's norms are LayerNorms without bias, eps 1e-5")
    if config.head_dim * config.num_heads != config.hidden_size:
        raise ConfigError(f"{config.architecture}: DBRX's heads are hidden_size / n_heads wide")
    return {
        "d_model": config.hidden_size,
        "n_heads": config.num_heads,
        "n_layers": config.num_layers,
        "max_seq_len": config.max_position_embeddings,
        "attn_config": {
            "kv_n_heads": config.num_kv_heads,
            "clip_qkv": config.clip_qkv,
            "rope_theta": config.rope_theta,
        },
        "ffn_config": {
            "ffn_hidden_size": config.moe_intermediate_size,
            "moe_num_experts": config.num_experts,
            "moe_top_k": config.num_experts_per_tok,
            "moe_normalize_expert_weights": 1.0 if config.norm_topk_prob else None,
            "ffn_act_fn": {"name": hf["hidden_act"]},
        },
    }


Layout = dict[str, dict[str, Any]]


def _layout(config: Any, prefix: str) -> Layout:
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    width = config.moe_intermediate_size
    layout: Layout = {
        f"{prefix}wte.weight": {"model.embed_tokens.weight": None},
        f"{prefix}norm_f.weight": {"model.norm.weight": None},
    }
    for layer in range(config.num_layers):
        src, dst = f"{prefix}blocks.{layer}", f"model.layers.{layer}"
        block, experts = f"{src}.norm_attn_norm", f"{src}.ffn.experts.mlp"
        layout[f"{block}.norm_1.weight"] = {f"{dst}.input_layernorm.weight": None}
        layout[f"{block}.norm_2.weight"] = {f"{dst}.post_attention_layernorm.weight": None}
        layout[f"{block}.attn.Wqkv.weight"] = {
            f"{dst}.self_attn.q_proj.weight": [(0, q)],
            f"{dst}.self_attn.k_proj.weight": [(q, q + kv)],
            f"{dst}.self_attn.v_proj.weight": [(q + kv, q + 2 * kv)],
        }
        layout[f"{block}.attn.out_proj.weight"] = {f"{dst}.self_attn.o_proj.weight": None}
        layout[f"{src}.ffn.router.layer.weight"] = {f"{dst}.mlp.gate.weight": None}
        rows = [[(e * width, (e + 1) * width)] for e in range(config.num_experts)]
        layout[f"{experts}.w1"] = {f"{dst}.mlp.experts.{e}.gate_proj.weight": r for e, r in enumerate(rows)}
        layout[f"{experts}.v1"] = {f"{dst}.mlp.experts.{e}.up_proj.weight": r for e, r in enumerate(rows)}
        layout[f"{experts}.w2"] = {
            f"{dst}.mlp.experts.{e}.down_proj.weight": RowsTransposed(r) for e, r in enumerate(rows)
        }
    return layout


def checkpoint_layout(config: Any) -> Layout:
    """DBRX's stored names -> keel's (Llama's and Qwen-MoE's per-expert ones, the module docstring): DbrxModel's bare
    names first, so that an export writes DbrxForCausalLM's `transformer.` ones."""
    return {**_layout(config, ""), **_layout(config, "transformer.")}
