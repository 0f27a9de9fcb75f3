"""KVCacheManager bookkeeping: allocation, reference counts, prefix hashing, LRU eviction."""

from __future__ import annotations

import pytest

from keel.errors import KeelError
from keel.serve.kv_blocks import NULL_BLOCK, KVCacheManager, block_hash
from keel.serve.kv_budget import parse_memory


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def commit_all(kv: KVCacheManager, seq: str, toks: list[int]) -> None:
    kv.commit(seq, len(toks), lambda a, b: toks[a:b])


def test_allocate_is_all_or_nothing_and_free_returns_everything():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    assert kv.allocate("a", 10)  # 3 blocks
    assert kv.num_free_blocks == 1
    assert not kv.allocate("b", 8)  # needs 2: refused, nothing taken
    assert kv.num_free_blocks == 1 and "b" not in kv.seqs
    assert kv.allocate("a", 12)  # still 3 blocks
    assert kv.allocate("a", 13)  # the 4th
    assert kv.num_free_blocks == 0 and kv.usage() == 1.0
    kv.free("a")
    assert kv.num_free_blocks == 4 and all(b.ref_count == 0 for b in kv.blocks)


def test_prefix_is_shared_by_reference_and_never_covers_the_last_token():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = tokens(12)
    assert kv.allocate("a", 12)
    commit_all(kv, "a", prompt)
    # Same 12 tokens: at most 11 may come from the cache -> 2 whole blocks.
    found = kv.find_prefix(prompt)
    assert [b for b, _ in found] == kv.block_table("a")[:2]
    assert kv.allocate("b", 12, prefix=found)
    assert kv.block_table("b")[:2] == kv.block_table("a")[:2]
    assert kv.block_table("b")[2] != kv.block_table("a")[2]  # the last block is private
    assert [kv.blocks[b].ref_count for b in kv.block_table("a")] == [2, 2, 1]
    # A different second block: only the first block matches (the hash chains the parent).
    other = tokens(4) + tokens(8, start=100)
    assert len(kv.find_prefix(other)) == 1


def test_reset_prefix_cache_forgets_cached_blocks_only_when_none_are_held():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = tokens(12)
    assert kv.allocate("a", 12)
    commit_all(kv, "a", prompt)
    assert not kv.reset_prefix_cache()  # "a" still holds its blocks
    assert len(kv.find_prefix(prompt)) == 2
    kv.free("a")
    assert len(kv.find_prefix(prompt)) == 2  # freed, still cached
    assert kv.reset_prefix_cache()
    assert kv.find_prefix(prompt) == [] and kv.num_free_blocks == 8
    assert all(b.hash is None for b in kv.blocks)


def test_chained_hash_depends_on_the_parent_and_the_extra_key():
    block = (1, 2, 3, 4)
    assert block_hash(None, block) != block_hash(block_hash(None, (9, 9, 9, 9)), block)
    assert block_hash(None, block, extra="adapter-a") != block_hash(None, block, extra="adapter-b")


def test_freed_cached_blocks_are_reused_until_evicted_in_lru_order():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    first, second = tokens(5), tokens(5, start=50)
    kv.allocate("a", 5)
    commit_all(kv, "a", first[:4])
    kv.free("a")  # tail first: a's last block is evicted before its prefix blocks
    assert len(kv.find_prefix(first)) == 2  # still cached while free
    kv.allocate("b", 5)  # takes 3 of the 4 free blocks, least recently freed first
    commit_all(kv, "b", second[:4])
    # a's tail (uncached) and a's second block went first; its first block survives.
    assert len(kv.find_prefix(first)) == 1
    kv.free("b")
    assert kv.allocate("c", 8)  # everything: all old entries evicted
    assert kv.find_prefix(first) == [] and kv.find_prefix(second) == []


def test_hit_on_a_free_cached_block_counts_against_capacity():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    prompt = tokens(5)
    kv.allocate("a", 5)
    commit_all(kv, "a", prompt[:4])
    kv.free("a")
    found = kv.find_prefix(prompt)
    assert len(found) == 2
    assert kv.allocate("b", 8, prefix=found) is False  # 2 revived + 2 new > 3 free
    assert kv.num_free_blocks == 3 and all(b.ref_count == 0 for b in kv.blocks)
    assert kv.allocate("b", 6, prefix=found)


