"""GPT-J (`GPTJForCausalLM`: GPT-J-6B and its fine-tunes): one biased LayerNorm `ln_1` feeding a parallel residual
(x + attn(norm(x)) + mlp(norm(x))), q/k/v and `out_proj` without biases, an ungated GELU MLP `fc_in` / `fc_out` with
biases (`gelu_new`, the tanh approximation), an untied LM head with a bias, and rotary (theta 10000, no scaling) over
the first `rotary_dim` channels of each head (all of it where null) on interleaved pairs: channels (2i, 2i + 1)
rotate together at frequency i. keel's rotary pairs channel i with i + rotary / 2, so q's and k's rotary rows are
read with each head's even rotary channels first, then its odd ones, and written back interleaved on export
(keel.families.rope.interleaved_qk_layout). The causal-mask buffers older files hold (`attn.bias`,
`attn.masked_bias`) are left unread.
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError
from keel.families.gpt_bigcode import ATTRIBUTE_MAP as ATTRIBUTE_MAP  # GPTJConfig's is GPT-2's
from keel.families.rope import interleaved_qk_layout

FAMILY = "gptj"
HF_ARCHITECTURE = "GPTJForCausalLM"
# transformers' GPTJConfig defaults (its layer_norm_epsilon is keel's rms_norm_eps: the norms' eps).
DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "hidden_act": "gelu_new",
    "bos_token_id": 50256,
    "eos_token_id": [50256],
}


def upgrade_config(hf: dict[str, Any]) -> dict[str, Any]:
    """GPTJConfig reads no rope keys (its sinusoids' theta is 10000, unscaled): any a file has go unread."""
    return {key: value for key, value in hf.items() if key not in ("rope_parameters", "rope_scaling", "rope_theta")}


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    head_dim = hidden // heads
    rotary = hf.get("rotary_dim")
    rotary = head_dim if rotary is None else int(rotary)
    factor = rotary / head_dim
    if not 0 < rotary <= head_dim or int(head_dim * factor) != rotary:
        raise ConfigError(f"{source}: rotary_dim {rotary} is not a width keel can rotate of a {head_dim}-wide head")
    return {
        "head_dim": head_dim,
        "num_kv_heads": heads,  # multi-head attention only
        "partial_rotary_factor": factor,
        "norm_type": "layer",
        "norm_bias": True,
        "parallel_residual": True,
        "post_attention_norm": False,
        "qkv_bias": False,
        "o_bias": False,
        "mlp_bias": True,
        "mlp_gated": False,
        "intermediate_size": int(hf.get("n_inner") or 4 * hidden),
        "lm_head_bias": True,
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    if config.num_kv_heads != config.num_heads or config.head_dim * config.num_heads != config.hidden_size:
        raise ConfigError(f"{config.architecture}: GPT-J has multi-head attention of hidden_size / heads wide heads")
    if config.rope_theta != 10000.0 or config.rope_scaling.type != "default":
        raise ConfigError(f"{config.architecture}: GPT-J's rotary has theta 10000 and no scaling (no key for others)")
    return {
        "n_inner": config.intermediate_size,
        "rotary_dim": config.rotary_dim,
        "activation_function": {"gelu_tanh": "gelu_new"}.get(config.hidden_act, config.hidden_act),
        "layer_norm_epsilon": config.rms_norm_eps,
    }


# GPT-J's names inside each block -> keel's (Llama's)
_LAYER_NAMES = {
    "ln_1": "input_layernorm",
    "attn.out_proj": "self_attn.o_proj",
    "attn.v_proj": "self_attn.v_proj",
    "mlp.fc_in": "mlp.up_proj",
    "mlp.fc_out": "mlp.down_proj",
}


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """GPT-J's own names -> keel's, q's and k's rotary rows regrouped (the module doc)."""
    layout: dict[str, dict[str, list[tuple[int, int]] | None]] = {
        "transformer.wte.weight": {"model.embed_tokens.weight": None},
        "transformer.ln_f.weight": {"model.norm.weight": None},
        "transformer.ln_f.bias": {"model.norm.bias": None},
    }
    qk = interleaved_qk_layout(config)
    for layer in range(config.num_layers):
        src, dst = f"transformer.h.{layer}", f"model.layers.{layer}"
        for stored, name in _LAYER_NAMES.items():
            layout[f"{src}.{stored}.weight"] = {f"{dst}.{name}.weight": None}
            if stored != "attn.out_proj" and stored != "attn.v_proj":
                layout[f"{src}.{stored}.bias"] = {f"{dst}.{name}.bias": None}
        for proj in ("q_proj", "k_proj"):
            layout[f"{src}.attn.{proj}.weight"] = qk[f"{dst}.self_attn.{proj}.weight"]
    return layout
