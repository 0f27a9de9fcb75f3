"""`keel inspect`: a checkpoint's structure, parameter counts, bytes by dtype, and provenance."""

from __future__ import annotations

import json
from typing import Any

from keel.config import ModelConfig
from keel.weights.checkpoint import Checkpoint

# Shown in this order; other ModelConfig fields only when they differ from "off".
_MAIN_FIELDS = [
    "architecture",
    "num_layers",
    "hidden_size",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "tie_word_embeddings",
    "qkv_bias",
    "o_bias",
    "mlp_bias",
    "qk_norm",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "rope_interleave",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "shared_expert_intermediate_size",
    "decoder_sparse_step",
    "mlp_only_layers",
    "shared_expert_gated",
    "router_scoring",
    "router_bias",
    "n_group",
    "topk_group",
    "router_group_score",
    "routed_scaling_factor",
    "norm_type",
    "norm_bias",
    "hidden_act",
    "mlp_gated",
    "parallel_residual",
    "partial_rotary_factor",
    "sliding_window",
    "rope_theta",
    "rope_scaling",
    "rms_norm_eps",
    "max_position_embeddings",
    "bos_token_id",
    "eos_token_id",
    "dtype",
]
_MOE_ONLY = {
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "shared_expert_intermediate_size",
    "decoder_sparse_step",
    "mlp_only_layers",
}
_MLA_ONLY = {"q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_interleave"}
# DeepSeek's router; shown for sigmoid routers and for grouped or scaled ones (DeepSeek-V2's softmax router).
_DEEPSEEK_ROUTER_ONLY = {
    "shared_expert_gated",
    "router_scoring",
    "router_bias",
    "n_group",
    "topk_group",
    "router_group_score",
    "routed_scaling_factor",
}


def _deepseek_router(config: ModelConfig) -> bool:
    return config.router_scoring == "sigmoid" or config.n_group > 1 or config.routed_scaling_factor != 1.0


def _human(n: float, unit: str = "") -> str:
    for suffix in ("", "K", "M", "G", "T"):
        if abs(n) < 1000:
            return f"{n:.1f}{suffix}{unit}" if suffix else f"{int(n)}{unit}"
        n /= 1000
    return f"{n:.1f}P{unit}"


def describe(checkpoint: Checkpoint) -> dict[str, Any]:
    config = checkpoint.config
    fields = {}
    for name in _MAIN_FIELDS:
        if name in _MOE_ONLY and not config.is_moe or name in _MLA_ONLY and not config.is_mla:
            continue
        if name in _DEEPSEEK_ROUTER_ONLY and not (config.is_moe and _deepseek_router(config)):
            continue
        value = getattr(config, name)
        if name == "rope_scaling":
            value = {"type": value.type, "factor": value.factor} if value.type != "default" else "none"
        fields[name] = {"value": value, "source": checkpoint.provenance.get(name, "read")}
    return {
        "path": str(checkpoint.path),
        "format": checkpoint.format,
        "fields": fields,
        "layer_types": sorted(set(config.layer_types)),
        "parameters": config.param_counts(),
        "bytes_by_dtype": dict(sorted(checkpoint.bytes_by_dtype.items())),
        "tokenizer": checkpoint.tokenizer is not None,
        "chat_template": bool(checkpoint.tokenizer and checkpoint.tokenizer.chat_template),
    }


def format_text(info: dict[str, Any]) -> str:
    lines = [f"model:  {info['path']}", f"format: {info['format']}", ""]
    lines.append(f"{'field':<34} {'value':<24} source")
    for name, entry in info["fields"].items():
        lines.append(f"{name:<34} {json.dumps(entry['value']):<24} {entry['source']}")
    params = info["parameters"]
    lines += [
        "",
        f"parameters: {params['total']:,} total ({_human(params['total'])}), "
        f"{params['active']:,} active per token ({_human(params['active'])}), "
        f"{params['embedding']:,} in embeddings/head",
        "bytes on disk by dtype: "
        + ", ".join(f"{k} {_human(v, 'B')}" for k, v in info["bytes_by_dtype"].items())
        + f" (total {_human(sum(info['bytes_by_dtype'].values()), 'B')})",
        f"tokenizer: {'yes' if info['tokenizer'] else 'no'}; chat template: {'yes' if info['chat_template'] else 'no'}",
    ]
    sources = {e["source"] for e in info["fields"].values()}
    if sources - {"read"}:
        lines.append(
            "sources: read = config.json/GGUF metadata, inferred = tensor shapes, "
            "hint = --head-dim/--num-heads, default = not recoverable, family default used"
        )
    return "\n".join(lines)
