"""Bailing Hybrid (`BailingHybridForCausalLM`, model_type bailing_hybrid: inclusionAI's Ling/Ring 3 hybrids): Kimi
Delta Attention layers (`linear_attention`, keel's `linear_variant` "kda") with a full-rank decay and output gate
(`f_proj`, `g_proj`: `kda_full_rank_gates`) and, where `kda_safe_gate`, the decay bounded below
(`kda_gate_lower_bound` = `kda_lower_bound`), between DeepSeek-V3's multi-head latent attention layers (rotating
interleaved pairs) whose heads' outputs are gated by sigmoid of a unit per head (`g_proj`: keel's
`attention_output_gate` with `attention_gate_per_head`); DeepSeek-V3's experts (sigmoid router, selection bias,
groups, shared experts; dense layers by `mlp_layer_types` or `first_k_dense_replace`).

The layer kinds: `layer_types`, else every `layer_group_size`-th layer full attention. The KDA heads are the
attention's (`num_attention_heads`, `head_dim` in the releases' config.json, which transformers then reuses as the
rotary width: `linear_head_dim` where written). The checkpoints keep Ling's names (transformers renames them on load):
`model.word_embeddings`, each layer's `attention.` (its output projection `dense`, the KDA convolutions apart, its
decay's `f_proj`/`dt_bias`/`A_log` beside them), the router's `expert_bias`. The multi-token-prediction layers after
the last (`num_mtp_layers`) are not read.
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError
from keel.families.layer_kinds import dense_layers, mlp_layer_types, refuse_other_conv_activation

FAMILY = "bailing_hybrid"
HF_ARCHITECTURE = "BailingHybridForCausalLM"
# transformers' BailingHybridConfig defaults (the MoE and MLA ones under the names keel's DeepSeek readers use).
DEFAULTS: dict[str, Any] = {
    "head_dim": 128,  # the KDA heads' width (keel's head_dim is the latent attention's, nope + rope)
    "num_key_value_heads": 32,
    "rms_norm_eps": 1e-6,
    "rope_theta": 6_000_000.0,
    "max_position_embeddings": 262144,
    "bos_token_id": None,
    "eos_token_id": [156895],
    "intermediate_size": 6144,
    "num_experts": 512,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "n_shared_experts": 1,
    "first_k_dense_replace": 2,
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "rope_interleave": True,
}
# BailingHybridConfig's attribute_map, as alias -> the key keel reads.
ATTRIBUTE_MAP = {
    "num_experts": "n_routed_experts",
    "num_local_experts": "n_routed_experts",
    "num_experts_per_token": "num_experts_per_tok",
    "num_shared_experts": "n_shared_experts",
    "moe_renormalize": "norm_topk_prob",
    "num_expert_group": "n_group",
    "model_max_length": "max_position_embeddings",
    "num_mtp_layers": "num_nextn_predict_layers",
}
# keys its config class refuses (DeepSeek's names it does not have) or computes: not written
COMPUTED_KEYS = ("n_routed_experts", "rope_interleave", "qk_head_dim")
GROUP_SIZE = 6  # layer_group_size's default
LOWER_BOUND = -5.0  # kda_lower_bound's default


def upgrade_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The linear layers' geometry and the layer kinds as BailingHybridConfig derives them where absent; the rope
    always interleaved (the config class has no key for it)."""
    out = dict(hf)
    out.setdefault("linear_head_dim", hf.get("head_dim") or DEFAULTS["head_dim"])
    out.setdefault("linear_num_heads", hf.get("num_attention_heads") or 32)
    out.setdefault("linear_conv_kernel_dim", hf.get("short_conv_kernel_size") or 4)
    out["rope_interleave"] = True
    if not hf.get("layer_types"):
        group = int(hf.get("layer_group_size") or GROUP_SIZE)
        out["layer_types"] = [
            "full_attention" if (i + 1) % group == 0 else "linear_attention"
            for i in range(int(hf["num_hidden_layers"]))
        ]
    return out


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    refuse_other_conv_activation(hf, source)  # the KDA convolutions' activation is hidden_act too
    layers = int(hf["num_hidden_layers"])
    kinds = hf["layer_types"]
    if len(kinds) != layers or not set(kinds) <= {"full_attention", "linear_attention"}:
        raise ConfigError(f"{source}: layer_types must give full_attention or linear_attention for each layer")
    heads, dim, kernel = (int(hf[key]) for key in ("linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim"))
    safe = hf.get("kda_safe_gate", True)
    bound = float(hf["kda_lower_bound"] if hf.get("kda_lower_bound") is not None else LOWER_BOUND)
    return {
        "layer_types": list(kinds),
        "linear_variant": "kda",
        "kda_full_rank_gates": True,
        "kda_gate_lower_bound": bound if safe else None,
        "linear_num_key_heads": heads,
        "linear_num_value_heads": heads,
        "linear_key_head_dim": dim,
        "linear_value_head_dim": dim,
        "linear_conv_kernel_dim": kernel,
        "attention_output_gate": True,
        "attention_gate_per_head": True,
        "mlp_only_layers": dense_layers(hf, source, first_dense=int(hf.get("first_k_dense_replace", 2))),
        "o_bias": bool(hf.get("attention_bias", False)),  # q_a_proj, kv_a_proj_with_mqa and dense, as DeepSeek's
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    if config.linear_variant != "kda" or not config.kda_full_rank_gates or not config.attention_output_gate:
        raise ConfigError("bailing_hybrid: its KDA layers have full-rank gates and its attention a gate per head")
    bound = config.kda_gate_lower_bound
    return {
        "layer_types": list(config.layer_types),
        "mlp_layer_types": mlp_layer_types(config),
        "linear_head_dim": config.linear_value_head_dim,
        "linear_num_heads": config.linear_num_value_heads,
        "linear_conv_kernel_dim": config.linear_conv_kernel_dim,
        "short_conv_kernel_size": config.linear_conv_kernel_dim,
        "kda_safe_gate": bound is not None,
        "kda_lower_bound": LOWER_BOUND if bound is None else bound,
        "num_experts": config.num_experts,  # n_routed_experts, which its config class refuses
        "attention_bias": config.o_bias,
    }


KDA_TENSORS = (
    *(f"{p}_proj.weight" for p in ("q", "k", "v", "f", "b", "g")),
    *(f"{p}_conv1d.weight" for p in ("q", "k", "v")),
    "dt_bias",
    "A_log",
    "o_norm.weight",
)
MLA_TENSORS = (
    "q_proj.weight",
    "q_a_proj.weight",
    "q_a_proj.bias",
    "q_a_layernorm.weight",
    "q_b_proj.weight",
    "kv_a_proj_with_mqa.weight",
    "kv_a_proj_with_mqa.bias",
    "kv_a_layernorm.weight",
    "kv_b_proj.weight",
)


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """Ling's names -> keel's: the embedding, each layer's `attention.` (`dense`: o_proj; the latent attention's
    `g_proj`: keel's output_gate) and the router's bias."""
    layout: dict[str, dict[str, list[tuple[int, int]] | None]] = {
        "model.word_embeddings.weight": {"model.embed_tokens.weight": None}
    }
    for layer in range(config.num_layers):
        stored, attn = f"model.layers.{layer}.attention", f"model.layers.{layer}.self_attn"
        linear = config.is_linear_layer(layer)
        names = {name: name for name in (KDA_TENSORS if linear else MLA_TENSORS)}
        names |= {"dense.weight": "o_proj.weight", "dense.bias": "o_proj.bias"}
        if not linear:
            names["g_proj.weight"] = "output_gate.weight"
        for name, keel in names.items():
            layout[f"{stored}.{name}"] = {f"{attn}.{keel}": None}
        gate = f"model.layers.{layer}.mlp.gate"
        layout[f"{gate}.expert_bias"] = {f"{gate}.e_score_correction_bias": None}
    return layout
