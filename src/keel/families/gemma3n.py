"""Gemma 3n, text (`Gemma3nForCausalLM`, model_type gemma3n_text; and the released `Gemma3nForConditionalGeneration`
checkpoints on text: the decoder under `model.language_model.`, the vision and audio towers and their embedders
unread). Gemma 3's block (sandwich norms, q/k norms per head, the embedding times sqrt(hidden_size), a GELU-gated MLP,
sliding layers, one in five global by default, whose RoPE has its own base `rope_local_base_freq`, a final soft-cap)
with Gemma 4's plain RMSNorm scales (weight, not 1 + weight), softmax scale 1 and values normed per head without a
weight (`v_norm`), and:

- AltUp (`altup_num_inputs` copies of the residual stream; keel's altup_num_inputs, altup_active_idx,
  altup_correct_scale: keel.model.altup);
- LAuReL (`laurel_rank`: a low-rank branch on the attention's normed input, averaged with the attention's residual
  sum by 1/sqrt(2); keel's laurel_rank);
- activation sparsity in the MLPs of the layers `activation_sparsity_pattern` names (a Gaussian top-k of the gate;
  keel's activation_sparsity);
- Gemma 4 E2B/E4B's per-layer input embeddings (keel's per_layer_input_size) and KV sharing (`num_kv_shared_layers`:
  keel's kv_shared_layers), with two differences from Gemma 4's: the per-layer input branch reads AltUp's corrected
  active copy (times `correct_output_scale`) and joins the copies after the first, and token ids past the per-layer
  table read its row 0.

`intermediate_size` may be a list, one width per layer: read where every layer's is the same.

Refused by name: `intermediate_size` of different widths per layer, an `activation_sparsity_pattern` not one value
per layer, tensor parallelism (AltUp, LAuReL, the per-layer inputs, KV sharing), pipeline stages (AltUp's copies of
the stream, the per-layer inputs), and training an AltUp model (transformers clips its coefficients while training,
`altup_coef_clip`; keel's training does not). The fused CPU layer and the compiled decode step step aside for the
modules. GGUF files (llama.cpp's `gemma3n`) are read by keel.weights.gguf.
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError
from keel.families import gemma3
from keel.families.gemma import gemma2_activation, gemma2_activation_to_hf
from keel.families.windows import sliding_layer_types

FAMILY = "gemma3n"
HF_ARCHITECTURE = "Gemma3nForCausalLM"
# transformers' Gemma3nTextConfig defaults.
DEFAULTS: dict[str, Any] = {
    "head_dim": 256,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "max_position_embeddings": 32_768,
    "bos_token_id": 2,
    "eos_token_id": [1],
}
LOCAL_ROPE_THETA = 10_000.0
SLIDING_WINDOW_PATTERN = 5  # every fifth layer global
SPARSE_LAYERS, SPARSITY = 10, 0.95  # the config class's default pattern: the first ten layers, where there are more


def upgrade_config(hf: dict[str, Any]) -> dict[str, Any]:
    """As Gemma3nTextConfig reads a file: one RoPE per layer kind from `rope_theta` and `rope_local_base_freq`
    (with `rope_scaling` on the global layers') where it has no `rope_parameters`; a list of equal MLP widths as
    one."""
    hf = dict(hf)
    if not hf.get("rope_parameters"):
        full = {"rope_type": "default", **(hf.get("rope_scaling") or {})}
        full.setdefault("rope_theta", hf.get("rope_theta", DEFAULTS["rope_theta"]))
        local = {"rope_type": "default", "rope_theta": hf.get("rope_local_base_freq", LOCAL_ROPE_THETA)}
        hf["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
        hf.pop("rope_scaling", None)
    widths = hf.get("intermediate_size")
    if isinstance(widths, list):
        if len(set(widths)) != 1:
            raise ConfigError("intermediate_size: MLPs of different widths per layer are not supported")
        hf["intermediate_size"] = widths[0]
    return hf


def _sparsity(hf: dict[str, Any], source: str) -> list[float]:
    layers = int(hf["num_hidden_layers"])
    pattern = hf.get("activation_sparsity_pattern")
    if pattern is None:
        sparse = SPARSE_LAYERS if layers > SPARSE_LAYERS else 0
        pattern = [SPARSITY] * sparse + [0.0] * (layers - sparse)
    elif not isinstance(pattern, list):
        pattern = [pattern] * layers
    if len(pattern) != layers:
        raise ConfigError(f"{source}: activation_sparsity_pattern needs one value per layer ({layers})")
    pattern = [float(s) for s in pattern]
    return pattern if any(pattern) else []


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    cap = hf.get("final_logit_softcapping", 30.0)
    return {
        "norm_placement": "sandwich",
        "qk_norm": True,
        "v_norm": True,
        "embedding_multiplier": float(hf["hidden_size"]) ** 0.5,
        "attention_scale": 1.0,
        "hidden_act": gemma2_activation(hf, source),
        "final_logit_softcapping": None if cap is None else float(cap),
        "sliding_window": int(hf.get("sliding_window") or 512),
        "layer_types": sliding_layer_types(hf, SLIDING_WINDOW_PATTERN),
        "qkv_bias": bool(hf.get("attention_bias", False)),
        "o_bias": bool(hf.get("attention_bias", False)),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
        "per_layer_input_size": int(hf.get("hidden_size_per_layer_input", 256) or 0),
        "per_layer_input_vocab_size": int(hf.get("vocab_size_per_layer_input", 262_144)),
        "kv_shared_layers": int(hf.get("num_kv_shared_layers", 15) or 0),
        "altup_num_inputs": int(hf.get("altup_num_inputs", 4)),
        "altup_active_idx": int(hf.get("altup_active_idx", 0)),
        "altup_correct_scale": bool(hf.get("altup_correct_scale", True)),
        "laurel_rank": int(hf.get("laurel_rank", 64)),
        "activation_sparsity": _sparsity(hf, source),
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {
        "model_type": "gemma3n_text",
        "hidden_activation": gemma2_activation_to_hf(config),
        "final_logit_softcapping": config.final_logit_softcapping,
        "sliding_window": config.sliding_window,
        "layer_types": list(config.layer_types),
        "attention_bias": config.qkv_bias,
        "hidden_size_per_layer_input": config.per_layer_input_size,
        "vocab_size_per_layer_input": config.ple_vocab_size,
        "num_kv_shared_layers": config.kv_shared_layers,
        "altup_num_inputs": config.altup_num_inputs,
        "altup_active_idx": config.altup_active_idx,
        "altup_correct_scale": config.altup_correct_scale,
        "laurel_rank": config.laurel_rank,
        "activation_sparsity_pattern": [config.layer_activation_sparsity(i) for i in range(config.num_layers)],
    }


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """Gemma's four block norms under keel's names (keel.families.gemma3)."""
    return gemma3.checkpoint_layout(config)
