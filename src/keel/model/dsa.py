"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): the lightning indexer that picks, for each query, the keys
multi-head latent attention (keel.model.mla) may attend to.

Per token the indexer projects an index query of `index_n_heads` heads from the query's low-rank latent
(q_a_layernorm's output; `wq_b`), one index key (`wk`, then a LayerNorm `k_norm`) and a weight per head
(`weights_proj`); the first qk_rope_head_dim channels of both are rotated (DeepSeek-V3.2: halves, GLM-5: interleaved
pairs; the same cos/sin as the attention's). A key's score for a query is

    sum_h w[h] * n_heads^-0.5 * relu(q[h] . k * index_head_dim^-0.5)

and the query attends to the `index_topk` visible keys that score highest (all of them where it sees no more):
an attention mask, so with contexts of at most index_topk tokens the layer is dense latent attention exactly. As
in transformers (and DeepSeek's release, whose indexer learns from a separate KL loss), the selection is computed
without gradients: training through keel leaves the indexer's weights where they are.

The index keys are kept by the cache beside the latent rows (`IndexQuery`, `PagedKVCache.attend_latent`). GLM-5's
"shared" layers have no indexer and reuse the selection of the last full layer before them
(ModelConfig.indexer_types).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from keel.config import ModelConfig
from keel.model.layers import apply_rotary

# transformers' and DeepSeek's indexer builds k_norm with LayerNorm's eps 1e-6, whatever the config's.
INDEX_NORM_EPS = 1e-6


@dataclass
class IndexQuery:
    """A DSA layer's indexer inputs for the cache: index queries q [B, S, Hi, D] and their head weights w [B, S, Hi]
    (float32, n_heads^-0.5 folded in), the step's index keys k [B, S, 1, D] to store (None on a shared layer),
    `source` (the layer whose stored keys and selection are used) and `topk`."""

    q: Tensor | None
    w: Tensor | None
    k: Tensor | None
    source: int
    topk: int


class Indexer(nn.Module):
    """The lightning indexer of one DSA layer; transformers' parameter names (`self_attn.indexer.*`)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.interleaved = config.index_rope_interleave
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=INDEX_NORM_EPS)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)

    def forward(self, x: Tensor, q_latent: Tensor, rope: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, S, h] and the query latent [B, S, q_lora_rank] -> index queries [B, S, Hi, D], keys [B, S, 1, D]
        (rotated) and float32 head weights [B, S, Hi]."""
        b, s, _ = x.shape
        q = self.wq_b(q_latent).view(b, s, self.n_heads, self.head_dim)
        k = self.k_norm(self.wk(x)).unsqueeze(2)
        cos, sin = rope
        q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        w = self.weights_proj(x).float() * self.n_heads**-0.5
        return q, k, w

    def _rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        rot, rest = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        if self.interleaved:  # pairs side by side: evens then odds (q and k alike, so q.k is unchanged)
            rot = torch.cat((rot[..., 0::2], rot[..., 1::2]), dim=-1)
        return torch.cat((apply_rotary(rot, cos, sin), rest), dim=-1)


def index_scores(q: Tensor, w: Tensor, k: Tensor) -> Tensor:
    """Index queries q [B, S, Hi, D] with weights w [B, S, Hi] against keys k [B, L, D] -> float32 scores
    [B, S, L]: sum_h w[h] relu(q[h] . k / sqrt(D)) (transformers' order: the relu'd scores, then the weighted sum)."""
    scores = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * q.shape[-1] ** -0.5
    return torch.matmul(w.unsqueeze(-2), scores.relu()).squeeze(-2)


@torch.no_grad()
def top_k_mask(scores: Tensor, allowed: Tensor, topk: int) -> Tensor:
    """[B, S, L] boolean, True = attend: of the keys `allowed` [B, S, L] (causal) lets each query see, the `topk`
    best-scoring ones (every one where it sees no more)."""
    if scores.shape[-1] <= topk:
        return allowed
    best = scores.masked_fill(~allowed, float("-inf")).topk(topk, dim=-1).indices
    return torch.zeros_like(allowed).scatter_(-1, best, True) & allowed


@torch.no_grad()
def select_keys(index: IndexQuery, keys: Tensor, allowed: Tensor) -> Tensor:
    """The selection [B, S, L] of queries `index.q` over index keys [B, L, D] they may see where `allowed`."""
    return top_k_mask(index_scores(index.q, index.w, keys), allowed, index.topk)
