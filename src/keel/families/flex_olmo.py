"""FlexOlmo (`FlexOlmoForCausalLM`): OLMo 2's block (norms on each sublayer's output, RMSNorms over the whole q and
k projections before the rotary embedding; its `post_attention_layernorm` / `post_feedforward_layernorm` read as
keel's output norms) with OLMoE's experts in every layer (a softmax router, the top `num_experts_per_tok` of
`num_experts`, renormalised where `norm_topk_prob`). No `clip_qkv` (its attention is OLMo 2's: not read).
"""

from __future__ import annotations

from typing import Any

from keel.families import olmo2, olmoe

FAMILY = "flex_olmo"
HF_ARCHITECTURE = "FlexOlmoForCausalLM"
# transformers' FlexOlmoConfig defaults.
DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-6,
    "rope_theta": 500000.0,
    "max_position_embeddings": 4096,
    "bos_token_id": None,
    "eos_token_id": [100257],
}


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    return {**olmoe.moe_fields(hf, experts=7, per_token=5, width=11008), "norm_placement": "post"}


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return olmoe.moe_hf_fields(config)


checkpoint_layout = olmo2.checkpoint_layout
