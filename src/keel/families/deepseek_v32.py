"""DeepSeek-V3.2 (`DeepseekV32ForCausalLM`): DeepSeek-V3's block (multi-head latent attention with the low-rank
query, always on interleaved rotary pairs; DeepSeek-V3's experts, the first `first_k_dense_replace` layers dense
unless `mlp_layer_types` lists them) with DeepSeek Sparse Attention in every layer: a lightning indexer (keel.model.dsa:
`index_n_heads` heads of `index_head_dim`, its rotary on halves) picks the `index_topk` keys each query attends to.
keel.config reads the latent attention and the experts as DeepSeek-V3's; the multi-token-prediction layer after the
last (transformers ignores it on load) is not read.
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError
from keel.families.layer_kinds import dense_layers, mlp_layer_types

FAMILY = "deepseek_v32"
HF_ARCHITECTURE = "DeepseekV32ForCausalLM"
# transformers' DeepseekV32Config defaults (the MoE and MLA ones are read by keel.config's DeepSeek-style readers).
DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280,
    "head_dim": 64,  # the rotary width (keel reads qk_rope_head_dim)
    "num_key_value_heads": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 163840,
    "bos_token_id": 0,
    "eos_token_id": [1],
    "intermediate_size": 18432,
    "num_experts": 256,  # HF: n_routed_experts
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 2048,
    "norm_topk_prob": True,
    "n_shared_experts": 1,
    "first_k_dense_replace": 3,
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "rope_interleave": True,
    "index_topk": 2048,
    "index_head_dim": 128,
    "index_n_heads": 64,
}
ATTRIBUTE_MAP = {"num_local_experts": "n_routed_experts"}
# Its config class has no rope_interleave (the latent attention always rotates interleaved pairs): not written.
COMPUTED_KEYS = ("rope_interleave",)


def dsa_fields(hf: dict[str, Any], source: str, defaults: dict[str, Any]) -> dict[str, Any]:
    """The DSA layers' and the block's fields, shared with GLM-5 (keel.families.glm_moe_dsa)."""
    if "q_lora_rank" in hf and hf["q_lora_rank"] is None:
        raise ConfigError(
            f"{source}: q_lora_rank null (a full-rank q_proj) is not supported (the indexer reads the query latent)"
        )
    layers = int(hf["num_hidden_layers"])
    kinds = hf.get("layer_types") or ["indexed_attention"] * layers
    if list(kinds) != ["indexed_attention"] * layers:
        raise ConfigError(f"{source}: layer_types must be indexed_attention for each of the {layers} layers")
    first = hf.get("first_k_dense_replace")
    fields = {
        "mlp_only_layers": dense_layers(hf, source, first_dense=int(first if first is not None else 3)),
        # DeepSeek-V3's attention_bias: q_a_proj, kv_a_proj_with_mqa and o_proj
        "o_bias": bool(hf.get("attention_bias", False)),
        "rope_interleave": True,
        "layer_types": ["full_attention"] * layers,  # HF's "indexed_attention": keel's index_topk says the rest
    }
    for key in ("index_topk", "index_n_heads", "index_head_dim"):
        value = hf.get(key)
        fields[key] = int(defaults[key] if value is None else value)
        if fields[key] <= 0:
            raise ConfigError(f"{source}: {key} must be positive, got {fields[key]}")
    return fields


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    return dsa_fields(hf, source, DEFAULTS)


def dsa_hf_fields(config: Any, interleaved: bool, shared: bool) -> dict[str, Any]:
    """The keys `dsa_fields` reads, refusing what the family's config cannot hold: an indexer rotating the other
    way (`index_rope_interleave`), or shared selections where its layers all have an indexer (`indexer_types`)."""
    if config.index_rope_interleave != interleaved:
        raise ConfigError(
            f"{config.architecture}: index_rope_interleave {config.index_rope_interleave} cannot be written (its "
            "indexer's rotary is fixed)"
        )
    if not shared and "shared" in config.indexer_types:
        raise ConfigError(f"{config.architecture}: indexer_types with shared layers cannot be written (no config key)")
    return {
        "mlp_layer_types": mlp_layer_types(config),
        "attention_bias": config.o_bias,
        "index_topk": config.index_topk,
        "index_n_heads": config.index_n_heads,
        "index_head_dim": config.index_head_dim,
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return dsa_hf_fields(config, interleaved=False, shared=False)
