"""Mamba 1's mixer (`layer_types` "mamba1": Mamba, Falcon Mamba, Jamba): x is projected to the channels and an
output gate z (`in_proj`, in that order); the channels pass a causal depthwise convolution (`conv1d`) and SiLU; a
low-rank step, B and C are projected from them (`x_proj`), RMS-normed where the config says (`mamba_dt_bc_norm`:
Falcon Mamba without weights, Jamba's `dt_layernorm` / `b_layernorm` / `c_layernorm` with them), the step expanded to
one per channel (`dt_proj`, its bias before softplus); the selective scan (keel.model.selective_scan) mixes the
tokens, with D's skip; the result, gated by SiLU(z), is projected back (`out_proj`). Parameter names are
transformers' (its `mixer.` / `mamba.` is keel's `self_attn.`: the family's checkpoint layout). A sequence's past is
a state (keel.model.recurrent): the convolution's last inputs and one [channels, N] matrix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from keel.config import ModelConfig
from keel.model.layers import RMSNorm, WeightlessNorm, building_on_meta
from keel.model.recurrent import RecurrentSpans, causal_conv, causal_conv_continued, continue_sequences
from keel.model.selective_scan import selective_scan


def _dt_bc_norm(config: ModelConfig, dim: int) -> nn.Module | None:
    if config.mamba_dt_bc_norm == "rms":
        return RMSNorm(dim, config.mamba_dt_bc_norm_eps)
    if config.mamba_dt_bc_norm == "weightless":
        return WeightlessNorm("rms", config.mamba_dt_bc_norm_eps)
    return None


class Mamba1Mixer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        h, inner = config.hidden_size, config.mamba_d_inner
        self.inner, self.state_size, self.rank = inner, config.mamba_d_state, config.mamba_dt_rank
        self.in_proj = nn.Linear(h, 2 * inner, bias=config.mamba_proj_bias)
        self.conv1d = nn.Conv1d(inner, inner, config.mamba_d_conv, groups=inner, bias=config.mamba_conv_bias)
        self.x_proj = nn.Linear(inner, self.rank + 2 * self.state_size, bias=False)
        self.dt_proj = nn.Linear(self.rank, inner, bias=True)
        self.A_log = nn.Parameter(torch.empty(inner, self.state_size) if building_on_meta() else self.initial_a_log())
        self.D = nn.Parameter(torch.ones(inner))
        self.out_proj = nn.Linear(inner, h, bias=config.mamba_out_bias)
        self.dt_layernorm = _dt_bc_norm(config, self.rank)
        self.b_layernorm = _dt_bc_norm(config, self.state_size)
        self.c_layernorm = _dt_bc_norm(config, self.state_size)

    def initial_a_log(self) -> Tensor:
        """A = 1, 2, ..., N along each channel's state, as Mamba starts."""
        return torch.arange(1, self.state_size + 1, dtype=torch.float32).log().expand(self.inner, -1).contiguous()

    def forward(self, x: Tensor, meta) -> Tensor:  # meta: keel.model.attention.AttentionMetadata
        b, s, _ = x.shape
        channels, gate = self.in_proj(x).chunk(2, dim=-1)
        spans = None if meta.cache is None else meta.cache.recurrent_spans(self.layer, meta)
        weight, bias = self.conv1d.weight, self.conv1d.bias
        if spans is None:  # whole sequences from an empty state
            conv = F.silu(causal_conv(channels, weight, bias))
        else:
            conv = F.silu(causal_conv_continued(channels.reshape(b * s, -1), weight, bias, spans)).view(b, s, -1)
        step, bs, cs = self.x_proj(conv).split((self.rank, self.state_size, self.state_size), dim=-1)
        if self.dt_layernorm is not None:
            step, bs, cs = self.dt_layernorm(step), self.b_layernorm(bs), self.c_layernorm(cs)
        step = F.softplus(self.dt_proj(step).float())
        inputs = (conv.float(), step, bs.float(), cs.float())
        if spans is None:
            out, _ = self._scan(*inputs, None)
        else:
            flat = tuple(t.reshape(b * s, -1) for t in inputs)
            out = self._continue(flat, spans).view(b, s, -1)
        return self.out_proj((out * F.silu(gate.float())).to(x.dtype))

    def _scan(self, conv: Tensor, step: Tensor, bs: Tensor, cs: Tensor, state: Tensor | None) -> tuple[Tensor, Tensor]:
        """The scan over convolved channels [B, L, D] (steps [B, L, D], B and C [B, L, N]) from `state` (None: empty)
        -> (y [B, L, D] float32 with D's skip, the final state)."""
        if state is None:
            state = conv.new_zeros(conv.shape[0], self.inner, self.state_size)
        y, state = selective_scan(conv, step, -self.A_log.float().exp(), bs, cs, state)
        return y + self.D.float() * conv, state

    def _continue(self, inputs: tuple[Tensor, ...], spans: RecurrentSpans) -> Tensor:
        """Each sequence's tokens continued from its states, which are updated in place."""
        out = inputs[0].new_empty(inputs[0].shape[0], self.inner)
        return continue_sequences(self._scan, spans, inputs, out)
