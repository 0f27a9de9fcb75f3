"""Layers whose past is a state per sequence rather than keys and values (`ModelConfig.is_recurrent_layer`): Gated
DeltaNet (keel.model.linear_attention: "linear_attention" layers, Qwen3.5), the gated short convolution
(keel.model.short_conv: "conv" layers, LFM2), Mamba 2's mixer (keel.model.mamba: "mamba" layers, Granite 4.0-H;
beside the attention of Falcon-H1's "hybrid" layers, which keep keys and values too) and Mamba 1's
(keel.model.mamba1: "mamba1" layers, Mamba, Falcon Mamba, Jamba) and MiniMax's lightning attention
(keel.model.lightning: "lightning" layers). Each but the last runs a causal depthwise convolution whose last K - 1
inputs it keeps; Gated DeltaNet also keeps its delta rule's [Hv, Dk, Dv] matrix, Mamba 2 its [H, P, N] state,
Mamba 1 its [channels, N] state, lightning attention its [H, D, D] state alone.

Without a cache each row of a batch is a whole sequence from an empty state. With one, the cache's
`recurrent_spans` says which tokens belong to which sequence and hands out that sequence's states, which the layer
continues in place: a chunk of a prefill, or one decode token of many sequences at once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from keel.config import ModelConfig


@dataclass
class RecurrentSpans:
    """The tokens of one forward by sequence, for a layer with recurrent state, and that layer's state stores.

    Token indices are into the forward's tokens flattened ([B, S] -> B * S). `chunks`: (first, end, slot) of each
    run of several tokens of one sequence; `decode_tokens` / `decode_slots`: single tokens of sequences, run as one
    batch. A sequence starting at position 0 has had its slot emptied by the cache."""

    conv: Tensor  # [slots, conv channels, K - 1] the last convolution inputs
    state: Tensor | None  # [slots, ...] float32 (keel.model.recurrent.state_shape); None for a short convolution
    chunks: list[tuple[int, int, int]]
    decode_tokens: Tensor | None = None  # [N] int64
    decode_slots: Tensor | None = None  # [N] int64


def conv_shape(config: ModelConfig, layer: int) -> tuple[int, int]:
    """(channels, kernel) of a recurrent layer's causal convolution."""
    kind = config.layer_types[layer]
    if kind == "lightning":  # no convolution: an empty store ([slots, 0, 0]) keeps every recurrent layer's slots alike
        return 0, 1
    if kind == "conv":
        return config.hidden_size, config.short_conv_kernel
    if kind == "rglru":
        return config.lru_width, config.lru_conv_kernel
    if config.has_mamba(layer):
        inner = config.mamba_n_heads * config.mamba_d_head
        return inner + 2 * config.mamba_n_groups * config.mamba_d_state, config.mamba_d_conv
    if kind == "mamba1":
        return config.mamba_d_inner, config.mamba_d_conv
    keys = config.linear_num_key_heads * config.linear_key_head_dim
    return 2 * keys + config.linear_num_value_heads * config.linear_value_head_dim, config.linear_conv_kernel_dim


def state_shape(config: ModelConfig, layer: int) -> tuple[int, ...] | None:
    """A recurrent layer's float32 state beside its convolution's inputs, per sequence: Gated DeltaNet's [Hv, Dk, Dv],
    Mamba 2's [H, P, N], Mamba 1's [channels, N], lightning attention's [H, D, D], the RG-LRU's [lru_width]; None for
    a short convolution."""
    kind = config.layer_types[layer]
    if kind == "rglru":
        return (config.lru_width,)
    if kind == "lightning":
        return (config.num_heads, config.head_dim, config.head_dim)
    if kind == "linear_attention":
        return (config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim)
    if config.has_mamba(layer):
        return (config.mamba_n_heads, config.mamba_d_head, config.mamba_d_state)
    if kind == "mamba1":
        return (config.mamba_d_inner, config.mamba_d_state)
    return None


