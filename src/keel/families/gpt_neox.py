"""GPT-NeoX (`GPTNeoXForCausalLM`: Pythia, GPT-NeoX-20B, and their fine-tunes): LayerNorm with a bias,
rotary over the first `rotary_pct` of each head (0.25), the parallel residual with two norms by default,
an ungated GELU MLP with biases, biased attention projections, and its own tensor names: `gpt_neox.`
instead of `model.`, `embed_in`, `attention.dense`, `mlp.dense_h_to_4h` / `dense_4h_to_h`,
`final_layer_norm`, and q, k and v in one `attention.query_key_value` whose rows hold, per head, that
head's q, then k, then v (split at load, interleaved back on export). Older checkpoints call the head
`embed_out`; both are read.
"""

from __future__ import annotations

from typing import Any

from keel.families.rope import partial_rotary_factor, rope_settings

FAMILY = "gpt_neox"
HF_ARCHITECTURE = "GPTNeoXForCausalLM"
# transformers' GPTNeoXConfig defaults (its layer_norm_eps is keel's rms_norm_eps: the norms' eps).
DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "bos_token_id": 0,
    "eos_token_id": [2],
    "hidden_act": "gelu",
}


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    rope = rope_settings(hf)
    theta = rope.get("rope_theta", hf.get("rotary_emb_base", hf.get("rope_theta", DEFAULTS["rope_theta"])))
    parallel = bool(hf.get("use_parallel_residual", True))
    bias = bool(hf.get("attention_bias", True))
    eps = hf.get("layer_norm_eps")
    return {
        "norm_type": "layer",
        "norm_bias": True,
        "rms_norm_eps": float(DEFAULTS["rms_norm_eps"] if eps is None else eps),
        "partial_rotary_factor": partial_rotary_factor(hf, 0.25, "rotary_pct"),
        "rope_theta": float(theta),
        "qkv_bias": bias,
        "o_bias": bias,
        "mlp_bias": True,
        "mlp_gated": False,
        "parallel_residual": parallel,
        "num_kv_heads": int(hf["num_attention_heads"]),  # multi-head attention only
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {
        "layer_norm_eps": config.rms_norm_eps,
        "use_parallel_residual": config.parallel_residual,
        "attention_bias": config.qkv_bias,
        "rotary_pct": config.partial_rotary_factor,
        "rotary_emb_base": config.rope_theta,
        "rope_parameters": {**hf["rope_parameters"], "partial_rotary_factor": config.partial_rotary_factor},
    }


def qkv_rows(config: Any) -> dict[str, list[tuple[int, int]]]:
    """keel's q/k/v projections -> their rows of a fused `query_key_value` that holds each head's q, k and v in turn
    (GPT-NeoX's layout; BLOOM's, Persimmon's and multi-head GPT-BigCode's too)."""
    d, heads = config.head_dim, config.num_heads
    return {
        name: [(h * 3 * d + part * d, h * 3 * d + (part + 1) * d) for h in range(heads)]
        for part, name in enumerate(("q_proj", "k_proj", "v_proj"))
    }


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """Stored tensor -> {the HF-style (Llama) name keel reads: its rows of it, or None: all of it}."""
    qkv = qkv_rows(config)

    layout: dict[str, dict[str, list[tuple[int, int]] | None]] = {
        "gpt_neox.embed_in.weight": {"model.embed_tokens.weight": None},
        "embed_out.weight": {"lm_head.weight": None},
    }
    for kind in ("weight", "bias"):
        layout[f"gpt_neox.final_layer_norm.{kind}"] = {f"model.norm.{kind}": None}
    for layer in range(config.num_layers):
        src, dst = f"gpt_neox.layers.{layer}", f"model.layers.{layer}"
        for kind in ("weight", "bias"):
            for norm in ("input_layernorm", "post_attention_layernorm"):
                layout[f"{src}.{norm}.{kind}"] = {f"{dst}.{norm}.{kind}": None}
            layout[f"{src}.attention.query_key_value.{kind}"] = {
                f"{dst}.self_attn.{name}.{kind}": rows for name, rows in qkv.items()
            }
            layout[f"{src}.attention.dense.{kind}"] = {f"{dst}.self_attn.o_proj.{kind}": None}
            layout[f"{src}.mlp.dense_h_to_4h.{kind}"] = {f"{dst}.mlp.up_proj.{kind}": None}
            layout[f"{src}.mlp.dense_4h_to_h.{kind}"] = {f"{dst}.mlp.down_proj.{kind}": None}
    return layout
