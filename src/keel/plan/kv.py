"""KV-cache capacity: how many tokens and sequences a memory budget holds.

The same arithmetic the serving engine sizes its pool with (keel.model.kv_size): whole blocks of
`block_size` tokens over all layers, K and V per KV head, or for multi-head latent attention the
compressed latent and the rope key only; int8 adds one scale per token and head.
"""

from __future__ import annotations

import torch

from keel.config import ModelConfig
from keel.model.kv_size import kv_cache_bytes
from keel.model.recurrent import RecurrentStates


def kv_capacity(
    config: ModelConfig,
    budget_bytes: int,
    dtype: torch.dtype = torch.bfloat16,
    kv_cache_dtype: str = "auto",
    block_size: int = 16,
    context: int | None = None,
) -> dict[str, int]:
    """{"bytes_per_token", "blocks", "tokens", "sequences"} for a budget (sequences of `context`
    tokens, each holding whole blocks; 0 when no context is given). A model without attention layers (Mamba) keeps
    a state per sequence and nothing per token: the sequences whose states fit, one block each (keel.serve.hybrid)."""
    per_block = kv_cache_bytes(config, dtype, kv_cache_dtype, tokens=block_size)
    if not per_block:
        sequences = budget_bytes // RecurrentStates.bytes_per_slot(config, dtype)
        return {"bytes_per_token": 0, "blocks": sequences, "tokens": sequences * (context or 0), "sequences": sequences}
    blocks = budget_bytes // per_block
    sequences = blocks // -(-context // block_size) if context else 0
    return {
        "bytes_per_token": kv_cache_bytes(config, dtype, kv_cache_dtype),
        "blocks": blocks,
        "tokens": blocks * block_size,
        "sequences": sequences,
    }