def causal_conv(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """Depthwise causal convolution of whole sequences from empty pasts: x [B, S, C] -> [B, S, C]."""
    length = x.shape[1]
    out = F.conv1d(x.transpose(1, 2), weight, bias, padding=weight.shape[-1] - 1, groups=weight.shape[0])
    return out[..., :length].transpose(1, 2)


def causal_conv_continued(x: Tensor, weight: Tensor, bias: Tensor | None, spans: RecurrentSpans) -> Tensor:
    """The convolution of each sequence's tokens in x [T, C] continued from its stored inputs, which are updated."""
    out = torch.empty_like(x)
    past = weight.shape[-1] - 1
    groups = weight.shape[0]
    for first, end, slot in spans.chunks:
        # a bfloat16 KV cache (--kv-cache-dtype) keeps the convolution's past in bfloat16 too
        window = torch.cat([spans.conv[slot].to(x.dtype), x[first:end].t()], dim=-1).unsqueeze(0)  # [1, C, K-1+L]
        spans.conv[slot] = window[0, :, -past:]
        out[first:end] = F.conv1d(window, weight, bias, groups=groups)[0].t()
    if spans.decode_tokens is not None:
        tokens, slots = spans.decode_tokens, spans.decode_slots
        window = torch.cat([spans.conv.index_select(0, slots).to(x.dtype), x.index_select(0, tokens).unsqueeze(-1)], -1)
        spans.conv.index_copy_(0, slots, window[..., 1:].to(spans.conv.dtype))
        out[tokens] = F.conv1d(window, weight, bias, groups=groups)[..., 0]
    return out


def continue_sequences(
    run: Callable[..., tuple[Tensor, Tensor]], spans: RecurrentSpans, inputs: tuple[Tensor, ...], out: Tensor
) -> Tensor:
    """A recurrence (`run(*inputs batched [B, L, ...], state [B, ...]) -> (outputs [B, L, ...], final state)`) over
    each sequence's tokens of `inputs` ([T, ...] each), continued from its state, which is updated in place; the
    outputs written into `out` ([T, ...]): each chunk on its own, the one-token decodes as one batch."""
    for first, end, slot in spans.chunks:
        piece, state = run(*(t[first:end][None] for t in inputs), spans.state[slot][None])
        spans.state[slot] = state[0]
        out[first:end] = piece[0]
    if spans.decode_tokens is not None:
        tokens, slots = spans.decode_tokens, spans.decode_slots
        piece, state = run(*(t[tokens][:, None] for t in inputs), spans.state.index_select(0, slots))
        spans.state.index_copy_(0, slots, state)
        out[tokens] = piece[:, 0]
    return out


class RecurrentStates:
    """The states of a model's recurrent layers for `slots` sequences at once: per layer the convolution's last inputs
    [slots, C, K - 1] (in `dtype`) and, where the layer has one, its float32 state (`state_shape`). A cache
    holds one and says which slot each sequence of a forward uses (`spans`); a slot is emptied when its sequence
    starts."""

    def __init__(self, config: ModelConfig, slots: int, dtype: torch.dtype, device: torch.device | str) -> None:
        layers = [i for i in range(config.num_layers) if config.is_recurrent_layer(i)]
        self.conv = {}
        for i in layers:
            channels, kernel = conv_shape(config, i)
            self.conv[i] = torch.zeros(slots, channels, kernel - 1, dtype=dtype, device=device)
        shapes = {i: state_shape(config, i) for i in layers}
        self.state = {
            i: torch.zeros(slots, *shape, dtype=torch.float32, device=device)
            for i, shape in shapes.items()
            if shape is not None
        }

    @staticmethod
    def bytes_per_slot(config: ModelConfig, dtype: torch.dtype) -> int:
        """What one sequence's states take over every recurrent layer."""
        total = 0
        for i in range(config.num_layers):
            if config.is_recurrent_layer(i):
                channels, kernel = conv_shape(config, i)
                total += channels * (kernel - 1) * dtype.itemsize
            shape = state_shape(config, i) if config.is_recurrent_layer(i) else None
            if shape is not None:
                total += 4 * math.prod(shape)
        return total

    def reset(self, slots: list[int]) -> None:
        """Empty these slots in every layer (their sequences start at position 0). Slot by slot: an index tensor
        built from the list would be a host-to-device copy, which on CUDA waits for the stream (a step starts few)."""
        for slot in slots:
            for store in (*self.conv.values(), *self.state.values()):
                store[slot].zero_()

    def spans(
        self,
        layer: int,
        chunks: list[tuple[int, int, int]],
        decode_tokens: Tensor | None = None,
        decode_slots: Tensor | None = None,
    ) -> RecurrentSpans:
        return RecurrentSpans(self.conv[layer], self.state.get(layer), chunks, decode_tokens, decode_slots)
