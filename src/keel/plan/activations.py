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
for such a layer's backward pass, the paper's method applied to keel's layer, for the recipes keel
trains with (`ActivationPrecision`: 16-bit weights and activations, float32, or autocast over float32
weights); tests/test_plan.py checks it against the bytes autograd actually saves (saved-tensor hooks)
on a real keel layer in each recipe.
"""

from __future__ import annotations

from dataclasses import dataclass

from keel.config import ModelConfig


def gpt_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, flash: bool = False) -> float:
    """The paper's per-layer activation bytes with tensor + sequence parallelism of degree t."""
    scores = 0 if flash else 5 * a * s / h
    return s * b * h * (34 + scores) / t


@dataclass(frozen=True)
class ActivationPrecision:
    """The dtypes a training recipe keeps activations in (bytes per value)."""

    compute: int = 2  # matmul inputs and outputs (bf16/fp16; 4 in float32)
    residual: int = 2  # the residual stream between blocks: the weights' dtype (4 with float32 weights)
    autocast: bool = False  # torch.autocast over float32 weights: each matmul saves its own cast copy of its input

    @classmethod
    def of(cls, weights: int, compute: int) -> ActivationPrecision:
        """float32 weights computing in 16 bits run under autocast; otherwise activations are in the
        weights' dtype (FSDP's mixed precision hands the blocks 16-bit weights: pass weights=2)."""
        if weights == 4 and compute == 2:
            return cls(2, 4, True)
        return cls(weights, weights)


BF16 = ActivationPrecision()


def norm_bytes(h: int, p: ActivationPrecision) -> float:
    """An RMSNorm keeps its input as float32 (upcast, or as is) and the normalised tensor (in the
    residual's dtype) for the weight's gradient, plus a float32 1/rms per token."""
    return 4 * h + p.residual * h + 4


def layer_activation_bytes(
    config: ModelConfig,
    seq: int,
    micro_batch: int,
    tp: int = 1,
    recompute: str = "none",
    precision: ActivationPrecision = BF16,
    layer: int | None = None,
) -> float:
    """Bytes one layer keeps for backward, per GPU. recompute: "none", or "full" (only the layer's
    input is kept; the layer's forward is recomputed in backward). Sequence parallelism is assumed
    with tp > 1 (norms and residuals sharded too), flash attention (no s x s scores kept). `layer`:
    which layer (dense or MoE in models that mix them); default: an MoE layer when the model has experts."""
    sbh = seq * micro_batch * config.hidden_size
    if recompute == "full":
        return sbh * precision.residual / tp
    if recompute != "none":
        raise ValueError(f"recompute must be 'none' or 'full', got {recompute!r}")
    h, a = config.hidden_size, precision.compute
    # the layer's attention geometry; by default the widest (Gemma 4's full-attention layers have their own)
    shapes = [layer] if layer is not None else config.attention_layers() or [0]
    d = max(config.layer_head_dim(i) for i in shapes)
    q, kv = max(config.layer_q_size(i) for i in shapes), max(config.layer_kv_size(i) for i in shapes)
    moe = config.num_experts > 0 if layer is None else config.is_moe_layer(layer)
    # The normed inputs of attention and MLP: one tensor shared by their projections, or under
    # autocast one cast copy per projection (q, k, v; MLA's two down-projections; gate and up).
    attention_inputs = (2 if config.is_mla else 3) if precision.autocast else 1
    mlp_inputs = (2 + (2 if config.shared_expert_intermediate_size else 0) if moe else 2) if precision.autocast else 1
    values = 2 * norm_bytes(h, precision) + a * h * (attention_inputs + mlp_inputs)
    # q, k, v after rotary and the attention output (SDPA's saved tensors, the output being o_proj's
    # input), the float32 logsumexp per head, the rotary cos/sin the products keep.
    values += a * (2 * q + 2 * kv + 2 * d) + 4 * config.num_heads
    if moe:
        k, i = config.num_experts_per_tok, config.moe_intermediate_size
        # Per routed slot: its gathered input, the fused gate/up output, SiLU(gate), the product (down's
        # input) and three h-wide copies of its output (sorted, scattered back, weighted); the router's
        # float32 probabilities twice.
        values += a * k * (4 * i + 4 * h) + 2 * 4 * config.num_experts
        if config.shared_expert_intermediate_size:
            values += a * 4 * config.shared_expert_intermediate_size
    else:
        values += a * 4 * config.widest_intermediate_size  # gate and up outputs, SiLU(gate), the product (down's input)
    return seq * micro_batch * values / tp
