"""Paged KV cache: block bookkeeping (this module's `KVCacheManager`) and block storage (`PagedKVCache`).

The manager owns fixed-size blocks shared by all layers: a free queue in LRU order, reference
counts, block tables per sequence, and prefix caching by chained block hashes (vLLM v1's
design). It never touches tensors. Only *full* blocks are ever shared or cached, and a full
block is never written again; a sequence's partially filled last block is always private to
it, so copy-on-write never has to copy (the last prompt token is always recomputed, so even a
fully cached prompt writes into a fresh block of its own).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch
from torch import Tensor

from keel.config import ModelConfig
from keel.errors import KeelError
from keel.model.attention import AttentionMetadata, sdpa

log = logging.getLogger("keel.serve")

NULL_BLOCK = -1  # a block-table entry whose block was freed (out of a sliding window)


def block_hash(parent: int | None, tokens: Seq[int], extra: object = None) -> int:
    """Chained hash of a full block: its tokens, everything before it (the parent hash), and an
    extra key (future LoRA adapters / multimodal inputs) so different contexts never collide."""
    return hash((parent, tuple(tokens), extra))


@dataclass
class Block:
    id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and registered for prefix reuse
    tokens: tuple[int, ...] = ()  # for cached blocks: verified on a hit, so a hash collision is harmless


@dataclass
class SequenceBlocks:
    """A sequence's block table and how many of its blocks are hashed (registered in the cache)."""

    table: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise KeelError(f"KV cache needs at least one block of one token (got {num_blocks} x {block_size})")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks with ref_count 0, least recently used first. OrderedDict: O(1) pop-front,
        # O(1) removal from the middle (a cache hit on a free block), O(1) append.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.seqs: dict[str, SequenceBlocks] = {}
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found

    # ------------------------------------------------------------------ state
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def usage(self) -> float:
        """Fraction of blocks held by sequences (cached-but-free blocks count as free)."""
        return 1.0 - len(self.free_queue) / len(self.blocks)

    def block_table(self, seq_id: str) -> list[int]:
        return self.seqs[seq_id].table

    # ---------------------------------------------------------- prefix cache
    def find_prefix(self, tokens: Seq[int], extra: object = None) -> list[tuple[int, int]]:
        """(block id, hash) of the cached blocks that spell the longest cached prefix of `tokens`.

        At most len(tokens) - 1 tokens are matched, rounded down to whole blocks: the last token is
        always computed (its logits are needed) and written into a block of the sequence's own.
        A pure lookup: nothing is held or counted until `allocate` takes the blocks.
        """
        if not self.enable_prefix_caching:
            return []
        bs, found, parent = self.block_size, [], None
        for i in range((len(tokens) - 1) // bs):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            h = block_hash(parent, chunk, extra)
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].tokens != chunk:
                break
            found.append((block_id, h))
            parent = h
        return found

    def record_prefix_lookup(self, queried_tokens: int, hit_tokens: int) -> None:
        self.prefix_queries += queried_tokens
        self.prefix_hits += hit_tokens

    # ------------------------------------------------------------ allocation
    def allocate(self, seq_id: str, num_tokens: int, prefix: list[tuple[int, int]] | None = None) -> bool:
        """Grow the sequence's table to hold `num_tokens` tokens, starting a new sequence with the
        cached `prefix` blocks (from `find_prefix`). All or nothing: False changes nothing."""
        prefix = prefix or []
        entry = self.seqs.get(seq_id)
        if entry is None:
            entry = SequenceBlocks()
        else:
            assert not prefix, "a prefix can only start a sequence"
        need = max(0, -(-num_tokens // self.block_size) - len(entry.table) - len(prefix))
        revived = sum(1 for block_id, _ in prefix if self.blocks[block_id].ref_count == 0)
        if need + revived > len(self.free_queue):
            return False
        for block_id, h in prefix:
            self._touch(block_id)
            entry.table.append(block_id)
            entry.hashes.append(h)
        for _ in range(need):
            block_id, _ = self.free_queue.popitem(last=False)  # least recently used free block
            block = self.blocks[block_id]
            if block.hash is not None:  # evict its old prefix-cache entry
                if self.cached.get(block.hash) == block_id:
                    del self.cached[block.hash]
                block.hash, block.tokens = None, ()
            block.ref_count = 1
            entry.table.append(block_id)
        self.seqs[seq_id] = entry
        return True

    def _touch(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def commit(
        self, seq_id: str, num_computed: int, tokens_between: Callable[[int, int], Seq[int]], extra: object = None
    ) -> None:
        """Register the sequence's blocks that are now full (their K/V computed) for prefix reuse.
        `tokens_between(start, end)` gives the sequence's tokens; it is called only for new full blocks."""
        if not self.enable_prefix_caching:
            return
        entry = self.seqs[seq_id]
        bs = self.block_size
        parent = entry.hashes[-1] if entry.hashes else None
        for i in range(len(entry.hashes), num_computed // bs):
            chunk = tuple(tokens_between(i * bs, (i + 1) * bs))
            h = block_hash(parent, chunk, extra)
            entry.hashes.append(h)
            parent = h
            block_id = entry.table[i]
            if block_id == NULL_BLOCK:
                continue
            block = self.blocks[block_id]
            if h not in self.cached:  # an identical block cached by another sequence wins
                block.hash, block.tokens = h, chunk
                self.cached[h] = block_id

    def truncate(self, seq_id: str, num_tokens: int) -> None:
        """Release the sequence's blocks past those holding its first `num_tokens` tokens: blocks that
        were reserved for speculative drafts the target rejected (nothing valid is in them)."""
        entry = self.seqs[seq_id]
        keep = -(-num_tokens // self.block_size)
        while len(entry.table) > keep:
            block_id = entry.table.pop()
            if block_id != NULL_BLOCK:
                self._release(block_id)
        del entry.hashes[keep:]

    def free_outside_window(self, seq_id: str, first_needed_position: int) -> None:
        """Sliding window: release blocks whose every position is before `first_needed_position`."""
        entry = self.seqs[seq_id]
        for i in range(min(first_needed_position // self.block_size, len(entry.table))):
            if entry.table[i] != NULL_BLOCK:
                self._release(entry.table[i])
                entry.table[i] = NULL_BLOCK

    def free(self, seq_id: str) -> None:
        """Release all of a sequence's blocks. Tail blocks go to the free queue first, so they are
        evicted before the shared prefix blocks that other requests are likelier to reuse."""
        entry = self.seqs.pop(seq_id, None)
        if entry is None:
            return
        for block_id in reversed(entry.table):
            if block_id != NULL_BLOCK:
                self._release(block_id)

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed twice"
        if block.ref_count == 0:
            self.free_queue[block_id] = None

    def held_blocks(self, seq_id: str) -> int:
        return sum(1 for b in self.seqs[seq_id].table if b != NULL_BLOCK) if seq_id in self.seqs else 0


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """Cache bytes of one token over all layers: K and V of every KV head, or for multi-head latent
    attention the latent and the rope key only (kv_lora_rank + qk_rope_head_dim values per layer)."""
    if config.is_mla:
        return config.num_layers * (config.kv_lora_rank + config.qk_rope_head_dim) * dtype.itemsize
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype.itemsize


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Cache bytes of every layer for one block of tokens."""
    return kv_bytes_per_token(config, dtype) * block_size


def blocks_in_budget(
    bytes_per_block: int,
    kv_cache_memory: str | int | None,
    device: str | torch.device = "cpu",
    gpu_memory_utilization: float = 0.9,
) -> int:
    """KV blocks a budget holds: `kv_cache_memory` bytes ("2GiB" or an int), or with None on CUDA a share of
    the device's free memory (None on CPU is an error)."""
    if kv_cache_memory is None:
        if not torch.cuda.is_available() or not str(device).startswith("cuda"):
            raise KeelError("--kv-cache-memory is required on CPU (e.g. 2GiB)")
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * gpu_memory_utilization)
    elif isinstance(kv_cache_memory, int):
        budget = kv_cache_memory
    else:
        budget = parse_memory(kv_cache_memory)
    return budget // bytes_per_block


def parse_memory(text: str) -> int:
    """'2GiB', '512MiB', '1.5GB', '1000000' -> bytes."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    value = text.strip().lower()
    for unit, factor in units.items():
        if value.endswith(unit):
            try:
                return int(float(value[: -len(unit)]) * factor)
            except ValueError:
                break
    try:
        return int(value)
    except ValueError:
        raise KeelError(f"--kv-cache-memory {text!r}: expected a size such as 2GiB or 512MiB") from None


def write_rows(store: Tensor, slots: Tensor, rows: Tensor) -> None:
    """A step's new rows [1, T, H_kv, D] into their flat slots [T] of one layer's store [H_kv, slots, D]."""
    store.index_copy_(1, slots, rows[0].transpose(0, 1))


def slot_of(table: list[int], position: int, block_size: int) -> int:
    """The flat cache slot of a sequence's token at `position`, through its block table."""
    return table[position // block_size] * block_size + position % block_size


def visible_blocks(table: list[int], num_tokens: int, block_size: int) -> list[int]:
    """The blocks holding a sequence's first `num_tokens` tokens, freed ones (NULL_BLOCK, behind a
    sliding window) as block 0: attention masks them by position."""
    return [b if b != NULL_BLOCK else 0 for b in table[: -(-num_tokens // block_size)]]


def gather_blocks(store: Tensor, tables: Tensor, block_size: int) -> Tensor:
    """One layer's store [H_kv, slots, D] and block ids [B, nb] -> [H_kv, B, nb * block_size, D]
    (one index_select, contiguous)."""
    heads, dim = store.shape[0], store.shape[2]
    rows = store.view(heads, -1, block_size * dim).index_select(1, tables.flatten())
    return rows.view(heads, tables.shape[0], -1, dim)


def decode_mask(positions: Tensor, num_keys: int, window: int | None) -> Tensor:
    """[B, L] boolean, True = attend: key slot k of a gathered table against each query position."""
    q = positions.view(-1, 1)
    k = torch.arange(num_keys, device=q.device).view(1, -1)
    allowed = k <= q
    if window is not None:
        allowed = allowed & (q - k < window)
    return allowed


def attend_decode_rows(rows: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Attention of one-token queries rows [H, B, D] over their gathered keys [H_kv, B, L, D] and
    values [H_kv, B, L, Dv] where mask [B, L] allows -> [H, B, Dv]. Shared by the eager paged cache
    and the compiled decode step (keel.serve.compiled_decode), so both compute the same numbers.

    One-token queries: batched matmuls and a float32 softmax beat SDPA's CPU kernel here (which is
    ~9x slower in bfloat16 for this shape)."""
    kv_heads, heads, dim = keys.shape[0], rows.shape[0], rows.shape[-1]
    qd = rows.view(kv_heads, heads // kv_heads, -1, dim).transpose(1, 2)  # [Hkv, B, G, D]
    scores = torch.matmul(qd, keys.transpose(-1, -2)).float() * scale  # [Hkv, B, G, L]
    scores.masked_fill_(~mask[None, :, None, :], float("-inf"))
    probs = scores.softmax(dim=-1).to(values.dtype)
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
class StepPlan:
    """How the tokens of one packed step map onto the paged cache (built by the runner).

    Tokens of all scheduled sequences are packed into one row [1, T]. Decode tokens (one per
    sequence) are attended in groups of similar length (little padding); each prefill chunk is
    attended on its own.
    """

    slot_mapping: Tensor  # [T] flat slot (block * block_size + offset) where each token's K/V goes
    decodes: list[DecodeGroup]
    prefills: list[tuple[int, int, Tensor, Tensor]]  # (start, end, block table [nb], query positions [C])
    _masks: dict = field(default_factory=dict)

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
    """

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: str = "cpu",
        layers: range | None = None,
    ) -> None:
        """layers: the layers this cache stores (a pipeline stage's); the others get empty stores."""
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.layers = range(config.num_layers) if layers is None else layers
        self.latent_rank = config.kv_lora_rank
        if config.is_mla:
            self.num_kv_heads, self.head_dim = 1, config.kv_lora_rank + config.qk_rope_head_dim
        else:
            self.num_kv_heads, self.head_dim = config.num_kv_heads, config.head_dim
        self.keys = [
            torch.zeros(self.num_kv_heads, self.slots_of(i), self.head_dim, dtype=dtype, device=device)
            for i in range(config.num_layers)
        ]
        self.values = [] if config.is_mla else [torch.zeros_like(k) for k in self.keys]
        self.plan: StepPlan | None = None

    def slots_of(self, layer: int) -> int:
        """Token slots of a layer's store: all blocks' for the stored layers, none for the others."""
        return self.num_blocks * self.block_size if layer in self.layers else 0

    def nbytes(self) -> int:
        """Bytes of cache storage actually allocated (all layers, all blocks)."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def _gather(self, store: Tensor, tables: Tensor) -> Tensor:
        return gather_blocks(store, tables, self.block_size)

    def attend(
        self, layer: int, q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata, window: int | None
    ) -> Tensor:
        k_store, v_store = self.keys[layer], self.values[layer]
        self._write(k_store, k)
        self._write(v_store, v)
        return self._attend(q, k_store, v_store, window, None)

    def attend_latent(self, layer: int, q: Tensor, kv: Tensor, meta: AttentionMetadata, scale: float) -> Tensor:
        store = self.keys[layer]
        self._write(store, kv)
        return self._attend(q, store, None, None, scale)

    def _write(self, store: Tensor, rows: Tensor) -> None:
        """The step's new rows [1, T, H_kv, D] into their slots of one layer's store (the KV writes;
        keel profile decode times this method)."""
        write_rows(store, self.plan.slot_mapping, rows)

    def _attend(
        self, q: Tensor, k_store: Tensor, v_store: Tensor | None, window: int | None, scale: float | None
    ) -> Tensor:
        """Attention of the step's queries q [1, H, T, D] over the stored rows -> [1, H, T, Dv]. Without
        a value store (MLA), a row's value is its first `latent_rank` channels (its latent)."""
        plan = self.plan

        def gather(tables: Tensor) -> tuple[Tensor, Tensor]:
            keys = self._gather(k_store, tables)  # [Hkv, B, L, D]
            return keys, (self._gather(v_store, tables) if v_store is not None else keys[..., : self.latent_rank])

        queries = q[0]  # [H, T, D]
        heads = queries.shape[0]
        v_dim = self.head_dim if v_store is not None else self.latent_rank
        whole = len(plan.decodes) == 1 and plan.decodes[0].whole_step
        out = None if whole else queries.new_empty(heads, queries.shape[1], v_dim)
        decode_scale = scale if scale is not None else self.head_dim**-0.5
        for g, dec in enumerate(plan.decodes):
            keys, values = gather(dec.tables)
            # A step of decodes only, in row order (steady-state decoding): the queries are the
            # group's, and its output is the step's (no selecting and scattering back).
            rows = queries if dec.whole_step else queries.index_select(1, dec.index)
            mask = plan.mask(("decode", g), dec.positions, keys.shape[2], window)  # [B, L]
            od = attend_decode_rows(rows, keys, values, mask, decode_scale)
            if dec.whole_step:
                return od.unsqueeze(0)
            out.index_copy_(1, dec.index, od)
        for i, (start, end, table, positions) in enumerate(plan.prefills):
            keys, values = gather(table[None])
            keys, values = keys.transpose(0, 1), values.transpose(0, 1)  # [1, Hkv, L, D]
            mask = plan.mask(i, positions, keys.shape[2], window)[None, None]
            out[:, start:end] = sdpa(queries[None, :, start:end], keys, values, mask, scale=scale)[0]
        return out.unsqueeze(0)
