"""Lightning attention, the linear-attention layer of MiniMax-Text-01 and MiniMax-M1 (`layer_types` "lightning";
transformers' MiniMaxLightningAttention, its "linear_attention" layers).

x is projected to q, k and v at once (`qkv_proj`, each head's q, k, v side by side) and passed through SiLU. Each
head h keeps a state S [D, D] with a fixed decay e^-s_h per token (no write gate, no delta rule):
    S <- e^-s_h S + k^T v;  out = q S
The slopes s_h are ALiBi's geometric series (2^(-8/H))^(h+1), scaled by the layer's depth: 1 - layer / (L - 1),
so the last layer barely forgets. The heads' outputs, concatenated, pass one RMSNorm over all of them (`norm`),
times sigmoid(`output_gate`(x)), then `out_proj`. `lightning_steps` runs the recurrence token by token (decode);
`lightning_chunked` a sequence in chunks (each chunk's own tokens as a decayed causal product, the earlier ones
through the state), both in float32 and continued from a state, so that a prefill split in two equals one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from keel.config import ModelConfig
from keel.model.layers import RMSNorm
from keel.model.recurrent import continue_sequences

CHUNK = 64
NORM_EPS = 1e-6  # transformers' MiniMaxRMSNorm default: the layer's norm does not read rms_norm_eps


def slopes(heads: int, layer: int, layers: int) -> Tensor:
    """Each head's decay rate s_h [H] float32, as transformers computes it (its 1e-5 terms included); on the CPU
    whatever the default device (a model built on the meta device still knows them)."""
    base = 1 / (2 ** (8 / heads))
    rate = base ** (torch.arange(heads, dtype=torch.float32, device="cpu") + 1)
    return rate * (1 - layer / (layers - 1 + 1e-5) + 1e-5)


def lightning_steps(q: Tensor, k: Tensor, v: Tensor, s: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """Token by token. q, k, v [B, H, T, D] float32, s [H], state [B, H, D, D] -> (out [B, H, T, D], last state)."""
    decay = (-s).exp()[:, None, None]
    outs = []
    for t in range(q.shape[2]):
        state = state * decay + k[:, :, t].unsqueeze(-1) * v[:, :, t].unsqueeze(-2)
        outs.append((q[:, :, t].unsqueeze(-2) @ state).squeeze(-2))
    return torch.stack(outs, dim=2), state


def lightning_chunked(
    q: Tensor, k: Tensor, v: Tensor, s: Tensor, state: Tensor, chunk: int = CHUNK
) -> tuple[Tensor, Tensor]:
    """The same as `lightning_steps`, chunk by chunk: token i of a chunk reads the state before it decayed i + 1
    times, and the chunk's tokens j <= i decayed i - j times; the state then decays by the chunk's length and takes
    each key decayed to the chunk's end."""
    length = q.shape[2]
    pos = torch.arange(chunk, dtype=torch.float32, device=q.device)
    rate = s.to(q.device)[:, None]
    within = (rate[..., None] * (pos[:, None] - pos[None, :])).masked_fill(pos[:, None] < pos[None, :], float("inf"))
    within = (-within).exp()  # [H, C, C]: e^-s(i-j) for j <= i, 0 above the diagonal
    outs = []
    for first in range(0, length, chunk):
        n = min(chunk, length - first)
        qc, kc, vc = (t[:, :, first : first + n] for t in (q, k, v))
        to_query = (-rate * (pos[:n] + 1)).exp()[..., None]  # [H, n, 1]
        to_end = (-rate * (n - 1 - pos[:n])).exp()[..., None]
        scores = (qc @ kc.transpose(-1, -2)) * within[:, :n, :n]
        outs.append((qc * to_query) @ state + scores @ vc)
        state = state * (-rate * n).exp()[..., None] + (kc * to_end).transpose(-1, -2) @ vc
    return torch.cat(outs, dim=2), state


class LightningAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.heads, self.head_dim = config.num_heads, config.head_dim
        h, inner = config.hidden_size, config.num_heads * config.head_dim
        self.qkv_proj = nn.Linear(h, 3 * inner, bias=False)
        self.output_gate = nn.Linear(h, inner, bias=False)
        self.norm = RMSNorm(inner, NORM_EPS)
        self.out_proj = nn.Linear(inner, h, bias=False)
        # a function of the layer's place alone, not a buffer: nothing to load, and a model built on the meta
        # device keeps them; copied to the activations' device once
        self.slopes = slopes(self.heads, layer, config.num_layers)

    def forward(self, x: Tensor, meta) -> Tensor:  # meta: keel.model.attention.AttentionMetadata
        b, s, _ = x.shape
        qkv = F.silu(self.qkv_proj(x)).view(b, s, self.heads, 3 * self.head_dim)
        spans = None if meta.cache is None else meta.cache.recurrent_spans(self.layer, meta)
        if spans is None:  # whole sequences from an empty state, the batch at once
            out, _ = self._mix(qkv, None)
        else:
            flat = qkv.reshape(b * s, self.heads, 3 * self.head_dim)
            out = flat.new_empty(b * s, self.heads, self.head_dim, dtype=torch.float32)
            out = continue_sequences(self._mix, spans, (flat,), out).view(b, s, self.heads, self.head_dim)
        out = self.norm(out.reshape(b, s, -1).to(x.dtype))
        return self.out_proj(torch.sigmoid(self.output_gate(x)) * out)

    def _mix(self, qkv: Tensor, state: Tensor | None) -> tuple[Tensor, Tensor]:
        """The recurrence over qkv [B, L, H, 3D] from `state` (None: empty) -> (out [B, L, H, D] float32, state)."""
        q, k, v = (t.transpose(1, 2).float() for t in qkv.split(self.head_dim, dim=-1))
        if state is None:
            state = q.new_zeros(q.shape[0], self.heads, self.head_dim, self.head_dim)
        if self.slopes.device != q.device:
            self.slopes = self.slopes.to(q.device)
        rule = lightning_steps if q.shape[2] == 1 else lightning_chunked
        out, state = rule(q, k, v, self.slopes, state)
        return out.transpose(1, 2), state
