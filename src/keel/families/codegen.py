"""CodeGen (`CodeGenForCausalLM`: Salesforce codegen-350M … 16B, -mono / -multi / -nl, and CodeGen 2's 1B-7B): GPT-J's
block (keel.families.gptj: one biased LayerNorm feeding a parallel residual, rotary on interleaved pairs over the
first `rotary_dim` channels of each head, unbiased attention, a biased GELU MLP, a biased LM head) with q, k and v in
one `attn.qkv_proj` laid out for the 4 model-parallel shards CodeGen was trained on: its rows are 4 blocks, each
holding its quarter of the queries, then of the values, then of the keys. They are read as keel's q_proj, k_proj and
v_proj by rows (q's and k's rotary rows regrouped as GPT-J's are) and fused again on export.

A null `rotary_dim` (transformers then builds sinusoids over hidden_size, not a head's width) is refused by name.
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError
from keel.families import gptj
from keel.families.gpt_bigcode import ATTRIBUTE_MAP as ATTRIBUTE_MAP  # CodeGenConfig's is GPT-2's
from keel.families.rope import interleaved_rotary_rows

FAMILY = "codegen"
HF_ARCHITECTURE = "CodeGenForCausalLM"
# transformers' CodeGenConfig defaults (its layer_norm_epsilon is keel's rms_norm_eps: the norms' eps).
DEFAULTS: dict[str, Any] = dict(gptj.DEFAULTS)
ROTARY_DIM = 64
MP_NUM = 4  # the model-parallel shards of the fused q/v/k projection

upgrade_config = gptj.upgrade_config


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    if "rotary_dim" in hf and hf["rotary_dim"] is None:
        raise ConfigError(f"{source}: rotary_dim null (rotary over hidden_size channels) is not supported")
    hidden = int(hf["hidden_size"])
    if hidden % MP_NUM:
        raise ConfigError(f"{source}: hidden_size {hidden} must be a multiple of CodeGen's {MP_NUM} shards")
    return gptj.config_fields({**hf, "rotary_dim": int(hf.get("rotary_dim") or ROTARY_DIM)}, source)


hf_fields = gptj.hf_fields


def _shard_rows(config: Any, part: int, channels: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The stored rows of `channels` (ranges of q's, k's or v's own rows) of `part` (0: q, 1: v, 2: k) in qkv_proj:
    channel c lies in shard c // L at row shard * 3L + part * L + c % L (L = hidden_size / 4)."""
    local = config.hidden_size // MP_NUM
    rows: list[tuple[int, int]] = []
    for a, b in channels:
        for c in range(a, b):
            row = (c // local) * 3 * local + part * local + c % local
            if rows and rows[-1][1] == row:
                rows[-1] = (rows[-1][0], row + 1)
            else:
                rows.append((row, row + 1))
    return rows


def checkpoint_layout(config: Any) -> dict[str, dict[str, Any]]:
    """GPT-J's names, with q/k/v read out of the sharded qkv_proj (the module doc)."""
    layout = {
        stored: parts
        for stored, parts in gptj.checkpoint_layout(config).items()
        if not stored.endswith(("attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight"))
    }
    rotary = interleaved_rotary_rows(config.num_heads, config.head_dim, config.rotary_dim)
    every = [(0, config.hidden_size)]
    parts = {"q_proj": _shard_rows(config, 0, rotary), "v_proj": _shard_rows(config, 1, every)}
    parts["k_proj"] = _shard_rows(config, 2, rotary)
    for layer in range(config.num_layers):
        dst = f"model.layers.{layer}.self_attn"
        layout[f"transformer.h.{layer}.attn.qkv_proj.weight"] = {f"{dst}.{n}.weight": r for n, r in parts.items()}
    return layout
