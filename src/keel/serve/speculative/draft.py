"""Draft-model drafting: a small model (or a quantized copy of the target) proposes k tokens.

The draft model keeps its own paged KV store, addressed by the *target's* block tables: a
request's token at position p has its draft K/V in the same slot as its target K/V, so the draft
needs no block manager of its own, blocks freed or shared by the target are freed or shared for
both, and a prefix-cache hit is at worst a draft recomputation (the draft rewrites identical
values into a shared block: same tokens, same positions). `Request.draft_computed` counts the
tokens the draft store holds; before proposing, the draft catches up on the rest (the whole prompt
the first time, one or two tokens after each verification).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from keel.model.transformer import Transformer
from keel.serve.kv_cache import PagedKVCache
from keel.serve.request import Request
from keel.serve.runner import Chunk, forward_step, pack_step
from keel.serve.sampling import RowState, Sampler
from keel.serve.speculative.verify import draw


class DraftModelProposer:
    def __init__(self, model: Transformer, cache: PagedKVCache, block_tables: Callable[[str], list[int]]) -> None:
        self.model = model
        self.cache = cache
        self.block_tables = block_tables
        self.sampler = Sampler()

    @torch.inference_mode()
    def propose(self, requests: list[Request]) -> None:
        """Fill each request's `spec_token_ids` (its length, k, was reserved by the scheduler) with k
        drafts, and `spec_probs` with the distributions sampled requests drew them from."""
        drafts: dict[str, list[int]] = {r.request_id: [] for r in requests}
        probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r in requests}
        # First forward: catch up on the tokens the draft has not seen, ending with the last known one.
        active = list(requests)
        chunks = [
            Chunk(
                self.block_tables(r.request_id), r.draft_computed, r.token_ids_between(r.draft_computed, r.num_tokens)
            )
            for r in active
        ]
        while active:
            step = pack_step(chunks, self.cache.block_size, self.model.device)
            logits = forward_step(self.model, self.cache, step)
            states = [
                RowState(
                    r.params,
                    r.generator,
                    r.prompt_token_ids,
                    r.output_token_ids + drafts[r.request_id],
                    r.eos_token_ids,
                )
                for r in active
            ]
            x, greedy = self.sampler.process_logits(logits, states)
            argmax = x.argmax(dim=-1).tolist()
            greedy_rows = greedy.tolist()
            next_active, chunks = [], []
            for i, r in enumerate(active):
                if greedy_rows[i]:
                    token = argmax[i]
                else:
                    p = x[i].softmax(dim=-1)
                    token = draw(p, r.generator)
                    probs[r.request_id].append(p)
                mine = drafts[r.request_id]
                mine.append(token)
                if len(mine) < len(r.spec_token_ids):  # feed it to draft the next one
                    next_active.append(r)
                    chunks.append(Chunk(self.block_tables(r.request_id), r.num_tokens + len(mine) - 1, [token]))
            active = next_active
        for r in requests:
            k = len(r.spec_token_ids)
            r.spec_token_ids = drafts[r.request_id]
            r.spec_probs = torch.stack(probs[r.request_id]) if probs[r.request_id] else None
            r.draft_computed = r.num_tokens + k - 1  # the last draft was never fed
