"""GPT-BigCode (`GPTBigCodeForCausalLM`: StarCoder 1, SantaCoder, WizardCoder): GPT-2's block with learned absolute
positions (`wpe`, keel's `position_embedding` learned), biased LayerNorms before each sublayer, an ungated GELU (tanh)
MLP `c_fc` / `c_proj` with biases, a biased attention whose q, k and v sit in one `c_attn`, and the head tied to the
embedding. With `multi_query` (the default) one key/value head serves every query head and `c_attn`'s rows are all
the queries, then the key, then the value; without it each head's q, k and v rows follow each other (GPT-NeoX's
interleaving). Both are split at load and fused again on export. `attention_softmax_in_fp32` and
`scale_attention_softmax_in_fp32` are precision options of transformers' older kernels: its softmax, as keel's
attention, is float32 either way, so they are read and written back but change nothing.
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError
from keel.families.gpt_neox import qkv_rows as per_head_qkv_rows
from keel.families.parts import Transposed

Layout = dict[str, dict[str, Any]]

FAMILY = "gpt_bigcode"
HF_ARCHITECTURE = "GPTBigCodeForCausalLM"
# GPTBigCodeConfig's attribute_map, and its keys for the common ones keel reads.
ATTRIBUTE_MAP = {
    "n_embd": "hidden_size",
    "n_positions": "max_position_embeddings",
    "n_head": "num_attention_heads",
    "n_layer": "num_hidden_layers",
    "activation_function": "hidden_act",
    "layer_norm_epsilon": "rms_norm_eps",
}
# transformers' GPTBigCodeConfig defaults (its layer_norm_epsilon is keel's rms_norm_eps: the norms' eps).
DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 1024,
    "hidden_act": "gelu_pytorch_tanh",
    "bos_token_id": 50256,
    "eos_token_id": [50256],
}


def gpt2_block(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """The block GPT-2 and GPT-BigCode share: learned positions, biased LayerNorms before sequential sublayers, an
    ungated MLP n_inner wide (4 x hidden_size where null), biases everywhere, the head tied by default, the softmax
    scale 1 where `scale_attn_weights` is false."""
    if hf.get("add_cross_attention"):
        raise ConfigError(f"{source}: add_cross_attention is not supported (a decoder without an encoder only)")
    hidden = int(hf["hidden_size"])
    return {
        "position_embedding": "learned",
        "norm_type": "layer",
        "norm_bias": True,
        "qkv_bias": True,
        "o_bias": True,
        "mlp_bias": True,
        "mlp_gated": False,
        "intermediate_size": int(hf.get("n_inner") or 4 * hidden),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
        "attention_scale": None if hf.get("scale_attn_weights", True) else 1.0,
    }


def gpt2_block_hf(config: Any) -> dict[str, Any]:
    """`gpt2_block`'s keys on export."""
    if config.attention_scale not in (None, 1.0):
        raise ConfigError(f"{config.architecture}: a softmax scale other than 1/sqrt(head_dim) or 1 has no key")
    return {
        "n_inner": config.intermediate_size,
        "activation_function": {"gelu_tanh": "gelu_pytorch_tanh"}.get(config.hidden_act, config.hidden_act),
        "layer_norm_epsilon": config.rms_norm_eps,
        "scale_attn_weights": config.attention_scale is None,
    }


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    multi_query = bool(hf.get("multi_query", True))
    return {**gpt2_block(hf, source), "num_kv_heads": 1 if multi_query else int(hf["num_attention_heads"])}


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    if config.num_kv_heads not in (1, config.num_heads):
        raise ConfigError(f"{config.architecture}: {config.num_kv_heads} key/value heads (multi_query: 1, else all)")
    if config.attention_scale_by_layer:
        raise ConfigError(f"{config.architecture}: attention_scale_by_layer has no key (GPT-2's)")
    return {**gpt2_block_hf(config), "multi_query": config.num_kv_heads == 1}


def qkv_rows(config: Any) -> dict[str, list[tuple[int, int]]]:
    """keel's q/k/v projections -> their rows of the fused `c_attn`: all queries, then the key, then the value of the
    one key/value head (multi-query), or each head's q, k, v in turn."""
    d, heads = config.head_dim, config.num_heads
    if config.num_kv_heads == 1:
        q = heads * d
        return {"q_proj": [(0, q)], "k_proj": [(q, q + d)], "v_proj": [(q + d, q + 2 * d)]}
    return per_head_qkv_rows(config)


# GPT-2's names inside each block -> keel's (Llama's)
GPT2_LAYER_NAMES = {
    "ln_1": "input_layernorm",
    "ln_2": "post_attention_layernorm",
    "attn.c_proj": "self_attn.o_proj",
    "mlp.c_fc": "mlp.up_proj",
    "mlp.c_proj": "mlp.down_proj",
}


def gpt2_layout(
    config: Any, rows: dict[str, list[tuple[int, int]]], conv1d: bool = False, prefix: str = "transformer."
) -> Layout:
    """GPT-2's stored names (under `prefix`) -> keel's (Llama's); `rows`: c_attn's rows of each of q, k, v (of its
    transpose where `conv1d`: GPT-2's Conv1D weights are stored [in, out], keel.weights.parts.Transposed)."""

    def weight(part: list[tuple[int, int]] | None) -> Any:
        return Transposed(part) if conv1d else part

    layout: Layout = {
        f"{prefix}wte.weight": {"model.embed_tokens.weight": None},
        f"{prefix}wpe.weight": {"model.embed_positions.weight": None},
        f"{prefix}ln_f.weight": {"model.norm.weight": None},
        f"{prefix}ln_f.bias": {"model.norm.bias": None},
    }
    for layer in range(config.num_layers):
        src, dst = f"{prefix}h.{layer}", f"model.layers.{layer}"
        for stored, name in GPT2_LAYER_NAMES.items():
            conv = stored != "ln_1" and stored != "ln_2"
            layout[f"{src}.{stored}.weight"] = {f"{dst}.{name}.weight": weight(None) if conv else None}
            layout[f"{src}.{stored}.bias"] = {f"{dst}.{name}.bias": None}
        layout[f"{src}.attn.c_attn.weight"] = {f"{dst}.self_attn.{n}.weight": weight(r) for n, r in rows.items()}
        layout[f"{src}.attn.c_attn.bias"] = {f"{dst}.self_attn.{n}.bias": r for n, r in rows.items()}
    return layout


def checkpoint_layout(config: Any) -> Layout:
    """Stored tensor -> {the HF-style (Llama) name keel reads: its rows of it, or None: all of it}."""
    return gpt2_layout(config, qkv_rows(config))
