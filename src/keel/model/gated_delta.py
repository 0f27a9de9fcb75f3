"""The gated delta rule (Gated DeltaNet: Qwen3.5's and Qwen3-Next's linear-attention layers), in float32.

Each value head keeps a state S [Dk, Dv]. For each token, with decay a = exp(g) and write strength beta:
    S <- a S;  S <- S + k (beta (v - k^T S))^T;  out = q^T S
(q and k L2-normalised, q scaled by Dk^-1/2). `delta_rule_steps` runs it token by token (decode: one token of
many sequences); `delta_rule_chunked` runs a sequence in chunks, each chunk's updates condensed into matmuls by
solving one unit lower-triangular system (the WY form of the DeltaNet papers), then scanned chunk to chunk. Both
take and return the state, so a sequence can be continued across forwards (chunked prefill, then decode).

The decay is per head (g [B, H, T]: Gated DeltaNet) or per key channel (g [B, H, T, Dk]: Kimi Delta Attention, whose
a = exp(g) scales each row of S on its own). Per channel, the chunk's pairwise decays e^(c_i - c_j) differ by channel,
so they are formed as [C, C, Dk] per chunk (exact, and free of the e^-c overflow a factored form would risk).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

CHUNK = 64


def l2_normalise(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (the FLA library's form, which transformers follows)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def prepare(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """float32 [B, H, T, D] q, k, v from [B, T, H*, D], q and k normalised (q also by Dk^-1/2) and repeated over the
    value heads each key head serves (consecutive value heads share a key head)."""
    heads = v.shape[2]
    if k.shape[2] != heads:
        q = q.repeat_interleave(heads // k.shape[2], dim=2)
        k = k.repeat_interleave(heads // k.shape[2], dim=2)
    q, k, v = (t.transpose(1, 2).float() for t in (q, k, v))
    q, k = l2_normalise(q), l2_normalise(k)
    return q * q.shape[-1] ** -0.5, k, v


def delta_rule_steps(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """Token by token. q, k [B, H, T, Dk], v [B, H, T, Dv] (from `prepare`), g [B, H, T] or [B, H, T, Dk] and beta
    [B, H, T] float32, state [B, H, Dk, Dv] float32 -> (out [B, H, T, Dv], the state after the last token)."""
    outs = []
    for t in range(q.shape[2]):
        a = g[:, :, t].exp()
        state = state * (a[..., None] if g.dim() == 4 else a[..., None, None])
        k_t = k[:, :, t]
        remembered = (k_t.unsqueeze(-1) * state).sum(dim=-2)  # k^T S: [B, H, Dv]
        delta = (v[:, :, t] - remembered) * beta[:, :, t].unsqueeze(-1)
        state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        outs.append((q[:, :, t].unsqueeze(-1) * state).sum(dim=-2))
    return torch.stack(outs, dim=2), state


def delta_rule_chunked(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, chunk: int = CHUNK
) -> tuple[Tensor, Tensor]:
    """The same result as `delta_rule_steps`, chunk by chunk: within a chunk, with cumulative log decays c_t, the
    writes u solve (I + L) u = beta v and the decayed keys w solve (I + L) w = beta e^c k, where L is the strictly lower
    part of beta_i (k_i . k_j) e^(c_i - c_j); each chunk then reads the state once and updates it once."""
    if g.dim() == 4:
        return _per_channel_chunked(q, k, v, g, beta, state, chunk)
    b, h, length, dk = k.shape
    pad = (chunk - length % chunk) % chunk
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    n = (length + pad) // chunk
    q, k, v = (t.reshape(b, h, n, chunk, t.shape[-1]) for t in (q, k, v))
    g, beta = g.reshape(b, h, n, chunk), beta.reshape(b, h, n, chunk)
    cum = g.cumsum(dim=-1)
    future = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    # e^(c_i - c_j) for j <= i (the decay from token j to token i), 0 above the diagonal
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(future, float("-inf")).exp()
    k_beta = k * beta.unsqueeze(-1)
    system = (k_beta @ k.transpose(-1, -2)) * decay  # unit diagonal taken below: only its strictly lower part counts
    writes = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    decayed_keys = torch.linalg.solve_triangular(
        system, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True
    )
    within = (q @ k.transpose(-1, -2)) * decay  # causal scores inside the chunk, diagonal included
    q_decayed = q * cum.exp().unsqueeze(-1)
    k_to_end = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    out = torch.empty_like(writes)
    for i in range(n):
        fresh = writes[:, :, i] - decayed_keys[:, :, i] @ state  # what the state does not already predict
        out[:, :, i] = q_decayed[:, :, i] @ state + within[:, :, i] @ fresh
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ fresh
    return out.reshape(b, h, n * chunk, -1)[:, :, :length], state


def _per_channel_chunked(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, chunk: int
) -> tuple[Tensor, Tensor]:
    """`delta_rule_chunked` with a decay per key channel (g [B, H, T, Dk]): the same systems, each pairwise product
    summed over channels with that channel's decay; a chunk's [C, C, Dk] decays are formed one chunk at a time to
    bound memory."""
    b, h, length, dk = k.shape
    pad = (chunk - length % chunk) % chunk
    if pad:
        q, k, v, g = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    n = (length + pad) // chunk
    q, k, v, g = (t.reshape(b, h, n, chunk, t.shape[-1]) for t in (q, k, v, g))
    beta = beta.reshape(b, h, n, chunk).unsqueeze(-1)
    cum = g.cumsum(dim=-2)  # [B, H, n, C, Dk]
    future = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    out = v.new_empty(b, h, n, chunk, v.shape[-1])
    for i in range(n):
        c, k_i, q_i = cum[:, :, i], k[:, :, i], q[:, :, i]
        # e^(c_i - c_j) per channel for j <= i, 0 above the diagonal: [B, H, C, C, Dk]
        decay = (c.unsqueeze(-2) - c.unsqueeze(-3)).masked_fill(future[..., None], float("-inf")).exp()
        k_beta = k_i * beta[:, :, i]
        system = (k_beta.unsqueeze(-2) * k_i.unsqueeze(-3) * decay).sum(-1)
        writes = torch.linalg.solve_triangular(system, v[:, :, i] * beta[:, :, i], upper=False, unitriangular=True)
        decayed_keys = torch.linalg.solve_triangular(system, k_beta * c.exp(), upper=False, unitriangular=True)
        within = (q_i.unsqueeze(-2) * k_i.unsqueeze(-3) * decay).sum(-1)
        fresh = writes - decayed_keys @ state
        out[:, :, i] = (q_i * c.exp()) @ state + within @ fresh
        end = c[..., -1:, :]  # [B, H, 1, Dk]
        state = state * end.transpose(-1, -2).exp() + (k_i * (end - c).exp()).transpose(-1, -2) @ fresh
    return out.reshape(b, h, n * chunk, -1)[:, :, :length], state
