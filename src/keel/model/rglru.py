"""Griffin's recurrent block with its Real-Gated Linear Recurrent Unit (`layer_types` "rglru": RecurrentGemma;
transformers' RecurrentGemmaRecurrentBlock and RecurrentGemmaRglru, its "recurrent" blocks).

x [.., hidden] takes two branches: y = act(`linear_y`(x)), and `linear_x`(x) through a causal depthwise convolution
of `lru_conv_kernel` taps (`conv_1d`, biased) into the RG-LRU; their product goes through `linear_out`. The RG-LRU,
over u [.., W] split in num_heads blocks, has block-diagonal gates (`input_gate_weight` [H, W/H, W/H] and biases)
    i = sigmoid(u Wi + bi),  r = sigmoid(u Wr + br),  log a = -8 r softplus(`recurrent_param`)
    h_t = a_t h_{t-1} + sqrt(1 - a_t^2) (i_t u_t)
and outputs h_t. A token at position 0 resets: its a is taken as 0 and its input is not scaled by sqrt(1 - a^2)
(transformers' `reset`, what also separates packed sequences). The gates are computed in the activations' dtype and
the recurrence accumulates in float32, each output rounded back, as transformers does (a decode token is one step,
a prefill goes by chunks of 32 tokens: `lru_chunked`); the state kept between calls
(keel.model.recurrent) is the convolution's last K - 1 inputs and h [W] in float32. Parameter names are
transformers' (its `temporal_block.` is keel's `self_attn.`: the family's checkpoint layout).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from keel.config import ModelConfig
from keel.model.layers import activation
from keel.model.recurrent import causal_conv, causal_conv_continued, continue_sequences

CHUNK = 32
MAX_SQRT_GRADIENT = 1000.0


def lru_scan(a: Tensor, x: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """h_t = a_t h_{t-1} + x_t token by token in float32 (transformers' loop; keel's decode step): a, x [B, L, W],
    state [B, W] float32 -> (h [B, L, W] in x's dtype, the last h float32)."""
    out = torch.empty_like(x)
    for t in range(x.shape[1]):
        state = a[:, t].float() * state + x[:, t].float()
        out[:, t] = state.to(x.dtype)
    return out, state


def lru_chunked(log_a: Tensor, x: Tensor, state: Tensor, chunk: int = CHUNK) -> tuple[Tensor, Tensor]:
    """`lru_scan` given log a [B, L, W] float32 (-inf: a = 0, a reset), chunk by chunk in float32 (a prefill's chunk
    at once, not a Python step per token): h_t = sum_{s<=t} (prod_{s<r<=t} a_r) x_s + (prod_{r<=t} a_r) h_0, the
    products as exponentials of sums of log a within each chunk (a masked cumulative sum: no large sums subtracted).
    A reset's -inf is an exact zero with finite gradients (no log of 0)."""
    b, length, width = x.shape
    log_a = log_a.transpose(1, 2)  # [B, W, L]
    steps = torch.arange(chunk, device=x.device)
    below = steps[:, None] > steps[None, :]  # [t, s]: t > s
    outs = []
    for first in range(0, length, chunk):
        n = min(chunk, length - first)
        la, xc = log_a[..., first : first + n], x[:, first : first + n].float().transpose(1, 2)
        # [B, W, t, s]: sum of log a_r over s < r <= t; -inf above the diagonal (s after t)
        seg = la[..., :, None].expand(b, width, n, n).masked_fill(~below[:n, :n], 0).cumsum(-2)
        seg = seg.masked_fill(below[:n, :n].T, float("-inf"))
        h = (seg.exp() @ xc[..., None])[..., 0] + la.cumsum(-1).exp() * state[..., None]
        outs.append(h)
        state = h[..., -1]
    return torch.cat(outs, dim=-1).transpose(1, 2).to(x.dtype), state


class BoundedSqrt(torch.autograd.Function):
    """sqrt with its gradient bounded at 1000 (transformers' SqrtBoundDerivative: 1 - a^2 nears 0 as a nears 1)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:  # noqa: ANN001
        ctx.save_for_backward(x)
        return torch.sqrt(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # noqa: ANN001
        (x,) = ctx.saved_tensors
        return grad / torch.sqrt(torch.clip(4.0 * x, min=1 / MAX_SQRT_GRADIENT**2))


class RGLRU(nn.Module):
    """The Real-Gated Linear Recurrent Unit (module doc): its parameters, named as transformers' `rg_lru.*`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.heads = config.num_heads
        width = config.lru_width
        block = width // self.heads
        self.recurrent_param = nn.Parameter(torch.empty(width))
        self.input_gate_weight = nn.Parameter(torch.empty(self.heads, block, block))
        self.input_gate_bias = nn.Parameter(torch.empty(self.heads, block))
        self.recurrent_gate_weight = nn.Parameter(torch.empty(self.heads, block, block))
        self.recurrent_gate_bias = nn.Parameter(torch.empty(self.heads, block))
        with torch.no_grad():  # transformers' initialisation (its default w_init_variance_scale, 0.01)
            self.recurrent_param.copy_(self.initial_recurrent_param())
            for weight in (self.input_gate_weight, self.recurrent_gate_weight):
                nn.init.normal_(weight, std=(0.01 / block) ** 0.5)
            nn.init.zeros_(self.input_gate_bias)
            nn.init.zeros_(self.recurrent_gate_bias)

    def initial_recurrent_param(self) -> Tensor:
        """`recurrent_param`'s start: softplus^-1(-log c) per channel for base decays c over [0.9, 0.999] (a = c^(8 r)),
        c^2 spread evenly where transformers draws it uniformly, so that every layout starts alike."""
        width = self.recurrent_param.shape[0]
        squared = torch.linspace(0.9**2 + 1e-8, 0.999**2 + 1e-8, width, device="cpu")
        return (1 / squared.sqrt() - 1).log()

    def _gate(self, u: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
        """sigmoid(u W + b) per block: u [B, L, W] -> [B, L, W]. One baddbmm, as transformers (the bias added before
        the product is rounded: in bfloat16 a separate add rounds twice)."""
        b, s, w = u.shape
        blocks = u.reshape(b * s, self.heads, w // self.heads).transpose(0, 1)  # [H, B*L, W/H]
        return torch.sigmoid(torch.baddbmm(bias[:, None, :], blocks, weight).transpose(0, 1).reshape(b, s, w))

    def forward(self, u: Tensor, positions: Tensor, state: Tensor | None) -> tuple[Tensor, Tensor]:
        """u [B, L, W] (the convolution's output), positions [B, L], state [B, W] float32 (None: empty) ->
        (h [B, L, W] in u's dtype, the last state)."""
        reset = (positions == 0).unsqueeze(-1)
        gate_in = self._gate(u, self.input_gate_weight, self.input_gate_bias)
        gate_a = self._gate(u, self.recurrent_gate_weight, self.recurrent_gate_bias)
        log_a = -8.0 * gate_a * F.softplus(self.recurrent_param)
        # sqrt(1 - a^2) normalises the input so that h keeps unit scale; not at a reset, where there is no past
        scale = torch.where(reset, torch.ones_like(log_a), BoundedSqrt.apply(1 - torch.exp(2 * log_a)))
        x = u * gate_in * scale.to(u.dtype)
        if state is None:
            state = u.new_zeros(u.shape[0], u.shape[-1], dtype=torch.float32)
        a = torch.exp(log_a)  # in the activations' dtype, as transformers rounds it
        if u.shape[1] == 1:  # a decode step, as transformers takes it
            return lru_scan(a * ~reset, x, state)
        # the log of the rounded a (kept from 0, whose log's gradient is infinite), a reset's -inf put in apart
        log_a = torch.log(a.float().clamp_min(torch.finfo(torch.float32).tiny)).masked_fill(reset, float("-inf"))
        return lru_chunked(log_a, x, state)


class RGLRUBlock(nn.Module):
    """Griffin's recurrent block (module doc), keel's `self_attn` of an "rglru" layer."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        h, width = config.hidden_size, config.lru_width
        self.linear_y = nn.Linear(h, width)
        self.linear_x = nn.Linear(h, width)
        self.linear_out = nn.Linear(width, h)
        self.conv_1d = nn.Conv1d(width, width, config.lru_conv_kernel, groups=width)
        self.rg_lru = RGLRU(config)
        self.act = activation(config.hidden_act)

    def forward(self, x: Tensor, meta) -> Tensor:  # meta: keel.model.attention.AttentionMetadata
        b, s, _ = x.shape
        gate = self.act(self.linear_y(x))
        u = self.linear_x(x)
        width = u.shape[-1]
        positions = meta.positions.expand(b, s)
        spans = None if meta.cache is None else meta.cache.recurrent_spans(self.layer, meta)
        if spans is None:  # whole sequences from empty states, the batch at once
            conv = causal_conv(u, self.conv_1d.weight, self.conv_1d.bias)
            out, _ = self.rg_lru(conv, positions, None)
        else:
            flat = u.reshape(b * s, width)
            conv = causal_conv_continued(flat, self.conv_1d.weight, self.conv_1d.bias, spans)
            out = continue_sequences(self.rg_lru, spans, (conv, positions.reshape(b * s)), torch.empty_like(flat))
            out = out.view(b, s, width)
        return self.linear_out(out * gate)
