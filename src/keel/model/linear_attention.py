"""Gated DeltaNet, the linear-attention layer of Qwen3.5 and Qwen3-Next (`layer_types` "linear_attention").

x is projected to q/k/v (`in_proj_qkv`), an output gate z (`in_proj_z`), a write strength beta = sigmoid(`in_proj_b`)
and a decay g = -exp(A_log) softplus(`in_proj_a` + dt_bias) per value head. q/k/v pass a causal depthwise
convolution (`conv1d`, kernel K) and SiLU, then the gated delta rule (keel.model.gated_delta) mixes the tokens;
each head's output is RMS-normed, scaled by SiLU(z) (`norm`), and projected back (`out_proj`). Parameter names are
transformers' (its `linear_attn.` is keel's `self_attn.`: the family's checkpoint layout). OLMo Hybrid's beta is
scaled (`linear_beta_scale`: 2) and its norm has an eps of its own (`linear_norm_eps`). A sequence's past is a
state (keel.model.recurrent): the convolution's last inputs and the delta rule's matrix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from keel.config import ModelConfig
from keel.model.gated_delta import delta_rule_chunked, delta_rule_steps, prepare
from keel.model.layers import building_on_meta
from keel.model.recurrent import RecurrentSpans, causal_conv, causal_conv_continued, continue_sequences


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's output (in float32, rounded to the input's dtype before the weight), times SiLU of
    the gate in float32: transformers' Qwen3_5RMSNormGated."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        h = config.hidden_size
        self.key_heads, self.value_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.key_dim, self.value_dim = config.linear_key_head_dim, config.linear_value_head_dim
        keys, values = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        self.splits = (keys, keys, values)
        channels = 2 * keys + values
        self.in_proj_qkv = nn.Linear(h, channels, bias=False)
        self.in_proj_z = nn.Linear(h, values, bias=False)
        self.in_proj_b = nn.Linear(h, self.value_heads, bias=False)
        self.in_proj_a = nn.Linear(h, self.value_heads, bias=False)
        self.conv1d = nn.Conv1d(channels, channels, config.linear_conv_kernel_dim, groups=channels, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.value_heads))
        self.A_log = nn.Parameter(torch.empty(self.value_heads) if building_on_meta() else self.initial_a_log())
        self.norm = GatedRMSNorm(self.value_dim, config.linear_norm_eps or config.rms_norm_eps)
        self.beta_scale = config.linear_beta_scale  # OLMo Hybrid's negative eigenvalues: beta in [0, 2]
        self.out_proj = nn.Linear(values, h, bias=False)

    def initial_a_log(self) -> Tensor:
        """Decay rates A spread over [1, 16] across the value heads (Mamba 2's range; transformers draws them at
        random there), the same on every layout."""
        return torch.linspace(1.0, 16.0, self.value_heads).log()

    def conv_weight(self) -> Tensor:
        """The causal convolution's weight over [q, k, v] ([C, 1, K])."""
        return self.conv1d.weight

    def forward(self, x: Tensor, meta) -> Tensor:  # meta: keel.model.attention.AttentionMetadata
        b, s, _ = x.shape
        mixed = self.in_proj_qkv(x)
        z = self.in_proj_z(x)
        beta = self.in_proj_b(x).sigmoid().float()
        if self.beta_scale != 1.0:
            beta = beta * self.beta_scale
        decay = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        spans = None if meta.cache is None else meta.cache.recurrent_spans(self.layer, meta)
        if spans is None:  # whole sequences from an empty state, the batch at once
            out, _ = self._mix(F.silu(causal_conv(mixed, self.conv_weight(), None)), decay, beta, None)
        else:
            out = self._continue(mixed.reshape(b * s, -1), decay.reshape(b * s, -1), beta.reshape(b * s, -1), spans)
            out = out.view(b, s, self.value_heads, self.value_dim)
        out = self.norm(out.to(x.dtype), z.view(b, s, self.value_heads, self.value_dim))
        return self.out_proj(out.reshape(b, s, -1))

    def _mix(self, conv: Tensor, decay: Tensor, beta: Tensor, state: Tensor | None) -> tuple[Tensor, Tensor]:
        """The delta rule over convolved q/k/v [B, L, C] (decay, beta [B, L, Hv]) from `state` (None: empty) ->
        (out [B, L, Hv, Dv] float32, the final state)."""
        b, length, _ = conv.shape
        q, k, v = conv.split(self.splits, dim=-1)
        q, k = (t.reshape(b, length, self.key_heads, self.key_dim) for t in (q, k))
        q, k, v = prepare(q, k, v.reshape(b, length, self.value_heads, self.value_dim))
        if state is None:
            state = q.new_zeros(b, self.value_heads, self.key_dim, self.value_dim)
        g, w = decay.transpose(1, 2), beta.transpose(1, 2)
        rule = delta_rule_steps if length == 1 else delta_rule_chunked
        out, state = rule(q, k, v, g, w, state)
        return out.transpose(1, 2), state

    def _continue(self, mixed: Tensor, decay: Tensor, beta: Tensor, spans: RecurrentSpans) -> Tensor:
        """Each sequence's tokens continued from its states, which are updated in place."""
        conv = F.silu(causal_conv_continued(mixed, self.conv_weight(), None, spans))
        out = mixed.new_empty(mixed.shape[0], self.value_heads, self.value_dim, dtype=torch.float32)
        return continue_sequences(self._mix, spans, (conv, decay, beta), out)
