"""Mamba 1's selective scan, in float32: the "mamba1" layers of Mamba, Falcon Mamba and Jamba.

Each channel d keeps a state s_d [N] (N the state size). For each token, with step dt_d (after softplus) and
A_d [N] (A < 0):
    s_d <- exp(dt_d A_d) s_d + dt_d x_d B;  y_d = s_d . C
(B and C [N] shared by the channels). Unlike Mamba 2's scalar decay per head (keel.model.ssd), the decay differs per
(channel, state) entry, so the chunk form does not factor into matmuls: `selective_scan` runs a sequence in chunks,
each a parallel prefix scan of the linear recurrence over its tokens (log2 of its length steps of elementwise
products, all decays at most 1, so nothing overflows) from the state the chunk starts with; a single token
(decode) is one step of it. It takes and returns the state, so a sequence can be continued across forwards.
"""

from __future__ import annotations

import torch
from torch import Tensor

CHUNK = 64  # tokens per chunk: a chunk's [B, L, channels, N] decays and inputs are held at once


def selective_scan(
    x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor, state: Tensor, chunk: int = CHUNK
) -> tuple[Tensor, Tensor]:
    """x and dt [B, L, D] (dt after softplus), a [D, N] (A itself, negative), b and c [B, L, N], state [B, D, N] ->
    (y without the D skip [B, L, D], the last state)."""
    outs = []
    for first in range(0, x.shape[1], chunk):
        part = slice(first, first + chunk)
        steps = dt[:, part, :, None]
        decays = (steps * a).exp()  # [B, L, D, N]
        inputs = steps * x[:, part, :, None] * b[:, part, None, :]
        decayed, states = prefix_scan(decays, inputs)
        states = states + decayed * state[:, None]  # the chunk's starting state, decayed to each token
        outs.append((states @ c[:, part, :, None])[..., 0])
        state = states[:, -1]
    return torch.cat(outs, dim=1), state


def prefix_scan(decays: Tensor, inputs: Tensor) -> tuple[Tensor, Tensor]:
    """The recurrence h_t = decays_t h_(t-1) + inputs_t along dim 1 from h = 0, for every t at once (Hillis-Steele:
    after the step of width w, entry t has folded in the w entries before it) -> (the product of the decays up to
    each t, h_t)."""
    width = 1
    while width < decays.shape[1]:
        inputs = torch.cat([inputs[:, :width], decays[:, width:] * inputs[:, :-width] + inputs[:, width:]], dim=1)
        decays = torch.cat([decays[:, :width], decays[:, width:] * decays[:, :-width]], dim=1)
        width *= 2
    return decays, inputs
