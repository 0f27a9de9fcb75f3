"""LFM2's gated short convolution (`layer_types` "conv"): x is projected to three parts B, C and x' (`in_proj`),
B * x' passes a causal depthwise convolution over the last `short_conv_kernel` tokens (`conv`), the result is scaled
by C and projected back (`out_proj`); biases where `short_conv_bias`. Parameter names are transformers' (its
`conv.` is keel's `self_attn.`: the family's checkpoint layout). A sequence's past is the convolution's last inputs
(keel.model.recurrent).
"""

from __future__ import annotations

from torch import Tensor, nn

from keel.config import ModelConfig
from keel.model.recurrent import causal_conv, causal_conv_continued


class ShortConv(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        h, bias = config.hidden_size, config.short_conv_bias
        self.in_proj = nn.Linear(h, 3 * h, bias=bias)
        self.conv = nn.Conv1d(h, h, config.short_conv_kernel, groups=h, bias=bias)
        self.out_proj = nn.Linear(h, h, bias=bias)

    def forward(self, x: Tensor, meta) -> Tensor:  # meta: keel.model.attention.AttentionMetadata
        b, s, h = x.shape
        gate_in, gate_out, inputs = self.in_proj(x).chunk(3, dim=-1)
        mixed = gate_in * inputs
        spans = None if meta.cache is None else meta.cache.recurrent_spans(self.layer, meta)
        if spans is None:
            conv = causal_conv(mixed, self.conv.weight, self.conv.bias)
        else:
            conv = causal_conv_continued(mixed.reshape(b * s, h), self.conv.weight, self.conv.bias, spans).view(b, s, h)
        return self.out_proj(gate_out * conv)
