"""The reference generator, the oracle the serving engine is tested against: single-sequence generation
over a contiguous KV cache, with none of the engine's machinery (paging, scheduling, batching).

`ContiguousKVCache` implements the model's `KVCache.attend` contract with one [B, H_kv, max_len, D]
buffer per layer, indexed by position (the serving engine's paged cache implements the same
contract over fixed-size blocks). For multi-head latent attention (config.is_mla) each layer keeps
one [B, 1, max_len, R + P] buffer instead, the latent and the rope key of each token, and no values
(`attend_latent`).

`stream_tokens`: one prefill, then one token per forward, with the engine's sampler. The serving
engine is what `keel generate` and the server use; this path is the baseline it is tested against
and bench/decode.py's subject (keel's model forward at batch 1, without the engine).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from keel.config import ModelConfig
from keel.errors import KeelError
from keel.model.attention import AttentionMetadata, alibi_bias, explicit_attention, sdpa
from keel.model.attention import visible as visible_to
from keel.model.dsa import IndexQuery, select_keys
from keel.model.recurrent import RecurrentSpans, RecurrentStates
from keel.model.transformer import Transformer
from keel.serve.sampling import RowState, Sampler, SamplingParams, request_generator


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
        self.softcap = config.attn_logit_softcapping  # Gemma 2's attention-score soft-capping
        if config.is_mla:  # one shared row per token: [latent, rope key]
            shapes = [(batch, 1, max_len, config.kv_lora_rank + config.qk_rope_head_dim)] * config.num_layers
        else:  # each layer's own KV heads and head width (Gemma 4's full-attention layers)
            shapes = [
                (batch, config.layer_num_kv_heads(i), max_len, config.layer_head_dim(i))
                for i in range(config.num_layers)
            ]
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]
        # values at each layer's own width (MiMo-V2-Flash's are narrower than its keys)
        self.values: list[Tensor] = (
            [k.new_zeros(*k.shape[:-1], config.layer_v_head_dim(i)) for i, k in enumerate(self.keys)]
            if not config.is_mla
            else []
        )
        self._key_positions = torch.arange(max_len, device=device)
        # DeepSeek Sparse Attention: each indexing layer's index keys [B, 1, max_len, index_head_dim]
        self.index_keys = {
            i: torch.zeros(batch, 1, max_len, config.index_head_dim, dtype=dtype, device=device)
            for i in config.dsa_index_layers()
        }
        # recurrent layers (Qwen3.5, LFM2): one state slot per row
        self.recurrent = RecurrentStates(config, batch, dtype, device) if config.has_recurrent_layers else None

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
            if self.recurrent is not None:  # rows that start their sequence start from empty states
                self.recurrent.reset([b for b, first in enumerate(positions[:, 0].tolist()) if first == 0])
        return meta.cache_plan

    def _store(self, cache: Tensor, new: Tensor, meta: AttentionMetadata, rows: Tensor | None) -> None:
        """Write `new` ([B, S, H, D]) at the slots of its positions in `cache` ([B, H, max_len, D])."""
        if rows is None:
            cache.index_copy_(2, meta.positions[0], new.transpose(1, 2))
        else:
            # [B, S] positions per row: advanced indexing puts each row's tokens at its own slots.
            cache.permute(0, 2, 1, 3)[rows, meta.positions] = new

    def attend(
        self,
        layer: int,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        meta: AttentionMetadata,
        window: int | None,
        sinks: Tensor | None = None,
        alibi: Tensor | None = None,
    ) -> Tensor:
        _, rows = self._prepare(meta)
        self._store(self.keys[layer], k, meta, rows)
        self._store(self.values[layer], v, meta, rows)
        return self.attend_stored(layer, q, meta, window, sinks, alibi)

    def attend_stored(
        self,
        layer: int,
        q: Tensor,
        meta: AttentionMetadata,
        window: int | None,
        sinks: Tensor | None = None,
        alibi: Tensor | None = None,
    ) -> Tensor:
        visible, _ = self._prepare(meta)
        k_cache, v_cache = self.keys[layer], self.values[layer]
        # Slot i holds position i; slots past a row's own tokens are masked as "after the query".
        mask = meta.mask(self._key_positions[:visible], window)
        if self.softcap is not None or sinks is not None or alibi is not None:
            keys, values = k_cache[:, :, :visible], v_cache[:, :, :visible]
            bias = None
            if alibi is not None:  # ALiBi: each head's slope times the distance from the query (slot i: position i)
                q_at = meta.positions[:, None, :, None]
                bias = alibi_bias(alibi.view(1, -1, 1, 1), q_at, self._key_positions[:visible].view(1, 1, 1, -1))
            return explicit_attention(q, keys, values, mask, self.softcap, sinks=sinks, bias=bias)
        return sdpa(q, k_cache[:, :, :visible], v_cache[:, :, :visible], mask)

    def recurrent_spans(self, layer: int, meta: AttentionMetadata) -> RecurrentSpans:
        """Row b is sequence b in slot b: a chunk of its S tokens, or one decode token of each row."""
        self._prepare(meta)
        batch, length = meta.positions.shape
        if length == 1:
            rows = torch.arange(batch, device=meta.positions.device)
            return self.recurrent.spans(layer, [], rows, rows)
        return self.recurrent.spans(layer, [(b * length, (b + 1) * length, b) for b in range(batch)])

    def attend_latent(
        self, layer: int, q: Tensor, kv: Tensor, meta: AttentionMetadata, scale: float, index: IndexQuery | None = None
    ) -> Tensor:
        visible, rows = self._prepare(meta)
        cache = self.keys[layer]
        self._store(cache, kv, meta, rows)
        rows_seen = cache[:, :, :visible]
        mask = meta.mask(self._key_positions[:visible], None)
        if index is not None:  # DSA: the visible keys the indexer selects (its source layer's, kept per forward)
            if index.source not in meta.index_masks:
                self._store(self.index_keys[layer], index.k, meta, rows)
                allowed = visible_to(meta.positions.unsqueeze(-1), self._key_positions[:visible], None)
                keep = select_keys(index, self.index_keys[layer][:, 0, :visible], allowed)
                meta.index_masks[index.source] = keep.unsqueeze(1)
            mask = meta.index_masks[index.source]
        # The value of a token is its latent: the first R channels of its row.
        return sdpa(q, rows_seen, rows_seen[..., : self.latent_rank], mask, scale=scale)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0  # from the first generated token to the last
    finish_reason: str = ""  # "stop" (EOS) or "length"
    token_ids: list[int] = field(default_factory=list)

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        steps = self.generated_tokens - 1  # the first token comes out of the prefill
        return steps / self.decode_seconds if steps > 0 and self.decode_seconds else 0.0


@torch.inference_mode()
def stream_tokens(
    model: Transformer,
    prompt_ids: list[int],
    params: SamplingParams,
    eos_token_ids: list[int] | None = None,
    stats: GenerationStats | None = None,
) -> Iterator[int]:
    """Yield generated token ids one at a time (prefill once, then KV-cached decode)."""
    params.validate()
    context = model.config.max_position_embeddings
    if not prompt_ids:
        raise KeelError("the prompt is empty")
    if len(prompt_ids) >= context:
        raise KeelError(f"prompt has {len(prompt_ids)} tokens; the model's context is {context} tokens")
    max_new = min(params.max_tokens, context - len(prompt_ids))
    stats = stats if stats is not None else GenerationStats()
    stats.prompt_tokens = len(prompt_ids)
    stats.token_ids = []
    eos = set() if params.ignore_eos else set(eos_token_ids or [])
    sampler = Sampler()
    state = RowState(params, request_generator(params, model.device), prompt_ids, stats.token_ids, list(eos))

    device = model.device
    cache = ContiguousKVCache(model.config, 1, len(prompt_ids) + max_new, model.dtype, device)
    tokens = torch.tensor([prompt_ids], device=device)
    start = time.perf_counter()
    logits = model(tokens, positions=torch.arange(len(prompt_ids), device=device)[None], cache=cache, last_only=True)
    token = int(sampler(logits[:, -1], [state]).token_ids[0])
    stats.prefill_seconds = time.perf_counter() - start
    decode_start = time.perf_counter()
    position = len(prompt_ids)
    while True:
        stats.generated_tokens += 1
        stats.token_ids.append(token)
        stats.decode_seconds = time.perf_counter() - decode_start
        yield token
        if token in eos:
            stats.finish_reason = "stop"
            return
        if stats.generated_tokens >= max_new:
            stats.finish_reason = "length"
            return
        step = torch.tensor([[token]], device=device)
        logits = model(step, positions=torch.tensor([[position]], device=device), cache=cache, last_only=True)
        token = int(sampler(logits[:, -1], [state]).token_ids[0])
        position += 1
