"""One rank's share of a parallel forward: its pipeline stage's layers over its tensor-parallel slices.

Every rank of a step runs `StageRunner.run(chunks)` on the same chunks (the step's sequences, see
keel.serve.runner.Chunk). With pipeline parallelism the chunks are split into micro-batches that
flow stage to stage: stage s receives micro-batch i's hidden states from stage s - 1 (the rank of
the same tensor-parallel index), runs its layers and sends them on without waiting (isend), so
while stage s + 1 works on micro-batch i, stage s already works on i + 1. The last stage computes
the logits of the selected rows; its tensor-parallel rank 0 sends them to global rank 0, the rank
that samples. Shapes need no handshake: every rank derives them from the chunks it was given.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from keel.model.transformer import Transformer
from keel.serve.kv_cache import PagedKVCache
from keel.serve.runner import Chunk, pack_step


def selected_rows(chunks: list[Chunk]) -> list[range]:
    """Each chunk's rows in the step's selected logits (what `pack_step` reports, without packing)."""
    rows, first = [], 0
    for chunk in chunks:
        n = len(chunk.tokens) if chunk.logits == "all" else 1 if chunk.logits == "last" else 0
        rows.append(range(first, first + n))
        first += n
    return rows


def micro_batches(chunks: list[Chunk], count: int) -> list[list[Chunk]]:
    """Split chunks, in order, into at most `count` contiguous groups of similar token counts."""
    count = max(1, min(count, len(chunks)))
    total = sum(len(c.tokens) for c in chunks)
    groups: list[list[Chunk]] = [[]]
    seen = 0
    for i, chunk in enumerate(chunks):
        left_chunks = len(chunks) - i
        boundary = total * len(groups) / count
        # Start a new group at the group's share of tokens, or when every remaining chunk must open one.
        if groups[-1] and len(groups) < count and (seen >= boundary or left_chunks == count - len(groups)):
            groups.append([])
        groups[-1].append(chunk)
        seen += len(chunk.tokens)
    return groups


class StageRunner:
    def __init__(
        self,
        model: Transformer,
        cache: PagedKVCache,
        *,
        rank: int,
        tp: int,
        pp: int,
        hidden_size: int,
        vocab_size: int,
    ) -> None:
        self.model = model
        self.cache = cache
        self.rank, self.tp, self.pp = rank, tp, pp
        self.stage = rank // tp
        self.first = self.stage == 0
        self.last = self.stage == pp - 1
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.device = model.device
        self.dtype = model.dtype

    @torch.inference_mode()
    def run(self, chunks: list[Chunk]) -> Tensor | None:
        """This rank's part of the step; the selected logits on global rank 0 (None elsewhere)."""
        pending = []  # isend handles and the tensors they send (kept alive until sent)
        outputs = []
        for group in micro_batches(chunks, self.pp):
            step = pack_step(group, self.cache.block_size, self.device)
            if self.first:
                x = step.tokens
            else:
                x = torch.empty(1, step.tokens.shape[1], self.hidden_size, dtype=self.dtype, device=self.device)
                dist.recv(x, src=self.rank - self.tp)
            self.cache.plan = step.plan
            try:
                y = self.model(x, positions=step.positions, cache=self.cache, select=step.select)
            finally:
                self.cache.plan = None
            if self.last:
                outputs.append(y)
            else:
                y = y.contiguous()
                pending.append((dist.isend(y, dst=self.rank + self.tp), y))
        for handle, _ in pending:
            handle.wait()
        if not self.last:
            return self._logits_from_last_stage(chunks) if self.rank == 0 else None
        logits = torch.cat(outputs) if outputs else torch.empty(0, self.vocab_size, dtype=self.dtype)
        if self.rank == 0:
            return logits
        if self.rank % self.tp == 0 and logits.shape[0]:  # the last stage's first rank hands them to the sampler
            dist.send(logits.contiguous(), dst=0)
        return None

    def _logits_from_last_stage(self, chunks: list[Chunk]) -> Tensor:
        rows = sum(len(r) for r in selected_rows(chunks))
        logits = torch.empty(rows, self.vocab_size, dtype=self.dtype, device=self.device)
        if rows:  # a step of prefill chunks only samples nothing: nothing is sent
            dist.recv(logits, src=(self.pp - 1) * self.tp)
        return logits
