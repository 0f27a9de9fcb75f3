"""Kimi Delta Attention (Kimi Linear's `linear_attention` layers, `linear_variant` "kda"): Gated DeltaNet with a
decay per key channel rather than per head.

x is projected to q, k and v (`q_proj`, `k_proj`, `v_proj`; one head count and one width for all three), which pass
causal depthwise convolutions (`q_conv1d`, `k_conv1d`, `v_conv1d`, run as one) and SiLU; beta = sigmoid(`b_proj`) per
head; the decay is g = -exp(A_log) softplus(f_b(f_a(x)) + dt_bias) per head and key channel (`f_a_proj`, `f_b_proj`:
low rank through one head's width); the gated delta rule (keel.model.gated_delta, its per-channel form) mixes the
tokens; each head's output is RMS-normed and scaled by sigmoid of a low-rank gate (`g_a_proj`, `g_b_proj`;
`o_norm`), then projected back (`o_proj`). Parameter names and shapes are those of Moonshot's checkpoints (which
transformers renames and fuses on load). The mixing, the states and their continuation are Gated DeltaNet's
(keel.model.linear_attention).

Bailing Hybrid's variant: `kda_full_rank_gates` projects the decay and the gate at full rank (`f_proj`, `g_proj`;
A_log [H], as its checkpoints store it); `kda_gate_lower_bound` bounds the decay, g = bound *
sigmoid(exp(A_log) (f + dt_bias)) (its `kda_safe_gate`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from keel.config import ModelConfig
from keel.model.layers import building_on_meta
from keel.model.linear_attention import GatedDeltaNet
from keel.model.recurrent import causal_conv


class SigmoidGatedRMSNorm(nn.Module):
    """RMSNorm over each head's output, times its weight and sigmoid of the gate, all in float32 (transformers'
    KimiLinearRMSNormGated: the weight is not rounded to the input's dtype first, unlike Qwen3.5's)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return (self.weight.float() * normed * gate.float().sigmoid()).to(x.dtype)


class KimiDeltaAttention(GatedDeltaNet):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        nn.Module.__init__(self)  # Gated DeltaNet's mixing, not its projections
        self.layer = layer
        h, heads, dim = config.hidden_size, config.linear_num_value_heads, config.linear_value_head_dim
        self.key_heads = self.value_heads = heads
        self.key_dim = self.value_dim = dim
        width = heads * dim
        self.splits = (width, width, width)
        self.q_proj = nn.Linear(h, width, bias=False)
        self.k_proj = nn.Linear(h, width, bias=False)
        self.v_proj = nn.Linear(h, width, bias=False)
        kernel = config.linear_conv_kernel_dim
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (
            nn.Conv1d(width, width, kernel, groups=width, bias=False) for _ in range(3)
        )
        self.full_rank = config.kda_full_rank_gates
        self.lower_bound = config.kda_gate_lower_bound
        if self.full_rank:  # Bailing Hybrid: hidden -> heads x width at once
            self.f_proj = nn.Linear(h, width, bias=False)
            self.g_proj = nn.Linear(h, width, bias=False)
        else:  # Kimi: low rank through one head's width
            self.f_a_proj = nn.Linear(h, dim, bias=False)
            self.f_b_proj = nn.Linear(dim, width, bias=False)
            self.g_a_proj = nn.Linear(h, dim, bias=False)
            self.g_b_proj = nn.Linear(dim, width, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(width))
        # the checkpoints' shape: Kimi's [1, 1, H, 1], Bailing Hybrid's [H]
        self.a_shape = (heads,) if self.full_rank else (1, 1, heads, 1)
        self.A_log = nn.Parameter(torch.empty(self.a_shape) if building_on_meta() else self.initial_a_log())
        self.b_proj = nn.Linear(h, heads, bias=False)
        self.o_norm = SigmoidGatedRMSNorm(dim, config.linear_norm_eps or config.rms_norm_eps)
        self.o_proj = nn.Linear(width, h, bias=False)

    def initial_a_log(self) -> Tensor:
        """Decay rates A spread over [1, 16] across the heads (transformers draws them at random there)."""
        return super().initial_a_log().view(self.a_shape)

    def conv_weight(self) -> Tensor:
        """The three convolutions as one over [q, k, v] ([3 H D, 1, K])."""
        return torch.cat((self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight))

    def log_decay(self, x: Tensor) -> Tensor:
        """The log decay per head and key channel, in float32: [B, S, H, Dk]."""
        b, s, _ = x.shape
        raw = self.f_proj(x) if self.full_rank else self.f_b_proj(self.f_a_proj(x))
        raw = (raw.float() + self.dt_bias.float()).view(b, s, self.value_heads, -1)
        rate = self.A_log.float().exp().view(1, 1, -1, 1)
        if self.lower_bound is not None:  # Bailing Hybrid's safe gate: bounded below
            return self.lower_bound * torch.sigmoid(rate * raw)
        return -rate * F.softplus(raw)

    def output_gate(self, x: Tensor) -> Tensor:
        return self.g_proj(x) if self.full_rank else self.g_b_proj(self.g_a_proj(x))

    def forward(self, x: Tensor, meta) -> Tensor:  # meta: keel.model.attention.AttentionMetadata
        b, s, _ = x.shape
        mixed = torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), dim=-1)
        beta = self.b_proj(x).sigmoid().float()
        decay = self.log_decay(x)
        spans = None if meta.cache is None else meta.cache.recurrent_spans(self.layer, meta)
        if spans is None:  # whole sequences from an empty state, the batch at once
            out, _ = self._mix(F.silu(causal_conv(mixed, self.conv_weight(), None)), decay, beta, None)
        else:
            flat = (t.reshape(b * s, *t.shape[2:]) for t in (mixed, decay, beta))
            out = self._continue(*flat, spans).view(b, s, self.value_heads, self.value_dim)
        gate = self.output_gate(x).view(b, s, self.value_heads, self.value_dim)
        out = self.o_norm(out.to(x.dtype), gate)
        return self.o_proj(out.reshape(b, s, -1))
