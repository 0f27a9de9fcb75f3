"""GLM-5 (`GlmMoeDsaForCausalLM`): DeepSeek-V3.2's block (keel.families.deepseek_v32: latent attention with DeepSeek
Sparse Attention, DeepSeek-V3's experts) under GLM's config, with two changes: its indexer rotates interleaved
pairs (keel's `index_rope_interleave`), and a layer may have no indexer of its own and attend to the keys the last
full layer before it selected (cross-layer top-k sharing: `indexer_types`, "full" or "shared" per layer, else
transformers' pattern from `index_topk_pattern` ("F"/"S" per layer) or `index_topk_freq` and
`index_skip_topk_offset`). The multi-token-prediction layer after the last is not read.
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError
from keel.families import deepseek_v32

FAMILY = "glm_moe_dsa"
HF_ARCHITECTURE = "GlmMoeDsaForCausalLM"
# transformers' GlmMoeDsaConfig defaults
DEFAULTS: dict[str, Any] = {
    **deepseek_v32.DEFAULTS,
    "vocab_size": 154880,
    "num_key_value_heads": 64,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 202752,
    "intermediate_size": 12288,
    "n_group": 1,
    "topk_group": 1,
    "q_lora_rank": 2048,
    "qk_nope_head_dim": 192,
    "v_head_dim": 256,
    "index_n_heads": 32,
}
ATTRIBUTE_MAP = deepseek_v32.ATTRIBUTE_MAP
COMPUTED_KEYS = deepseek_v32.COMPUTED_KEYS


def indexer_types(hf: dict[str, Any], source: str) -> list[str]:
    """Each layer's indexer, "full" or "shared", as GlmMoeDsaConfig derives it."""
    layers = int(hf["num_hidden_layers"])
    types = hf.get("indexer_types")
    pattern = hf.get("index_topk_pattern")
    if types is None and pattern is not None:
        codes = {"F": "full", "S": "shared"}
        if isinstance(pattern, str) and not set(pattern) <= set(codes):
            raise ConfigError(f"{source}: index_topk_pattern must be F or S per layer, got {pattern!r}")
        types = [codes[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    if types is None:
        freq = max(int(hf.get("index_topk_freq") or 1), 1)
        offset = int(hf.get("index_skip_topk_offset", 2))
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]
    if len(types) != layers or not set(types) <= {"full", "shared"} or types[0] != "full":
        raise ConfigError(
            f"{source}: indexer_types must give full or shared for each of the {layers} layers, the first full"
        )
    return list(types)


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    types = indexer_types(hf, source)
    return {
        **deepseek_v32.dsa_fields(hf, source, DEFAULTS),
        "index_rope_interleave": True,
        "indexer_types": [] if set(types) == {"full"} else types,
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    types = config.indexer_types or ["full"] * config.num_layers
    return {**deepseek_v32.dsa_hf_fields(config, interleaved=True, shared=True), "indexer_types": list(types)}
