"""A contiguous KV cache: one [B, H_kv, max_len, D] buffer per layer, indexed by position.

Used by single-sequence generation and the decode benchmark. The serving engine's paged cache
implements the same `KVCache.attend` contract over fixed-size blocks. For multi-head latent
attention (config.is_mla) each layer keeps one [B, 1, max_len, R + P] buffer instead, the latent
and the rope key of each token, and no values (`attend_latent`).
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
        self.max_len = max_len
        self.latent_rank = config.kv_lora_rank
        if config.is_mla:  # one shared row per token: [latent, rope key]
            shape = (batch, 1, max_len, config.kv_lora_rank + config.qk_rope_head_dim)
            self.values: list[Tensor] = []
        else:
            shape = (batch, config.num_kv_heads, max_len, config.head_dim)
            self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
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

    def _store(self, cache: Tensor, new: Tensor, meta: AttentionMetadata, rows: Tensor | None) -> None:
        """Write `new` ([B, S, H, D]) at the slots of its positions in `cache` ([B, H, max_len, D])."""
        if rows is None:
            cache.index_copy_(2, meta.positions[0], new.transpose(1, 2))
        else:
            # [B, S] positions per row: advanced indexing puts each row's tokens at its own slots.
            cache.permute(0, 2, 1, 3)[rows, meta.positions] = new

    def attend(
        self, layer: int, q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata, window: int | None
    ) -> Tensor:
        visible, rows = self._prepare(meta)
        k_cache, v_cache = self.keys[layer], self.values[layer]
        self._store(k_cache, k, meta, rows)
        self._store(v_cache, v, meta, rows)
        # Slot i holds position i; slots past a row's own tokens are masked as "after the query".
        mask = meta.mask(self._key_positions[:visible], window)
        return sdpa(q, k_cache[:, :, :visible], v_cache[:, :, :visible], mask)

    def attend_latent(self, layer: int, q: Tensor, kv: Tensor, meta: AttentionMetadata, scale: float) -> Tensor:
        visible, rows = self._prepare(meta)
        cache = self.keys[layer]
        self._store(cache, kv, meta, rows)
        rows_seen = cache[:, :, :visible]
        mask = meta.mask(self._key_positions[:visible], None)
        # The value of a token is its latent: the first R channels of its row.
        return sdpa(q, rows_seen, rows_seen[..., : self.latent_rank], mask, scale=scale)
