"""Kimi Linear (`KimiLinearForCausalLM`: Kimi-Linear-48B-A3B): Kimi Delta Attention layers (`linear_attention`,
keel's `linear_variant` "kda": Gated DeltaNet with a decay per key channel, keel.model.kda) between multi-head latent
attention layers without position encoding (DeepSeek-V3's latent attention whose rope part is left unrotated:
`rope_layers` all False), and DeepSeek-V3's experts (sigmoid router with a selection bias and groups, shared experts;
dense layers by `mlp_layer_types`).

Its config class reads keys under names of its own (`num_experts`, `num_experts_per_token`, `moe_renormalize`, ...:
ATTRIBUTE_MAP) and Moonshot's released files nest the linear layers' in `linear_attn_config` (1-indexed
`kda_layers` / `full_attn_layers`) with DeepSeek's `first_k_dense_replace` (`upgrade_config`). Refused by name:
Its checkpoints keep transformers' pre-conversion names: experts as Mixtral's (`block_sparse_moe.experts.E.w1/w3/w2`),
the dense layers' MLPs under `block_sparse_moe.` too (`checkpoint_layout`), the three short convolutions apart. Refused
by name: `mla_use_nope` false (a latent attention that rotates, which transformers does not run) and a router other than
sigmoid (`moe_router_activation_func`). llama.cpp's `kimi-linear` GGUF files are read by keel.weights.gguf.
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError
from keel.families.layer_kinds import dense_layers, mlp_layer_types, refuse_other_conv_activation

FAMILY = "kimi_linear"
HF_ARCHITECTURE = "KimiLinearForCausalLM"
# transformers' KimiLinearConfig defaults (the MoE and MLA ones under the names keel's DeepSeek readers use).
DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": 32,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,  # unused: no layer rotates
    "max_position_embeddings": 1048576,
    "bos_token_id": 163584,
    "eos_token_id": [163586],
    "intermediate_size": 9216,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 1024,
    "norm_topk_prob": True,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.446,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "rope_interleave": False,
}
# KimiLinearConfig's attribute_map, as alias -> the key keel reads.
ATTRIBUTE_MAP = {
    "num_experts": "n_routed_experts",
    "num_experts_per_token": "num_experts_per_tok",
    "num_shared_experts": "n_shared_experts",
    "moe_renormalize": "norm_topk_prob",
    "num_expert_group": "n_group",
    "model_max_length": "max_position_embeddings",
}
# the config class computes these from others (head_dim: the rotary width): not written
COMPUTED_KEYS = ("head_dim", "qk_head_dim")
LINEAR = {"linear_num_heads": 32, "linear_head_dim": 128, "linear_conv_kernel_dim": 4}


def upgrade_config(hf: dict[str, Any]) -> dict[str, Any]:
    """Moonshot's nested `linear_attn_config` as transformers' top-level keys (what KimiLinearConfig does)."""
    nested = hf.get("linear_attn_config") or {}
    out = dict(hf)
    for key, nested_key in (
        ("linear_head_dim", "head_dim"),
        ("linear_num_heads", "num_heads"),
        ("linear_conv_kernel_dim", "short_conv_kernel_size"),
    ):
        if nested_key in nested:
            out[key] = nested[nested_key]
    layers = int(hf["num_hidden_layers"])
    if not hf.get("layer_types"):
        if "full_attn_layers" in nested and "kda_layers" in nested:
            kinds: list[str | None] = [None] * layers
            for i in nested["full_attn_layers"]:
                kinds[i - 1] = "full_attention"
            for i in nested["kda_layers"]:
                kinds[i - 1] = "linear_attention"
        else:
            kinds = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(layers)]
        out["layer_types"] = kinds
    return out


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    refuse_other_conv_activation(hf, source)
    if hf.get("mla_use_nope") is False:
        raise ConfigError(f"{source}: mla_use_nope false (a rotating latent attention) is not supported")
    router = hf.get("moe_router_activation_func") or "sigmoid"
    if router != "sigmoid":
        raise ConfigError(f"{source}: moe_router_activation_func {router!r} is not supported (sigmoid)")
    layers = int(hf["num_hidden_layers"])
    kinds = hf["layer_types"]
    if len(kinds) != layers or not set(kinds) <= {"full_attention", "linear_attention"}:
        raise ConfigError(f"{source}: layer_types must give full_attention or linear_attention for each layer")
    heads, dim, kernel = (int(hf.get(key) or default) for key, default in LINEAR.items())
    return {
        "layer_types": list(kinds),
        "linear_variant": "kda",
        "linear_num_key_heads": heads,
        "linear_num_value_heads": heads,
        "linear_key_head_dim": dim,
        "linear_value_head_dim": dim,
        "linear_conv_kernel_dim": kernel,
        "rope_layers": [False] * layers,
        "mlp_only_layers": dense_layers(hf, source, first_dense=int(hf.get("first_k_dense_replace") or 1)),
        "o_bias": bool(hf.get("attention_bias", False)),  # q_a_proj, kv_a_proj_with_mqa and o_proj, as DeepSeek's
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {
        "layer_types": list(config.layer_types),
        "mlp_layer_types": mlp_layer_types(config),
        "linear_head_dim": config.linear_value_head_dim,
        "linear_num_heads": config.linear_num_value_heads,
        "linear_conv_kernel_dim": config.linear_conv_kernel_dim,
        "num_experts": config.num_experts,
        "num_experts_per_token": config.num_experts_per_tok,
        "num_shared_experts": hf["n_shared_experts"],
        "moe_renormalize": config.norm_topk_prob,
        "num_expert_group": config.n_group,
        "attention_bias": config.o_bias,
    }


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """The dense layers' MLPs, stored under `block_sparse_moe.` as the experts are, read as keel's `mlp.`."""
    layout: dict[str, dict[str, list[tuple[int, int]] | None]] = {}
    for layer in config.mlp_only_layers:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            stored = f"model.layers.{layer}.block_sparse_moe.{proj}.weight"
            layout[stored] = {f"model.layers.{layer}.mlp.{proj}.weight": None}
    return layout
