"""Persimmon (`PersimmonForCausalLM`: adept/persimmon-8b-base and -chat, and Fuyu's decoder): a sequential pre-norm
block with biased LayerNorms (`layer_norm_eps`), multi-head attention whose q, k and v are stored in one biased
`query_key_value` with, per head, that head's q, then k, then v (GPT-NeoX's layout: split at load, interleaved back on
export), LayerNorms over each head of q and k with one weight and bias shared by the heads (`qk_layernorm`: keel's
qk_norm_type "layer", qk_norm_bias), rotary over the first half of each head by default, and an ungated biased MLP of
ReLU squared (`hidden_act` relu2: `dense_h_to_4h`, `dense_4h_to_h`). Its other names: `self_attn.dense` (keel's
o_proj) and `final_layernorm`.
"""

from __future__ import annotations

from typing import Any

from keel.families.gpt_neox import qkv_rows
from keel.families.rope import partial_rotary_factor

FAMILY = "persimmon"
HF_ARCHITECTURE = "PersimmonForCausalLM"
# transformers' PersimmonConfig defaults (its layer_norm_eps is keel's rms_norm_eps: the norms' eps).
DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 16384,
    "bos_token_id": 1,
    "eos_token_id": [2],
    "hidden_act": "relu2",
}
ROTARY_SHARE = 0.5  # PersimmonConfig's partial_rotary_factor


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    eps = hf.get("layer_norm_eps")
    qk_norm = bool(hf.get("qk_layernorm", True))
    return {
        "norm_type": "layer",
        "norm_bias": True,
        "rms_norm_eps": float(DEFAULTS["rms_norm_eps"] if eps is None else eps),
        "partial_rotary_factor": partial_rotary_factor(hf, ROTARY_SHARE),
        "qkv_bias": True,
        "o_bias": True,
        "mlp_bias": True,
        "mlp_gated": False,
        "qk_norm": qk_norm,
        "qk_norm_type": "layer",
        "qk_norm_bias": qk_norm,
        "num_kv_heads": int(hf["num_attention_heads"]),  # multi-head attention only
        "head_dim": int(hf["hidden_size"]) // int(hf["num_attention_heads"]),
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {
        "layer_norm_eps": config.rms_norm_eps,
        "qk_layernorm": config.qk_norm,
        "rope_parameters": {**hf["rope_parameters"], "partial_rotary_factor": config.partial_rotary_factor},
    }


# Keys Persimmon's config class does not have (its heads give both): not written.
COMPUTED_KEYS = ("head_dim", "num_key_value_heads")


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """Stored tensor -> {the HF-style (Llama) name keel reads: its rows of it, or None: all of it}."""
    qkv = qkv_rows(config)

    layout: dict[str, dict[str, list[tuple[int, int]] | None]] = {}
    for kind in ("weight", "bias"):
        layout[f"model.final_layernorm.{kind}"] = {f"model.norm.{kind}": None}
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}"
        for kind in ("weight", "bias"):
            layout[f"{p}.self_attn.query_key_value.{kind}"] = {
                f"{p}.self_attn.{name}.{kind}": rows for name, rows in qkv.items()
            }
            layout[f"{p}.self_attn.dense.{kind}"] = {f"{p}.self_attn.o_proj.{kind}": None}
            layout[f"{p}.mlp.dense_h_to_4h.{kind}"] = {f"{p}.mlp.up_proj.{kind}": None}
            layout[f"{p}.mlp.dense_4h_to_h.{kind}"] = {f"{p}.mlp.down_proj.{kind}": None}
            if config.qk_norm:
                for hf_norm, norm in (("q_layernorm", "q_norm"), ("k_layernorm", "k_norm")):
                    layout[f"{p}.self_attn.{hf_norm}.{kind}"] = {f"{p}.self_attn.{norm}.{kind}": None}
    return layout
