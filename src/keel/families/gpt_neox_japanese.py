"""GPT-NeoX-Japanese (`GPTNeoXJapaneseForCausalLM`: ABEJA's gpt-neox-japanese-2.7b): GPT-NeoX's tensor layout
(q, k and v per head in one `attention.query_key_value`, keel.families.gpt_neox.qkv_rows) under the
`gpt_neox_japanese.` prefix, with its own block: a sequential residual (not GPT-NeoX's parallel one) with biased
LayerNorms, no biases on q/k/v, the attention output or the MLP, but one on the last layer's attention output
(`attention.dense_bias`, added before the residual: keel's o_proj bias of that layer alone, `o_bias_layers`), an
ungated GELU MLP hidden_size x `intermediate_multiple_size` wide, rotary over `rotary_pct` of each head (1.0 by
default) at base `rotary_emb_base`. Its tokenizer (GPTNeoXJapaneseTokenizer: vocab.txt and emoji.json) is not one
the `tokenizers` library reads: serving needs a tokenizer.json beside the weights.
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError
from keel.families.gpt_neox import qkv_rows
from keel.families.rope import partial_rotary_factor, rope_settings

FAMILY = "gpt_neox_japanese"
HF_ARCHITECTURE = "GPTNeoXJapaneseForCausalLM"
# transformers' GPTNeoXJapaneseConfig defaults (its layer_norm_eps is keel's rms_norm_eps: the norms' eps).
DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "bos_token_id": 31996,
    "eos_token_id": [31999],
    "hidden_act": "gelu",
    "vocab_size": 32000,
    "num_attention_heads": 32,
}
PREFIX = "gpt_neox_japanese"


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    rope = rope_settings(hf)
    theta = rope.get("rope_theta", hf.get("rotary_emb_base", hf.get("rope_theta", DEFAULTS["rope_theta"])))
    eps = hf.get("layer_norm_eps")
    hidden, layers = int(hf["hidden_size"]), int(hf["num_hidden_layers"])
    multiple = hf.get("intermediate_multiple_size", 4)
    if not isinstance(multiple, int | float) or int(hidden * multiple) <= 0:
        raise ConfigError(f"{source}: intermediate_multiple_size must be a positive number, got {multiple!r}")
    return {
        "norm_type": "layer",
        "norm_bias": True,
        "rms_norm_eps": float(DEFAULTS["rms_norm_eps"] if eps is None else eps),
        "partial_rotary_factor": partial_rotary_factor(hf, 1.0, "rotary_pct"),
        "rope_theta": float(theta),
        "intermediate_size": int(hidden * multiple),  # transformers' int(hidden_size * intermediate_multiple_size)
        "qkv_bias": False,
        "o_bias": False,
        "o_bias_layers": [layers - 1],  # the last layer's attention `dense_bias`
        "mlp_bias": False,
        "mlp_gated": False,
        "parallel_residual": False,
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),  # the config class's default
        "num_kv_heads": int(hf.get("num_attention_heads", DEFAULTS["num_attention_heads"])),  # multi-head only
        # transformers' heads: hidden_size / num_attention_heads, whatever a head_dim key says
        "head_dim": hidden // int(hf.get("num_attention_heads", DEFAULTS["num_attention_heads"])),
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    if config.o_bias or config.o_bias_layers != [config.num_layers - 1]:
        raise ConfigError("gpt_neox_japanese: only the last layer's attention output has a bias (o_bias_layers)")
    if config.intermediate_size % config.hidden_size:
        raise ConfigError(
            f"gpt_neox_japanese: intermediate_size ({config.intermediate_size}) must be a multiple of hidden_size "
            f"({config.hidden_size}) (its config holds intermediate_multiple_size)"
        )
    return {
        "layer_norm_eps": config.rms_norm_eps,
        "intermediate_multiple_size": config.intermediate_size // config.hidden_size,
        "rotary_pct": config.partial_rotary_factor,
        "rotary_emb_base": config.rope_theta,
        "rope_parameters": {**hf["rope_parameters"], "partial_rotary_factor": config.partial_rotary_factor},
    }


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """Stored tensor -> {the HF-style (Llama) name keel reads: its rows of it, or None: all of it}."""
    qkv = qkv_rows(config)
    layout: dict[str, dict[str, list[tuple[int, int]] | None]] = {
        f"{PREFIX}.embed_in.weight": {"model.embed_tokens.weight": None},
        "embed_out.weight": {"lm_head.weight": None},
    }
    for kind in ("weight", "bias"):
        layout[f"{PREFIX}.final_layer_norm.{kind}"] = {f"model.norm.{kind}": None}
    for layer in range(config.num_layers):
        src, dst = f"{PREFIX}.layers.{layer}", f"model.layers.{layer}"
        for kind in ("weight", "bias"):
            for norm in ("input_layernorm", "post_attention_layernorm"):
                layout[f"{src}.{norm}.{kind}"] = {f"{dst}.{norm}.{kind}": None}
        layout[f"{src}.attention.query_key_value.weight"] = {
            f"{dst}.self_attn.{name}.weight": rows for name, rows in qkv.items()
        }
        layout[f"{src}.attention.dense.weight"] = {f"{dst}.self_attn.o_proj.weight": None}
        layout[f"{src}.attention.dense_bias"] = {f"{dst}.self_attn.o_proj.bias": None}
        layout[f"{src}.mlp.dense_h_to_4h.weight"] = {f"{dst}.mlp.up_proj.weight": None}
        layout[f"{src}.mlp.dense_4h_to_h.weight"] = {f"{dst}.mlp.down_proj.weight": None}
    return layout
