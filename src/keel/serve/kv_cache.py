"""The paged KV store (`PagedKVCache`): every layer's K/V rows in fixed-size blocks, and attention over them.

Which blocks a sequence holds is the block manager's business (keel.serve.kv_blocks); this module
holds the tensors: it writes a packed step's new rows into their slots and attends each query over
the blocks of its sequence, as the runner's `StepPlan` describes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from keel.config import ModelConfig
from keel.kernels import triton_paged
from keel.model.attention import AttentionMetadata, alibi_bias, sink_softmax, softcap_scores, visible
from keel.model.dsa import IndexQuery, select_keys
from keel.model.recurrent import RecurrentSpans, RecurrentStates
from keel.serve.attention_backends import attend_causal, attend_chunk, attention_backend
from keel.serve.staging import to_device


def write_rows(store: Tensor, slots: Tensor, rows: Tensor) -> None:
    """A step's new rows [1, T, H_kv, D] into their flat slots [T] of one layer's store [H_kv, slots, D]
    (rounded to the store's dtype: a bfloat16 cache of a float32 model)."""
    store.index_copy_(1, slots, rows[0].transpose(0, 1).to(store.dtype))


def gather_blocks(store: Tensor, tables: Tensor, block_size: int) -> Tensor:
    """One layer's store [H_kv, slots, D] and block ids [B, nb] -> [H_kv, B, nb * block_size, D]
    (one index_select, contiguous)."""
    heads, dim = store.shape[0], store.shape[2]
    rows = store.view(heads, -1, block_size * dim).index_select(1, tables.flatten())
    return rows.view(heads, tables.shape[0], -1, dim)


def decode_mask(positions: Tensor, num_keys: int, window: int | None) -> Tensor:
    """[B, L] boolean, True = attend: key slot k of a gathered table against each query position."""
    q = positions.view(-1, 1)
    return visible(q, torch.arange(num_keys, device=q.device).view(1, -1), window)


def attend_decode_rows(
    rows: Tensor,
    keys: Tensor,
    values: Tensor,
    mask: Tensor,
    scale: float,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    alibi: Tensor | None = None,
    positions: Tensor | None = None,
) -> Tensor:
    """Attention of one-token queries rows [H, B, D] over their gathered keys [H_kv, B, L, D] and
    values [H_kv, B, L, Dv] where mask [B, L] allows -> [H, B, Dv], the scaled scores soft-capped at
    `softcap` when set (Gemma 2), each head's softmax sink counted where `sinks` [H] is given (GPT-OSS), each
    score biased by ALiBi where `alibi` [H] (slopes) is given with the rows' `positions` [B] (gathered key slot l
    is position l).
    Shared by the eager paged cache and the compiled decode step (keel.serve.compiled_decode), so both
    compute the same numbers.

    One-token queries: batched matmuls and a float32 softmax beat SDPA's CPU kernel here (measured in
    docs/BENCHMARKS.md, "int8 KV cache"). Rows stored in another dtype (a bfloat16 cache) are read as the
    queries' dtype."""
    keys, values = keys.to(rows.dtype), values.to(rows.dtype)
    kv_heads, heads, dim = keys.shape[0], rows.shape[0], rows.shape[-1]
    qd = rows.view(kv_heads, heads // kv_heads, -1, dim).transpose(1, 2)  # [Hkv, B, G, D]
    scores = torch.matmul(qd, keys.transpose(-1, -2)).float() * scale  # [Hkv, B, G, L]
    if softcap:
        scores = softcap_scores(scores, softcap)
    if alibi is not None:
        keys_at = torch.arange(keys.shape[2], device=rows.device)
        slopes = alibi.view(kv_heads, 1, heads // kv_heads, 1)
        scores = scores + alibi_bias(slopes, positions.view(1, -1, 1, 1), keys_at.view(1, 1, 1, -1))
    scores.masked_fill_(~mask[None, :, None, :], float("-inf"))
    column = None if sinks is None else sinks.view(kv_heads, 1, heads // kv_heads, 1)
    probs = sink_softmax(scores, column).to(values.dtype)
    out = torch.matmul(probs, values)  # [Hkv, B, G, Dv]
    return out.transpose(1, 2).reshape(heads, -1, values.shape[-1])


def length_groups(lengths: list[int], ratio: float = 1.25, max_groups: int = 4) -> list[list[int]]:
    """Indices of decode rows grouped by length (block-table width), so that each group is padded only
    to its own longest table: sorted by length, a new group starts when a row is over `ratio` x the
    group's first (or past `max_groups` groups). Shared by the eager paged cache's plan and the
    compiled decode step, so both attend the same groups."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        if groups and (lengths[i] <= ratio * lengths[groups[-1][0]] or len(groups) == max_groups):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


@dataclass
class DecodeGroup:
    """Single-token queries of sequences with similar lengths, attended as one batch."""

    index: Tensor  # [Bg] rows of the packed step
    tables: Tensor  # [Bg, nb] block tables, padded with block 0 (masked by position)
    positions: Tensor  # [Bg] position of each query token
    whole_step: bool = False  # the group is every row of the step, in order (index = 0..T-1)


@dataclass
class PagedRows:
    """Every token of a step as keel's paged-attention kernel reads it: its sequence's block table
    (tables[table_of[t]], int32, padded with block 0 past what it may see) and its position."""

    tables: Tensor  # [S, nb] int32
    table_of: Tensor  # [T] int64
    positions: Tensor  # [T] int64


@dataclass
class InPlaceLayer:
    """What `PagedKVCache.in_place` hands an operator that writes and attends in one call."""

    keys: Tensor  # [H_kv, slots, D]
    values: Tensor
    slots: Tensor  # [T] int64: where each token's K/V go
    rows: PagedRows
    block_size: int
    key_scales: Tensor | None = None  # int8 stores' float16 scales [H_kv, slots, 1] (keel.serve.kv_quant)
    value_scales: Tensor | None = None


def paged_rows(plan: StepPlan, num_tokens: int) -> PagedRows:
    """The plan's decode groups and prefill chunks as one `PagedRows` (built once per step)."""
    if not plan.prefills and len(plan.decodes) == 1 and plan.decodes[0].whole_step:
        # Every row a decode, in order (batch-1 decode, most decode steps): the group's own tensors, not
        # a dozen small ops that, on caches the step's weights sweep, cost a measurable share of a step.
        group = plan.decodes[0]
        return PagedRows(group.tables.cpu().to(torch.int32), torch.arange(num_tokens), group.positions.cpu())
    tables: list[Tensor] = []  # [rows, width] each: a decode group's (padded already), a chunk's
    table_of = torch.zeros(num_tokens, dtype=torch.long)
    positions = torch.zeros(num_tokens, dtype=torch.long)
    count = 0
    for group in plan.decodes:
        index = group.index.cpu()
        table_of[index] = torch.arange(count, count + len(index))
        positions[index] = group.positions.cpu()
        tables.append(group.tables.cpu())
        count += len(index)
    for chunk in plan.prefills:
        table_of[chunk.start : chunk.end] = count
        positions[chunk.start : chunk.end] = chunk.positions.cpu()
        tables.append(chunk.table.cpu()[None])
        count += 1
    width = max(t.shape[1] for t in tables)
    padded = torch.cat([F.pad(t, (0, width - t.shape[1])) for t in tables]).to(torch.int32)
    return PagedRows(padded, table_of, positions)


def kernel_attends(store: Tensor, head_dim: int, block_size: int) -> bool:
    """Whether keel's C++ paged-attention kernel reads this store (keel.serve.attention_backends decides:
    CPU, float32/bf16/int8 rows, head dim <= 576, blocks <= 64 tokens, outside a compile trace)."""
    return attention_backend(store, head_dim, block_size) == "kernels"


class PrefillChunk(NamedTuple):
    """A multi-token chunk of one sequence in a packed step (a prefill chunk, or a token and its drafts)."""

    start: int  # the chunk's rows [start, end) of the packed step
    end: int
    table: Tensor  # the sequence's visible blocks [nb]
    positions: Tensor  # the chunk's query positions [C]
    keys: int  # keys the chunk's last token sees (its position + 1): the chunk's gathered rows end there


class FreshChunks(NamedTuple):
    """Chunks that start their sequences (each sees only its own rows), padded at the end to one length
    and attended as one batch with a plain causal mask: padding rows follow every real row, so no real
    query sees them."""

    chunks: list[int]  # their indices in StepPlan.prefills
    length: int  # the longest chunk's: every chunk padded to it
    rows: Tensor  # [N * length] the step's row of each padded query (padding: the chunk's first row)
    slots: Tensor  # [N * length] the store slot of each padded key (padding: the chunk's first slot)
    valid: Tensor  # [n] the real entries' places in the padded [N * length]
    valid_rows: Tensor  # [n] their rows of the step


def fresh_batches(prefills: list[PrefillChunk], slot_mapping: Tensor, waste: float = 2.0) -> list[FreshChunks]:
    """Chunks that start at position 0, longest first, grouped while the padded size stays within `waste`
    times the group's real tokens; groups of one are left to the per-chunk path."""
    fresh = sorted(
        (i for i, c in enumerate(prefills) if c.keys == c.end - c.start),
        key=lambda i: prefills[i].start - prefills[i].end,
    )
    groups: list[list[int]] = []
    for i in fresh:
        size = prefills[i].end - prefills[i].start
        group = groups[-1] if groups else None
        longest = prefills[group[0]].end - prefills[group[0]].start if group else 0
        real = sum(prefills[j].end - prefills[j].start for j in group) if group else 0
        if group and (len(group) + 1) * longest <= waste * (real + size):
            group.append(i)
        else:
            groups.append([i])
    batches = []
    for group in groups:
        if len(group) < 2:
            continue
        length = prefills[group[0]].end - prefills[group[0]].start
        rows, valid, valid_rows = [], [], []
        for n, i in enumerate(group):
            c = prefills[i]
            own = list(range(c.start, c.end))
            rows += own + [c.start] * (length - len(own))
            valid += range(n * length, n * length + len(own))
            valid_rows += own
        device = slot_mapping.device
        row_index = to_device(rows, torch.int64, device)
        batches.append(
            FreshChunks(
                group, length, row_index, slot_mapping.index_select(0, row_index),
                to_device(valid, torch.int64, device), to_device(valid_rows, torch.int64, device),
            )
        )  # fmt: skip
    return batches


def attend_fresh_chunks(
    queries: Tensor, k_store: Tensor, v_store: Tensor | None, fresh: FreshChunks, v_dim: int, scale: float | None
) -> Tensor:
    """queries [H, T, D] of a step; the batch's chunks attended causally over their own stored rows
    -> [H, n, Dv] for its real rows (`fresh.valid_rows`). Without a value store (MLA) a row's value is
    its first `v_dim` channels."""
    heads, dim = queries.shape[0], queries.shape[-1]
    count, length = len(fresh.chunks), fresh.length
    q = queries.index_select(1, fresh.rows).view(heads, count, length, dim).transpose(0, 1)
    keys = k_store.index_select(1, fresh.slots)
    keys = keys.view(keys.shape[0], count, length, keys.shape[-1]).transpose(0, 1)  # [N, Hkv, L, D]
    if v_store is None:
        values = keys[..., :v_dim]
    else:
        values = v_store.index_select(1, fresh.slots)
        values = values.view(values.shape[0], count, length, v_dim).transpose(0, 1)
    out = attend_causal(q, keys, values, scale)  # [N, H, L, Dv]
    return out.transpose(0, 1).reshape(heads, count * length, v_dim).index_select(1, fresh.valid)


@dataclass
class RecurrentPlan:
    """Which state slot each sequence of a packed step continues (the runner's), for the recurrent layers:
    multi-token chunks as (first row, end row, slot), the one-token decodes as rows and slots, and the slots of
    sequences that start at position 0 (emptied before the forward)."""

    chunks: list[tuple[int, int, int]]
    decode_rows: Tensor | None
    decode_slots: Tensor | None
    fresh: list[int]


@dataclass
class StepPlan:
    """How the tokens of one packed step map onto the paged cache (built by the runner).

    Tokens of all scheduled sequences are packed into one row [1, T]. Decode tokens (one per
    sequence) are attended in groups of similar length (little padding); each prefill chunk is
    attended on its own.
    """

    slot_mapping: Tensor  # [T] flat slot (block * block_size + offset) where each token's K/V goes
    decodes: list[DecodeGroup]
    prefills: list[PrefillChunk]
    # recurrent layers (config.has_recurrent_layers): each sequence's state slot (keel.model.recurrent)
    recurrent: RecurrentPlan | None = None
    _masks: dict = field(default_factory=dict)

    def rows(self, num_tokens: int) -> PagedRows:
        """The step's tokens for keel's paged-attention kernel; memoised per step for all layers."""
        if "rows" not in self._masks:
            self._masks["rows"] = paged_rows(self, num_tokens)
        return self._masks["rows"]

    def all_decodes(self) -> tuple[Tensor | None, Tensor, Tensor]:
        """Every decode row of the step at once, for a kernel that walks each row's own table (Triton):
        (their rows of the step, None when they are the whole step in order; tables [N, W] padded with
        block 0; positions [N]). Memoised per step for all layers."""
        if "all_decodes" not in self._masks:
            groups = self.decodes
            if len(groups) == 1:
                group = groups[0]
                self._masks["all_decodes"] = (None if group.whole_step else group.index, group.tables, group.positions)
            else:
                width = max(g.tables.shape[1] for g in groups)
                self._masks["all_decodes"] = (
                    torch.cat([g.index for g in groups]),
                    torch.cat([F.pad(g.tables, (0, width - g.tables.shape[1])) for g in groups]),
                    torch.cat([g.positions for g in groups]),
                )
        return self._masks["all_decodes"]

    def fresh_prefills(self) -> list[FreshChunks]:
        """The step's chunks that start their sequences, in batches of similar lengths (`fresh_batches`);
        memoised per step for all layers."""
        if "fresh" not in self._masks:
            self._masks["fresh"] = fresh_batches(self.prefills, self.slot_mapping)
        return self._masks["fresh"]

    def mask(self, key: object, q_positions: Tensor, num_keys: int, window: int | None) -> Tensor:
        """[Q, L] boolean, True = attend; memoised per step for all layers."""
        if (key, window) not in self._masks:
            self._masks[(key, window)] = decode_mask(q_positions, num_keys, window)
        return self._masks[(key, window)]


class PagedKVCache:
    """Block storage for all layers, head-major: keys and values as [H_kv, num_blocks, block_size * D].

    Head-major, so that gathering a sequence's blocks yields [H_kv, L, D] rows that feed batched
    matmuls without another copy. Implements the model's `KVCache.attend` for a packed step
    described by `plan` (set by the runner before each forward): scatter the new K/V into their
    slots, then gather each group's blocks once per layer and attend.

    Multi-head latent attention (config.is_mla): one store per layer of [1, slots, R + P] rows (the
    latent, then the rope key) and no value store; `attend_latent` attends with the first R channels
    of each row as its value. Blocks, prefix hashes and plans are the same as for K/V.

    DeepSeek Sparse Attention (config.is_dsa, keel.model.dsa): each layer with an indexer of its own also keeps a
    store of [1, slots, index_head_dim] index keys in the same slots (so blocks, the prefix cache and their
    accounting cover them), and its queries attend through `_attend_indexed` (torch, each query masked to the keys
    its indexer selects; the selection memoised per step for the layers sharing it), or, in a step where no query
    sees more than index_topk keys (every key selected), as dense latent attention through any backend.
    """

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: str = "cpu",
        layers: range | None = None,
        sequences: int = 1,
    ) -> None:
        """layers: the layers this cache stores (a pipeline stage's); the others get empty stores. sequences: how
        many sequences at once the recurrent layers keep states for (the scheduler's max_num_seqs)."""
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.layers = range(config.num_layers) if layers is None else layers
        self.latent_rank = config.kv_lora_rank
        # Gemma 2's attention-score soft-capping, applied by every backend that attends here.
        self.softcap = config.attn_logit_softcapping
        # GPT-OSS's softmax sinks: the model passes each layer's to `attend`; keel::decoder_layers has none.
        self.has_sinks = config.attention_sinks
        # ALiBi's slopes: the model passes each layer's to `attend`; keel::decoder_layers has none either.
        self.has_alibi = config.position_embedding == "alibi"
        # Each layer's KV heads and row width (Gemma 4's full-attention layers have their own): one store a layer
        n = config.num_layers
        if config.is_mla:  # one row a token: the latent and the rope key
            self.kv_heads, self.head_dims = [1] * n, [config.kv_lora_rank + config.qk_rope_head_dim] * n
        else:
            self.kv_heads = [config.layer_num_kv_heads(i) for i in range(n)]
            self.head_dims = [config.layer_head_dim(i) for i in range(n)]
        # the layers that keep K/V: not the recurrent ones, which keep a state per sequence in `sequences` slots
        # instead (hybrid layers keep both), nor those without a token mixer ("mlp"), which keep neither, nor those
        # attending over another layer's (kv_shared_layers: `attend_stored`)
        self.attention = set(config.kv_layers())
        self.keys = [
            torch.zeros(self.kv_heads[i], self.slots_of(i), self.head_dims[i], dtype=dtype, device=device)
            for i in range(config.num_layers)
        ]
        # values at each layer's own width (MiMo-V2-Flash's are narrower than its keys)
        self.values = (
            []
            if config.is_mla
            else [
                torch.zeros(self.kv_heads[i], self.slots_of(i), config.layer_v_head_dim(i), dtype=dtype, device=device)
                for i in range(config.num_layers)
            ]
        )
        self.recurrent = RecurrentStates(config, sequences, dtype, device) if config.has_recurrent_layers else None
        indexed = set(config.dsa_index_layers())
        self.index_keys = [
            torch.zeros(1, self.slots_of(i) if i in indexed else 0, config.index_head_dim, dtype=dtype, device=device)
            for i in range(config.num_layers)
        ]
        self.plan: StepPlan | None = None

    def attention_backend(self) -> str:
        """The backend that attends over this cache's stores (keel.serve.attention_backends)."""
        stored = [i for i in self.layers if i in self.attention] or [0]
        return attention_backend(self.keys[stored[0]], self.head_dims[stored[0]], self.block_size)

    def slots_of(self, layer: int) -> int:
        """Token slots of a layer's store: all blocks' for the stored attention layers, none for the others."""
        return self.num_blocks * self.block_size if layer in self.layers and layer in self.attention else 0

    def recurrent_spans(self, layer: int, meta: AttentionMetadata) -> RecurrentSpans:
        """The step's sequences and their state slots for a recurrent layer (`StepPlan.recurrent`)."""
        plan = self.plan.recurrent
        return self.recurrent.spans(layer, plan.chunks, plan.decode_rows, plan.decode_slots)

    def start_sequences(self) -> None:
        """Empty the states of the sequences this step starts (before its forward)."""
        if self.recurrent is not None and self.plan.recurrent is not None:
            self.recurrent.reset(self.plan.recurrent.fresh)

    def nbytes(self) -> int:
        """Bytes of cache storage actually allocated (all layers, all blocks)."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values, *self.index_keys))

    def _gather(self, store: Tensor, tables: Tensor) -> Tensor:
        return gather_blocks(store, tables, self.block_size)

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
        k_store, v_store = self.keys[layer], self.values[layer]
        self._write(k_store, k)
        self._write(v_store, v)
        return self._attend(q, k_store, v_store, window, None, sinks, alibi)

    def attend_stored(
        self, layer: int, q: Tensor, meta: AttentionMetadata, window: int | None, sinks: Tensor | None = None
    ) -> Tensor:
        return self._attend(q, self.keys[layer], self.values[layer], window, None, sinks)

    def in_place(self, layer: int, num_tokens: int) -> InPlaceLayer | None:
        """One layer's stores and this step's slots and rows, for an operator that writes the step's K/V and
        attends where they lie in one call (keel::decoder_layers); None where keel's paged-attention kernel
        does not read this cache (then `attend` runs)."""
        if not self.attends_in_place(layer):
            return None
        return InPlaceLayer(
            self.keys[layer], self.values[layer], self.plan.slot_mapping, self.plan.rows(num_tokens), self.block_size
        )

    def attends_in_place(self, layer: int) -> bool:
        """Whether `in_place` serves this layer: keel's paged-attention kernel reads its stores where they lie."""
        # MLA has no values; keel::decoder_layers's attention neither soft-caps scores nor counts sinks nor biases
        if not self.values or self.softcap or self.has_sinks or self.has_alibi:
            return False
        if self.values[layer].shape[-1] != self.head_dims[layer]:  # the kernel's values are as wide as its keys
            return False
        return kernel_attends(self.keys[layer], self.head_dims[layer], self.block_size)

    def attend_latent(
        self, layer: int, q: Tensor, kv: Tensor, meta: AttentionMetadata, scale: float, index: IndexQuery | None = None
    ) -> Tensor:
        store = self.keys[layer]
        self._write(store, kv)
        if index is None:
            return self._attend(q, store, None, None, scale)
        if index.k is not None:
            self._write(self.index_keys[layer], index.k)
        if self._within_top_k(index.topk):  # every visible key selected: dense latent attention, on any backend
            return self._attend(q, store, None, None, scale)
        return self._attend_indexed(q, store, index, scale)

    def _within_top_k(self, topk: int) -> bool:
        """Whether no query of this step can see more than `topk` keys, from host-side bounds only (a decode group's
        table width, a chunk's key count): then each query's selection is every key it sees. Memoised per step."""
        plan = self.plan
        memo = ("index_dense", topk)
        if memo not in plan._masks:
            widths = [dec.tables.shape[1] * self.block_size for dec in plan.decodes]
            plan._masks[memo] = max([*widths, *(chunk.keys for chunk in plan.prefills)], default=0) <= topk
        return plan._masks[memo]

    def _attend_indexed(self, q: Tensor, store: Tensor, index: IndexQuery, scale: float) -> Tensor:
        """DeepSeek Sparse Attention over latent rows: each decode group and prefill chunk gathers its rows, and each
        query attends (torch: keel's paged kernels take no mask) to the visible keys its indexer selects ->
        [1, H, T, R]."""
        plan = self.plan
        queries = q[0]  # [H, T, R + P]
        out = queries.new_empty(queries.shape[0], queries.shape[1], self.latent_rank)
        for g, dec in enumerate(plan.decodes):
            rows = queries.index_select(1, dec.index)
            keys = self._gather(store, dec.tables)  # [1, B, L, R + P]
            allowed = plan.mask(("decode", g), dec.positions, keys.shape[2], None)  # [B, L]
            keep = self._selection(index, ("decode", g), dec.index, dec.tables, allowed[:, None])[:, 0]
            od = attend_decode_rows(rows, keys, keys[..., : self.latent_rank], keep, scale)
            out.index_copy_(1, dec.index, od)
        for i, chunk in enumerate(plan.prefills):
            keys = self._gather(store, chunk.table[None]).transpose(0, 1)[:, :, : chunk.keys]  # [1, 1, L, R + P]
            allowed = plan.mask(i, chunk.positions, chunk.keys, None)  # [C, L]
            rows = torch.arange(chunk.start, chunk.end, device=queries.device)
            keep = self._selection(index, i, rows, chunk.table[None], allowed[None])  # [1, C, L]
            out[:, chunk.start : chunk.end] = attend_chunk(
                queries[None, :, chunk.start : chunk.end], keys, keys[..., : self.latent_rank], keep[:, None], scale
            )[0]
        return out.unsqueeze(0)

    def _selection(self, index: IndexQuery, part: object, rows: Tensor, tables: Tensor, allowed: Tensor) -> Tensor:
        """The keys [B, Q, L] that the queries of one decode group (B rows, Q = 1) or prefill chunk (B = 1, Q rows)
        attend to: the indexer of `index.source` scored over its stored keys, memoised per step, so that the layers
        sharing that indexer's choice (GLM-5's) reuse it."""
        memo = ("index", index.source, part)
        masks = self.plan._masks
        if memo not in masks:
            keys = self._gather(self.index_keys[index.source], tables)[0][:, : allowed.shape[-1]]  # [B, L, D]
            q, w = index.q[0].index_select(0, rows), index.w[0].index_select(0, rows)  # [n, Hi, D], [n, Hi]
            shape = (keys.shape[0], allowed.shape[1])
            query = IndexQuery(q.view(*shape, *q.shape[1:]), w.view(*shape, -1), None, index.source, index.topk)
            masks[memo] = select_keys(query, keys, allowed)
        return masks[memo]

    def _write(self, store: Tensor, rows: Tensor) -> None:
        """The step's new rows [1, T, H_kv, D] into their slots of one layer's store (the KV writes;
        keel profile decode times this method)."""
        write_rows(store, self.plan.slot_mapping, rows)

    def _attend(
        self,
        q: Tensor,
        k_store: Tensor,
        v_store: Tensor | None,
        window: int | None,
        scale: float | None,
        sinks: Tensor | None = None,
        alibi: Tensor | None = None,
    ) -> Tensor:
        """Attention of the step's queries q [1, H, T, D] over the stored rows -> [1, H, T, Dv]. Without
        a value store (MLA), a row's value is its first `latent_rank` channels (its latent). `sinks` [H]: each
        head's softmax sink (GPT-OSS). `alibi` [H]: each head's ALiBi slope (Bloom, MPT, Falcon-RW)."""
        plan = self.plan
        softcap = self.softcap
        head_dim = q.shape[-1]  # the layer's (MLA: the latent and rope key's)
        backend = attention_backend(k_store, head_dim, self.block_size) if isinstance(k_store, Tensor) else "torch"
        # the int8 cache's stores (QuantStore) hold values as wide as keys (it refuses v_head_dim)
        v_dim = (
            self.latent_rank
            if v_store is None
            else (v_store if isinstance(v_store, Tensor) else v_store.data).shape[-1]
        )
        if v_dim != head_dim and v_store is not None:
            backend = "torch"  # keel's kernels and the Triton kernel read values as wide as the keys
        if backend == "kernels":
            return self._attend_in_place(q, k_store, v_store, None, None, window, scale, sinks, alibi)

        def gather(tables: Tensor) -> tuple[Tensor, Tensor]:
            keys = self._gather(k_store, tables)  # [Hkv, B, L, D]
            return keys, (self._gather(v_store, tables) if v_store is not None else keys[..., : self.latent_rank])

        queries = q[0]  # [H, T, D]
        heads = queries.shape[0]
        whole = len(plan.decodes) == 1 and plan.decodes[0].whole_step
        out = None if whole else queries.new_empty(heads, queries.shape[1], v_dim)
        decode_scale = scale if scale is not None else head_dim**-0.5
        if backend == "triton" and plan.decodes:
            # Each row walks its own table: every decode row of the step in one call, whatever its length.
            index, tables, positions = plan.all_decodes()
            rows = queries if index is None else queries.index_select(1, index)
            od = triton_paged.paged_attention(
                rows.transpose(0, 1), k_store, v_store, tables, None, positions,
                self.block_size, window or 0, decode_scale, v_dim, softcap=softcap or 0.0, sinks=sinks, alibi=alibi,
            ).transpose(0, 1)  # fmt: skip
            if index is None:
                return od.unsqueeze(0)
            out.index_copy_(1, index, od)
        for g, dec in enumerate(plan.decodes if backend != "triton" else []):
            # A step of decodes only, in row order (steady-state decoding): the queries are the
            # group's, and its output is the step's (no selecting and scattering back).
            rows = queries if dec.whole_step else queries.index_select(1, dec.index)
            keys, values = gather(dec.tables)
            mask = plan.mask(("decode", g), dec.positions, keys.shape[2], window)  # [B, L]
            od = attend_decode_rows(rows, keys, values, mask, decode_scale, softcap, sinks, alibi, dec.positions)
            if dec.whole_step:
                return od.unsqueeze(0)
            out.index_copy_(1, dec.index, od)
        batched: set[int] = set()
        if window is None and not softcap and sinks is None and alibi is None and isinstance(k_store, Tensor):
            # Chunks that start their sequence (a prompt's first chunk) see only their own rows: those of
            # similar lengths go through one causal call instead of a gather and a call each.
            for fresh in plan.fresh_prefills():
                rows = attend_fresh_chunks(queries, k_store, v_store, fresh, v_dim, scale)
                out.index_copy_(1, fresh.valid_rows, rows)
                batched.update(fresh.chunks)
        for i, chunk in enumerate(plan.prefills):
            if i in batched:
                continue
            keys, values = gather(chunk.table[None])
            # [1, Hkv, L, D], cut at the chunk's last key (a block's unwritten tail is never visible)
            keys, values = keys.transpose(0, 1)[:, :, : chunk.keys], values.transpose(0, 1)[:, :, : chunk.keys]
            mask = None if window is None else plan.mask(i, chunk.positions, chunk.keys, window)[None, None]
            out[:, chunk.start : chunk.end] = attend_chunk(
                queries[None, :, chunk.start : chunk.end],
                keys,
                values,
                mask,
                scale,
                softcap,
                sinks,
                alibi,
                chunk.positions,
            )[0]
        return out.unsqueeze(0)

    def _attend_in_place(
        self,
        q: Tensor,
        k_store: Tensor,
        v_store: Tensor | None,
        k_scales: Tensor | None,
        v_scales: Tensor | None,
        window: int | None,
        scale: float | None,
        sinks: Tensor | None = None,
        alibi: Tensor | None = None,
    ) -> Tensor:
        """Every query of the step, decodes and prefill chunks alike, in one call of keel's paged-attention
        kernel (keel.kernels): each (token, KV head) walks its sequence's block table and reads K/V where
        they lie, the query heads of a GQA group sharing each read; no gathered copy."""
        queries = q[0]  # [H, T, D]
        rows = self.plan.rows(queries.shape[1])
        out = torch.ops.keel.paged_attention(
            queries.transpose(0, 1),
            k_store,
            v_store,
            k_scales,
            v_scales,
            rows.tables,
            rows.table_of,
            rows.positions,
            self.block_size,
            window or 0,
            scale if scale is not None else queries.shape[-1] ** -0.5,
            queries.shape[-1] if v_store is not None else self.latent_rank,
            self.softcap or 0.0,
            sinks,
            alibi,
        )  # [T, H, Dv]
        return out.transpose(0, 1).unsqueeze(0)
