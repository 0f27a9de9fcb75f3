"""BitNet b1.58 (`BitNetForCausalLM`: microsoft/bitnet-b1.58-2B-4T and its -bf16 variant): Llama's block with two
sub-norms, an RMSNorm over the attention's output before o_proj (keel's `attn_sub_norm`) and one over the gated MLP's
act(gate) * up before down_proj (`ffn_sub_norm`), and a gated ReLU-squared MLP (`hidden_act` relu2).

The -bf16 release (no `quantization_config`) holds plain float weights, which transformers runs as they are.
The 1.58-bit release's `quantization_config` (quant_method bitnet: ternary weights, 4 to a byte, times a
`weight_scale`; activations quantized per token to int8 inside every linear layer) is read by keel.quant.bitnet:
this module checks its options and refuses by name what keel does not run (`use_rms_norm`: an RMSNorm inside each
layer, with weights of its own, which the releases do not use). llama.cpp's `bitnet` GGUF files (F16/F32 or ternary
TQ1_0 / TQ2_0 blocks) are read by keel.weights.gguf as AutoBitLinear offline layers; bitnet.cpp's I2_S is refused.
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError
from keel.families.llama_biases import bias_fields

FAMILY = "bitnet"
HF_ARCHITECTURE = "BitNetForCausalLM"
# transformers' BitNetConfig defaults.
DEFAULTS: dict[str, Any] = {
    "hidden_size": 2560,
    "intermediate_size": 6912,
    "num_hidden_layers": 30,
    "num_attention_heads": 20,
    "num_key_value_heads": 5,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 2048,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "relu2",
    "tie_word_embeddings": False,
}
LINEAR_CLASSES = ("bitlinear", "autobitlinear")
MODES = ("offline", "online")


def check_quantization(quant: Any, source: str) -> dict[str, Any]:
    """The bitnet `quantization_config` as keel runs it ({linear_class, quantization_mode, modules_to_not_convert});
    a one-line ConfigError naming the option keel does not run."""
    if not isinstance(quant, dict) or quant.get("quant_method") != "bitnet":
        method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else "unknown"
        raise ConfigError(f"{source}: BitNet quantization {method!r} is not supported (bitnet or none)")
    linear = quant.get("linear_class", "bitlinear")
    mode = quant.get("quantization_mode", "offline")
    if linear not in LINEAR_CLASSES:
        raise ConfigError(f"{source}: quantization_config linear_class {linear!r} is not one of {LINEAR_CLASSES}")
    if mode not in MODES:
        raise ConfigError(f"{source}: quantization_config quantization_mode {mode!r} is not one of {MODES}")
    if quant.get("use_rms_norm"):
        raise ConfigError(f"{source}: quantization_config use_rms_norm (a norm inside each BitLinear) is not supported")
    skip = quant.get("modules_to_not_convert") or []
    if not isinstance(skip, list) or not all(isinstance(m, str) for m in skip):
        raise ConfigError(f"{source}: quantization_config modules_to_not_convert must be a list of module names")
    return {"linear_class": linear, "quantization_mode": mode, "modules_to_not_convert": list(skip)}


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    quant = hf.get("quantization_config")
    if quant:
        check_quantization(quant, source)
    return {"attn_sub_norm": True, "ffn_sub_norm": True, **bias_fields(hf)}


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {"attention_bias": config.qkv_bias}
