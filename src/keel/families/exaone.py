"""EXAONE 3.0 / 3.5 (`ExaoneForCausalLM`, model_type exaone): Llama's model, which transformers runs it on, under
GPT-2-style tensor names (`transformer.h.N.attn.attention.q_proj`, `ln_1`, `mlp.c_fc_0`, ...; read under Llama's
and written back under EXAONE's) and config keys of its own (`num_layers`, `layer_norm_epsilon`,
`activation_function`). Known by its model_type: transformers saves it with `LlamaForCausalLM` in `architectures`.
"""

from __future__ import annotations

from typing import Any

from keel.families.llama_biases import bias_fields, bias_keys

FAMILY = "exaone"
HF_ARCHITECTURE = "ExaoneForCausalLM"
MODEL_TYPE = "exaone"
# ExaoneConfig's attribute_map.
ATTRIBUTE_MAP = {
    "num_layers": "num_hidden_layers",
    "layer_norm_epsilon": "rms_norm_eps",
    "activation_function": "hidden_act",
}
# transformers' ExaoneConfig defaults (a LlamaConfig's, some of them its own).
DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500_000.0,
    "max_position_embeddings": 4096,
    "bos_token_id": 1,
    "eos_token_id": [361],
}
# EXAONE's name -> Llama's, inside each layer.
_LAYER_NAMES = {
    "attn.attention.q_proj": "self_attn.q_proj",
    "attn.attention.k_proj": "self_attn.k_proj",
    "attn.attention.v_proj": "self_attn.v_proj",
    "attn.attention.out_proj": "self_attn.o_proj",
    "ln_1": "input_layernorm",
    "ln_2": "post_attention_layernorm",
    "mlp.c_fc_0": "mlp.gate_proj",
    "mlp.c_fc_1": "mlp.up_proj",
    "mlp.c_proj": "mlp.down_proj",
}


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    return bias_fields(hf)


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return bias_keys(config)


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """EXAONE's names -> keel's (Llama's): every tensor renamed, none split."""
    layout: dict[str, dict[str, list[tuple[int, int]] | None]] = {
        "transformer.wte.weight": {"model.embed_tokens.weight": None},
        "transformer.ln_f.weight": {"model.norm.weight": None},
    }
    for layer in range(config.num_layers):
        for stored, name in _LAYER_NAMES.items():
            for kind in ("weight", "bias"):
                layout[f"transformer.h.{layer}.{stored}.{kind}"] = {f"model.layers.{layer}.{name}.{kind}": None}
    return layout
