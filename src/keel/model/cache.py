"""A contiguous KV cache: one [B, H_kv, max_len, D] buffer per layer, indexed by position.

Used by single-sequence generation and the decode benchmark. The serving engine's paged cache
implements the same `KVCache.attend` contract over fixed-size blocks.
"""

from __future__ import annotations

import torch
from torch import Tensor

from keel.config import ModelConfig
from keel.model.attention import AttentionMetadata, sdpa


class ContiguousKVCache:
    def __init__(
        self,
        config: ModelConfig,
        batch: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (batch, config.num_kv_heads, max_len, config.head_dim)
        self.max_len = max_len
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self._key_positions = torch.arange(max_len, device=device)

    def _prepare(self, meta: AttentionMetadata) -> tuple[int, Tensor | None]:
        """Per forward (not per layer): how many slots are visible, and how rows are addressed."""
        if meta.cache_plan is None:
            visible = int(meta.positions.max()) + 1
            if visible > self.max_len:
                raise ValueError(f"position {visible - 1} is beyond the KV cache length {self.max_len}")
            positions = meta.positions
            # All rows at the same positions (batch 1, or aligned batches): one index_copy_ suffices.
            same_rows = positions.shape[0] == 1 or bool((positions == positions[:1]).all())
            rows = None if same_rows else torch.arange(positions.shape[0], device=positions.device).unsqueeze(1)
            meta.cache_plan = (visible, rows)
        return meta.cache_plan

    def attend(
        self, layer: int, q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata, window: int | None
    ) -> Tensor:
        visible, rows = self._prepare(meta)
        k_cache, v_cache = self.keys[layer], self.values[layer]
        if rows is None:
            index = meta.positions[0]
            k_cache.index_copy_(2, index, k.transpose(1, 2))
            v_cache.index_copy_(2, index, v.transpose(1, 2))
        else:
            # [B, S] positions per row: advanced indexing puts each row's tokens at its own slots.
            k_cache.permute(0, 2, 1, 3)[rows, meta.positions] = k
            v_cache.permute(0, 2, 1, 3)[rows, meta.positions] = v
        # Slot i holds position i; slots past a row's own tokens are masked as "after the query".
        mask = meta.mask(self._key_positions[:visible], window)
        return sdpa(q, k_cache[:, :, :visible], v_cache[:, :, :visible], mask)
