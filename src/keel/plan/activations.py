"""Activation memory of one transformer layer in training (Korthikanti et al., 2022, "Reducing
Activation Recomputation in Large Transformer Models").

For a micro-batch of b sequences of s tokens, hidden size h, a attention heads, 16-bit activations
and the standard layer (attention + a 4h MLP, dropout masks of one byte), the paper counts
    sbh (34 + 5 a s / h) bytes per layer,
of which 5as/h is the s x s attention scores/softmax/dropout (absent with a fused, memory-efficient
attention kernel such as FlashAttention or SDPA, which keep only the output and the logsumexp).
With tensor parallelism of degree t and sequence parallelism everything is divided by t; with full
recomputation (activation checkpointing of every layer) only the layer input, sbh x 2 bytes, stays.

keel's layers differ from the paper's GPT: SwiGLU with an intermediate of i (not 4h), RMSNorm, no
dropout, grouped-query attention, SDPA. `layer_activation_bytes` counts the tensors autograd keeps
for such a layer's backward pass, the paper's method applied to keel's layer; tests/test_plan.py
checks it against the bytes autograd actually saves (saved-tensor hooks) on a real keel layer.
"""

from __future__ import annotations

from keel.config import ModelConfig


def gpt_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, flash: bool = False) -> float:
    """The paper's per-layer activation bytes with tensor + sequence parallelism of degree t."""
    scores = 0 if flash else 5 * a * s / h
    return s * b * h * (34 + scores) / t


def layer_activation_bytes(
    config: ModelConfig,
    seq: int,
    micro_batch: int,
    tp: int = 1,
    recompute: str = "none",
    bytes_per_value: int = 2,
    layer: int | None = None,
) -> float:
    """Bytes one layer keeps for backward, per GPU. recompute: "none", or "full" (only the layer's
    input is kept; the layer's forward is recomputed in backward). Sequence parallelism is assumed
    with tp > 1 (norms and residuals sharded too), flash attention (no s x s scores kept). `layer`:
    which layer (dense or MoE in models that mix them); default: an MoE layer when the model has experts."""
    sbh = seq * micro_batch * config.hidden_size
    if recompute == "full":
        return sbh * bytes_per_value / tp
    if recompute != "none":
        raise ValueError(f"recompute must be 'none' or 'full', got {recompute!r}")
    h = config.hidden_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    # Each RMSNorm keeps its input in float32 (2 values' bytes), the normalized bf16 tensor (for the
    # weight's gradient) and its output (the next projections' input).
    norms = 2 * (2 * h + h + h)
    # q, k, v after rotary and the attention output (SDPA's saved tensors, the output being o_proj's
    # input), plus the float32 logsumexp per head.
    attention = 2 * q + 2 * kv + 2 * config.num_heads / config.head_dim
    moe = config.num_experts > 0 if layer is None else config.is_moe_layer(layer)
    if moe:
        k, i = config.num_experts_per_tok, config.moe_intermediate_size
        # Per routed slot: its gathered input, the fused gate/up output, SiLU(gate), the product (down's
        # input) and three h-wide copies of its output (sorted, scattered back, weighted); the router's
        # float32 probabilities twice.
        mlp = k * (4 * i + 4 * h) + 2 * 2 * config.num_experts
        if config.shared_expert_intermediate_size:
            mlp += 4 * config.shared_expert_intermediate_size
    else:
        mlp = 4 * config.intermediate_size  # gate and up outputs, SiLU(gate), the product (down's input)
    values_per_token = norms + attention + mlp
    return seq * micro_batch * values_per_token * bytes_per_value / tp
