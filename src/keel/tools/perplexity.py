"""Perplexity of a token sequence under a model (a single window; `keel eval` adds striding)."""

from __future__ import annotations

import math

import torch

from keel.model.loss import cross_entropy_loss
from keel.model.transformer import Transformer


@torch.inference_mode()
def perplexity(model: Transformer, token_ids: list[int]) -> float:
    """exp(mean negative log-likelihood of tokens 1..N-1 given their prefixes)."""
    if len(token_ids) < 2:
        raise ValueError("perplexity needs at least two tokens")
    if len(token_ids) > model.config.max_position_embeddings:
        raise ValueError(f"{len(token_ids)} tokens exceed the context of {model.config.max_position_embeddings}")
    tokens = torch.tensor([token_ids], device=model.device)
    return perplexity_of_logits(model(tokens), tokens)


def perplexity_of_logits(logits: torch.Tensor, tokens: torch.Tensor) -> float:
    """The same from logits [B, N, V] already computed for tokens [B, N]."""
    return math.exp(cross_entropy_loss(logits[:, :-1], tokens[:, 1:]).item())
