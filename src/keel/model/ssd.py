"""Mamba 2's state-space recurrence (the SSD form), in float32: GraniteMoeHybrid's (Granite 4.0-H's) mamba layers.

Each head h keeps a state S [P, N] (P the head's channels, N the state size). For each token, with step
dt = softplus(dt_raw + dt_bias) clamped to the layer's limits and decay a = exp(dt A_h) (A_h < 0):
    S <- a S + dt x B^T;  y = S C + D_h x
(B and C [N] shared by the heads of one group). `ssd_steps` runs it token by token (decode: one token of many
sequences); `ssd_chunked` runs a sequence in chunks: inside a chunk the outputs are a causal, decay-weighted
product (C_t . B_s) over its tokens plus each token's read of the state the chunk starts from, and the state passes
from chunk to chunk. Both take and return the state, so a sequence can be continued across forwards.
"""

from __future__ import annotations

import torch
from torch import Tensor

CHUNK = 64


def ssd_steps(x: Tensor, dt: Tensor, a_log: Tensor, b: Tensor, c: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """x [B, H, T, P], dt [B, H, T] (after softplus and limits), a_log [H] (A = -exp(a_log)), b and c [B, H, T, N]
    (groups repeated over their heads), state [B, H, P, N] -> (y without the D skip [B, H, T, P], the last state)."""
    a = -a_log.float().exp()
    outs = []
    for t in range(x.shape[2]):
        step = dt[:, :, t]
        decay = (step * a).exp()[..., None, None]
        state = state * decay + (step[..., None] * x[:, :, t]).unsqueeze(-1) * b[:, :, t].unsqueeze(-2)
        outs.append(state @ c[:, :, t].unsqueeze(-1))
    return torch.cat(outs, dim=-1).transpose(-1, -2), state


def ssd_chunked(
    x: Tensor, dt: Tensor, a_log: Tensor, b: Tensor, c: Tensor, state: Tensor, chunk: int = CHUNK
) -> tuple[Tensor, Tensor]:
    """`ssd_steps`' result, chunk by chunk (same arguments)."""
    a = -a_log.float().exp()
    length = x.shape[2]
    outs = []
    for first in range(0, length, chunk):
        end = min(first + chunk, length)
        xs, steps, bs, cs = x[:, :, first:end], dt[:, :, first:end], b[:, :, first:end], c[:, :, first:end]
        cum = (steps * a[:, None]).cumsum(dim=-1)  # [B, H, L]: log decay from the chunk's start to each token
        future = torch.ones(end - first, end - first, dtype=torch.bool, device=x.device).triu(1)
        decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(future, float("-inf")).exp()  # token s -> t
        inputs = xs * steps.unsqueeze(-1)  # dt x
        y = ((cs @ bs.transpose(-1, -2)) * decay) @ inputs  # within the chunk
        y = y + (cs @ state.transpose(-1, -2)) * cum.exp().unsqueeze(-1)  # the starting state's part
        outs.append(y)
        to_end = (cum[..., -1:] - cum).exp().unsqueeze(-1)  # decay from each token to the chunk's end
        state = state * cum[..., -1].exp()[..., None, None] + (inputs * to_end).transpose(-1, -2) @ bs
    return torch.cat(outs, dim=2), state
