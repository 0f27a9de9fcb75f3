"""BLOOM (`BloomForCausalLM`: bigscience/bloom and bloom-560m..7b1, BLOOMZ, and their fine-tunes): ALiBi in place of
any position embedding (keel's position_embedding "alibi", Bloom's slopes), a biased LayerNorm after the word
embedding (`word_embeddings_layernorm`: keel's embedding_norm with its own weight and bias), biased LayerNorms before
sequential sublayers, multi-head attention with biased projections whose q, k and v sit in one `query_key_value`
laid out per head ([heads, 3, head_dim]: each head's q, k, v rows; split at load, interleaved back on export), an
ungated tanh-GELU MLP four times the width with biases, and the head tied to the embedding. Checkpoints saved from
BloomModel (bigscience's) name their tensors without the `transformer.` prefix; both are read.
`apply_residual_connection_post_layernorm` (the normed input as the residual) is refused by name; `pretraining_tp`
with `slow_but_exact` only re-orders transformers' sums of the output projections, so it changes nothing here.
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError
from keel.families.gpt_neox import qkv_rows

FAMILY = "bloom"
HF_ARCHITECTURE = "BloomForCausalLM"
# BloomConfig's attribute_map and its keys for the common ones keel reads.
ATTRIBUTE_MAP = {
    "n_embed": "hidden_size",
    "n_head": "num_attention_heads",
    "n_layer": "num_hidden_layers",
    "layer_norm_epsilon": "rms_norm_eps",
}
# transformers' BloomConfig defaults (its layer_norm_epsilon is keel's rms_norm_eps: the norms' eps). BLOOM was
# trained on 2048 tokens; ALiBi itself has no table to bound positions.
DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 2048,
    "hidden_act": "gelu_pytorch_tanh",
    "bos_token_id": 1,
    "eos_token_id": [2],
}


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    if hf.get("apply_residual_connection_post_layernorm"):
        raise ConfigError(f"{source}: Bloom's apply_residual_connection_post_layernorm is not supported")
    return {
        "position_embedding": "alibi",
        "norm_type": "layer",
        "norm_bias": True,
        "embedding_norm": True,
        "num_kv_heads": int(hf["num_attention_heads"]),  # multi-head attention only
        "intermediate_size": 4 * int(hf["hidden_size"]),
        "hidden_act": "gelu_tanh",
        "qkv_bias": True,
        "o_bias": True,
        "mlp_bias": True,
        "mlp_gated": False,
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    arch = config.architecture
    if config.num_kv_heads != config.num_heads or config.intermediate_size != 4 * config.hidden_size:
        raise ConfigError(f"{arch}: Bloom has multi-head attention and an MLP 4 x hidden_size wide")
    if config.alibi_bias_max != 8 or config.alibi_scale != 1 or config.position_embedding != "alibi":
        raise ConfigError(f"{arch}: Bloom's ALiBi has slopes of alibi_bias_max 8, unscaled")
    return {
        "n_layer": config.num_layers,
        "n_head": config.num_heads,
        "layer_norm_epsilon": config.rms_norm_eps,
        "apply_residual_connection_post_layernorm": False,
    }


def _layout(config: Any, prefix: str) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    qkv = qkv_rows(config)

    layout: dict[str, dict[str, list[tuple[int, int]] | None]] = {
        f"{prefix}word_embeddings.weight": {"model.embed_tokens.weight": None},
    }
    for kind in ("weight", "bias"):
        layout[f"{prefix}word_embeddings_layernorm.{kind}"] = {f"model.embedding_norm.{kind}": None}
        layout[f"{prefix}ln_f.{kind}"] = {f"model.norm.{kind}": None}
    for layer in range(config.num_layers):
        src, dst = f"{prefix}h.{layer}", f"model.layers.{layer}"
        for kind in ("weight", "bias"):
            for norm in ("input_layernorm", "post_attention_layernorm"):
                layout[f"{src}.{norm}.{kind}"] = {f"{dst}.{norm}.{kind}": None}
            layout[f"{src}.self_attention.query_key_value.{kind}"] = {
                f"{dst}.self_attn.{name}.{kind}": rows for name, rows in qkv.items()
            }
            layout[f"{src}.self_attention.dense.{kind}"] = {f"{dst}.self_attn.o_proj.{kind}": None}
            layout[f"{src}.mlp.dense_h_to_4h.{kind}"] = {f"{dst}.mlp.up_proj.{kind}": None}
            layout[f"{src}.mlp.dense_4h_to_h.{kind}"] = {f"{dst}.mlp.down_proj.{kind}": None}
    return layout


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """Stored tensor -> {the HF-style (Llama) name keel reads: its rows of it, or None: all of it}: BloomModel's bare
    names first, so that an export writes BloomForCausalLM's `transformer.` ones."""
    return {**_layout(config, ""), **_layout(config, "transformer.")}
