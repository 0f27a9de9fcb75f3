"""A.X-K2 (`AXK2ForCausalLM`: SK Telecom's A.X K2): DeepSeek-V3.2's block (keel.families.deepseek_v32: latent
attention with DeepSeek Sparse Attention in every layer, DeepSeek-V3's experts) with three changes:

- the query: no q_b_proj; one `q_gate_proj` maps the query latent normed and raw side by side (2 x q_lora_rank) to
  each head's query and a gate per value channel, the heads' outputs times its sigmoid before o_proj (keel's
  `mla_query_gate`); the indexer reads the normed latent, as DeepSeek-V3.2's;
- gated norms: input_layernorm in every layer and post_attention_layernorm in the sparse ones are an RMSNorm times
  sigmoid(fc2(silu(fc1(y)))) of its output y, a low-rank pair of `gated_norm_rank` (keel's `gated_norm_rank`;
  transformers' `*.norm.weight`, `*.mlp.fc1/fc2.weight`);
- the router: without expert groups where `n_group` / `topk_group` are null (A.X-K2-Light; keel's one group), and
  with them the experts outside the chosen groups score 0, not -inf (keel's `router_group_mask_zero`).

The releases name the gated query's projection `q_b_proj` and the norms' pair `W_down` / `W_up` (`checkpoint_layout`).
Its dense and sparse layers are listed by `mlp_layer_types`, else derived from `first_k_dense_replace` (1) and
`moe_layer_freq` as its config class derives them.
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError
from keel.families import axk1, deepseek_v32

FAMILY = "axk2"
HF_ARCHITECTURE = "AXK2ForCausalLM"
# transformers' AXK2Config defaults (the MoE and MLA ones are read by keel.config's DeepSeek-style readers).
DEFAULTS: dict[str, Any] = {
    **deepseek_v32.DEFAULTS,
    "vocab_size": 163840,
    "head_dim": 64,  # declared; the class sets it to qk_rope_head_dim (keel reads that)
    "num_key_value_heads": 32,
    "max_position_embeddings": 131072,
    "bos_token_id": 163691,
    "eos_token_id": [163691],
    "intermediate_size": 5120,
    "num_experts": 128,  # HF: n_routed_experts
    "moe_intermediate_size": 512,
    "first_k_dense_replace": 1,
    "n_group": 1,  # null: no expert groups
    "topk_group": 1,
    "q_lora_rank": 384,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 32,
    "v_head_dim": 64,
    "index_n_heads": 16,
    "gated_norm_rank": 16,
}
ATTRIBUTE_MAP = deepseek_v32.ATTRIBUTE_MAP
COMPUTED_KEYS = deepseek_v32.COMPUTED_KEYS


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    if (hf.get("n_group") is None) != (hf.get("topk_group") is None):
        raise ConfigError(f"{source}: n_group and topk_group must be set together (both null: no expert groups)")
    rank = hf.get("gated_norm_rank")
    rank = int(DEFAULTS["gated_norm_rank"] if rank is None else rank)
    if rank <= 0:
        raise ConfigError(f"{source}: gated_norm_rank must be positive, got {rank}")
    return {
        **deepseek_v32.dsa_fields(hf, source, DEFAULTS),
        "mlp_only_layers": axk1.dense_layers(hf, source),
        "mla_query_gate": True,
        "gated_norm_rank": rank,
        "router_group_mask_zero": True,
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    grouped = config.n_group > 1
    return {
        **deepseek_v32.hf_fields(config, hf),
        "gated_norm_rank": config.gated_norm_rank,
        "n_group": config.n_group if grouped else None,
        "topk_group": config.topk_group if grouped else None,
    }


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """The releases' names (vLLM's layout, which transformers renames on load): the gated query's projection stored as
    `q_b_proj`, the norms' gate pair as `W_down` / `W_up`."""
    layout: dict[str, dict[str, list[tuple[int, int]] | None]] = {}
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}"
        layout[f"{prefix}.self_attn.q_b_proj.weight"] = {f"{prefix}.self_attn.q_gate_proj.weight": None}
        norms = ["input_layernorm"] + (["post_attention_layernorm"] if config.is_moe_layer(layer) else [])
        for norm in norms:
            for stored, ours in (("W_down", "fc1"), ("W_up", "fc2")):
                layout[f"{prefix}.{norm}.{stored}.weight"] = {f"{prefix}.{norm}.mlp.{ours}.weight": None}
    return layout
