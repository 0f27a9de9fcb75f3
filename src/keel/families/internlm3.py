"""InternLM3 (`InternLM3ForCausalLM`, model_type internlm3): Llama's model, which transformers runs it on, with its
config class's defaults (head_dim 128 whatever the width, two KV heads) and biases under its own names (`qkv_bias`
for q/k/v, `bias` for the output projection and the MLP; transformers, and so keel, runs only the two alike). Its
releases scale rope `dynamic`ally (keel.config.RopeScaling: served within max_position_embeddings). Known by its
model_type: transformers saves it with `LlamaForCausalLM` in `architectures`.
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError
from keel.families.llama_biases import bias_fields, bias_keys

FAMILY = "internlm3"
HF_ARCHITECTURE = "InternLM3ForCausalLM"
MODEL_TYPE = "internlm3"
# InternLM3Config's attribute_map.
ATTRIBUTE_MAP = {"qkv_bias": "attention_bias", "bias": "mlp_bias"}
# transformers' InternLM3Config defaults.
DEFAULTS: dict[str, Any] = {
    "head_dim": 128,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 32768,
    "bos_token_id": 1,
    "eos_token_id": [2],
}


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    biases = bias_fields(hf)
    if biases["qkv_bias"] != biases["mlp_bias"]:
        raise ConfigError(
            f"{source}: qkv_bias {biases['qkv_bias']} with bias {biases['mlp_bias']} is not supported (InternLM3)"
        )
    return biases


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return bias_keys(config)
