"""BioGPT (`BioGptForCausalLM`: microsoft/biogpt, BioGPT-Large): fairseq's decoder with learned absolute positions
whose table starts at row 2 (`embed_positions` of max_position_embeddings + 2 rows: keel's position_offset 2), the
token embedding times sqrt(hidden_size) where `scale_embedding` (keel's embedding_multiplier), biased LayerNorms
before each sublayer and a final one, multi-head attention with biases on q/k/v and `out_proj`, an ungated biased
MLP `fc1` / `fc2` (`hidden_act`, GELU by default) and an unbiased head `output_projection`, tied by default.
The norms' eps is torch's default 1e-5 whatever `layer_norm_eps` says: BioGptConfig has the key, but its model
builds its LayerNorms without it (read as transformers runs it: ignored).
"""

from __future__ import annotations

from typing import Any

from keel.families import fairseq

FAMILY = "biogpt"
HF_ARCHITECTURE = "BioGptForCausalLM"
# transformers' BioGptConfig defaults.
DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 1024,
    "hidden_act": "gelu",
    "bos_token_id": 0,
    "eos_token_id": [2],
    "pad_token_id": 1,
}


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    return {**fairseq.block_fields(hf), "position_embedding": "learned"}


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {"scale_embedding": fairseq.scale_embedding(config, "BioGPT"), "layer_norm_eps": fairseq.LAYER_NORM_EPS}


def checkpoint_layout(config: Any) -> dict[str, dict[str, None]]:
    """BioGPT's stored names -> keel's (Llama's)."""
    return {
        "biogpt.embed_tokens.weight": {"model.embed_tokens.weight": None},
        "biogpt.embed_positions.weight": {"model.embed_positions.weight": None},
        "output_projection.weight": {"lm_head.weight": None},
        **fairseq.layer_layout(config, "biogpt"),
    }
