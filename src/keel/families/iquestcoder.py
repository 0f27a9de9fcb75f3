"""IQuest-Coder-V1 (`IQuestCoderForCausalLM`, model_type iquestcoder): Llama's model, which transformers runs it on,
with a config class of its own defaults (head_dim 128 whatever the width). Known by its model_type: transformers saves
it with `LlamaForCausalLM` in `architectures`. `clip_qkv` and `use_sliding_window`, options of the original code that
no release enables and transformers refuses, are refused by name.
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError
from keel.families.llama_biases import bias_fields, bias_keys

FAMILY = "iquestcoder"
HF_ARCHITECTURE = "IQuestCoderForCausalLM"
MODEL_TYPE = "iquestcoder"
# transformers' IQuestCoderConfig defaults.
DEFAULTS: dict[str, Any] = {
    "head_dim": 128,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 131072,
    "bos_token_id": 1,
    "eos_token_id": [2],
}


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    if hf.get("clip_qkv") is not None:
        raise ConfigError(f"{source}: clip_qkv {hf['clip_qkv']!r} is not supported (IQuest-Coder)")
    if hf.get("use_sliding_window"):
        raise ConfigError(f"{source}: use_sliding_window {hf['use_sliding_window']!r} is not supported (IQuest-Coder)")
    return bias_fields(hf)


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return bias_keys(config)