def test_sliding_window_frees_blocks_behind_the_window():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate("a", 20)
    kv.free_outside_window("a", first_needed_position=9)  # positions 0..8 unneeded: blocks 0, 1 go
    assert kv.block_table("a")[:2] == [NULL_BLOCK, NULL_BLOCK]
    assert kv.held_blocks("a") == 3 and kv.num_free_blocks == 5
    kv.free("a")
    assert kv.num_free_blocks == 8


def test_bad_sizes_are_clear_errors():
    with pytest.raises(KeelError):
        KVCacheManager(num_blocks=0, block_size=16)
    assert parse_memory("2GiB") == 2 * 2**30 and parse_memory("512MiB") == 512 * 2**20
    assert parse_memory("1.5GB") == 1_500_000_000 and parse_memory("4096") == 4096
    with pytest.raises(KeelError, match="kv-cache-memory"):
        parse_memory("lots")


def test_gpu_memory_utilization_leaves_the_weights_and_the_activation_peak(monkeypatch):
    """vLLM's rule: KV = total x utilization - memory in use - the dummy step's activation peak."""
    from keel.serve import kv_budget

    gib = 2**30
    assert kv_budget.utilization_budget(0.9, free=90 * gib, total=100 * gib, activation_peak=5 * gib) == 75 * gib
    with pytest.raises(KeelError, match="--gpu-memory-utilization 0.5: 50.0 GiB .* 60.0 GiB in use"):
        kv_budget.utilization_budget(0.5, free=40 * gib, total=100 * gib, activation_peak=gib)
    with pytest.raises(KeelError, match="expected a share"):
        kv_budget.utilization_budget(1.5, free=40 * gib, total=100 * gib, activation_peak=0)
    # On CUDA without a size: the device's memory and the profiled peak (the probe is faked here).
    peaks = []
    monkeypatch.setattr(kv_budget.torch.cuda, "mem_get_info", lambda device: (80 * gib, 100 * gib))
    blocks = kv_budget.blocks_in_budget(gib, None, "cuda:0", 0.5, lambda: peaks.append(1) or 4 * gib)
    assert blocks == 50 - 20 - 4 and peaks == [1]
    assert kv_budget.blocks_in_budget(gib, "3GiB", "cuda:0", 0.5, lambda: peaks.append(1) or 0) == 3 and peaks == [1]
    # On CPU without a size: the default, nothing profiled.
    assert kv_budget.blocks_in_budget(2**20, None, "cpu") == parse_memory(kv_budget.CPU_DEFAULT) // 2**20


def test_the_dummy_step_packs_the_step_budget_as_the_scheduler_would():
    """The step the activation peak is measured on: the budget's tokens in sequences of at most max_model_len,
    the logits of one row per running sequence (at most max_num_seqs), the last rows of the packed step."""
    from keel.serve.config import SchedulerConfig
    from keel.serve.kv_budget import DummyStep
    from keel.serve.scheduler import GPU_BATCHED_TOKENS, step_budget

    assert DummyStep.of(2048, 4096, 256) == DummyStep(1, 2048, 256)
    assert DummyStep.of(2048, 300, 256) == DummyStep(7, 300, 256)  # 2,100 tokens: the budget rounded up to sequences
    assert DummyStep.of(128, 4096, 256) == DummyStep(1, 128, 128)  # no more rows than tokens
    assert DummyStep(2, 3, 4).select("cpu").tolist() == [2, 3, 4, 5]
    sched = SchedulerConfig()
    assert step_budget(sched, "cuda", 2, 8192) == GPU_BATCHED_TOKENS
    assert step_budget(sched, "cpu", 2, 8192) == 128
    assert step_budget(SchedulerConfig(enable_chunked_prefill=False), "cpu", 2, 8192) == 8192  # a whole prompt
    assert step_budget(SchedulerConfig(max_num_batched_tokens=96), "cuda", 2, 8192) == 96
