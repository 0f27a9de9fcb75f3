"""Mamba 2's mixer (`layer_types` "mamba": GraniteMoeHybrid, Granite 4.0-H): x is projected to an output gate z, the
convolved channels (x, B, C) and a step per head (`in_proj`, in that order); x, B and C pass a causal depthwise
convolution (`conv1d`) and SiLU; the state-space recurrence (keel.model.ssd) mixes the tokens, with D's skip; the
result, gated by SiLU(z) and RMS-normed per group of channels (`norm`), is projected back (`out_proj`). Parameter
names are transformers' (its `mamba.` is keel's `self_attn.`: the family's checkpoint layout). A sequence's past
is a state (keel.model.recurrent): the convolution's last inputs and one [P, N] matrix per head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from keel.config import ModelConfig
from keel.model.layers import building_on_meta
from keel.model.recurrent import RecurrentSpans, causal_conv, causal_conv_continued, continue_sequences
from keel.model.ssd import ssd_chunked, ssd_steps


class GroupedGatedRMSNorm(nn.Module):
    """x times SiLU(z), then an RMS norm over each group of channels, in float32, times the weight (transformers'
    GraniteMoeHybridRMSNormGated: the gate before the norm); `before_gate`: the norm of x, then the gate (Falcon-H1's
    mamba_norm_before_gate). `float32_weight`: the weight applied in float32 and the result rounded once
    (FalconH1RMSNormGated), not to the rounded norm (Granite's)."""

    def __init__(self, dim: int, groups: int, eps: float, before_gate: bool = False, float32_weight: bool = False):
        super().__init__()
        self.groups, self.eps = groups, eps
        self.before_gate, self.float32_weight = before_gate, float32_weight
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        z = F.silu(gate.float())
        grouped = (x.float() if self.before_gate else x.float() * z).unflatten(-1, (self.groups, -1))
        normed = F.rms_norm(grouped, (grouped.shape[-1],), None, self.eps).flatten(-2)
        if not self.float32_weight:
            return self.weight * normed.to(self.weight.dtype)
        out = self.weight.float() * normed
        return (out * z if self.before_gate else out).to(self.weight.dtype)


class Mamba2Mixer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        h = config.hidden_size
        self.heads, self.head_dim = config.mamba_n_heads, config.mamba_d_head
        self.groups, self.state_size = config.mamba_n_groups, config.mamba_d_state
        self.inner = self.heads * self.head_dim
        channels = self.inner + 2 * self.groups * self.state_size
        self.splits = (self.inner, channels, self.heads)
        self.dt_limit = config.mamba_dt_limit
        self.in_proj = nn.Linear(h, self.inner + channels + self.heads, bias=config.mamba_proj_bias)
        # Falcon-H1's ssm_multipliers: in_proj's output times one multiplier per segment (z, x, B, C, the steps)
        group_width = self.groups * self.state_size
        self.proj_segments = (self.inner, self.inner, group_width, group_width, self.heads)
        self.proj_multipliers = config.mamba_proj_multipliers
        self.conv1d = nn.Conv1d(channels, channels, config.mamba_d_conv, groups=channels, bias=config.mamba_conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(self.heads))
        self.A_log = nn.Parameter(torch.empty(self.heads) if building_on_meta() else self.initial_a_log())
        self.D = nn.Parameter(torch.ones(self.heads))
        # None: the output gated by SiLU(z) alone (Falcon-H1 without mamba_rms_norm)
        self.norm = (
            None
            if config.mamba_norm == "gate"
            else GroupedGatedRMSNorm(
                self.inner,
                self.groups,
                config.rms_norm_eps,
                before_gate=config.mamba_norm == "norm_gate",
                float32_weight=config.mamba_norm_float32,
            )
        )
        self.out_proj = nn.Linear(self.inner, h, bias=config.mamba_out_bias)

    def initial_a_log(self) -> Tensor:
        """A = 1, 2, ..., H across the heads, as Mamba 2 starts."""
        return torch.arange(1, self.heads + 1, dtype=torch.float32).log()

    def forward(self, x: Tensor, meta) -> Tensor:  # meta: keel.model.attention.AttentionMetadata
        b, s, _ = x.shape
        projected = self.in_proj(x)
        if self.proj_multipliers:
            per_channel = torch.tensor(self.proj_multipliers, dtype=projected.dtype, device=projected.device)
            projected = projected * per_channel.repeat_interleave(torch.tensor(self.proj_segments, device=x.device))
        gate, mixed, step = projected.split(self.splits, dim=-1)
        step = F.softplus(step.float() + self.dt_bias.float())
        spans = None if meta.cache is None else meta.cache.recurrent_spans(self.layer, meta)
        weight, bias = self.conv1d.weight, self.conv1d.bias
        if spans is None:  # whole sequences from an empty state, the batch at once
            out, _ = self._scan(F.silu(causal_conv(mixed, weight, bias)), step, None)
        else:
            conv = F.silu(causal_conv_continued(mixed.reshape(b * s, -1), weight, bias, spans))
            out = self._continue(conv, step.reshape(b * s, -1), spans).view(b, s, self.heads, self.head_dim)
        out = out.flatten(-2)
        out = out * F.silu(gate) if self.norm is None else self.norm(out, gate)  # Falcon-H1: SiLU in gate's dtype
        return self.out_proj(out.to(x.dtype))

    def _scan(self, conv: Tensor, step: Tensor, state: Tensor | None) -> tuple[Tensor, Tensor]:
        """The recurrence over convolved x/B/C [B, L, C] (steps [B, L, H]) from `state` (None: empty) ->
        (y [B, L, H, P] float32 with D's skip, the final state)."""
        b, length, _ = conv.shape
        if length > 1 or state is None:
            # the steps' limits bind the chunked scan only: a one-token step continuing a state is not clamped, as
            # transformers' recurrent form, mamba_ssm's step and vLLM's decode leave it
            step = step.clamp(*self.dt_limit)
        xs, bs, cs = conv.float().split((self.inner, self.groups * self.state_size, self.groups * self.state_size), -1)
        xs = xs.view(b, length, self.heads, self.head_dim).transpose(1, 2)
        per_group = self.heads // self.groups
        bs, cs = (
            t.view(b, length, self.groups, -1).repeat_interleave(per_group, dim=2).transpose(1, 2) for t in (bs, cs)
        )
        if state is None:
            state = xs.new_zeros(b, self.heads, self.head_dim, self.state_size)
        scan = ssd_steps if length == 1 else ssd_chunked
        y, state = scan(xs, step.transpose(1, 2), self.A_log, bs, cs, state)
        y = y + self.D.float()[:, None, None] * xs
        return y.transpose(1, 2), state

    def _continue(self, conv: Tensor, step: Tensor, spans: RecurrentSpans) -> Tensor:
        """Each sequence's tokens continued from its states, which are updated in place."""
        out = conv.new_empty(conv.shape[0], self.heads, self.head_dim, dtype=torch.float32)
        return continue_sequences(self._scan, spans, (conv, step), out)
