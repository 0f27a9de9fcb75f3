"""KV-cache block bookkeeping: the blocks, reference counts, block tables and prefix cache (no tensors).

`KVCacheManager` owns fixed-size blocks shared by all layers: a free queue in LRU order, reference
counts, block tables per sequence, and prefix caching by chained block hashes (vLLM v1's
design). It never touches tensors (the paged store is keel.serve.kv_cache). Only *full* blocks
are ever shared or cached, and a full block is never written again; a sequence's partially filled
last block is always private to it, so copy-on-write never has to copy (the last prompt token is
always recomputed, so even a fully cached prompt writes into a fresh block of its own).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from keel.errors import KeelError

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

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's `reset_prefix_cache`): False, and nothing changed, while a
        sequence holds blocks, since a running sequence's registered blocks are still being reused."""
        if self.seqs:
            return False
        for block_id in self.cached.values():
            self.blocks[block_id].hash, self.blocks[block_id].tokens = None, ()
        self.cached.clear()
        return True

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


def slot_of(table: list[int], position: int, block_size: int) -> int:
    """The flat cache slot of a sequence's token at `position`, through its block table."""
    return table[position // block_size] * block_size + position % block_size


def visible_blocks(table: list[int], num_tokens: int, block_size: int) -> list[int]:
    """The blocks holding a sequence's first `num_tokens` tokens, freed ones (NULL_BLOCK, behind a
    sliding window) as block 0: attention masks them by position. A new list (a slice: a row a step, so the
    Python loop runs only where a window freed blocks)."""
    blocks = table[: -(-num_tokens // block_size)]
    if NULL_BLOCK in blocks:
        return [b if b != NULL_BLOCK else 0 for b in blocks]
    return blocks
