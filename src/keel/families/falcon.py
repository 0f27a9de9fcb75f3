"""Falcon (`FalconForCausalLM`: Falcon-7B/40B/180B and their fine-tunes): biased LayerNorms, rotary over whole
heads, an ungated GELU MLP (`dense_h_to_4h` / `dense_4h_to_h`), biases on every projection where `bias`, the head
tied, and q, k and v in one `query_key_value`. Its blocks:
- `parallel_attn` (7B): attention and MLP both read one `input_layernorm` of the block's input and are added to it
  (keel's parallel_residual without a post-attention norm);
- `new_decoder_architecture` (40B, 180B): the same parallel block, with two norms `ln_attn` / `ln_mlp` (GPT-NeoX's
  parallel block; read as keel's input_layernorm / post_attention_layernorm) unless num_ln_in_parallel_attn is 1;
- neither: Llama's sequential block with LayerNorms.
`query_key_value`'s rows are grouped by key/value head: each group's query heads, then its key, then its value
(transformers' _split_heads). `multi_query` (7B) is one group, so all queries, then the key, then the value; without
it (nor the new architecture) every head is a group of its own (q, k, v per head). Falcon-RW's `alibi` replaces the
rotary embedding with ALiBi (keel's position_embedding "alibi", Bloom's slopes): transformers adds the bias before
the softmax scale, so each slope is scaled by 1/sqrt(head_dim) too (alibi_scale). Its bias is of each key's absolute
position rounded to bfloat16, keel's of the distance in float32: the same wherever the slopes are powers of two
(1, 2, 4 or 8 heads) and positions below 256, within bfloat16's rounding
elsewhere. The block combinations transformers itself cannot run are refused by name.
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError

FAMILY = "falcon"
HF_ARCHITECTURE = "FalconForCausalLM"
# FalconConfig's head_dim is a property (hidden_size / heads): not written.
COMPUTED_KEYS = ("head_dim",)
# Older Falcon config.json keys under the names keel reads.
ATTRIBUTE_MAP = {
    "n_embed": "hidden_size",
    "n_head": "num_attention_heads",
    "n_layer": "num_hidden_layers",
    "n_head_kv": "num_kv_heads",
    "layer_norm_epsilon": "rms_norm_eps",
    "activation": "hidden_act",
}
# transformers' FalconConfig defaults (its layer_norm_epsilon is keel's rms_norm_eps: the norms' eps).
DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "hidden_act": "gelu",
    "bos_token_id": 11,
    "eos_token_id": [11],
}


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    heads = int(hf["num_attention_heads"])
    new = bool(hf.get("new_decoder_architecture", False))
    parallel = bool(hf.get("parallel_attn", True))
    norms = hf.get("num_ln_in_parallel_attn")
    if new and not parallel:
        raise ConfigError(f"{source}: new_decoder_architecture without parallel_attn (transformers cannot run it)")
    if not new and parallel and norms == 2:
        raise ConfigError(f"{source}: num_ln_in_parallel_attn 2 needs new_decoder_architecture (transformers')")
    if new:
        kv_heads = int(hf.get("num_kv_heads") or heads)
    else:
        kv_heads = 1 if hf.get("multi_query", True) else heads
    bias = bool(hf.get("bias", False))
    alibi = {}
    if hf.get("alibi"):  # Falcon-RW: the bias before the softmax scale (FalconModel divides it by sqrt(head_dim))
        head_dim = int(hf["hidden_size"]) // heads
        alibi = {"position_embedding": "alibi", "alibi_scale": head_dim**-0.5}
    return {
        **alibi,
        "norm_type": "layer",
        "norm_bias": True,
        "num_kv_heads": kv_heads,
        "qkv_bias": bias,
        "o_bias": bias,
        "mlp_bias": bias,
        "mlp_gated": False,
        "intermediate_size": int(hf.get("ffn_hidden_size") or 4 * int(hf["hidden_size"])),
        "parallel_residual": parallel,
        # the new architecture's two norms by default; the parallel block's one otherwise
        "post_attention_norm": not parallel or (new and norms in (None, 2)),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
    }


def _new_architecture(config: Any) -> bool:
    """Whether the config needs Falcon's new_decoder_architecture: two norms, or key/value heads other than 1 or
    all (the old one's multi_query or not)."""
    two_norms = config.parallel_residual and config.post_attention_norm
    return two_norms or config.num_kv_heads not in (1, config.num_heads)


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    new = _new_architecture(config)
    if new and not config.parallel_residual:
        raise ConfigError(f"{config.architecture}: a sequential block has {config.num_kv_heads} KV heads (1 or all)")
    alibi = config.position_embedding == "alibi"
    if alibi and (config.alibi_bias_max != 8 or config.alibi_scale != config.head_dim**-0.5):
        raise ConfigError(f"{config.architecture}: Falcon's ALiBi has slopes of alibi_bias_max 8 over sqrt(head_dim)")
    if config.rotary_dim != config.head_dim or config.attention_scale is not None:
        raise ConfigError(f"{config.architecture}: Falcon rotates whole heads at the default softmax scale")
    if not (config.qkv_bias == config.o_bias == config.mlp_bias):
        raise ConfigError(f"{config.architecture}: Falcon's one `bias` covers every projection")
    return {
        "new_decoder_architecture": new,
        "multi_query": config.num_kv_heads == 1,
        "num_kv_heads": config.num_kv_heads,
        "parallel_attn": config.parallel_residual,
        "num_ln_in_parallel_attn": (2 if config.post_attention_norm else 1) if new else None,
        "alibi": alibi,
        "bias": config.qkv_bias,
        "ffn_hidden_size": config.intermediate_size,
        "activation": {"gelu_tanh": "gelu_pytorch_tanh"}.get(config.hidden_act, config.hidden_act),
        "layer_norm_epsilon": config.rms_norm_eps,
    }


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """Stored tensor -> {the HF-style (Llama) name keel reads: its rows of it, or None: all of it}."""
    d, groups = config.head_dim, config.num_kv_heads
    per = config.num_heads // groups  # query heads per key/value head
    group = (per + 2) * d  # rows of one group: its queries, its key, its value

    def rows(start: int, stop: int) -> list[tuple[int, int]]:  # rows [start, stop) of every group
        return [(g * group + start, g * group + stop) for g in range(groups)]

    qkv = {"q_proj": rows(0, per * d), "k_proj": rows(per * d, (per + 1) * d), "v_proj": rows((per + 1) * d, group)}
    two_norms = config.parallel_residual and config.post_attention_norm and _new_architecture(config)
    norms = {"ln_attn": "input_layernorm", "ln_mlp": "post_attention_layernorm"} if two_norms else {}
    if not two_norms:
        norms = {"input_layernorm": "input_layernorm", "post_attention_layernorm": "post_attention_layernorm"}
    layout: dict[str, dict[str, list[tuple[int, int]] | None]] = {
        "transformer.word_embeddings.weight": {"model.embed_tokens.weight": None},
    }
    for kind in ("weight", "bias"):
        layout[f"transformer.ln_f.{kind}"] = {f"model.norm.{kind}": None}
    for layer in range(config.num_layers):
        src, dst = f"transformer.h.{layer}", f"model.layers.{layer}"
        names = {
            **norms,
            "self_attention.dense": "self_attn.o_proj",
            "mlp.dense_h_to_4h": "mlp.up_proj",
            "mlp.dense_4h_to_h": "mlp.down_proj",
        }
        for kind in ("weight", "bias"):
            for stored, name in names.items():
                layout[f"{src}.{stored}.{kind}"] = {f"{dst}.{name}.{kind}": None}
            layout[f"{src}.self_attention.query_key_value.{kind}"] = {
                f"{dst}.self_attn.{name}.{kind}": r for name, r in qkv.items()
            }
    return layout
